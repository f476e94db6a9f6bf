"""Wrappers that carry LoCo state through megatron-core's optimizer checkpoint calls.

Installed by :func:`loco_megatron.install` (and removed by ``uninstall``); both Megatron-LM's
``megatron.training.checkpointing`` and the main job reach them through megatron-core's own
calls:

==========================================================  =====================================
``DistributedOptimizer.sharded_state_dict``                 adds the ``"loco"`` entry (torch_dist)
``dist_checkpointing.load``                                 resolves and applies LoCo entries
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

from .. import compat
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
                or (not is_loading and not view.state.active)):
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
        return result
    return load_state_dict


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
            if chained and len(self.chained_optimizers) == 1:
                return result
            first_error = None
            for index, opt in _distributed_optimizers(self):
                view = OptimizerLoCo(opt, state)
                try:  # each load starts with a collective over its DP group: a rank that
                    torch_format.load(view, filename, index)  # failed still joins the next ones
                except Exception as e:  # noqa: BLE001 - re-raised below, after all of them
                    first_error = first_error or e
            if first_error is not None:
                raise first_error
            return result
    return load_parameter_state


def _wrap_dist_load(orig, state):
    @functools.wraps(orig)
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        if not dist_format.resolve_requests(sharded_state_dict, checkpoint_dir):
            return orig(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        # every rank: the LoCo entries applied at once, one decision (checkpoint.agree)
        with agree.load_round(kwargs.get("process_group")):
            loaded = orig(sharded_state_dict, checkpoint_dir, *args, **kwargs)
            dist_format.apply_loaded(loaded)
        return loaded
    return load


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
