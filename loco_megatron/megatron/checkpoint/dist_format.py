"""LoCo state in megatron-core distributed checkpoints (``--ckpt-format torch_dist``).

``DistributedOptimizer.sharded_state_dict`` (megatron/core/optimizer/distrib_optimizer.py) gets
a ``"loco"`` entry, with megatron's own key scheme ``loco.dp_group_idx_{i}.gbuf_idx_{g}.
bucket_idx_{b}`` (``ChainedOptimizer`` prefixes it like the rest):

* ``.meta``: a ``ShardedObject`` (one per TP/PP domain) with the fingerprint, DP size, bucket
  layout and step counters (:meth:`OptimizerLoCo.meta`);
* ``.exact.{codes,scales|values}``: each rank's error buffer under a leading DP axis,
  ``ShardedTensor.from_rank_offsets(key, data, (0, dp_rank, dp_size), prepend_axis_num=1)``
  (with several distributed-optimizer instances two leading axes, instance and DP rank:
  ``(0, instance, instances), (1, dp_rank, dp_size)``, ``prepend_axis_num=2``);
* ``.error_sum``: the DP-summed error in the ``dp_reshardable`` index space,
  global shape ``(numel_unpadded,)``, rank ``r`` holding ``[r * shard, (r + 1) * shard)``
  (summed over all instances too; instance 0 is the main replica).

Which of these a load can use depends on the checkpoint (DP size, presence of LoCo state), which
``sharded_state_dict(is_loading=True)`` cannot see. So the load template holds only a request and
the ``meta`` object; :func:`resolve_requests`, run by the wrapped ``dist_checkpointing.load``
(which knows the directory), reads the checkpoint's metadata and adds the ``ShardedTensor`` s of
the usable form, or drops ``meta`` when the checkpoint has no LoCo state.
``DistributedOptimizer.load_state_dict`` then hands the loaded entry to
:func:`loco_megatron.megatron.checkpoint.state.apply`.

Strict loads (``--dist-ckpt-strictness raise_all``, ``log_all``, ``return_all``) count every
checkpoint key no rank loads as missing. A load reads one error form, and a resume after a DP,
TP or bucket change reads fewer (or none) of the saved LoCo keys, so the saved forms are
optional: while the wrapped load runs, :func:`optional_loco_keys` hides from the strict check's
view of the checkpoint (``serialization.load_sharded_metadata``) the LoCo keys this rank does not
load. Keys it does load, and every other key, are checked as stock.
"""

import contextlib
import re
from typing import Dict, Iterator, List

import torch

from ...patching import PatchSet
from .. import compat
from .state import OptimizerLoCo

#: a LoCo key of a distributed checkpoint (any optimizer prefix a ChainedOptimizer adds)
LOCO_KEY = re.compile(r"(^|\.)loco\.(expert_)?dp_group_idx_\d+\.")
#: the patch set that makes unread LoCo keys optional during one strict load
OPTIONAL_KEYS_PATCH_SET = "loco-optional-keys"

REQUEST = "__loco__"
_mapping = compat.dist_checkpointing_mapping
#: views of the optimizers whose load template holds a request, by the optimizer's ``id``: applied by
#: :func:`apply_loaded` right after ``dist_checkpointing.load`` (one round on every rank)
PENDING_LOADS: Dict[int, OptimizerLoCo] = {}


def sharded_entry(view: OptimizerLoCo, is_loading: bool) -> Dict[str, object]:
    """The ``"loco"`` entry of ``view``'s optimizer sharded state dict (collective on save:
    the summed error is reduce-scattered over the DP group)."""
    m = _mapping()
    meta_key = f"{view.prefix}.meta"
    meta_replica = (0, view.instance, view.dp_rank)
    grid = _grid(view)
    if is_loading:
        PENDING_LOADS[id(view.optimizer)] = view  # the latest template of each optimizer
        request = {"active": view.state.active, "grid": grid, "view": id(view.optimizer),
                   "buckets": {r.name: {"error_numel": r.error_numel,
                                        "stages": {p: n for p, _, n in view.stages(r)},
                                        "numel_unpadded": r.numel_unpadded,
                                        "sum_range": r.sum_range} for r in view.buckets}}
        return {REQUEST: m.LocalNonpersistentObject(request),
                "meta": m.ShardedObject(meta_key, None, (1,), (0,), replica_id=meta_replica)}
    # megatron-core < 0.15 cannot save uneven sharded tensors: the exact form only there
    state = view.state_dict(None if compat.supports_uneven_sharded_tensors() else ["exact"])
    entry = {"meta": m.ShardedObject(meta_key, state["meta"], (1,), (0,), replica_id=meta_replica),
             "exact": {}, "sum": {}}
    for ref in view.buckets:
        base = f"{view.prefix}.{ref.name}"
        if ref.name in state["exact"]:
            entry["exact"][ref.name] = {
                field: _exact_tensor(f"{base}.exact.{field}", t, grid)
                for field, t in state["exact"][ref.name].items()}
        values = state["sum"].get(ref.name)
        if values is not None and values.numel():
            entry["sum"][ref.name] = _sum_tensor(f"{base}.error_sum", values, ref.numel_unpadded,
                                                 ref.sum_range[0], replica_id=view.instance)
    return entry


def _grid(view: OptimizerLoCo) -> List[List[int]]:
    """``[[rank, world], ...]`` of the exact form's leading axes: DP, or instance and DP."""
    dp = [view.dp_rank, view.dp_size]
    return [dp] if view.instances == 1 else [[view.instance, view.instances], dp]


def _exact_tensor(key: str, data: torch.Tensor, grid):
    offsets = [(axis, rank, world) for axis, (rank, world) in enumerate(grid)]
    return _mapping().ShardedTensor.from_rank_offsets(key, data, *offsets, replica_id=0,
                                                      prepend_axis_num=len(grid))


def _sum_tensor(key: str, data: torch.Tensor, numel_unpadded: int, start: int,
                replica_id: int = 0):
    return _mapping().ShardedTensor(
        key=key, data=data, dtype=data.dtype, local_shape=tuple(data.shape),
        global_shape=(numel_unpadded,), global_offset=(start,), axis_fragmentations=None,
        replica_id=replica_id, prepend_axis_num=0, allow_shape_mismatch=False, flattened_range=None)


def _requests(tree) -> Iterator[dict]:
    if isinstance(tree, dict):
        if REQUEST in tree:
            yield tree
        for v in tree.values():
            yield from _requests(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _requests(v)


def resolve_requests(sharded_state_dict, checkpoint_dir) -> int:
    """Turn every LoCo load request in ``sharded_state_dict`` into what ``checkpoint_dir``
    holds (in place). Returns the number of requests resolved."""
    m = _mapping()
    requests = list(_requests(sharded_state_dict))
    if not requests:
        return 0
    saved = compat.load_sharded_metadata(str(checkpoint_dir))
    for entry in requests:
        wrapped = entry[REQUEST]
        req = dict(wrapped.obj if isinstance(wrapped, m.LocalNonpersistentObject) else wrapped)
        meta_obj = entry["meta"]
        prefix = meta_obj.key[:-len(".meta")]
        req["source"] = str(checkpoint_dir)
        req.pop("applied", None)  # a template used for a second load applies again
        entry[REQUEST] = m.LocalNonpersistentObject(req)
        if meta_obj.unique_key not in saved:
            del entry["meta"]
            continue
        if not req["active"]:
            continue
        entry["exact"], entry["sum"] = {}, {}
        grid = req["grid"]
        for name, b in req["buckets"].items():
            base = f"{prefix}.{name}"
            exact = _saved_exact(saved, f"{base}.exact", grid, b["stages"])
            if exact is not None:
                entry["exact"][name] = {
                    f: _exact_tensor(f"{base}.exact.{f}", torch.empty(n, dtype=dtype), grid)
                    for f, (dtype, n) in exact.items()}
                continue
            sum_meta = saved.get(f"{base}.error_sum")
            if sum_meta is None or tuple(sum_meta.global_shape) != (b["numel_unpadded"],):
                continue
            start, stop = b["sum_range"]
            entry["sum"][name] = (
                _sum_tensor(f"{base}.error_sum", torch.empty(stop - start, dtype=sum_meta.dtype),
                            b["numel_unpadded"], start)
                if stop > start else m.LocalNonpersistentObject(torch.empty(0)))
    return len(requests)


def _saved_exact(saved, base: str, grid, stages: Dict[str, int]):
    """``{field: (dtype, local numel)}`` of an exact form saved on the same grid (DP size, and
    instances if several) holding every error buffer of ``stages`` (``{field prefix: numel}``,
    :meth:`OptimizerLoCo.stages`), else None."""
    worlds = [world for _, world in grid]
    out = {}
    for prefix, numel in stages.items():
        stage = f"{base}.{prefix}" if prefix else base
        for fields in (("codes", "scales"), ("values",)):
            metas = [saved.get(f"{stage}.{f}") for f in fields]
            if all(x is not None for x in metas):
                shapes = [tuple(x.global_shape) for x in metas]
                if all(list(s[:-1]) == worlds for s in shapes) and shapes[0][-1] == numel:
                    out.update({f"{prefix}.{f}" if prefix else f: (x.dtype, s[-1])
                                for f, x, s in zip(fields, metas, shapes)})
                    break
        else:
            return None
    return out


def apply_loaded(loaded) -> int:
    """Apply every LoCo entry of what ``dist_checkpointing.load`` returned to its optimizer
    (the wrapped load calls this inside a :func:`agree.load_round`, so all ranks take
    one decision); marks them applied for ``DistributedOptimizer.load_state_dict``. Returns
    the number applied."""
    count = 0
    for entry in _requests(loaded):
        req = entry[REQUEST]
        if (not isinstance(req, dict) or req.get("applied")
                or req.get("view") not in PENDING_LOADS):
            continue
        load_entry(PENDING_LOADS.pop(req["view"]), entry)
        req["applied"] = True
        count += 1
    return count


def load_entry(view: OptimizerLoCo, entry: dict) -> List[str]:
    """Apply a loaded ``"loco"`` entry (``{"meta", "exact", "sum"}``, the shape of
    :meth:`OptimizerLoCo.state_dict`) to ``view`` (:meth:`OptimizerLoCo.load_state_dict`)."""
    req = entry.get(REQUEST)
    if isinstance(req, dict) and req.get("applied"):
        return []  # already applied right after dist_checkpointing.load
    if not isinstance(req, dict) or "source" not in req:
        raise RuntimeError("LoCo: the distributed checkpoint was loaded without "
                           "loco_megatron's dist_checkpointing.load hook; call "
                           "loco_megatron.install() before loading")
    return view.load_state_dict(entry, req["source"])


def _sharded_keys(tree) -> set:
    """Keys of every ``ShardedBase`` (tensor or object) in a sharded state dict."""
    base = _mapping().ShardedBase
    if isinstance(tree, base):
        return {tree.key}
    if isinstance(tree, dict):
        return set().union(*(_sharded_keys(v) for v in tree.values())) if tree else set()
    if isinstance(tree, (list, tuple)):
        return set().union(*(_sharded_keys(v) for v in tree)) if tree else set()
    return set()


@contextlib.contextmanager
def optional_loco_keys(sharded_state_dict):
    """While the block runs, megatron-core's strict-load check does not see the LoCo keys of
    the checkpoint that ``sharded_state_dict`` (this rank's, resolved) does not load: saved
    error forms this resume does not use are optional, not missing (module docstring)."""
    serialization = compat.dist_checkpointing_serialization()
    stock = serialization.load_sharded_metadata
    loaded = _sharded_keys(sharded_state_dict)

    def load_sharded_metadata(*args, **kwargs):
        saved = stock(*args, **kwargs)
        return {k: v for k, v in saved.items()
                if v.key in loaded or not LOCO_KEY.search(v.key)}

    with PatchSet(OPTIONAL_KEYS_PATCH_SET).applied() as patches:
        patches.replace(serialization, "load_sharded_metadata", load_sharded_metadata)
        yield
