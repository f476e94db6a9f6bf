"""LoCo's state through Megatron-Bridge's own torch_dist save and load
(megatron/bridge/training/checkpointing.py), on 2 CPU ranks: a resume continues bit for bit,
and fails to without LoCo's entries (what makes this test able to fail)."""

import math

import pytest
import torch

from tests.helpers.multiproc import run_ranks
from .worker_bridge import run

TIMEOUT_S = 600
LOCO = {"bits": 4, "param-bits": 4}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """4 iterations with a checkpoint at iteration 2 (Bridge's save_interval)."""
    ckpt = str(tmp_path_factory.mktemp("bridge_ckpt"))
    res = run_ranks(run, 2, {"loco": LOCO, "iters": 4, "save": ckpt, "save_interval": 2},
                    timeout_s=TIMEOUT_S)
    return ckpt, res


def _resume(ckpt, **spec):
    return run_ranks(run, 2, {"loco": LOCO, "iters": 4, "load": ckpt, "ckpt_step": 2, **spec},
                     timeout_s=TIMEOUT_S)


def _identical(straight_res, resumed) -> bool:
    return all(s["losses"][2:] == r["losses"] and all(
        torch.equal(s["params"][n], r["params"][n]) for n in s["params"])
        for s, r in zip(straight_res, resumed))


def test_resume_through_bridge_is_bit_identical(straight):
    """Iterations 3-4 after Bridge loads the iteration-2 checkpoint: the same losses and final
    parameters as the straight run, bit for bit (error buffers, step counters and the
    weight-difference state restored; with LoCo's dummy optimizer states before the load)."""
    ckpt, res = straight
    resumed = _resume(ckpt)
    assert len(resumed[0]["losses"]) == 2
    assert _identical(res, resumed)


def test_resume_without_loco_state_differs(straight):
    """The same resume with the checkpoint's LoCo entries ignored (error buffers start from
    zero) does not continue the run: the check above can fail."""
    ckpt, res = straight
    assert not _identical(res, _resume(ckpt, drop_loco_state=True))


def test_dp_size_change_reshards_as_with_megatron_training(straight):
    """The 2-rank iteration-2 checkpoint resumed through Bridge on 4 ranks (micro batch 1, the
    same global batch): as with megatron.training (tests/distributed/test_checkpoint.py), each
    rank takes its shard of the DP-summed error, with its one warning, and training goes on."""
    ckpt, _ = straight
    resumed = run_ranks(run, 4, {"loco": LOCO, "iters": 4, "load": ckpt, "ckpt_step": 2,
                                 "mbs": 1}, timeout_s=TIMEOUT_S)
    logs = [line for r in resumed for line in r["logs"]]
    assert any("LoCo: DP size changed 2 -> 4" in line and "resharded from the DP-summed form"
               in line for line in logs), logs
    for r in resumed:
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"]), r["losses"]
    first = resumed[0]["params"]
    assert all(torch.equal(first[n], r["params"][n]) for r in resumed[1:] for n in first)
