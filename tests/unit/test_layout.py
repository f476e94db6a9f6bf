"""Bucket block layout: blocks never straddle DP shards or parameters (loco_megatron.layout)."""

import pytest
import torch

from loco_megatron.layout import BucketLayout


@pytest.mark.parametrize("numel,world,block,bounds", [
    (12, 2, 4, ()), (9026, 2, 256, ()), (27075, 3, 32, (100, 5000, 9025, 20000)),
    (4096, 4, 64, (64, 1000, 1001, 3000)), (128, 1, 256, (5,)),
])
def test_round_trip_and_block_alignment(numel, world, block, bounds):
    lay = BucketLayout.build(numel, world, block, bounds)
    x = torch.arange(numel, dtype=torch.float64) + 1
    padded = lay.to_padded(x, torch.float64)
    assert padded.numel() == world * lay.padded_shard and lay.padded_shard % block == 0
    # every element lands once; padding is zero
    assert torch.equal(padded[padded != 0].sort().values, x)
    shard = numel // world
    cuts = {0, numel, *(r * shard for r in range(world)), *bounds}
    for r in range(world):
        out = torch.empty(shard, dtype=torch.float64)
        lay.from_padded_shard(padded[r * lay.padded_shard:(r + 1) * lay.padded_shard], r, out)
        assert torch.equal(out, x[r * shard:(r + 1) * shard])
        for src, dst, n in lay.segments[r]:
            assert (dst - r * lay.padded_shard) % block == 0  # segment starts a block
            assert not any(src < c < src + n for c in cuts)  # no cut inside a segment


def test_identity_when_aligned():
    lay = BucketLayout.build(1024, 2, 256, (256,))
    assert lay.is_identity and lay.padding_fraction() == 0
    assert not BucketLayout.build(1024, 2, 256, (100,)).is_identity


def test_indivisible_bucket_rejected():
    with pytest.raises(ValueError, match="does not split over 3"):
        BucketLayout.build(10, 3, 4)
