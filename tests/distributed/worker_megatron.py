"""Train a tiny megatron-core GPT (GPTModel + DDP + DistributedOptimizer) on one rank of a grid.

Shared by the grid tests; runs unchanged on CPU ranks (gloo + CUDA emulation) and on GPUs
(NCCL). ``train(...)`` returns per-step losses, final parameters, LoCo counters and, when asked,
the check of each reduced shard against the exact reduction of what every rank sent.
"""

import torch
import torch.distributed as dist

VOCAB, SEQ, HIDDEN = 128, 32, 64


def setup(tp: int, backend: str):
    """Emulate CUDA on CPU ranks and initialise megatron's model-parallel groups."""
    if backend == "gloo":
        from loco_megatron.emulation import activate

        activate()
    else:
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)


class ShardChecker:
    """Records what the compensator sends (compensated input h, in the padded layout) so the
    reduced shards can be compared with the exact reduction of the h of all DP ranks:
    the sum, or the mean with ``average_in_collective`` (``ReduceOp.AVG``), plus the rounding to
    the gradient buffer's dtype."""

    def __init__(self, state):
        self.state, self.sent = state, {}
        self.last = {}  # bucket key -> (reduced shard, exact, bound) of the latest check, fp64
        compress = state.compensator.compress

        def recording_compress(key, g_in, layout=None):
            g = g_in if layout is None else layout.to_padded(
                g_in, torch.float64 if g_in.dtype == torch.float64 else torch.float32)
            err = state.compensator.errors.get(key)
            h = g.double() + (err.get().double() if err is not None else 0)
            self.sent[key] = h
            return compress(key, g_in, layout)

        state.compensator.compress = recording_compress

    def check(self, model, dp_group, sum_group=None, summed_over=None) -> float:
        """Max of |reduced - exact| / bound over every bucket of ``model`` (one DDP chunk;
        must be <= 1); the bound includes one rounding to the gradient buffer's dtype (bf16/fp16
        buffers). ``dp_group``: the group the buckets reduce-scatter over; ``sum_group``
        (default ``dp_group``): the ranks whose h the reduced shard sums (e.g. the whole DP group
        with several distributed optimizer instances, where the shard is all-reduced across
        instances after); ``summed_over(bucket)``: a process group whose ranks' reduced shards
        of this bucket megatron sums after the reduce-scatter (finalize_model_grads' embedding
        all-reduce between first and last pipeline stage), or None."""
        from tests.helpers.blocks import half_steps, spans

        cfg, worst = self.state.config, 0.0
        rank, world = dist.get_rank(dp_group), dist.get_world_size(dp_group)
        sum_group = dp_group if sum_group is None else sum_group
        for group in model.bucket_groups:
            for bucket in group.buckets:
                h = self.sent[bucket.loco_key]
                half_step = half_steps(h, spans(self.state.layouts[bucket.loco_key]), cfg.bits)
                exact, bound = h.clone(), half_step.clone()
                dist.all_reduce(exact, group=sum_group)
                dist.all_reduce(bound, group=sum_group)
                if model.ddp_config.average_in_collective:  # ReduceOp.AVG (also across instances)
                    n = dist.get_world_size(sum_group)
                    exact, bound = exact / n, bound / n
                if summed_over is not None and summed_over(bucket) is not None:
                    dist.all_reduce(exact, group=summed_over(bucket))
                    dist.all_reduce(bound, group=summed_over(bucket))
                layout = self.state.layouts[bucket.loco_key]
                shard = bucket.grad_data.numel() // world
                exp, bnd = (torch.empty(shard, dtype=torch.float64) for _ in range(2))
                ps = layout.padded_shard
                layout.from_padded_shard(exact[rank * ps:(rank + 1) * ps], rank, exp)
                layout.from_padded_shard(bound[rank * ps:(rank + 1) * ps], rank, bnd)
                got = bucket.grad_data[rank * shard:(rank + 1) * shard].double().cpu()
                eps = torch.finfo(bucket.grad_data.dtype).eps  # + rounding to the buffer dtype
                bnd = bnd.cpu() * (1 + eps) + exp.cpu().abs() * eps
                ratio = (got - exp.cpu()).abs() / (bnd * (1 + 1e-5) + 1e-7)
                worst = max(worst, float(ratio.max()))
                self.last[bucket.loco_key] = (got, exp.cpu(), bnd)
        return worst


def build_gpt(overlap: bool, bucket_size: int = 20000, dropout: float = 0.1, *,
              params_dtype: torch.dtype = torch.float32, grad_reduce_in_fp32: bool = True,
              module_fn=None, disable_bucketing: bool = False,
              use_distributed_optimizer: bool = True, num_layers: int = 2, **ddp_kwargs):
    """A seeded 2-layer GPTModel wrapped in megatron-core DDP, and its distributed Adam.

    ``params_dtype=torch.bfloat16`` builds it as megatron.training does for ``--bf16``
    (bf16 parameters, ``Float16Module``); ``module_fn(gpt)`` may wrap the GPT before DDP;
    ``disable_bucketing`` is DDP's (megatron.training sets it for virtual-pipeline chunks > 0);
    ``use_distributed_optimizer=False``: plain DDP (all-reduce) and megatron's plain optimizer;
    ``num_layers``: transformer layers (12 parameters each)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    bf16 = params_dtype == torch.bfloat16
    cfg = TransformerConfig(num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=4,
                            use_cpu_initialization=True, pipeline_dtype=params_dtype,
                            hidden_dropout=dropout, attention_dropout=dropout,
                            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                            **(dict(bf16=True, params_dtype=params_dtype) if bf16 else {}))
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=VOCAB, max_sequence_length=SEQ)
    if bf16:
        from megatron.core.transformer.module import Float16Module

        gpt = Float16Module(cfg, gpt)
    if module_fn is not None:
        gpt = module_fn(gpt)
    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=overlap,
        grad_reduce_in_fp32=grad_reduce_in_fp32, bucket_size=bucket_size, **ddp_kwargs)
    model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=gpt,
                                    disable_bucketing=disable_bucketing)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3,
                        use_distributed_optimizer=use_distributed_optimizer,
                        **(dict(bf16=True, params_dtype=params_dtype) if bf16 else {})),
        [model])
    return model, opt


def forward_backward(model, opt) -> torch.Tensor:
    """One step's forward, backward and gradient reduction on a fixed per-DP-rank batch."""
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(100 + ps.get_data_parallel_rank())  # same on TP ranks
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=gen).to(device)
    position = torch.arange(SEQ, device=device).unsqueeze(0).expand(4, -1)
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ, device=device)) < 0.5
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = model(tokens, position, mask, labels=tokens).mean()
    loss.backward()
    model.finish_grad_sync()
    return loss


def stale_model_worker(rank, world):
    """A model wrapped under an earlier install() is refused after a re-install."""
    import loco_megatron

    setup(1, "gloo")
    loco_megatron.install(loco_megatron.LoCoConfig(bits=4))
    old_model, old_opt = build_gpt(overlap=False)
    forward_backward(old_model, old_opt)
    loco_megatron.uninstall()
    forward_backward(old_model, old_opt)  # after uninstall: stock path, no error
    state = loco_megatron.install(loco_megatron.LoCoConfig(bits=4))
    new_model, new_opt = build_gpt(overlap=False)
    forward_backward(new_model, new_opt)
    calls = state.wire.calls
    try:
        forward_backward(old_model, old_opt)
        message = None
    except RuntimeError as e:
        message = str(e)
    loco_megatron.uninstall()
    return message, calls


def tp_drift(model) -> float:
    """Largest difference of a TP-replicated parameter (not ``tensor_model_parallel``) between
    this rank and the other ranks of its TP group."""
    from megatron.core import parallel_state as ps

    group, worst = ps.get_tensor_model_parallel_group(), 0.0
    for p in model.module.parameters():
        if getattr(p, "tensor_model_parallel", False):
            continue
        copies = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
        dist.all_gather(copies, p.detach().contiguous(), group=group)
        worst = max(worst, max(float((c - p).abs().max()) for c in copies))
    return worst


def train(mode: str, overlap: bool, steps: int = 20, bucket_size: int = 20000,
          check_steps=(0, 7), block_size: int = 256, start_iter: int = 0,
          param_sync: bool = True, **build_kwargs):
    """Build and train the tiny GPT with LoCo ``mode`` in {"stock", "unset", "bits16", "loco4",
    "loco8", "param16", "param4"} ("unset": installed with ``LoCoConfig()``, bits None;
    "param*": ``--loco-param-bits`` alone); ``build_kwargs`` go to
    :func:`build_gpt` (e.g. ``use_distributed_optimizer=False``); ``param_sync=False`` turns
    DDP's forward pre-hook (the overlapped parameter all-gather) off after building, for
    ``overlap_param_gather`` without a distributed or layer-wise optimizer to feed it."""
    import loco_megatron
    from megatron.core import parallel_state as ps

    state = None
    if mode != "stock":
        bits = {"unset": None, "bits16": 16, "loco4": 4, "loco8": 8, "param16": None,
                "param4": None}[mode]
        param_bits = {"param16": 16, "param4": 4}.get(mode)
        state = loco_megatron.install(loco_megatron.LoCoConfig(
            bits=bits, block_size=block_size, start_iter=start_iter, param_bits=param_bits))
    checker = ShardChecker(state) if state is not None and state.active else None
    try:
        model, opt = build_gpt(overlap, bucket_size, **build_kwargs)
        if not param_sync and getattr(model, "use_forward_hook", False):  # 0.17+ sets it here
            model.disable_forward_pre_hook(param_sync=False)
        losses, worst = [], 0.0
        for step in range(steps):
            loss = forward_backward(model, opt)
            if checker is not None and step in check_steps:
                worst = max(worst, checker.check(model, ps.get_data_parallel_group()))
            opt.step()
            losses.append(float(loss))
        params = {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()}
        drift = tp_drift(model)
        counters = {}
        if state is not None and state.active:
            counters = {"calls": state.wire.calls, "compress": state.compensator.stats.calls,
                        "buckets": state.num_buckets, "bytes": state.wire.bytes_sent,
                        "stock_bytes": state.wire.stock_bytes,
                        "steps": sorted(set(state.compensator.stats.steps.values()))}
        return {"losses": losses, "params": params, "tp_drift": drift, "counters": counters,
                "shard_check": worst, "num_bucket_groups": len(model.bucket_groups)}
    finally:
        loco_megatron.uninstall()


def param_ranges_worker(rank, world):
    """Check compat.bucket_param_ranges against each parameter's main_grad storage offset."""
    import loco_megatron
    from loco_megatron.megatron import compat

    setup(1, "gloo")
    # parameters of 3-70 elements: small blocks, or LoCo would send more than stock (refused)
    loco_megatron.install(loco_megatron.LoCoConfig(bits=4, block_size=16))
    try:
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)
        from megatron.core.transformer.transformer_config import TransformerConfig

        torch.manual_seed(0)  # odd parameter sizes (70, 7, 21, 3, ...): padded starts
        module = torch.nn.Sequential(*[torch.nn.Linear(10 - 3 * (i % 2), 7 - 4 * (i % 2))
                                       for i in range(6)])
        model = DistributedDataParallel(
            config=TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                                     use_cpu_initialization=True),
            module=module, ddp_config=DistributedDataParallelConfig(
                use_distributed_optimizer=True, bucket_size=200, overlap_grad_reduce=True))
        checked = padded = 0
        for buffer in compat.ddp_buffers(model):
            for bucket in buffer.buckets:
                ranges = compat.bucket_param_ranges(buffer, bucket)
                assert ranges == bucket.loco_param_ranges
                running = 0
                for param in bucket.params_list:
                    start, end = ranges[param]
                    offset = (param.main_grad.data_ptr() - bucket.grad_data.data_ptr()) \
                        // bucket.grad_data.element_size()
                    assert (start, end - start) == (offset, param.numel()), (start, end, offset)
                    padded += start != running
                    running += param.numel()
                    checked += 1
        return checked, padded
    finally:
        loco_megatron.uninstall()


def warmup_worker(rank, world, start_iter, steps):
    """Stock vs LoCo 4-bit with ``--loco-start-iter start_iter`` (overlapped, several buckets)."""
    setup(1, "gloo")
    return {"stock": train("stock", True, steps, bucket_size=6000, check_steps=()),
            "loco4": train("loco4", True, steps, bucket_size=6000, check_steps=(),
                           start_iter=start_iter)}


def grid_worker(rank, world, tp, overlap, backend, modes):
    setup(tp, backend)
    return {mode: train(mode, overlap) for mode in modes}


def loco_off_worker(rank, world, tp, modes, build_kwargs):
    """``train`` each of ``modes`` (20 steps) with ``build_kwargs`` (e.g. plain DDP); each
    result also holds ``gathers``: the ``all_gather_object`` calls the rank made (LoCo's
    start-up agreement check is one per DP group; none where LoCo could not compress)."""
    setup(tp, "gloo")
    kwargs = dict(build_kwargs)
    overlap = kwargs.pop("overlap_grad_reduce", False)
    original, out = dist.all_gather_object, {}
    for mode in modes:
        calls = []

        def counting(*args, **kw):
            calls.append(1)
            return original(*args, **kw)

        dist.all_gather_object = counting
        try:
            out[mode] = train(mode, overlap, check_steps=(), **kwargs)
        finally:
            dist.all_gather_object = original
        out[mode]["gathers"] = len(calls)
    return out
