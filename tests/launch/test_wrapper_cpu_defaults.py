"""The checkout wrapper on a machine without a GPU, with none of the CPU flags: the launch path
adds run_pretrain.sh's CPU-compatible Megatron settings itself and says so in one line
(loco_megatron/training/cpu_defaults.py), and an explicit ``--distributed-backend nccl`` ends
in one line naming it, not in a traceback per rank.

The command of the docs (docs/megatron_lm.md), a tiny model's sizes added:
``python -m torch.distributed.run --nproc-per-node 2 -m loco_megatron.training.run_megatron_lm
--megatron-lm CLONE --mock-data --tokenizer-type NullTokenizer --vocab-size 4096
--use-distributed-optimizer --loco-bits 4``, on (a) a "checkout" holding only a
``pretrain_gpt.py`` (the installed megatron-core 0.19, as CI runs it) and (b) a real
Megatron-LM core_v0.19.0 checkout (``$MEGATRON_LM``, or the tag from
``$LOCO_MEGATRON_LM_MIRROR``; skipped without either).
"""

import os

from loco_megatron.training.cpu_defaults import CPU_DEFAULTS

from tests.helpers.megatron_lm_checkouts import TINY_GPT, real_checkout, torchrun
from tests.launch.test_megatron_lm_wrapper import (NEW_STYLE, WRAPPER, _assert_trained,
                                                  _synthetic_checkout)

#: the tiny model's sizes and schedule: TINY_GPT without its data and tokenizer flags
SIZES = TINY_GPT[:TINY_GPT.index("--mock-data")]
COMMAND = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096",
           "--use-distributed-optimizer", "--loco-bits", "4"]
ADDED = ("> LoCo: no GPU, so Megatron runs on CPU ranks; added the CPU-compatible settings "
         "you did not set: --distributed-backend gloo --transformer-impl local")


def _assert_no_cpu_flag_given():
    flags = {flag for flag, _ in CPU_DEFAULTS}
    assert not flags & set(SIZES + COMMAND)


def _run(checkout, *extra, preloaded=True):
    """``preloaded=False`` for a real checkout: the ranks import its own megatron package."""
    _assert_no_cpu_flag_given()
    return torchrun(WRAPPER, ["--megatron-lm", str(checkout), *COMMAND, *SIZES, *extra],
                    preloaded=preloaded)


def test_wrapper_trains_on_cpu_without_cpu_flags(tmp_path):
    rc, out = _run(_synthetic_checkout(tmp_path, NEW_STYLE), "--user-flag", "1")
    assert rc == 0, out[-6000:]
    assert out.count(ADDED) == 1, out[-6000:]  # one line, rank 0
    _assert_trained(out)


def test_explicit_nccl_without_gpus_is_one_line(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("raise SystemExit('not reached')\n")
    rc, out = _run(tmp_path, "--distributed-backend", "nccl")
    assert rc != 0
    assert "error: --distributed-backend nccl needs GPUs and this machine has none" in out, out
    assert "Traceback" not in out.split("error: --distributed-backend")[0]
    assert "ProcessGroupNCCL" not in out and "not reached" not in out


def test_real_checkout_trains_on_cpu_without_cpu_flags(tmp_path_factory):
    which = "MEGATRON_LM" if os.environ.get("MEGATRON_LM") else "core_v0.19.0"
    checkout = real_checkout(which, tmp_path_factory)
    rc, out = _run(checkout, preloaded=False)
    assert rc == 0, out[-6000:]
    assert out.count(ADDED) == 1, out[-6000:]
    assert f"from {checkout}/megatron/core" in out
    _assert_trained(out)
