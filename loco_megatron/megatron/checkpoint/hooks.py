"""Wrappers that carry LoCo state through megatron-core's optimizer checkpoint calls.

Installed by :func:`loco_megatron.install` (and removed by ``uninstall``); both Megatron-LM's
``megatron.training.checkpointing`` and the main job reach them through megatron-core's own
calls:

==========================================================  =====================================
``DistributedOptimizer.sharded_state_dict``                 adds the ``"loco"`` entry (torch_dist)
``dist_checkpointing.load``                                 resolves and applies LoCo entries;
                                                            a model-only load's checksums first
``DistributedOptimizer.load_state_dict``                    applies a loaded ``"loco"`` entry
``DistributedOptimizer.save_parameter_state`` / ``load_``   per-rank LoCo files (torch format)
``ChainedOptimizer.save_parameter_state`` / ``load_``       the same, for several optimizers
==========================================================  =====================================

Every optimizer load also tells the ``--loco-param-bits`` path to resynchronise the replicas'
parameters exactly before its next weight difference
(:mod:`loco_megatron.megatron.param_sync`). With LoCo off (``--loco-bits 16/32``) only the
load side runs, to warn that a checkpoint's LoCo
state is ignored; nothing is saved and training is untouched.
"""

import functools

from .. import compat, param_reload
from . import agree, dist_format, torch_format
from .state import OptimizerLoCo


def _wrap_sharded_state_dict(orig, state):
    @functools.wraps(orig)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
        if model_sharded_state_dict is None:
            model_sharded_state_dict = {}
        result = orig(self, model_sharded_state_dict, is_loading, *args, **kwargs)
        view = OptimizerLoCo(self, state)
        sharding = (kwargs.get("metadata") or {}).get("distrib_optim_sharding_type")
        if (not isinstance(result, dict) or sharding == "fsdp_dtensor"
                or (not is_loading and not view.saves_state)):
            return result
        result["loco"] = dist_format.sharded_entry(view, is_loading)
        return result
    return sharded_state_dict


def _wrap_load_state_dict(orig, state):
    @functools.wraps(orig)
    def load_state_dict(self, state_dict):
        entry = None
        if isinstance(state_dict, dict) and "loco" in state_dict:
            entry = state_dict["loco"]
            state_dict = {k: v for k, v in state_dict.items() if k != "loco"}
        result = orig(self, state_dict)
        _parameters_loaded(state)
        view = OptimizerLoCo(self, state)
        if entry is not None:
            dist_format.load_entry(view, entry)
        _gather_after_mode_switch([self])
        return result
    return load_state_dict


def _gather_after_mode_switch(optimizers, agree_first: bool = False) -> None:
    """The checkpoint was saved with ``--loco-param-bits`` and this run gathers parameters as
    stock (marked by :func:`~loco_megatron.megatron.checkpoint.state.apply`): every replica
    takes the loaded main parameters now, not at the first all-gather
    (:func:`loco_megatron.megatron.param_reload.gather_loaded_params`). ``agree_first``: the
    ranks read their own files (``torch`` format, where expert parallelism spreads the DP
    group's files over directories), so the decision is all-reduced first; ``torch_dist`` ranks
    read one saved record."""
    for opt in optimizers:
        marked = bool(getattr(opt, "loco_gather_params_after_load", False))
        opt.loco_gather_params_after_load = False
        if param_reload.agreed(opt, marked) if agree_first else marked:
            param_reload.gather_loaded_params(opt)


def _parameters_loaded(state) -> None:
    """An optimizer load (main parameters, with the model's): with ``--loco-param-bits`` the
    next parameter all-gather first resynchronises the replicas' parameters exactly
    (:meth:`~loco_megatron.megatron.param_sync.ParamSync.invalidate`)."""
    if getattr(state, "param_sync", None) is not None:
        state.param_sync.invalidate()


def _distributed_optimizers(optimizer):
    DistributedOptimizer = compat.distributed_optimizer_class()
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    return [(i, opt) for i, opt in enumerate(chain) if isinstance(opt, DistributedOptimizer)
            and not getattr(opt, "is_stub_optimizer", False)]


def _wrap_save_parameter_state(orig, state, chained: bool):
    @functools.wraps(orig)
    def save_parameter_state(self, filename):
        orig(self, filename)
        if chained and len(self.chained_optimizers) == 1:
            return  # delegated to the DistributedOptimizer's own (wrapped) method
        for index, opt in _distributed_optimizers(self):
            torch_format.save(OptimizerLoCo(opt, state), filename, index)
    return save_parameter_state


def _wrap_load_parameter_state(orig, state, chained: bool):
    @functools.wraps(orig)
    def load_parameter_state(self, filename, *args, **kwargs):
        with agree.load_round():  # every rank: one decision (checkpoint.agree)
            result = orig(self, filename, *args, **kwargs)
            _parameters_loaded(state)
            first_error = None
            delegated = chained and len(self.chained_optimizers) == 1
            for index, opt in [] if delegated else _distributed_optimizers(self):
                view = OptimizerLoCo(opt, state)
                try:  # each load starts with a collective over its DP group: a rank that
                    torch_format.load(view, filename, index)  # failed still joins the next ones
                except Exception as e:  # noqa: BLE001 - re-raised below, after all of them
                    first_error = first_error or e
            if first_error is not None:
                raise first_error
        if not agree.in_round():  # the outermost load, decided on every rank: collectives now
            _gather_after_mode_switch([opt for _, opt in _distributed_optimizers(self)],
                                      agree_first=True)
        return result
    return load_parameter_state


def _wrap_dist_load(orig, state):
    @functools.wraps(orig)
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        if not dist_format.resolve_requests(sharded_state_dict, checkpoint_dir):
            # no optimizer state: a model-only load, whose tensors are loaded in place, so
            # the parameters' checksums are taken before (a full load restores the main
            # parameters itself, in place too: nothing to refresh from the model)
            param_reload.snapshot(state)
            return orig(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        param_reload.full_load(state)  # pending differences and an earlier snapshot are void
        # every rank: the LoCo entries applied at once, one decision (checkpoint.agree)
        with agree.load_round(kwargs.get("process_group")), \
                dist_format.optional_loco_keys(sharded_state_dict):
            loaded = orig(sharded_state_dict, checkpoint_dir, *args, **kwargs)
            dist_format.apply_loaded(loaded)
        return loaded
    return load


def checkpoint_holds_loco_state(load_dir, ckpt_step=None, non_persistent_dir=None) -> bool:
    """Whether a checkpoint Megatron-LM's ``--load load_dir`` may resume from holds LoCo state:
    LoCo files next to the ``torch`` format's optimizer files, or LoCo keys in a ``torch_dist``
    checkpoint's metadata. The candidates: iteration ``ckpt_step`` (``--ckpt-step``) when given,
    else the iterations the trackers name (``latest_checkpointed_iteration.txt`` of ``load_dir``,
    and of the non-persistent global checkpoints: ``non_persistent_dir``, default
    ``load_dir/non_persistent``). False when there is none. Megatron-LM's layout:
    megatron/training/checkpointing.py (``get_checkpoint_tracker_filename``,
    ``get_checkpoint_name``, ``_get_non_persistent_iteration``)."""
    import os

    if not load_dir:
        return False
    if ckpt_step is not None:
        iter_dirs = [os.path.join(load_dir, f"iter_{int(ckpt_step):07d}")]
    else:
        iter_dirs = [d for base in (load_dir, non_persistent_dir
                                    or os.path.join(load_dir, "non_persistent"))
                     for d in [_tracked_iteration(base)] if d is not None]
    return any(_iteration_holds_loco_state(d) for d in iter_dirs)


def _iteration_holds_loco_state(iter_dir: str) -> bool:
    import glob
    import os

    if glob.glob(os.path.join(glob.escape(iter_dir), "mp_rank_*", "loco_state_*.pt")):
        return True
    if not os.path.exists(os.path.join(iter_dir, ".metadata")):
        return False
    try:
        saved = compat.load_sharded_metadata(iter_dir)
    except Exception:  # noqa: BLE001 - not a readable torch_dist checkpoint: Megatron will say
        return False
    return any(dist_format.LOCO_KEY.search(v.key) for v in saved.values())


def _tracked_iteration(base: str):
    """The iteration directory ``base``'s tracker file names, or None."""
    import os

    try:
        with open(os.path.join(base, "latest_checkpointed_iteration.txt")) as f:
            tag = f.read().strip()
    except OSError:
        return None
    return os.path.join(base, "release" if tag == "release"
                        else f"iter_{int(tag):07d}" if tag.isdigit() else tag)


def forget_pending_loads() -> None:
    """Drop the optimizers of load templates that were never loaded (called by uninstall)."""
    dist_format.PENDING_LOADS.clear()


def patches(state):
    """``[(owner, attribute, wrapper factory)]`` that :func:`loco_megatron.install` applies;
    the wrappers act on ``state`` (the install's ``LoCoState``)."""
    DistributedOptimizer = compat.distributed_optimizer_class()
    ChainedOptimizer = compat.chained_optimizer_class()
    def bind(wrap, **kwargs):
        return functools.partial(wrap, state=state, **kwargs)

    return [
        (DistributedOptimizer, "sharded_state_dict", bind(_wrap_sharded_state_dict)),
        (DistributedOptimizer, "load_state_dict", bind(_wrap_load_state_dict)),
        (DistributedOptimizer, "save_parameter_state",
         bind(_wrap_save_parameter_state, chained=False)),
        (DistributedOptimizer, "load_parameter_state",
         bind(_wrap_load_parameter_state, chained=False)),
        (ChainedOptimizer, "save_parameter_state", bind(_wrap_save_parameter_state, chained=True)),
        (ChainedOptimizer, "load_parameter_state", bind(_wrap_load_parameter_state, chained=True)),
    ] + [(owner, "load", bind(_wrap_dist_load)) for owner in compat.dist_checkpointing_load_owners()]
