"""loco-megatron: LoCo compensated low-bit gradient reduce-scatter for Megatron.

Paper: "LoCo: Low-Bit Communication Adaptor for Large-scale Model Training" (arXiv 2407.04480).

    import loco_megatron
    state = loco_megatron.install(loco_megatron.LoCoConfig(bits=4))
    ...  # build megatron-core DDP + DistributedOptimizer as usual
    loco_megatron.uninstall()
"""

from .config import LoCoConfig, LoCoConfigError

__version__ = "0.1.0"


def install(config: LoCoConfig):
    """See :func:`loco_megatron.megatron.plugin.install`."""
    from .megatron.plugin import install as _install

    return _install(config)


def uninstall() -> None:
    """See :func:`loco_megatron.megatron.plugin.uninstall`."""
    from .megatron.plugin import uninstall as _uninstall

    _uninstall()


def enable_megatron_lm(argv=None) -> None:
    """See :func:`loco_megatron.megatron.lm_hooks.enable_loco` (called by the patched
    Megatron-LM ``pretrain_gpt.py`` of ``patches/``)."""
    from .megatron.lm_hooks import enable_loco

    enable_loco(argv)


__all__ = ["LoCoConfig", "LoCoConfigError", "enable_megatron_lm", "install", "uninstall",
           "__version__"]
