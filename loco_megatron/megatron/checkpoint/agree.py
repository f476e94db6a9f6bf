"""One decision on every rank when a checkpoint's LoCo state is loaded.

Each rank restores its own error buffers from what its DP group saved
(:func:`loco_megatron.megatron.checkpoint.state.apply`). But ranks of *different* DP groups hold
replicas of the same parameters: LayerNorm weights and row-parallel biases on every
tensor-parallel rank, the word embedding shared by the first and last pipeline stage. Their
gradients are equal, and stay equal after LoCo only if their error buffers, step counters
(which schedule the periodic reset and the ``--loco-start-iter`` warm-up) and resets are. After
a resume at another TP/PP/EP size each DP group finds different saved state, or none (the state
is keyed by DP group), so without agreement one TP rank reset and continued its counters while
another restarted them at zero, and the replicas drifted apart from the first reset on.

So a checkpoint load is a *round* (:func:`load_round`, opened by the checkpoint hooks around
megatron-core's load calls): every optimizer's outcome on this rank is recorded
(:func:`record`), and when the outermost round closes one ``all_gather_object`` over the ranks
that loaded decides for all of them:

* step counters: the largest saved counter, on every bucket of every rank (every bucket counts
  one per optimizer step, so they were equal when saved);
* error buffers: when the model-parallel layout changed (TP, PP, EP or expert-TP size) or some
  buckets were restored while others had to be reset, every rank resets every error buffer
  (exact or resharded restores are kept only where all ranks restored);
* messages: the same true lines on every rank, logged once (the group's rank 0);
* a rank whose load raised makes every rank raise (instead of the others training on or
  waiting in a collective the failed rank never joins).

The round's group is the one ``dist_checkpointing.load`` was given (``process_group``), else
every rank: a load by only some ranks (models on disjoint ranks of one job) is not supported.
"""

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch.distributed as dist

logger = logging.getLogger(__name__)

NO_STATE = "has no LoCo state"


@dataclass
class Outcome:
    """What :func:`state.apply` did for one optimizer on this rank.

    Attributes:
        notes: ``(logging level, text)`` to report.
        active: LoCo compresses in this run.
        had_state: the checkpoint held LoCo state for this optimizer.
        restored: buckets whose error buffers were restored (exact or from the summed form).
        reset: buckets whose error buffers were reset to zero.
        step: the largest step counter saved for this optimizer's buckets (None: none saved).
        saved_layout: the model-parallel layout saved with it (None: unknown, older format).
        source: checkpoint file or directory, for messages.
        reset_all: forgets every error buffer of the optimizer.
        set_steps: sets every bucket's step counter of the optimizer.
    """

    notes: List[Tuple[int, str]]
    active: bool
    had_state: bool
    restored: int
    reset: int
    step: Optional[int]
    saved_layout: Optional[Dict[str, int]]
    source: str
    reset_all: Callable[[], None] = field(repr=False, default=lambda: None)
    set_steps: Callable[[int], None] = field(repr=False, default=lambda step: None)

    def summary(self) -> dict:
        """The picklable part every rank sees."""
        return {"notes": self.notes, "active": self.active, "had_state": self.had_state,
                "restored": self.restored, "reset": self.reset, "step": self.step,
                "saved_layout": self.saved_layout, "source": self.source}


_ROUNDS: List[List[Outcome]] = []


def in_round() -> bool:
    """True inside :func:`load_round` (outcomes are then decided together)."""
    return bool(_ROUNDS)


def record(outcome: Outcome) -> None:
    """Add ``outcome`` to the open round (call only when :func:`in_round`)."""
    _ROUNDS[-1].append(outcome)


def model_parallel_layout() -> Optional[Dict[str, int]]:
    """``{"tp", "pp", "ep", "etp"}`` sizes of megatron-core's ``parallel_state``, or None when
    it is not initialised (megatron/core/parallel_state.py, 0.13-0.19)."""
    try:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return None
        return {"tp": ps.get_tensor_model_parallel_world_size(),
                "pp": ps.get_pipeline_model_parallel_world_size(),
                "ep": ps.get_expert_model_parallel_world_size(),
                "etp": ps.get_expert_tensor_parallel_world_size()}
    except (ImportError, AttributeError, AssertionError, RuntimeError):
        return None


@contextlib.contextmanager
def load_round(group=None):
    """Decide every LoCo load outcome recorded inside together (see the module docstring).

    Nested rounds join the outermost one. Collective over ``group`` (default: every rank) when
    the outermost round closes, also when the body raised (the error is shared, then re-raised).

    Raises:
        RuntimeError: another rank's load raised (its message is named).
    """
    if _ROUNDS:
        yield
        return
    _ROUNDS.append([])
    error: Optional[BaseException] = None
    try:
        yield
    except Exception as e:  # shared with the other ranks below, then re-raised
        error = e
        raise
    finally:
        outcomes = _ROUNDS.pop()
        if dist.is_available() and dist.is_initialized():
            _decide(outcomes, group, error)
        elif error is None:
            _apply_decision(outcomes, [o.summary() for o in outcomes], 0)


def _decide(outcomes: List[Outcome], group, error: Optional[BaseException]) -> None:
    mine = {"error": f"{type(error).__name__}: {error}" if error is not None else None,
            "views": [o.summary() for o in outcomes], "layout": model_parallel_layout()}
    gathered: List[Optional[dict]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if error is not None:
        return  # re-raised by load_round
    failed = [(rank, g["error"]) for rank, g in enumerate(gathered) if g["error"]]
    if failed:
        rank, message = failed[0]
        raise RuntimeError(f"LoCo: loading the checkpoint failed on rank {rank} of the group "
                           f"({message}); every rank stops instead of training on a partial "
                           f"load")
    views = [v for g in gathered for v in g["views"]]
    now = next((g["layout"] for g in gathered if g["layout"] is not None), None)
    _apply_decision(outcomes, views, dist.get_rank(group), now)


def _apply_decision(outcomes: List[Outcome], views: List[dict], rank: int,
                    now: Optional[Dict[str, int]] = None) -> None:
    """Apply the round's decision to this rank's ``outcomes`` given every rank's ``views``."""
    if not views:
        return
    steps = [v["step"] for v in views if v["step"] is not None]
    step = max(steps) if steps else None
    active = any(v["active"] for v in views)
    saved = next((v["saved_layout"] for v in views if v["saved_layout"] is not None), None)
    source = views[0]["source"]
    layout_changed = active and saved is not None and now is not None and saved != now
    partial = active and any(v["reset"] for v in views) and any(v["restored"] for v in views)
    notes = _distinct([n for v in views for n in v["notes"]])
    if any(v["had_state"] for v in views):  # untrue where another group found the state
        notes = [(level, text) for level, text in notes if NO_STATE not in text]
    counters = f"; step counters continue at {step}" if step else ""
    if layout_changed:
        notes = [(logging.WARNING, f"LoCo: model-parallel layout changed {_describe(saved)} -> "
                                   f"{_describe(now)} since {source}: error buffers are kept per "
                                   f"DP group and do not map onto the new layout, so every rank "
                                   f"resets them to zero{counters}")]
    elif partial:
        reasons = "; ".join(text for _, text in notes) or (
            f"LoCo: some error buffers of {source} could not be restored")
        notes = [(logging.WARNING, reasons
                  + f"; to keep replicas on other model-parallel ranks identical every rank "
                    f"resets its error buffers to zero{counters}")]
    for outcome in outcomes:
        if layout_changed or partial:
            outcome.reset_all()
        if step is not None and active:
            outcome.set_steps(step)
        outcome.notes = notes
    if rank == 0:
        for level, text in notes:
            logger.log(level, text)


def _distinct(notes: List[Tuple[int, str]]) -> List[Tuple[int, str]]:
    seen, out = set(), []
    for level, text in notes:
        if text not in seen:
            seen.add(text)
            out.append((level, text))
    return out


def _describe(layout: Dict[str, int]) -> str:
    return " ".join(f"{k.upper()}{v}" for k, v in layout.items())
