"""Convergence study, statistics: differences paired by seed, summarised across seeds.

The unit of evidence is a seed. Every arm of the study runs the same seeds (``--seed``: model
initialisation and the data order), so arm ``a`` and full precision are compared seed by seed:

    d_s = (L_a,s - L_full,s) / L_full,s        L: final training loss (mean of the last k
                                               iterations) or the validation loss

and summarised by the mean of ``d_s`` over seeds and its standard error ``sd(d_s) / sqrt(n)``
(sample standard deviation, n - 1). Consecutive iterations of one run are autocorrelated and
say nothing about seed-to-seed variation, so they never enter a standard error here. A
difference is "beyond seed noise" when the two-sided 95% Student-t interval ``mean ± t_{n-1} *
se`` excludes zero (:data:`T975`: the standard table; with 3 seeds t = 4.303).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from .convergence_runs import RunResult

#: two-sided 95% quantiles of Student's t by degrees of freedom (t_{0.975, df})
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}

Key = Tuple[str, Optional[int], int]  # (arm, block size or None for full precision, seed)


def final_loss(train: Dict[int, float], k: int) -> float:
    """Mean training loss over the last ``k`` iterations of a run."""
    vals = [train[i] for i in sorted(train)[-k:]]
    return sum(vals) / len(vals)


def rel(a: float, b: float) -> float:
    """Relative difference ``(a - b) / b``."""
    return (a - b) / b


def t975(df: int) -> float:
    """``t_{0.975, df}`` from :data:`T975` (the next smaller tabulated df above 10: wider)."""
    if df < 1:
        return math.nan
    return T975[max(d for d in T975 if d <= df)]


def across_seeds(values: Sequence[float]) -> Dict[str, object]:
    """Mean, standard error across seeds and the 95% t interval of per-seed ``values``.

    Returns:
        ``{"mean", "se", "n", "ci95" (half width), "per_seed", "beyond_noise", "negative"}``:
        ``se`` and ``ci95`` are NaN for one seed; ``beyond_noise`` is True when the interval
        excludes 0; ``negative`` counts the seeds with a value below 0.
    """
    vals = [float(v) for v in values]
    n = len(vals)
    if not n:
        raise ValueError("across_seeds needs at least one value")
    mean = sum(vals) / n
    if n < 2:
        se = half = math.nan
    else:
        se = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1) / n)
        half = t975(n - 1) * se
    return {"mean": mean, "se": se, "n": n, "ci95": half, "per_seed": vals,
            "beyond_noise": bool(n >= 2 and abs(mean) > half),
            "negative": sum(v < 0 for v in vals)}


def paired(results: Dict[Key, RunResult], a: Tuple[str, Optional[int]],
           b: Tuple[str, Optional[int]], seeds: Sequence[int], k: int) -> Dict[str, object]:
    """Arm ``a`` against arm ``b`` (each ``(arm, block)``), seed by seed, relative to ``b``:
    ``{"train": across_seeds(...), "valid": across_seeds(...)}``."""
    train = [rel(final_loss(results[(*a, s)].train, k), final_loss(results[(*b, s)].train, k))
             for s in seeds]
    valid = [rel(results[(*a, s)].valid, results[(*b, s)].valid) for s in seeds]
    return {"train": across_seeds(train), "valid": across_seeds(valid)}


def summarize(results: Dict[Key, RunResult], arms: Sequence[str], blocks: Sequence[int],
              seeds: Sequence[int], k: int,
              comparisons: Sequence[Tuple[str, str]] = ()) -> Dict[str, object]:
    """Every compressed arm against full precision, and the ``comparisons`` ``(a, b)`` between
    compressed arms, per block size.

    Args:
        results: ``(arm, block, seed) -> RunResult``; full precision is ``("full", None,
            seed)``, every other arm one run per block size and seed.
        arms: the compressed arms (not "full").
        k: iterations averaged for the final training loss.

    Returns:
        ``{"rows": {"arm@block": {...}}, "comparisons": {"a-vs-b@block": paired(...)},
        "full": {...}}`` (string keys: the report's JSON). A row has the arm's mean losses,
        ``vs_full`` (:func:`paired`), ``drift`` and ``zero_fraction`` (:func:`across_seeds` of
        the per-seed values, None when the arm does not compress).
    """
    full = [("full", None, s) for s in seeds]
    out = {"rows": {}, "comparisons": {}, "k": k, "seeds": list(seeds),
           "full": {"train": sum(final_loss(results[f].train, k) for f in full) / len(full),
                    "valid": sum(results[f].valid for f in full) / len(full)}}
    for block in blocks:
        for arm in arms:
            runs = [results[(arm, block, s)] for s in seeds]
            drift = [r.drift for r in runs if r.drift is not None]
            zeros = [r.zero_fraction for r in runs if r.zero_fraction is not None]
            out["rows"][f"{arm}@{block}"] = {
                "arm": arm, "block": block,
                "train": sum(final_loss(r.train, k) for r in runs) / len(runs),
                "valid": sum(r.valid for r in runs) / len(runs),
                "vs_full": paired(results, (arm, block), ("full", None), seeds, k),
                "drift": across_seeds(drift) if len(drift) == len(runs) else None,
                "zero_fraction": across_seeds(zeros) if len(zeros) == len(runs) else None,
                "iter_ms": _median([r.iter_ms for r in runs if r.iter_ms is not None]),
                "diverged": sum(not math.isfinite(final_loss(r.train, k))
                                or not math.isfinite(r.valid) for r in runs),
            }
        for a, b in comparisons:
            out["comparisons"][f"{a}-vs-{b}@{block}"] = {
                "a": a, "b": b, "block": block,
                **paired(results, (a, block), (b, block), seeds, k)}
    return out


def wins(comparison: Dict[str, object]) -> bool:
    """Arm ``a`` beats arm ``b`` in a :func:`summarize` comparison: its validation and training
    losses are lower on average and the validation difference is below zero beyond seed
    noise (the 95% interval lies below zero)."""
    v, t = comparison["valid"], comparison["train"]
    return bool(v["mean"] < 0 and t["mean"] < 0 and v["beyond_noise"])


def _median(vals: List[float]) -> Optional[float]:
    vals = sorted(vals)
    return vals[len(vals) // 2] if vals else None
