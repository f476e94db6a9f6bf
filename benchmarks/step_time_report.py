"""The step-time section's markdown: one table row per (DP, rate, overlap, variant), the
speedups of the LoCo variants against the fair baselines (b) and (c) of the same run, notes.

Works on ``data["runs"]`` of :mod:`.step_time` (hand-made dicts in the tests): each run is
``{"variant", "overlap", "error", rate: {"step_ms_median", ...}, ...}`` keyed by
:func:`.step_time.run_key`. Only measured ratios: a ratio whose two runs are not both measured
is "–".
"""

import os
import re
from typing import Dict, List, Optional, Tuple

from .step_time_variants import BASELINES, BY_KEY, CANDIDATES, run_key


def step_ms(runs: Dict, dp: int, key: str, overlap: bool, rate: str) -> Optional[float]:
    """Median ms/step of one run at ``rate``; None when it failed, was not run or lacks it."""
    r = runs.get(run_key(dp, key, overlap), {})
    if r.get("error"):
        return None
    return r.get(rate, {}).get("step_ms_median")


def speedup(runs: Dict, dp: int, key: str, base: str, overlap: bool,
            rate: str) -> Optional[float]:
    """``ms/step of base / ms/step of key`` (> 1: ``key`` is faster), same DP, rate, overlap."""
    b, x = step_ms(runs, dp, base, overlap, rate), step_ms(runs, dp, key, overlap, rate)
    return b / x if b and x else None


def _x(v: Optional[float]) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _ms(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.0f}"


def _mib(n: Optional[float]) -> str:
    return "–" if n is None else f"{n / 2 ** 20:.1f}"


def _pct(x: Optional[float]) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _num(x: Optional[float]) -> str:
    return "?" if x is None else f"{x:.1f}"


def _nominal_bytes_per_s(rate: str) -> Optional[float]:
    """Bytes/s of a tc rate (``1gbit``, ``100mbit``); None when it is not of that form."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]] / 8 if m else None


def _cause(r: Dict) -> str:
    """The first error line of a failed run's logs (the launcher's summary hides it)."""
    lines = r.get("node0_log", []) + r.get("node1_log", [])
    picked = ([ln for ln in lines if ln.startswith("error:")]
              or [ln for ln in lines if "Error" in ln])
    return picked[0].strip()[:300] if picked else ""


def table(cfg: Dict, runs: Dict) -> List[str]:
    """Rows of the main table (a "vs" column for each baseline the configuration runs)."""
    bases = [b for b in BASELINES if b in cfg["variants"]]
    rows = ["| rate | DP | overlap | variant | ms/step | " + "".join(f"vs ({b}) | " for b in bases)
            + "link MiB/step ns0→ns1 / ns1→ns0 | grad-sync share | param all-gather share "
            "| LoCo wire share | buckets |", "|---" * (10 + len(bases)) + "|"]
    for dp in cfg["dp"]:
        for rate in cfg["rates"]:
            for overlap in cfg["overlap"]:
                for key in cfg["variants"]:
                    r = runs.get(run_key(dp, key, overlap), {})
                    s = {} if r.get("error") else r.get(rate, {})
                    ms = _ms(s.get("step_ms_median")) if s else (
                        "**failed**" if r.get("error", "").strip() and
                        not r["error"].startswith("not run") else "not run")
                    vs = "".join(f"{_x(speedup(runs, dp, key, b, overlap, rate))} | "
                                 for b in bases)
                    rows.append(
                        f"| {rate} | {dp} | {'on' if overlap else 'off'} "
                        f"| ({key}) {BY_KEY[key].name} | {ms} | {vs}"
                        f"{_mib(s.get('link_tx_bytes_per_step'))} / "
                        f"{_mib(s.get('link_rx_bytes_per_step'))} "
                        f"| {_pct(s.get('grad_sync_share'))} "
                        f"| {_pct(s.get('params_all_gather_share'))} "
                        f"| {_pct(s.get('loco_comm_share'))} | {r.get('buckets') or '–'} |")
    return rows


def headline(cfg: Dict, runs: Dict) -> List[str]:
    """One line per (DP, rate, overlap): each LoCo variant against each fair baseline."""
    lines = []
    for dp in cfg["dp"]:
        for rate in cfg["rates"]:
            for overlap in cfg["overlap"]:
                parts = [f"({k}) vs ({b}): {_x(speedup(runs, dp, k, b, overlap, rate))}"
                         for k in CANDIDATES if k in cfg["variants"]
                         for b in BASELINES if b in cfg["variants"]]
                if parts:
                    lines.append(f"- **{rate}, DP {dp}, overlap {'on' if overlap else 'off'}**: "
                                 + ", ".join(parts))
    return lines


def notes(cfg: Dict, runs: Dict) -> List[str]:
    """A line per failed (or not run) run with its error, and where flags did not arrive."""
    out = []
    for name, r in runs.items():
        if r.get("error"):
            cause, v = _cause(r), BY_KEY.get(r.get("variant"))
            out.append(f"- `{name}` ({v.name if v else '?'}, overlap "
                       f"{'on' if r.get('overlap') else 'off'}): {r['error']}"
                       + (f" — `{cause}`" if cause else ""))
    return out


def markdown(cfg: Dict, rate_check: Dict[str, Optional[float]], runs: Dict,
             load: Tuple[Optional[float], Optional[float]] = (None, None),
             png: Optional[str] = None) -> str:
    """The section's body: set-up, table, headline, failures, how to read it, plot link."""
    m = cfg["model"]
    check = "; ".join(f"`tbf rate {r}` → {v / 1e6:.0f} MB/s ({v * 8 / 1e9:.2f} Gbit/s)"
                      if v else f"`tbf rate {r}` → check failed" for r, v in rate_check.items())
    variants = "; ".join(f"({k}) {BY_KEY[k].name}: `{' '.join(BY_KEY[k].flags)}`"
                         for k in cfg["variants"])
    lines = [
        f"Megatron GPT ({m['num_layers']} layer, hidden {m['hidden_size']}, seq "
        f"{m['seq_length']}, micro-batch {m['micro_batch_size']} per rank, "
        + ("`--bf16`: bf16 parameters, all-gathered in bf16; gradients accumulated and "
           "reduce-scattered in fp32 unless `--grad-reduce-in-bf16`" if m.get("bf16")
           else "fp32 parameters and gradients")
        + f"), CPU ranks, gloo, distributed optimizer. Two network namespaces (the two "
        f"\"nodes\") joined by a veth pair shaped with `tc tbf` on both ends; DP/2 ranks per "
        f"namespace. Variants: {variants}. Each with overlap off and on (on: "
        f"`--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size "
        f"{cfg['bucket_size']}`). Medians over {cfg['measure']} iterations after "
        f"{cfg['warmup']} warm-up iterations; all rates in one run per (DP, overlap, variant), "
        f"the link re-shaped between them. Every run's flags were checked in rank 0's log "
        f"(Megatron's argument dump, megatron-core's DDP config, megatron-core's and LoCo's "
        f"start-up lines, bucket count); a run where "
        f"they did not arrive is listed as failed.", "",
        f"Link check (one TCP stream, namespace 0 → 1): {check}." + "".join(
            f" At {r} one stream reached only {100 * v / _nominal_bytes_per_s(r):.0f}% of the "
            f"shaped rate: there the CPUs, not the shaper, limit the transfer."
            for r, v in rate_check.items() if v and _nominal_bytes_per_s(r)
            and v < 0.8 * _nominal_bytes_per_s(r)), "",
        f"Host load (1-min load average at the first / after the last run): "
        f"{_num(load[0])} / {_num(load[1])} on {os.cpu_count()} CPUs, the benchmark's own "
        f"ranks included: they share the cores, so single steps vary (per-iteration times are "
        f"in `data`).", "", "Speedup = ms/step of the baseline / ms/step of the variant, same "
        "run of the section, same rate, same overlap setting (measured ratios only):", ""]
    lines += headline(cfg, runs) + [""] + table(cfg, runs)
    failed = notes(cfg, runs)
    if failed:
        lines += ["", "Runs that failed or did not run:", ""] + failed
    lines += [
        "", "How to read it: (a) is stock megatron-core on gloo, whose `reduce_scatter_tensor` "
        "runs as an all-reduce (about twice an ideal reduce-scatter's bytes): it flatters LoCo. "
        "(b) is megatron-core's own all-to-all reduce-scatter, which sends the ideal "
        "(N−1)/N of the buffer, as NCCL's ring reduce-scatter does: the fair baseline; (c) also "
        "halves its bytes with bf16 gradients. Link bytes: veth counters of namespace 0 "
        "(everything it sent / received per step: gradient and parameter collectives of all its "
        "ranks, TCP/IP headers); ranks inside one namespace talk over its local routes (not "
        "shaped, not counted), like an intra-node link, which is what (f) uses. Grad-sync "
        "share: Megatron's `all-grads-sync` timer (max over ranks) / step time; with overlap "
        "on it is only the part of the reduce-scatter still running when the backward ends. "
        "Param all-gather share: `params-all-gather` (–: with `--overlap-param-gather` the "
        "all-gather runs in the next forward and has no timer). LoCo wire share: `loco-comm` "
        "(min over ranks) / step. Buckets: megatron-core's gradient bucket count.", "",
        "Not measured here: NCCL, GPUs, real NICs or switches: these are CPU ranks on "
        "2 shared cores, gloo over TCP on an emulated link, so compute, LoCo's CPU "
        "compression and gloo's CPU reductions compete with each other for the cores; the "
        "ratios are those of this set-up, not predictions for a GPU cluster."]
    if png:
        lines += ["", f"![step time per variant, overlap off/on, per link rate]({png})"]
    return "\n".join(lines)
