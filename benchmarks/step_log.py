"""Parse Megatron's training log: iteration lines, the timer block after each, LoCo's fields.

Megatron prints (last rank) one iteration line per ``--log-interval`` step, then with
``--timing-log-level >= 1`` a block ``INFO:megatron.core.timers:(min, max) time across ranks
(ms):`` of ``    name ....: (min, max)`` lines for that step; LoCo adds ``loco wire bytes per
step: N`` (and with ``--loco-param-bits`` ``loco param-gather bytes per step: N``) to the
iteration line and ``loco-*`` timers to the block (docs/telemetry.md). Ranks
share one pipe, so matching is unanchored: another rank's output may follow a line's last ``|``.
"""

import re
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|.*?"
                       r"elapsed time per iteration \(ms\): ([\d.]+)")
LOCO_BYTES = re.compile(r"loco wire bytes per step: (\d+)")
PARAM_BYTES = re.compile(r"loco param-gather bytes per step: (\d+)")
TIMER = re.compile(r"^\s+([\w./-]+) \.+: \(([\d.]+), ([\d.]+)\)")
STARTUP_BYTES = re.compile(r"> LoCo: model chunk \d+: (?!parameter).*?(\d+) bytes/step per rank "
                           r"on the wire vs (\d+) stock")


@dataclass
class Step:
    """One logged iteration: step time, ``{timer: (min, max) ms across ranks}``, LoCo bytes."""

    iteration: int
    ms: float
    timers: Dict[str, Tuple[float, float]] = field(default_factory=dict)
    loco_bytes: Optional[int] = None
    param_bytes: Optional[int] = None


class LogParser:
    """Incremental parser: :meth:`feed` one line at a time (a stream) or :meth:`feed_text`.

    Attributes:
        steps: iteration -> :class:`Step`, in log order.
        startup_bytes: ``(LoCo, stock)`` bytes/step per rank from LoCo's start-up line, summed
            over model chunks (None with LoCo off).
    """

    def __init__(self):
        self.steps: Dict[int, Step] = {}
        self.startup_bytes: Optional[Tuple[int, int]] = None
        self._last: Optional[Step] = None

    def feed(self, line: str) -> Optional[int]:
        """Parse one line; returns the iteration number when it is an iteration line."""
        m = ITERATION.search(line)
        if m:
            b, pb = LOCO_BYTES.search(line), PARAM_BYTES.search(line)
            self._last = Step(int(m[1]), float(m[3]), loco_bytes=int(b[1]) if b else None,
                              param_bytes=int(pb[1]) if pb else None)
            self.steps[self._last.iteration] = self._last
            return self._last.iteration
        m = TIMER.search(line)
        if m and self._last is not None:
            self._last.timers[m[1]] = (float(m[2]), float(m[3]))
            return None
        m = STARTUP_BYTES.search(line)
        if m:
            loco, stock = self.startup_bytes or (0, 0)
            self.startup_bytes = (loco + int(m[1]), stock + int(m[2]))
        return None

    def feed_text(self, text: str) -> "LogParser":
        """Parse a whole log."""
        for line in text.splitlines():
            self.feed(line)
        return self


def summarize(steps: List[Step], timers=("all-grads-sync", "params-all-gather",
                                         "loco-compress", "loco-comm", "loco-decompress")) -> Dict:
    """Median step time and median per-step timer maxima (ms) over ``steps``.

    ``<timer>_ms_median`` is the max over ranks (the step waits for the slowest rank),
    ``<timer>_min_ms_median`` the min. Shares are of ``median(step)``: ``grad_sync_share`` from
    ``all-grads-sync`` (max), ``loco_comm_share`` from ``loco-comm`` (min over ranks: the rank
    that reaches the blocking all-to-all last waits for the transfer only, not for the other
    ranks' compression). Medians, not means: the CPUs are shared.
    """
    if not steps:
        return {}
    ms = [s.ms for s in steps]
    out = {"iterations": [s.iteration for s in steps], "step_ms": ms,
           "step_ms_median": statistics.median(ms), "step_ms_mean": statistics.fmean(ms),
           "step_ms_min": min(ms)}
    for name in timers:
        if all(name in s.timers for s in steps):
            out[f"{name}_ms_median"] = statistics.median(s.timers[name][1] for s in steps)
            out[f"{name}_min_ms_median"] = statistics.median(s.timers[name][0] for s in steps)
    for key, name in (("grad_sync_share", "all-grads-sync_ms_median"),
                      ("params_all_gather_share", "params-all-gather_ms_median"),
                      ("loco_comm_share", "loco-comm_min_ms_median")):
        if name in out:
            out[key] = out[name] / out["step_ms_median"]
    loco = [s.loco_bytes for s in steps if s.loco_bytes is not None]
    if loco:
        out["loco_wire_bytes_per_step"] = max(loco)
    param = [s.param_bytes for s in steps if s.param_bytes is not None]
    if param:
        out["param_gather_bytes_per_step"] = max(param)
    return out
