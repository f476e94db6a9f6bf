"""Block layout of one gradient bucket: where each quantization block lies on the wire.

A bucket of ``numel`` elements is reduce-scattered over ``world`` ranks in equal shards. LoCo
quantizes blockwise, and two rules keep that exact and consistent:

* a block never straddles a DP shard boundary (each rank receives whole blocks);
* a block never straddles a parameter boundary. Otherwise a block's absmax scale would mix a
  tensor-parallel-replicated parameter (layernorm weight, bias: equal gradients on every TP rank)
  with a TP-sharded neighbour (different on every TP rank), the replicated parameter would be
  quantized differently on each TP rank, and its copies would drift apart.

So the bucket is cut into segments at shard and parameter boundaries and each segment into
blocks of ``block_size`` elements, its **last block short** (the padding-free wire format:
no zeros are sent to fill blocks). On the wire the codes of a shard's segments follow each other
contiguously, each segment starting at an even element offset (:data:`ALIGN`: two 4-bit codes
share a byte, so a block never shares a byte with its neighbour and the fused kernels never
write the same byte from two blocks); an odd-length segment is followed by one zero code. Each
shard's wire length is rounded up to the largest one, and its block count likewise (zero-length
blocks with scale 0 at the end), so the all-to-all splits are equal. Per rank and bucket the wire
then holds ``bits * P / 8`` bytes of codes and ``4 * K`` bytes of scales per peer
(``P = padded_shard``, ``K = blocks_per_shard``): about ``bits * n / 8 + 4 * blocks`` for the
bucket, whatever the block size. Parameter boundaries come from the bucket-local
``(start, end)`` of each parameter (``compat.bucket_param_ranges``).

:class:`ChunkView` describes chunks made of shards of a layout (the hierarchical mode's stages
send several shards to one peer); the fused kernels read any of them through a
:class:`~loco_megatron.kernels.block_table.BlockTable`.
"""

from dataclasses import dataclass
from typing import Iterable, List, Tuple

import torch

from .caches import per_model

Segment = Tuple[int, int, int]  # (source offset in bucket, offset in wire layout, length)
Block = Tuple[int, int, int]  # (source offset, wire offset, valid elements 0..block_size)

#: wire offset alignment of every segment (and so of every block), in elements
ALIGN = 2


def aligned(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN` (the wire elements a segment of ``n`` takes)."""
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class BucketLayout:
    """Segment table mapping a bucket ``[numel]`` to its wire layout ``[world * padded_shard]``.

    Attributes:
        numel: bucket elements (divisible by ``world``).
        world: DP group size.
        block_size: elements per quantization block (a segment's last block may be shorter).
        padded_shard: wire elements per rank (even; the largest shard's segments, each rounded
            up to :data:`ALIGN`).
        segments: per shard, a tuple of :data:`Segment` (offsets absolute in bucket / wire).
        blocks_per_shard: blocks per rank on the wire (the largest shard's; scales per rank).
        exact_segments: per shard, the :data:`Segment` s sent at full precision instead
            (``--loco-full-precision-1d``: 1-D parameters), offsets absolute in the bucket and
            in the exact lane ``[world * exact_shard]`` (not compressed, no blocks).
        exact_shard: lane elements per rank (the largest shard's; 0 without exact segments).
    """

    numel: int
    world: int
    block_size: int
    padded_shard: int
    segments: Tuple[Tuple[Segment, ...], ...]
    blocks_per_shard: int
    exact_segments: Tuple[Tuple[Segment, ...], ...] = ()
    exact_shard: int = 0

    @classmethod
    def build(cls, numel: int, world: int, block_size: int,
              boundaries: Iterable[int] = (), exact: Iterable[Tuple[int, int]] = ()
              ) -> "BucketLayout":
        """Cut at shard boundaries and at the given bucket-local ``boundaries``; the parts of
        the bucket-local ``[start, end)`` ranges ``exact`` go to the full-precision lane.

        Raises:
            ValueError: ``numel`` not divisible by ``world``.
        """
        if numel % world:
            raise ValueError(f"bucket of {numel} elements does not split over {world} ranks")
        shard = numel // world
        exact = sorted((max(0, s), min(numel, e)) for s, e in exact if min(numel, e) > max(0, s))
        cuts = sorted({0, numel, *(r * shard for r in range(world)),
                       *(b for b in boundaries if 0 < b < numel),
                       *(b for se in exact for b in se if 0 < b < numel)})
        per_shard = [[] for _ in range(world)]
        lane = [[] for _ in range(world)]
        for start, end in zip(cuts[:-1], cuts[1:]):
            if shard:
                inside = any(s <= start and end <= e for s, e in exact)
                (lane if inside else per_shard)[start // shard].append((start, end - start))
        exact_shard = max((sum(n for _, n in segs) for segs in lane), default=0)
        exact_segments = []
        for r, segs in enumerate(lane):
            dst, table = r * exact_shard, []
            for src, n in segs:
                table.append((src, dst, n))
                dst += n
            exact_segments.append(tuple(table))
        padded_shard = max((sum(aligned(n) for _, n in segs) for segs in per_shard), default=0)
        nbs = max((sum(-(-n // block_size) for _, n in segs) for segs in per_shard), default=0)
        segments = []
        for r, segs in enumerate(per_shard):
            dst, table = r * padded_shard, []
            for src, n in segs:
                table.append((src, dst, n))
                dst += aligned(n)
            segments.append(tuple(table))
        if not exact_shard:
            return cls(numel, world, block_size, padded_shard, tuple(segments), nbs)
        return cls(numel, world, block_size, padded_shard, tuple(segments), nbs,
                   tuple(exact_segments), exact_shard)

    @property
    def shard(self) -> int:
        """Elements per rank in the bucket (``numel / world``)."""
        return self.numel // self.world

    @property
    def nblocks(self) -> int:
        """Blocks of the whole wire layout (``world * blocks_per_shard``: one scale each)."""
        return self.world * self.blocks_per_shard

    @property
    def is_identity(self) -> bool:
        """True when the wire layout is the bucket itself (no copy needed)."""
        return not self.exact_shard and self.padded_shard == self.shard and all(
            src == dst for segs in self.segments for src, dst, _ in segs)

    def shard_blocks(self, rank: int) -> Tuple[Block, ...]:
        """Shard ``rank``'s :data:`Block` s in wire order, offsets relative to the shard (source)
        and to its wire chunk; ``blocks_per_shard`` of them (zero-length ones at the end)."""
        return _shard_blocks(self, rank)

    def wire_bytes_per_peer(self, bits: int) -> int:
        """Bytes one rank sends each peer per bucket: ``bits * P / 8`` of codes, ``4 * K`` of
        scales."""
        return self.padded_shard * bits // 8 + 4 * self.blocks_per_shard

    def exact_bytes_per_peer(self, element_size: int) -> int:
        """Bytes of the full-precision lane one rank sends each peer per bucket."""
        return self.exact_shard * element_size

    def full(self) -> "BucketLayout":
        """This layout with no full-precision lane (every segment in blocks): the parameter
        all-gather's (``--loco-param-bits`` sends every parameter's weight difference)."""
        return _full(self) if self.exact_shard else self

    def to_lane(self, x: torch.Tensor) -> torch.Tensor:
        """Bucket ``[numel]`` -> new lane ``[world * exact_shard]`` of the exact segments, in
        ``x``'s dtype (zeros where a shorter shard ends)."""
        return _gather(self.exact_segments, self.world * self.exact_shard, x, x.dtype)

    def from_lane_shard(self, lane: torch.Tensor, rank: int, out: torch.Tensor) -> None:
        """Rank ``rank``'s lane shard ``[exact_shard]`` into its exact segments of ``out``
        ``[shard]`` (cast to ``out.dtype``)."""
        _scatter_shard(self.exact_segments[rank], rank * self.shard, rank * self.exact_shard,
                       lane, out)

    def to_padded(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Bucket ``[numel]`` -> new wire-layout tensor ``[world * padded_shard]`` in ``dtype``
        (zeros where no segment lies)."""
        if self.is_identity:
            return x.to(dtype)
        return _gather(self.segments, self.world * self.padded_shard, x, dtype)

    def from_padded_shard(self, padded: torch.Tensor, rank: int, out: torch.Tensor) -> None:
        """Write rank ``rank``'s wire shard ``[padded_shard]`` into ``out`` ``[shard]``
        (cast to ``out.dtype``)."""
        if self.is_identity:
            out.copy_(padded)
            return
        _scatter_shard(self.segments[rank], rank * self.shard, rank * self.padded_shard, padded,
                       out)

    def padding_fraction(self) -> float:
        """Extra code elements on the wire (alignment, equal shards), as a fraction of
        ``numel``."""
        return (self.world * self.padded_shard - self.numel) / self.numel if self.numel else 0.0


@per_model
def _indices(segs: Tuple[Segment, ...], base_src: int, base_dst: int,
             device: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """int64 ``(source, destination)`` element indices of ``segs`` (offsets less the bases),
    on ``device``: built once per segments and device (loco_megatron/caches.py), so a gather or
    scatter is a fixed number of launches whatever the number of segments (parameters)."""
    src = [torch.arange(s - base_src, s - base_src + n) for s, _, n in segs]
    dst = [torch.arange(d - base_dst, d - base_dst + n) for _, d, n in segs]
    if not segs:
        src = dst = [torch.zeros(0, dtype=torch.int64)]
    return torch.cat(src).to(device), torch.cat(dst).to(device)


def _gather(tables, size: int, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new ``[size]`` tensor in ``dtype`` holding ``x``'s segments at their destinations
    (zeros elsewhere); ``tables``: per shard, ``(source, destination, length)``. Four
    launches (zeros, index_select, cast, index_copy_), whatever the segments."""
    src, dst = _indices(tuple(s for segs in tables for s in segs), 0, 0, str(x.device))
    out = torch.zeros(size, dtype=dtype, device=x.device)
    return out.index_copy_(0, dst, x.index_select(0, src).to(dtype))


def _scatter_shard(segs, base_src: int, base_dst: int, values: torch.Tensor,
                   out: torch.Tensor) -> None:
    """One shard's segments of ``values`` (destination offsets from ``base_dst``) into ``out``
    (source offsets from ``base_src``), cast to ``out.dtype``: three launches (index_select,
    cast, index_copy_), whatever the segments."""
    src, dst = _indices(tuple(segs), base_src, base_dst, str(values.device))
    out.index_copy_(0, src, values.index_select(0, dst).to(out.dtype))


@per_model
def _full(layout: BucketLayout) -> BucketLayout:
    bounds = {x for part in (layout.segments, layout.exact_segments) for segs in part
              for s, _, n in segs for x in (s, s + n)}
    return BucketLayout.build(layout.numel, layout.world, layout.block_size, bounds)


@per_model
def _shard_blocks(layout: BucketLayout, rank: int) -> Tuple[Block, ...]:
    bs, base_src, base_dst = layout.block_size, rank * layout.shard, rank * layout.padded_shard
    out: List[Block] = []
    for src, dst, n in layout.segments[rank]:
        for k in range(0, n, bs):
            out.append((src - base_src + k, dst - base_dst + k, min(bs, n - k)))
    end = sum(aligned(n) for _, _, n in layout.segments[rank])
    out.extend((layout.shard, end, 0) for _ in range(layout.blocks_per_shard - len(out)))
    return tuple(out)


@dataclass(frozen=True)
class ChunkView:
    """``world`` chunks, each made of shards of a :class:`BucketLayout` (``chunks[c]``: the
    base shard indices chunk ``c`` holds, in order; every chunk holds as many). A chunk's wire
    form is its shards' wire forms one after the other (``len * P`` elements, ``len * K``
    blocks). Its source is the bucket (``wire_order`` False: shard ``i`` of a chunk reads
    ``shard`` elements) or data already in wire order (True: ``P`` elements, offsets equal).

    The flat collective's view is every shard once (:meth:`flat`); the hierarchical stages use
    several shards per chunk (loco_megatron/hierarchical.py).
    """

    base: BucketLayout
    chunks: Tuple[Tuple[int, ...], ...]
    wire_order: bool = False

    @classmethod
    def flat(cls, layout: BucketLayout) -> "ChunkView":
        """Chunk ``r`` = shard ``r``, read from the bucket: the layout itself."""
        return cls(layout, tuple((r,) for r in range(layout.world)))

    @property
    def world(self) -> int:
        return len(self.chunks)

    @property
    def per_chunk(self) -> int:
        """Base shards per chunk."""
        return len(self.chunks[0]) if self.chunks else 0

    @property
    def block_size(self) -> int:
        return self.base.block_size

    @property
    def padded_shard(self) -> int:
        """Wire elements per chunk."""
        return self.per_chunk * self.base.padded_shard

    @property
    def blocks_per_shard(self) -> int:
        """Blocks (scales) per chunk."""
        return self.per_chunk * self.base.blocks_per_shard

    @property
    def shard(self) -> int:
        """Source elements per chunk."""
        return self.per_chunk * (self.base.padded_shard if self.wire_order else self.base.shard)

    @property
    def numel(self) -> int:
        """Source elements of all chunks."""
        return self.world * self.shard

    def _pieces(self):
        """``(chunk, base shard, source offset, wire offset)`` of every base shard of every
        chunk, in order."""
        P = self.base.padded_shard
        unit = P if self.wire_order else self.base.shard
        for c, chunk in enumerate(self.chunks):
            for i, r in enumerate(chunk):
                yield c, r, c * self.shard + i * unit, (c * self.per_chunk + i) * P

    def _relative_segments(self, r: int):
        """Base shard ``r``'s segments relative to its source and wire starts (the source is
        the wire position in wire order)."""
        base = self.base
        for s, d, n in base.segments[r]:
            d -= r * base.padded_shard
            yield (d if self.wire_order else s - r * base.shard), d, n

    def segments(self) -> List[Segment]:
        """Every segment, chunk after chunk: ``(source offset, wire offset, length)``."""
        return [(src0 + s, dst0 + d, n) for _, r, src0, dst0 in self._pieces()
                for s, d, n in self._relative_segments(r)]

    def to_wire(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Source ``[numel]`` -> new wire tensor ``[world * padded_shard]`` in ``dtype`` (zeros
        where no segment lies)."""
        if self.chunks == tuple((r,) for r in range(self.base.world)) and not self.wire_order:
            return self.base.to_padded(x, dtype)
        out = torch.zeros(self.world * self.padded_shard, dtype=dtype, device=x.device)
        for src, dst, n in self.segments():
            out[dst:dst + n] = x[src:src + n]
        return out

    def from_wire_chunk(self, values: torch.Tensor, rank: int, out: torch.Tensor) -> None:
        """Chunk ``rank``'s wire values ``[padded_shard]`` into ``out`` ``[shard]`` (cast to
        ``out.dtype``)."""
        segs = [(src0 + s, dst0 + d, n) for c, r, src0, dst0 in self._pieces() if c == rank
                for s, d, n in self._relative_segments(r)]
        _scatter_shard(segs, rank * self.shard, rank * self.padded_shard, values, out)

    def blocks(self) -> List[Block]:
        """Every block, chunk after chunk: ``(source offset, wire offset, valid elements)``."""
        out, P = [], self.base.padded_shard
        for _, r, src0, dst0 in self._pieces():
            for s, d, n in self.base.shard_blocks(r):
                if self.wire_order:
                    s = d if n else P
                out.append((src0 + s, dst0 + d, n))
        return out
