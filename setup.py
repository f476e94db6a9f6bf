"""Kept for tools that still run ``setup.py`` (pip before 21.3 for editable installs); the
package's metadata is in pyproject.toml."""

from setuptools import setup

setup()
