"""Stand-in (test environment only): nvidia-resiliency-ext 0.4.1 with a ``__version__``.

Why: megatron-core 0.19's megatron/core/dist_checkpointing/strategies/nvrx.py reads
``nvidia_resiliency_ext.__version__`` when the package is importable and asserts it is at least
0.6.0; the newest release on the package index, 0.4.1, is a namespace package without
``__version__``, so ``import megatron.core.dist_checkpointing`` dies. Megatron-Bridge needs the
package anyway (megatron/bridge/training/pretrain.py imports
``nvidia_resiliency_ext.inprocess.CallWrapper`` unconditionally).

What: this regular package takes the name first on ``sys.path`` and extends its ``__path__`` to
the installed 0.4.1 (every submodule is the real one), and says ``__version__ = "0.6.0"``, the
minimum megatron-core asks: megatron-core then checks the async-checkpoint symbols it uses
itself and, 0.4.1 lacking some, saves synchronously without NVRx.
"""

import pkgutil

__path__ = pkgutil.extend_path(__path__, __name__)
__version__ = "0.6.0"
