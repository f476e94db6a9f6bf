"""megatron-core's gradient buckets for one GPU, and their exact bytes and LoCo memory.

Bucketing follows ``DistributedOptimizer._compute_per_buffer_param_layout`` (megatron-core
0.19, ``param_and_grad_buffer.py``/``distrib_optimizer.py``; 0.13-0.16 build the same layout
inside ``_ParamAndGradBuffer``): parameters in reverse registration order (backward order), each
start padded to 64 elements, a bucket closed once it holds ``bucket_size`` elements (and around
a ``shared_embedding`` parameter), its end padded to ``lcm(DP, 128)``; dense and expert
parameters in separate buffers (the expert one padded for the expert-DP size). Default bucket
size ``max(4e7, 1e6 * DP)`` elements; one bucket per buffer without ``overlap_grad_reduce``.

Bytes and memory use LoCo's own formulas on LoCo's own block layout
(:class:`~loco_megatron.layout.BucketLayout`, cut at every parameter start and end as the
plugin cuts it): :func:`~loco_megatron.megatron.report.expected_bytes_per_step`,
:func:`~loco_megatron.megatron.report.hierarchical_bytes_per_step`,
:func:`~loco_megatron.accounting.error_state_bytes`.
"""

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..config import LoCoConfig
from ..layout import BucketLayout
from ..accounting import (error_state_bytes, expected_bytes_per_step,
                          hierarchical_bytes_per_step, stage_error_bytes)
from .cluster import GroupSpread
from .model import Param


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket of one GPU.

    Attributes:
        numel: elements, padded (divisible by the group size).
        ranges: bucket-local ``(start, end)`` of each parameter.
        expert: in the expert buffer (reduced over the expert-DP group).
        ready: fraction of its buffer's elements whose gradients exist once this bucket is
            complete (backward order), in (0, 1].
        group: the reduce-scatter group's spread over nodes.
    """

    numel: int
    ranges: Tuple[Tuple[int, int], ...]
    expert: bool
    ready: float
    group: GroupSpread

    def layout(self, block_size: int) -> BucketLayout:
        """LoCo's padded block layout of this bucket."""
        bounds = {i for r in self.ranges for i in r}
        return BucketLayout.build(self.numel, self.group.size, block_size, bounds)


def _pad(x: int, m: int) -> int:
    return -(-x // m) * m


def buffer_buckets(params: List[Param], dp: int, bucket_size: Optional[int],
                   pad_high_busbw: bool = False) -> List[Tuple[int, Tuple[Tuple[int, int], ...]]]:
    """megatron-core's buckets of one buffer: ``[(padded numel, param ranges)]`` in bucket
    order, from ``params`` in registration order (reversed here, as megatron does)."""
    divisor = math.lcm(dp, 128, 2 ** 16) if pad_high_busbw else math.lcm(dp, 128)
    out, ranges = [], []
    start = bucket_start = 0
    end = 0

    def close(end_index):
        bucket_end = _pad(end_index, divisor)
        out.append((bucket_end - bucket_start,
                    tuple((s - bucket_start, e - bucket_start) for s, e in ranges)))
        return bucket_end

    for p in reversed(params):
        start = _pad(start, 64)
        if p.shared_embedding and ranges:
            bucket_start = start = close(start)
            ranges = []
        end = start + p.numel
        ranges.append((start, end))
        if (bucket_size is not None and end - bucket_start >= bucket_size) or p.shared_embedding:
            bucket_start = start = close(end)
            ranges = []
        else:
            start = end
    if ranges:
        close(end)
    return out


def gpu_buckets(params: List[Param], dense: GroupSpread, expert: Optional[GroupSpread],
                bucket_size: Optional[int], pad_high_busbw: bool = False) -> List[Bucket]:
    """All buckets of one GPU (dense buffer, then expert buffer), with ready fractions."""
    out = []
    for is_expert, group in ((False, dense), (True, expert)):
        ps = [p for p in params if p.expert == is_expert]
        if not ps:
            continue
        raw = buffer_buckets(ps, group.size, bucket_size, pad_high_busbw)
        total, done = sum(n for n, _ in raw), 0
        for numel, ranges in raw:
            done += numel
            out.append(Bucket(numel, ranges, is_expert, done / total, group))
    return out


def default_bucket_size(dp: int) -> int:
    """megatron-core DDP's default ``bucket_size``: ``max(4e7, 1e6 * dp)`` elements."""
    return max(40_000_000, 1_000_000 * dp)


@dataclass(frozen=True)
class BucketBytes:
    """Bytes one rank sends for one bucket per optimizer step, and LoCo's per-bucket state.

    Attributes:
        stock: ring reduce-scatter in the grad buffer's dtype, ``(N-1) * shard * elem``.
        flat: flat LoCo all-to-all (codes + fp32 scales).
        intra, inter: hierarchical LoCo, intra-node and inter-node stage.
        error: LoCo error-buffer bytes of this bucket on this rank (int8 + scale per block).
        wire: encoded padded bucket, one way (payload + scales), flat LoCo.
        padded: elements of the padded layout (``N * padded_shard``).
    """

    stock: int
    flat: int
    intra: int
    inter: int
    error: int
    wire: int
    padded: int


def bucket_bytes(bucket: Bucket, grad_elem: int, bits: int, block_size: int,
                 hierarchical: bool = False, intra_bits: int = 16) -> BucketBytes:
    """Exact bytes of one bucket for LoCo at ``bits`` (flat, or hierarchical with
    ``intra_bits`` 16/8 on the bucket's node spread), through LoCo's own formulas."""
    cfg = LoCoConfig(bits=bits, block_size=block_size, hierarchical=hierarchical,
                     intra_node_bits=intra_bits if hierarchical else 16)
    lay = bucket.layout(block_size)
    flat, stock = expected_bytes_per_step(cfg, [(lay, grad_elem)])
    M, L = bucket.group.nodes, bucket.group.per_node
    if hierarchical:
        intra, inter = hierarchical_bytes_per_step(cfg, M, L, [(lay, grad_elem)])
        error = stage_error_bytes(cfg, M, L, lay)
    else:
        intra = inter = 0
        error = error_state_bytes(cfg, [lay])[0]
    padded = lay.world * lay.padded_shard
    return BucketBytes(stock, flat, intra, inter, error,
                       padded * bits // 8 + 4 * lay.nblocks, padded)
