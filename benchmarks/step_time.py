"""Section step_time: end-to-end Megatron step time, stock megatron-core vs LoCo 4-bit (and LoCo
4-bit with the parameter all-gather as 4-bit weight differences, ``--loco-param-bits 4``), over an
emulated slow link between two "nodes" (network namespaces + veth + ``tc tbf``; netns.py).

Each run is Megatron's real training loop (``loco_megatron.training.pretrain_gpt``, CPU ranks, gloo)
started by ``torch.distributed.run`` in both namespaces (``--nnodes 2``, ``--nproc-per-node``
DP/2, master = namespace 0's veth address, ``GLOO_SOCKET_IFNAME`` = the namespace's veth end).
One run measures every rate: after its warm-up it measures ``measure`` iterations at the first
rate, then the link is re-shaped (``tc qdisc replace``) when the last of them is logged, one
transition iteration is dropped, and the next rate is measured. The runs of every mode
(:data:`MODES`) use the same model, data, seed and schedule. Everything that sizes
the section is in :data:`CONFIG`.
"""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from . import netns
from .launch import CPU_ARGS, corpus_args
from .report import Section
from .step_log import LogParser, summarize

REPO = Path(__file__).resolve().parent.parent
#: (name, LoCo flags) of each run per DP size
MODES = (("stock", ("--loco-bits", "16")), ("loco4", ("--loco-bits", "4")),
         ("loco4+param4", ("--loco-bits", "4", "--loco-param-bits", "4")))
CONFIG = {
    # section_budget_s: hard cap on the training runs (a run gets what is left; later runs are
    # skipped), run_timeout_s: cap per run. Each run costs ~45-60 s of Megatron start-up here.
    # fp32 parameters and gradients: on CPU ranks bf16 compute is slow (a bf16 backward took ~8x
    # the fp32 one here), which would make the step compute-bound; `bf16=True` is available
    # (bf16 parameters all-gathered in bf16, fp32 gradient reduce-scatter).
    "full": dict(rates=("1gbit", "10gbit"), dp=(2, 4), warmup=2, measure=6, run_timeout_s=300,
                 section_budget_s=1000,
                 model=dict(num_layers=1, hidden_size=1024, num_attention_heads=8, seq_length=8,
                            micro_batch_size=1, bf16=False)),
    "quick": dict(rates=("1gbit", "10gbit"), dp=(2,), warmup=2, measure=3, run_timeout_s=150,
                  section_budget_s=270,
                  model=dict(num_layers=1, hidden_size=512, num_attention_heads=8, seq_length=8,
                             micro_batch_size=1, bf16=False)),
}


def schedule(cfg: Dict) -> Tuple[int, List[Tuple[str, List[int]]]]:
    """``(train_iters, [(rate, measured iterations), ...])`` for one run of ``cfg``.

    Iterations 1..warmup are dropped (warmup >= 2: megatron-core 0.19 does not reset its timers
    at the first iteration, so iteration 2's timer block covers iterations 1-2); each later rate
    is preceded by one dropped transition iteration (the one running while the link is
    re-shaped).
    """
    if cfg["warmup"] < 2:
        raise ValueError("warmup must be >= 2 (iteration 2's timers include iteration 1)")
    it, segments = cfg["warmup"], []
    for i, rate in enumerate(cfg["rates"]):
        it += 1 if i else 0
        segments.append((rate, list(range(it + 1, it + cfg["measure"] + 1))))
        it += cfg["measure"]
    return it, segments


def megatron_args(cfg: Dict, dp: int, loco_flags, train_iters: int,
                  data: List[str]) -> List[str]:
    """Megatron-LM flags of one run (model, ``data`` flags, logging; no checkpoints, no
    evaluation)."""
    m = cfg["model"]
    return [
        *CPU_ARGS, "--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden_size"]),
        "--num-attention-heads", str(m["num_attention_heads"]),
        "--seq-length", str(m["seq_length"]), "--max-position-embeddings", str(m["seq_length"]),
        "--micro-batch-size", str(m["micro_batch_size"]),
        "--global-batch-size", str(m["micro_batch_size"] * dp),
        "--train-iters", str(train_iters), "--split", "98,1,1", "--lr", "1e-4", "--seed", "1234",
        "--use-distributed-optimizer", "--log-interval", "1", "--timing-log-level", "2",
        "--eval-interval", "1000000", "--eval-iters", "0",
        *data, *loco_flags] + (
        ["--bf16"] if m.get("bf16") else [])


def _veth_tx(pid: int, dev: str) -> Optional[int]:
    """tx bytes of ``dev`` in the network namespace of process ``pid`` (/proc/PID/net/dev)."""
    try:
        for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                return int(rest.split()[8])
    except (OSError, ValueError, IndexError):
        pass
    return None


def train_run(link: "netns.TwoNodeLink", cfg: Dict, dp: int, mode: str, data: List[str],
              port: int, log_dir: Path, timeout_s: float) -> Dict:
    """One Megatron run over ``link``, re-shaping it per :func:`schedule`; returns its figures.

    Returns ``{rate: summarize(...) + link_tx_bytes_per_step}`` plus ``startup_bytes`` and
    ``error`` (""), or ``error`` and ``node0_log``/``node1_log`` excerpts when it failed.
    """
    train_iters, segments = schedule(cfg)
    switch_after = {its[-1]: segments[i + 1][0] for i, (_, its) in enumerate(segments[:-1])}
    link.set_rate(segments[0][0])
    parser, tx, procs = LogParser(), {}, []
    args = megatron_args(cfg, dp, dict(MODES)[mode], train_iters, data)
    tag = f"dp{dp}-{mode}"
    for node in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=link.dev[node],
                   CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--node-rank", str(node), "--nproc-per-node", str(dp // 2),
               "--master-addr", link.addr[0], "--master-port", str(port),
               "-m", "loco_megatron.training.pretrain_gpt", *args]
        out = (subprocess.PIPE if node == 1
               else open(log_dir / f"{tag}.node0.log", "w"))  # noqa: SIM115 (closed below)
        procs.append(link.popen(node, cmd, env=env, cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, text=True))
        if node == 0:
            out.close()

    def read():  # node 1 hosts the last rank, which prints the iteration lines and timers
        with open(log_dir / f"{tag}.node1.log", "w") as f:
            for line in procs[1].stdout:
                f.write(line)
                it = parser.feed(line)
                if it is not None:
                    tx[it] = _veth_tx(procs[0].pid, link.dev[0])
                    if it in switch_after:
                        link.set_rate(switch_after[it])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline, error = time.monotonic() + timeout_s, ""
    while any(p.poll() is None for p in procs):  # a failed node ends the run (10 s grace)
        failed = [p.returncode for p in procs if p.poll() not in (None, 0)]
        if failed:
            deadline = min(deadline, time.monotonic() + 10)
        if time.monotonic() > deadline:
            error = f"timed out after {timeout_s:.0f} s" if not failed else ""
            break
        time.sleep(0.5)
    for p in procs:
        netns.kill_group(p)
        link.procs.remove(p)
    reader.join(timeout=30)
    # LoCo's start-up line comes from global rank 0, on node 0.
    node0 = LogParser().feed_text((log_dir / f"{tag}.node0.log").read_text(errors="replace"))
    result: Dict = {"startup_bytes": parser.startup_bytes or node0.startup_bytes,
                    "error": error}
    for rate, its in segments:
        if not all(i in parser.steps for i in its):
            result["error"] = result["error"] or (
                f"iterations {its[0]}-{its[-1]} missing from the log (exit codes "
                f"{[p.returncode for p in procs]}; logs in {log_dir})")
            continue
        r = summarize([parser.steps[i] for i in its])
        first, last = tx.get(its[0] - 1), tx.get(its[-1])
        if first is not None and last is not None:
            r["link_tx_bytes_per_step"] = (last - first) / len(its)
        result[rate] = r
    if result["error"]:
        for k in (0, 1):  # the launcher's summary hides the cause: keep error lines too
            lines = (log_dir / f"{tag}.node{k}.log").read_text(errors="replace").splitlines()
            result[f"node{k}_log"] = ([ln for ln in lines if ln.startswith("error:")
                                       or "Error" in ln][-4:] + lines[-4:])
    return result


def _fmt_bytes(n: Optional[float]) -> str:
    return "?" if n is None else f"{n / 2 ** 20:.2f} MiB"


def _ms(x: Optional[float]) -> str:
    return "?" if x is None else f"{x:.0f}"


def _num(x: Optional[float]) -> str:
    return "?" if x is None else f"{x:.1f}"


def _pct(x: Optional[float]) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def run(quick: bool, workdir: Path) -> Section:
    """Measure stock vs LoCo 4-bit step time for every (rate, DP) of :data:`CONFIG`."""
    sec = Section("step_time", "End-to-end step time over an emulated slow link")
    why = netns.unavailable()
    if why:
        sec.skipped = why
        return sec
    cfg = CONFIG["quick" if quick else "full"]
    log_dir = Path(workdir) / "step_time_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    data = corpus_args()
    try:
        link = netns.TwoNodeLink(cfg["rates"][0])
        link.open()
    except (subprocess.SubprocessError, OSError) as e:
        sec.skipped = f"could not build the two-namespace link: {getattr(e, 'stderr', '') or e}"
        return sec
    runs, rate_check, load = {}, {}, [None, None]
    try:
        for rate in cfg["rates"]:
            link.set_rate(rate)
            try:
                rate_check[rate] = link.measure_rate(nbytes=32 * 2 ** 20)
            except (RuntimeError, subprocess.SubprocessError) as e:  # report, keep measuring
                rate_check[rate] = None
                print(f"step_time: link check at {rate} failed: {e}", file=sys.stderr)
        port, end = 29600 + os.getpid() % 200, time.monotonic() + cfg["section_budget_s"]
        load[0] = os.getloadavg()[0]
        for dp in cfg["dp"]:
            for mode, _ in MODES:
                left = min(cfg["run_timeout_s"], end - time.monotonic())
                if left < 30:
                    runs[f"dp{dp}-{mode}"] = {"error": "not run: section time budget "
                                              f"({cfg['section_budget_s']} s) spent"}
                    continue
                print(f"step_time: DP={dp} {mode} ...", file=sys.stderr, flush=True)
                runs[f"dp{dp}-{mode}"] = train_run(link, cfg, dp, mode, data, port, log_dir,
                                                   left)
                port += 1
        load[1] = os.getloadavg()[0]
    finally:
        link.close()
    sec.data = {"config": cfg, "modes": {m: list(f) for m, f in MODES}, "rate_check_bytes_per_s": rate_check,
                "load_average_1min_start_end": load, "cpu_count": os.cpu_count(),
                "runs": runs, "logs": str(log_dir)}
    sec.markdown = _markdown(cfg, rate_check, runs, load)
    return sec


def _markdown(cfg: Dict, rate_check: Dict[str, Optional[float]], runs: Dict,
              load: Tuple[Optional[float], Optional[float]] = (None, None)) -> str:
    m = cfg["model"]
    check = "; ".join(f"`tbf rate {r}` → {v / 1e6:.0f} MB/s ({v * 8 / 1e9:.2f} Gbit/s)"
                      if v else f"`tbf rate {r}` → check failed" for r, v in rate_check.items())
    lines = [
        f"Megatron GPT ({m['num_layers']} layer, hidden {m['hidden_size']}, seq "
        f"{m['seq_length']}, micro-batch {m['micro_batch_size']} per rank, "
        + ("`--bf16`: bf16 parameters, all-gathered in bf16, gradients accumulated and "
           "reduce-scattered in fp32, " if m.get("bf16") else "fp32 parameters and gradients, ")
        + f"CPU ranks, gloo), distributed optimizer, **no** `--overlap-grad-reduce` (gradient "
        f"communication is not hidden). Two namespaces joined by a veth pair shaped with "
        f"`tc tbf` on both ends; DP/2 ranks per namespace. Medians over {cfg['measure']} "
        f"iterations after {cfg['warmup']} warm-up iterations; all rates in one run per "
        f"(DP, mode), the link re-shaped between them.", "",
        f"Link check (one TCP stream, namespace 0 → 1): {check}.", "",
        f"Host load (1-min load average at the first / after the last run): "
        f"{_num(load[0])} / {_num(load[1])} on {os.cpu_count()} CPUs, the benchmark's own ranks "
        f"included: the ranks (and anything else running) share the cores, so single steps "
        f"vary (per-iteration times are in `data`).", "",
        "| rate | DP | stock ms/step | LoCo ms/step | speedup (stock/LoCo) | grad-sync share "
        "stock | grad-sync share LoCo (wire part) | grad bytes/step/rank stock vs LoCo "
        "| link bytes/step (ns0→ns1) stock vs LoCo | param all-gather share stock / LoCo "
        "| LoCo + param 4-bit ms/step | speedup (stock/LoCo+param) | its param all-gather share "
        "| its param bytes/step/rank | its link bytes/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for dp in cfg["dp"]:
        st, lo = runs.get(f"dp{dp}-stock", {}), runs.get(f"dp{dp}-loco4", {})
        lp = runs.get(f"dp{dp}-loco4+param4", {})
        for r in (st, lo, lp):
            if r.get("error"):
                cause = [ln for ln in r.get("node0_log", []) + r.get("node1_log", [])
                         if ln.startswith("error:")][:1]
                notes.append(f"DP={dp}: run failed: {r['error']}"
                             + (f": `{cause[0]}`" if cause else ""))
        sb = (lo.get("startup_bytes") or (None, None))
        for rate in cfg["rates"]:
            s, c, q = st.get(rate, {}), lo.get(rate, {}), lp.get(rate, {})
            sms, cms, qms = (s.get("step_ms_median"), c.get("step_ms_median"),
                             q.get("step_ms_median"))
            speed = f"{sms / cms:.2f}x" if sms and cms else "?"
            qspeed = f"{sms / qms:.2f}x" if sms and qms else "?"
            lines.append(
                f"| {rate} | {dp} | {_ms(sms)} | {_ms(cms)} | {speed} "
                f"| {_pct(s.get('grad_sync_share'))} | {_pct(c.get('grad_sync_share'))} "
                f"({_pct(c.get('loco_comm_share'))}) "
                f"| {_fmt_bytes(sb[1])} vs {_fmt_bytes(c.get('loco_wire_bytes_per_step'))} "
                f"| {_fmt_bytes(s.get('link_tx_bytes_per_step'))} vs "
                f"{_fmt_bytes(c.get('link_tx_bytes_per_step'))} "
                f"| {_pct(s.get('params_all_gather_share'))} / "
                f"{_pct(c.get('params_all_gather_share'))} "
                f"| {_ms(qms)} | {qspeed} | {_pct(q.get('params_all_gather_share'))} "
                f"| {_fmt_bytes(q.get('param_gather_bytes_per_step'))} "
                f"| {_fmt_bytes(q.get('link_tx_bytes_per_step'))} |")
            link = s.get("link_tx_bytes_per_step")
            if dp == 2 and link and sb[1]:  # ns0 -> ns1 = rank 0's sends: RS + AG
                notes.append(f"{rate}, DP=2: stock sent {link / 2 ** 20:.1f} MiB/step over the "
                             f"link, {link / (2 * sb[1]):.2f}x the reduce-scatter + all-gather "
                             f"theory (2 x {sb[1] / 2 ** 20:.1f} MiB)")
    lines += ["", "Grad-sync share: Megatron's `all-grads-sync` timer (max over ranks; "
              "finish_grad_sync, i.e. the whole reduce-scatter, for LoCo including compression "
              "and decompression) / step time; the wire part is LoCo's `loco-comm` timer (min "
              "over ranks: the blocking all-to-all's transfer, without waiting for a slower "
              "rank's compression). Param all-gather: `params-all-gather` (fp32; the same in stock "
              "and LoCo; with `--loco-param-bits 4` the all-gather of 4-bit weight differences "
              "and their apply, its bytes from LoCo's telemetry). Grad bytes: exact "
              "reduce-scatter bytes per rank (stock: LoCo's start-up line; LoCo: its telemetry). "
              "Link bytes: veth counter, everything namespace 0 sent per step (both "
              "collectives, other ranks' traffic, TCP/IP headers). With 2 ranks per namespace, "
              "pairs inside one namespace talk over its own veth address, which the kernel "
              "routes locally (not shaped, not counted). Shared 2-core CPU: compute and "
              "LoCo's CPU compression compete with the other ranks, so LoCo can be slower."]
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])
