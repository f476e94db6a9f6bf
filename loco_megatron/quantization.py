"""Blockwise absmax quantizer ``Q_b`` / ``deQ`` and 4-bit packing (torch reference).

LoCo's ``Q_b`` (loco_megatron/algorithm.py, step 2): ``scale = absmax(block) / D`` (at most
:func:`max_scale`, at least the smallest normal for a nonzero block: :func:`floor_scale`),
``q = clamp(round(x * r), -2^(b-1), 2^(b-1) - 1)`` with ``r`` the block's reciprocal scale
(:func:`reciprocal`: one IEEE division per block, a multiplication per element),
round-to-nearest (ties to even, as ``torch.round``). The divisor ``D`` (:func:`divisor`) is the
grid (``--loco-grid``, :data:`~loco_megatron.config.GRIDS`):

* ``symmetric`` (default): ``D = 2^(b-1) - 1`` (7 for 4 bits, 127 for 8): the codes span
  ``[-7, 7]`` in practice (15 levels) and every element is within half a step, ``scale / 2``;
* ``full-range`` (the DeepSpeed LoCo kernel's): ``D = 2^(b-1)`` (8, 128): codes ``[-8, 7]``
  (16 levels), a step 7/8 as large, but a positive absmax element rounds to 8 and is clipped
  to 7 (7/8 of its value: an error of up to ``scale = absmax / 8``).

The clamp range is the same for both; decoding is ``codes * scale`` for both. An all-zero block
gets scale 0 and codes 0, never NaN. Scales are fp32 (wire overhead ``32 / block_size`` bits per
element). 4-bit codes are stored as two's-complement nibbles, two per byte (element ``2i`` in
the low nibble, ``2i+1`` in the high nibble).

Works on CPU and CUDA tensors of any float dtype; all arithmetic is in fp32 (fp64 input stays
fp64 so exact identities can be tested).
"""

from functools import lru_cache
from typing import Tuple

import torch

from .config import COMPRESSED_BITS, GRIDS


def _check_bits(bits: int) -> None:
    if bits not in COMPRESSED_BITS:
        raise ValueError(f"bits={bits} is not supported by the quantizer; use one of {COMPRESSED_BITS}")


def qmax(bits: int) -> int:
    """Largest code magnitude, ``2^(bits-1) - 1`` (7 for 4 bits, 127 for 8 bits)."""
    _check_bits(bits)
    return 2 ** (bits - 1) - 1


def _check_grid(grid: str) -> None:
    if grid not in GRIDS:
        raise ValueError(f"grid={grid!r} is not one of {GRIDS}")


def divisor(bits: int, grid: str = "symmetric") -> int:
    """The scale's divisor ``D`` (``scale = absmax / D``): ``2^(bits-1) - 1`` for ``symmetric``
    (7, 127), ``2^(bits-1)`` for ``full-range`` (8, 128). Also the largest code magnitude a
    block's values reach (the full-range absmax element rounds to ``D`` before the clamp)."""
    _check_bits(bits)
    _check_grid(grid)
    return 2 ** (bits - 1) if grid == "full-range" else qmax(bits)


@lru_cache(maxsize=None)
def max_scale(bits: int, grid: str = "symmetric") -> float:
    """Largest fp32 scale whose ``divisor(bits, grid) * scale`` is finite in fp32 (4 bits
    symmetric: ``RN(FLT_MAX / 7)``; 8 bits symmetric: one ulp below ``RN(FLT_MAX / 127)``,
    whose product rounds to inf; full-range: ``FLT_MAX / 8`` or ``/ 128`` exactly, which
    ``absmax / D`` never exceeds). Blocks with ``|x|`` near FLT_MAX get this scale, so finite
    input never decodes to inf (the codes then clamp; the error stays within ``scale / 2`` up to
    rounding, and the clipped full-range absmax within ``scale``)."""
    q = torch.tensor(float(divisor(bits, grid)), dtype=torch.float32)
    s = torch.tensor(torch.finfo(torch.float32).max, dtype=torch.float32) / q
    while not torch.isfinite(s * q):
        s = torch.nextafter(s, torch.zeros_like(s))
    return float(s)


def reciprocal(safe: torch.Tensor) -> torch.Tensor:
    """``r = RN(1 / safe)`` per block: the factor the quantizer multiplies each element by
    (``q = round(x * r)``), so that there is one IEEE division per block instead of one per
    element, in the torch reference, the C kernel and the Triton kernel alike (bit for bit).
    Always finite: a nonzero block's scale is at least the dtype's smallest normal
    (:func:`floor_scale`), and the largest scale's reciprocal is normal.

    Args:
        safe: ``[nblocks]`` positive scales (a zero scale replaced by 1), fp32 or fp64.

    Returns:
        ``[nblocks]`` of the same dtype.
    """
    return torch.ones((), dtype=safe.dtype, device=safe.device) / safe


def floor_scale(scales: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """A nonzero block's scale raised to at least the dtype's smallest normal value
    (``2^-126`` in fp32): a block of subnormal values (absmax below ``D * 2^-126``) is then
    quantized on the grid of ``2^-126``, whose reciprocal ``2^126`` is finite and exact, so
    every element stays within half a step (``2^-127``) and nothing overflows. An all-zero
    block keeps scale 0; NaN and inf scales are left as they are.

    Args:
        scales: ``[nblocks]`` ``absmax / D``; amax: ``[nblocks]`` the blocks' absmax.

    Returns:
        ``[nblocks]``, the same dtype.
    """
    tiny = torch.finfo(scales.dtype).tiny
    return torch.where((amax > 0) & (scales < tiny), tiny, scales)


def padded_numel(numel: int, block_size: int) -> int:
    """``numel`` rounded up to a whole number of blocks."""
    return -(-numel // block_size) * block_size


def quantize_blockwise(x: torch.Tensor, bits: int, block_size: int, grid: str = "symmetric"
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat tensor blockwise (absmax, round-to-nearest).

    Args:
        x: 1-D float tensor of any length (padded with zeros to whole blocks internally).
        bits: 4 or 8.
        block_size: elements per block (even for 4 bits).
        grid: ``"symmetric"`` (``scale = absmax / (2^(b-1) - 1)``) or ``"full-range"``
            (``absmax / 2^(b-1)``); :func:`divisor`.

    Returns:
        ``(codes, scales)``: ``codes`` int8 of shape ``[nblocks * block_size]`` with values in
        ``[-2^(b-1), 2^(b-1) - 1]`` (unpacked), ``scales`` of shape ``[nblocks]`` in fp32 (fp64
        if ``x`` is fp64). Non-finite input gives non-finite scales (callers check first).

    Raises:
        ValueError: unsupported ``bits`` or ``grid``, or a non-1-D input.
    """
    _check_bits(bits)
    _check_grid(grid)
    if x.dim() != 1:
        raise ValueError(f"quantize_blockwise expects a flat tensor, got shape {tuple(x.shape)}")
    work_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = x.numel()
    npad = padded_numel(n, block_size)
    xb = torch.zeros(npad, dtype=work_dtype, device=x.device)
    xb[:n] = x
    xb = xb.view(-1, block_size)
    # IEEE division by a tensor, not by a Python number: CUDA computes tensor / CPU scalar as a
    # multiplication by the fp32 reciprocal (about half of all 4-bit scales one ulp off the
    # division the fused kernels do; loco_megatron/kernels promises them bit for bit)
    amax = xb.abs().amax(dim=1)
    scales = floor_scale(amax / torch.full((), divisor(bits, grid), dtype=work_dtype,
                                           device=x.device), amax)
    if work_dtype == torch.float32:  # |x| near FLT_MAX: a scale whose codes decode finite
        smax = max_scale(bits, grid)
        scales = torch.where((scales > smax) & (scales < float("inf")), smax, scales)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(xb * reciprocal(safe).unsqueeze(1))
    codes = codes.clamp_(-(qmax(bits) + 1), qmax(bits))
    return codes.to(torch.int8).view(-1), scales


def quantize_spans(x: torch.Tensor, spans: torch.Tensor, bits: int, grid: str = "symmetric"
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_blockwise` with blocks of any length: block ``b`` is the next
    ``spans[b]`` elements of ``x`` (0 allowed). Same arithmetic per block (absmax, IEEE
    division by the grid's divisor, the smallest-normal floor and the FLT_MAX clamp of the
    scale, multiplication by its
    :func:`reciprocal` scale, round half to even, clamp).

    Args:
        x: 1-D float tensor ``[n]``; spans: int64 ``[nblocks]`` summing to ``n``.

    Returns:
        ``(codes int8 [n], scales [nblocks])`` (fp32, fp64 for fp64 input); a NaN/inf in a
        block gives it a non-finite scale.
    """
    _check_bits(bits)
    _check_grid(grid)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    spans = spans.to(x.device)
    xw = x.to(work)
    amax = torch.segment_reduce(xw.abs(), "max", lengths=spans, unsafe=True, initial=0.0)
    scales = floor_scale(amax / torch.full((), divisor(bits, grid), dtype=work,
                                           device=x.device), amax)
    if work == torch.float32:
        smax = max_scale(bits, grid)
        scales = torch.where((scales > smax) & (scales < float("inf")), smax, scales)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    per = reciprocal(safe).repeat_interleave(spans, output_size=x.numel())
    codes = torch.round(xw * per)
    return codes.clamp_(-(qmax(bits) + 1), qmax(bits)).to(torch.int8), scales


def dequantize_spans(codes: torch.Tensor, scales: torch.Tensor, spans: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_spans`: ``codes * scale`` per element, block ``b``'s scale
    covering ``spans[b]`` elements; ``[n]`` in ``dtype`` (no host sync: the size is given)."""
    per = scales.to(dtype).repeat_interleave(spans.to(scales.device), output_size=codes.numel())
    return codes.to(dtype) * per


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, block_size: int,
                         numel: int = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``codes * scale`` per block.

    Args:
        codes: integer tensor ``[nblocks * block_size]`` (unpacked codes).
        scales: ``[nblocks]`` float scales.
        block_size: elements per block.
        numel: number of leading elements to return (default: all, padding included).
        dtype: output dtype (fp32 by default).

    Returns:
        1-D tensor of ``numel`` elements in ``dtype``.
    """
    out = codes.view(-1, block_size).to(dtype) * scales.to(dtype).unsqueeze(1)
    out = out.view(-1)
    return out if numel is None else out[:numel]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack signed 4-bit codes (int8 in ``[-8, 7]``, even length) two per byte.

    Returns a uint8 tensor of ``codes.numel() // 2`` bytes. Raises ValueError on odd length.
    """
    if codes.numel() % 2:
        raise ValueError(f"pack_int4 needs an even number of codes, got {codes.numel()}")
    nib = (codes.view(-1, 2).to(torch.int16) & 0xF).to(torch.uint8)
    return nib[:, 0] | (nib[:, 1] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 ``[n]`` -> int8 codes ``[2n]`` in ``[-8, 7]``."""
    p = packed.to(torch.int16)
    nib = torch.stack((p & 0xF, (p >> 4) & 0xF), dim=-1).view(-1)
    return torch.where(nib >= 8, nib - 16, nib).to(torch.int8)


def encode(x: torch.Tensor, bits: int, block_size: int, grid: str = "symmetric"
           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize (on ``grid``, :func:`quantize_blockwise`) and pack for the wire: returns
    ``(payload uint8, scales fp32)``.

    The payload holds ``nblocks * block_size * bits / 8`` bytes (4-bit packed, 8-bit codes
    reinterpreted as uint8), whatever the grid; :func:`decode` needs no grid.
    """
    codes, scales = quantize_blockwise(x, bits, block_size, grid)
    return pack_codes(codes, bits), scales.float()


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Wire form of unpacked int8 codes: two per byte for 4 bits, reinterpreted as uint8 for 8."""
    return pack_int4(codes) if bits == 4 else codes.view(torch.uint8)


def unpack_codes(payload: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int8 codes, two per byte for 4 bits."""
    _check_bits(bits)
    return unpack_int4(payload) if bits == 4 else payload.view(torch.int8)


def decode(payload: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`encode`: unpack and dequantize to ``dtype`` (padding included)."""
    _check_bits(bits)
    codes = unpack_int4(payload) if bits == 4 else payload.view(torch.int8)
    return dequantize_blockwise(codes, scales, block_size, dtype=dtype)


def wire_bytes(numel: int, bits: int, block_size: int, scale_bytes: int = 4) -> int:
    """Exact bytes of :func:`encode` output for ``numel`` elements (codes plus scales)."""
    nblocks = -(-numel // block_size)
    return nblocks * block_size * bits // 8 + nblocks * scale_bytes
