"""Weight-difference all-gather (``--loco-param-bits``): the parameter half of DP traffic.

docs/param_gather.md. With megatron-core's distributed optimizer, each data-parallel rank owns
one shard of every bucket: after the optimizer step it holds the new fp32 main parameters of
its shard, and the bucket's parameter all-gather (param_and_grad_buffer.py
``_ParamAndGradBucketGroup.start_param_sync``) sends every shard, in the parameters' dtype, to
every replica. Here the owner sends the *weight difference* instead (SDP4Bit, arXiv
2410.15526, quantizes weight differences the same way), per bucket and rank ``r``:

    1. difference  d = new - held          fp32, over rank r's shard; ``held`` = the model
                                           parameters every replica holds (same bits everywhere)
    2. quantize    c = Q_b(d)              blockwise absmax, one fp32 scale per block (the
                                           gradient path's quantizer, block layout and kernels)
    3. all-gather  every rank receives every owner's ``c`` (codes and scales)
    4. apply       held <- RN_dtype(held + deQ(c))   on every rank, the owner included, in the
                                           same order: replicas stay bit-identical

The fp32 main parameters are never touched, so what one step's quantization drops stays in the
next step's ``new - held`` (error feedback without a buffer) and, elementwise,

    |main - held| <= scale / 2 + ulp_dtype(held) / 2        (scale: the block's, last step)

up to the fp32 rounding of ``d`` and of ``held + deQ(c)``: it never accumulates. ``Q_b`` here
is always the ``symmetric`` grid, whatever ``--loco-grid`` says for gradients: the bound needs
every element within half a step, which ``full-range`` breaks (its clipped absmax element is a
whole step off). Blocks follow the bucket's :class:`~loco_megatron.layout.BucketLayout` (cut
at shard and parameter
boundaries, so a tensor-parallel-replicated parameter is quantized alike on every TP rank); each
rank's chunk on the wire is rounded up to the largest shard's codes and blocks (a segment's last
block is short), so the all-gather is even: ``bits * P / 8 + 4 * K`` bytes per rank instead of
``shard * element size``.

Encoding and decoding go through :mod:`loco_megatron.kernels` (``--loco-kernels``: torch
reference, C, Triton; bit-identical codes and scales): the compress kernel with its error update
off (a reset step, ``beta = 0``) is exactly ``Q_b``, and decompressing one chunk is exactly
``deQ``.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import kernels
from .caches import on_clear, per_model
from .collectives import check_launch, launch, step_timer
from .layout import BucketLayout

#: Megatron timers (log level 2) of the parameter path: encode + own apply; the all-gathers
#: (launch, and the wait for them); decode + apply of the received chunks
TIMER_NAMES = ("loco-param-encode", "loco-param-comm", "loco-param-decode")


@per_model
def shard_layouts(layout: BucketLayout) -> Tuple[BucketLayout, ...]:
    """Per DP rank ``r``, the one-rank layout of shard ``r`` of ``layout`` (the same block cuts,
    offsets relative to the shard): what rank ``r`` encodes and every rank decodes."""
    out = []
    for r, segs in enumerate(layout.segments):
        base = r * layout.shard
        cuts = [src - base for src, _, _ in segs]
        out.append(BucketLayout.build(layout.shard, 1, layout.block_size, cuts))
    return tuple(out)


def chunk_shape(layout: BucketLayout, bits: int) -> Tuple[int, int]:
    """``(payload bytes, scales)`` one rank contributes to a bucket's all-gather (padded to the
    largest shard, so every rank sends the same)."""
    return layout.padded_shard * bits // 8, layout.blocks_per_shard


def wire_bytes(layout: BucketLayout, bits: int) -> int:
    """Bytes one rank sends to each peer per bucket: ``bits * P / 8 + 4 * K`` (``P`` wire
    elements and ``K`` blocks per shard)."""
    payload, scales = chunk_shape(layout, bits)
    return payload + 4 * scales


class _Discarded:
    """Where the compress kernels write the error of a weight difference, which nothing keeps
    (beta 0 on a reset step: the ``fp32`` storage of an
    :class:`~loco_megatron.error_buffer.ErrorBuffer`, its ``values`` only). One fp32 buffer
    per device, grown to the largest shard and reused by every bucket (the kernels run in
    order on one stream), instead of a new buffer and a host copy of its spans per bucket
    per step."""

    storage = "fp32"
    _buffers: Dict[str, torch.Tensor] = {}

    def __init__(self, numel: int, device):
        key = str(device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=torch.float32, device=device)
        self.values = buf[:numel]

    def zero_(self) -> None:
        self.values.zero_()

    def get(self) -> torch.Tensor:
        return self.values.clone()

    @classmethod
    def release(cls) -> None:
        """Free the buffers (:func:`loco_megatron.uninstall`, through
        :func:`loco_megatron.caches.clear`)."""
        cls._buffers.clear()


on_clear(_Discarded.release)


def encode(impl: str, new: torch.Tensor, held: torch.Tensor, layout: BucketLayout, rank: int,
           bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-2 on the owner: ``Q_b(new - held)`` of shard ``rank``, padded for the wire.

    Args:
        impl: ``"torch"``, ``"cpu"`` or ``"triton"`` (:func:`loco_megatron.kernels.select`).
        new: fp32 ``[layout.shard]``, the new main parameters in the bucket's shard layout
            (elements no parameter covers hold ``held``'s value: difference 0).
        held: ``[layout.shard]`` in the parameter dtype, what every replica holds now.
        layout: the bucket's layout; rank: the owner's index in the DP group; bits: 4 or 8.

    Returns:
        ``(payload uint8 [P * bits / 8], scales fp32 [K])`` (:func:`chunk_shape`);
        a NaN/inf in ``new`` gives its block a non-finite scale (decoded NaN, as stock would
        copy it).
    """
    return encode_difference(impl, new - held.float(), layout, rank, bits)


def encode_difference(impl: str, diff: torch.Tensor, layout: BucketLayout, rank: int,
                      bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode` of a difference ``new - held`` already computed (fp32 ``[layout.shard]``,
    read only): ``Q_b(diff)`` padded for the wire."""
    lay = shard_layouts(layout)[rank]
    table = kernels.block_table(lay, diff.device if impl != "torch" else "cpu")
    payload, scales, *_ = kernels.compress_bucket(
        impl, diff, table, _Discarded(lay.padded_shard, diff.device), bits=bits, beta=0.0,
        reset=True, want_err_sq=False, grid="symmetric")  # whatever --loco-grid says
    nbytes, nscales = chunk_shape(layout, bits)
    out_p = torch.zeros(nbytes, dtype=torch.uint8, device=diff.device)
    out_s = torch.zeros(nscales, dtype=torch.float32, device=diff.device)
    out_p[:payload.numel()] = payload
    out_s[:scales.numel()] = scales
    return out_p, out_s


def apply(impl: str, target: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor,
          layout: BucketLayout, rank: int, bits: int) -> None:
    """Step 4 for shard ``rank`` alone: ``target <- RN_dtype(target + deQ(c))`` in place (the
    drift check's copy of the owner's shard; the all-gather applies every shard at once,
    :func:`all_gather_differences`).

    Args:
        target: ``[layout.shard]`` contiguous parameter-dtype copy of shard ``rank`` of the
            bucket's parameters (``held``), on any rank.
        payload, scales: what rank ``rank`` sent (:func:`encode`).
    """
    lay = shard_layouts(layout)[rank]
    table = kernels.block_table(lay, target.device if impl != "torch" else "cpu")
    kernels.apply_chunks(impl, payload[:lay.padded_shard * bits // 8],
                         scales[:lay.blocks_per_shard], table, bits=bits, out=target)


@dataclass
class ParamGatherStats:
    """Exact bytes of the parameter all-gathers this rank sent, and the drift of ``held``.

    ``bytes_sent`` counts every byte sent to another rank (compressed chunks, and the exact
    all-gathers of :attr:`exact_gathers`); ``stock_bytes`` what megatron-core's all-gather
    would have sent for the same buckets (``(world - 1) * shard * element size``). The drift
    sums stay on the device: ``max |main - held|``, ``sum (main - held)^2`` and
    ``sum main^2`` over this rank's own shards after each compressed step."""

    calls: int = 0
    bytes_sent: int = 0
    stock_bytes: int = 0
    exact_gathers: int = 0
    #: compute the drift after each compressed step (three fp32 passes over the shard; the
    #: iteration line turns it on)
    track_drift: bool = False
    drift: Optional[torch.Tensor] = field(default=None, repr=False)
    _mark: Tuple[int, int] = field(default=(0, 0), repr=False)

    def add_drift(self, new: torch.Tensor, held: torch.Tensor) -> None:
        """Accumulate ``[max |new - held|, sum (new - held)^2, sum new^2, elements]`` (fp64
        scalars from fp32 reductions, on the device; no host sync)."""
        r = new - held.float()
        row = torch.stack([torch.linalg.vector_norm(r, float("inf")), torch.dot(r, r),
                           torch.dot(new, new), torch.tensor(float(r.numel()), device=r.device)]
                          ).double() if r.numel() else torch.zeros(4, dtype=torch.float64,
                                                                   device=r.device)
        if self.drift is None:
            self.drift = row
        else:
            self.drift = torch.cat([torch.maximum(self.drift[:1], row[:1]),
                                    self.drift[1:] + row[1:]])

    def reduce(self, steps: int, group=None) -> Optional[Dict[str, float]]:
        """The window since the last call, over ``group`` (collective: every rank calls it):
        ``bytes_per_step`` and ``stock_bytes_per_step`` (largest per-rank mean over ``steps``
        steps), ``drift_max`` = max ``|main - held|`` / rms(main) and ``drift_rms`` =
        rms(main - held) / rms(main) over every rank's own shards after its last compressed
        step. None on every rank when nothing was gathered in the window."""
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend(group) == "nccl" else torch.device("cpu"))
        sent, stock = self.bytes_sent - self._mark[0], self.stock_bytes - self._mark[1]
        self._mark = (self.bytes_sent, self.stock_bytes)
        drift = (self.drift.to(device) if self.drift is not None
                 else torch.zeros(4, dtype=torch.float64, device=device))
        self.drift = None
        top = torch.stack([drift[0], torch.tensor(float(sent), dtype=torch.float64, device=device),
                           torch.tensor(float(stock), dtype=torch.float64, device=device)])
        sums = drift[1:].clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(sums, group=group)
        (mx, sent, stock), (rsq, msq, n) = top.cpu().tolist(), sums.cpu().tolist()
        if not stock:
            return None
        rms = math.sqrt(msq / n) if n else 0.0
        steps = max(steps, 1)
        return {"bytes_per_step": sent / steps, "stock_bytes_per_step": stock / steps,
                "drift_max": mx / rms if rms else 0.0,
                "drift_rms": math.sqrt(rsq / n) / rms if rms else 0.0}


def all_gather_differences(params: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor,
                           layout: BucketLayout, group, async_op: bool, *, impl: str, bits: int,
                           stats: Optional[ParamGatherStats] = None, timers=None):
    """Steps 3-4 for one bucket: all-gather every owner's codes and scales, then apply every
    rank's difference to its shard of ``params`` in one pass (this rank's own included; each
    element is in exactly one shard, so every replica does the same arithmetic).

    The gathers are two ``all_gather_into_tensor`` into ``[world, chunk]`` buffers (codes,
    scales), and the apply one :func:`loco_megatron.kernels.apply_chunks` over the bucket's
    flat block table: the number of collectives, kernels and torch ops per bucket does not
    depend on the DP size (``all_gather`` into a list would copy each rank's tensor out and
    apply rank by rank). The seam calls it outside megatron-core's ``_coalescing_manager``;
    with ``async_op`` the returned :class:`~loco_megatron.collectives.LoCoWork` finishes the
    apply in ``wait()`` (the handle the bucket group must wait on).

    Args:
        params: the bucket's ``param_data`` ``[layout.numel]`` (parameter dtype, contiguous).
        payload, scales: this rank's chunk (:func:`encode`).
        layout: the bucket's layout; group: its DP group.

    Returns:
        the work handle with ``async_op``, else None after applying.
    """
    check_launch(params, "the LoCo parameter all-gather")
    world = dist.get_world_size(group)
    recv_p = torch.empty(world * payload.numel(), dtype=payload.dtype, device=payload.device)
    recv_s = torch.empty(world * scales.numel(), dtype=scales.dtype, device=scales.device)
    comm_timer = step_timer(timers, TIMER_NAMES[1])
    comm_timer.start()
    works = [dist.all_gather_into_tensor(recv_p, payload, group=group, async_op=async_op),
             dist.all_gather_into_tensor(recv_s, scales, group=group, async_op=async_op)]
    comm_timer.stop()
    if stats is not None:
        stats.calls += 1
        stats.bytes_sent += (world - 1) * (payload.numel() + 4 * scales.numel())
        stats.stock_bytes += (world - 1) * layout.shard * params.element_size()
    table = kernels.block_table(layout, params.device if impl != "torch" else "cpu")

    def finish():
        timer = step_timer(timers, TIMER_NAMES[2])
        timer.start()
        kernels.apply_chunks(impl, recv_p, recv_s, table, bits=bits, out=params.view(-1))
        timer.stop()

    return launch(works, finish, comm_timer, async_op)
