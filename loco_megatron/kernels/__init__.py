"""Fused compression kernels, one contract for three implementations.

docs/kernels.md; the arithmetic they implement: loco_megatron/algorithm.py.

The hot path of LoCo has two halves, each a single pass over the data:

* **compress** (:func:`compress_bucket`): for every quantization block of a bucket, compensate
  (``h = g + e``), quantize and pack (``Q_b(h)``: codes and one fp32 scale, on the ``symmetric``
  or ``full-range`` grid of ``--loco-grid``), and update the error
  buffer (``e = beta * e + (1 - beta) * (h - deQ(Q_b(h)))``, stored as int8 + fp32 scale per
  block, or fp32);
* **decompress** (:func:`decompress_shard`): unpack and dequantize the ``world`` chunks received
  for this rank's shard, sum them in fp32 (rank order), divide by ``world`` for ``AVG``, and write
  the shard in the output's dtype.

Implementations (``--loco-kernels``, :attr:`~loco_megatron.config.LoCoConfig.kernels`):

``torch``   the reference: plain torch ops (:mod:`loco_megatron.algorithm`), any device, fp64
            for exact tests.
``cpu``     a C loop over blocks compiled on first use (:mod:`.cpu`), CPU tensors.
``triton``  Triton kernels (:mod:`.triton_kernels`), CUDA tensors (CPU under
            ``TRITON_INTERPRET=1``, for tests).
``auto``    ``triton`` for CUDA tensors (refused in one line when Triton does not import:
            ``--loco-kernels torch`` runs the reference on a GPU on purpose), ``cpu`` for CPU
            tensors when the C library builds, else ``torch``; fp64 always ``torch``.

All three give the same codes and scales bit for bit and the same error buffer, on either grid
(the same IEEE fp32 operations in the same order, no FMA contraction, round-half-to-even; the
grid only changes the scale's divisor: 7 or 8 for 4 bits, 127 or 128 for 8); the decompressed
sums agree within fp32 rounding. A non-finite block (a NaN or inf in ``h = g + e``) skips its
error update: it keeps its previous error (zero on a reset step), so no NaN/inf ever enters an
error buffer, and it is counted on the device (no host sync); its values are still sent (the
block's scale carries the NaN/inf), so the reduced gradient is non-finite there, as with stock
communication, and megatron's NaN check and fp16 loss scaler see it. Finite blocks of the same
bucket update as usual (RELIABILITY.md).
"""

from typing import Optional, Tuple

import torch

from ..config import KERNEL_CHOICES, LoCoConfigError
from .block_table import BlockTable, block_table

__all__ = ["KERNEL_CHOICES", "BlockTable", "block_table", "select", "compress_bucket",
           "decompress_shard"]


def select(choice: str, tensor: torch.Tensor) -> str:
    """The implementation for ``tensor`` under ``--loco-kernels choice``.

    Returns ``"torch"``, ``"cpu"`` or ``"triton"``.

    ``auto`` on a CPU tensor falls back to ``torch`` when the C kernels cannot run (no C
    compiler, ``cpu_kernels.c`` missing from the install, a library that does not load),
    saying why once in the log.

    Raises:
        LoCoConfigError: (a ``ValueError``, one line naming the flag; the launch paths end the
            rank with it) ``choice`` unknown, or it names an implementation that cannot run on
            ``tensor`` (``triton`` without Triton, or on a CPU tensor without
            ``TRITON_INTERPRET=1``; ``cpu`` on a CUDA tensor, without a C compiler or without
            ``cpu_kernels.c``), or ``auto`` on a CUDA tensor without Triton.
    """
    if choice not in KERNEL_CHOICES:
        raise LoCoConfigError(f"--loco-kernels {choice!r} is not one of {KERNEL_CHOICES}")
    if choice == "torch" or tensor.dtype == torch.float64:
        return "torch"
    # device.type, not is_cuda: the CPU emulation of CUDA reports is_cuda for CPU tensors
    auto = "triton" if tensor.device.type == "cuda" else "cpu"
    impl = auto if choice == "auto" else choice
    reason = _module(impl).unavailable_reason(tensor)
    if reason is None:
        return impl
    if choice != "auto":
        raise LoCoConfigError(f"--loco-kernels {choice}: {reason}")
    if impl == "triton":  # a GPU without Triton: the reference would be slow, and silently
        raise LoCoConfigError(f"--loco-kernels auto: {reason}; on a GPU LoCo needs the Triton "
                         f"kernels (the torch reference copies its block tables to the device "
                         f"on every call): install Triton, or pass --loco-kernels torch to "
                         f"run the reference anyway")
    return "torch"


def _module(impl: str):
    if impl == "triton":
        from . import triton_kernels as mod
    elif impl == "cpu":
        from . import cpu as mod
    else:
        from .. import algorithm as mod
    return mod


def compress_bucket(impl: str, g: torch.Tensor, table: BlockTable, err, *, bits: int,
                    beta: float, reset: bool, want_err_sq: bool, grid: str = "symmetric"
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                               Optional[torch.Tensor]]:
    """Compensate, quantize, pack and update the error of one bucket in one pass.

    Args:
        impl: ``"torch"``, ``"cpu"`` or ``"triton"`` (from :func:`select`).
        g: the bucket's local gradient, flat ``[table.numel]`` (fp32/bf16/fp16; fp64 only with
            ``torch``). Read only.
        table: the bucket's :class:`BlockTable` (where each wire block's elements are in ``g``).
        err: the bucket's :class:`~loco_megatron.error_buffer.ErrorBuffer`
            (``table.padded_numel`` elements, same block size); updated in place.
        bits: 4 or 8.
        beta: error moving-average factor in [0, 1).
        reset: treat the stored error as zero (a reset step).
        want_err_sq: also return ``||h - deQ(Q(h))||^2`` (telemetry).
        grid: the code grid of ``Q`` (``--loco-grid``): ``"symmetric"``, scale
            ``absmax / (2^(b-1) - 1)``, or ``"full-range"``, scale ``absmax / 2^(b-1)``; codes
            clamped to ``[-2^(b-1), 2^(b-1) - 1]`` either way
            (:func:`~loco_megatron.quantization.quantize_blockwise`). The int8 error storage is
            symmetric whatever the grid; decompression needs no grid (``codes * scale``).

    Returns:
        ``(payload, scales, nonfinite, err_sq, buf_sq)``: uint8 ``[padded_numel * bits / 8]``,
        fp32 ``[nblocks]``, a 0-dim int32 count of non-finite blocks (each kept its previous
        error),
        0-dim fp64 ``||h - deQ(Q(h))||^2`` or None, and 0-dim fp64 ``||e||^2`` of the updated
        error buffer when the implementation computed it on the way (C and Triton, int8
        storage, with ``want_err_sq``) else None. All on ``g``'s device; no host sync.
    """
    return _module(impl).compress_bucket(g, table, err, bits=bits, beta=beta, reset=reset,
                                         want_err_sq=want_err_sq, grid=grid)


def decompress_shard(impl: str, payload: torch.Tensor, scales: torch.Tensor, table: BlockTable,
                     rank: int, *, bits: int, average: bool, out: torch.Tensor) -> None:
    """Sum the ``table.world`` received chunks of rank ``rank``'s shard into ``out``.

    Args:
        impl: ``"torch"``, ``"cpu"`` or ``"triton"``.
        payload: uint8 ``[world * padded_shard * bits / 8]``: chunk ``r`` is what rank ``r`` sent.
        scales: fp32 ``[world * blocks_per_shard]``.
        table: the bucket's :class:`BlockTable`.
        rank: this rank's index in the group (which shard ``out`` is).
        bits: 4 or 8.
        average: divide the sum by ``world`` (``ReduceOp.AVG``).
        out: ``[table.shard]`` in any float dtype; written (cast from fp32, round-to-nearest).
    """
    _module(impl).decompress_shard(payload, scales, table, rank, bits=bits, average=average,
                                   out=out)


def apply_chunks(impl: str, payload: torch.Tensor, scales: torch.Tensor, table: BlockTable, *,
                 bits: int, out: torch.Tensor) -> None:
    """Add every rank's decoded chunk to its own shard of ``out``, in place, in one pass: the
    weight-difference apply (loco_megatron/weight_difference.py, step 4) of a whole bucket,
    ``out <- RN_dtype(out + deQ(c_r))`` on shard ``r`` for every ``r``.

    Args:
        impl: ``"torch"``, ``"cpu"`` or ``"triton"``.
        payload: uint8 ``[world * padded_shard * bits / 8]``: chunk ``r`` what rank ``r`` sent
            (an ``all_gather_into_tensor`` of every rank's codes).
        scales: fp32 ``[world * blocks_per_shard]``, gathered alike.
        table: the bucket's flat :class:`BlockTable` (every block of every shard; blocks of
            chunk ``r`` are ``r * blocks_per_shard ..``, their wire offsets in chunk ``r``).
        bits: 4 or 8.
        out: ``[table.numel]`` contiguous, fp32/bf16/fp16 (the bucket's ``param_data``).

    The number of kernels and torch ops does not depend on ``world``; the Triton kernel reads
    the codes and ``out`` and writes ``out`` once (4.5 B per bf16 element at 4 bits).
    """
    _module(impl).apply_chunks(payload, scales, table, bits=bits, out=out)

