"""Megatron-LM settings for CPU ranks, added where the user did not choose them.

On a machine without a GPU every launch path (the checkout wrapper
:mod:`loco_megatron.training.run_megatron_lm`, the patched ``pretrain_gpt.py`` of ``patches/``,
the main job's :mod:`loco_megatron.training.pretrain_gpt`) runs Megatron on CPU ranks through
the CUDA emulation. Megatron's own defaults assume GPUs: NCCL (``ProcessGroupNCCL is only
supported with GPUs``), Transformer Engine, fused kernels (``persist_layer_norm not supported
by torch LayerNorm``), initialisation on the GPU. :data:`CPU_DEFAULTS` are the flags
``run_pretrain.sh`` passes on such a machine; :func:`add_cpu_defaults` puts each one that the
command line (or its ``--config`` file) does not set before the user's flags, and
:func:`check_cpu_backend` refuses ``--distributed-backend nccl`` in one line.
"""

from typing import List, Optional, Sequence, Tuple

from ..config import LoCoConfigError

#: (flag, value or None for a switch): what run_pretrain.sh passes without a GPU, in its order
#: (every flag exists in Megatron-LM core_v0.13.1 to core_v0.19.0; each has one spelling)
CPU_DEFAULTS: Tuple[Tuple[str, Optional[str]], ...] = (
    ("--distributed-backend", "gloo"),
    ("--transformer-impl", "local"),
    ("--no-gradient-accumulation-fusion", None),
    ("--use-cpu-initialization", None),
    ("--no-masked-softmax-fusion", None),
    ("--no-bias-gelu-fusion", None),
    ("--no-bias-swiglu-fusion", None),
    ("--no-bias-dropout-fusion", None),
    ("--no-rope-fusion", None),
    ("--no-persist-layer-norm", None),
)
BACKEND = "--distributed-backend"


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _value(argv: Sequence[str], flag: str) -> Optional[str]:
    """The last value given to ``flag`` (``--flag V`` or ``--flag=V``), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def check_cpu_backend(argv: Sequence[str]) -> None:
    """Refuse a ``--distributed-backend`` other than gloo on a machine without a GPU.

    Raises:
        LoCoConfigError: one line naming the flag and what to do.
    """
    backend = _value(argv, BACKEND)
    if backend is not None and backend != "gloo":
        raise LoCoConfigError(
            f"{BACKEND} {backend} needs GPUs and this machine has none: Megatron runs here on "
            f"CPU ranks through the CUDA emulation, with gloo. Drop {BACKEND} (gloo is then "
            f"chosen for you) or pass {BACKEND} gloo, or start the job on GPU nodes.")


def add_cpu_defaults(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """``(argv with the missing CPU defaults first, the flags added)``.

    A flag counts as set when it appears in ``argv`` in any form (``--flag``, ``--flag V``,
    ``--flag=V``): the user's choice stays, even one that does not suit CPU ranks (except the
    backend, :func:`check_cpu_backend`). Nothing is added with Megatron's ``--yaml-cfg``, which
    replaces the whole command line.
    """
    if _given(argv, "--yaml-cfg"):
        return list(argv), []
    added: List[str] = []
    for flag, value in CPU_DEFAULTS:
        if not _given(argv, flag):
            added += [flag] if value is None else [flag, value]
    return added + list(argv), added


def startup_line(added: Sequence[str]) -> str:
    """The one start-up line saying which CPU settings were added."""
    return (f"> LoCo: no GPU, so Megatron runs on CPU ranks; added the CPU-compatible settings "
            f"you did not set: {' '.join(added)}")
