"""LoCo error compensation: per-bucket error buffers with moving average, resets and int8 storage.

Implements LoCo's error feedback (arXiv 2407.04480, Alg. 1; the numbered steps and their
reference arithmetic: loco_megatron/algorithm.py) for one data-parallel rank::

    h_t = g_t + e_{t-1}                                   (compensate)
    c_t = Q_b(h_t)                                        (compress; what is sent)
    e_t = beta * e_{t-1} + (1 - beta) * (h_t - deQ(c_t))  (error moving average)
    e   = 0 every ``reset_interval`` optimizer steps      (reset)

Error buffers are keyed by stable ids (e.g. ``(model chunk, buffer, bucket)``), never by tensor
identity, and checked against the bucket's numel, as PyTorch's ``ddp_comm_hooks`` state objects
key their error dicts by bucket index.
"""

from dataclasses import dataclass, field
from typing import Dict, Hashable, Optional, Tuple

import torch

from . import kernels
from .caches import per_model
from .config import LoCoConfig
from .error_buffer import (STORAGE_FIELDS, ErrorBuffer, decode_entry, uniform_spans,
                           validate_entry)
from .layout import BucketLayout

__all__ = ["Compensator", "CompensatorStats", "ErrorBuffer", "STORAGE_FIELDS", "decode_entry",
           "validate_entry"]


@per_model
def _wire_order_layout(numel: int, block_size: int) -> BucketLayout:
    """The identity layout of ``numel`` elements already in wire order (whole blocks)."""
    return BucketLayout.build(numel, 1, block_size)


@dataclass
class CompensatorStats:
    """Counters since construction: calls, resets, and per-key steps.

    ``steps`` is read by reports and tests; it is written only through the
    :class:`Compensator` step-counter API (:meth:`~Compensator.step_of`,
    :meth:`~Compensator.count_step`, :meth:`~Compensator.set_step`, and
    :meth:`~Compensator.compress` advancing its bucket's counter)."""

    calls: int = 0
    resets: int = 0
    steps: Dict[Hashable, int] = field(default_factory=dict)


class Compensator:
    """Holds every bucket's :class:`ErrorBuffer` and applies LoCo steps 1-4.

    Args:
        config: a :class:`~loco_megatron.config.LoCoConfig` with ``bits`` 4 or 8.
    """

    def __init__(self, config: LoCoConfig):
        if not config.enabled:
            raise ValueError(f"Compensator needs bits 4 or 8, got bits={config.bits}")
        self.config = config
        self.errors: Dict[Hashable, ErrorBuffer] = {}
        self.stats = CompensatorStats()
        self._nonfinite: Optional[torch.Tensor] = None  # 0-dim int64 count on the device
        #: the CUDA stream the count was last updated on (None on CPU): a reader orders its
        #: copy after it there (:class:`~loco_megatron.nonfinite.NonfiniteMonitor`)
        self.nonfinite_stream = None
        #: bucket key -> 0-dim count of non-finite blocks in its latest compress (device tensor;
        #: read by :class:`~loco_megatron.nonfinite.NonfiniteMonitor` only after a warning fired)
        self.last_nonfinite: Dict[Hashable, torch.Tensor] = {}
        #: a :class:`~loco_megatron.metrics.StepMetrics` fed by :meth:`compress`, or None (no cost)
        self.metrics = None
        #: a :class:`~loco_megatron.drift_probe.DriftProbe` fed by :meth:`compress`, or None
        self.probe = None

    # ---- per-bucket step counters: schedule resets and --loco-start-iter, saved in checkpoints

    def step_of(self, key: Hashable) -> int:
        """Optimizer steps bucket ``key`` has taken (0 before its first)."""
        return self.stats.steps.get(key, 0)

    def count_step(self, key: Hashable) -> None:
        """Count one optimizer step of ``key`` that did not go through :meth:`compress` (the
        ``--loco-start-iter`` warm-up at full precision)."""
        self.stats.steps[key] = self.step_of(key) + 1

    def set_step(self, key: Hashable, step: int) -> None:
        """Set ``key``'s counter (a checkpoint restore: resets stay on the same steps)."""
        self.stats.steps[key] = int(step)

    def error_buffer(self, key: Hashable, numel: int, device, spans=None) -> ErrorBuffer:
        """Bucket ``key``'s :class:`ErrorBuffer` of ``numel`` elements (fp32 work dtype),
        created as zeros if it does not exist (the checkpoint's view of a never-used bucket);
        ``spans``: its blocks' wire elements (:class:`ErrorBuffer`).

        Raises:
            RuntimeError: the buffer exists with another number of elements.
        """
        return self._buffer(key, numel, torch.float32, device, spans)

    def _buffer(self, key: Hashable, numel: int, dtype: torch.dtype, device,
                spans=None) -> ErrorBuffer:
        buf = self.errors.get(key)
        if buf is None:
            buf = ErrorBuffer(numel, self.config.block_size, self.config.error_dtype, dtype, device,
                              spans)
            self.errors[key] = buf
            return buf
        if buf.numel != numel or (spans is not None and spans is not buf.host_spans and (
                spans.numel() != buf.nblocks or not torch.equal(spans, buf.host_spans))):
            blocks = "" if spans is None else f" in {spans.numel()} blocks"
            raise RuntimeError(
                f"LoCo error buffer {key} holds {buf.numel} elements in {buf.nblocks} blocks but "
                f"the bucket now has {numel}{blocks}: the gradient-buffer layout changed after "
                f"install (bucket size, DP size or model changed); call "
                f"loco_megatron.uninstall() and install() again.")
        if buf.device != torch.device(device):
            buf.to_(device)  # restored from a checkpoint on another device
        return buf

    def compress(self, key: Hashable, g: torch.Tensor, layout: Optional[BucketLayout] = None,
                 *, bits: Optional[int] = None, step: Optional[int] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Compensate ``g`` with bucket ``key``'s error, encode it, and update the error.

        One pass of the fused kernel ``--loco-kernels`` selects for ``g``
        (:func:`loco_megatron.kernels.select`: Triton on CUDA, C on CPU, else the torch
        reference); no host sync.

        Args:
            key: stable bucket id.
            g: flat local gradient (fp32/bf16/fp16; fp64 runs the torch reference in fp64).
                With ``layout``: the bucket ``[layout.numel]``, read through the layout's block
                table (blocks cut at shard and parameter boundaries); without: already in wire
                order, ``[n]``, ``n`` a multiple of ``block_size``. Not modified.
            layout: the bucket's :class:`~loco_megatron.layout.BucketLayout`, a
                :class:`~loco_megatron.layout.ChunkView` of its shards (the hierarchical
                stages), or None.
            bits: code width, 4 or 8 (default ``config.bits``; the hierarchical mode's
                intra-node stage uses 8).
            step: optimizer step that schedules the reset; default: ``key``'s own step counter,
                which is then advanced. Given (the hierarchical mode's stage buffers follow their
                bucket's counter), no counter is advanced.

        Returns:
            ``(payload, scales)`` for the ``n`` wire elements and ``K`` blocks of the layout:
            uint8 ``[n * bits / 8]``, fp32 ``[K]``.

        A non-finite block of the compensated gradient is still encoded (the reduced result is
        then non-finite there, as with stock communication, so megatron's NaN check and fp16
        loss scaler see it), but its error update is skipped: the block keeps its previous
        error, so no NaN/inf enters the buffer (:meth:`nonfinite_updates` counts these blocks;
        :class:`~loco_megatron.nonfinite.NonfiniteMonitor` logs a warning).
        """
        cfg = self.config
        if layout is None:
            if g.numel() % cfg.block_size:
                raise ValueError(f"compress without a layout needs a whole number of "
                                 f"{cfg.block_size}-element blocks, got {g.numel()} elements")
            layout = _wire_order_layout(g.numel(), cfg.block_size)
        impl = kernels.select(cfg.kernels, g)
        table = kernels.block_table(layout, g.device if impl != "torch" else "cpu")
        work = torch.float64 if g.dtype == torch.float64 else torch.float32
        buf = self._buffer(key, table.padded_numel, work, g.device, table.spans)
        own_counter = step is None
        if own_counter:
            step = self.step_of(key)
        reset = bool(cfg.reset_interval and step > 0 and step % cfg.reset_interval == 0)
        if reset:
            self.stats.resets += 1
        payload, scales, nonfinite, err_sq, buf_sq = kernels.compress_bucket(
            impl, g.reshape(-1), table, buf, bits=bits or cfg.bits, beta=cfg.beta, reset=reset,
            want_err_sq=self.metrics is not None, grid=cfg.grid)
        count = nonfinite.to(torch.int64)  # added on the device: no host sync
        self._nonfinite = count if self._nonfinite is None else self._nonfinite + count
        if g.is_cuda:  # LoCo's side stream, or megatron's communication stream with several
            self.nonfinite_stream = torch.cuda.current_stream(g.device)  # optimizer instances
        self.last_nonfinite[key] = nonfinite
        if self.metrics is not None:
            self.metrics.record(err_sq, buf.squared_norm() if buf_sq is None else buf_sq,
                                nonfinite)
        if self.probe is not None:  # the convergence study's instrument (drift_probe.py)
            self.probe.observe(key, g, table, payload, scales, bits or cfg.bits)
        if own_counter:
            self.set_step(key, step + 1)
        self.stats.calls += 1
        return payload, scales

    @property
    def nonfinite_count(self) -> Optional[torch.Tensor]:
        """0-dim int64 device tensor: non-finite blocks since construction (None before the
        first compress); reading it is the caller's host sync
        (:class:`~loco_megatron.nonfinite.NonfiniteMonitor` copies it asynchronously)."""
        return self._nonfinite

    def nonfinite_updates(self) -> int:
        """Blocks whose compensated gradient was non-finite (error update skipped) since
        construction. Reads a device counter: a host sync, for tests and reports only."""
        return 0 if self._nonfinite is None else int(self._nonfinite)

    def error_bytes(self) -> int:
        """Total bytes of all error buffers on this rank."""
        return sum(b.nbytes() for b in self.errors.values())

    # ---- fp16 loss scaling (loco_megatron/megatron/loss_scale.py) ----

    def rescale_errors(self, factor: torch.Tensor) -> None:
        """Multiply every error buffer by ``factor``, in place, on the device (no host sync).

        Error buffers hold errors of ``grad_data``, i.e. in units of ``loss_scale * gradient``;
        when fp16's dynamic loss scaler changes the scale, the buffers must follow
        (``factor = new_scale / old_scale``). int8 storage multiplies the per-block fp32 scales
        (the codes stay), fp32/fp64 storage the values. Exact for power-of-two factors
        (megatron-core's growth factor 2 and backoff factor 0.5) as long as no scale leaves the
        fp32 range; any other factor is rounded to the storage dtype, then the product is
        rounded once more.

        Args:
            factor: a one-element float tensor (e.g. ``[1]`` fp32/fp64, any device); moved to
                each buffer's device and dtype.
        """
        for buf in self.errors.values():
            buf.mul_(factor)

    def clear_errors(self) -> None:
        """Set every error buffer to zero in place (allocations and step counters kept; no host
        sync). Used when megatron skips an optimizer step (fp16 overflow): the errors of
        gradients that were thrown away must not be fed back."""
        for buf in self.errors.values():
            buf.zero_()

    # ---- checkpoint restore (the saved shape and the resume policy:
    # loco_megatron/megatron/checkpoint/state.py, ``OptimizerLoCo.state_dict``) ----

    def restore_error(self, key: Hashable, entry: Dict[str, torch.Tensor], numel: int, device,
                      where: str, spans: Optional[torch.Tensor] = None) -> None:
        """Set bucket ``key``'s error buffer (``numel`` elements, blocks of ``spans`` wire
        elements, :class:`ErrorBuffer`) from a saved ``entry``.

        ``entry`` holds the fields of either storage (:data:`STORAGE_FIELDS`); saved with the
        current storage it is copied bit for bit, otherwise it is decoded and stored again.

        Raises:
            ValueError: missing field, wrong dtype or element count; the message names ``where``.
        """
        if spans is None:
            spans = uniform_spans(numel, self.config.block_size)
        storage = validate_entry(entry, numel, spans.numel(), where)
        dtype = entry["values"].dtype if storage == "fp32" else torch.float32
        work = torch.float64 if dtype == torch.float64 else torch.float32
        self.errors.pop(key, None)
        buf = self._buffer(key, numel, work, device, spans)
        if storage == self.config.error_dtype:
            for name in STORAGE_FIELDS[storage]:
                getattr(buf, name).copy_(entry[name])
        else:
            buf.set(decode_entry(entry, spans, work).to(device))

    def set_error(self, key: Hashable, values: torch.Tensor,
                  spans: Optional[torch.Tensor] = None) -> None:
        """Set bucket ``key``'s error to ``values`` (``[numel]``, fp32; int8 storage rounds;
        ``spans``: its blocks, :class:`ErrorBuffer`)."""
        self.errors.pop(key, None)
        self._buffer(key, values.numel(), torch.float32, values.device, spans).set(values)

    def reset_error(self, key: Hashable) -> None:
        """Forget bucket ``key``'s error (it restarts from zero at its next compress)."""
        self.errors.pop(key, None)
