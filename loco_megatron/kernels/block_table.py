"""Per-block gather/scatter table of a bucket's wire layout, for the fused kernels.

A :class:`~loco_megatron.layout.BucketLayout` (or a :class:`~loco_megatron.layout.ChunkView`
of its shards) cuts the bucket into blocks that each lie inside one segment: block ``b`` holds
the source elements ``src[b] .. src[b] + length[b] - 1``, and its codes (and its error, which is
stored in the same wire layout) sit at wire offsets ``off[b] .. off[b] + length[b] - 1``
(``off[b]`` even; ``length`` may be short at a segment's end, 0 for a chunk's trailing blocks).
The kernels read the bucket through this table instead of copying it into the wire layout first.
"""

from dataclasses import dataclass
from typing import Union

import torch

from ..caches import host_tensor, per_model
from ..layout import BucketLayout, ChunkView

View = Union[BucketLayout, ChunkView]


@dataclass(frozen=True, eq=False)
class BlockTable:
    """Where each wire block of a bucket comes from and goes.

    Attributes:
        layout: the :class:`ChunkView` it describes (``layout.base``: the bucket's layout).
        src: int64 ``[nblocks]``: source offset of each block's first element.
        off: int64 ``[nblocks]``: wire offset of each block's first element (even).
        length: int32 ``[nblocks]``: valid elements of each block (0 .. block_size).
        spans: int64 ``[nblocks]`` on the CPU: wire elements from each block's offset to the
            next block's (its codes, alignment and trailing padding; they sum to
            ``padded_numel``): how per-block scales expand to elements.
        dense: the bits (of 4 and 8) at which the kernels write every byte of the payload:
            4 when each block's span is its length rounded up to even (a 4-bit byte holds a
            pair; an odd block's last high nibble is written as a zero code), 8 when each
            span is its length. Elsewhere (alignment gaps, a shorter shard's padding) the
            payload is allocated zero-filled.
    """

    layout: ChunkView
    src: torch.Tensor
    off: torch.Tensor
    length: torch.Tensor
    spans: torch.Tensor
    dense: frozenset = frozenset()

    def payload_alloc(self, bits: int):
        """``torch.empty`` when the kernels write every payload byte at ``bits``
        (:attr:`dense`), else ``torch.zeros`` (the uncovered wire elements are zero codes)."""
        return torch.empty if bits in self.dense else torch.zeros

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def nblocks(self) -> int:
        return self.src.numel()

    @property
    def numel(self) -> int:
        """Source elements (the compress kernels' input length)."""
        return self.layout.numel

    @property
    def padded_numel(self) -> int:
        """Elements of the wire layout (``world * padded_shard``)."""
        return self.layout.world * self.layout.padded_shard

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def shard(self) -> int:
        """Source elements per chunk."""
        return self.layout.shard

    @property
    def padded_shard(self) -> int:
        """Wire elements per chunk."""
        return self.layout.padded_shard

    @property
    def blocks_per_shard(self) -> int:
        return self.layout.blocks_per_shard


def as_view(layout: View) -> ChunkView:
    """A :class:`ChunkView` (a layout becomes its flat view)."""
    return ChunkView.flat(layout) if isinstance(layout, BucketLayout) else layout


def _build(view: ChunkView) -> BlockTable:
    blocks = view.blocks()
    t = torch.tensor(blocks, dtype=torch.int64).view(-1, 3)
    src, off, length = t[:, 0].contiguous(), t[:, 1].contiguous(), t[:, 2].to(torch.int32)
    ends = torch.cat((off[1:], torch.tensor([view.world * view.padded_shard])))
    spans, n = ends - off, t[:, 2]
    dense = frozenset(bits for bits, covered in ((4, n + n % 2), (8, n))
                      if torch.equal(spans, covered))
    return BlockTable(view, src, off, length, host_tensor(spans), dense)


@per_model
def _cached(view: ChunkView, device: str) -> BlockTable:
    """Built once per view and device (loco_megatron/caches.py: every table a step uses stays
    cached, so a step makes no host-to-device copy); a device table's CPU build is not kept."""
    t = _build(view)
    if device == "cpu":
        return t
    return BlockTable(view, t.src.to(device), t.off.to(device), t.length.to(device), t.spans,
                      t.dense)


def block_table(layout: View, device) -> BlockTable:
    """The (cached) :class:`BlockTable` of ``layout`` (a :class:`BucketLayout` or a
    :class:`ChunkView`) with its tensors on ``device`` (``spans`` stays on the CPU)."""
    return _cached(as_view(layout), str(torch.device(device)))
