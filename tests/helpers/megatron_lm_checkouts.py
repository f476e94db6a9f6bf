"""Shared by the Megatron-LM wrapper / patch tests: CPU launch flags, torchrun, checkouts.

Real checkouts come from ``$MEGATRON_LM`` (a user's clone, used as is) or are extracted from a
local git mirror of NVIDIA/Megatron-LM (``$LOCO_MEGATRON_LM_MIRROR``, no default: the user
says where) with ``git archive`` into a temporary directory; tests that need one skip, saying
so, when neither is set (CI). Nothing fetched is ever written to the repo.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.preloaded import launch_env

ROOT = Path(__file__).resolve().parents[2]
#: a git mirror of NVIDIA/Megatron-LM the user named (``$LOCO_MEGATRON_LM_MIRROR``), or None
MIRROR = (Path(os.environ["LOCO_MEGATRON_LM_MIRROR"])
          if os.environ.get("LOCO_MEGATRON_LM_MIRROR") else None)
NO_CHECKOUT = ("no Megatron-LM checkout: set MEGATRON_LM to a clone, or LOCO_MEGATRON_LM_MIRROR "
               "to a git mirror of NVIDIA/Megatron-LM"
               + (f" ({MIRROR} is not a directory)" if MIRROR is not None else ""))


def mirror_available() -> bool:
    """True when ``$LOCO_MEGATRON_LM_MIRROR`` names an existing directory."""
    return MIRROR is not None and MIRROR.is_dir()
#: as run_pretrain.sh passes them on a machine without a GPU
CPU_FLAGS = ["--distributed-backend", "gloo", "--transformer-impl", "local",
             "--no-gradient-accumulation-fusion", "--use-cpu-initialization",
             "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
             "--no-rope-fusion", "--no-persist-layer-norm"]
TINY_GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
            "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-interval", "100",
            "--eval-iters", "0", "--split", "98,1,1", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "128"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(target, args, cwd=ROOT, timeout=900, nproc=2, preloaded=True):
    """Run ``python -m torch.distributed.run`` with 2 CPU ranks; ``target`` is ``["-m", mod]``
    or ``[script]``. Returns ``(returncode, stdout + stderr)``. ``preloaded``: torchrun and its
    ranks come from the preloaded launcher (tests/helpers/preloaded.py); pass False for a real
    Megatron-LM checkout, whose own ``megatron`` package the ranks must import."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               CUDA_DEVICE_MAX_CONNECTIONS="1")
    if preloaded:
        env = launch_env(env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), *target, *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def extract_tag(tag: str, dest: Path, paths=()) -> Path:
    """``git archive`` of ``tag`` (optionally only ``paths``) from the mirror into ``dest``."""
    if not mirror_available():
        pytest.skip(NO_CHECKOUT)
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", f"--git-dir={MIRROR}", "archive", tag, *paths],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def real_checkout(which: str, tmp_path_factory) -> Path:
    """``$MEGATRON_LM`` when ``which == "MEGATRON_LM"``, else the tag extracted from the mirror."""
    if which == "MEGATRON_LM":
        return Path(os.environ["MEGATRON_LM"])
    return extract_tag(which, tmp_path_factory.mktemp(which))


#: the release tags with a patch in patches/ (the last of each minor release, 0.13 to 0.19)
TAGS = sorted(p.stem for p in (ROOT / "patches").glob("core_v*.patch"))


def real_checkout_params():
    """The checkouts to test: the user's clone if ``MEGATRON_LM`` is set, else every tag
    of ``patches/``."""
    return ["MEGATRON_LM"] if os.environ.get("MEGATRON_LM") else TAGS
