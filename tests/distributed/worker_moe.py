"""Train a tiny megatron-core MoE GPT (4 experts, EP 2) with LoCo on 4 ranks, and checkpoint it.

Grid: world 4 = DP 4 for the dense parameters, EP 2 x expert-DP 2 for the experts. megatron-core
puts the expert parameters in ``ddp.expert_parallel_buffers``, reduce-scattered over the
expert-DP group (megatron/core/distributed/distributed_data_parallel.py), and
``get_megatron_optimizer`` returns a ``ChainedOptimizer`` of a dense and an expert
``DistributedOptimizer`` (megatron/core/optimizer/__init__.py). Runs on CPU ranks (gloo + CUDA
emulation) with the all-to-all token dispatcher.
"""

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.distributed.worker_megatron import SEQ, VOCAB, ShardChecker, forward_backward

HIDDEN, EXPERTS, EP = 32, 4, 2


def setup_moe(ep=None):
    """CUDA emulation and model-parallel groups with expert parallelism ``EP``. The MoE
    router's ``@jit_fuser`` / ``@torch.compile`` functions run eagerly: dynamo cannot trace
    under the CUDA emulation (loco_megatron/emulation/cpu_cuda.py)."""
    import torch._dynamo
    from loco_megatron.emulation import activate
    from megatron.core import parallel_state as ps

    torch._dynamo.config.disable = True
    activate()
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16 without Transformer Engine tests it
        moe_utils.te_general_gemm = None           # unguarded in RouterGatingLinearFunction
    ps.initialize_model_parallel(expert_model_parallel_size=EP if ep is None else ep)


def build_moe_gpt(overlap: bool, bucket_size: int = 4000, ep=None):
    """A seeded 2-layer MoE GPTModel (4 experts, top-2, all-to-all dispatcher) in megatron-core
    DDP with the distributed optimizer, and its ``ChainedOptimizer`` (dense + expert Adam)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4,
                            use_cpu_initialization=True, pipeline_dtype=torch.float32,
                            hidden_dropout=0.0, attention_dropout=0.0,
                            num_moe_experts=EXPERTS, moe_router_topk=2,
                            expert_model_parallel_size=EP if ep is None else ep,
                            moe_token_dispatcher_type="allgather",
                            moe_aux_loss_coeff=0.0, add_bias_linear=False)  # 0.13: MoE has no bias
    gpt = GPTModel(config=cfg, vocab_size=VOCAB, max_sequence_length=SEQ,
                   transformer_layer_spec=get_gpt_layer_local_spec(
                       num_experts=EXPERTS, moe_grouped_gemm=False))
    ddp_cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=overlap, grad_reduce_in_fp32=True,
        bucket_size=bucket_size)
    model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=gpt)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, use_distributed_optimizer=True), [model])
    return model, opt


def startup_lines_worker(rank, world, ep):
    """LoCo 4-bit start-up lines of the MoE GPT at expert parallelism ``ep`` (rank 0's
    captured stdout; the other ranks return [])."""
    import contextlib
    import io

    import loco_megatron

    setup_moe(ep)
    loco_megatron.install(loco_megatron.LoCoConfig(bits=4, block_size=64))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            build_moe_gpt(False, ep=ep)
    finally:
        loco_megatron.uninstall()
    return [line for line in out.getvalue().splitlines() if line.startswith("> LoCo")]


def expert_dp_group():
    """The group expert buckets reduce-scatter over (``get_expert_data_parallel_group``,
    megatron/core/parallel_state.py, 0.13-0.19)."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_data_parallel_group()


def _expert_keys(model):
    return {b.loco_key for g in model.expert_parallel_bucket_groups for b in g.buckets}


def train_moe(mode: str, overlap: bool, steps: int, check_steps=(0, 3)):
    """Train with LoCo ``mode`` in {"stock", "bits16", "loco4"}; returns losses, parameters,
    counters split into dense and expert buckets, the group sizes the compressed collectives
    saw, and the worst shard/bound ratio of dense and of expert buckets."""
    import loco_megatron
    from loco_megatron.megatron import plugin
    from megatron.core import parallel_state as ps

    state = None
    if mode != "stock":
        state = loco_megatron.install(
            loco_megatron.LoCoConfig(bits={"bits16": 16, "loco4": 4}[mode], block_size=64))
    checker = ShardChecker(state) if state is not None and state.active else None
    sizes = {}
    if checker is not None:  # record the group size each bucket's compressed collective saw
        compress = state.compensator.compress

        def sizing_compress(key, g_in, layout=None):
            sizes.setdefault(key, set()).add(layout.world)
            return compress(key, g_in, layout)
        state.compensator.compress = sizing_compress
    try:
        model, opt = build_moe_gpt(overlap)
        losses, worst = [], {"dense": 0.0, "expert": 0.0}
        for step in range(steps):
            loss = forward_backward(model, opt)
            if checker is not None and step in check_steps:
                worst["dense"] = max(worst["dense"],
                                     checker.check(model, ps.get_data_parallel_group()))
                experts = SimpleNamespace(bucket_groups=model.expert_parallel_bucket_groups,
                                          ddp_config=model.ddp_config)
                worst["expert"] = max(worst["expert"], checker.check(experts, expert_dp_group()))
            opt.step()
            losses.append(float(loss))
        out = {"losses": losses, "shard_check": worst,
               "params": {n: p.detach().cpu().clone() for n, p in model.module.named_parameters()},
               "num_expert_buckets": sum(len(g.buckets)
                                         for g in model.expert_parallel_bucket_groups),
               "expert_dp": dist.get_world_size(expert_dp_group()),
               "optimizers": [type(o).__name__ for o in opt.chained_optimizers]}
        if checker is not None:
            expert = _expert_keys(model)
            calls = state.compensator.stats.steps
            out["counters"] = {
                "dense_steps": sorted(v for k, v in calls.items() if k not in expert),
                "expert_steps": sorted(v for k, v in calls.items() if k in expert),
                "expert_sizes": sorted({s for k in expert for s in sizes.get(k, ())}),
                "dense_sizes": sorted({s for k, v in sizes.items() if k not in expert for s in v}),
                "expert_buckets": len(expert), "buckets": state.num_buckets}
        assert plugin.get_state() is state
        return out, model, opt, state
    except BaseException:
        loco_megatron.uninstall()
        raise


def _save_fully_reshardable(model, opt, ckpt_dir) -> bool:
    """Save as Megatron-LM does with ``--dist-ckpt-optim-fully-reshardable`` (0.19
    megatron/training/checkpointing.py: ``chained_optim_avoid_prefix``, so the ChainedOptimizer
    does not prefix its dense and expert members' keys; LoCo's own keys must differ)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if "fully_reshardable" not in getattr(DistributedOptimizer,
                                          "checkpoint_fully_reshardable_formats", ()):
        return True  # megatron-core 0.13: no such format, and members always prefixed
    metadata = {"distrib_optim_sharding_type": "fully_reshardable",
                "chained_optim_avoid_prefix": True, "dp_cp_group": ps.get_data_parallel_group()}
    os.makedirs(ckpt_dir, exist_ok=True)
    model_sd = model.module.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd,
                             "optimizer": opt.sharded_state_dict(model_sd, metadata=metadata)},
                            ckpt_dir)
    return True


def moe_worker(rank, world, overlap, steps, ckpt_dir):
    """stock, bits16 and loco4 training; then the loco4 run is saved in both checkpoint formats
    and resumed from each (worker_resume.py). Returns the three runs' results and the
    resume comparison under ``"ckpt"`` (dense and expert buffers separately)."""
    import loco_megatron
    from loco_megatron.training.workarounds import fix_torch_adamw_resume
    from tests.distributed.worker_resume import save_then_resume

    setup_moe()
    fix_torch_adamw_resume()  # CPU: torch AdamW fallback (no TE/apex), as worker_ckpt.py
    results = {}
    for mode in ("stock", "bits16"):
        results[mode], *_ = train_moe(mode, overlap, steps)
        loco_megatron.uninstall()
    results["loco4"], model, opt, state = train_moe("loco4", overlap, steps)
    expert = _expert_keys(model)
    dense = {b.loco_key for g in model.bucket_groups for b in g.buckets}
    results["fully_reshardable_saved"] = _save_fully_reshardable(
        model, opt, os.path.join(ckpt_dir, "fully_reshardable"))
    results["ckpt"] = save_then_resume(model, opt, state, lambda: build_moe_gpt(overlap),
                                       state.config, ckpt_dir, {"dense": dense, "expert": expert})
    results["ckpt"]["torch_dirs"] = sorted(os.listdir(os.path.join(ckpt_dir, "torch")))
    return results


def corrupt_load_worker(rank, world, ckpt_dir, optimizer_index, dp_file):
    """Save the MoE model (dense + expert DistributedOptimizer, ``torch`` format), truncate one
    LoCo file of optimizer ``optimizer_index`` (``dp_file``: e.g. ``dp003``, in EP rank 1's
    directory) and load on every rank. Returns the load's error message (None: it loaded)."""
    import loco_megatron
    from loco_megatron.training.workarounds import fix_torch_adamw_resume
    from tests.distributed import worker_ckpt

    setup_moe()
    fix_torch_adamw_resume()
    config = loco_megatron.LoCoConfig(bits=4, block_size=64)
    loco_megatron.install(config)
    try:
        model, opt = build_moe_gpt(False)
        for _ in range(2):
            forward_backward(model, opt)
            opt.step()
        worker_ckpt.save(model, opt, "torch", ckpt_dir)
    finally:
        loco_megatron.uninstall()
    dist.barrier()
    if rank == 0:
        path = os.path.join(ckpt_dir, "mp_rank_00_001",
                            f"loco_state_{optimizer_index}_{dp_file}.pt")
        with open(path, "r+b") as f:
            f.truncate(100)
    dist.barrier()
    loco_megatron.install(config)
    try:
        model, opt = build_moe_gpt(False)
        try:
            worker_ckpt.load(model, opt, "torch", ckpt_dir)
        except Exception as e:  # noqa: BLE001 - the message is the result
            return f"{type(e).__name__}: {e}"
        return None
    finally:
        loco_megatron.uninstall()
