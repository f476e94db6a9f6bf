"""Megatron-Bridge owners of the fixes :mod:`loco_megatron.training.workarounds` makes for
``megatron.training``: Bridge has its own copies of the calls they replace.

* ``megatron.bridge.training.initialize.compile_helpers`` (imported by name there from
  megatron/core/datasets/utils.py): Bridge's ``initialize_megatron`` runs ``make`` for the
  dataset helper on local rank 0 and exits when it fails; the megatron-core wheel ships the
  compiled helper but no Makefile (any hardware). Skipped when the prebuilt helper imports
  (:func:`skip_helper_build_when_prebuilt`).
* ``megatron.bridge.training.initialize._warmup_jit_function``: under the CPU emulation the
  warm-up's torch.compile looks for libcuda (:func:`skip_jit_warmup`).
* Without Transformer Engine or apex (megatron-core's torch AdamW fallback, e.g. CPU ranks):
  ``megatron.bridge.training.checkpointing.load_checkpoint`` gets the dummy optimizer states
  before a load that megatron.training's ``load_checkpoint`` gets
  (:func:`init_torch_optimizer_states_before_load`), and megatron-core's
  ``DistributedOptimizer`` the bit-exact resume fixes
  (:func:`loco_megatron.training.workarounds.fix_torch_adamw_resume`, the same owner).

* ``megatron.bridge.training.setup.setup_logging``: with Bridge's default
  ``logger.filter_warnings=True`` it adds a filter dropping every WARNING record to each
  existing logger (megatron/training/utils/log_utils.py ``add_filter_to_all_loggers``), which
  would silence LoCo's own warnings (a DP-size change on resume, error buffers reset, NaN/Inf
  gradients): LoCo's loggers get that filter removed again (:func:`keep_loco_warnings`).

All go through the process's one workaround patch set (``loco-workarounds``).
"""

import os
from typing import List

import torch

from ..training import workarounds


def skip_helper_build_when_prebuilt() -> None:
    """Make Bridge's ``compile_helpers()`` a no-op when the compiled dataset helper imports
    (megatron/bridge/training/initialize.py); megatron-core's own build otherwise."""
    import megatron.bridge.training.initialize as initialize

    original = initialize.compile_helpers

    def compile_helpers():
        if not workarounds.prebuilt_helper_available():
            original()

    workarounds.replace(initialize, "compile_helpers", compile_helpers,
                        "Megatron-Bridge: dataset helper prebuilt")


def skip_jit_warmup() -> None:
    """Replace Bridge's ``_warmup_jit_function`` (megatron/bridge/training/initialize.py) with
    a no-op: under the CPU emulation its torch.compile warm-up looks for libcuda."""
    import megatron.bridge.training.initialize as initialize

    workarounds.replace(initialize, "_warmup_jit_function", lambda *args, **kwargs: None,
                        "Megatron-Bridge: CPU emulation")


def init_torch_optimizer_states_before_load() -> None:
    """Let Bridge load an optimizer checkpoint with megatron-core's torch AdamW fallback.

    Bridge's ``load_checkpoint(state, model, optimizer, ...)`` (megatron/bridge/training/
    checkpointing.py, called by its ``CheckpointManager``) builds the optimizer's
    ``sharded_state_dict`` to load into; with ``torch.optim.AdamW`` the per-parameter state is
    empty before the first step and ``DistributedOptimizer.state_dict()`` fails. As for
    megatron.training: megatron-core's ``_init_optimizer_states_with_dummy_values()`` first
    (only when the optimizer state will be loaded: ``checkpoint.load_optim`` and not
    ``checkpoint.finetune``, a checkpoint exists), the load overwrites them; autograd off
    during the load. Stock with Transformer Engine or apex.
    """
    import megatron.bridge.training.checkpointing as checkpointing
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    original = checkpointing.load_checkpoint

    def load_checkpoint(state, model, optimizer, *args, **kwargs):
        ckpt = state.cfg.checkpoint
        load_dir = ckpt.load or getattr(ckpt, "pretrained_checkpoint", None)
        if optimizer is not None and load_dir and ckpt.load_optim and not ckpt.finetune \
                and os.path.exists(load_dir):
            for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
                if isinstance(opt, distrib_optimizer.DistributedOptimizer) and not opt.optimizer.state:
                    with torch.no_grad():
                        opt._init_optimizer_states_with_dummy_values()
        with torch.no_grad():
            return original(state, model, optimizer, *args, **kwargs)

    workarounds.replace(checkpointing, "load_checkpoint", load_checkpoint,
                        "Megatron-Bridge: torch AdamW without TE/apex")


def keep_loco_warnings() -> None:
    """Wrap Bridge's ``setup_logging`` (as megatron/bridge/training/setup.py imported it): after
    it, the ``loco_megatron`` loggers drop the WARNING filter it added (other loggers keep it)."""
    import logging

    import megatron.bridge.training.setup as setup

    original = setup.setup_logging

    def setup_logging(*args, **kwargs):
        original(*args, **kwargs)
        for name, logger in list(logging.Logger.manager.loggerDict.items()):
            if name.split(".")[0] == "loco_megatron" and isinstance(logger, logging.Logger):
                for f in list(logger.filters):
                    if getattr(f, "__name__", "") == "warning_filter":
                        logger.removeFilter(f)

    workarounds.replace(setup, "setup_logging", setup_logging,
                        "Megatron-Bridge: LoCo's warnings kept under logger.filter_warnings")


def apply_needed(emulated: bool) -> List[str]:
    """Apply what this process needs (idempotent) and return every workaround in force."""
    skip_helper_build_when_prebuilt()
    keep_loco_warnings()
    init_torch_optimizer_states_before_load()
    workarounds.fix_torch_adamw_resume()
    if emulated:
        skip_jit_warmup()
    return workarounds.applied()
