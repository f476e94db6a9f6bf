"""The weight-difference all-gather of one bucket (``--loco-param-bits``,
loco_megatron/weight_difference.py ``all_gather_differences``) launches as many collectives,
kernels and torch ops at DP 2, 4 and 8: two ``all_gather_into_tensor`` into ``[world, chunk]``
buffers and one fused apply over the bucket's flat block table, not a list all-gather with a
copy and an apply per rank. gloo ranks on the CPU (the C kernels, as under the CPU emulation of
CUDA); the replicas end bit-identical and equal to the shard-by-shard reference."""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.multiproc import run_ranks

NUMEL, BLOCK, CUTS = 8 * 300, 64, (123, 1000, 1555, 2001)


class _Ops(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _worker(rank, world):
    from loco_megatron import weight_difference as wd
    from loco_megatron.kernels import cpu
    from loco_megatron.layout import BucketLayout

    layout = BucketLayout.build(NUMEL, world, BLOCK, CUTS).full()
    gen = torch.Generator().manual_seed(3)
    held = (torch.randn(NUMEL, generator=gen) * 0.02).to(torch.bfloat16)
    new = held.float() + torch.randn(NUMEL, generator=gen) * 1e-3
    part = slice(rank * layout.shard, (rank + 1) * layout.shard)
    payload, scales = wd.encode("cpu", new[part], held[part], layout, rank, 4)
    lib, _ = cpu._load()
    calls = Counter()
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_gather_into_tensor")}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    decompress = lib.loco_decompress
    lib.loco_decompress = counting("loco_decompress", decompress)
    params = held.clone()
    try:
        with _Ops() as mode:
            wd.all_gather_differences(params, payload, scales, layout, None, False, impl="cpu",
                                      bits=4)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        lib.loco_decompress = decompress
    ref = held.clone()  # every shard applied on its own, as the reference does
    for r in range(world):
        p, s = wd.encode("torch", new[r * layout.shard:(r + 1) * layout.shard],
                         held[r * layout.shard:(r + 1) * layout.shard], layout, r, 4)
        wd.apply("torch", ref[r * layout.shard:(r + 1) * layout.shard], p, s, layout, r, 4)
    return dict(calls), dict(mode.ops), torch.equal(params, ref), params


def test_param_gather_launches_do_not_grow_with_dp():
    """Per bucket at DP 2, 4 and 8: the same collectives (2), C kernel calls (1) and torch ops
    (by name and count); every replica bit-identical and equal to the reference. About 25 s
    (14 gloo processes on 2 cores)."""
    seen = {}
    for world in (2, 4, 8):
        results = run_ranks(_worker, world)
        calls, ops, exact, params = results[0]
        assert all(r[2] for r in results), world
        assert all(torch.equal(r[3], params) for r in results), world
        seen[world] = (calls, ops)
    assert seen[2] == seen[4] == seen[8], seen
    calls = seen[2][0]
    assert calls == {"all_gather_into_tensor": 2, "loco_decompress": 1}, calls
