"""Spawn N gloo ranks on this machine and collect each rank's return value.

Usage: ``results = run_ranks(worker, world_size, *args)`` where ``worker(rank, world_size,
*args)`` is a module-level function; each rank runs in a process forked from a fork server
that has megatron-core imported already (:data:`PRELOAD`), with the caller's environment and a
gloo process group already initialised (file rendezvous), and what it returns (picklable) comes
back in rank order (``backend="nccl"``: one GPU per rank). An exception on any rank fails the
caller with that rank's traceback.
"""

import datetime
import os
import pickle
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


#: Modules the fork server imports once per test session (megatron-core's GPT stack takes ~7 s
#: of CPU per process to import); each rank is then forked from it already loaded.
PRELOAD = ["torch", "torch.distributed", "megatron.core.distributed",
           "megatron.core.models.gpt.gpt_model", "megatron.core.optimizer",
           "megatron.core.dist_checkpointing"]
#: ``forkserver`` (default) or ``spawn`` (``LOCO_TEST_START_METHOD``): a fresh interpreter per
#: rank, slower, for debugging an import-order effect.
START_METHOD = os.environ.get("LOCO_TEST_START_METHOD", "forkserver")


#: ``backend`` of ranks that share the one GPU over gloo (CUDA tensors, spawned ranks)
GLOO_CUDA = "gloo-cuda"


def start_method(backend: str) -> str:
    """How ranks of ``backend`` start: NCCL ranks are always spawned. Importing :data:`PRELOAD`
    calls ``torch.cuda.is_available()`` (megatron-core's dist_checkpointing, torch's
    cpp_extension), i.e. ``cudaGetDeviceCount``, which initialises the CUDA driver in the fork
    server: on a GPU machine every rank forked from it would then fail to use CUDA (torch's
    "poison fork", see ``torch.cuda.is_available``)."""
    return "spawn" if backend in ("nccl", GLOO_CUDA) else START_METHOD


def _entry(rank, fn, world_size, tmpdir, args, backend, local_world_size=None, env=None):
    if env is not None:  # the fork server's environment is the one it started with
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    local = local_world_size or world_size
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % local),
                      LOCAL_WORLD_SIZE=str(local))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    elif backend == GLOO_CUDA:  # every rank on device 0, collectives over gloo
        torch.cuda.set_device(0)
        backend = "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmpdir}/rendezvous",
                            rank=rank, world_size=world_size)
    # Every rank finishes connecting before any can exit: a worker that returns at once (e.g.
    # on an expected error) would otherwise close its end while a slower peer still connects.
    dist.barrier()
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(tmpdir, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        _exit_barrier(tmpdir, rank, world_size)
    finally:
        dist.destroy_process_group()


def _exit_barrier(tmpdir, rank, world_size, timeout_s=300):
    """Wait until every rank has finished its work before any closes its gloo sockets.

    Outside gloo (a FileStore): a rank that closes its connections right after the last
    collective can reset a peer's socket before that peer has read the last message, and the
    peer aborts ("terminate called without an active exception")."""
    store = dist.FileStore(os.path.join(tmpdir, "exit_store"), world_size)
    store.set(f"done{rank}", "1")  # raises after timeout_s when a rank never gets here
    store.wait([f"done{r}" for r in range(world_size)], datetime.timedelta(seconds=timeout_s))


_PRELOADED = []


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def run_ranks(fn, world_size, *args, backend="gloo", local_world_size=None, timeout_s=None):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo, or nccl with one GPU
    per rank); return their results. ``local_world_size``: ranks per emulated node
    (``LOCAL_WORLD_SIZE``; default all ranks on one node). ``timeout_s``: fail (TimeoutError,
    ranks killed) when they have not all finished by then, instead of hanging."""
    method = start_method(backend)
    if method == "forkserver" and not _PRELOADED:
        import multiprocessing

        multiprocessing.set_forkserver_preload([m for m in PRELOAD if _importable(m)])
        _PRELOADED.append(True)
    with tempfile.TemporaryDirectory() as tmpdir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, tmpdir, args, backend,
                                               local_world_size, dict(os.environ)),
                                 nprocs=world_size, join=False, start_method=method)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not ctx.join(timeout=None if deadline is None else 1.0):
            if deadline is not None and time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{fn.__name__}: ranks still running after {timeout_s} s "
                                   f"(a hang)")
        results = []
        for r in range(world_size):
            with open(os.path.join(tmpdir, f"result{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
