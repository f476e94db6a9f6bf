"""Blockwise quantizer and 4-bit packing against exact references (loco_megatron/algorithm.py)."""

import pytest
import torch

from loco_megatron.quantization import (
    decode, dequantize_blockwise, encode, pack_int4, padded_numel, qmax, quantize_blockwise,
    unpack_int4, wire_bytes,
)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,block", [(1, 2), (7, 4), (255, 64), (1000, 256), (4096, 128)])
def test_round_trip_error_at_most_half_scale(bits, n, block):
    torch.manual_seed(n + bits)
    x = torch.randn(n) * 3
    codes, scales = quantize_blockwise(x, bits, block)
    assert codes.dtype == torch.int8 and codes.numel() == padded_numel(n, block)
    assert int(codes.min()) >= -(qmax(bits) + 1) and int(codes.max()) <= qmax(bits)
    y = dequantize_blockwise(codes, scales, block, numel=n)
    per_elem_scale = scales.repeat_interleave(block)[:n]
    # round-to-nearest: |x - deQ(Q(x))| <= scale/2 (plus fp32 rounding of x/scale).
    assert torch.all((x - y).abs() <= per_elem_scale / 2 * (1 + 1e-5) + 1e-12)
    # Reference scale: absmax / qmax per block.
    xp = torch.zeros(padded_numel(n, block)); xp[:n] = x
    torch.testing.assert_close(scales, xp.view(-1, block).abs().amax(1) / qmax(bits), rtol=0, atol=0)


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_and_empty_blocks_give_zeros_without_nan(bits):
    x = torch.zeros(300)
    x[260:270] = torch.linspace(-1, 1, 10)
    codes, scales = quantize_blockwise(x, bits, 128)
    assert scales[0] == 0 and scales[1] == 0 and scales[2] > 0
    y = dequantize_blockwise(codes, scales, 128, numel=300)
    assert torch.isfinite(y).all()
    assert torch.all(y[:256] == 0)
    codes, scales = quantize_blockwise(torch.zeros(0), bits, 64)
    assert codes.numel() == 0 and scales.numel() == 0
    payload, s = encode(torch.zeros(0), bits, 64)
    assert payload.numel() == 0 and decode(payload, s, bits, 64).numel() == 0


def test_absmax_element_is_exact():
    x = torch.tensor([0.1, -2.0, 0.5, 1.0])
    codes, scales = quantize_blockwise(x, 4, 4)
    assert codes[1] == -7 and dequantize_blockwise(codes, scales, 4)[1] == -2.0


@pytest.mark.parametrize("n", [2, 6, 10, 1002])
def test_pack_int4_round_trip_all_codes(n):
    codes = (torch.arange(n) % 16 - 8).to(torch.int8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == n // 2
    assert torch.equal(unpack_int4(packed), codes)


def test_pack_layout_low_nibble_first():
    assert pack_int4(torch.tensor([1, -1], dtype=torch.int8)).tolist() == [0xF1]
    with pytest.raises(ValueError):
        pack_int4(torch.zeros(3, dtype=torch.int8))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [1, 33, 511, 1000])
def test_encode_decode_odd_lengths(bits, n):
    x = torch.randn(n, dtype=torch.float64)
    payload, scales = encode(x, bits, 16)
    assert payload.numel() * payload.element_size() + scales.numel() * 4 == wire_bytes(n, bits, 16)
    codes, ref_scales = quantize_blockwise(x, bits, 16)
    ref = dequantize_blockwise(codes, ref_scales, 16, numel=n, dtype=torch.float64)
    torch.testing.assert_close(decode(payload, scales, bits, 16, dtype=torch.float64)[:n], ref,
                               rtol=1e-7, atol=0)  # scales travel as fp32


def test_bad_bits_rejected():
    with pytest.raises(ValueError, match="bits=3"):
        quantize_blockwise(torch.ones(4), 3, 4)
    with pytest.raises(ValueError, match="flat"):
        quantize_blockwise(torch.ones(2, 2), 4, 4)


def test_wire_bytes_4bit_ratio():
    n = 1 << 20
    assert wire_bytes(n, 4, 256) == n // 2 + (n // 256) * 4
    assert wire_bytes(n, 4, 256) / (2 * n) < 0.27
