"""Blockwise reference arithmetic on the wire layout, for tests (independent of the kernels).

Blocks are cut at every segment (DP shard and parameter) boundary, a segment's last block
short; ``spans`` gives each block's wire elements (its codes, then any alignment or trailing
zeros, which never change a block's absmax): loco_megatron/layout.py.
"""

import torch

from loco_megatron.kernels import block_table
from loco_megatron.quantization import dequantize_blockwise, divisor, quantize_blockwise


def spans(layout) -> torch.Tensor:
    """int64 ``[blocks]``: the wire elements of each block of ``layout`` (a ``BucketLayout`` or
    ``ChunkView``), in wire order."""
    return block_table(layout, "cpu").spans


def shard_spans(layout, rank: int) -> torch.Tensor:
    """:func:`spans` of shard ``rank``'s blocks only."""
    K = layout.blocks_per_shard
    return spans(layout)[rank * K:(rank + 1) * K]


def block_absmax(x: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """Per-element absmax of its block (``x`` in the wire layout, blocks of ``span``)."""
    span = span.to(x.device)
    return torch.segment_reduce(x.abs(), "max", lengths=span, unsafe=True,
                                initial=0.0).repeat_interleave(span)


def half_steps(x: torch.Tensor, span: torch.Tensor, bits: int, grid: str = "symmetric"):
    """Per element, half the quantization step of its block: ``absmax / D / 2``."""
    return block_absmax(x, span) / divisor(bits, grid) / 2


def roundtrip(x: torch.Tensor, span: torch.Tensor, bits: int, dtype=None) -> torch.Tensor:
    """``deQ(Q_b(x))`` block by block (blocks of ``span``), decoded in ``dtype`` (default
    ``x``'s)."""
    dtype = x.dtype if dtype is None else dtype
    out, i = torch.zeros(x.numel(), dtype=dtype, device=x.device), 0
    for n in span.tolist():
        if n:
            codes, scales = quantize_blockwise(x[i:i + n], bits, n)
            out[i:i + n] = dequantize_blockwise(codes, scales, n, dtype=dtype)
        i += n
    return out


def decoded_error(buf) -> torch.Tensor:
    """An :class:`~loco_megatron.error_buffer.ErrorBuffer` decoded to fp64 (int8: codes times
    their block's scale, exact in fp64)."""
    if buf.storage == "int8":
        per = buf.scales.double().cpu().repeat_interleave(buf.spans.cpu())
        return buf.codes.double().cpu() * per
    return buf.values.double()
