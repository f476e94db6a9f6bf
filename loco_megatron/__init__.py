"""loco-megatron: LoCo compensated low-bit gradient reduce-scatter for Megatron.

Paper: "LoCo: Low-Bit Communication Adaptor for Large-scale Model Training" (arXiv 2407.04480).

    import loco_megatron
    with loco_megatron.installed(loco_megatron.LoCoConfig(bits=4)) as state:
        ...  # build megatron-core DDP + DistributedOptimizer as usual, train

(or ``state = loco_megatron.install(...)`` ... ``loco_megatron.uninstall()``).
"""

from .config import LoCoConfig, LoCoConfigError

__version__ = "0.1.0"


def install(config: LoCoConfig):
    """See :func:`loco_megatron.megatron.plugin.install`."""
    from .megatron.plugin import install as _install

    return _install(config)


def installed(config: LoCoConfig):
    """Context manager: LoCo installed for the block, uninstalled when it ends (also on an
    exception). See :func:`loco_megatron.megatron.plugin.installed`.

        with loco_megatron.installed(loco_megatron.LoCoConfig(bits=4)) as state:
            ...  # build DDP + DistributedOptimizer and train
    """
    from .megatron.plugin import installed as _installed

    return _installed(config)


def uninstall() -> None:
    """See :func:`loco_megatron.megatron.plugin.uninstall`."""
    from .megatron.plugin import uninstall as _uninstall

    _uninstall()


def enable_megatron_lm(argv=None) -> None:
    """See :func:`loco_megatron.training.argument_hooks.enable_loco` (called by the patched
    Megatron-LM ``pretrain_gpt.py`` of ``patches/``)."""
    from .training.argument_hooks import enable_loco

    enable_loco(argv)


__all__ = ["LoCoConfig", "LoCoConfigError", "enable_megatron_lm", "install", "installed",
           "uninstall", "__version__"]
