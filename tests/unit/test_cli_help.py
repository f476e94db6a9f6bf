"""``loco-megatron --help`` (and each subcommand's) is plain text: no reStructuredText markup
such as double backquotes from a module docstring, and no unexpanded ``%`` formats."""

import argparse

import pytest

from loco_megatron.cli.command import parser


def _helps():
    top = parser()
    yield "loco-megatron", top.format_help()
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"loco-megatron {name}", sub.format_help()


HELPS = list(_helps())


@pytest.mark.parametrize("name,text", HELPS, ids=[name for name, _ in HELPS])
def test_help_is_plain_text(name, text):
    assert "``" not in text and ":func:" not in text and ":mod:" not in text, (name, text)
    assert "%(" not in text, (name, text)


def test_top_level_help_says_what_it_is():
    text = parser().format_help()
    assert text.startswith("usage: loco-megatron")
    assert "loco-megatron (also python -m loco_megatron): tools for LoCo" in text
