"""Convergence study: does compensation matter, and which? Full precision against 4-bit without
compensation, plain error feedback, LoCo, LoCo on the full-range grid and LoCo with the 4-bit
parameter all-gather, at two block sizes, over several seeds (BENCHMARKS.md).

Every run is Megatron's own training loop on the real default corpus (this Python's
standard-library sources, local BPE tokenizer, cached; benchmarks/convergence_runs.py launches
it as ``run_pretrain.sh`` does on 2 CPU ranks). Only the ``--loco-*`` flags and ``--seed``
differ between runs:

==============  ===================================================================  ==========
arm             flags                                                                 blocks
==============  ===================================================================  ==========
full            ``--loco-bits 16`` (stock megatron-core)                              (none)
nocomp          ``--loco-bits 4 --loco-reset-interval 1``: the error is zeroed        256, 4096
                before every step, so ``h_t = g_t`` (plain 4-bit quantization)
ef              ``--loco-bits 4 --loco-err-beta 0``: classic error feedback           256, 4096
loco            ``--loco-bits 4 --loco-err-beta 0.8``: LoCo's moving average          256, 4096
loco-fr         ``loco`` with ``--loco-grid full-range`` (DeepSpeed's 16-level grid)  256, 4096
loco+param      ``loco`` with ``--loco-param-bits 4`` (weight differences)           256, 4096
==============  ===================================================================  ==========

The compressed arms pin ``--loco-grid`` so that the study keeps its meaning whatever the
default. The statistics (differences paired by seed, mean ± standard error across seeds, 95%
Student-t intervals) are in benchmarks/convergence_stats.py, the tables and the plot in
benchmarks/convergence_report.py. The drift and zero-code columns come from the drift probe
(loco_megatron/drift_probe.py).

Size and learning rate (:data:`FULL`; the reasons are in the report's text, :data:`WHY`): the
runs must be long enough, and the step size large enough, for the compression penalty to stand
above seed-to-seed noise, and all runs must fit in about 45 minutes on 2 cores.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .convergence_report import markdown, plot
from .convergence_runs import RunFailed, RunResult, run_one  # noqa: F401 (re-exported)
from .convergence_stats import Key, summarize
from .launch import corpus_args
from .report import Section


@dataclass(frozen=True)
class Arm:
    """One arm of the study: report key, label and its ``--loco-*`` flags (block size apart)."""

    key: str
    label: str
    flags: Tuple[str, ...]


FULL_ARM = Arm("full", "full precision (stock, `--loco-bits 16`)", ("--loco-bits", "16"))
_SYM = ("--loco-grid", "symmetric")
ARMS = (
    Arm("nocomp", "4-bit, no compensation", ("--loco-bits", "4", "--loco-reset-interval", "1",
                                             *_SYM)),
    Arm("ef", "4-bit, error feedback (β = 0)", ("--loco-bits", "4", "--loco-err-beta", "0",
                                                *_SYM)),
    Arm("loco", "4-bit LoCo (β = 0.8)", ("--loco-bits", "4", "--loco-err-beta", "0.8", *_SYM)),
    Arm("loco-fr", "4-bit LoCo, full-range grid", ("--loco-bits", "4", "--loco-err-beta", "0.8",
                                                   "--loco-grid", "full-range")),
    Arm("loco+param", "4-bit LoCo + 4-bit parameter all-gather",
        ("--loco-bits", "4", "--loco-err-beta", "0.8", "--loco-param-bits", "4", *_SYM)),
)
#: the pairs ``(a, b)`` compared seed by seed at each block size (a relative to b)
COMPARISONS = (("loco", "ef"), ("ef", "nocomp"), ("loco", "nocomp"), ("loco-fr", "loco"),
               ("loco+param", "loco"))

#: run_pretrain.sh's model/optimizer defaults this study keeps unchanged
DEFAULT_ARGS = ("--split", "98,1,1", "--lr-decay-style", "cosine", "--weight-decay", "0.1",
                "--clip-grad", "1.0", "--use-distributed-optimizer")


@dataclass
class Config:
    """Model size, schedule, seeds and block sizes of the study (the same for every run)."""

    iters: int
    num_layers: int = 2
    hidden_size: int = 128
    heads: int = 4
    seq_length: int = 128
    micro_batch: int = 4
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 15
    eval_iters: int = 10
    last_k: int = 20          # final training loss: mean of the last K iterations
    timeout_s: float = 600.0  # per run
    nproc: int = 2
    seeds: Tuple[int, ...] = (1, 2, 3)
    blocks: Tuple[int, ...] = (256, 4096)
    arms: Tuple[str, ...] = field(default_factory=lambda: tuple(a.key for a in ARMS))

    def megatron_args(self) -> List[str]:
        """Flags for one run (data, TensorBoard, ``--seed`` and ``--loco-*`` flags come
        separately)."""
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


FULL = Config(iters=150)
QUICK = Config(iters=4, num_layers=1, hidden_size=64, seq_length=64, warmup=1, eval_iters=1,
               last_k=2, timeout_s=240.0, seeds=(1, 2), blocks=(256,))

#: why the study has the size and learning rate of :data:`FULL` (printed with the results)
WHY = ("run_pretrain.sh's learning rate (1e-3 cosine to 1e-4), 150 iterations. A probe before "
       "this study (one seed, block 4096, 150 iterations, this model and corpus) tried the "
       "pilot's 3e-3: full precision itself ended worse (training loss 6.306 against 6.068 at "
       "1e-3) and every 4-bit arm ended *below* it (no compensation -3.4%, error feedback "
       "-1.2%, LoCo -2.0%): quantization noise regularising an over-large step, not a "
       "compression penalty. At 1e-3 the same probe gave no compensation +1.10%, error "
       "feedback +0.52%, LoCo +0.26% above full precision, the pilot's order. Block 4096 is "
       "where absmax rounding zeroes most coordinates and compensation must carry them; block "
       "256 (the default) is where the penalty is smallest. 150 iterations keep the 33 runs "
       "within about 45 minutes on 2 cores.")


def plan(cfg: Config) -> List[Tuple[Arm, Optional[int], int]]:
    """The runs of the study, in order: per seed, full precision, then every arm per block."""
    arms = {a.key: a for a in ARMS}
    out = []
    for seed in cfg.seeds:
        out.append((FULL_ARM, None, seed))
        out += [(arms[key], block, seed) for block in cfg.blocks for key in cfg.arms]
    return out


def run_flags(arm: Arm, block: Optional[int]) -> List[str]:
    """The ``--loco-*`` flags of one run."""
    return [*arm.flags] + ([] if block is None else ["--loco-block-size", str(block)])


def run(quick: bool, workdir: Path, cfg: Optional[Config] = None,
        extra: Sequence[str] = ()) -> Section:
    """Run every training of the study and build the report section.

    Args:
        quick: a few iterations of a tiny model, 2 seeds, block 256 (exercises the code in
            minutes; numbers mean nothing).
        workdir: report folder; gets ``convergence.png`` and, while running, ``convergence-runs/``
            (removed after success, kept on failure for the logs).
        cfg: overrides the configuration (tests).
        extra: more Megatron flags for every run (tests: ``--mock-data ...`` instead of the corpus).

    Raises:
        RunFailed: a run failed (its command and log tail in the message).
    """
    cfg = cfg or (QUICK if quick else FULL)
    workdir = Path(workdir)
    runs_dir = workdir / "convergence-runs"
    shutil.rmtree(runs_dir, ignore_errors=True)
    data = [] if any(a in ("--mock-data", "--data-path") for a in extra) else corpus_args()
    results: Dict[Key, RunResult] = {}
    todo, t_start = plan(cfg), time.perf_counter()
    for i, (arm, block, seed) in enumerate(todo, 1):
        name = f"{arm.key}-b{block}-s{seed}" if block else f"{arm.key}-s{seed}"
        print(f"benchmarks: convergence: run {i}/{len(todo)} {name} ({cfg.iters} iterations)"
              f" ...", file=sys.stderr, flush=True)
        r = run_one(cfg, runs_dir / name.replace("+", "_"),
                    [*data, *extra, "--seed", str(seed), *run_flags(arm, block)])
        if arm is not FULL_ARM and r.drift is None:
            raise RunFailed(f"convergence run {name} compressed but wrote no drift-probe files "
                            f"under {runs_dir / name.replace('+', '_') / 'probe'} "
                            f"(loco_megatron/drift_probe.py; LOCO_DRIFT_PROBE not honoured?)")
        results[(arm.key, block, seed)] = r
        print(f"benchmarks: convergence: {name} done in {r.seconds:.0f} s (total "
              f"{time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
    summary = summarize(results, cfg.arms, cfg.blocks, cfg.seeds, cfg.last_k, [
        c for c in COMPARISONS if set(c) <= set(cfg.arms)])
    labels = {a.key: a.label for a in (FULL_ARM, *ARMS)}
    png = plot(results, cfg, labels, workdir / "convergence.png")
    shutil.rmtree(runs_dir, ignore_errors=True)
    note = "`--quick`: a smoke test of a few iterations; the numbers mean nothing." if quick else ""
    data_out = {"config": {k: v for k, v in vars(cfg).items()}, **summary,
                "train_loss": {f"{a}@{b}@{s}" if b else f"{a}@{s}": [r.train[i]
                                                                     for i in sorted(r.train)]
                               for (a, b, s), r in results.items()},
                "drift_series": {f"{a}@{b}@{s}": r.drift_series
                                 for (a, b, s), r in results.items() if b}}
    return Section(name="convergence", title="Convergence: compression against full precision, "
                   "across seeds",
                   markdown=markdown(summary, cfg, labels, WHY if not quick else "", note)
                   + f"\n\n![training loss]({png.name})",
                   data=data_out, files=[png.name])
