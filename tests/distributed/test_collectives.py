"""Compensated reduce-scatter on 2, 3 and 4 gloo ranks against exact references (docs/architecture.md)."""

import pytest
import torch
import torch.distributed as dist

from loco_megatron.collectives import WireStats, compensated_reduce_scatter
from loco_megatron.compensator import Compensator
from loco_megatron.config import LoCoConfig
from loco_megatron.quantization import quantize_blockwise

from tests.helpers.multiproc import run_ranks


def _local_grad(rank, numel, seed, dtype):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return (torch.randn(numel, generator=g) * (rank + 1)).to(dtype)


def _worker(rank, world, numel, bits, dtype, op_name, steps):
    op = getattr(dist.ReduceOp, op_name)
    block = 32
    comp = None if bits == 16 else Compensator(LoCoConfig(bits=bits, block_size=block, beta=0.8))
    comp_async = None if bits == 16 else Compensator(LoCoConfig(bits=bits, block_size=block, beta=0.8))
    stats = WireStats()
    out = []
    for step in range(steps):
        g = _local_grad(rank, numel, step, dtype)
        shard = numel // world
        ref = torch.empty(shard, dtype=dtype)
        dist.reduce_scatter_tensor(ref, g.clone(), op=dist.ReduceOp.SUM)
        if op == dist.ReduceOp.AVG:
            ref = ref / world
        # megatron-style: output is a view into the input bucket
        buf = g.clone()
        compensated_reduce_scatter(buf[rank * shard:(rank + 1) * shard], buf, op=op,
                                   compensator=comp, key=(0, 0, 0), stats=stats)
        buf2 = g.clone()
        h = compensated_reduce_scatter(buf2[rank * shard:(rank + 1) * shard], buf2, op=op,
                                       async_op=True, compensator=comp_async, key=(0, 0, 0))
        if comp is not None:
            h.wait()
            h.wait()  # idempotent
        elif h is not None:
            h.wait()
        out.append((ref, buf[rank * shard:(rank + 1) * shard].clone(),
                    buf2[rank * shard:(rank + 1) * shard].clone()))
    # every rank's full compensated input, to compute the exact bound on rank 0
    return out, stats


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bits16_equals_reduce_scatter_tensor_exactly(world):
    for ref, got, got_async in run_ranks(_worker, world, 96 * world, 16, torch.float32, "SUM", 2)[0][0]:
        assert torch.equal(ref, got) and torch.equal(ref, got_async)


@pytest.mark.parametrize("world,numel", [(2, 9026), (3, 9025 * 3), (4, 4 * 1000)])
@pytest.mark.parametrize("bits", [4, 8])
def test_low_bit_within_scale_bound_and_async_agrees(world, numel, bits):
    """Step 0 (no error yet): |result - exact| <= sum over ranks of scale_r/2 per element."""
    results = run_ranks(_worker, world, numel, bits, torch.float32, "SUM", 3)
    shard = numel // world
    # exact bound for step 0: each rank's quantization error is at most its block scale / 2
    grads = [_local_grad(r, numel, 0, torch.float32) for r in range(world)]
    for rank, (steps, stats) in enumerate(results):
        ref, got, got_async = steps[0]
        bound = torch.zeros(shard)
        for g in grads:
            part = g[rank * shard:(rank + 1) * shard]
            _, scales = quantize_blockwise(part, bits, 32)
            bound += (scales / 2).repeat_interleave(32)[:shard]
        err = (got - ref).abs()
        assert torch.all(err <= bound * (1 + 1e-4) + 1e-6), float((err - bound).max())
        assert err.max() > 0  # really quantized
        for _, got_s, got_a in steps:
            assert torch.equal(got_s, got_a)  # sync and async agree bit-for-bit
        # exact bytes per step, to each peer: the shard's codes (an odd shard gets one zero
        # code: even offsets) and one scale per 32 elements, the last block short
        codes, blocks = shard + shard % 2, -(-shard // 32)
        assert stats.bytes_sent == 3 * (world - 1) * (codes * bits // 8 + 4 * blocks)
        assert stats.stock_bytes == 3 * (world - 1) * shard * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_avg_op_and_output_dtype(dtype):
    results = run_ranks(_worker, 2, 2 * 640, 8, dtype, "AVG", 1)
    for steps, _ in results:
        ref, got, _ = steps[0]
        assert got.dtype == dtype
        tol = 0.05 if dtype == torch.bfloat16 else 0.03
        assert (got.double() - ref.double()).abs().max() < tol * ref.double().abs().max()


def _bad_op_worker(rank, world):
    comp = Compensator(LoCoConfig(bits=4))
    x = torch.ones(world * 4)
    try:
        compensated_reduce_scatter(x[:4], x, op=dist.ReduceOp.MAX, compensator=comp, key=0)
    except ValueError as e:
        return str(e)
    return None


def test_unsupported_op_rejected():
    assert all("SUM and AVG" in m for m in run_ranks(_bad_op_worker, 2))
