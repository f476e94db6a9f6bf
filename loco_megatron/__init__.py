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


__all__ = ["LoCoConfig", "LoCoConfigError", "install", "uninstall", "__version__"]
