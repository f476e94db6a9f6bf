"""Rank workers for test_loss_scale.py: LoCo's error buffers under megatron-core's fp16
loss scaling (loco_megatron/megatron/loss_scale.py).

Each phase returns plain facts (floats, bools, messages) computed on the rank; the test asserts
on them. The tiny GPT is wrapped as ``megatron.training.get_model`` does for ``--fp16``:
``Float16Module`` (fp16 parameters), then megatron-core DDP with the distributed optimizer.
"""

import torch
import torch.distributed as dist

from tests.helpers.blocks import decoded_error
from .worker_megatron import SEQ, VOCAB, ShardChecker, setup

#: initial loss scale, growth interval: the scale grows after steps 2 and 7, and an inf
#: injected at step 4 backs it off (hysteresis 1), within 8 steps
INITIAL_SCALE, WINDOW, INF_STEP, STEPS = 2.0 ** 10, 3, 4, 8
#: steps whose reduced shards are checked against the exact reduction: the first, the one
#: after a growth (rescaled errors fed back) and the one after the overflow (cleared errors)
CHECK_STEPS = (0, 3, 5)


def _errors(state):
    """A copy of every stored error tensor, by (bucket key, field)."""
    return {(key, name): t.detach().clone() for key, buf in state.compensator.errors.items()
            for name, t in buf.tensors().items()}


def _decoded(state):
    """Every error buffer decoded to fp64 (int8: codes * scale, exact in fp64)."""
    out = {}
    for key, buf in state.compensator.errors.items():
        out[key] = decoded_error(buf)
    return out


# ---- unit: a real grad scaler driven by hand ----

def _scaler_unit(error_dtype: str, growth_factor: float):
    """Drive a DynamicGradScaler through growth, hysteresis and backoff with compressed steps
    in between; compare every error buffer with an fp64 reference after each update."""
    import loco_megatron
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    state = loco_megatron.install(loco_megatron.LoCoConfig(bits=4, block_size=32,
                                                           error_dtype=error_dtype))
    try:
        comp = state.compensator
        scaler = DynamicGradScaler(initial_scale=2.0 ** 8, min_scale=1.0,
                                   growth_factor=growth_factor, backoff_factor=0.5,
                                   growth_interval=2, hysteresis=2)
        gen = torch.Generator().manual_seed(7)
        flags = [False, False, False, True, False, True, True, False, False]  # grow, hyst, back
        worst, events = 0.0, []
        for found_inf in flags:
            for key, n in (("a", 96), ("b", 160)):
                comp.compress(key, torch.randn(n, generator=gen) * float(scaler.scale))
            ref = _decoded(state)
            before = scaler.scale
            scaler.update(found_inf)
            ratio = float(scaler.scale.double() / before.double())
            if found_inf:
                ref = {k: torch.zeros_like(v) for k, v in ref.items()}
            else:
                ref = {k: v * ratio for k, v in ref.items()}
            got = _decoded(state)
            for k in ref:
                err = (got[k] - ref[k]).abs() / ref[k].abs().clamp_min(1e-30)
                worst = max(worst, float(err.max()))
            events.append((found_inf, ratio, all(torch.equal(got[k], ref[k]) for k in ref),
                           all(float(v.abs().max()) > 0 for v in got.values())))
        return {"events": events, "worst_rel": worst, "clears": state.loss_scale.clears,
                "rescales": state.loss_scale.rescales}
    finally:
        loco_megatron.uninstall()


def _chain_and_uninstall():
    """Two scalers updating identically (a ChainedOptimizer's dense and expert optimizers):
    one rescale; a ConstantGradScaler's found_inf clears; after uninstall (and with LoCo off)
    update() touches nothing and is megatron's own method again."""
    import loco_megatron
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    originals = (DynamicGradScaler.update, ConstantGradScaler.update)
    state = loco_megatron.install(loco_megatron.LoCoConfig(bits=8, block_size=32))
    comp = state.compensator
    patched = (DynamicGradScaler.update, ConstantGradScaler.update) != originals
    scalers = [DynamicGradScaler(2.0 ** 4, 1.0, 2.0, 0.5, 1, 1) for _ in range(2)]
    comp.compress("a", torch.randn(64, generator=torch.Generator().manual_seed(3)))
    before = _decoded(state)["a"]
    for s in scalers:  # both grow (growth_interval 1): one rescale by 2
        s.update(False)
    chain_once = torch.equal(_decoded(state)["a"], 2 * before)
    ConstantGradScaler(2.0 ** 4).update(True)
    constant_clears = float(_decoded(state)["a"].abs().max()) == 0.0
    comp.compress("a", torch.randn(64, generator=torch.Generator().manual_seed(4)))
    kept = _errors(state)
    loco_megatron.uninstall()
    restored = (DynamicGradScaler.update, ConstantGradScaler.update) == originals
    scalers[0].update(False)
    scalers[0].update(True)
    after_uninstall = all(torch.equal(kept[k], v) for k, v in _errors(state).items())
    off = loco_megatron.install(loco_megatron.LoCoConfig(bits=16))
    off_untouched = (DynamicGradScaler.update, ConstantGradScaler.update) == originals
    loco_megatron.uninstall()
    return {"patched": patched, "chain_once": chain_once, "rescales": state.loss_scale.rescales,
            "constant_clears": constant_clears, "restored": restored,
            "after_uninstall": after_uninstall, "off_untouched": off_untouched and not off.active}


# ---- end to end: megatron-core GPT in fp16 with the dynamic loss scaler ----

def build_fp16_gpt(loss_scale=None, check_for_nan_in_grad=False, overlap=True):
    """A seeded 2-layer GPTModel in fp16 (``Float16Module``), megatron-core DDP (fp16 grad
    buffers, several buckets) and the distributed Adam with megatron's grad scaler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True, fp16=True, params_dtype=torch.float16,
                            pipeline_dtype=torch.float16, hidden_dropout=0.0,
                            attention_dropout=0.0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=VOCAB, max_sequence_length=SEQ)
    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=overlap, grad_reduce_in_fp32=False,
        bucket_size=4000, check_for_nan_in_grad=check_for_nan_in_grad)
    model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg,
                                    module=Float16Module(cfg, gpt))
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, use_distributed_optimizer=True, fp16=True,
        params_dtype=torch.float16, loss_scale=loss_scale, initial_loss_scale=INITIAL_SCALE,
        min_loss_scale=1.0, loss_scale_window=WINDOW, hysteresis=1), [model])
    return model, opt


def fp16_step(model, opt, poison=None):
    """Forward, scaled backward and gradient reduction of one step, as megatron's schedules do
    (``loss * optimizer.get_loss_scale()``); ``poison`` (inf or nan) multiplies the scaled loss,
    so every gradient of this rank is non-finite."""
    from megatron.core import parallel_state as ps

    gen = torch.Generator().manual_seed(100 + ps.get_data_parallel_rank())
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=gen)
    position = torch.arange(SEQ).unsqueeze(0).expand(4, -1)
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = model(tokens, position, mask, labels=tokens).float().mean()
    scaled = opt.scale_loss(loss)
    if poison is not None:
        scaled = scaled * poison
    scaled.backward()
    model.finish_grad_sync()
    return float(loss)


def _params(model):
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def train_fp16(mode: str, error_dtype: str = "int8"):
    """Train ``STEPS`` steps in fp16 with the dynamic loss scaler, an inf on rank 0 at
    ``INF_STEP``; per step: loss, scale before/after, update_successful, whether the
    parameters moved, and (LoCo) facts about the error buffers before and after the update."""
    import loco_megatron
    from megatron.core import parallel_state as ps

    state = None
    if mode != "stock":
        bits = {"bits16": 16, "loco4": 4}[mode]
        state = loco_megatron.install(loco_megatron.LoCoConfig(bits=bits, block_size=64,
                                                               error_dtype=error_dtype))
    try:
        checker = ShardChecker(state) if state is not None and state.active else None
        model, opt = build_fp16_gpt()
        steps, worst = [], 0.0
        for step in range(STEPS):
            poison = float("inf") if step == INF_STEP and dist.get_rank() == 0 else None
            loss = fp16_step(model, opt, poison)
            if checker is not None and step in CHECK_STEPS:  # fp16 buffer: + its rounding
                worst = max(worst, checker.check(model, ps.get_data_parallel_group()))
            before_params, scale_before = _params(model), float(opt.get_loss_scale())
            pre = _errors(state) if state is not None and state.active else {}
            ok, _, _ = opt.step()
            post = _errors(state) if pre else {}
            scale_after = float(opt.get_loss_scale())
            factor = scale_after / scale_before
            rec = {"loss": loss, "scale_before": scale_before, "scale_after": scale_after,
                   "ok": bool(ok), "params_moved": any(
                       not torch.equal(p, before_params[n]) for n, p in _params(model).items())}
            if pre:
                scaled_fields = {"scales", "values"}
                rec.update(
                    pre_nonzero=all(float(t.abs().max()) > 0 for (_, f), t in pre.items()
                                    if f in scaled_fields),
                    post_zero=all(float(t.abs().max()) == 0 for t in post.values()),
                    post_finite=all(bool(torch.isfinite(t.float()).all()) for t in post.values()),
                    post_is_factor_pre=all(
                        torch.equal(post[k], pre[k] * factor if k[1] in scaled_fields else pre[k])
                        for k in pre))
            steps.append(rec)
        out = {"steps": steps, "params": {n: p.cpu() for n, p in _params(model).items()}}
        if state is not None and state.active:
            out.update(shard_check=worst, clears=state.loss_scale.clears,
                       rescales=state.loss_scale.rescales,
                       nonfinite=state.compensator.nonfinite_updates(),
                       compress=state.compensator.stats.calls, buckets=state.num_buckets,
                       counter_steps=sorted(set(state.compensator.stats.steps.values())))
        return out
    finally:
        loco_megatron.uninstall()


def nan_check(rank):
    """``check_for_nan_in_grad=True`` (as megatron.training keeps it with a constant loss
    scale): two good steps, then a NaN in rank 0's gradients. Megatron's check must raise before
    any LoCo work. Rank 1 sits the poisoned step out (a peer of a failing rank would wait in the
    collective, LoCo or stock alike)."""
    import loco_megatron

    state = loco_megatron.install(loco_megatron.LoCoConfig(bits=4, block_size=64))
    try:
        model, opt = build_fp16_gpt(loss_scale=2.0 ** 10, check_for_nan_in_grad=True)
        for _ in range(2):
            fp16_step(model, opt)
            opt.step()
        dist.barrier()
        if rank != 0:
            return None
        calls, kept = state.compensator.stats.calls, _errors(state)
        nonfinite = state.compensator.nonfinite_updates()
        try:
            fp16_step(model, opt, poison=float("nan"))
            message = None
        except RuntimeError as e:
            message = str(e)
        return {"message": message, "calls_before": calls,
                "calls_after": state.compensator.stats.calls,
                "errors_untouched": kept.keys() == _errors(state).keys() and all(
                    torch.equal(kept[k], v) for k, v in _errors(state).items()),
                "nonfinite_unchanged": state.compensator.nonfinite_updates() == nonfinite,
                "had_errors": len(kept) > 0}
    finally:
        loco_megatron.uninstall()


def loss_scale_worker(rank, world, backend="gloo"):
    """Every phase in one spawn: unit checks, stock/bits16/LoCo fp16 training, the NaN check."""
    setup(1, backend)
    out = {"unit": {(dt, g): _scaler_unit(dt, g) for dt, g in
                    (("int8", 2.0), ("fp32", 2.0), ("fp32", 3.0))},
           "chain": _chain_and_uninstall()}
    out.update({mode: train_fp16(mode) for mode in ("stock", "bits16", "loco4")})
    out["loco4_fp32"] = train_fp16("loco4", error_dtype="fp32")
    out["nan"] = nan_check(rank)
    return out
