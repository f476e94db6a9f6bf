"""A run shorter than its learning-rate warm-up is refused in one line before ranks start
(Megatron asserts it only once every rank is up, as a bare AssertionError)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loco_megatron.cli.schedule import ScheduleError, check_lr_schedule

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv,message", [
    (["--train-iters", "300", "--lr-warmup-iters", "20", "--train-iters", "10"],
     "--lr-warmup-iters 20 must be below --train-iters 10 (the default --lr-decay-iters)"),
    (["--train-iters", "300", "--lr-warmup-iters", "20", "--lr-decay-iters", "20"],
     "--lr-warmup-iters 20 must be below --lr-decay-iters 20"),
])
def test_warmup_not_below_decay_is_refused(argv, message):
    with pytest.raises(ScheduleError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_lr_schedule(argv)


@pytest.mark.parametrize("argv", [
    ["--train-iters", "300", "--lr-warmup-iters", "20"],
    ["--train-iters", "10", "--lr-warmup-iters", "20", "--lr-decay-iters", "50"],
    ["--train-iters", "10", "--lr-warmup-fraction", "0.1"],  # Megatron's own rule
    ["--train-iters", "10"], ["--lr-warmup-iters", "x"],  # malformed: Megatron's parser says so
])
def test_valid_or_not_ours_passes(argv):
    check_lr_schedule(argv)


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_run_pretrain_refuses_a_short_run_before_launching(tmp_path):
    env = dict(os.environ, LOCO_DRY_RUN="1", OUT_DIR=str(tmp_path))
    proc = subprocess.run(["bash", str(ROOT / "run_pretrain.sh"), "--mock-data",
                           "--train-iters", "10"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().endswith("--lr-warmup-iters 1 as well."), proc.stderr
    assert "node 0:" not in proc.stdout  # never reached the launch
