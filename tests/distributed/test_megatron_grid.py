"""LoCo inside megatron-core GPTModel + DDP + DistributedOptimizer on TP x DP grids.

CPU ranks (gloo + CUDA emulation) by default; the same tests run on GPUs with NCCL where at
least ``world`` GPUs are present (``-m gpu``).
"""

import pytest
import torch

from tests.helpers.multiproc import run_ranks
from .worker_megatron import grid_worker

GRIDS = [pytest.param(1, 2, id="TP1xDP2"),
         pytest.param(2, 4, id="TP2xDP2")]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap_off", "overlap_on"])
@pytest.mark.parametrize("tp,world", GRIDS)
def test_grid(tp, world, overlap):
    check_grid(run_ranks(grid_worker, world, tp, overlap, "gloo", MODES), overlap)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True], ids=["overlap_off", "overlap_on"])
@pytest.mark.parametrize("tp,world", GRIDS)
def test_grid_nccl(tp, world, overlap):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, found {_gpus()}")
    check_grid(run_ranks(grid_worker, world, tp, overlap, "nccl", MODES, backend="nccl"), overlap)


MODES = ("stock", "bits16", "loco4")


def check_grid(results, overlap):
    """Assertions shared by the gloo and NCCL runs of one grid."""
    for rank, res in enumerate(results):
        stock, bits16, loco = res["stock"], res["bits16"], res["loco4"]
        # LoCo off (bits 16): bit-identical to stock megatron-core, losses and parameters.
        assert bits16["losses"] == stock["losses"]
        assert all(torch.equal(stock["params"][n], bits16["params"][n]) for n in stock["params"])
        # megatron-core uses one bucket without overlap, several with it
        assert (stock["num_bucket_groups"] > 1) == overlap
        # LoCo 4-bit: the custom path ran for every bucket of every step.
        c = loco["counters"]
        assert c["buckets"] >= stock["num_bucket_groups"]
        assert c["calls"] == c["compress"] == 20 * c["buckets"]
        assert 0 < c["bytes"] < 0.2 * c["stock_bytes"]  # fp32 grads: ~4.5/32 on the wire
        # reduced shards within the quantization bound of the exact reduction
        assert loco["shard_check"] <= 1.0, loco["shard_check"]
        # loss falls over 20 steps
        assert sum(loco["losses"][-3:]) / 3 < 0.7 * loco["losses"][0], loco["losses"]
        assert loco["losses"][-1] < stock["losses"][0]
        # tensor-parallel-replicated parameters stay identical across TP ranks
        assert loco["tp_drift"] == 0.0 and stock["tp_drift"] == 0.0
        # compressed training differs from stock (it really compressed) but stays close
        assert loco["losses"] != stock["losses"]
        assert abs(loco["losses"][-1] - stock["losses"][-1]) < 0.1 * stock["losses"][0]


def test_model_from_an_earlier_install_is_refused():
    from .worker_megatron import stale_model_worker

    for message, calls in run_ranks(stale_model_worker, 2):
        assert calls == 1  # the new model's one bucket went through LoCo
        assert message is not None and "before the current loco_megatron.install()" in message


def test_warmup_start_iter_runs_stock_first():
    """--loco-start-iter 3: the first 3 steps are megatron-core's own full-precision reduce
    (losses bit-identical to stock, nothing compressed), LoCo compresses every step after."""
    from .worker_megatron import warmup_worker

    start, steps = 3, 6
    for res in run_ranks(warmup_worker, 2, start, steps):
        stock, loco = res["stock"], res["loco4"]
        c = loco["counters"]
        assert loco["losses"][:start + 1] == stock["losses"][:start + 1]  # step 3's loss: stock grads
        assert loco["losses"][start + 1:] != stock["losses"][start + 1:]
        assert c["buckets"] > 1 and c["compress"] == (steps - start) * c["buckets"]
        assert c["steps"] == [steps]  # warm-up steps counted (resets stay on schedule)
