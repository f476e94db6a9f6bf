"""Building and loading the C kernels (loco_megatron/kernels/cpu.py) when things go wrong.

``--loco-kernels auto`` must fall back to the torch reference, never crash, whatever the cache
holds, and a failed build must not leave files behind (every rank of every run would add one).
"""

import shutil

import pytest
import torch

from loco_megatron import kernels
from loco_megatron.kernels import cpu


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A private, empty kernel cache and no memory of an earlier build in this process."""
    monkeypatch.setenv("LOCO_KERNEL_CACHE", str(tmp_path))
    cpu._load.cache_clear()
    monkeypatch.setattr(cpu.unavailable_reason, "_logged", False, raising=False)
    yield tmp_path
    cpu._load.cache_clear()  # later tests load the library from the default cache again


needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc)")


def test_unloadable_library_falls_back(fresh_build, monkeypatch):
    """A library that does not load (here a "compiler" that writes garbage; in practice a
    truncated file left in a shared cache, or a noexec cache directory): auto picks the torch
    reference, --loco-kernels cpu says why; neither raises OSError."""
    fake_cc = fresh_build / "fake-cc"
    fake_cc.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\n'
                       'echo "not an ELF file" > "$2"\n')
    fake_cc.chmod(0o755)
    cache = fresh_build / "cache"
    monkeypatch.setenv("LOCO_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("CC", str(fake_cc))
    assert kernels.select("auto", torch.zeros(4)) == "torch"
    with pytest.raises(ValueError, match="cannot load"):
        kernels.select("cpu", torch.zeros(4))
    assert len(list(cache.glob("*.so"))) == 1  # the file it could not load, named in the error


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false", ""])
def test_failed_build_leaves_no_files(fresh_build, monkeypatch, cc):
    monkeypatch.setenv("CC", cc)
    assert kernels.select("auto", torch.zeros(4)) == "torch"
    assert list(fresh_build.iterdir()) == []


@needs_cc
def test_cc_with_arguments(fresh_build, monkeypatch):
    """``CC="ccache gcc"``-style values: the compiler and its arguments, as make reads them."""
    monkeypatch.setenv("CC", f"{shutil.which('cc')} -DLOCO_UNUSED_MACRO=1")
    assert kernels.select("cpu", torch.zeros(4)) == "cpu"
    assert len(list(fresh_build.glob("*.so"))) == 1


def test_missing_c_source_auto_falls_back_in_one_line_and_cpu_refuses(fresh_build, monkeypatch,
                                                                       caplog):
    """An install without its package data (a wheel built without ``cpu_kernels.c``): ``auto``
    runs the torch reference and says once, in one line, which file and why; ``cpu`` refuses in
    one line naming the file (before: FileNotFoundError from the first compress)."""
    from loco_megatron.config import LoCoConfigError

    missing = fresh_build / "site" / "loco_megatron" / "kernels" / "cpu_kernels.c"
    monkeypatch.setattr(cpu, "SOURCE", missing)
    with caplog.at_level("WARNING", logger="loco_megatron"):
        assert kernels.select("auto", torch.zeros(4)) == "torch"
        assert kernels.select("auto", torch.zeros(4, dtype=torch.bfloat16)) == "torch"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("LoCo: using the torch reference on CPU: the C kernel source "
                               f"{missing} cannot be read (No such file or directory)"), lines
    with pytest.raises(LoCoConfigError) as refused:
        kernels.select("cpu", torch.zeros(4))
    message = str(refused.value)
    assert message.startswith(f"--loco-kernels cpu: the C kernel source {missing} cannot be "
                              f"read") and "\n" not in message
    assert "reinstall" in message
    assert not any(fresh_build.rglob("*.so"))  # nothing built
