"""Convergence study, report: the tables (markdown) and the loss curves (PNG) of
benchmarks/convergence.py's runs, from benchmarks/convergence_stats.py's summary."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List

from .convergence_stats import wins


def _pct(x: float) -> str:
    return "?" if x is None or math.isnan(x) else f"{100 * x:+.2f}%"


def _pm(s: Dict[str, object]) -> str:
    """``mean ± se`` of an :func:`~benchmarks.convergence_stats.across_seeds` result, in %."""
    se = "n/a" if math.isnan(s["se"]) else f"{100 * s['se']:.2f}%"
    return f"{_pct(s['mean'])} ± {se}"


def _seeds(s: Dict[str, object]) -> str:
    return ", ".join(f"{100 * v:+.2f}" for v in s["per_seed"])


def _frac(s) -> str:
    if s is None:
        return "–"
    se = "" if math.isnan(s["se"]) else f" ± {s['se']:.4f}"
    return f"{s['mean']:.4f}{se}"


def markdown(summary: Dict[str, object], cfg, labels: Dict[str, str], why: str = "",
             extra_note: str = "") -> str:
    """The section's body: setup, one table per block size, the comparisons, the verdicts."""
    from loco_megatron.config import LoCoConfig

    k, seeds, full = summary["k"], summary["seeds"], summary["full"]
    lines = [
        f"{cfg.iters} iterations per run, seeds {', '.join(map(str, seeds))} (`--seed`: "
        f"initialisation and data order), every arm paired with full precision seed by seed. "
        f"GPT {cfg.num_layers} layers x hidden {cfg.hidden_size}, {cfg.heads} heads, seq "
        f"{cfg.seq_length}, global batch {cfg.micro_batch * cfg.nproc} ({cfg.nproc} CPU ranks, "
        f"gloo, distributed optimizer), lr {cfg.lr:g} cosine to {cfg.min_lr:g} after "
        f"{cfg.warmup} warm-up iterations; real default corpus (Python stdlib sources, BPE "
        f"vocab 8192). Final training loss: mean of the last {k} iterations; validation loss: "
        f"Megatron's final evaluation ({cfg.eval_iters} batches).", ""]
    if why:
        lines += [f"Why this size: {why}", ""]
    lines += [
        "vs full: the relative difference to full precision of the same seed, mean ± standard "
        "error **across seeds** (per-seed values in brackets, in %). Drift: "
        "‖Σ deQ(c_t) − Σ g_t‖ / ‖Σ g_t‖ of each rank's own codes after the last step (mean over "
        "ranks; ± s.e. across seeds); zero codes: the share of codes equal to 0 among the real "
        "elements, mean over steps (loco_megatron/drift_probe.py).", "",
        f"Full precision: training loss {full['train']:.4f}, validation {full['valid']:.4f} "
        f"(means over seeds).", ""]
    for block in cfg.blocks:
        lines += [f"**Block {block}**", "",
                  "| arm | train loss | vs full (train) | validation loss | vs full (valid) "
                  "| drift | zero codes | ms/iter |", "|---|---|---|---|---|---|---|---|"]
        for arm in cfg.arms:
            r = summary["rows"][f"{arm}@{block}"]
            t, v = r["vs_full"]["train"], r["vs_full"]["valid"]
            ms = "?" if r["iter_ms"] is None else f"{r['iter_ms']:.0f}"
            bad = f" (**{r['diverged']} run(s) diverged: NaN/inf loss**)" if r["diverged"] else ""
            lines.append(f"| {labels.get(arm, arm)}{bad} | {r['train']:.4f} | {_pm(t)} "
                         f"[{_seeds(t)}] | {r['valid']:.4f} | {_pm(v)} [{_seeds(v)}] "
                         f"| {_frac(r['drift'])} | {_frac(r['zero_fraction'])} | {ms} |")
        lines.append("")
    comps = summary["comparisons"]
    if comps:
        lines += ["**Comparisons between arms** (a relative to b, paired by seed; 95% interval "
                  "`mean ± t·se`, Student t with n − 1 degrees of freedom)", "",
                  "| a vs b | block | train: mean ± se | valid: mean ± se (95% interval) "
                  "| seeds with a below b (valid) | beyond seed noise (valid) |",
                  "|---|---|---|---|---|---|"]
        for c in comps.values():
            v = c["valid"]
            ci = "n/a" if math.isnan(v["ci95"]) else f"±{100 * v['ci95']:.2f}%"
            lines.append(f"| {c['a']} vs {c['b']} | {c['block']} | {_pm(c['train'])} "
                         f"| {_pm(v)} ({ci}) | {v['negative']}/{v['n']} "
                         f"| {'yes' if v['beyond_noise'] else 'no'} |")
        lines += ["", *verdicts(comps, LoCoConfig().grid)]
    if extra_note:
        lines += ["", extra_note]
    return "\n".join(lines)


def verdicts(comps: Dict[str, Dict], default_grid: str) -> List[str]:
    """Plain sentences on the questions the study asks (LoCo vs error feedback, compensation vs
    none, the grid, the parameter all-gather)."""
    out = []

    def say(a: str, b: str, claim: str) -> None:
        found = [c for c in comps.values() if (c["a"], c["b"]) == (a, b)]
        if not found:
            return
        won = [c["block"] for c in found if wins(c)]
        lost = [c["block"] for c in found if not wins(c)]
        parts = [f"block {c['block']}: valid {_pm(c['valid'])}" for c in found]
        if won and not lost:
            verdict = f"yes, beyond seed noise at every block size ({'; '.join(parts)})"
        elif won:
            verdict = (f"beyond seed noise at block {', '.join(map(str, won))} only, not at "
                       f"{', '.join(map(str, lost))} ({'; '.join(parts)})")
        else:
            verdict = f"not shown beyond seed noise at this scale ({'; '.join(parts)})"
        out.append(f"- {claim}: {verdict}.")

    say("loco", "ef", "Does LoCo beat plain error feedback")
    say("ef", "nocomp", "Does error feedback beat no compensation")
    say("loco", "nocomp", "Does LoCo beat no compensation")
    say("loco-fr", "loco", "Does the full-range grid beat the symmetric grid (LoCo)")
    say("loco+param", "loco", "Does the 4-bit parameter all-gather lower the loss")
    grid = [c for c in comps.values() if (c["a"], c["b"]) == ("loco-fr", "loco")]
    if grid:
        all_win = all(wins(c) for c in grid)
        rule = ("wins at every block size" if all_win else "does not win at every block size")
        follows = (default_grid == "full-range") == all_win
        out.append(f"- Default grid: `{default_grid}` (`--loco-grid`). The full-range grid {rule}"
                   + (f", so `{default_grid}` is the default by the rule (default only if it "
                      f"wins)." if follows else
                      f": by the rule (default only if it wins) the default should be "
                      f"`{'full-range' if all_win else 'symmetric'}`, not `{default_grid}`: "
                      f"check loco_megatron/config.py."))
    return out


def plot(results, cfg, labels: Dict[str, str], path: Path, window: int = 10) -> Path:
    """PNG: per block size, the training loss (mean over seeds, moving average of ``window``)
    of every arm and full precision, and below it each arm minus full precision (paired by
    seed, then averaged; moving average of ``4 * window``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(vals, w):
        w = max(1, min(w, len(vals)))
        return [sum(vals[max(0, j - w + 1):j + 1]) / len(vals[max(0, j - w + 1):j + 1])
                for j in range(len(vals))]

    def mean_curve(keys):
        its = sorted(set.intersection(*(set(results[k].train) for k in keys)))
        return its, [sum(results[k].train[i] for k in keys) / len(keys) for i in its]

    labels = {k: v.replace("`", "") for k, v in labels.items()}
    cols = len(cfg.blocks)
    fig, axes = plt.subplots(2, cols, figsize=(6.5 * cols, 8), squeeze=False, sharex=True,
                             gridspec_kw={"height_ratios": [3, 2]})
    colors = {key: f"C{i}" for i, key in enumerate(("full", *cfg.arms))}
    full_keys = [("full", None, s) for s in cfg.seeds]
    for col, block in enumerate(cfg.blocks):
        ax, dax = axes[0][col], axes[1][col]
        its, vals = mean_curve(full_keys)
        ax.plot(its, smooth(vals, window), color=colors["full"], linewidth=1.6,
                label=labels.get("full", "full"))
        tail = vals[len(vals) // 5:]
        for arm in cfg.arms:
            keys = [(arm, block, s) for s in cfg.seeds]
            its, vals = mean_curve(keys)
            ax.plot(its, smooth(vals, window), color=colors[arm], linewidth=1.2,
                    label=labels.get(arm, arm))
            tail += vals[len(vals) // 5:]
            diff = [sum(results[(arm, block, s)].train[i] - results[("full", None, s)].train[i]
                        for s in cfg.seeds) / len(cfg.seeds) for i in its]
            dax.plot(its, smooth(diff, 4 * window), color=colors[arm], linewidth=1.2)
        if tail and len(its) >= 20:  # zoom on the last 80%: the first steps dwarf the rest
            lo, hi = min(tail), max(tail)
            ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
        dax.axhline(0.0, color=colors["full"], linewidth=1.0)
        ax.set_title(f"block {block}: training loss, mean of {len(cfg.seeds)} seeds")
        ax.grid(True, alpha=0.3)
        dax.grid(True, alpha=0.3)
        dax.set_xlabel("iteration")
        if col == 0:
            ax.set_ylabel(f"loss (moving average of {window})")
            dax.set_ylabel(f"arm - full precision, same seed\n(moving average of {4 * window})")
            ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
