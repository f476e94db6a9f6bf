"""CPU-compatible Megatron settings in the launch paths (loco_megatron/training/cpu_defaults.py).

Without a GPU the wrapper, the patched pretrain_gpt.py and the main job's entry module add
run_pretrain.sh's CPU flags that the user did not set, say so in one line, and refuse an
explicit ``--distributed-backend nccl`` in one line; with a GPU nothing changes."""

import re
import sys
from pathlib import Path

import pytest

from loco_megatron import emulation
from loco_megatron.config import LoCoConfigError
from loco_megatron.training import startup, workarounds
from loco_megatron.training.cpu_defaults import (CPU_DEFAULTS, add_cpu_defaults,
                                                 check_cpu_backend)

from tests.helpers.megatron_lm_checkouts import CPU_FLAGS

ROOT = Path(__file__).resolve().parents[2]
ALL = [x for flag, value in CPU_DEFAULTS for x in ([flag] if value is None else [flag, value])]
USER = ["--train-iters", "4", "--use-distributed-optimizer", "--loco-bits", "4"]


def test_the_defaults_are_run_pretrain_sh_s_cpu_flags():
    text = (ROOT / "run_pretrain.sh").read_text()
    block = re.search(r"else\n.*?hw_args=\((.*?)\)", text, re.S).group(1)
    assert block.split() == ALL
    assert set(CPU_FLAGS) <= set(ALL)  # what the launch tests passed by hand


def test_every_default_added_before_the_user_flags():
    argv, added = add_cpu_defaults(USER)
    assert added == ALL and argv == ALL + USER


def test_what_the_user_set_stays_theirs():
    user = ["--transformer-impl", "transformer_engine", "--distributed-backend=gloo",
            "--no-rope-fusion", *USER]
    argv, added = add_cpu_defaults(user)
    assert "--transformer-impl" not in added and "--distributed-backend" not in added
    assert "--no-rope-fusion" not in added and "--use-cpu-initialization" in added
    assert argv == added + user and argv.count("--transformer-impl") == 1


def test_nothing_added_with_megatron_yaml_cfg():
    assert add_cpu_defaults(["--yaml-cfg", "x.yaml"]) == (["--yaml-cfg", "x.yaml"], [])


@pytest.mark.parametrize("argv", [["--distributed-backend", "nccl"],
                                  ["--distributed-backend=nccl"],
                                  ["--distributed-backend", "gloo", "--distributed-backend",
                                   "nccl"]])
def test_nccl_refused_in_one_line(argv):
    with pytest.raises(LoCoConfigError) as refused:
        check_cpu_backend(argv)
    message = str(refused.value)
    assert message.startswith("--distributed-backend nccl needs GPUs and this machine has none")
    assert "\n" not in message and "--distributed-backend gloo" in message


def test_gloo_or_unset_passes():
    check_cpu_backend(["--distributed-backend", "gloo"])
    check_cpu_backend(USER)


@pytest.fixture
def launch(monkeypatch):
    """prepare() as a launch path calls it, with the GPU check replaced by ``gpu``."""
    monkeypatch.setattr(workarounds, "apply_needed", lambda emulated: [])
    monkeypatch.setenv("RANK", "0")

    def run(argv, gpu=False):
        monkeypatch.setattr(emulation, "activate_if_no_gpu", lambda: not gpu)
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
        return startup.prepare()

    return run


def test_launch_path_on_cpu_adds_the_flags_and_says_so(launch, capsys):
    assert launch(["--no-persist-layer-norm", *USER]) is True
    added = [a for a in ALL if a != "--no-persist-layer-norm"]
    assert sys.argv[1:] == added + ["--no-persist-layer-norm", *USER]
    lines = [line for line in capsys.readouterr().out.splitlines() if "CPU-compatible" in line]
    assert lines == ["> LoCo: no GPU, so Megatron runs on CPU ranks; added the CPU-compatible "
                     f"settings you did not set: {' '.join(added)}"]


def test_launch_path_on_cpu_with_every_flag_set_says_nothing(launch, capsys):
    launch([*ALL, *USER])
    assert sys.argv[1:] == ALL + USER
    assert "CPU-compatible" not in capsys.readouterr().out


def test_launch_path_with_a_gpu_is_untouched(launch, capsys):
    assert launch(["--distributed-backend", "nccl", *USER], gpu=True) is False
    assert sys.argv[1:] == ["--distributed-backend", "nccl", *USER]


def test_launch_path_on_cpu_refuses_nccl_in_one_line(launch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch(["--distributed-backend", "nccl", *USER])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --distributed-backend nccl needs GPUs")


def test_explicit_argv_is_only_checked(monkeypatch):
    monkeypatch.setattr(workarounds, "apply_needed", lambda emulated: [])
    monkeypatch.setattr(emulation, "activate_if_no_gpu", lambda: True)
    monkeypatch.setattr(sys, "argv", ["x.py", "--lr", "1"])
    startup.prepare(USER)
    assert sys.argv == ["x.py", "--lr", "1"]
