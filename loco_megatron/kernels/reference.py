"""The torch reference of the fused kernels (``--loco-kernels torch``): any device, any dtype.

Defines the arithmetic the ``cpu`` and ``triton`` kernels reproduce bit for bit
(:mod:`loco_megatron.kernels`); fp64 input stays fp64 so the exact identities of DESIGN.md §1
can be tested. Costs several passes and temporaries over the bucket; the fused kernels do one.
"""

import torch

from ..quantization import dequantize_blockwise, decode, pack_codes, quantize_blockwise


def compress_bucket(g, table, err, *, bits, beta, reset, want_err_sq):
    """Reference of :func:`loco_megatron.kernels.compress_bucket` (same arguments)."""
    block = table.block_size
    work = torch.float64 if g.dtype == torch.float64 else torch.float32
    if reset:
        err.zero_()
    e_prev = err.get()
    h = table.layout.to_padded(g.view(-1), work) + e_prev
    codes, scales = quantize_blockwise(h, bits, block)
    scales = scales.float()  # as sent: the error is measured against what peers decode
    err_now = h - dequantize_blockwise(codes, scales, block, dtype=work)
    new = beta * e_prev + (1.0 - beta) * err_now if beta else err_now
    bad = ~torch.isfinite(scales)  # [nblocks]: a NaN/inf in h (its scale is NaN/inf)
    bad_elem = bad.repeat_interleave(block)
    err_sq = None
    if want_err_sq:  # fp64 sum of the finite blocks: the reference's telemetry is exact
        err64 = err_now.masked_fill_(bad_elem, 0.0).double()
        err_sq = torch.dot(err64, err64)
        del err64
    new = torch.where(bad_elem, torch.zeros((), dtype=work, device=h.device), new)
    # a non-finite block keeps its previous error bit for bit: the storage is written only
    # where the block was finite (read before it is overwritten, no copy of the buffer)
    if err.storage == "int8":
        e_codes, e_scales = quantize_blockwise(new, 8, block)
        err.codes.copy_(torch.where(bad_elem, err.codes, e_codes))
        err.scales.copy_(torch.where(bad, err.scales, e_scales))
    else:
        err.values.copy_(torch.where(bad_elem, err.values, new))
    return pack_codes(codes, bits), scales, bad.sum(dtype=torch.int32), err_sq, None


def decompress_shard(payload, scales, table, rank, *, bits, average, out):
    """Reference of :func:`loco_megatron.kernels.decompress_shard` (same arguments)."""
    work = torch.float64 if out.dtype == torch.float64 else torch.float32
    chunks = decode(payload, scales, bits, table.block_size, dtype=work)
    reduced = chunks.view(table.world, table.layout.padded_shard).sum(dim=0)
    if average:  # by a tensor: CUDA divides by a Python number through its reciprocal
        reduced /= torch.full((), table.world, dtype=work, device=reduced.device)
    table.layout.from_padded_shard(reduced, rank, out)
