"""Warn when NaN/Inf gradients reached LoCo (megatron's NaN check off), without a host sync.

The compress kernels skip the error update of every quantization block whose compensated
gradient ``h = g + e`` holds a NaN or inf (the block keeps its previous error; RELIABILITY.md)
and count those blocks on the device (:meth:`loco_megatron.compensator.Compensator.compress`).
:class:`NonfiniteMonitor` turns the count into a log warning. On a GPU (and under the CPU
emulation, where the event completes at once) it copies the counter into pinned host memory
behind a CUDA event, on the stream that last updated it, and reads it once the event has
completed (at this poll or a later one), so the training stream never waits for the host; plain
CPU tensors are read at once.
"""

import contextlib
import logging
from typing import Optional

import torch
import torch.distributed as dist

from .caches import host_tensor

logger = logging.getLogger(__name__)


def _on_device(tensor: torch.Tensor) -> bool:
    """On a GPU (``is_cuda``: the CPU emulation's tensors too, so the CPU checks of the GPU
    contract run the asynchronous path)."""
    return tensor.is_cuda


def _pinned_scalar() -> torch.Tensor:
    """0-dim int64 in pinned host memory (plain host memory where the CUDA runtime is not up:
    the CPU emulation)."""
    return host_tensor(torch.zeros((), dtype=torch.int64, pin_memory=torch.cuda.is_initialized()))


class NonfiniteMonitor:
    """Log a warning when non-finite blocks were counted, at the 1st, 2nd, 4th, 8th, ... step
    that had any (fp16 dynamic loss scaling overflows routinely: no flood).

    Args:
        compensator: the rank's :class:`~loco_megatron.compensator.Compensator`.

    Call :meth:`poll` after each bucket group's reduce-scatter was launched
    (:mod:`loco_megatron.megatron.plugin` does); it returns the blocks newly counted, or 0.
    """

    def __init__(self, compensator):
        self.compensator = compensator
        self.counted = 0  # blocks seen so far
        self.steps = 0  # optimizer steps in which some block was non-finite
        self._unreported = 0
        self._last_step = None
        self._host: Optional[torch.Tensor] = None
        self._event = None

    def poll(self) -> int:
        """Count the blocks since the last poll; warn on the 1st, 2nd, 4th, ... such step."""
        counter = self.compensator.nonfinite_count
        if counter is None:
            return 0
        if not _on_device(counter):
            return self._count(int(counter))
        seen = 0
        if self._event is not None and self._event.query():
            seen = self._count(int(self._host))
            self._event = None
        if self._event is None:  # snapshot the counter for a later poll
            self._snapshot(counter)
            if self._event.query():  # already copied (without a GPU: at once); never waits
                seen += self._count(int(self._host))
                self._event = None
        return seen

    def _snapshot(self, counter: torch.Tensor) -> None:
        """Copy ``counter`` to pinned host memory behind an event, both on the stream that last
        updated it (megatron's communication stream with several distributed-optimizer
        instances and overlap): on the current stream the copy could read it before the
        compress kernels wrote it."""
        stream = self.compensator.nonfinite_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if self._host is None:
                self._host = _pinned_scalar()
            self._host.copy_(counter, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def _count(self, total: int) -> int:
        new = total - self.counted
        if new <= 0:
            return 0
        self.counted = total
        self._unreported += new
        step = max(self.compensator.stats.steps.values(), default=0)
        if step == self._last_step:
            return new  # this step was reported (or skipped) already: counted for the next
        self._last_step = step
        self.steps += 1
        if self.steps & (self.steps - 1) == 0:  # 1, 2, 4, 8, ...
            self._warn()
        return new

    def _warn(self) -> None:
        stream = self.compensator.nonfinite_stream
        if stream is not None:  # the per-bucket flags were written there (a warning: may wait)
            stream.synchronize()
        buckets = sorted(str(k) for k, c in self.compensator.last_nonfinite.items()
                         if int(c) > 0)  # host reads only now that a warning fires
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        logger.warning(
            "LoCo: %d quantization block(s) of the compensated gradient on rank %d held NaN/Inf "
            "(buckets %s); their error update was skipped (they keep their previous error: no "
            "NaN/Inf entered an error buffer). They were sent as they are, so the reduced "
            "gradient holds NaN/Inf there. Steps with NaN/Inf so far: %d (%d blocks); this "
            "warning repeats at the 1st, 2nd, 4th, 8th, ... such step. Expected with --fp16 "
            "dynamic loss scaling (megatron skips overflow steps, LoCo clears its error "
            "buffers); otherwise megatron's --check-for-nan-in-loss-and-grad stops on such "
            "gradients before LoCo runs.",
            self._unreported, rank, ", ".join(buckets) or "of an earlier step", self.steps,
            self.counted)
        self._unreported = 0
