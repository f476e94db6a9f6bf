"""One rank of test_rank_failure.py, started as its own process (no torch.multiprocessing
parent that would kill the survivors):
``python -m tests.distributed.worker_kill RANK WORLD DIR TIMEOUT_S``.

Trains the tiny GPT with LoCo 4-bit for 2 steps, saves a torch_dist checkpoint (and this rank's
error buffers, for the test to compare) into DIR, then in step 3 the last rank SIGKILLs itself
between the two all-to-alls of a compensated reduce-scatter (payload sent, scales not). The
other ranks must exit non-zero on their own, within the process-group timeout.
"""

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main(rank: int, world: int, out_dir: str, timeout_s: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    import loco_megatron
    from loco_megatron.training.workarounds import fix_torch_adamw_resume
    from tests.distributed.worker_ckpt import errors, save
    from tests.distributed.worker_megatron import build_gpt, forward_backward, setup

    setup(1, "gloo")
    fix_torch_adamw_resume()
    state = loco_megatron.install(loco_megatron.LoCoConfig(bits=4))
    model, opt = build_gpt(overlap=False, dropout=0.0)
    for _ in range(2):
        forward_backward(model, opt)
        opt.step()
    save(model, opt, "torch_dist", os.path.join(out_dir, "ckpt"))
    torch.save(errors(state), os.path.join(out_dir, f"errors{rank}.pt"))
    dist.barrier()
    print(f"rank {rank}: checkpoint saved", flush=True)
    if rank == world - 1:
        calls = []
        original = dist.all_to_all_single

        def dying_all_to_all(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # the payload went out, the scales never will
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        dist.all_to_all_single = dying_all_to_all
    forward_backward(model, opt)  # the survivors fail in here
    print(f"rank {rank}: step 3 finished (should not happen)", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
