"""Parse Megatron's training log: iteration lines, the timer block after each, LoCo's fields,
and what Megatron was configured with (its argument dump, megatron-core's DDP config, buckets).

Megatron prints (last rank) one iteration line per ``--log-interval`` step, then with
``--timing-log-level >= 1`` a block ``INFO:megatron.core.timers:(min, max) time across ranks
(ms):`` of ``    name ....: (min, max)`` lines for that step; LoCo adds ``loco wire bytes per
step: N`` (and with ``--loco-param-bits`` ``loco param-gather bytes per step: N``) to the
iteration line and ``loco-*`` timers to the block (docs/telemetry.md). Ranks
share one pipe, so matching is unanchored: another rank's output may follow a line's last ``|``.

Rank 0 prints, at start-up, Megatron's argument dump (``---- arguments ----``, then one
``  name ..... value`` line per argument, ``---- end of arguments ----``), megatron-core's
``Setting up DistributedDataParallel with config DistributedDataParallelConfig(k=v, ...)`` and
``Number of buckets for gradient all-reduce / reduce-scatter: N`` per gradient buffer.
"""

import re
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

ITERATION = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|.*?"
                       r"elapsed time per iteration \(ms\): ([\d.]+)")
LOCO_BYTES = re.compile(r"loco wire bytes per step: (\d+)")
PARAM_BYTES = re.compile(r"loco param-gather bytes per step: (\d+)")
TIMER = re.compile(r"^\s+([\w./-]+) \.+: \(([\d.]+), ([\d.]+)\)")
ARGS_BEGIN = re.compile(r"-{4,} arguments -{4,}")
ARGS_END = re.compile(r"-{4,} end of arguments -{4,}")
ARG = re.compile(r"^  (\w+) \.* (.*?)\s*$")  # no dots after a long name
DDP_CONFIG = re.compile(r"Setting up DistributedDataParallel with config "
                        r"DistributedDataParallelConfig\((.*)\)")
DDP_FIELD = re.compile(r"(\w+)=(\([^)]*\)|'[^']*'|[^,]*)")
NUM_BUCKETS = re.compile(r"Number of buckets for gradient all-reduce / reduce-scatter: (\d+)")
#: start-up lines that show a setting took effect: megatron-core's (rank 0) and LoCo's
NOTICES = {
    "fp32_accumulation_rs": re.compile(r"Using reduce_scatter_with_fp32_accumulation as "
                                       r"reduce-scatter implementation"),
    "loco_active": re.compile(r"> LoCo active: \d+-bit compensated reduce-scatter"),
    "loco_hierarchical": re.compile(r"> LoCo hierarchical: model chunk"),
    "loco_param_gather": re.compile(r"> LoCo: model chunk \d+: parameter all-gather as"),
}
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
        arguments: Megatron's argument dump, ``{name: value as printed}`` (``"True"``,
            ``"None"``, ``"16"``, ``"torch.bfloat16"``); empty when the log has none.
        ddp_config: megatron-core's ``DistributedDataParallelConfig`` as logged,
            ``{field: value as printed}`` (the last one logged).
        buckets: bucket count of each gradient buffer, in log order.
        notices: names of the :data:`NOTICES` lines seen.
    """

    def __init__(self):
        self.steps: Dict[int, Step] = {}
        self.startup_bytes: Optional[Tuple[int, int]] = None
        self.arguments: Dict[str, str] = {}
        self.ddp_config: Dict[str, str] = {}
        self.buckets: List[int] = []
        self.notices: Set[str] = set()
        self._last: Optional[Step] = None
        self._in_args = False

    def feed(self, line: str) -> Optional[int]:
        """Parse one line; returns the iteration number when it is an iteration line."""
        if self._in_args:
            if ARGS_END.search(line):
                self._in_args = False
            else:
                m = ARG.match(line)
                if m:
                    self.arguments[m[1]] = m[2]
            return None
        if ARGS_BEGIN.search(line):
            self._in_args = True
            return None
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
        m = DDP_CONFIG.search(line)
        if m:
            self.ddp_config = {k: v.strip() for k, v in DDP_FIELD.findall(m[1])}
            return None
        m = NUM_BUCKETS.search(line)
        if m:
            self.buckets.append(int(m[1]))
            return None
        self.notices.update(k for k, rx in NOTICES.items() if rx.search(line))
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
