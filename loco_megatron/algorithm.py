"""LoCo, the algorithm: start reading here.

LoCo (arXiv 2407.04480, Algorithm 1) compresses each data-parallel rank's gradient to ``b``
bits (4 by default) before the reduce-scatter, and feeds the compression error back into the
next step's gradient through a moving average kept in 8 bits. For one gradient bucket on one
rank, at optimizer step ``t`` (``g_t``: the local gradient; ``e``: the bucket's error buffer):

    0. reset       e_{t-1} = 0                  every ``reset_interval`` steps (paper: T)
    1. compensate  h_t = g_t + e_{t-1}
    2. quantize    c_t = Q_b(h_t)               blockwise absmax, one fp32 scale per block
                                                (grid: --loco-grid); c_t goes on the wire
    3. error       e_t = beta * e_{t-1} + (1 - beta) * (h_t - deQ(c_t))
                                                stored in int8 with a scale per block (or fp32)
    4. reduce      every rank sends each peer that peer's shard of c_t (all-to-all); each
                   rank decodes the codes it received and sums them into its gradient shard
                   (the reduce-scatter's result, averaged by DP size where megatron averages)

This module is the reference arithmetic of steps 0-4 in plain torch: any device, any dtype
(fp64 stays fp64, so exact identities can be tested), several passes and temporaries over the
bucket. It is also ``--loco-kernels torch``. The fused kernels reproduce it bit for bit in one
pass: :mod:`loco_megatron.kernels.cpu` (C) and :mod:`loco_megatron.kernels.triton_kernels`
(Triton); :func:`loco_megatron.kernels.compress_bucket` dispatches between them.

Where the other steps live: ``Q_b`` / ``deQ`` and 4-bit packing in
:mod:`loco_megatron.quantization`; the error buffer's int8 storage in
:mod:`loco_megatron.error_buffer`; the per-bucket error buffers, step counters and resets in
:class:`loco_megatron.compensator.Compensator`; the block layout (blocks cut at DP-shard and
parameter boundaries, the last block of a segment short) in :mod:`loco_megatron.layout`; step 4's collectives in
:mod:`loco_megatron.collectives` (flat) and :mod:`loco_megatron.hierarchical` (two-stage); the
megatron-core seam in :mod:`loco_megatron.megatron.plugin`. Non-finite blocks: the block is still
sent (megatron's NaN check and fp16 loss scaler must see it) but keeps its previous error.
"""

import torch

from .quantization import dequantize_spans, pack_codes, quantize_spans, unpack_codes


def sum_in_rank_order(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` ``[world, n]`` -> a new ``[n]`` in ``dtype``: row 0 + row 1 + ... in that order
    (the fused kernels' order: the same sum on every rank, whatever the collective)."""
    total = rows[0].to(dtype, copy=True)
    for r in range(1, rows.shape[0]):
        total += rows[r]
    return total


def compress_bucket(g, table, err, *, bits, beta, reset, want_err_sq, grid="symmetric"):
    """Steps 0-3 for one bucket: reset, compensate, quantize, error update.

    The work happens on the wire layout (``table.padded_numel`` elements; a block's scale
    covers ``table.spans`` elements: its own, then the zero alignment or trailing codes, which
    never change its absmax), as the fused kernels do block by block.

    Args:
        g: the bucket's local gradient, flat ``[table.numel]`` (fp32/bf16/fp16/fp64).
        table: its :class:`~loco_megatron.kernels.block_table.BlockTable` (wire layout).
        err: its :class:`~loco_megatron.error_buffer.ErrorBuffer` (``[table.padded_numel]``),
            updated in place.
        bits: 4 or 8. beta: the moving-average factor. reset: step 0 applies this step.
        want_err_sq: also return the squared norm of this step's compression error (telemetry).
        grid: the quantizer's grid for the sent codes, ``"symmetric"`` or ``"full-range"``
            (:func:`~loco_megatron.quantization.divisor`); the error buffer's own int8 storage
            is always symmetric (it is not sent).

    Returns:
        ``(payload uint8 [n * bits / 8], scales fp32 [nblocks], non-finite blocks int32 [],
        error squared norm fp64 [] or None, None)`` for the ``n`` wire elements; the same as
        :func:`loco_megatron.kernels.compress_bucket`.
    """
    work = torch.float64 if g.dtype == torch.float64 else torch.float32
    spans = table.spans.to(g.device)
    n = table.padded_numel
    if reset:  # step 0: reset
        err.zero_()
    e_prev = err.get()
    h = table.layout.to_wire(g.reshape(-1), work) + e_prev  # step 1: compensate
    codes, scales = quantize_spans(h, spans, bits, grid)  # step 2: quantize
    scales = scales.float()  # as sent: the error is measured against what peers decode
    err_now = h - dequantize_spans(codes, scales, spans, work)  # step 3: error update
    new = beta * e_prev + (1.0 - beta) * err_now if beta else err_now
    bad = ~torch.isfinite(scales)  # [nblocks]: a NaN/inf in h (its scale is NaN/inf)
    bad_elem = bad.repeat_interleave(spans, output_size=n)
    err_sq = None
    if want_err_sq:  # fp64 sum of the finite blocks: the reference's telemetry is exact
        err64 = err_now.masked_fill_(bad_elem, 0.0).double()
        err_sq = torch.dot(err64, err64)
        del err64
    new = torch.where(bad_elem, torch.zeros((), dtype=work, device=h.device), new)
    # a non-finite block keeps its previous error bit for bit: the storage is written only
    # where the block was finite (read before it is overwritten, no copy of the buffer)
    if err.storage == "int8":
        e_codes, e_scales = quantize_spans(new, spans, 8)
        err.codes.copy_(torch.where(bad_elem, err.codes, e_codes))
        err.scales.copy_(torch.where(bad, err.scales, e_scales))
    else:
        err.values.copy_(torch.where(bad_elem, err.values, new))
    return pack_codes(codes, bits), scales, bad.sum(dtype=torch.int32), err_sq, None


def decompress_shard(payload, scales, table, rank, *, bits, average, out):
    """Step 4 on the receiving side: decode the ``table.world`` chunks this rank received
    (its shard of every rank's codes, concatenated) and sum them into ``out`` (this rank's
    gradient shard, ``[table.shard]``), divided by the DP size when ``average``. Same
    arguments as :func:`loco_megatron.kernels.decompress_shard`."""
    work = torch.float64 if out.dtype == torch.float64 else torch.float32
    world, nbs, P = table.world, table.blocks_per_shard, table.padded_shard
    spans = table.spans[rank * nbs:(rank + 1) * nbs].repeat(world)  # each sender's chunk
    chunks = dequantize_spans(unpack_codes(payload, bits), scales, spans, work)
    reduced = sum_in_rank_order(chunks.view(world, P), work)
    if average:  # by a tensor: CUDA divides by a Python number through its reciprocal
        reduced /= torch.full((), world, dtype=work, device=reduced.device)
    table.layout.from_wire_chunk(reduced, rank, out.view(-1))


def accumulate(out: torch.Tensor, delta: torch.Tensor) -> None:
    """``out <- RN_out.dtype(out + delta)`` in place (``delta`` fp32 of ``out``'s shape): the
    weight-difference apply's last step, ``out.float() + delta`` as the fused kernel adds."""
    if out.dtype == torch.float32:
        out.add_(delta)
    else:
        out.copy_(out.float().add_(delta))


def apply_chunks(payload, scales, table, *, bits, out):
    """The reference of :func:`loco_megatron.kernels.apply_chunks`: decode every chunk of
    ``table``'s wire (codes times their block's scale) and add it to ``out`` in its dtype."""
    work = torch.float64 if out.dtype == torch.float64 else torch.float32
    values = dequantize_spans(unpack_codes(payload, bits), scales, table.spans, work)
    delta = torch.empty(out.numel(), dtype=work, device=out.device)
    P, shard = table.padded_shard, table.shard
    for r in range(table.world):
        table.layout.from_wire_chunk(values[r * P:(r + 1) * P], r,
                                     delta[r * shard:(r + 1) * shard])
    accumulate(out.view(-1), delta)

