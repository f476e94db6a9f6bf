"""Train the tiny GPT with two distributed-optimizer instances (world 4 = 2 instances x DP 2).

With ``num_distributed_optimizer_instances > 1`` megatron-core reduce-scatters each bucket
inside its instance (synchronously) and then all-reduces the shard across instances in full
precision (``_ParamAndGradBucketGroup.start_grad_sync``,
megatron/core/distributed/param_and_grad_buffer.py, 0.13-0.19): LoCo compresses the
intra-instance reduce-scatter; the inter-instance all-reduce is megatron-core's own.
"""

import os

import torch
import torch.distributed as dist

from tests.distributed.worker_megatron import ShardChecker, build_gpt, forward_backward

INSTANCES = 2


def _build(overlap: bool):
    return build_gpt(overlap, bucket_size=6000, dropout=0.0,
                     num_distributed_optimizer_instances=INSTANCES)


def train_instances(mode: str, overlap: bool, steps: int, check_steps=(0, 3), ckpt_dir=None):
    """Train with LoCo ``mode`` in {"stock", "bits16", "loco4"}; returns losses, parameters,
    LoCo counters, the group size each compressed reduce-scatter saw and the worst shard/bound
    ratio (exact reference and bound summed over all 4 ranks). With ``ckpt_dir`` the run is
    saved in both checkpoint formats and resumed from each (worker_resume.py):
    ``out["ckpt"]``."""
    import loco_megatron
    from megatron.core import parallel_state as ps
    from tests.distributed.worker_resume import save_then_resume

    state = None
    if mode != "stock":
        state = loco_megatron.install(
            loco_megatron.LoCoConfig(bits={"bits16": 16, "loco4": 4}[mode], block_size=64))
    checker = ShardChecker(state) if state is not None and state.active else None
    sizes = set()
    if checker is not None:
        compress = state.compensator.compress

        def sizing_compress(key, g_in, layout=None):
            sizes.add(layout.world)
            return compress(key, g_in, layout)
        state.compensator.compress = sizing_compress
    try:
        model, opt = _build(overlap)
        losses, worst = [], 0.0
        intra = ps.get_intra_distributed_optimizer_instance_group()
        for step in range(steps):
            loss = forward_backward(model, opt)
            if checker is not None and step in check_steps:
                worst = max(worst, checker.check(model, intra, ps.get_data_parallel_group()))
            opt.step()
            losses.append(float(loss))
        out = {"losses": losses, "shard_check": worst, "sizes": sorted(sizes),
               "num_bucket_groups": len(model.bucket_groups),
               "params": {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()}}
        if checker is not None:
            out["counters"] = {"calls": state.wire.calls, "compress": state.compensator.stats.calls,
                               "buckets": state.num_buckets}
        if ckpt_dir is not None:
            keys = {b.loco_key for g in model.bucket_groups for b in g.buckets}
            out["ckpt"] = save_then_resume(model, opt, state, lambda: _build(overlap),
                                           state.config, ckpt_dir, {"dense": keys})
            out["ckpt"]["torch_files"] = sorted(os.listdir(os.path.join(ckpt_dir, "torch",
                                                                        "mp_rank_00")))
        return out
    finally:
        loco_megatron.uninstall()


def instances_worker(rank, world, steps, ckpt_dir):
    """stock, bits16 and loco4 with overlap off and on; the last loco4 run saves a checkpoint."""
    from loco_megatron.emulation import activate
    from loco_megatron.training.workarounds import fix_torch_adamw_resume
    from megatron.core import parallel_state as ps

    activate()
    fix_torch_adamw_resume()  # CPU: torch AdamW fallback (no TE/apex), as worker_ckpt.py
    ps.initialize_model_parallel(num_distributed_optimizer_instances=INSTANCES)
    out = {"dp": dist.get_world_size(ps.get_data_parallel_group()),
           "intra": dist.get_world_size(ps.get_intra_distributed_optimizer_instance_group())}
    for overlap in (False, True):
        for mode in ("stock", "bits16", "loco4"):
            save_dir = ckpt_dir if overlap and mode == "loco4" else None
            out[overlap, mode] = train_instances(mode, overlap, steps, ckpt_dir=save_dir)
    return out
