"""The main job end to end: run_pretrain.sh -> default corpus -> torchrun -> megatron.training.

Short runs (a few iterations) of exactly what a user starts; the full 300-iteration run and its
losses are in the README.
"""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHORT = ["--train-iters", "4", "--lr-warmup-iters", "1", "--log-interval", "1",
         "--eval-interval", "4", "--eval-iters", "1", "--seq-length", "64",
         "--max-position-embeddings", "64", "--num-layers", "2", "--hidden-size", "64"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, *flags):
    env = dict(os.environ, MASTER_PORT=str(_free_port()), OUT_DIR=str(tmp_path / "run"))
    env.setdefault("LOCO_DATA_DIR", str(Path.home() / ".cache" / "loco_megatron" / "data"))
    proc = subprocess.run(["bash", str(ROOT / "run_pretrain.sh"), *SHORT, *flags], env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def _losses(out):
    return [float(x) for x in re.findall(r"iteration\s+\d+/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", out)]


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_run_pretrain_loco4_on_default_corpus(tmp_path):
    out = _run(tmp_path, "--save", str(tmp_path / "ckpt"), "--save-interval", "4")
    assert "> LoCo active: 4-bit compensated reduce-scatter" in out
    assert re.search(r"> LoCo: model chunk 0: \d+ buckets, \d+ gradient elements", out)
    assert len(_losses(out)) == 4  # Megatron's own iteration lines
    assert "validation loss at iteration 4" in out
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (tmp_path / "run" / "tensorboard").is_dir()


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_run_pretrain_bits16_is_stock(tmp_path):
    out = _run(tmp_path, "--loco-bits", "16")
    assert "> LoCo off (--loco-bits 16)" in out and "LoCo: model chunk" not in out
    assert len(_losses(out)) == 4


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_run_pretrain_tensor_parallel(tmp_path):
    """TP2 on 2 ranks (DP=1: nothing to compress, the stock path runs and says so)."""
    out = _run(tmp_path, "--tensor-model-parallel-size", "2")
    assert "data-parallel size 1, no gradient is communicated" in out
    assert len(_losses(out)) == 4


def test_bad_loco_flag_fails_at_startup_naming_it(tmp_path):
    env = dict(os.environ, MASTER_PORT=str(_free_port()), OUT_DIR=str(tmp_path / "run"))
    proc = subprocess.run(["bash", str(ROOT / "run_pretrain.sh"), *SHORT, "--loco-bits", "3",
                           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"],
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: --loco-bits 3 is not supported" in out
    assert "LoCoConfigError" not in out  # a one-line message, not our traceback
    assert "building GPT model" not in out  # before Megatron starts


def test_fsdp_refused_at_startup(tmp_path):
    env = dict(os.environ, MASTER_PORT=str(_free_port()), OUT_DIR=str(tmp_path / "run"))
    proc = subprocess.run(["bash", str(ROOT / "run_pretrain.sh"), *SHORT, "--use-megatron-fsdp",
                           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"],
                          env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: --loco-bits 4 cannot be used with --use-megatron-fsdp" in out
    assert "LoCo active" not in out


@pytest.mark.skipif(sys.platform != "linux", reason="bash launcher")
def test_resume_from_checkpoint_with_loco(tmp_path):
    """--save/--exit-interval then --load continues at the saved iteration (megatron-core's torch
    optimizer fallback needs loco_megatron.megatron.training_fixes for this on CPU). LoCo's error
    buffers restart from zero on resume until they are checkpointed (issue 3)."""
    ckpt = str(tmp_path / "ckpt")
    _run(tmp_path, "--train-iters", "6", "--save", ckpt, "--save-interval", "4",
         "--exit-interval", "4")
    out = _run(tmp_path, "--train-iters", "6", "--load", ckpt)
    assert re.search(r"successfully loaded checkpoint from .* at iteration 4", out)
    assert re.findall(r"iteration\s+(\d+)/\s*6 \|", out) == ["5", "6"]
    assert len(_losses(out)) == 2
