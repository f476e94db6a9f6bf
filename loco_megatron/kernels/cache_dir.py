"""Triton's compile cache on a node-local disk, one directory per job.

Triton compiles into ``$TRITON_CACHE_DIR`` (default ``~/.triton/cache``). With a home directory
on NFS, ranks of several nodes compiling into one shared cache at once fail (an open Triton
issue), so every LoCo launch path points it at a node-local directory of the job when the user
has not set it: ``run_pretrain.sh`` and ``slurm/megatron_lm_node.sh`` (which
``slurm/pretrain.sbatch`` runs on each node) in shell, the Megatron-Bridge path
(:func:`loco_megatron.bridge.pretrain`) here, with the same name.
"""

import os
from typing import Mapping, Optional


def node_local_cache_dir(env: Optional[Mapping[str, str]] = None) -> str:
    """``$TMPDIR/loco-triton-<job>`` (``/tmp`` without ``$TMPDIR``): the job is Slurm's
    ``SLURM_JOB_ID``, else torchrun's ``TORCHELASTIC_RUN_ID`` (the same on every rank of a
    launch), else the parent process id (a plain ``python`` run: its own directory)."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or str(os.getppid())
    return os.path.join(env.get("TMPDIR") or "/tmp", f"loco-triton-{job}")


def use_node_local_cache() -> str:
    """Set ``TRITON_CACHE_DIR`` to :func:`node_local_cache_dir` unless it is set (call before
    the first compile); returns the directory Triton will use."""
    return os.environ.setdefault("TRITON_CACHE_DIR", node_local_cache_dir())
