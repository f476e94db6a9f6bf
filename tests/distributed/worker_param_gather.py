"""Ranks of the ``--loco-param-bits`` tests: the tiny GPT of :mod:`.worker_megatron` trained with
the weight-difference parameter all-gather, checking after every step that the replicas hold
the same bits, that ``|main - held|`` is within the bound and what went on the wire."""

import torch
import torch.distributed as dist

from .worker_megatron import build_gpt, forward_backward, setup, tp_drift

MODES = {"stock": {}, "param16": dict(param_bits=16), "unset": {},
         "param4": dict(param_bits=4), "param8": dict(param_bits=8),
         "both4": dict(bits=4, param_bits=4)}


def replicas_identical(params, group) -> bool:
    """Every tensor of ``params`` bit-identical on all ranks of ``group`` (their raw bytes)."""
    flat = torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in params])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, flat, group=group)
    return all(torch.equal(c, flat) for c in copies)


def drift_ratio(opt, sync) -> float:
    """Largest ``|main - held| / bound`` over this rank's own shards (<= 1 within the bound):
    bound = half the block's quantization step of the last difference + half an ulp of the
    parameter dtype + the fp32 roundings of ``new - held`` and ``held + deQ``."""
    from loco_megatron.megatron import param_sync
    from loco_megatron.kernels import block_table
    from loco_megatron.weight_difference import shard_layouts

    worst = 0.0
    for o in getattr(opt, "chained_optimizers", [opt]):
        entries = param_sync._optimizer_entries(o, sync)
        held = {e.bucket.loco_key: e.own().clone() for e in entries}
        new = param_sync.main_shards(o, entries)
        for e in entries:
            key = e.bucket.loco_key
            if key not in sync.last_scales:
                continue
            lay = shard_layouts(e.layout)[e.rank]
            spans = block_table(lay, "cpu").spans  # each block's wire elements
            half = (sync.last_scales[key][:lay.blocks_per_shard] / 2).cpu()
            half = half.repeat_interleave(spans)
            step = torch.empty(lay.shard, dtype=torch.float32)
            lay.from_padded_shard(half, 0, step)
            h = held[key].float()
            ulp = torch.finfo(held[key].dtype).eps * h.abs() / 2
            fp32 = 2 * torch.finfo(torch.float32).eps * torch.maximum(new[key].abs(), h.abs())
            bound = step + ulp + fp32 + 1e-30
            worst = max(worst, float(((new[key] - h).abs() / bound).max()))
    return worst


def independent_drift(opt, sync):
    """The iteration line's drift figures recomputed in fp64 from the main parameters and the
    model parameters of every rank's own shards: ``(max |main - held| / rms(main),
    rms(main - held) / rms(main))`` over all ranks."""
    from loco_megatron.megatron import param_sync

    worst, rsq, msq, n = 0.0, 0.0, 0.0, 0
    for o in getattr(opt, "chained_optimizers", [opt]):
        entries = param_sync._optimizer_entries(o, sync)
        for key, new in param_sync.main_shards(o, entries).items():
            e = sync.buckets[key]
            r = new.double() - e.own().double()
            worst = max(worst, float(r.abs().max()))
            rsq, msq, n = rsq + float(r.dot(r)), msq + float(new.double().dot(new.double())), \
                n + r.numel()
    top = torch.tensor([worst], dtype=torch.float64)
    sums = torch.tensor([rsq, msq, float(n)], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    dist.all_reduce(sums)
    rms = (sums[1] / sums[2]).sqrt()
    return float(top[0] / rms), float((sums[0] / sums[2]).sqrt() / rms)


def train(mode: str, overlap: bool, steps: int, *, params_dtype=torch.float32,
          bucket_size: int = 20000, block_size: int = 256, **build_kwargs):
    """Train ``steps`` steps; returns losses, final parameters, per-step replica checks and
    drift ratios, and the parameter all-gather's byte counts."""
    import loco_megatron
    from loco_megatron.accounting import param_gather_bytes_per_step
    from megatron.core import parallel_state as ps

    state = None
    if mode != "stock":
        state = loco_megatron.install(loco_megatron.LoCoConfig(block_size=block_size,
                                                               **MODES[mode]))
    sync = state.param_sync if state is not None else None
    handed = []
    original, original_into = dist.all_gather, dist.all_gather_into_tensor

    def recorder(fn):
        def recording(output, tensor, group=None, async_op=False):
            handed.append(tensor.numel() * tensor.element_size())
            return fn(output, tensor, group=group, async_op=async_op)
        return recording

    try:
        model, opt = build_gpt(overlap, bucket_size, params_dtype=params_dtype,
                               overlap_param_gather=overlap, **build_kwargs)
        dp = ps.get_data_parallel_group()
        losses, identical, drifts, step_bytes, handed_bytes, figures = [], [], [], [], [], []
        if sync is not None:
            sync.stats.track_drift = True  # as the iteration line does
        layout_shards = [(e.layout.shard, e.layout.block_size) for e in sync.buckets.values()] \
            if sync is not None else []
        for step in range(steps):
            before = sync.stats.bytes_sent if sync is not None else 0
            # what the parameter path hands the collectives
            dist.all_gather, dist.all_gather_into_tensor = recorder(original), \
                recorder(original_into)
            try:
                loss = forward_backward(model, opt)
                opt.step()  # (not overlapped: this step's gather)
                if overlap:  # what the next forward's pre-hooks do: launch, wait, apply
                    for group in model.bucket_groups:
                        group.finish_param_sync(skip_next_bucket_dispatch=True)
            finally:
                dist.all_gather, dist.all_gather_into_tensor = original, original_into
            step_bytes.append((sync.stats.bytes_sent - before) if sync is not None else 0)
            handed_bytes.append(sum(handed))
            handed.clear()
            losses.append(float(loss))
            identical.append(replicas_identical(model.module.parameters(), dp))
            if sync is not None:
                drifts.append(drift_ratio(opt, sync))
                figures.append((sync.stats.reduce(1), independent_drift(opt, sync)))
        model.start_param_sync(force_sync=True)  # as megatron before a save or evaluation
        identical.append(replicas_identical(model.module.parameters(), dp))
        expected = None
        if sync is not None:
            layouts = [(e.layout, e.bucket.param_data.element_size())
                       for e in sync.buckets.values()]
            expected = param_gather_bytes_per_step(sync.config.param_bits, layouts)
        return {"losses": losses,
                "params": {n: p.detach().float().clone() for n, p in model.module.named_parameters()},
                "identical": identical, "drift": drifts, "tp_drift": tp_drift(model),
                "step_bytes": step_bytes, "handed": handed_bytes, "expected": expected,
                "stats": None if sync is None else (sync.stats.bytes_sent, sync.stats.stock_bytes,
                                                    sync.stats.exact_gathers, sync.stats.calls,
                                                    sync.fp32_copies),
                "buckets": len(model.bucket_groups), "shards": layout_shards,
                "figures": figures}
    finally:
        loco_megatron.uninstall()


def grid_worker(rank, world, tp, modes, steps, overlap, params_dtype, build_kwargs=None):
    """``train`` each mode of ``modes`` on a TP ``tp`` x DP ``world / tp`` grid."""
    setup(tp, "gloo")
    return {mode: train(mode, overlap, steps, params_dtype=params_dtype, **(build_kwargs or {}))
            for mode in modes}


def moe_worker(rank, world, steps, modes=("stock", "param4", "both4")):
    """MoE with EP 2 on ``world`` ranks (worker_moe.py's model, overlapped gradient reduce):
    per mode, per step, dense parameters identical over the DP group and expert parameters
    over the expert-DP group; losses; the registered buckets' group sizes."""
    import loco_megatron

    from .worker_moe import build_moe_gpt, expert_dp_group, setup_moe
    from megatron.core import parallel_state as ps

    setup_moe()
    out = {}
    for mode in modes:
        state = None
        if mode != "stock":
            state = loco_megatron.install(loco_megatron.LoCoConfig(block_size=64, **MODES[mode]))
        try:
            model, opt = build_moe_gpt(True)
            experts = {id(p) for g in model.expert_parallel_bucket_groups for b in g.buckets
                       for p in b.params}
            dense = [p for p in model.module.parameters() if id(p) not in experts]
            expert = [p for p in model.module.parameters() if id(p) in experts]
            losses, identical = [], []
            for _ in range(steps):
                losses.append(float(forward_backward(model, opt)))
                opt.step()
                identical.append((replicas_identical(dense, ps.get_data_parallel_group()),
                                  replicas_identical(expert, expert_dp_group())))
            sizes = sorted({e.world for e in state.param_sync.buckets.values()}) \
                if state is not None else []
            out[mode] = {"losses": losses, "identical": identical, "group_sizes": sizes,
                         "expert_dp": dist.get_world_size(expert_dp_group()),
                         "expert_buckets": sum(len(g.buckets)
                                               for g in model.expert_parallel_bucket_groups)}
        finally:
            loco_megatron.uninstall()
    return out


def fp16_worker(rank, world, modes=("param4", "both4")):
    """fp16 with megatron's dynamic loss scaler (worker_loss_scale.py's model) and an inf on
    rank 0 at ``INF_STEP``: per step whether the update happened, the parameter all-gather
    bytes this rank sent, and whether the replicas are identical."""
    import loco_megatron
    from megatron.core import parallel_state as ps

    from .worker_loss_scale import INF_STEP, STEPS, build_fp16_gpt, fp16_step

    setup(1, "gloo")
    out = {}
    for mode in modes:
        state = loco_megatron.install(loco_megatron.LoCoConfig(block_size=64, **MODES[mode]))
        try:
            model, opt = build_fp16_gpt()
            rows = []
            for step in range(STEPS):
                poison = float("inf") if step == INF_STEP and dist.get_rank() == 0 else None
                fp16_step(model, opt, poison)
                before = state.param_sync.stats.bytes_sent
                ok, _, _ = opt.step()
                rows.append((bool(ok), state.param_sync.stats.bytes_sent - before,
                             replicas_identical(model.module.parameters(),
                                                ps.get_data_parallel_group())))
            out[mode] = rows
        finally:
            loco_megatron.uninstall()
    return out


def reload_worker(rank, world, hook, steps=5):
    """Overlapped bf16 training (weight differences pending between the optimizer step and the
    next forward) with ``hook`` after step 2: ``"model_load"`` loads the model's step-0 state
    dict and the optimizer's main parameters from it (an in-process weight reload), ``"double_
    step"`` makes a second optimizer step before the forward. Per step: replicas identical."""
    import loco_megatron
    from megatron.core import parallel_state as ps

    setup(1, "gloo")
    out = {}
    for mode in ("stock", "param4"):
        if mode != "stock":
            loco_megatron.install(loco_megatron.LoCoConfig(param_bits=4, block_size=64))
        try:
            model, opt = build_gpt(True, 6000, dropout=0.0, params_dtype=torch.bfloat16,
                                   overlap_param_gather=True)
            identical, snap = [], None
            for step in range(steps):
                forward_backward(model, opt)
                if step == 0:
                    snap = {k: v.clone() if torch.is_tensor(v) else v
                            for k, v in model.state_dict().items()}
                opt.step()
                if step == 2 and hook == "model_load":
                    with torch.no_grad():
                        model.load_state_dict(snap)
                    opt.reload_model_params()
                if step == 2 and hook == "double_step":
                    opt.step()
                for group in model.bucket_groups:  # what the next forward's pre-hooks do
                    group.finish_param_sync(skip_next_bucket_dispatch=True)
                identical.append(replicas_identical(model.module.parameters(),
                                                    ps.get_data_parallel_group()))
            model.start_param_sync(force_sync=True)
            identical.append(replicas_identical(model.module.parameters(),
                                                ps.get_data_parallel_group()))
            out[mode] = identical
        finally:
            loco_megatron.uninstall()
    return out
