"""Start-up refusals of the launch paths (loco_megatron/training/startup.py), one line each.

``--async-save`` on CPU ranks: megatron's persistent checkpoint worker runs outside the CUDA
emulation and dies, leaving the ranks hanging in the save, so every launch path refuses it when
the emulation is on; with a GPU it passes untouched. A LoCoConfigError raised inside Megatron's
own calls (building DDP) ends the rank with one line too, not a traceback."""

import pytest

from loco_megatron import emulation
from loco_megatron.training import startup, workarounds

ARGV = ["--train-iters", "4", "--use-distributed-optimizer", "--save", "/tmp/ckpt", "--async-save",
        "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]


@pytest.mark.parametrize("loco", [[], ["--loco-bits", "4"]])
def test_async_save_refused_on_cpu_ranks_in_one_line(monkeypatch, capsys, loco):
    monkeypatch.setattr(emulation, "activate_if_no_gpu", lambda: True)
    monkeypatch.setattr(workarounds, "apply_needed", lambda emulated: [])
    with pytest.raises(SystemExit) as exit_info:
        startup.prepare(ARGV + loco)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --async-save needs a GPU"), err
    assert "drop --async-save" in err


def test_async_save_untouched_with_a_gpu(monkeypatch):
    monkeypatch.setattr(emulation, "activate_if_no_gpu", lambda: False)
    monkeypatch.setattr(workarounds, "apply_needed", lambda emulated: [])
    assert startup.prepare(ARGV + ["--loco-bits", "4"]) is False


def test_without_async_save_cpu_ranks_start(monkeypatch):
    monkeypatch.setattr(emulation, "activate_if_no_gpu", lambda: True)
    monkeypatch.setattr(workarounds, "apply_needed", lambda emulated: [])
    assert startup.prepare(ARGV[:5]) is True


def test_refusal_from_inside_megatron_is_one_line_without_traceback(tmp_path):
    """A LoCoConfigError raised inside Megatron's calls (the bucket-disagreement check runs
    while megatron-core builds DDP) ends the rank with one line and status 2 once the launch
    path's prepare() ran."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from loco_megatron.cli.console import install_excepthook\n"
            "from loco_megatron.config import LoCoConfigError\n"
            "install_excepthook(); install_excepthook()\n"
            "def build_ddp():\n"
            "    raise LoCoConfigError('LoCo: the ranks disagree: give every rank the same "
            "--ddp-bucket-size')\n"
            "build_ddp()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"RANK": "0", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == ("error: LoCo: the ranks disagree: give every rank the same "
                           "--ddp-bucket-size\n"), proc.stderr
    other = subprocess.run([sys.executable, "-c", code.replace("LoCoConfigError('", "ValueError('")],
                           capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"},
                           timeout=120)
    assert other.returncode == 1 and "Traceback" in other.stderr  # others: Python's own hook


def test_prepare_installs_the_one_line_hook(monkeypatch):
    import sys

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(emulation, "activate_if_no_gpu", lambda: False)
    monkeypatch.setattr(workarounds, "apply_needed", lambda emulated: [])
    startup.prepare(ARGV[:4])
    assert getattr(sys.excepthook, "loco_one_line", False)
