"""The quantizer's grid (``--loco-grid``, loco_megatron/quantization.py): ``full-range`` (scale
``absmax / 2^(b-1)``, codes ``[-2^(b-1), 2^(b-1) - 1]``, DeepSpeed LoCo's) against a direct fp64
computation, its error bound (half a step except the clipped positive absmax element: one step),
the fp32-limit guard, and the C kernel equal to the torch reference on both grids."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loco_megatron import kernels
from loco_megatron.config import GRIDS
from loco_megatron.error_buffer import ErrorBuffer
from loco_megatron.layout import BucketLayout
from loco_megatron.quantization import (decode, dequantize_blockwise, divisor, encode, max_scale,
                                        quantize_blockwise)

from .test_quantizer_fuzz import DTYPES, FMAX, FUZZ, VALUES

BLOCK = 64


def _direct(x64: torch.Tensor, bits: int, block: int):
    """Full-range in fp64, written out: scale = absmax / 2^(b-1), codes = clamp(rint(x/scale),
    -2^(b-1), 2^(b-1) - 1); and the exact quotients x/scale."""
    half = 2 ** (bits - 1)
    xb = x64.view(-1, block)
    scale = xb.abs().amax(dim=1) / half
    q = xb / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
    return torch.round(q).clamp(-half, half - 1), scale, q


def _data(seed, n=64 * BLOCK):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -3, 4, (n // BLOCK, 1), generator=gen).double()
    x = x.view(-1, BLOCK)
    x[1] = torch.randint(-16, 17, (BLOCK,), generator=gen).double() * 0.5  # rounding ties
    x[2] = 0.0  # an all-zero block
    x[3, 5] = x[3].abs().max() * 1.5  # a positive absmax element (clipped to 7/8)
    x[4, 9] = -x[4].abs().max() * 1.5  # a negative one (exact at code -8)
    return x.view(-1)


def test_divisor_and_max_scale():
    assert [divisor(b, g) for b in (4, 8) for g in GRIDS] == [7, 8, 127, 128]
    assert divisor(4) == 7  # symmetric by default
    for bits, d in ((4, 8), (8, 128)):
        s = max_scale(bits, "full-range")
        assert s == FMAX / d  # exact: a power of two
        assert torch.isfinite(torch.tensor(s, dtype=torch.float32) * d)
    assert max_scale(4) == max_scale(4, "symmetric") > max_scale(4, "full-range")
    with pytest.raises(ValueError, match="grid='asymmetric'"):
        quantize_blockwise(torch.ones(4), 4, 4, "asymmetric")
    with pytest.raises(ValueError, match="grid="):
        divisor(4, "Full-Range")


@pytest.mark.parametrize("bits", [4, 8])
def test_full_range_equals_direct_fp64_computation(bits):
    x = _data(bits)
    codes, scales = quantize_blockwise(x, bits, BLOCK, "full-range")  # fp64 in: fp64 arithmetic
    ref_codes, ref_scales, _ = _direct(x, bits, BLOCK)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.double(), ref_codes.view(-1))
    assert int(codes.min()) == -2 ** (bits - 1) and int(codes.max()) == 2 ** (bits - 1) - 1
    # fp32 in (fp32 arithmetic): the scale absmax/8 is exact, so it equals the fp64 one; the
    # codes equal rint of the fp64 quotient except where that quotient is within fp32 rounding
    # of a tie (x/scale is rounded to fp32 first)
    x32 = x.float()
    codes32, scales32 = quantize_blockwise(x32, bits, BLOCK, "full-range")
    ref_codes, ref_scales, q = _direct(x32.double(), bits, BLOCK)
    assert scales32.dtype == torch.float32 and torch.equal(scales32.double(), ref_scales)
    near_tie = ((q - q.floor() - 0.5).abs() <= q.abs() * 2.0 ** -23).view(-1)
    assert torch.equal(codes32.double()[~near_tie], ref_codes.view(-1)[~near_tie])
    assert near_tie.sum() < 200  # the exact ties of block 1 (and few others)
    # and the grid reaches the quantizer: symmetric is another scale on every nonzero block
    _, sym = quantize_blockwise(x32, bits, BLOCK)
    nonzero = scales32 > 0
    assert (sym[nonzero] > scales32[nonzero]).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_range_error_bound(bits, dtype):
    """|x - deQ(Q(x))| <= scale/2 for every element except those clipped at the top code
    (x/scale > 2^(b-1) - 1/2: only the largest positive ones), whose error is at most one step,
    absmax / 2^(b-1); the positive absmax element itself decodes to 7/8 (127/128) of its value,
    a negative one exactly."""
    x = _data(10 + bits).to(dtype)
    codes, scales = quantize_blockwise(x, bits, BLOCK, "full-range")
    y = dequantize_blockwise(codes, scales, BLOCK, dtype=torch.float64).view(-1, BLOCK)
    xb, s = x.double().view(-1, BLOCK), scales.double().unsqueeze(1)
    err = (xb - y).abs()
    rel = 2.0 ** -20 if dtype == torch.float32 else 2.0 ** -40  # rounding of x/scale, q*scale
    top = 2 ** (bits - 1) - 1
    clipped = xb / torch.where(s > 0, s, torch.ones_like(s)) > top + 0.5
    assert clipped.any()
    assert (err[~clipped] <= (s * (0.5 + rel)).expand_as(err)[~clipped]).all()
    assert (err[clipped] <= (s * (1 + rel)).expand_as(err)[clipped]).all()
    assert (codes.view(-1, BLOCK)[clipped] == top).all()
    amax = xb.abs().amax(dim=1)
    assert codes.view(-1, BLOCK)[3, 5] == top
    torch.testing.assert_close(y[3, 5], amax[3] * top / (top + 1), rtol=2 * rel, atol=0)
    assert y[4, 9] == -amax[4] and codes.view(-1, BLOCK)[4, 9] == -(top + 1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("grid", GRIDS)
def test_zero_blocks_give_zeros(bits, grid):
    x = torch.zeros(300)
    x[260:270] = torch.linspace(-1, 1, 10)
    codes, scales = quantize_blockwise(x, bits, 128, grid)
    assert scales[0] == 0 and scales[1] == 0 and scales[2] > 0
    assert not codes[:256].any()
    y = dequantize_blockwise(codes, scales, 128, numel=300)
    assert torch.isfinite(y).all() and (y[:256] == 0).all()
    codes, scales = quantize_blockwise(torch.zeros(0), bits, 64, grid)
    assert codes.numel() == 0 and scales.numel() == 0


@pytest.mark.parametrize("bits", [4, 8])
def test_full_range_near_flt_max_decodes_finite(bits):
    x = torch.tensor([FMAX, -FMAX, 1.0, 3e38], dtype=torch.float32)
    codes, scales = quantize_blockwise(x, bits, 4, "full-range")
    assert scales[0] == FMAX / 2 ** (bits - 1)
    y = dequantize_blockwise(codes, scales, 4)
    assert torch.isfinite(y).all() and y[1] == -FMAX


@pytest.mark.parametrize("bits", [4, 8])
def test_encode_decode_on_the_full_range_grid(bits):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    payload, scales = encode(x, bits, 16, grid="full-range")
    codes, ref_scales = quantize_blockwise(x, bits, 16, "full-range")
    assert torch.equal(scales, ref_scales)
    sym_payload, sym_scales = encode(x, bits, 16)
    assert payload.numel() == sym_payload.numel() == 1008 * bits // 8  # same wire bytes
    assert torch.equal(decode(payload, scales, bits, 16),
                       dequantize_blockwise(codes, ref_scales, 16))
    assert not torch.equal(scales, sym_scales)


@FUZZ
@given(values=VALUES, prev=VALUES, dtype=st.sampled_from(DTYPES), bits=st.sampled_from([4, 8]),
       block=st.sampled_from([2, 6, 64]), storage=st.sampled_from(["int8", "fp32"]),
       beta=st.sampled_from([0.0, 0.8]), grid=st.sampled_from(GRIDS))
def test_c_kernel_equals_reference_on_both_grids(values, prev, dtype, bits, block, storage, beta,
                                                 grid):
    """Awkward values (NaN, inf, denormals, FLT_MAX): the C kernel's scales, codes of finite
    blocks and error buffer equal the torch reference's bit for bit, on either grid."""
    g = torch.tensor(values + [1.0], dtype=torch.float32).to(dtype)
    if kernels.select("auto", g) != "cpu":
        pytest.skip("no C compiler: the C kernels do not build here")
    layout = BucketLayout.build(g.numel(), 1, block)
    e0 = torch.tensor(prev + [0.0] * g.numel(), dtype=torch.float32)[:g.numel()]
    e0 = torch.nan_to_num(e0, nan=0.0, posinf=1e30, neginf=-1e30)
    out = {}
    for impl in ("torch", "cpu"):
        table = kernels.block_table(layout, "cpu")
        err = ErrorBuffer(table.padded_numel, block, storage, torch.float32, "cpu", table.spans)
        err.set(layout.to_padded(e0, torch.float32))
        payload, scales, count, _, _ = kernels.compress_bucket(
            impl, g, table, err, bits=bits, beta=beta, reset=False, want_err_sq=False, grid=grid)
        out[impl] = (payload, scales, int(count), err.tensors())
    (p0, s0, c0, e0_), (p1, s1, c1, e1_) = out["torch"], out["cpu"]
    assert c0 == c1
    nan = torch.isnan(s0)
    assert torch.equal(nan, torch.isnan(s1))
    assert torch.equal(s0.view(torch.int32)[~nan], s1.view(torch.int32)[~nan])
    if c0 == 0:  # the codes of a non-finite block are not defined
        assert torch.equal(p0, p1)
    for name in e0_:
        a, b = e0_[name], e1_[name]
        assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                           b.view(torch.int32) if b.dtype == torch.float32 else b), name


@pytest.mark.parametrize("bits", [4, 8])
def test_weight_differences_stay_symmetric(bits):
    """--loco-param-bits quantizes on the symmetric grid (its |main - held| <= step/2 bound),
    whatever --loco-grid is: scales absmax/7 (/127), the positive absmax element exact."""
    from loco_megatron import weight_difference as wd

    layout = BucketLayout.build(4 * BLOCK, 1, BLOCK)
    gen = torch.Generator().manual_seed(5)
    held = torch.randn(layout.numel, generator=gen)
    new = held + torch.randn(layout.numel, generator=gen) * 1e-3
    _, scales = wd.encode("torch", new, held, layout, 0, bits)
    _, sym = quantize_blockwise(new - held, bits, BLOCK, "symmetric")
    assert torch.equal(scales, sym)


@pytest.mark.parametrize("kernels_", ["torch", "auto"])
@pytest.mark.parametrize("grid", GRIDS)
def test_compensator_sends_codes_on_the_configured_grid(grid, kernels_):
    """LoCoConfig.grid reaches the compress kernel: the first step's scales (no error yet) are
    absmax / divisor(bits, grid)."""
    from loco_megatron.compensator import Compensator
    from loco_megatron.config import LoCoConfig

    g = torch.randn(4 * BLOCK, generator=torch.Generator().manual_seed(2))
    comp = Compensator(LoCoConfig(bits=4, block_size=BLOCK, grid=grid, kernels=kernels_))
    _, scales = comp.compress("bucket", g)
    assert torch.equal(scales, g.view(-1, BLOCK).abs().amax(dim=1) / torch.tensor(
        float(divisor(4, grid))))
