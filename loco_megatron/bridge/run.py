"""``loco_megatron.bridge.pretrain``: Megatron-Bridge's ``pretrain`` with LoCo installed.

Bridge's ``pretrain(config, forward_step_func, callbacks)`` (megatron/bridge/training/
pretrain.py) builds megatron-core's own ``DistributedDataParallel`` and
``get_megatron_optimizer`` inside ``setup()``, so LoCo's megatron-core seam applies unchanged,
provided it is installed before ``setup()`` wraps the model: a callback would be too late. The
order here:

1. the LoCo settings (:mod:`.settings`), checked with the other launch paths' refusals in
   Bridge's words (:mod:`.checks`), before anything starts;
2. the CPU emulation when there is no GPU, the Bridge workarounds this process needs
   (:mod:`.workarounds`), the one-line refusal hook;
3. :func:`loco_megatron.install`, then Bridge's ``pretrain`` with :class:`.LoCoCallback`
   added to the caller's callbacks;
4. :func:`loco_megatron.uninstall` when it returns or raises.
"""

from typing import Tuple

import torch

from .settings import LoCoLike, as_config


def pretrain(config, forward_step_func, callbacks=None, loco: LoCoLike = None,
             bridge_pretrain=None):
    """Run Megatron-Bridge's ``pretrain`` with LoCo installed for its duration.

    Args:
        config: Bridge's ``ConfigContainer`` (a recipe's, after its overrides:
            :func:`loco_megatron.bridge.process_config_with_overrides` takes ``loco:`` / ``loco.*``
            out of a YAML file and the command line).
        forward_step_func: as for Bridge's ``pretrain`` (e.g.
            ``megatron.bridge.training.gpt_step.forward_step``).
        callbacks: as for Bridge's ``pretrain`` (a list of ``Callback`` or a
            ``CallbackManager``); :class:`~loco_megatron.bridge.callback.LoCoCallback` is added.
        loco: a :class:`~loco_megatron.LoCoConfig`, a mapping like a YAML ``loco:`` section
            (``{"bits": 4}``), or None: nothing installed, Bridge runs as shipped (a checkpoint's
            LoCo state is then not read).
        bridge_pretrain: the function to run instead of Bridge's ``pretrain`` (tests).

    Returns:
        What Bridge's ``pretrain`` returns (None).

    Raises:
        LoCoConfigError: a bad LoCo setting, or a Bridge setting LoCo refuses (one line naming
            it in Bridge's words, e.g. ``checkpoint.ckpt_format='fsdp_dtensor' cannot be used
            with loco.bits=4: ...``); uncaught in a script, it ends the rank with that line
            and exit status 2.
    """
    from ..cli.console import install_excepthook
    from ..emulation import activate_if_no_gpu
    from ..kernels.cache_dir import use_node_local_cache
    from . import checks, workarounds
    from .callback import LoCoCallback

    install_excepthook()
    loco_config = as_config(loco)
    if loco_config is not None:  # refusals before anything is changed in this process
        checks.check(config, loco_config, emulated=not torch.cuda.is_available())
    emulated = activate_if_no_gpu()
    workarounds.apply_needed(emulated)
    if bridge_pretrain is None:
        from megatron.bridge.training.pretrain import pretrain as bridge_pretrain
    if loco_config is None:  # Bridge as shipped: its environment untouched
        return bridge_pretrain(config, forward_step_func, callbacks=callbacks)
    use_node_local_cache()  # TRITON_CACHE_DIR unless set (kernels/cache_dir.py)
    import loco_megatron

    state = loco_megatron.install(loco_config)
    try:
        callbacks, callback = _with_callback(callbacks, LoCoCallback)
        callback.state, callback.emulated = state, emulated
        callback.print_startup()
        return bridge_pretrain(config, forward_step_func, callbacks=callbacks)
    finally:
        if loco_megatron.megatron.plugin.get_state() is state:
            loco_megatron.uninstall()


def _with_callback(callbacks, cls) -> Tuple[object, object]:
    """``(callbacks, the cls instance among them)``: the caller's callbacks (None, a list, or a
    ``CallbackManager``) with a new ``cls()`` added last, unless the caller passed one (to read
    its ``history``)."""
    from megatron.bridge.training.callbacks import CallbackManager

    if isinstance(callbacks, CallbackManager):
        for fn in callbacks.list_callbacks("on_train_step_end"):
            if isinstance(getattr(fn, "__self__", None), cls):
                return callbacks, fn.__self__
        callback = cls()
        callbacks.add(callback)
        return callbacks, callback
    callbacks = list(callbacks or [])
    mine = [c for c in callbacks if isinstance(c, cls)]
    if mine:
        return callbacks, mine[0]
    callback = cls()
    return callbacks + [callback], callback
