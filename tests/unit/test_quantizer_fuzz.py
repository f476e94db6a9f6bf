"""Property tests (hypothesis) of the quantizer and the fused compress kernels on awkward
input: NaN, +-inf, denormals, values near FLT_MAX, all-zero, empty, length 1, odd lengths,
every supported dtype (fp32, bf16, fp16; fp64 for the reference), bits 4 and 8, block sizes
that are not powers of two (RELIABILITY.md).

Properties: a finite block gives a finite scale and finite decoded values within the
quantization bound; a block with a NaN gets a NaN scale, one with an inf (no NaN) an inf scale,
and only those; the error buffer is finite after every compress, a non-finite block keeps its
previous error bit for bit, and the C kernel equals the torch reference bit for bit.
Derandomized under CI (the same examples every run); locally a fresh search each run.
"""

import os

import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from loco_megatron import kernels
from loco_megatron.error_buffer import ErrorBuffer
from loco_megatron.layout import BucketLayout
from loco_megatron.quantization import (dequantize_blockwise, decode, encode, max_scale, qmax,
                                        quantize_blockwise)

FMAX = torch.finfo(torch.float32).max
TINY = 2.0 ** -149  # the smallest fp32 denormal
SPECIALS = [0.0, -0.0, 1.0, -2.5, TINY, -TINY, 3 * TINY, 1e-40, -1e-39, 1.1754942e-38, 1e38,
            -3e38, FMAX, -FMAX, 65504.0, float("inf"), -float("inf"), float("nan")]
VALUES = st.lists(st.one_of(st.floats(width=32), st.sampled_from(SPECIALS)), max_size=200)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FUZZ = settings(max_examples=int(os.environ.get("LOCO_FUZZ_EXAMPLES", "150")), deadline=None,
                derandomize=bool(os.environ.get("CI")), database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def bound(scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Largest |x - deQ(Q(x))| of a finite block with this scale: half a step, the rounding of
    x / scale and of codes * scale (relative 2^-20 covers both), and, for denormal scales, the
    absolute rounding of the scale itself (at most qmax codes of 2^-150 each) and of the
    product."""
    return scale.double() * (0.5 + 2.0 ** -20) + (qmax(bits) + 2) * TINY


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    n = -(-x.numel() // block) * block
    out = torch.zeros(n, dtype=x.dtype)
    out[:x.numel()] = x
    return out.view(-1, block)


@FUZZ
@given(values=VALUES, dtype=st.sampled_from(DTYPES + [torch.float64]), bits=st.sampled_from([4, 8]),
       block=st.sampled_from([2, 4, 6, 10, 64, 96]))
@example(values=[], dtype=torch.float32, bits=4, block=64)
@example(values=[0.0] * 7, dtype=torch.float32, bits=4, block=2)
@example(values=[FMAX, -FMAX, 1.0], dtype=torch.float32, bits=8, block=2)
@example(values=[TINY, -3 * TINY, 0.0], dtype=torch.float32, bits=8, block=4)
def test_quantize_dequantize_properties(values, dtype, bits, block):
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    codes, scales = quantize_blockwise(x, bits, block)
    nblocks = -(-x.numel() // block)
    assert codes.dtype == torch.int8 and codes.numel() == nblocks * block
    assert scales.numel() == nblocks
    assert int(codes.min(), ) >= -qmax(bits) - 1 if codes.numel() else True
    assert int(codes.max()) <= qmax(bits) if codes.numel() else True
    xb = _blocks(x.double(), block)
    y = dequantize_blockwise(codes, scales, block, dtype=torch.float64).view(-1, block)
    has_nan = torch.isnan(xb).any(dim=1)
    has_inf = torch.isinf(xb).any(dim=1) & ~has_nan
    finite = ~has_nan & ~has_inf
    assert torch.equal(torch.isnan(scales), has_nan)
    assert torch.equal(torch.isinf(scales), has_inf)
    s = scales[finite].double()
    assert (s >= 0).all()
    if dtype != torch.float64:
        assert (s <= max_scale(bits)).all()
    assert torch.isfinite(y[finite]).all()  # no NaN/inf from finite input
    err = (xb[finite] - y[finite]).abs()
    assert (err <= bound(s, bits).unsqueeze(1)).all(), (err.max(), s)
    zero = finite & (xb == 0).all(dim=1)
    assert (scales[zero] == 0).all() and not codes.view(-1, block)[zero].any()
    if bits == 4 or dtype != torch.float64:  # the wire form: packed codes + fp32 scales
        payload, wire_scales = encode(x, bits, block)
        back = decode(payload, wire_scales, bits, block, dtype=torch.float64).view(-1, block)
        assert torch.equal(back[finite], y[finite]) or dtype == torch.float64


@FUZZ
@given(values=VALUES, prev=VALUES, dtype=st.sampled_from(DTYPES), bits=st.sampled_from([4, 8]),
       block=st.sampled_from([2, 6, 10, 64]), storage=st.sampled_from(["int8", "fp32"]),
       beta=st.sampled_from([0.0, 0.5, 0.8, 0.999]), reset=st.booleans())
@example(values=[FMAX, 1.0, -FMAX], prev=[1e30, -1.0], dtype=torch.float32, bits=8, block=2,
         storage="int8", beta=0.8, reset=False)
@example(values=[float("nan")], prev=[0.5], dtype=torch.float32, bits=4, block=2,
         storage="fp32", beta=0.8, reset=False)
def test_compress_kernels_properties(values, prev, dtype, bits, block, storage, beta, reset):
    """One compress of a bucket with a finite previous error: the stored error is finite, a
    non-finite block of h = g + e keeps the previous error bit for bit, finite blocks update
    within the bound, the C kernel equals the reference bit for bit."""
    g = torch.tensor(values, dtype=torch.float32).to(dtype)
    n = g.numel()
    assume(n > 0)  # megatron has no empty buckets
    layout = BucketLayout.build(n, 1, block)
    e0 = torch.tensor(prev + [0.0] * n, dtype=torch.float32)[:n]
    e0 = torch.nan_to_num(e0, nan=0.0, posinf=1e30, neginf=-1e30)  # error buffers are finite
    results = {}
    impls = ["torch"] + (["cpu"] if kernels.select("auto", g) == "cpu" else [])
    for impl in impls:
        table = kernels.block_table(layout, "cpu")
        err = ErrorBuffer(table.padded_numel, block, storage, torch.float32, "cpu", table.spans)
        err.set(layout.to_padded(e0, torch.float32))
        before = {k: t.clone() for k, t in err.tensors().items()}
        e_prev = torch.zeros(table.padded_numel) if reset else err.get()
        # one segment of n elements: block b holds [b * block, min((b + 1) * block, n)), the
        # last one short; as [blocks, block] tiles, zeros beyond n
        nb = -(-n // block)

        def tile(v):
            return torch.nn.functional.pad(v[:n], (0, nb * block - n)).view(-1, block)

        payload, scales, count, _, _ = kernels.compress_bucket(
            impl, g, table, err, bits=bits, beta=beta, reset=reset, want_err_sq=False)
        results[impl] = (payload, scales, {k: t.clone() for k, t in err.tensors().items()})
        h = layout.to_padded(g, torch.float32) + e_prev
        bad = ~torch.isfinite(tile(h)).all(dim=1)
        assert int(count) == int(bad.sum())
        e_new = tile(err.get())
        assert torch.isfinite(e_new).all()  # never a NaN/inf in the error buffer
        for name, t in err.tensors().items():
            rows = tile if t.numel() != bad.numel() else (lambda v: v)
            kept = torch.zeros_like(rows(before[name])) if reset else rows(before[name])
            assert torch.equal(rows(t)[bad], kept[bad]), name
        s = scales.double()[~bad].unsqueeze(1)
        assert torch.isfinite(s).all()
        step = e_new[~bad].double() - beta * tile(e_prev)[~bad].double()
        # int8: half a step of the error's scale, absmax / 127 floored to FLT_MIN
        store = (e_new[~bad].abs().amax(dim=1, keepdim=True).double() / 254 + 2 * TINY
                 + torch.finfo(torch.float32).tiny / 2
                 if storage == "int8" else 1e-6 * e_new[~bad].abs().double() + TINY)
        # + the fp32 roundings of q * scale and of h - q * scale: a few ulps of |h|
        slack = (1e-6 * (beta * tile(e_prev)[~bad].abs().double())
                 + 2 * torch.finfo(torch.float32).eps * tile(h)[~bad].abs().double())
        assert (step.abs() <= (1 - beta) * bound(s, bits) + store + slack).all(), impl
    if "cpu" in results:
        (p0, s0, e0_), (p1, s1, e1_) = results["torch"], results["cpu"]
        assert torch.equal(s0.view(torch.int32)[~torch.isnan(s0)],
                           s1.view(torch.int32)[~torch.isnan(s1)])
        for name in e0_:
            a, b = e0_[name], e1_[name]
            assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                               b.view(torch.int32) if b.dtype == torch.float32 else b), name
