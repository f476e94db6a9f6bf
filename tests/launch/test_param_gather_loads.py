"""Loads that keep the weights with ``--loco-param-bits``, through Megatron's own training loop.

2 CPU ranks (``python -m loco_megatron.training.pretrain_gpt`` under torchrun, the tiny GPT on
mock data), every run with Megatron's ``--check-weight-hash-across-dp-replicas-interval 1``
(replicas bit-identical after every iteration):

* model-only loads (``--finetune``, ``--no-load-optim``) of a trained checkpoint continue from
  the loaded model with the flag as without it (fp32 and bf16). Megatron-LM refreshes the
  optimizer's main parameters after such a load only for fp16/bf16
  (``optimizer.reload_model_params()``); without LoCo's own refresh the fp32 main copy kept
  its initial values and the first weight difference pulled every replica back to them;
* mode switches: a checkpoint saved with the flag resumes without it (LoCo installed off or
  entirely unset), and a checkpoint saved without it resumes with it, replicas identical from
  the first iteration (``torch`` and ``torch_dist``).
"""

import re

import pytest

from tests.helpers.markers import requires_megatron_training
from tests.helpers.megatron_lm_checkouts import CPU_FLAGS, TINY_GPT, torchrun

pytestmark = requires_megatron_training
PRETRAIN = ["-m", "loco_megatron.training.pretrain_gpt"]
SAVED_AT = 8
#: the tiny GPT trained hard enough that its initial weights are far worse (lm loss ~0.4 higher)
BASE = [*CPU_FLAGS, *TINY_GPT, "--use-distributed-optimizer", "--lr", "5e-3", "--lr-decay-iters", "100",
        "--use-checkpoint-opt_param-scheduler",
        "--check-weight-hash-across-dp-replicas-interval", "1", "--seed", "1234"]
PARAM4 = ["--loco-param-bits", "4"]
DTYPES = {"fp32": [], "bf16": ["--bf16"]}
#: lm loss of a model-only load with the flag vs without: the weight differences' quantization
#: only (measured below 0.01); losing the loaded weights costs about 0.3 by the third iteration
LOSS_TOL = 0.03


def _run(*flags):
    rc, out = torchrun(PRETRAIN, [*BASE, *flags], timeout=600)
    assert rc == 0, _excerpt(out)
    assert "Parameter hashes not matching" not in out
    return out


def _excerpt(out: str) -> str:
    keys = ("Error", "error", "assert", "Traceback", "hash")
    hits = [line for line in out.splitlines() if any(k in line for k in keys)]
    return "\n".join(hits[:60]) + "\n--- end of output ---\n" + out[-4000:]


def _losses(out):
    return [float(x) for x in re.findall(r"iteration\s+\d+/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", out)]


def _save(tmp_path_factory, dtype, fmt, *flags):
    ckpt = tmp_path_factory.mktemp(f"{dtype}-{fmt}")
    _run(*DTYPES[dtype], "--ckpt-format", fmt, "--train-iters", str(SAVED_AT), "--save",
         str(ckpt), "--save-interval", str(SAVED_AT), *flags)
    return ckpt


@pytest.fixture(scope="module")
def stock_ckpts(tmp_path_factory):
    """A checkpoint saved without the flag, per dtype (fp32: torch_dist, bf16: torch)."""
    return {"fp32": _save(tmp_path_factory, "fp32", "torch_dist"),
            "bf16": _save(tmp_path_factory, "bf16", "torch")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_model_only_loads_continue_from_the_loaded_model(stock_ckpts, dtype):
    """``--finetune`` (iteration and schedule restart) and ``--no-load-optim`` (fresh Adam
    state) from the trained checkpoint: the losses with ``--loco-param-bits 4`` follow those
    of the same run without it within :data:`LOSS_TOL`, and the first loss equals the trained
    model's (the load itself is exact)."""
    ckpt = str(stock_ckpts[dtype])
    fmt = "torch_dist" if dtype == "fp32" else "torch"
    runs = {"finetune": ["--finetune", "--train-iters", "3"],
            "no-load-optim": ["--no-load-optim", "--train-iters", str(SAVED_AT + 3)]}
    for name, flags in runs.items():
        common = [*DTYPES[dtype], "--ckpt-format", fmt, "--load", ckpt, *flags]
        without, with_flag = _losses(_run(*common)), _losses(_run(*common, *PARAM4))
        assert len(without) == len(with_flag) == 3, (name, without, with_flag)
        assert with_flag[0] == pytest.approx(without[0], abs=1e-6), name
        worst = max(abs(a - b) for a, b in zip(with_flag, without))
        assert worst < LOSS_TOL, (name, without, with_flag)


@pytest.mark.parametrize("dtype,fmt", [("fp32", "torch_dist"), ("fp32", "torch"),
                                       ("bf16", "torch_dist")])
def test_saved_with_the_parameter_all_gather_resumes_without_it(tmp_path_factory, dtype, fmt):
    """Saved with ``--loco-param-bits 4``; resumed with LoCo on but the all-gather stock, and
    with LoCo entirely unset (the launch path installs it off because ``--load`` holds LoCo
    state): replicas identical at every iteration, one line saying what happened."""
    ckpt = str(_save(tmp_path_factory, dtype, fmt, "--loco-bits", "4", *PARAM4))
    resume = [*DTYPES[dtype], "--ckpt-format", fmt, "--load", ckpt,
              "--train-iters", str(SAVED_AT + 2)]
    out = _run(*resume, "--loco-bits", "4")
    assert len(_losses(out)) == 2
    assert "was saved with --loco-param-bits 4 and is resumed without it" in out
    out = _run(*resume)
    assert len(_losses(out)) == 2
    assert "holds LoCo state; LoCo is installed off (as --loco-bits 16) to load it" in out
    assert "was saved with --loco-param-bits 4 and is resumed without it" in out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_saved_without_the_parameter_all_gather_resumes_with_it(stock_ckpts, dtype):
    """The reverse switch: the first all-gather after the load is exact (stock bytes), then
    weight differences; replicas identical at every iteration, one line."""
    fmt = "torch_dist" if dtype == "fp32" else "torch"
    out = _run(*DTYPES[dtype], "--ckpt-format", fmt, "--load", str(stock_ckpts[dtype]),
               "--train-iters", str(SAVED_AT + 3), *PARAM4)
    assert len(_losses(out)) == 3
    assert "was saved without --loco-param-bits: the parameters are all-gathered exactly " \
           "once" in out
