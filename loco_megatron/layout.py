"""Block layout of one gradient bucket: where each quantization block lies on the wire.

A bucket of ``numel`` elements is reduce-scattered over ``world`` ranks in equal shards. LoCo
quantizes blockwise, and two rules keep that exact and consistent:

* a block never straddles a DP shard boundary (each rank receives whole blocks);
* a block never straddles a parameter boundary. Otherwise a block's absmax scale would mix a
  tensor-parallel-replicated parameter (layernorm weight, bias: equal gradients on every TP rank)
  with a TP-sharded neighbour (different on every TP rank), the replicated parameter would be
  quantized differently on each TP rank, and its copies would drift apart.

So the bucket is cut into segments at shard and parameter boundaries, each segment is padded
with zeros to a whole number of blocks, and each shard's padded length is rounded up to the
largest one so that the all-to-all splits are equal. Parameter boundaries come from
the bucket-local ``(start, end)`` of each parameter (``compat.bucket_param_ranges``).
"""

from dataclasses import dataclass
from typing import Iterable, Tuple

import torch

from .quantization import padded_numel

Segment = Tuple[int, int, int]  # (source offset in bucket, offset in padded layout, length)


@dataclass(frozen=True)
class BucketLayout:
    """Segment table mapping a bucket ``[numel]`` to its padded wire layout
    ``[world * padded_shard]``.

    Attributes:
        numel: bucket elements (divisible by ``world``).
        world: DP group size.
        block_size: elements per quantization block.
        padded_shard: elements per rank in the padded layout (a multiple of ``block_size``).
        segments: per shard, a tuple of :data:`Segment` (offsets absolute in bucket / layout).
    """

    numel: int
    world: int
    block_size: int
    padded_shard: int
    segments: Tuple[Tuple[Segment, ...], ...]

    @classmethod
    def build(cls, numel: int, world: int, block_size: int,
              boundaries: Iterable[int] = ()) -> "BucketLayout":
        """Cut at shard boundaries and at the given bucket-local ``boundaries``.

        Raises:
            ValueError: ``numel`` not divisible by ``world``.
        """
        if numel % world:
            raise ValueError(f"bucket of {numel} elements does not split over {world} ranks")
        shard = numel // world
        cuts = sorted({0, numel, *(r * shard for r in range(world)),
                       *(b for b in boundaries if 0 < b < numel)})
        per_shard = [[] for _ in range(world)]
        for start, end in zip(cuts[:-1], cuts[1:]):
            if shard:
                per_shard[start // shard].append((start, end - start))
        padded_shard = max((sum(padded_numel(n, block_size) for _, n in segs) for segs in per_shard),
                           default=0)
        segments = []
        for r, segs in enumerate(per_shard):
            dst, table = r * padded_shard, []
            for src, n in segs:
                table.append((src, dst, n))
                dst += padded_numel(n, block_size)
            segments.append(tuple(table))
        return cls(numel, world, block_size, padded_shard, tuple(segments))

    @property
    def shard(self) -> int:
        """Elements per rank in the bucket (``numel / world``)."""
        return self.numel // self.world

    @property
    def is_identity(self) -> bool:
        """True when the padded layout is the bucket itself (no copy needed)."""
        return self.padded_shard == self.shard and all(
            src == dst for segs in self.segments for src, dst, _ in segs)

    def to_padded(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Bucket ``[numel]`` -> new padded tensor ``[world * padded_shard]`` in ``dtype``."""
        if self.is_identity:
            return x.to(dtype)
        out = torch.zeros(self.world * self.padded_shard, dtype=dtype, device=x.device)
        for segs in self.segments:
            for src, dst, n in segs:
                out[dst:dst + n] = x[src:src + n]
        return out

    def from_padded_shard(self, padded: torch.Tensor, rank: int, out: torch.Tensor) -> None:
        """Write rank ``rank``'s padded shard ``[padded_shard]`` into ``out`` ``[shard]``
        (cast to ``out.dtype``)."""
        if self.is_identity:
            out.copy_(padded)
            return
        base_src, base_dst = rank * self.shard, rank * self.padded_shard
        for src, dst, n in self.segments[rank]:
            out[src - base_src:src - base_src + n] = padded[dst - base_dst:dst - base_dst + n]

    def padding_fraction(self) -> float:
        """Extra elements on the wire from padding, as a fraction of ``numel``."""
        return (self.world * self.padded_shard - self.numel) / self.numel if self.numel else 0.0
