"""Convergence: loss after N steps, full precision vs 4-bit without compensation vs plain error
feedback vs LoCo (BENCHMARKS.md).

Four runs of Megatron's own training loop (``loco_megatron.training.pretrain_gpt`` under
``torch.distributed.run``, 2 CPU ranks with gloo, as ``run_pretrain.sh`` launches it) on the real
default corpus (this Python's standard-library sources, local BPE tokenizer, cached), with the same
steps, seed and data; only the ``--loco-*`` flags differ:

==================  ================================================  ==========================
run                 flags                                             gradient reduce-scatter
==================  ================================================  ==========================
full precision      ``--loco-bits 16``                                stock megatron-core
4-bit, no comp.     ``--loco-bits 4 --loco-reset-interval 1``         ``h_t = g_t`` (error zeroed
                                                                      before every step)
error feedback      ``--loco-bits 4 --loco-err-beta 0``               ``e_t = h_t - deQ(Q(h_t))``
LoCo                ``--loco-bits 4 --loco-err-beta 0.8`` (default)   moving-average error
==================  ================================================  ==========================

The training loss of every iteration comes from the TensorBoard event files the runs write
(``lm loss``, exact fp32 values, ``--log-interval 1``; the printed iteration lines have 7
digits, and the one of iteration 2 averages iterations 1 and 2 because Megatron does not reset
its accumulator after the first line); the validation loss at the end from
Megatron's ``validation loss at iteration N on validation set`` line (TensorBoard writes the
validation and test set under one tag), checked against the event file.

The launch is replicated here rather than calling ``run_pretrain.sh``, which runs ``install.sh``
first (that may pip-install into the shared environment); the model flags are
``run_pretrain.sh``'s defaults with a smaller model and fewer steps so that the four runs fit in
minutes on a 2-core machine (tests check the defaults still match the script).

Size (measured on the 2-core machine, shared with other jobs at the time): a 2-layer, hidden-128
GPT, sequence 128, global batch 8, 300 iterations at ``run_pretrain.sh``'s learning-rate schedule
(1e-3 cosine to 1e-4, here 20 warmup iterations): 240-350 ms per iteration, ~20 s start-up and
evaluation, 110-170 s per run, 9 minutes for the four runs under load (less when idle). At that
size 4-bit without compensation ends measurably above full precision (+0.3 %). A probe at a 3x
learning rate (3e-3 to 3e-4) was worse for full precision itself and put every 4-bit run *below*
full precision (quantization noise helping an over-large step size), so the default schedule stays.
A 600-iteration probe (same schedule stretched) kept the picture: vs full precision, training
loss +0.22 % without compensation, +0.31 % error feedback, +0.17 % LoCo. The runs are deterministic: two full runs at different machine loads gave bit-identical losses.
"""

from __future__ import annotations

import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .launch import CPU_ARGS, corpus_args
from .report import Section

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Variant:
    """One of the four runs: report key, label and its ``--loco-*`` flags."""

    key: str
    label: str
    flags: Tuple[str, ...]


VARIANTS = (
    Variant("full", "full precision (stock, `--loco-bits 16`)", ("--loco-bits", "16")),
    Variant("nocomp", "4-bit, no compensation (`--loco-reset-interval 1`)",
            ("--loco-bits", "4", "--loco-reset-interval", "1")),
    Variant("ef", "4-bit, plain error feedback (`--loco-err-beta 0`)",
            ("--loco-bits", "4", "--loco-err-beta", "0")),
    Variant("loco", "4-bit LoCo (`--loco-err-beta 0.8`, default)",
            ("--loco-bits", "4", "--loco-err-beta", "0.8")),
)

#: run_pretrain.sh's model/optimizer defaults this benchmark keeps unchanged
DEFAULT_ARGS = ("--split", "98,1,1", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
                "--clip-grad", "1.0", "--seed", "1234", "--use-distributed-optimizer")


@dataclass
class Config:
    """Model size and schedule of the four runs (the same for all of them)."""

    iters: int
    num_layers: int = 2
    hidden_size: int = 128
    heads: int = 4
    seq_length: int = 128
    micro_batch: int = 4
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 20
    eval_iters: int = 10
    last_k: int = 20          # final training loss: mean of the last K logged iterations
    timeout_s: float = 600.0  # per run
    nproc: int = 2

    def megatron_args(self) -> List[str]:
        """Flags for one run (data, TensorBoard and ``--loco-*`` flags come separately)."""
        return [*DEFAULT_ARGS,
                "--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden_size),
                "--num-attention-heads", str(self.heads), "--seq-length", str(self.seq_length),
                "--max-position-embeddings", str(self.seq_length),
                "--micro-batch-size", str(self.micro_batch),
                "--global-batch-size", str(self.micro_batch * self.nproc),
                "--train-iters", str(self.iters), "--lr", repr(self.lr),
                "--min-lr", repr(self.min_lr), "--lr-warmup-iters", str(self.warmup),
                "--log-interval", "1",
                # no in-loop evaluation: only Megatron's final one on the validation set
                "--eval-interval", str(self.iters + 1), "--eval-iters", str(self.eval_iters)]


FULL = Config(iters=300)
QUICK = Config(iters=3, num_layers=1, hidden_size=64, seq_length=64, warmup=1, eval_iters=1,
               last_k=2, timeout_s=240.0)


@dataclass
class RunResult:
    """Losses of one run."""

    train: Dict[int, float]           # iteration -> training loss (TensorBoard ``lm loss``)
    valid: float                      # validation loss after the last iteration
    seconds: float = 0.0
    iter_ms: Optional[float] = None   # median elapsed time per iteration from the log


class RunFailed(RuntimeError):
    """A training run exited non-zero, timed out or logged incomplete results."""


# ---------------------------------------------------------------- parsing


def read_scalars(tb_dir: Path) -> Dict[str, List[Tuple[int, float]]]:
    """All scalar series of the TensorBoard event files under ``tb_dir``: tag -> [(step, value)]
    in the order written."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    files = sorted(Path(tb_dir).rglob("events.out.tfevents.*"))
    if not files:
        raise RunFailed(f"no TensorBoard event file under {tb_dir}")
    out: Dict[str, List[Tuple[int, float]]] = {}
    for f in files:
        acc = ea.EventAccumulator(str(f), size_guidance={ea.SCALARS: 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, float(e.value)) for e in acc.Scalars(tag))
    return out


def train_losses(scalars: Dict[str, List[Tuple[int, float]]], iters: int) -> Dict[int, float]:
    """Training loss per iteration (tag ``lm loss``); raises unless iterations 1..iters are all
    there exactly once."""
    series = scalars.get("lm loss", [])
    losses = dict(series)
    if len(losses) != len(series) or sorted(losses) != list(range(1, iters + 1)):
        steps = sorted(s for s, _ in series)
        raise RunFailed(f"TensorBoard 'lm loss' has iterations {steps[:3]}...{steps[-3:]} "
                        f"({len(series)} values), expected 1..{iters} once each")
    return losses


def parse_validation(log: str, iters: int) -> float:
    """The loss of Megatron's ``validation loss at iteration <iters> on validation set`` line."""
    marker = f"validation loss at iteration {iters} on validation set |"
    for line in log.splitlines():
        if marker in line:
            rest = line.split(marker, 1)[1]
            for part in rest.split("|"):
                part = part.strip()
                if part.startswith("lm loss value:"):
                    return float(part.split(":", 1)[1])
    raise RunFailed(f"no '{marker.rstrip(' |')}' line with an lm loss value in the log")


def parse_iteration_ms(log: str) -> Optional[float]:
    """Median ``elapsed time per iteration (ms)`` over the logged iterations after the first."""
    vals = []
    for line in log.splitlines():
        if "elapsed time per iteration (ms):" in line:
            try:
                vals.append(float(line.split("elapsed time per iteration (ms):", 1)[1]
                                  .split("|", 1)[0]))
            except ValueError:
                pass
    vals = sorted(vals[1:]) or vals
    return vals[len(vals) // 2] if vals else None


# ---------------------------------------------------------------- running


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(cfg: Config, run_dir: Path, extra: Sequence[str], port: int) -> List[str]:
    """The ``torch.distributed.run`` command line of one run (as ``run_pretrain.sh`` builds it
    on a machine without a GPU)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--node-rank", "0",
            "--nproc-per-node", str(cfg.nproc), "--master-addr", "127.0.0.1",
            "--master-port", str(port), "-m", "loco_megatron.training.pretrain_gpt", *CPU_ARGS,
            *cfg.megatron_args(), "--tensorboard-dir", str(run_dir / "tensorboard"), *extra]


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_one(cfg: Config, run_dir: Path, extra: Sequence[str]) -> RunResult:
    """Train once into ``run_dir`` (log.txt, tensorboard/) and read its losses.

    Raises:
        RunFailed: non-zero exit, timeout (the whole process group is killed) or missing results;
            the message has the command and the tail of the log.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "log.txt"
    cmd = launch_command(cfg, run_dir, extra, free_port())
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               CUDA_DEVICE_MAX_CONNECTIONS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                          if p))
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=cfg.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    seconds = time.perf_counter() - t0
    text = log_path.read_text(errors="replace")

    def fail(why: str) -> RunFailed:
        return RunFailed(f"convergence run in {run_dir} {why}\ncommand: {shlex.join(cmd)}\n"
                         f"--- last lines of {log_path} ---\n{_tail(text)}")

    if rc is None:
        raise fail(f"timed out after {cfg.timeout_s:.0f} s")
    if rc != 0:
        raise fail(f"exited with status {rc}")
    try:
        train = train_losses(read_scalars(run_dir / "tensorboard"), cfg.iters)
        valid = parse_validation(text, cfg.iters)
    except RunFailed as e:
        raise fail(f"finished but its results are incomplete: {e}") from None
    return RunResult(train, valid, seconds, parse_iteration_ms(text))


# ---------------------------------------------------------------- summary


def final_loss(train: Dict[int, float], k: int) -> Tuple[float, float]:
    """Mean training loss over the last ``k`` logged iterations and its standard error
    (sample std / sqrt(k); 0 for k = 1)."""
    vals = [train[i] for i in sorted(train)[-k:]]
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return mean, math.sqrt(var / len(vals))


def paired(a: Dict[int, float], b: Dict[int, float], k: int) -> Tuple[float, float]:
    """Relative difference of run ``a`` to run ``b`` over the last ``k`` iterations, from the
    per-iteration differences (same batches in both runs, so most of the batch-to-batch noise
    cancels): ``(mean(a_i - b_i) / mean(b_i), se(a_i - b_i) / mean(b_i))``. The first value
    equals ``rel`` of the two :func:`final_loss` means."""
    its = sorted(set(a) & set(b))[-k:]
    d = {i: a[i] - b[i] for i in its}
    mean_d, se_d = final_loss(d, k)
    mean_b = sum(b[i] for i in its) / len(its)
    return mean_d / mean_b, se_d / mean_b


def rel(a: float, b: float) -> float:
    """Relative difference ``(a - b) / b``."""
    return (a - b) / b


def acceptance(loss: Dict[str, float], tol: float = 0.01) -> Dict[str, object]:
    """The acceptance check on one loss per run: LoCo within ``tol`` of full precision (|relative
    difference| <= tol) and strictly lower than 4-bit without compensation."""
    vs_full = rel(loss["loco"], loss["full"])
    vs_nocomp = rel(loss["loco"], loss["nocomp"])
    within = abs(vs_full) <= tol
    lower = loss["loco"] < loss["nocomp"]
    return {"loco_vs_full": vs_full, "loco_vs_nocomp": vs_nocomp, "within_tol": within,
            "lower_than_nocomp": lower, "met": within and lower, "tol": tol}


def summarize(results: Dict[str, RunResult], k: int) -> Dict[str, object]:
    """Per-run final losses and the acceptance check on the training and validation loss."""
    rows = {}
    for key, r in results.items():
        mean, se = final_loss(r.train, k)
        rows[key] = {"train": mean, "train_se": se, "valid": r.valid, "seconds": r.seconds,
                     "iter_ms": r.iter_ms}
    for key, row in rows.items():
        row["paired_vs_full"] = paired(results[key].train, results["full"].train, k)
    return {"rows": rows, "k": min(k, min(len(r.train) for r in results.values())),
            "paired_loco_vs_nocomp": paired(results["loco"].train, results["nocomp"].train, k),
            "train": acceptance({key: row["train"] for key, row in rows.items()}),
            "valid": acceptance({key: row["valid"] for key, row in rows.items()})}


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def markdown(summary: Dict[str, object], cfg: Config, extra_note: str = "") -> str:
    """The section's body: setup, table, acceptance."""
    rows, k = summary["rows"], summary["k"]
    full = rows["full"]
    lines = [f"{cfg.iters} iterations, same seed (1234) and data for all runs: GPT "
             f"{cfg.num_layers} layers x hidden {cfg.hidden_size}, {cfg.heads} heads, seq "
             f"{cfg.seq_length}, global batch {cfg.micro_batch * cfg.nproc} "
             f"({cfg.nproc} CPU ranks, gloo, distributed optimizer), lr {cfg.lr:g} cosine to "
             f"{cfg.min_lr:g} after {cfg.warmup} warmup iterations; real default corpus "
             "(Python stdlib sources, BPE vocab 8192). Final training loss: mean of the last "
             f"{k} iterations (± standard error); validation loss: Megatron's final evaluation "
             f"({cfg.eval_iters} batches). ms/iter: median from Megatron's log, for the "
             "runtime only (CPU emulation, machine possibly shared; the step-time section "
             "measures speed).", "",
             "| run | final train loss | vs full | vs full, paired ± se | validation loss "
             "| vs full | ms/iter |",
             "|---|---|---|---|---|---|---|"]
    for v in VARIANTS:
        r = rows[v.key]
        ms = f"{r['iter_ms']:.0f}" if r["iter_ms"] is not None else "?"
        lines.append(f"| {v.label} | {r['train']:.4f} ± {r['train_se']:.4f} | "
                     f"{_pct(rel(r['train'], full['train']))} | "
                     f"{_pct(r['paired_vs_full'][0])} ± {100 * r['paired_vs_full'][1]:.2f}% | "
                     f"{r['valid']:.4f} | "
                     f"{_pct(rel(r['valid'], full['valid']))} | {ms} |")
    lines.append("")
    for name, what in (("train", "final training loss"), ("valid", "validation loss")):
        a = summary[name]
        lines.append(
            f"- Acceptance on the {what}: LoCo vs full precision {_pct(a['loco_vs_full'])} "
            f"({'within' if a['within_tol'] else 'NOT within'} {100 * a['tol']:g}%), "
            f"LoCo vs 4-bit without compensation {_pct(a['loco_vs_nocomp'])} "
            f"({'lower' if a['lower_than_nocomp'] else 'NOT lower'}): "
            f"**{'met' if a['met'] else 'not met'}**.")
    d, se = summary["paired_loco_vs_nocomp"]
    lines += ["", f"Noise: the runs see the same batches, so the per-iteration differences over "
              f"the last {k} iterations give a standard error for a difference (\"paired ± se\"). "
              f"It is a lower bound on the noise: it misses seed-to-seed variation (one seed "
              f"here), so a difference within a few se of zero is not evidence of anything. "
              f"LoCo vs 4-bit without compensation, paired: {_pct(d)} ± {100 * se:.2f}%."]
    lines += ["", "4-bit without compensation is `--loco-reset-interval 1`: the compensator "
              "zeroes the error buffer before every step after the first (and it starts at zero), "
              "so `h_t = g_t + 0 = g_t` and only plain 4-bit quantization remains "
              "(loco_megatron/compensator.py, `Compensator.compress`). Error feedback and LoCo "
              "keep the default reset interval (1024), longer than these runs."]
    if extra_note:
        lines += ["", extra_note]
    return "\n".join(lines)


def plot(results: Dict[str, RunResult], path: Path, window: int = 10) -> Path:
    """PNG of training loss vs iteration for every run (raw, faint; moving average, solid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dax) = plt.subplots(2, 1, figsize=(8, 8), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 2]})
    labels = {v.key: v.label.replace("`", "") for v in VARIANTS}
    for i, (key, r) in enumerate(results.items()):
        its = sorted(r.train)
        vals = [r.train[s] for s in its]
        color = f"C{i}"
        ax.plot(its, vals, color=color, alpha=0.25, linewidth=0.8)
        w = max(1, min(window, len(vals)))
        smooth = [sum(vals[max(0, j - w + 1):j + 1]) / len(vals[max(0, j - w + 1):j + 1])
                  for j in range(len(vals))]
        ax.plot(its, smooth, color=color, linewidth=1.6,
                label=f"{labels.get(key, key)} (val {r.valid:.3f})")
    base = results.get("full")
    if base is not None:
        for i, (key, r) in enumerate(results.items()):
            if key == "full":
                continue
            its = sorted(set(r.train) & set(base.train))
            diff = [r.train[s] - base.train[s] for s in its]
            w = max(1, min(4 * window, len(diff)))
            smooth = [sum(diff[max(0, j - w + 1):j + 1]) / len(diff[max(0, j - w + 1):j + 1])
                      for j in range(len(diff))]
            dax.plot(its, smooth, color=f"C{i}", linewidth=1.4, label=labels.get(key, key))
        dax.axhline(0.0, color="C0", linewidth=1.0)
        dax.set_ylabel(f"loss - full precision\n(mean of last {4 * window})")
        dax.grid(True, alpha=0.3)
    dax.set_xlabel("iteration")
    ax.set_ylabel(f"training loss (faint: raw, solid: mean of last {window})")
    ax.set_title("loco-megatron convergence: Python stdlib corpus, 2 CPU ranks")
    ax.grid(True, alpha=0.3)
    ax.legend()
    # the first iterations dwarf the differences at the end: zoom on the last 80%
    tail = [v for r in results.values() for s, v in r.train.items()
            if s > max(r.train) * 0.2]
    if tail and len(next(iter(results.values())).train) >= 20:
        lo, hi = min(tail), max(tail)
        ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- entry point


def run(quick: bool, workdir: Path, cfg: Optional[Config] = None,
        extra: Sequence[str] = ()) -> Section:
    """Run the four trainings and build the report section.

    Args:
        quick: a few iterations of a tiny model (exercises the code; numbers mean nothing).
        workdir: report folder; gets ``convergence.png`` and, while running, ``convergence-runs/``
            (removed after success, kept on failure for the logs).
        cfg: overrides the configuration (tests).
        extra: more Megatron flags for every run (tests: ``--mock-data ...`` instead of the corpus).
    """
    import shutil

    cfg = cfg or (QUICK if quick else FULL)
    workdir = Path(workdir)
    runs_dir = workdir / "convergence-runs"
    shutil.rmtree(runs_dir, ignore_errors=True)
    data = [] if any(a in ("--mock-data", "--data-path") for a in extra) else corpus_args()
    results: Dict[str, RunResult] = {}
    for v in VARIANTS:
        print(f"benchmarks: convergence: {v.key} ({cfg.iters} iterations) ...", file=sys.stderr,
              flush=True)
        results[v.key] = run_one(cfg, runs_dir / v.key, [*data, *extra, *v.flags])
        print(f"benchmarks: convergence: {v.key} done in {results[v.key].seconds:.0f} s",
              file=sys.stderr, flush=True)
    summary = summarize(results, cfg.last_k)
    png = plot(results, workdir / "convergence.png")
    shutil.rmtree(runs_dir, ignore_errors=True)
    note = "`--quick`: a smoke test of a few iterations; the numbers mean nothing." if quick else ""
    data_out = {"config": {k: v for k, v in vars(cfg).items()}, **summary,
                "train_loss": {k: [r.train[i] for i in sorted(r.train)]
                               for k, r in results.items()}}
    return Section(name="convergence", title="Convergence: loss after N steps",
                   markdown=markdown(summary, cfg, note) + f"\n\n![training loss]({png.name})",
                   data=data_out, files=[png.name])
