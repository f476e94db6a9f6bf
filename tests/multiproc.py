"""Spawn N gloo ranks on this machine and collect each rank's return value.

Usage: ``results = run_ranks(worker, world_size, *args)`` where ``worker(rank, world_size,
*args)`` is a module-level function; each rank runs in a fresh spawned process with a gloo
process group already initialised (file rendezvous), and what it returns (picklable) comes back
in rank order (``backend="nccl"``: one GPU per rank). An exception on any rank fails the caller with that rank's traceback.
"""

import os
import pickle
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, fn, world_size, tmpdir, args, backend, local_world_size=None):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    local = local_world_size or world_size
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % local),
                      LOCAL_WORLD_SIZE=str(local))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{tmpdir}/rendezvous",
                            rank=rank, world_size=world_size)
    # Every rank finishes connecting before any can exit: a worker that returns at once (e.g.
    # on an expected error) would otherwise close its end while a slower peer still connects.
    dist.barrier()
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(tmpdir, f"result{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size, *args, backend="gloo", local_world_size=None):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo, or nccl with one GPU
    per rank); return their results. ``local_world_size``: ranks per emulated node
    (``LOCAL_WORLD_SIZE``; default all ranks on one node)."""
    with tempfile.TemporaryDirectory() as tmpdir:
        mp.start_processes(_entry, args=(fn, world_size, tmpdir, args, backend, local_world_size),
                           nprocs=world_size,
                           join=True, start_method="spawn")
        results = []
        for r in range(world_size):
            with open(os.path.join(tmpdir, f"result{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
