"""Warn when NaN/Inf gradients reached LoCo (megatron's NaN check off), without a host sync.

The compress kernels skip the error update of every quantization block whose compensated
gradient ``h = g + e`` holds a NaN or inf (the block keeps its previous error; RELIABILITY.md)
and count those blocks on the device (:meth:`loco_megatron.compensator.Compensator.compress`).
:class:`NonfiniteMonitor` turns the count into a log warning. On CPU it reads the counter at
once; on CUDA it copies the counter into pinned host memory behind a CUDA event and reads it at
a later poll, once the event has completed, so the training stream never waits for the host.
"""

import logging
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class NonfiniteMonitor:
    """Log a warning each time the count of non-finite blocks has grown since the last report.

    Args:
        compensator: the rank's :class:`~loco_megatron.compensator.Compensator`.

    Call :meth:`poll` after each bucket group's reduce-scatter was launched
    (:mod:`loco_megatron.megatron.plugin` does); it returns the new count it reported, or 0.
    """

    def __init__(self, compensator):
        self.compensator = compensator
        self.reported = 0
        self._host: Optional[torch.Tensor] = None
        self._event = None

    def poll(self) -> int:
        """Report the blocks counted since the last report (a warning), return how many."""
        counter = self.compensator._nonfinite
        if counter is None:
            return 0
        if counter.device.type != "cuda":
            return self._report(int(counter))
        seen = 0
        if self._event is not None and self._event.query():
            seen = self._report(int(self._host))
            self._event = None
        if self._event is None:  # snapshot the counter for a later poll
            if self._host is None:
                self._host = torch.zeros((), dtype=torch.int64, pin_memory=True)
            self._host.copy_(counter, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        return seen

    def _report(self, total: int) -> int:
        new = total - self.reported
        if new <= 0:
            return 0
        self.reported = total
        buckets = sorted(str(k) for k, c in self.compensator.last_nonfinite.items()
                         if int(c) > 0)  # host reads only now that a warning fires
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        logger.warning(
            "LoCo: %d quantization block(s) of the compensated gradient on rank %d held NaN/Inf "
            "(buckets %s); their error update was skipped (they keep their previous error: no "
            "NaN/Inf entered an error buffer). They were sent as they are, so the reduced "
            "gradient holds NaN/Inf there: megatron's --check-for-nan-in-loss-and-grad (on by "
            "default) stops on such gradients before LoCo runs.",
            new, rank, ", ".join(buckets) or "of an earlier step")
        return new
