"""Bucket block layout: blocks never straddle DP shards or parameters (loco_megatron.layout)."""

import pytest
import torch

from loco_megatron.kernels import block_table
from loco_megatron.layout import ALIGN, BucketLayout, ChunkView


@pytest.mark.parametrize("numel,world,block,bounds", [
    (12, 2, 4, ()), (9026, 2, 256, ()), (27075, 3, 32, (100, 5000, 9025, 20000)),
    (4096, 4, 64, (64, 1000, 1001, 3000)), (128, 1, 256, (5,)),
])
def test_round_trip_and_block_alignment(numel, world, block, bounds):
    lay = BucketLayout.build(numel, world, block, bounds)
    x = torch.arange(numel, dtype=torch.float64) + 1
    padded = lay.to_padded(x, torch.float64)
    assert padded.numel() == world * lay.padded_shard and lay.padded_shard % ALIGN == 0
    # every element lands once; padding is zero
    assert torch.equal(padded[padded != 0].sort().values, x)
    shard = numel // world
    cuts = {0, numel, *(r * shard for r in range(world)), *bounds}
    for r in range(world):
        out = torch.empty(shard, dtype=torch.float64)
        lay.from_padded_shard(padded[r * lay.padded_shard:(r + 1) * lay.padded_shard], r, out)
        assert torch.equal(out, x[r * shard:(r + 1) * shard])
        used = 0
        for src, dst, n in lay.segments[r]:
            assert dst - r * lay.padded_shard == used  # codes contiguous, even offsets
            used += n + n % 2  # an odd segment is followed by one zero code, nothing more
            assert not any(src < c < src + n for c in cuts)  # no cut inside a segment
        assert used <= lay.padded_shard
        blocks = lay.shard_blocks(r)  # each segment cut into blocks, its last one short
        assert len(blocks) == lay.blocks_per_shard
        assert sum(n for _, _, n in blocks) == shard
        expect = [-(-n // block) for _, _, n in lay.segments[r]]
        assert sum(1 for _, _, n in blocks if n) == sum(expect)
        assert all(0 <= n <= block and d % 2 == 0 for _, d, n in blocks)
    # the all-to-all splits: the largest shard's wire elements and blocks
    assert lay.padded_shard == max(sum(n + n % 2 for *_, n in segs) for segs in lay.segments)
    assert lay.blocks_per_shard == max(sum(-(-n // block) for *_, n in segs)
                                       for segs in lay.segments)


@pytest.mark.parametrize("block", [2, 6, 256, 65536])
def test_wire_bytes_are_codes_and_one_scale_per_block(block):
    """No padding to whole blocks: a block size far above the shard costs one scale per
    segment, not a block of zeros."""
    bounds = (7, 100, 101, 333, 1000)
    lay = BucketLayout.build(1200, 3, block, bounds)
    segs = [n for s in lay.segments for *_, n in s]
    assert lay.padded_shard <= 400 + len(segs)  # shard 400 + at most one alignment code each
    per_peer = lay.wire_bytes_per_peer(4)
    assert per_peer == lay.padded_shard // 2 + 4 * lay.blocks_per_shard
    assert lay.blocks_per_shard <= max(sum(-(-n // block) for *_, n in s) for s in lay.segments)
    assert 3 * per_peer <= 1200 // 2 + 4 * 3 * lay.blocks_per_shard + 3 * len(segs)


def test_block_table_matches_the_layout_blocks():
    lay = BucketLayout.build(27075, 3, 32, (100, 5000, 9025, 20000))
    t = block_table(lay, "cpu")
    assert t.nblocks == 3 * lay.blocks_per_shard
    assert int(t.spans.sum()) == t.padded_numel and bool((t.spans >= t.length).all())
    for r in range(3):
        rows = slice(r * lay.blocks_per_shard, (r + 1) * lay.blocks_per_shard)
        rel = [(int(s) - r * lay.shard, int(o) - r * lay.padded_shard, int(n))
               for s, o, n in zip(t.src[rows], t.off[rows], t.length[rows])]
        assert [b for b in rel if b[2]] == [b for b in lay.shard_blocks(r) if b[2]]


def test_chunk_views_of_several_shards():
    """A chunk of shards (the hierarchical stages): their blocks one after the other, each
    shard's trailing blocks kept, source offsets in wire order when asked."""
    lay = BucketLayout.build(600, 3, 16, (50, 251, 420))
    view = ChunkView(lay, ((2, 0), (2, 0)), wire_order=True)
    t = block_table(view, "cpu")
    K, P = lay.blocks_per_shard, lay.padded_shard
    assert t.nblocks == 4 * K and t.padded_numel == 4 * P and view.shard == 2 * P
    first = [(int(o), int(n)) for o, n in zip(t.off[:K], t.length[:K])]
    assert first == [(d, n) for _, d, n in lay.shard_blocks(2)]
    assert bool((t.src[t.length > 0] == t.off[t.length > 0]).all())  # wire order: src == off


def test_identity_when_aligned():
    lay = BucketLayout.build(1024, 2, 256, (256,))
    assert lay.is_identity and lay.padding_fraction() == 0
    assert BucketLayout.build(1024, 2, 256, (100,)).is_identity  # even cuts: no copy needed
    assert not BucketLayout.build(1024, 2, 256, (101,)).is_identity  # an odd segment


def test_indivisible_bucket_rejected():
    with pytest.raises(ValueError, match="does not split over 3"):
        BucketLayout.build(10, 3, 4)


def test_full_precision_lane_takes_the_exact_ranges():
    """--loco-full-precision-1d: the given ranges leave the blocks for a lane of their own,
    contiguous per shard and rounded up to the largest shard's; everything is covered once."""
    lay = BucketLayout.build(1200, 3, 64, (7, 100, 101, 333, 1000), exact=[(100, 101), (333, 420)])
    # shard 0 holds [100, 101) and [333, 400): 68 lane elements; shard 1 [400, 420): 20
    assert lay.exact_shard == 68 and not lay.is_identity
    assert [sum(n for *_, n in segs) for segs in lay.exact_segments] == [68, 20, 0]
    x = torch.arange(1200, dtype=torch.float64) + 1
    wire, lane = lay.to_padded(x, torch.float64), lay.to_lane(x)
    assert torch.equal(torch.cat((wire[wire != 0], lane[lane != 0])).sort().values, x)
    for r in range(3):
        out = torch.zeros(400, dtype=torch.float64)
        lay.from_padded_shard(wire[r * lay.padded_shard:(r + 1) * lay.padded_shard], r, out)
        lay.from_lane_shard(lane[r * 68:(r + 1) * 68], r, out)
        assert torch.equal(out, x[r * 400:(r + 1) * 400])
    full = lay.full()  # the parameter all-gather's layout: every segment in blocks
    assert full.exact_shard == 0 and full == BucketLayout.build(1200, 3, 64,
                                                                (7, 100, 101, 333, 420, 1000))


def test_full_precision_lane_bytes():
    from loco_megatron.accounting import expected_bytes_per_step
    from loco_megatron.config import LoCoConfig

    lay = BucketLayout.build(1200, 3, 64, (7, 100, 101, 333, 1000), exact=[(100, 101), (333, 420)])
    loco, stock = expected_bytes_per_step(LoCoConfig(bits=4, block_size=64), [(lay, 4)])
    # per peer: codes of P wire elements at 4 bits, K scales, 68 fp32 lane elements
    assert loco == 2 * (lay.padded_shard // 2 + 4 * lay.blocks_per_shard + 4 * 68)
    assert stock == 2 * 400 * 4
