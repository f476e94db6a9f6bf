"""Per-block gather/scatter table of a bucket's padded wire layout, for the fused kernels.

A :class:`~loco_megatron.layout.BucketLayout` pads every segment (cut at DP-shard and parameter
boundaries) to whole blocks, so each wire block lies inside one segment: block ``b`` holds the
bucket elements ``src[b] .. src[b] + length[b] - 1`` followed by ``block_size - length[b]``
zeros (``length`` 0 for a shard's trailing padding blocks). The kernels read the bucket through
this table instead of copying it into the padded layout first.
"""

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..layout import BucketLayout


@dataclass(frozen=True, eq=False)
class BlockTable:
    """Where each wire block of a bucket comes from.

    Attributes:
        layout: the bucket's :class:`BucketLayout`.
        src: int64 ``[nblocks]``: bucket offset of each block's first element.
        length: int32 ``[nblocks]``: valid elements of each block (0 .. block_size).
    """

    layout: BucketLayout
    src: torch.Tensor
    length: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def nblocks(self) -> int:
        return self.src.numel()

    @property
    def numel(self) -> int:
        """Bucket elements (the kernels' input length)."""
        return self.layout.numel

    @property
    def padded_numel(self) -> int:
        """Elements of the padded wire layout (``nblocks * block_size``)."""
        return self.layout.world * self.layout.padded_shard

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def shard(self) -> int:
        return self.layout.shard

    @property
    def blocks_per_shard(self) -> int:
        return self.layout.padded_shard // self.layout.block_size


def _build(layout: BucketLayout) -> BlockTable:
    bs = layout.block_size
    nblocks = layout.world * layout.padded_shard // bs
    src = torch.zeros(nblocks, dtype=torch.int64)
    length = torch.zeros(nblocks, dtype=torch.int32)
    for segs in layout.segments:
        for s, d, n in segs:
            k = -(-n // bs)
            first = d // bs
            steps = torch.arange(k, dtype=torch.int64) * bs
            src[first:first + k] = s + steps
            length[first:first + k] = torch.clamp(n - steps, max=bs).to(torch.int32)
    return BlockTable(layout, src, length)


@lru_cache(maxsize=512)
def _cached(layout: BucketLayout, device: str) -> BlockTable:
    t = _build(layout)
    return BlockTable(layout, t.src.to(device), t.length.to(device))


def block_table(layout: BucketLayout, device) -> BlockTable:
    """The (cached) :class:`BlockTable` of ``layout`` with its tensors on ``device``."""
    return _cached(layout, str(torch.device(device)))
