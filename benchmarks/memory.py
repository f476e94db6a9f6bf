"""Peak memory per rank with LoCo vs stock megatron-core, measured and against the formula.

A small megatron-core GPT (``GPTModel`` + ``DistributedDataParallel`` + distributed Adam, the
stack of tests/distributed/worker_megatron.py) trains a few steps on 2 data-parallel ranks three
times in the same processes, after a discarded stock run that warms them up (later runs reuse
memory the first leaves resident, which would bias the whole-run peaks by the order): stock,
``loco_megatron.install(LoCoConfig(bits=4, kernels="torch"))`` (the torch reference of the hot
path) and ``kernels="auto"`` (the default: the fused C kernel on CPU tensors, Triton on CUDA
tensors). Which implementation ran is recorded from the calls of
``loco_megatron.kernels.compress_bucket``/``decompress_shard`` and checked against
``kernels.select(cfg.kernels, grad_data)``. ``overlap_grad_reduce`` is off, so megatron reduces
the (single) bucket synchronously in ``finish_grad_sync()``: the gradient sync is a phase of its
own that can be measured. Per rank:

* LoCo's persistent state exactly: ``Compensator.error_bytes()`` (int8 codes + fp32 scale per
  block of the padded bucket);
* the peak of the gradient-sync phase above the memory held when it starts, and the peak of
  the whole run.

Measurement: benchmarks/memory_measure.py (CPU: peak resident set with exact malloc; GPU:
``torch.cuda.max_memory_allocated``). The formula: benchmarks/memory_formula.py
(:func:`loco_memory_formula`, re-exported here).
"""

import os
from pathlib import Path
from typing import Dict, List

from .memory_formula import llama2_7b_formula, loco_memory_formula
from .memory_measure import FULL, MMAP_THRESHOLD, QUICK, measure, reduce_scatter_probe
from .report import Section

__all__ = ["loco_memory_formula", "llama2_7b_formula", "measure", "reduce_scatter_probe",
           "compare", "run", "MODES", "FULL", "QUICK"]

#: the runs, in order, in the same 2 processes: "loco<bits>-<--loco-kernels>"
MODES = ("stock", "loco4-torch", "loco4-auto")


def _mib(x: float) -> str:
    return f"{x / 2 ** 20:.2f}"


def _peak_in_sync(run: Dict) -> bool:
    """The run's whole-run peak was reached during a gradient sync."""
    return max(x["peak"] for x in run["syncs"]) - run["start"] >= run["run_peak"]


def compare(stock: List[Dict], loco: List[Dict], bits: int, block_size: int = 256) -> Dict:
    """Per-rank numbers of one LoCo run: measured vs :func:`loco_memory_formula` of the
    implementation that ran (raises RuntimeError when that is not what ``kernels.select``
    chose, or when the wire bytes differ from the formula's)."""
    rows, world = [], len(stock)
    for rank, (s, l) in enumerate(zip(stock, loco)):
        selected = sorted({impl for *_, impl in l["buckets"]})
        if l["ran"]["compress"] != selected or l["ran"]["decompress"] != selected:
            raise RuntimeError(f"rank {rank}, {l['mode']}: kernels.select chose {selected}, "
                               f"the calls ran {l['ran']}")
        formulas = [loco_memory_formula(lay, elt, bits, block_size, impl=impl)
                    for _, elt, lay, impl in l["buckets"]]
        wire = l["steps"] * sum(f["wire"] // world * (world - 1) for f in formulas)
        if wire != l["wire_bytes"]:
            raise RuntimeError(f"rank {rank}, {l['mode']}: sent {l['wire_bytes']} bytes, "
                               f"the formula's wire buffers give {wire}")
        persistent = sum(f["persistent"] for f in formulas)
        top = max(formulas, key=lambda f: f["transient_peak"])
        steady = slice(1, None)  # step 0 also allocates the error buffers and optimizer state
        s_sync = max(x["peak_above_before"] for x in s["syncs"][steady])
        l_sync = max(x["peak_above_before"] for x in l["syncs"][steady])
        rows.append({
            "rank": rank, "mode": l["mode"], "ran": selected[0], "impl": top["impl"],
            "measure": l["measure"], "params": l["params"], "buckets": len(formulas),
            "n_padded": sum(f["n_padded"] for f in formulas), "error_bytes": l["error_bytes"],
            "formula_persistent": persistent, "formula_transient": top["transient_peak"],
            "peak_phase": top["peak_phase"], "phase_bytes": top["phase_bytes"],
            "wire_bytes": wire, "stock_sync_peak": s_sync, "loco_sync_peak": l_sync,
            "sync_diff": l_sync - s_sync, "ratio": l_sync / top["transient_peak"],
            "stock_run_peak": s["run_peak"], "loco_run_peak": l["run_peak"],
            "run_diff": l["run_peak"] - s["run_peak"],
            "stock_run_peak_in_sync": _peak_in_sync(s), "loco_run_peak_in_sync": _peak_in_sync(l),
            "formula_total": persistent + top["transient_peak"]})
    return {"rows": rows}


def _markdown(dims: Dict, results: Dict[str, Dict], big: List[Dict], tele: Dict) -> List[str]:
    rows = [r for res in results.values() for r in res["rows"]]
    r0 = {mode: res["rows"][0] for mode, res in results.items()}
    kind, n = rows[0]["measure"], rows[0]["n_padded"]
    torch0, fused0 = r0["loco4-torch"], r0["loco4-auto"]
    lines = [
        f"megatron-core GPT ({dims['layers']} layers, hidden {dims['hidden']}, FFN {dims['ffn']} "
        f"SwiGLU, vocab {dims['vocab']}, {rows[0]['params']:,} parameters, fp32 gradient buffer, "
        f"one bucket: overlap_grad_reduce off) with DDP + distributed Adam, DP=2, {dims['steps']} "
        f"steps; three runs in the same 2 processes, one after the other, after a discarded stock "
        f"run that warms the processes up (later runs reuse memory it leaves resident): stock, "
        f"`--loco-bits 4 "
        f"--loco-kernels torch` (the torch reference) and `--loco-bits 4` with the default "
        f"`--loco-kernels auto` (block 256, int8 error buffer), which ran "
        f"**`{fused0['ran']}`**, the {fused0['impl']} kernel (`kernels.select`, checked against "
        f"the implementation the kernel calls received). "
        f"Measure: **{kind}**" + ("" if "cuda" in kind else
        f", glibc mmap threshold {MMAP_THRESHOLD // 1024} KiB and `malloc_trim` before each "
        "measured phase, so freed tensors leave the resident set") + ". Whole-run peak = peak "
        "above the memory held before the model was built. Gradient-sync peak = peak during "
        "`finish_grad_sync()` minus the memory held when it starts, worst step after the first; "
        "LoCo's is compared with the formula of the implementation that ran (LoCo never calls the "
        "stock reduce-scatter, whose own temporaries are the stock column). The bytes each rank "
        "sent equal the formula's wire buffers exactly (checked).", "",
        "| run | rank | error buffers (exact) MiB | formula persistent MiB | grad-sync peak stock "
        "MiB | grad-sync peak LoCo MiB | LoCo - stock MiB | formula transient MiB | LoCo "
        "peak/formula | whole-run peak stock MiB | LoCo MiB | diff MiB | formula persistent + "
        "transient MiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['rank']} | {_mib(r['error_bytes'])} | "
            f"{_mib(r['formula_persistent'])} | {_mib(r['stock_sync_peak'])} | "
            f"{_mib(r['loco_sync_peak'])} | {_mib(r['sync_diff'])} | "
            f"{_mib(r['formula_transient'])} | {r['ratio']:.3f} | {_mib(r['stock_run_peak'])} | "
            f"{_mib(r['loco_run_peak'])} | {_mib(r['run_diff'])} | {_mib(r['formula_total'])} |")
    lines += ["", f"Formula per phase (rank 0, n = {n:,} padded elements; bytes beyond the "
              "gradient buffer and the error buffer; **bold**: the peak):", "",
              "| implementation | phase | MiB | bytes / element |", "|---|---|---|---|"]
    for r in (fused0, torch0):
        for name, b in r["phase_bytes"].items():
            bold = "**" if name == r["peak_phase"] else ""
            lines.append(f"| {r['impl']} | {bold}{name}{bold} | {_mib(b)} | {b / n:.2f} |")
    fb, tb, sb = fused0["formula_transient"], torch0["formula_transient"], fused0["stock_sync_peak"]
    ratios = {m: [r["ratio"] for r in res["rows"]] for m, res in results.items()}
    cpus = os.cpu_count() or 1
    slack = cpus * (max(32, 2 * cpus) - 1) * os.sysconf("SC_PAGE_SIZE")  # percpu_counter_batch
    short = max(r["formula_transient"] - r["loco_sync_peak"] for r in rows)
    diff = {m: r["run_diff"] for m, r in r0.items()}

    def where(inside: bool) -> str:
        return "in" if inside else "outside"

    def span(xs: List[float]) -> str:
        return " / ".join(f"{x:.3f}" for x in xs)

    lines += [
        "", f"* Persistent: int8 codes + one fp32 scale per block = n * (1 + 4/256) bytes, "
        "exactly `error_bytes()`, the same for both implementations (plus the cached block "
        "table, 20 bytes per block on the device, not counted).",
        f"* The {fused0['impl']} path (the default): the error buffer is updated in place and the "
        f"bucket read through its block table, so the transient peak is the wire buffers "
        f"(payload + scales sent and received), in `{fused0['peak_phase']}`: {fb / n:.2f} bytes "
        f"per element, {fb / (4 * n):.2f}x the fp32 bucket and "
        f"{'below' if fused0['loco_sync_peak'] < sb else 'above'} stock's own gradient-sync "
        f"peak here ({sb / n:.2f} bytes per element: gloo's reduce-scatter). In the C kernel "
        "fp16 gradients add an fp32 copy of the bucket and an output that is not fp32 an fp32 "
        "shard; Triton needs neither (a shard copy only for a non-contiguous output).",
        f"* Torch reference (`--loco-kernels torch`): peak in `{torch0['peak_phase']}`, "
        f"{tb / n:.2f} bytes per element ({tb / fb:.0f}x the fused path): fp32 temporaries of "
        "`e_prev`, `h`, `err_now`, the error moving average, the `torch.where` that clears a "
        "non-finite bucket and the int8 re-quantization of the error (padded copy, quotient, "
        "rounded).",
        f"* Measured / formula, ranks 0-1: torch {span(ratios['loco4-torch'])}, fused "
        f"{span(ratios['loco4-auto'])}" + ("" if "cuda" in kind else
        f"; /proc reads the kernel's per-CPU batched resident-set counters, each off by up "
        f"to `percpu_counter_batch` - 1 pages per online CPU ({_mib(slack)} MiB here), so a "
        f"peak minus a starting point is uncertain by up to twice that; the largest shortfall "
        f"is {_mib(short)} MiB") + ".",
        f"* Telemetry (`enable_metrics()`, formula): the torch reference also builds "
        f"`ErrorBuffer.squared_norm()`'s fp32 copy of the int8 codes; the fused kernels do not "
        f"(C sums the squared norms in its pass, Triton into per-block partials): Triton peak "
        f"{tele['triton']['transient_peak'] / n:.2f} bytes per element "
        f"(`{tele['triton']['peak_phase']}`), C {tele['cpu']['transient_peak'] / n:.2f}.",
        f"* Whole run, LoCo - stock: torch {_mib(diff['loco4-torch'])} MiB, fused "
        f"{_mib(diff['loco4-auto'])} MiB (persistent + transient {_mib(torch0['formula_total'])} "
        f"and {_mib(fused0['formula_total'])} MiB). Stock's whole-run peak is "
        f"{where(fused0['stock_run_peak_in_sync'])} its gradient sync, torch LoCo's is "
        f"{where(torch0['loco_run_peak_in_sync'])} its own, fused LoCo's is "
        f"{where(fused0['loco_run_peak_in_sync'])} it (elsewhere: forward/backward or the "
        "optimizer step, plus the error buffers). Where both peaks are in the sync, LoCo - stock ~ "
        "persistent + transient - stock's sync peak"
        + "".join(f" ({r['impl']}: {_mib(r['formula_total'] - r['stock_sync_peak'])} MiB)"
                  for r in (torch0, fused0)
                  if r["stock_run_peak_in_sync"] and r["loco_run_peak_in_sync"])
        + "; otherwise it is at most persistent + transient. With overlap_grad_reduce the "
        "per-bucket transients occur per bucket being compressed, plus the wire buffers of "
        "every bucket awaiting its wait()."]
    lines += ["", "The formula on LLaMA-2-7B (megatron-core's bucket layout of "
              "benchmarks/wire_bytes.py, fp32 gradient buffer, LoCo-4, overlap_grad_reduce on: "
              "one bucket compressed at a time; every rank keeps an error buffer for its whole "
              "buckets, not a shard; fused = Triton, what GPUs run with `--loco-kernels auto`; "
              "telemetry off):",
              "", "| DP | buckets | largest bucket (elements) | persistent error buffers GiB | "
              "transient peak, fused (largest bucket) GiB | transient peak, torch reference "
              "GiB | wire buffers sent + received, all buckets in flight at once (upper bound) "
              "GiB |", "|---|---|---|---|---|---|---|"]
    for b in big:
        lines.append(f"| {b['dp']} | {b['buckets']} | {b['largest']:,} | "
                     f"{b['persistent'] / 2 ** 30:.2f} | {b['transient_fused'] / 2 ** 30:.2f} | "
                     f"{b['transient_torch'] / 2 ** 30:.2f} | {b['wire_all'] / 2 ** 30:.2f} |")
    return lines


def run(quick: bool, workdir: Path) -> Section:
    dims = QUICK if quick else FULL
    per_rank = measure(("stock",) + MODES, dims)  # the first run only warms the processes up
    runs = {mode: [r[i + 1] for r in per_rank] for i, mode in enumerate(MODES)}
    results = {mode: compare(runs["stock"], runs[mode], bits=4) for mode in MODES[1:]}
    _, elt, lay, _ = runs["loco4-auto"][0]["buckets"][0]
    tele = {impl: loco_memory_formula(lay, elt, 4, 256, impl=impl, telemetry=True)
            for impl in ("cpu", "triton")}
    big = llama2_7b_formula((8, 64) if quick else (8, 64, 512))
    lines = _markdown(dims, results, big, tele)
    return Section(name="memory", title="Peak memory per rank: LoCo vs stock",
                   markdown="\n".join(lines),
                   data={"dims": dims, "measure": results["loco4-auto"]["rows"][0]["measure"],
                         "rows": {m: res["rows"] for m, res in results.items()},
                         "telemetry": {i: {k: f[k] for k in ("transient_peak", "peak_phase")}
                                       for i, f in tele.items()},
                         "llama2_7b": big,
                         "syncs": {m: [r["syncs"] for r in rs] for m, rs in runs.items()}})


