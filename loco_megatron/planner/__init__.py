"""Planner: predict LoCo's gradient bytes, communication time, step time and memory on a cluster
before running it (``python -m loco_megatron plan``; docs/planner.md).

Files, one purpose each:

* :mod:`.errors`   -- :class:`PlannerError` (bad input: the message names the flag);
* :mod:`.model`    -- model sizes and per-GPU parameter lists in megatron-core's order;
* :mod:`.cluster`  -- parallel layout, cluster links, rank placement (nodes x ranks per group);
* :mod:`.buckets`  -- megatron-core's gradient buckets, exact bytes (LoCo's own formulas), memory;
* :mod:`.costs`    -- alpha-beta times of the collectives, overlap with backward/forward;
* :mod:`.predict`  -- the whole prediction: every variant's bytes, times and step-time ratio;
* :mod:`.report`   -- the printed table and the JSON;
* :mod:`.validate` -- predicted vs measured ratio on the committed emulated-link benchmark.
"""

from .errors import PlannerError

__all__ = ["PlannerError"]
