"""Workarounds that ``megatron.training`` (shipped in megatron-core >= 0.17 wheels) needs.

* The 0.19.2 wheel ships the compiled dataset helper (``helpers_cpp*.so``) but not its
  Makefile, while ``megatron.training.initialize._compile_dependencies`` always runs ``make`` on
  rank 0 and exits when it fails: :func:`skip_helper_build_when_prebuilt` keeps the build only
  when the prebuilt helper is missing (any hardware).
* Under the CPU emulation, dynamo cannot trace through the torch function mode, so the JIT
  warm-up is skipped (:func:`skip_jit_warmup`).
"""

import importlib
import logging

logger = logging.getLogger(__name__)


def prebuilt_helper_available() -> bool:
    """True when ``megatron.core.datasets.helpers_cpp`` imports (the wheel's compiled helper)."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
        return True
    except ImportError:
        return False


def skip_helper_build_when_prebuilt() -> None:
    """Make ``compile_helpers()`` a no-op when the compiled dataset helper is importable."""
    import megatron.core.datasets.utils as dataset_utils

    original = dataset_utils.compile_helpers
    if getattr(original, "_loco_wrapped", False):
        return

    def compile_helpers():
        if prebuilt_helper_available():
            return
        original()

    compile_helpers._loco_wrapped = True
    dataset_utils.compile_helpers = compile_helpers


def skip_jit_warmup() -> None:
    """Replace ``megatron.training.initialize._warmup_jit_function`` with a no-op."""
    import megatron.training.initialize as initialize

    initialize._warmup_jit_function = lambda *args, **kwargs: None
