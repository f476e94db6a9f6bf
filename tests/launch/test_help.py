"""``--help`` of the main job and of the checkout wrapper: one line of help per ``--loco-*`` flag
(from the settings registry), in Megatron's own help (which megatron-core 0.19 cannot print
without the workaround for its bare ``%``)."""

import os
import subprocess
import sys
import textwrap

import pytest

from loco_megatron.config import SETTINGS

from ..helpers.markers import requires_megatron_training
from ..helpers.preloaded import launch_env

pytestmark = requires_megatron_training

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: a checkout holding only its pretrain_gpt.py, which parses Megatron's arguments (the
#: installed megatron-core's megatron.training runs)
SCRIPT = """
    from megatron.training.arguments import parse_and_validate_args

    if __name__ == "__main__":
        parse_and_validate_args()
"""


def _help(argv):
    env = {**launch_env(), "COLUMNS": "200", "RANK": "0"}
    proc = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _assert_one_line_per_flag(out):
    lines = out.splitlines()
    assert "LoCo low-bit gradient communication:" in lines
    for name, setting in SETTINGS.items():
        holding = [line for line in lines if setting.help in line]
        assert len(holding) == 1, (setting.flag, holding)
        assert "(default: " in holding[0] and holding[0].rstrip().endswith(")")
        flag_lines = [i for i, line in enumerate(lines) if line.lstrip().startswith(setting.flag)]
        assert len(flag_lines) == 1, setting.flag
        i = flag_lines[0]  # the help on the flag's line, or on the next when the flag is long
        assert setting.help in lines[i] or setting.help in lines[i + 1], setting.flag


def test_main_job_help_lists_every_loco_flag():
    _assert_one_line_per_flag(_help(["-m", "loco_megatron.training.pretrain_gpt"]))


def test_wrapper_help_lists_every_loco_flag(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text(textwrap.dedent(SCRIPT))
    _assert_one_line_per_flag(_help(["-m", "loco_megatron.training.run_megatron_lm",
                                     "--megatron-lm", str(tmp_path)]))
