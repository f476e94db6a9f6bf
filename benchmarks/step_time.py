"""Section step_time: end-to-end Megatron step time over an emulated slow link, stock
megatron-core (three baselines) against LoCo 4-bit, each with communication overlap off and on.

Variants (:data:`VARIANTS`), each run with overlap off and with ``--overlap-grad-reduce
--overlap-param-gather`` and a ``--ddp-bucket-size`` that gives several buckets:

* (a) stock megatron-core (``--loco-bits 16``): gloo carries out ``reduce_scatter_tensor`` as
  an all-reduce, about twice an ideal reduce-scatter's bytes;
* (b) stock + ``--ddp-reduce-scatter-with-fp32-accumulation`` (megatron-core's all-to-all
  reduce-scatter: ideal bytes on gloo, the fair stand-in for NCCL's ring reduce-scatter);
* (c) (b) + ``--grad-reduce-in-bf16`` (bf16 gradients on the wire, fp32 accumulation);
* (d) LoCo 4-bit; (e) LoCo 4-bit + ``--loco-param-bits 4``;
* (f) LoCo 4-bit ``--loco-hierarchical`` (the two namespaces are the nodes; torchrun sets
  ``LOCAL_WORLD_SIZE`` = ranks per namespace).

Each run is Megatron's real training loop (``loco_megatron.training.pretrain_gpt``, CPU ranks,
gloo, ``--bf16``) started by ``torch.distributed.run`` in both namespaces (``--nnodes 2``,
``--nproc-per-node`` DP/2, master = namespace 0's veth address, ``GLOO_SOCKET_IFNAME`` = the
namespace's veth end). One run measures every rate: after its warm-up it measures ``measure``
iterations at the first rate, the link is re-shaped (``tc qdisc replace``) when the last of
them is logged, one transition iteration is dropped, and the next rate is measured. Every run
checks, from rank 0's log, that its flags reached Megatron (argument dump, megatron-core's DDP
config, megatron-core's and LoCo's start-up lines, bucket count: :func:`check_flags`); a run
where they did not is an error. Everything
that sizes the section is in :data:`CONFIG`; the tables are :mod:`.step_time_report`'s, the
plot :mod:`.step_time_plot`'s.
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
from .step_time_variants import (BY_KEY, VARIANTS, Variant, check_flags, expected_arguments,
                                 run_flags, run_key)


REPO = Path(__file__).resolve().parent.parent
CONFIG = {
    # section_budget_s: hard cap on the training runs (a run gets what is left; later runs are
    # skipped), run_timeout_s: cap per run. On 2 cores a DP-4 run of the full configuration
    # took 33-75 s with measure=6 (~25-50 s of Megatron start-up for 4 ranks, then 0.5-2 s per
    # iteration), 12 runs 9 min on a quiet machine; measure=10 adds 8 iterations per run.
    # --bf16: bf16 parameters
    # (all-gathered in bf16), gradients accumulated and reduce-scattered in fp32 unless
    # --grad-reduce-in-bf16. bucket_size: elements per bucket with overlap on (hidden 1024:
    # 4 buckets of ~4.2M, 4.2M, 4.2M, 8.4M elements; hidden 512: 4 of ~1M, 1M, 1M, 4.2M).
    "full": dict(rates=("1gbit", "10gbit"), dp=(4,), variants="abcdef", overlap=(False, True),
                 warmup=2, measure=10, run_timeout_s=240, section_budget_s=1380,
                 bucket_size=4_000_000,
                 model=dict(num_layers=1, hidden_size=1024, num_attention_heads=8, seq_length=8,
                            micro_batch_size=1, bf16=True)),
    "quick": dict(rates=("1gbit", "10gbit"), dp=(4,), variants="abd", overlap=(False, True),
                  warmup=2, measure=2, run_timeout_s=150, section_budget_s=420,
                  bucket_size=1_000_000,
                  model=dict(num_layers=1, hidden_size=512, num_attention_heads=8, seq_length=8,
                             micro_batch_size=1, bf16=True)),
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


def megatron_args(cfg: Dict, dp: int, flags, train_iters: int, data: List[str]) -> List[str]:
    """Megatron-LM flags of one run (model, ``data`` flags, logging, the run's ``flags``; no
    checkpoints, no evaluation)."""
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
        *data, *flags] + (["--bf16"] if m.get("bf16") else [])


def _veth_bytes(pid: int, dev: str) -> Optional[Tuple[int, int]]:
    """``(rx, tx)`` bytes of ``dev`` in the network namespace of process ``pid``."""
    try:
        for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                f = rest.split()
                return int(f[0]), int(f[8])
    except (OSError, ValueError, IndexError):
        pass
    return None


def train_run(link: "netns.TwoNodeLink", cfg: Dict, dp: int, variant: Variant, overlap: bool,
              data: List[str], port: int, log_dir: Path, timeout_s: float) -> Dict:
    """One Megatron run over ``link``, re-shaping it per :func:`schedule`; returns its figures.

    Returns ``{rate: summarize(...) + link_tx/rx_bytes_per_step}`` plus ``startup_bytes``,
    ``buckets``, ``megatron_args`` (the checked arguments as Megatron printed them),
    ``flag_mismatches`` and ``error`` ("" when it ran as intended; else the cause, with
    ``node0_log``/``node1_log`` excerpts).
    """
    train_iters, segments = schedule(cfg)
    switch_after = {its[-1]: segments[i + 1][0] for i, (_, its) in enumerate(segments[:-1])}
    link.set_rate(segments[0][0])
    parser, counters, procs = LogParser(), {}, []
    args = megatron_args(cfg, dp, run_flags(cfg, variant, overlap), train_iters, data)
    tag = run_key(dp, variant.key, overlap)
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
                    counters[it] = _veth_bytes(procs[0].pid, link.dev[0])
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
    # rank 0 (node 0) prints the argument dump, the DDP config and LoCo's start-up lines
    node0 = LogParser().feed_text((log_dir / f"{tag}.node0.log").read_text(errors="replace"))
    mismatches = check_flags(node0, cfg, dp, variant, overlap)
    result: Dict = {"variant": variant.key, "overlap": overlap, "flags": run_flags(
        cfg, variant, overlap), "startup_bytes": parser.startup_bytes or node0.startup_bytes,
        "buckets": sum(node0.buckets) or None, "flag_mismatches": mismatches,
        "megatron_args": {k: node0.arguments.get(k)
                          for k in expected_arguments(cfg, dp, variant, overlap)},
        "error": error}
    for rate, its in segments:
        if not all(i in parser.steps for i in its):
            result["error"] = result["error"] or (
                f"iterations {its[0]}-{its[-1]} missing from the log (exit codes "
                f"{[p.returncode for p in procs]}; logs in {log_dir})")
            continue
        r = summarize([parser.steps[i] for i in its])
        first, last = counters.get(its[0] - 1), counters.get(its[-1])
        if first is not None and last is not None:
            r["link_rx_bytes_per_step"] = (last[0] - first[0]) / len(its)
            r["link_tx_bytes_per_step"] = (last[1] - first[1]) / len(its)
        result[rate] = r
    if mismatches and not result["error"]:
        result["error"] = "flags did not reach Megatron: " + "; ".join(mismatches)
    if result["error"]:
        for k in (0, 1):  # the launcher's summary hides the cause: keep error lines too
            lines = (log_dir / f"{tag}.node{k}.log").read_text(errors="replace").splitlines()
            result[f"node{k}_log"] = ([ln for ln in lines if ln.startswith("error:")
                                       or "Error" in ln][-4:] + lines[-4:])
    return result


def run(quick: bool, workdir: Path) -> Section:
    """Measure every (DP, overlap, variant) of :data:`CONFIG` at every rate; table + plot."""
    from .step_time_plot import plot
    from .step_time_report import markdown

    sec = Section("step_time", "End-to-end step time over an emulated slow link")
    why = netns.unavailable()
    if why:
        sec.skipped = why
        return sec
    cfg = CONFIG["quick" if quick else "full"]
    workdir = Path(workdir)
    log_dir = workdir / "step_time_logs"
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
            for overlap in cfg["overlap"]:
                for key in cfg["variants"]:
                    name, left = run_key(dp, key, overlap), min(cfg["run_timeout_s"],
                                                                end - time.monotonic())
                    if left < 30:
                        runs[name] = {"variant": key, "overlap": overlap, "error": "not run: "
                                      f"section time budget ({cfg['section_budget_s']} s) spent"}
                        continue
                    print(f"step_time: {name} ...", file=sys.stderr, flush=True)
                    t0 = time.monotonic()
                    runs[name] = train_run(link, cfg, dp, BY_KEY[key], overlap, data, port,
                                           log_dir, left)
                    runs[name]["run_seconds"] = round(time.monotonic() - t0, 1)
                    port += 1
        load[1] = os.getloadavg()[0]
    finally:
        link.close()
    sec.data = {"config": cfg, "variants": {v.key: {"name": v.name, "flags": list(v.flags)}
                                            for v in VARIANTS},
                "rate_check_bytes_per_s": rate_check, "load_average_1min_start_end": load,
                "cpu_count": os.cpu_count(), "runs": runs, "logs": str(log_dir)}
    png = plot(cfg, runs, workdir / "step_time.png")
    sec.files = [png.name] if png else []
    sec.markdown = markdown(cfg, rate_check, runs, load, png.name if png else None)
    return sec
