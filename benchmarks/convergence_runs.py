"""Convergence study, one run: launch Megatron's training loop and read its losses and the drift
probe (benchmarks/convergence.py has the study; BENCHMARKS.md the results).

A run is ``loco_megatron.training.pretrain_gpt`` under ``torch.distributed.run`` (CPU ranks,
gloo, as ``run_pretrain.sh`` launches it without a GPU). The training loss of every iteration
comes from the TensorBoard event files the run writes (``lm loss``, exact fp32 values,
``--log-interval 1``; the printed iteration lines have 7 digits, and the one of iteration 2
averages iterations 1 and 2 because Megatron does not reset its accumulator after the first
line); the validation loss at the end from Megatron's ``validation loss at iteration N on
validation set`` line (TensorBoard writes the validation and test set under one tag). With LoCo
on, the run sets ``LOCO_DRIFT_PROBE`` (loco_megatron/drift_probe.py): every rank writes the
cumulative drift of its decoded codes and its zero-code fraction per step, read back here.
"""

from __future__ import annotations

import json
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

from .launch import CPU_ARGS

REPO = Path(__file__).resolve().parent.parent


@dataclass
class RunResult:
    """Losses and probe figures of one run.

    Attributes:
        train: iteration -> training loss (TensorBoard ``lm loss``).
        valid: validation loss after the last iteration.
        seconds: wall time of the run. iter_ms: median ms per iteration from the log.
        drift: final cumulative drift ``||sum deQ(c) - sum g|| / ||sum g||``, mean over ranks
            (None: nothing compressed).
        zero_fraction: share of zero codes among real elements, mean over steps and ranks.
        drift_series: ``[(step, drift)]`` of rank 0 (for the plot).
    """

    train: Dict[int, float]
    valid: float
    seconds: float = 0.0
    iter_ms: Optional[float] = None
    drift: Optional[float] = None
    zero_fraction: Optional[float] = None
    drift_series: List[Tuple[int, float]] = field(default_factory=list)


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


def launch_command(cfg, run_dir: Path, extra: Sequence[str], port: int) -> List[str]:
    """The ``torch.distributed.run`` command line of one run (as ``run_pretrain.sh`` builds it
    on a machine without a GPU)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--node-rank", "0",
            "--nproc-per-node", str(cfg.nproc), "--master-addr", "127.0.0.1",
            "--master-port", str(port), "-m", "loco_megatron.training.pretrain_gpt", *CPU_ARGS,
            *cfg.megatron_args(), "--tensorboard-dir", str(run_dir / "tensorboard"), *extra]


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def run_one(cfg, run_dir: Path, extra: Sequence[str]) -> RunResult:
    """Train once into ``run_dir`` (log.txt, tensorboard/, probe/) and read its losses and
    drift-probe figures.

    Raises:
        RunFailed: non-zero exit, timeout (the whole process group is killed) or missing results;
            the message has the command and the tail of the log.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "log.txt"
    cmd = launch_command(cfg, run_dir, extra, free_port())
    probe_dir = run_dir / "probe"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               CUDA_DEVICE_MAX_CONNECTIONS="1", LOCO_DRIFT_PROBE=str(probe_dir),
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
    try:
        drift, zeros, series = read_probe(probe_dir)
    except (OSError, ValueError, KeyError) as e:
        raise fail(f"finished but its drift probe files are unreadable: {e}") from None
    return RunResult(train, valid, seconds, parse_iteration_ms(text), drift, zeros, series)


def read_probe(folder: Path) -> Tuple[Optional[float], Optional[float], List[Tuple[int, float]]]:
    """The drift probe's files of one run (``drift-rank<R>.json``, loco_megatron/drift_probe.py).

    Returns:
        ``(drift, zero_fraction, series)``: the last step's drift averaged over ranks, the
        zero-code fraction averaged over every step of every rank, and rank 0's ``[(step,
        drift)]``; ``(None, None, [])`` when no rank wrote a file (LoCo off: nothing compressed).

    Raises:
        ValueError: the ranks recorded different step counts (a rank stopped early).
    """
    files = sorted(Path(folder).glob("drift-rank*.json"))
    if not files:
        return None, None, []
    data = [json.loads(f.read_text()) for f in files]
    steps = {d["steps"] for d in data}
    if len(steps) != 1:
        raise ValueError(f"ranks recorded different step counts {sorted(steps)} in {folder}")
    drift = sum(d["series"][-1][1] for d in data) / len(data)
    zeros = [row[2] for d in data for row in d["series"]]
    rank0 = min(data, key=lambda d: d["rank"])
    return drift, sum(zeros) / len(zeros), [(row[0], row[1]) for row in rank0["series"]]


