"""LoCo's ``loco-*`` timers inside megatron-core's ``Timers``, without a device sync.

docs/kernels.md ("GPU contract"), docs/telemetry.md. megatron-core's ``Timer``
(megatron/core/timers.py) calls ``torch.cuda.synchronize()`` at every ``start`` and ``stop``:
fine for its few timers per step, a host sync per bucket for LoCo's (three per bucket at
``--timing-log-level 2``). LoCo registers its own :class:`EventTimer` objects under its names in
the same ``Timers`` instead: ``start``/``stop`` record CUDA events on the current stream (a
wall clock when CUDA is not initialised, e.g. on CPU), and the recorded pairs are resolved only
when Megatron reads the timer (``Timers.log`` / ``write``, on logging iterations), waiting for
the last one then. Megatron prints them like its own.
"""

import time
from typing import List, Optional, Tuple

import torch

#: the log level of every LoCo timer (megatron's ``--timing-log-level 2``)
LOG_LEVEL = 2


class _NoTimer:
    def start(self, barrier=False):
        pass

    def stop(self, barrier=False):
        pass


NO_TIMER = _NoTimer()


class EventTimer:
    """A megatron-core timer (the interface of ``megatron.core.timers.TimerBase``: ``start``,
    ``stop``, ``reset``, ``elapsed``, ``active_time``) that never synchronizes the device while
    timing. ``elapsed`` is in seconds, like megatron's, summed over the start/stop pairs since
    the last reset.

    Raises:
        AssertionError: ``start`` while started or ``stop`` while stopped (as megatron's).
    """

    def __init__(self, name: str):
        self.name = name
        self._pairs: List[Tuple[object, object]] = []
        self._start: Optional[object] = None
        self._elapsed = 0.0
        self._active_time = 0.0

    @staticmethod
    def _mark():
        if torch.cuda.is_initialized():  # the real runtime (not the CPU emulation)
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, barrier=False):
        assert self._start is None, f"timer {self.name} has already been started"
        self._start = self._mark()

    def stop(self, barrier=False):
        assert self._start is not None, f"timer {self.name} is not started"
        self._pairs.append((self._start, self._mark()))
        self._start = None
        self._resolve(wait=False)  # pairs already done: a bounded number stays pending

    def _resolve(self, wait: bool = True) -> None:
        """Add the recorded pairs to the totals, in order; ``wait=False`` stops at the first
        whose end event has not completed (``query``: no sync)."""
        done = 0
        for begin, end in self._pairs:
            if isinstance(begin, float):
                seconds = end - begin
            else:
                if not wait and not end.query():
                    break
                end.synchronize()  # with wait: only when Megatron reads the timer
                seconds = begin.elapsed_time(end) / 1000.0
            self._elapsed += seconds
            self._active_time += seconds
            done += 1
        del self._pairs[:done]

    def reset(self):
        self._pairs.clear()
        self._start = None
        self._elapsed = 0.0

    def elapsed(self, reset=True, barrier=False) -> float:
        """Seconds timed since the last reset (a running pair is not counted)."""
        self._resolve()
        value = self._elapsed
        if reset:
            self._elapsed = 0.0
        return value

    def active_time(self) -> float:
        """Seconds timed since construction."""
        self._resolve()
        return self._active_time


def step_timer(timers, name: str):
    """LoCo's timer ``name`` in ``timers`` (a ``megatron.core.timers.Timers``): an
    :class:`EventTimer` registered there at log level 2 on first use, so Megatron's
    ``Timers.log`` reads it with its own; a no-op timer when ``timers`` is None or its log
    level is below 2 (as megatron's ``DummyTimer``)."""
    if timers is None:
        return NO_TIMER
    known = getattr(timers, "_timers", None)
    if known is None:  # not megatron's Timers: whatever it returns
        return timers(name, log_level=LOG_LEVEL)
    timer = known.get(name)
    if isinstance(timer, EventTimer):
        return timer
    if getattr(timers, "_log_level", LOG_LEVEL) < LOG_LEVEL:
        return NO_TIMER
    timer = known[name] = EventTimer(name)
    timers._log_levels[name] = LOG_LEVEL
    return timer
