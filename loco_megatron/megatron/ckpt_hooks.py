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

With LoCo off (``--loco-bits 16/32``) only the load side runs, to warn that a checkpoint's LoCo
state is ignored; nothing is saved and training is untouched.
"""

import functools

from . import ckpt_agree, ckpt_dist, ckpt_torch, compat
from .ckpt_state import OptimizerLoCo


def _state():
    from .plugin import get_state

    return get_state()


def _view(optimizer):
    state = _state()
    return None if state is None else OptimizerLoCo(optimizer, state)


def _wrap_sharded_state_dict(orig):
    @functools.wraps(orig)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
        if model_sharded_state_dict is None:
            model_sharded_state_dict = {}
        result = orig(self, model_sharded_state_dict, is_loading, *args, **kwargs)
        view = _view(self)
        sharding = (kwargs.get("metadata") or {}).get("distrib_optim_sharding_type")
        if (view is None or not isinstance(result, dict) or sharding == "fsdp_dtensor"
                or (not is_loading and not view.state.active)):
            return result
        result["loco"] = ckpt_dist.sharded_entry(view, is_loading)
        return result
    return sharded_state_dict


def _wrap_load_state_dict(orig):
    @functools.wraps(orig)
    def load_state_dict(self, state_dict):
        entry = None
        if isinstance(state_dict, dict) and "loco" in state_dict:
            entry = state_dict["loco"]
            state_dict = {k: v for k, v in state_dict.items() if k != "loco"}
        result = orig(self, state_dict)
        view = _view(self)
        if entry is not None and view is not None:
            ckpt_dist.load_entry(view, entry)
        return result
    return load_state_dict


def _distributed_optimizers(optimizer):
    DistributedOptimizer = compat.distributed_optimizer_class()
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    return [(i, opt) for i, opt in enumerate(chain) if isinstance(opt, DistributedOptimizer)
            and not getattr(opt, "is_stub_optimizer", False)]


def _wrap_save_parameter_state(orig, chained: bool):
    @functools.wraps(orig)
    def save_parameter_state(self, filename):
        orig(self, filename)
        if chained and len(self.chained_optimizers) == 1:
            return  # delegated to the DistributedOptimizer's own (wrapped) method
        for index, opt in _distributed_optimizers(self):
            view = _view(opt)
            if view is not None:
                ckpt_torch.save(view, filename, index)
    return save_parameter_state


def _wrap_load_parameter_state(orig, chained: bool):
    @functools.wraps(orig)
    def load_parameter_state(self, filename, *args, **kwargs):
        with ckpt_agree.load_round():  # every rank: one decision (ckpt_agree)
            result = orig(self, filename, *args, **kwargs)
            if chained and len(self.chained_optimizers) == 1:
                return result
            first_error = None
            for index, opt in _distributed_optimizers(self):
                view = _view(opt)
                if view is None:
                    continue
                try:  # each load starts with a collective over its DP group: a rank that
                    ckpt_torch.load(view, filename, index)  # failed still joins the next ones
                except Exception as e:  # noqa: BLE001 - re-raised below, after all of them
                    first_error = first_error or e
            if first_error is not None:
                raise first_error
            return result
    return load_parameter_state


def _wrap_dist_load(orig):
    @functools.wraps(orig)
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        if not ckpt_dist.resolve_requests(sharded_state_dict, checkpoint_dir):
            return orig(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        # every rank: the LoCo entries applied at once, one decision (ckpt_agree)
        with ckpt_agree.load_round(kwargs.get("process_group")):
            loaded = orig(sharded_state_dict, checkpoint_dir, *args, **kwargs)
            ckpt_dist.apply_loaded(loaded)
        return loaded
    return load


def forget_pending_loads() -> None:
    """Drop the optimizers of load templates that were never loaded (called by uninstall)."""
    ckpt_dist.PENDING_LOADS.clear()


def patches():
    """``[(owner, attribute, wrapper factory)]`` that :func:`loco_megatron.install` applies."""
    DistributedOptimizer = compat.distributed_optimizer_class()
    ChainedOptimizer = compat.chained_optimizer_class()
    return [
        (DistributedOptimizer, "sharded_state_dict", _wrap_sharded_state_dict),
        (DistributedOptimizer, "load_state_dict", _wrap_load_state_dict),
        (DistributedOptimizer, "save_parameter_state",
         functools.partial(_wrap_save_parameter_state, chained=False)),
        (DistributedOptimizer, "load_parameter_state",
         functools.partial(_wrap_load_parameter_state, chained=False)),
        (ChainedOptimizer, "save_parameter_state",
         functools.partial(_wrap_save_parameter_state, chained=True)),
        (ChainedOptimizer, "load_parameter_state",
         functools.partial(_wrap_load_parameter_state, chained=True)),
    ] + [(owner, "load", _wrap_dist_load) for owner in compat.dist_checkpointing_load_owners()]
