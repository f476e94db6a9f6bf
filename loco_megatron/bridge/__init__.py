"""LoCo in Megatron-Bridge recipes (docs/megatron_bridge.md).

    from loco_megatron.bridge import pretrain
    from megatron.bridge.training.gpt_step import forward_step

    cfg = my_recipe()                                   # a Bridge ConfigContainer
    pretrain(cfg, forward_step, loco={"bits": 4})      # or loco=LoCoConfig(bits=4)

From a YAML file's ``loco:`` section and ``loco.*`` overrides beside Bridge's Hydra overrides:
``loco = process_config_with_overrides(cfg, "run.yaml", ["train.train_iters=100", "loco.bits=4"])``
then ``pretrain(cfg, forward_step, loco=loco)``. Nothing here imports Megatron-Bridge until
called.
"""


def pretrain(config, forward_step_func, callbacks=None, loco=None, **kwargs):
    """See :func:`loco_megatron.bridge.run.pretrain`."""
    from .run import pretrain as _pretrain

    return _pretrain(config, forward_step_func, callbacks=callbacks, loco=loco, **kwargs)


def process_config_with_overrides(config, config_filepath=None, cli_overrides=(), loco=None):
    """See :func:`loco_megatron.bridge.settings.process_config_with_overrides`."""
    from .settings import process_config_with_overrides as _process

    return _process(config, config_filepath, cli_overrides, loco)


def split_overrides(overrides):
    """See :func:`loco_megatron.bridge.settings.split_overrides`."""
    from .settings import split_overrides as _split

    return _split(overrides)


def __getattr__(name):
    if name == "LoCoCallback":  # imports Megatron-Bridge
        from .callback import LoCoCallback

        return LoCoCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LoCoCallback", "pretrain", "process_config_with_overrides", "split_overrides"]
