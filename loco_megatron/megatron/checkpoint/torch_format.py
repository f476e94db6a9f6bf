"""LoCo state in megatron's plain ``torch`` checkpoint format (``--ckpt-format torch``).

megatron-core saves the distributed optimizer's parameter state with
``DistributedOptimizer.save_parameter_state(filename)`` (one ``distrib_optim.pt`` per TP/PP
rank, gathered on DP rank 0; megatron/core/optimizer/distrib_optimizer.py). LoCo's error buffers
are per DP rank and as large as a bf16 model / 2, so instead of gathering them every rank
writes its own file next to it::

    <iter dir>/mp_rank_XX[_YYY]/loco_state_<optimizer index>_dp<DP rank>.pt
        {"meta": ..., "exact": {bucket: {codes, scales} | {values}},
         "sum": {bucket: {"start": int, "values": fp32}}}

(see :mod:`loco_megatron.megatron.checkpoint.state` for the fields). Files are written to a temporary
name and renamed, so a failed save never leaves a half-written file under the final name, and
megatron only points ``latest_checkpointed_iteration.txt`` at an iteration after every rank's
save returned. On load, a rank reads its own file (same DP size) or the files whose shards of
the summed error overlap its new shard (DP size changed), memory-mapped.

Several distributed-optimizer instances: instance ``k > 0`` writes ``..._dp<rank>_inst<k>.pt``
with its exact error buffers; the summed error (over all instances) is in instance 0's files.
Expert parallelism: Megatron-LM gives each EP rank its own directory, so the dense optimizer's
files are spread over them; the metadata is read from the lowest DP rank's file in this
directory. A DP-size change then needs other directories' files and is refused (missing file):
resume such runs at a new DP size from ``torch_dist``.
"""

import glob
import os
import re
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .state import OptimizerLoCo, validate_meta


def sidecar_path(filename: str, index: int, dp_rank: int, instance: int = 0) -> str:
    """Path of DP rank ``dp_rank``'s LoCo file next to megatron's ``distrib_optim.pt``
    (distributed-optimizer instance ``instance`` > 0: ``..._dp<rank>_inst<instance>.pt``, its
    exact error buffers only; the summed error, over all instances, is in instance 0's files)."""
    suffix = f"_inst{instance}" if instance else ""
    return os.path.join(os.path.dirname(filename),
                        f"loco_state_{index}_dp{dp_rank:03d}{suffix}.pt")


def save(view: OptimizerLoCo, filename: str, index: int) -> Optional[str]:
    """Write this rank's LoCo file (collective over the DP group). Returns its path, or None
    when there is nothing to save (LoCo off, DP size 1: :attr:`OptimizerLoCo.saves_state`)."""
    if not view.saves_state:
        if view.dp_rank == 0:  # no LoCo file may survive from an earlier save here
            for path in _rank_files(filename, index).values():
                os.remove(path)
        return None
    state = view.state_dict()  # collective (the summed error): every instance takes part
    meta = state["meta"]
    exact = {name: {k: t.detach().cpu().clone() for k, t in fields.items()}
             for name, fields in state["exact"].items()}
    sums = {} if view.instance else {  # the sum over every instance: in instance 0's files
        ref.name: {"start": ref.sum_range[0], "values": state["sum"][ref.name].detach().cpu().clone()}
        for ref in view.buckets if ref.name in state["sum"]}
    if view.dp_rank == 0:  # files of ranks beyond this DP size are stale (an earlier save)
        for rank, path in _rank_files(filename, index).items():
            if rank >= view.dp_size:
                os.remove(path)
    path = sidecar_path(filename, index, view.dp_rank, view.instance)
    write_atomically({"meta": meta, "exact": exact, "sum": sums}, path)
    return path


def write_atomically(obj, path: str) -> None:
    """``torch.save(obj)`` to a temporary file next to ``path``, then rename it over ``path``:
    a failed write (disk full, directory not writable, quota) leaves ``path`` as it was (an
    earlier save's file, or none) and no partial file behind. Temporary files of ``path`` that a
    killed save left (``<path>.tmp<pid>``) are removed first.

    Raises:
        OSError: with the original errno, naming ``path`` and what to do.
    """
    tmp = f"{path}.tmp{os.getpid()}"
    for stale in glob.glob(glob.escape(path) + ".tmp*"):  # a save killed mid-write left it
        try:
            os.remove(stale)
        except OSError:
            pass
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save's C++ writer raises RuntimeError
        message = (f"LoCo could not write its checkpoint file {path} "
                   f"({getattr(e, 'strerror', None) or e}): is the disk full or the checkpoint "
                   f"directory not writable? This checkpoint is incomplete; megatron's previous "
                   f"checkpoint (latest_checkpointed_iteration.txt) is untouched. Free space or "
                   f"fix the permissions of --save and resume from it.")
        errno = getattr(e, "errno", None)
        raise (OSError(errno, message) if errno else OSError(message)) from e
    finally:
        try:
            if os.path.exists(tmp):
                os.remove(tmp)
        except OSError:
            pass


def _read(path: str, expected_meta: Optional[dict] = None) -> Dict[str, object]:
    """Load a LoCo file (memory-mapped); with ``expected_meta``, check that it belongs to the
    same save as DP rank 0's file."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # truncated / not a torch file
        raise ValueError(f"LoCo checkpoint file {path} cannot be read ({type(e).__name__}: "
                         f"{e}); it is truncated or corrupted. Restore it, or delete every "
                         f"loco_state_*.pt of this iteration to resume with zero error buffers.") from e
    if not isinstance(state, dict) or not {"meta", "exact", "sum"} <= set(state):
        raise ValueError(f"LoCo checkpoint file {path}: expected keys meta, exact, sum; got "
                         f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
    validate_meta(state["meta"], path)
    if expected_meta is not None and state["meta"] != expected_meta:
        raise ValueError(f"LoCo checkpoint file {path} does not belong to the same save as "
                         f"DP rank 0's file (DP size {state['meta']['dp_size']} vs "
                         f"{expected_meta['dp_size']}, or other step counters/layout): a stale "
                         f"file from an earlier save into this directory?")
    return state


def load(view: OptimizerLoCo, filename: str, index: int) -> List[str]:
    """Restore this rank's error buffers from the LoCo files next to ``filename`` by the resume
    policy (:func:`loco_megatron.megatron.checkpoint.state.apply`). Returns the messages logged.

    Raises:
        ValueError: a truncated or malformed file (naming the file and key), or a missing file
            of a rank whose summed-error shard is needed.
    """
    own = sidecar_path(filename, index, view.dp_rank, view.instance)
    leader = _first_rank_here(view, filename)
    first = sidecar_path(filename, index, leader)
    # messages name the checkpoint's iteration directory, the same on every rank (the
    # mp_rank_XX directory differs per TP/PP/EP rank); errors name the file
    source = os.path.dirname(os.path.dirname(os.path.abspath(filename)))
    if not os.path.exists(first):
        others = _rank_files(filename, index)
        if others:
            raise ValueError(f"LoCo checkpoint file {first} (DP rank {leader}'s, with the metadata) is "
                             f"missing while {os.path.basename(next(iter(others.values())))} "
                             f"exists; restore it, "
                             f"or delete every loco_state_{index}_dp*.pt to resume with zero "
                             f"error buffers")
        return view.load_state_dict(None, source)
    try:
        meta = _read(first)["meta"]
    except ValueError:
        if view.state.active:
            raise
        # LoCo off ignores the error buffers, as stock does; whether the parameter all-gather
        # sent weight differences is unknown, so the parameters are gathered exactly
        meta = {"forms": ["unread"], "unread": True}
    if not view.state.active:  # the record only (warnings, --loco-param-bits switches)
        return view.load_state_dict({"meta": meta}, source)
    exact = sums = None
    data_file = first
    if meta["dp_size"] == view.dp_size and meta.get("instances", 1) == view.instances:
        if not os.path.exists(own):
            raise ValueError(f"LoCo checkpoint file {own} is missing (saved at DP size "
                             f"{meta['dp_size']}, every rank wrote one)")
        exact, data_file = _read(own, meta)["exact"], own
    padding_changed = any(meta["buckets"].get(r.name, {}).get("error_numel") != r.error_numel
                          for r in view.buckets)
    if "sum" in meta["forms"] and (exact is None or padding_changed):
        sums = _gather_sums(view, meta, filename, index)
    return view.load_state_dict({"meta": meta, "exact": exact, "sum": sums}, source, data_file)


def _first_rank_here(view: OptimizerLoCo, filename: str) -> int:
    """Lowest DP rank whose files are next to ``filename`` (collective over the DP group).
    Usually 0; with expert parallelism Megatron-LM gives each EP rank its own
    ``mp_rank_XX[_YYY]_EEE`` directory, so the dense optimizer's DP group writes to several."""
    here = os.path.abspath(os.path.dirname(filename))
    dirs = [None] * view.dp_size
    dist.all_gather_object(dirs, here, group=view.group)
    return dirs.index(here)


def _rank_files(filename: str, index: int) -> Dict[int, str]:
    """``{DP rank: path}`` of every ``loco_state_<index>_dp<rank>.pt`` next to ``filename``."""
    found = {}
    for path in glob.glob(os.path.join(os.path.dirname(filename), f"loco_state_{index}_dp*.pt")):
        match = re.fullmatch(rf"loco_state_{index}_dp(\d+)\.pt", os.path.basename(path))
        if match:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def _gather_sums(view: OptimizerLoCo, meta: dict, filename: str, index: int):
    """This rank's range of the summed error, read from the old ranks' files."""
    old_dp, files, sums = meta["dp_size"], {}, {}
    for ref in view.buckets:
        saved = meta["buckets"].get(ref.name)
        if saved is None or saved["numel_unpadded"] != ref.numel_unpadded:
            continue
        start, stop = ref.sum_range
        old_shard = saved["numel"] // old_dp
        out = torch.zeros(stop - start, dtype=torch.float32)
        for q in range(start // old_shard, min(old_dp, -(-stop // old_shard))) if stop > start else ():
            path = sidecar_path(filename, index, q)
            if path not in files:
                if not os.path.exists(path):
                    raise ValueError(f"LoCo checkpoint file {path} is missing: the checkpoint "
                                     f"was saved at DP size {old_dp} and rank {q}'s shard of "
                                     f"the summed error is needed")
                files[path] = _read(path, meta)
            entry = files[path]["sum"].get(ref.name)
            where = f"{path} key {ref.name}.sum"
            if not isinstance(entry, dict) or not isinstance(entry.get("values"), torch.Tensor):
                raise ValueError(f"LoCo checkpoint {where}: missing or malformed")
            s0, vals = int(entry["start"]), entry["values"]
            lo, hi = max(start, s0), min(stop, s0 + vals.numel())
            if lo < hi:
                out[lo - start:hi - start] = vals[lo - s0:hi - s0].float()
        sums[ref.name] = out
    return sums
