"""The weight-difference all-gather's arithmetic (loco_megatron/weight_difference.py), on one
process: the bound on ``|main - held|``, that it does not accumulate, the wire format."""

import pytest
import torch

from loco_megatron import weight_difference as wd
from loco_megatron.accounting import param_gather_bytes_per_step
from loco_megatron.kernels import block_table
from loco_megatron.layout import BucketLayout

LAYOUT = BucketLayout.build(3 * 700, 3, 64, (123, 1000, 1555))


def _bound(new, held, scales, layout, rank):
    """Elementwise bound: half the block's step + half an ulp of held's dtype + two fp32
    roundings (of ``new - held`` and of ``held + deQ``)."""
    lay = wd.shard_layouts(layout)[rank]
    spans = block_table(lay, "cpu").spans
    half = (scales[:lay.blocks_per_shard] / 2).repeat_interleave(spans)
    step = torch.empty(lay.shard)
    lay.from_padded_shard(half, 0, step)
    h = held.float()
    return (step + torch.finfo(held.dtype).eps * h.abs() / 2
            + 2 * torch.finfo(torch.float32).eps * torch.maximum(new.abs(), h.abs()))


def _step(new, held, layout, bits):
    """Every rank's shard: encode and apply (as every replica does). Returns the scales."""
    scales = []
    for r in range(layout.world):
        part = slice(r * layout.shard, (r + 1) * layout.shard)
        payload, s = wd.encode("torch", new[part], held[part], layout, r, bits)
        wd.apply("torch", held[part], payload, s, layout, r, bits)
        scales.append(s)
    return scales


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_held_tracks_main_within_the_bound_and_does_not_accumulate(bits, dtype):
    """50 steps of random updates: after each, |main - held| <= half a quantization step of that step's
    difference + half an ulp; the residual stays at that size (error feedback through
    ``new - held``) while sending the quantized updates alone drifts away."""
    gen = torch.Generator().manual_seed(0)
    main = torch.randn(LAYOUT.numel, generator=gen) * 0.02
    held, naive = main.to(dtype), main.to(dtype)
    residuals, naive_gap = [], []
    for t in range(50):
        update = torch.randn(LAYOUT.numel, generator=gen) * 1e-4
        main = main + update
        scales = _step(main, held, LAYOUT, bits)
        for r in range(LAYOUT.world):
            part = slice(r * LAYOUT.shard, (r + 1) * LAYOUT.shard)
            gap = (main[part] - held[part].float()).abs()
            assert (gap <= _bound(main[part], held[part], scales[r], LAYOUT, r)).all(), (t, r)
        residuals.append(float((main - held.float()).abs().max()))
        # without feedback: each step's update quantized and added on its own
        base = naive.float()
        _step(base + update, naive, LAYOUT, bits)
        naive_gap.append(float((main - naive.float()).abs().max()))
    assert max(residuals[-10:]) <= 1.5 * max(residuals[:10])  # no accumulation
    if bits == 4 and dtype == torch.float32:
        assert naive_gap[-1] > 3 * residuals[-1]  # what the feedback is for


def test_tensor_parallel_replicated_blocks_do_not_mix_with_neighbours():
    """A parameter's blocks are cut at its boundaries: its codes do not depend on what the
    neighbouring parameter (different on each TP rank) holds."""
    held = torch.zeros(LAYOUT.numel)
    new_a, new_b = torch.zeros(LAYOUT.numel), torch.zeros(LAYOUT.numel)
    new_a[1000:1555] = new_b[1000:1555] = torch.linspace(-1e-3, 1e-3, 555)
    new_a[900:1000], new_b[900:1000] = 1.0, -5.0  # the neighbour differs
    out = []
    for new in (new_a, new_b):
        h = held.clone()
        _step(new, h, LAYOUT, 4)
        out.append(h[1000:1555])
    assert torch.equal(out[0], out[1])


def test_wire_format_and_byte_formula():
    for bits in (4, 8):
        nbytes, nscales = wd.chunk_shape(LAYOUT, bits)
        # shard 0: parameters of 123 and 577 elements (aligned 124 + 578 = 702 codes, 2 + 10
        # blocks of 64); shard 1: 300 + 400 (700, 5 + 7); shard 2: 155 + 545 (702, 3 + 9)
        assert (LAYOUT.padded_shard, LAYOUT.blocks_per_shard) == (702, 12)
        assert nbytes == 702 * bits // 8 and nscales == 12
        for r in range(LAYOUT.world):
            p, s = wd.encode("torch", torch.randn(LAYOUT.shard), torch.zeros(LAYOUT.shard),
                             LAYOUT, r, bits)
            assert (p.numel(), s.numel()) == (nbytes, nscales)
        loco, stock = param_gather_bytes_per_step(bits, [(LAYOUT, 2)])
        assert loco == 2 * (702 * bits // 8 + 4 * 12)
        assert stock == 2 * LAYOUT.shard * 2


def test_shard_layouts_keep_the_bucket_cuts():
    for r, lay in enumerate(wd.shard_layouts(LAYOUT)):
        base = r * LAYOUT.shard
        assert [(s - base, n) for s, _, n in LAYOUT.segments[r]] == [
            (s, n) for s, _, n in lay.segments[0]]
        assert lay.padded_shard <= LAYOUT.padded_shard


def test_nonfinite_main_reaches_held_as_stock_would():
    new = torch.zeros(LAYOUT.shard)
    new[5] = float("nan")
    held = torch.zeros(LAYOUT.shard)
    p, s = wd.encode("torch", new, held, LAYOUT, 0, 4)
    wd.apply("torch", held, p, s, LAYOUT, 0, 4)
    assert torch.isnan(held[5])


def test_drift_figures():
    stats = wd.ParamGatherStats()
    stats.add_drift(torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.tensor([1.0, -1.0, 1.0, -0.5]))
    assert stats.drift.tolist() == [0.5, 0.25, 4.0, 4.0]
