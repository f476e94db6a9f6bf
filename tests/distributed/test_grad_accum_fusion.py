"""LoCo with gradient-accumulation fusion: TE / apex fused wgrad kernels write weight gradients
straight into ``param.main_grad`` and set ``param.grad_added_to_main_grad``, and megatron-core's
backward hook (distributed/distributed_data_parallel.py, ``_make_backward_post_hook``) then skips
its ``main_grad.add_(param.grad)``. LoCo acts on the gradient buffer behind ``main_grad``, so it
must give the same reduce-scatter result whichever way the gradients arrive.

Two CPU ranks (gloo + CUDA emulation), a 2-layer MLP in megatron-core DDP with the distributed
optimizer's reduce-scatter, LoCo 4-bit, 3 steps (error feedback active from step 2). The fused
path mimics megatron-core's ``LinearWithGradAccumulationAndAsyncCommunication.backward`` with
``gradient_accumulation_fusion`` (tensor_parallel/layers.py): ``main_grad += grad_out^T @ x``, the
flag set, and a dummy weight gradient returned (NaN-filled here, so a double add would show).
"""

import torch
import torch.distributed as dist

from .worker_megatron import ShardChecker, setup

IN, HID, OUT, BATCH, STEPS = 16, 32, 8, 4, 3


class _FusedWgradLinear(torch.autograd.Function):
    """``y = x @ w^T``; backward accumulates ``dy^T @ x`` into ``w.main_grad`` (fp32)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        weight.main_grad.add_(grad_out.t() @ x)  # the fused wgrad GEMM's accumulation
        weight.grad_added_to_main_grad = True
        return grad_out @ weight, torch.full_like(weight, float("nan"))


class _MLP(torch.nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        self.w1 = torch.nn.Parameter(torch.randn(HID, IN) / IN ** 0.5)
        self.b1 = torch.nn.Parameter(torch.zeros(HID))  # biases: ordinary param.grad path
        self.w2 = torch.nn.Parameter(torch.randn(OUT, HID) / HID ** 0.5)

    def _linear(self, x, w):
        return _FusedWgradLinear.apply(x, w) if self.fused else x @ w.t()

    def forward(self, x):
        return self._linear(torch.tanh(self._linear(x, self.w1) + self.b1), self.w2)


def _run(fused: bool):
    """Reduced shards of each step, and the shard check against the exact reduction."""
    import loco_megatron
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    state = loco_megatron.install(loco_megatron.LoCoConfig(bits=4, block_size=64))
    checker = ShardChecker(state)
    try:
        torch.manual_seed(0)
        cfg = TransformerConfig(num_layers=1, hidden_size=HID, num_attention_heads=1,
                                use_cpu_initialization=True)
        model = DistributedDataParallel(
            config=cfg, module=_MLP(fused), ddp_config=DistributedDataParallelConfig(
                use_distributed_optimizer=True, overlap_grad_reduce=False,
                grad_reduce_in_fp32=True))
        group, rank = ps.get_data_parallel_group(), ps.get_data_parallel_rank()
        gen = torch.Generator().manual_seed(100 + rank)
        shards, worst = [], 0.0
        for _ in range(STEPS):
            x, target = torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)
            model.zero_grad_buffer()
            ((model(x) - target) ** 2).sum().backward()
            model.finish_grad_sync()
            worst = max(worst, checker.check(model, group))
            shard = []
            for bucket_group in model.bucket_groups:
                for bucket in bucket_group.buckets:
                    n = bucket.grad_data.numel() // dist.get_world_size(group)
                    shard.append(bucket.grad_data[rank * n:(rank + 1) * n].clone())
            shards.append(torch.cat(shard))
        flags = [bool(p.grad_added_to_main_grad) for p in (model.module.w1, model.module.w2)]
        return {"shards": shards, "worst": worst, "calls": state.wire.calls, "flags": flags}
    finally:
        loco_megatron.uninstall()


def fusion_worker(rank, world):
    setup(1, "gloo")
    return _run(fused=False), _run(fused=True)


def test_loco_reduce_scatter_same_with_fused_main_grad_writes(run_ranks):
    for plain, fused in run_ranks(fusion_worker, 2):
        assert fused["flags"] == [True, True] and plain["flags"] == [False, False]
        assert plain["calls"] == fused["calls"] == STEPS  # one bucket, through LoCo each step
        # same reduced shards, bit for bit (tolerance 0), at every step
        for a, b in zip(plain["shards"], fused["shards"]):
            assert torch.isfinite(b).all() and torch.equal(a, b)
        # and within LoCo's quantization bound of the exact (fp64) reduction of what was sent
        assert 0 < fused["worst"] <= 1.0 and 0 < plain["worst"] <= 1.0
