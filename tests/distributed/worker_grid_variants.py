"""Rank workers for test_grid_variants.py: DDP settings a megatron user runs beyond the basic grid.

Each run trains the tiny GPT of :mod:`tests.distributed.worker_megatron` a few steps under one
variant of ``DistributedDataParallelConfig`` / parameter dtype, as stock megatron-core, LoCo off
(bits 16) and LoCo 4-bit, and returns what the tests compare: losses, parameters, LoCo counters, the
bucket-group structure, the shard check against the exact reduction, and the first step's
reduced shards (error buffers still zero there, so LoCo's shard must lie within the
quantization bound of stock's).
"""

from contextlib import contextmanager

import torch

from .worker_megatron import HIDDEN, ShardChecker, build_gpt, forward_backward, setup

MODES = ("stock", "bits16", "loco4")
STEPS = 6
BLOCK = 256


class BF16Adapter(torch.nn.Module):
    """An fp32 model plus a bf16 residual adapter on its embedding output, so the DDP model has
    parameters of two dtypes: megatron-core then builds two gradient buffers (one per
    (param dtype, grad dtype)) and, with ``disable_bucketing`` or fp8-style grouping, puts
    buckets of both buffers into one bucket group.

    Args:
        gpt: the GPTModel; its ``embedding`` output ``[seq, batch, HIDDEN]`` gets
            ``+ adapter(x.bfloat16())``.
    """

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt
        device = next(gpt.parameters()).device
        self.adapter = torch.nn.Linear(HIDDEN, HIDDEN, dtype=torch.bfloat16, device=device)
        gpt.embedding.register_forward_hook(self._residual)

    def _residual(self, module, inputs, output):
        return output + self.adapter(output.to(torch.bfloat16)).to(output.dtype)

    def forward(self, *args, **kwargs):
        """The GPT's forward (the adapter runs inside it, through the embedding hook)."""
        return self.gpt(*args, **kwargs)


@contextmanager
def fp8_style_bucket_groups():
    """Group buckets as megatron-core's ``partition_buckets`` does for fp8 parameters (case 3:
    every non-fp8 bucket joins the last bucket of the fp8 buffer in one group) without fp8: the
    buffer with the most buckets is presented as the uint8 one while ``partition_buckets``
    (megatron/core/distributed/param_and_grad_buffer.py) runs. The real megatron code forms the
    groups; only the dtype tag is borrowed, and restored before DDP continues."""
    from megatron.core.distributed import distributed_data_parallel as ddp_module

    original = ddp_module.partition_buckets

    def partition(buffers, *args, **kwargs):
        if not buffers:
            return original(buffers, *args, **kwargs)
        main = max(buffers, key=lambda b: len(b.buckets))
        saved, main.param_dtype = main.param_dtype, torch.uint8
        try:
            return original(buffers, *args, **kwargs)
        finally:
            main.param_dtype = saved

    ddp_module.partition_buckets = partition
    try:
        yield
    finally:
        ddp_module.partition_buckets = original


def _reduced_shards(model):
    """This rank's reduced shard of every bucket, fp64, keyed (group index, bucket index)."""
    from megatron.core import parallel_state as ps

    rank, world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    out = {}
    for g, group in enumerate(model.bucket_groups):
        for b, bucket in enumerate(group.buckets):
            shard = bucket.grad_data.numel() // world
            out[g, b] = bucket.grad_data[rank * shard:(rank + 1) * shard].double().cpu().clone()
    return out


def run_variant(mode: str, overlap: bool, bucket_size: int = 9025, fp8_groups: bool = False,
                **build_kwargs) -> dict:
    """Train ``STEPS`` steps in ``mode`` (one of :data:`MODES`) with ``build_gpt(overlap,
    bucket_size, **build_kwargs)``; shard checks at the first and last step (LoCo only)."""
    import loco_megatron
    from megatron.core import parallel_state as ps

    state = None
    if mode != "stock":
        state = loco_megatron.install(loco_megatron.LoCoConfig(
            bits={"bits16": 16, "loco4": 4}[mode], block_size=BLOCK))
    checker = (ShardChecker(state) if state is not None and state.active
               and ps.get_data_parallel_world_size() > 1 else None)  # DP 1: nothing reduced
    try:
        with fp8_style_bucket_groups() if fp8_groups else _nothing():
            model, opt = build_gpt(overlap, bucket_size, **build_kwargs)
        losses, worst, first, first_check = [], 0.0, None, None
        for step in range(STEPS):
            loss = forward_backward(model, opt)
            if step == 0:
                first = _reduced_shards(model)
            if checker is not None and step in (0, STEPS - 1):
                worst = max(worst, checker.check(model, ps.get_data_parallel_group()))
                if step == 0:  # (reduced shard, exact, bound) by position, as in ``first``
                    first_check = {(g, b): checker.last[bucket.loco_key]
                             for g, group in enumerate(model.bucket_groups)
                             for b, bucket in enumerate(group.buckets)}
            opt.step()
            losses.append(float(loss))
        res = {"losses": losses, "shard_check": worst, "first": first,
               "first_check": first_check,
               "params": {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()},
               "groups": [[(b.grad_data.numel(), b.grad_data.dtype) for b in g.buckets]
                          for g in model.bucket_groups]}
        if state is not None and state.active:
            stats = state.compensator.stats
            res["counters"] = {"calls": state.wire.calls, "compress": stats.calls,
                               "buckets": state.num_buckets, "keys": len(stats.steps),
                               "steps": sorted(set(stats.steps.values())),
                               # a bucket with short blocks (a segment not a whole number of
                               # blocks: the last one short, nothing padded on the wire)
                               "short": [any(n % lay.block_size for segs in lay.segments
                                             for *_, n in segs)
                                         for lay in (state.layouts[k]
                                                     for k in sorted(state.layouts))]}
        return res
    finally:
        loco_megatron.uninstall()


@contextmanager
def _nothing():
    yield


def variants_worker(rank, world, tp, variants):
    """Run every ``(name, kwargs)`` of ``variants`` in all :data:`MODES` on a TP ``tp`` grid."""
    setup(tp, "gloo")
    return {name: {mode: run_variant(mode, **kwargs) for mode in MODES}
            for name, kwargs in variants}


def dp2_then_dp1_worker(rank, world, variants, dp1_variant):
    """``variants`` on TP1 x DP2, then megatron's groups rebuilt as TP2 x DP1 (same 2 ranks)
    for ``dp1_variant``: with DP 1 LoCo has nothing to send."""
    from megatron.core import parallel_state as ps

    results = variants_worker(rank, world, 1, variants)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    results["dp1"] = {mode: run_variant(mode, **dp1_variant) for mode in MODES}
    return results
