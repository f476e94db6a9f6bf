"""Parsers and the report of the GPU check (benchmarks/gpu_check.py, docs/gpu_check.md).

Standard library only: importable (and tested) on machines without a GPU or torch.
"""

import json
import math
import re
import statistics
from pathlib import Path
from typing import Dict, List, Optional

# ---------------------------------------------------------------------------------------- pytest

#: pytest's final line: "2 passed, 4 skipped, 600 deselected in 41.20s (0:00:41)", "no tests ran
#: in 0.01s", with or without the "====" frame (-q drops it)
_PYTEST_SUMMARY = re.compile(
    r"^=*\s*(?P<body>no tests ran|\d+ [a-z]+(?:, \d+ [a-z]+)*) in (?P<secs>[\d.]+)s"
    r"(?: \([\d:]+\))?\s*=*\s*$")
_PYTEST_COUNT = re.compile(r"(\d+) ([a-z]+)")
_PYTEST_KEYS = {"passed": "passed", "failed": "failed", "skipped": "skipped",
                "deselected": "deselected", "xfailed": "xfailed", "xpassed": "xpassed",
                "error": "errors", "errors": "errors", "warning": "warnings",
                "warnings": "warnings", "rerun": "rerun"}


def parse_pytest(text: str) -> Optional[Dict]:
    """Counts from pytest's last summary line, plus the ``-rfEs`` short summary's FAILED /
    ERROR lines and SKIPPED reasons; None when there is no summary line (killed, crashed)."""
    summary = None
    for line in reversed(text.splitlines()):
        m = _PYTEST_SUMMARY.match(line.strip())
        if m:
            summary = m
            break
    if summary is None:
        return None
    out = {k: 0 for k in ("passed", "failed", "skipped", "errors", "deselected", "xfailed",
                          "xpassed", "warnings")}
    for n, word in _PYTEST_COUNT.findall(summary["body"]):
        key = _PYTEST_KEYS.get(word)
        if key:
            out[key] = out.get(key, 0) + int(n)
    out["seconds"] = float(summary["secs"])
    out["line"] = summary.group(0).strip("= ").strip()
    lines = [ln.strip() for ln in text.splitlines()]
    out["failures"] = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))][:20]
    out["skip_reasons"] = [ln for ln in lines if ln.startswith("SKIPPED ")][:20]
    return out


def pytest_status(rc: Optional[int], timed_out: bool, summary: Optional[Dict]) -> str:
    """``pass`` | ``fail`` | ``no tests`` | ``timeout`` | ``error`` (no summary line)."""
    if timed_out:
        return "timeout"
    if summary is None:
        return "error"
    if summary["failed"] or summary["errors"]:
        return "fail"
    if not summary["passed"]:
        return "no tests"
    return "pass" if rc == 0 else "fail"


# ---------------------------------------------------------------------------------- run_pretrain

_ITER = re.compile(r"\biteration\s+(\d+)/\s*(\d+) \|")
_MS = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")
_LOSS = re.compile(r"\| lm loss: ([^\s|]+)")
_NAN_ITERS = re.compile(r"number of nan iterations:\s+(\d+)")
_SKIPPED_ITERS = re.compile(r"number of skipped iterations:\s+(\d+)")
_VAL = re.compile(r"validation[^|]*? loss at (.+?) \| lm loss value: ([^\s|]+)")
_LOCO = re.compile(r"(> LoCo.*?)\s*$")
_ARG_LINE = re.compile(r"^\s*\S+ \.{3,} ")  # megatron's argument dump: "  name ..... value"
_ERROR = re.compile(r"Traceback \(most recent call last\)|\b[A-Z]\w*(?:Error|Exception)\b"
                    r"|\berror\b:|\bERROR\b|exitcode\s*:\s*-?[1-9]|Signal \d+ \(SIG")
DP1 = "data-parallel size 1, no gradient is communicated"


def _float(s: str) -> Optional[float]:
    try:
        return float(s)
    except ValueError:
        return None


def parse_pretrain(text: str) -> Dict:
    """What a run_pretrain.sh log shows: the iteration lines (numbers, losses, ms), the last
    validation loss, LoCo's start-up lines, error lines, and whether gradients were compressed."""
    iters, ms, losses, nan_iters, skipped = [], [], [], 0, 0
    total, val, loco, errors, compressed = None, [], [], [], False
    for line in text.splitlines():
        m = _ITER.search(line)
        if m:
            iters.append(int(m[1]))
            total = int(m[2])
            t, loss = _MS.search(line), _LOSS.search(line)
            if t:
                ms.append(float(t[1]))
            if loss:
                losses.append(_float(loss[1]))
            c = _NAN_ITERS.search(line)
            nan_iters = max(nan_iters, int(c[1])) if c else nan_iters
            c = _SKIPPED_ITERS.search(line)
            skipped = max(skipped, int(c[1])) if c else skipped
            compressed |= "loco wire bytes per step" in line
            continue
        m = _VAL.search(line)
        if m:
            val.append({"at": m[1].strip(), "lm_loss": _float(m[2])})
            continue
        m = _LOCO.search(line)
        if m:
            if m[1] not in loco:
                loco.append(m[1])
            compressed |= bool(re.search(r"> LoCo: model chunk \d+: \d+ buckets", line))
            continue
        if not _ARG_LINE.match(line) and _ERROR.search(line):
            errors.append(line.strip()[:300])
    later = ms[1:] or ms  # the first logged interval includes the warm-up
    out = {"iterations_logged": iters, "last_iteration": iters[-1] if iters else 0,
           "train_iters": total, "last_loss": losses[-1] if losses else None,
           "first_loss": losses[0] if losses else None,
           "ms_per_iteration_median": statistics.median(later) if later else None,
           "ms_first_logged": ms[0] if ms else None, "nan_iterations": nan_iters,
           "skipped_iterations": skipped, "validation": val[-3:], "loco_lines": loco[:12],
           "errors": errors[:20], "error_count": len(errors), "compressed": compressed,
           "dp1_stock_path": any(DP1 in x for x in loco)}
    out["exercised"] = exercised_note(out)
    return out


def exercised_note(p: Dict) -> str:
    """One honest sentence on what the run exercised of LoCo."""
    if p["compressed"]:
        return ("LoCo compressed the gradient reduce-scatter (the iteration lines carry LoCo's "
                "wire bytes).")
    if p["dp1_stock_path"]:
        return ("LoCo was installed and configured (start-up line), but with one rank the "
                "data-parallel size is 1: megatron communicates no gradient, so nothing was "
                "compressed (the stock path ran). The Triton kernels were exercised in steps 1-2, "
                "the DP=1 compensated reduce-scatter on NCCL by pytest -m gpu.")
    if any(x.startswith("> LoCo off") for x in p["loco_lines"]):
        return "LoCo was off (its start-up line says so)."
    return "No LoCo start-up line in the log: the run did not get as far as installing LoCo."


def pretrain_status(rc: Optional[int], timed_out: bool, parsed: Dict, want_iters: int) -> str:
    if timed_out:
        return "timeout"
    loss = parsed["last_loss"]
    if (rc == 0 and parsed["last_iteration"] >= want_iters and not parsed["error_count"]
            and loss is not None and math.isfinite(loss)):
        return "pass"
    return "fail"


# ------------------------------------------------------------------------------------ rendering

def _f(x, spec=".3f", none="-"):
    if x is None:
        return none
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def status_word(step: Dict) -> str:
    s = step.get("status", "not run")
    return {"timeout": f"timed out after {_f(step.get('timeout_s'), '.0f')} s"}.get(s, s)


def render_throughput(d: Dict) -> List[str]:
    copy = (d.get("copy") or {}).get("GBps")
    md = [f"{d.get('bits', 4)}-bit, block {d.get('block')}, DP-{d.get('world')} table layout, "
          f"{d.get('error_storage', 'int8')} error buffer, beta {d.get('beta')}; implementation "
          f"`{d.get('impl')}`. GB/s = bucket bytes (elements x gradient dtype bytes) / median "
          f"time (CUDA events, after warm-up); decompress sums the {d.get('world')} received "
          f"chunks of one shard (AVG); apply adds every chunk's decoded weight difference to a "
          f"bucket of parameters of that dtype in place (`kernels.apply_chunks`, the "
          f"`--loco-param-bits` all-gather's last step). Device copy bandwidth (torch `copy_`, "
          f"read + write, "
          f"{_f((d.get('copy') or {}).get('bytes', 0) / 2 ** 20, '.0f')} MiB): "
          f"**{_f(copy, '.0f')} GB/s**. \"traffic\" = modelled bytes the call moves "
          f"(gradient, error codes and scales read and written, payload) / time, against copy "
          f"bandwidth: the roofline fraction.", "",
          "| gradient dtype | bucket MiB | elements | compress GB/s | / copy bw | compress "
          "traffic / copy bw | decompress GB/s | / copy bw | decompress traffic / copy bw | "
          "apply GB/s | apply traffic / copy bw | first calls s (compile) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def frac(x):
        return _f(x / copy if (x is not None and copy) else None)

    for r in d.get("rows", []):
        md.append(f"| {r['dtype']} | {r['MiB']} | {r['numel']:,} | {_f(r['compress_GBps'], '.1f')}"
                  f" | {frac(r['compress_GBps'])} | {frac(r.get('compress_traffic_GBps'))} | "
                  f"{_f(r['decompress_GBps'], '.1f')} | {frac(r['decompress_GBps'])} | "
                  f"{frac(r.get('decompress_traffic_GBps'))} | "
                  f"{_f(r.get('apply_GBps'), '.1f')} | {frac(r.get('apply_traffic_GBps'))} | "
                  f"{_f(r.get('compress_first_call_s'), '.2f')} / "
                  f"{_f(r.get('decompress_first_call_s'), '.2f')} / "
                  f"{_f(r.get('apply_first_call_s'), '.2f')} |")
    ceiling = d.get("static_ceiling") or {}
    if ceiling.get("error"):
        md.append(f"\nStatic issue ceiling: not computed ({ceiling['error']})")
    elif ceiling:
        parts = []
        for dtype in ("float32", "bfloat16"):
            c = ceiling.get(dtype) or {}
            best = max((r for r in d.get("rows", []) if r["dtype"] == dtype),
                       key=lambda r: r["MiB"], default=None)
            got = (f" (measured at {best['MiB']} MiB: {_f(best['compress_GBps'] / c['compress_GBps'])}"
                   f" / {_f(best['decompress_GBps'] / c['decompress_GBps'])} of it)"
                   if best and c else "")
            apply = (f", apply {_f(c.get('apply_GBps'), '.0f')} GB/s"
                     + (f" (measured: {_f(best['apply_GBps'] / c['apply_GBps'])} of it)"
                        if best and best.get("apply_GBps") and c.get("apply_GBps") else "")
                     if c.get("apply_GBps") else "")
            parts.append(f"{dtype} compress {_f(c.get('compress_GBps'), '.0f')} GB/s, "
                         f"decompress {_f(c.get('decompress_GBps'), '.0f')} GB/s{got}{apply}")
        md.append(f"\nStatic issue ceiling ({ceiling.get('arch')}, the compile check's "
                  f"warp-instructions per element; docs/kernels.md): " + "; ".join(parts) + ".")
    for e in d.get("errors", []):
        md.append(f"\nNot measured: {e}")
    return md


def render_kernels(d: Dict) -> List[str]:
    grids = [g for g in d.get("grids", []) if g]
    md = [f"`{d.get('impl')}` on CUDA against the torch reference on CUDA and on CPU: a DP-"
          f"{d.get('world')} bucket of {_f(d.get('numel'), ',')} elements, block {d.get('block')},"
          f" parameter cuts at {d.get('boundaries')}, {d.get('steps', 5)} compress steps "
          f"(beta {d.get('beta')}, reset at step {d.get('reset_step')}), int8 error storage; "
          f"payload, scales and error codes/scales compared bit for bit; every rank's "
          f"decompressed shard (AVG) within fp32 rounding. Grids: "
          f"{', '.join(grids) if grids else 'compress_bucket has no grid keyword (symmetric)'}.",
          "", "| grid | bits | gradient dtype | compress | decompress: bit-equal / max abs diff "
          "/ within fp32 rounding | ok |", "|---|---|---|---|---|---|"]
    for c in d.get("cases", []):
        if "error" in c:
            comp, dec = f"error: {c['error']}", "-"
        else:
            comp = "; ".join(f"{k}: {v}" for k, v in c["compress"].items())
            x = c["decompress"]
            dec = (f"{x['equal']}/{x['elements']} / {_f(x['max_abs_diff'], '.3g')} / "
                   f"{'yes' if x['within_bound'] else 'NO'}")
        md.append(f"| {c.get('grid') or 'symmetric'} | {c['bits']} | {c['dtype']} | {comp} | "
                  f"{dec} | {'yes' if c.get('ok') else 'NO'} |")
    return md


def render_pytest(d: Dict) -> List[str]:
    if not d.get("summary"):
        return ["No pytest summary line in the output (see the log)."]
    s = d["summary"]
    md = [f"`{d.get('command', 'pytest -m gpu')}`: **{s['passed']} passed, {s['failed']} failed, "
          f"{s['skipped']} skipped, {s['errors']} errors** ({s['deselected']} deselected) in "
          f"{_f(s['seconds'], '.1f')} s. Summary line: `{s['line']}`"]
    md += [f"* {x}" for x in s.get("failures", []) + s.get("skip_reasons", [])]
    return md


def render_pretrain(d: Dict) -> List[str]:
    p = d.get("parsed") or {}
    md = [f"`{d.get('command', 'run_pretrain.sh')}`" + (f"; {d['install']}" if d.get("install")
                                                        else ""), ""]
    if not p:
        return md + ["No log to parse."]
    md += [f"* iterations: {p['last_iteration']} of {p.get('train_iters') or d.get('iters')} "
           f"(logged: {', '.join(map(str, p['iterations_logged'])) or 'none'})",
           f"* lm loss: first logged {_f(p['first_loss'], '.4f')}, last {_f(p['last_loss'], '.4f')}"
           + "".join(f"; validation ({v['at']}): {_f(v['lm_loss'], '.4f')}"
                     for v in p.get("validation") or []),
           f"* elapsed ms per iteration: median {_f(p['ms_per_iteration_median'], '.1f')} over the "
           f"logged intervals after the first (first: {_f(p['ms_first_logged'], '.1f')})",
           f"* nan iterations {p['nan_iterations']}, skipped iterations {p['skipped_iterations']}",
           f"* what ran: {p['exercised']}"]
    md += ["", "LoCo start-up lines:", ""] + [f"    {x}" for x in p["loco_lines"] or ["(none)"]]
    if p["errors"]:
        md += ["", f"Error lines ({p['error_count']}, first {len(p['errors'])}):", ""]
        md += [f"    {x}" for x in p["errors"]]
    return md


def render_compile(d: Dict) -> List[str]:
    return [f"`{d.get('command')}`: exit {d.get('rc')}; its last lines (registers and spills "
            f"per variant, 64-bit addressing):", ""] + [f"    {x}" for x in d.get("tail", [])]


RENDER = {"throughput": render_throughput, "kernels": render_kernels, "compile": render_compile,
          "pytest": render_pytest, "pretrain": render_pretrain}
TITLES = {"throughput": "1. Triton kernel throughput vs copy bandwidth",
          "kernels": "2. Triton kernels against the torch reference (CUDA)",
          "compile": "3. Kernel compile check (sm_80, sm_90)",
          "pytest": "4. pytest -m gpu", "pretrain": "5. Main job on one GPU (run_pretrain.sh)"}


def render_markdown(res: Dict) -> str:
    m = res.get("machine", {})
    md = ["# GPU check", "",
          f"`{res.get('command', 'bash benchmarks/gpu_check.sh')}`, started {res.get('started')}, "
          f"{_f(res.get('seconds'), '.0f')} s of a {_f(res.get('budget_s'), '.0f')} s budget; "
          f"commit {m.get('commit', '?')}. What each step runs and how to read it: "
          f"docs/gpu_check.md.", "",
          "| machine | |", "|---|---|"]
    for key, label in (("gpu", "GPU"), ("gpu_memory", "GPU memory"), ("driver", "driver"),
                       ("driver_cuda", "CUDA (driver)"), ("torch", "torch"),
                       ("torch_cuda", "CUDA (torch build)"), ("triton", "triton"),
                       ("megatron_core", "megatron-core"), ("python", "python"),
                       ("host", "host")):
        md.append(f"| {label} | {m.get(key) or '-'} |")
    md += ["", "| step | status | seconds | timeout s | log |", "|---|---|---|---|---|"]
    for name, step in res.get("steps", {}).items():
        md.append(f"| {TITLES.get(name, name)} | {status_word(step)} | "
                  f"{_f(step.get('seconds'), '.0f')} | {_f(step.get('timeout_s'), '.0f')} | "
                  f"{step.get('log', '-')} |")
    for name, step in res.get("steps", {}).items():
        md += ["", f"## {TITLES.get(name, name)}", "", f"Status: **{status_word(step)}**"
               + (f". {step['note']}" if step.get("note") else ""), ""]
        if step.get("data"):
            md += RENDER[name](step["data"])
    return "\n".join(md) + "\n"


def write_report(res: Dict, out_md: Path) -> Path:
    """Write ``out_md`` and the same results as JSON beside it (``.json``); returns the JSON
    path."""
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text(render_markdown(res))
    out_json = out_md.with_suffix(".json")
    out_json.write_text(json.dumps(res, indent=1, default=str) + "\n")
    return out_json
