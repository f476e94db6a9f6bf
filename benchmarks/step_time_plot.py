"""PNG of the step-time section: median ms/step per variant, grouped bars overlap off / on,
one panel per link rate (and per DP size when several are run). Failed runs get no bar and an
``x`` label."""

import textwrap
from pathlib import Path
from typing import Dict, Optional

from .step_time_variants import BY_KEY
from .step_time_report import step_ms


def plot(cfg: Dict, runs: Dict, path: Path) -> Optional[Path]:
    """Write the plot to ``path``; returns it, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates, dps, keys = list(cfg["rates"]), list(cfg["dp"]), list(cfg["variants"])
    fig, axes = plt.subplots(len(dps), len(rates), figsize=(6.5 * len(rates), 4.5 * len(dps)),
                             squeeze=False, sharey="row")
    width = 0.8 / max(1, len(cfg["overlap"]))
    for i, dp in enumerate(dps):
        for j, rate in enumerate(rates):
            ax = axes[i][j]
            for k, overlap in enumerate(cfg["overlap"]):
                xs, hs, missing = [], [], []
                for n, key in enumerate(keys):
                    x = n + (k - (len(cfg["overlap"]) - 1) / 2) * width
                    ms = step_ms(runs, dp, key, overlap, rate)
                    if ms:
                        xs.append(x)
                        hs.append(ms)
                    else:
                        missing.append(x)
                bars = ax.bar(xs, hs, width, color=f"C{k}",
                              label=f"overlap {'on' if overlap else 'off'}")
                ax.bar_label(bars, fmt="%.0f", fontsize=7)
                for x in missing:
                    ax.text(x, 0, "x", ha="center", va="bottom", color=f"C{k}", fontsize=12)
            ax.set_xticks(range(len(keys)))
            ax.set_xticklabels([f"({k})\n" + textwrap.fill(BY_KEY[k].name, 13) for k in keys],
                               fontsize=7)
            ax.set_title(f"{rate}, DP {dp}")
            ax.grid(True, axis="y", alpha=0.3)
            if j == 0:
                ax.set_ylabel("median ms/step (lower is better)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Megatron step time over an emulated link (CPU ranks, gloo); x = failed / "
                 "not run", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
