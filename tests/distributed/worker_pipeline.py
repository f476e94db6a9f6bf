"""Train a tiny megatron-core GPT split over 2 pipeline stages (PP2 x DP2, 4 ranks).

The model is built per stage as megatron.training's ``get_model`` does (``pre_process`` /
``post_process`` per stage and virtual chunk, ``vp_stage``), every chunk wrapped in
megatron-core DDP with the distributed optimizer (chunks after the first with
``disable_bucketing``), and trained by megatron-core's own schedule
(``get_forward_backward_func``: 1F1B, or the interleaved schedule with virtual chunks) with
``finalize_model_grads`` and, with ``overlap_grad_reduce``, ``no_sync_func`` /
``grad_sync_func`` set as megatron/training/training.py sets them. p2p settings follow
megatron.training's defaults: ``batch_p2p_comm`` (batch_isend_irecv) without virtual chunks,
``overlap_p2p_comm`` (isend/irecv) with them. Embeddings are tied (megatron's default
``share_embeddings_and_output_weights``): the first stage's word embedding and the last
stage's output layer are kept equal by finalize_model_grads' embedding all-reduce.
"""

import torch
import torch.distributed as dist

from .worker_megatron import ShardChecker
from .worker_param_gather import replicas_identical

VOCAB, SEQ, HIDDEN, MICRO_BATCH, MICROBATCHES = 64, 16, 32, 2, 4


def setup_pipeline(vp):
    """(Re)initialise megatron's groups for PP2 x DP2 with ``vp`` virtual chunks (None: none)."""
    from loco_megatron.emulation import activate
    from megatron.core import parallel_state as ps

    activate()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2,
                                 virtual_pipeline_model_parallel_size=vp)


def build_chunks(vp, overlap: bool, bucket_size: int = 4000, pp: int = 2):
    """This stage's model chunks (one per virtual stage; ``2 / pp`` transformer layers each),
    in DDP with the distributed optimizer, and their distributed Adam (``pp`` 1: the same
    2-layer model on one stage). Returns ``(chunks, optimizer, config)``."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    chunks_per_stage = vp or 1
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=2 * chunks_per_stage, hidden_size=HIDDEN, num_attention_heads=4,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        overlap_p2p_comm=vp is not None, batch_p2p_comm=vp is None)  # megatron.training's
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                            overlap_grad_reduce=overlap,
                                            grad_reduce_in_fp32=True, bucket_size=bucket_size)
    chunks = []
    for i in range(chunks_per_stage):
        vp_stage = i if vp is not None else None
        gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                       vocab_size=VOCAB, max_sequence_length=SEQ,
                       share_embeddings_and_output_weights=True,  # megatron.training's default
                       pre_process=ps.is_pipeline_first_stage(ignore_virtual=False,
                                                              vp_stage=vp_stage),
                       post_process=ps.is_pipeline_last_stage(ignore_virtual=False,
                                                              vp_stage=vp_stage),
                       vp_stage=vp_stage)
        chunk = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=gpt,
                                        disable_bucketing=i > 0)
        chunk.vp_stage = vp_stage
        chunks.append(chunk)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), chunks)
    return chunks, opt, cfg


def set_sync_funcs(chunks, cfg, overlap: bool, state=None) -> list:
    """Set the schedule's hooks as megatron/training/training.py ``train()`` does (with
    ``--align-grad-reduce``, its default). Returns a list that gets LoCo's reduce-scatter call
    count (``state.wire.calls``) each time ``finalize_model_grads`` starts."""
    from megatron.core.distributed import finalize_model_grads as finalize

    calls_at_finalize = []

    def finalize_model_grads(*args, **kwargs):
        if state is not None and state.active:
            calls_at_finalize.append(state.wire.calls)
        return finalize(*args, **kwargs)

    if overlap:
        no_sync = [c.no_sync for c in chunks]
        grad_sync = [c.start_grad_sync for c in chunks]
        cfg.no_sync_func = no_sync[0] if len(chunks) == 1 else no_sync
        cfg.grad_sync_func = grad_sync[0] if len(chunks) == 1 else grad_sync
    cfg.finalize_model_grads_func = finalize_model_grads
    return calls_at_finalize


def _microbatches():
    """This DP rank's microbatches, the same every step: sequences that follow one fixed
    random permutation of the vocabulary (``next = perm[token]``), learnable in a few steps."""
    from megatron.core import parallel_state as ps

    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(100 + ps.get_data_parallel_rank())
    tokens = torch.empty(MICROBATCHES * MICRO_BATCH, SEQ, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (len(tokens),), generator=gen)
    for t in range(1, SEQ):
        tokens[:, t] = perm[tokens[:, t - 1]]
    return list(tokens.split(MICRO_BATCH))


def forward_step(data_iterator, model):
    """megatron's forward_step contract: ``(output_tensor, loss_func)``."""
    tokens = next(data_iterator)
    position = torch.arange(SEQ).unsqueeze(0).expand(tokens.shape[0], -1)
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5
    output = model(tokens, position, mask, labels=torch.roll(tokens, -1, 1))

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach().clone()}  # the schedule scales ``loss`` in place

    return output, loss_func


def _shared_embedding_group(chunk):
    """``summed_over`` for :meth:`ShardChecker.check`: the embedding group for the bucket that
    holds the tied word-embedding / output weight (its own bucket on both stages), else None."""
    from megatron.core import parallel_state as ps

    weight = None
    if chunk.module.pre_process or chunk.module.post_process:
        weight = chunk.module.shared_embedding_or_output_weight()
        assert weight.shared_embedding  # tied: megatron gives it a bucket of its own
    return lambda bucket: (ps.get_embedding_group() if weight is not None
                           and any(p is weight for p in bucket.params) else None)


def train(mode: str, vp, overlap: bool, steps: int, check_steps=(0, 3)):
    """Build this stage's chunks and train them with megatron-core's pipeline schedule under
    LoCo ``mode`` ("stock", "bits16", "loco4", "param4", "both4"). Returns per-step losses (last stage; None
    elsewhere), final parameters (per chunk), LoCo counters, the worst shard-check ratio and
    the tied-embedding drift."""
    import loco_megatron
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    state = None
    if mode != "stock":
        state = loco_megatron.install(loco_megatron.LoCoConfig(block_size=64, **{
            "bits16": dict(bits=16), "loco4": dict(bits=4), "param4": dict(param_bits=4),
            "both4": dict(bits=4, param_bits=4)}[mode]))
    checker = ShardChecker(state) if state is not None and state.active else None
    try:
        chunks, opt, cfg = build_chunks(vp, overlap)
        calls_at_finalize = set_sync_funcs(chunks, cfg, overlap, state)
        forward_backward = get_forward_backward_func()
        batches = _microbatches()
        losses, worst, identical = [], 0.0, []
        for step in range(steps):
            for chunk in chunks:
                chunk.zero_grad_buffer()
            opt.zero_grad()
            out = forward_backward(
                forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks],
                model=chunks, num_microbatches=MICROBATCHES, seq_length=SEQ,
                micro_batch_size=MICRO_BATCH, forward_only=False)
            if checker is not None and step in check_steps:
                for chunk in chunks:
                    worst = max(worst, checker.check(chunk, ps.get_data_parallel_group(),
                                                     summed_over=_shared_embedding_group(chunk)))
            opt.step()
            losses.append(sum(float(o["loss"]) for o in out) / len(out) if out else None)
            identical.append(all(replicas_identical(c.module.parameters(),
                                                    ps.get_data_parallel_group()) for c in chunks))
        params = [{n: p.detach().clone() for n, p in c.module.named_parameters()} for c in chunks]
        counters = {}
        if state is not None and state.active:
            counters = {"keys": [[b.loco_key for g in c.bucket_groups for b in g.buckets]
                                 for c in chunks],
                        "steps": dict(state.compensator.stats.steps),
                        "calls": state.wire.calls, "compress": state.compensator.stats.calls,
                        "chunks": state.num_chunks, "buckets": state.num_buckets,
                        "calls_at_finalize": calls_at_finalize}
        return {"losses": losses, "params": params, "counters": counters, "identical": identical,
                "stage": ps.get_pipeline_model_parallel_rank(),
                "shard_check": worst, "tied_drift": _tied_drift(chunks),
                "buckets_per_chunk": [sum(len(g.buckets) for g in c.bucket_groups)
                                      for c in chunks]}
    finally:
        loco_megatron.uninstall()


def _tied_drift(chunks):
    """max |word embedding (first stage) - output weight (last stage)| of the same DP rank,
    None on a rank without a tied weight (both stages hold one here)."""
    from megatron.core import parallel_state as ps

    chunk = chunks[0] if ps.is_pipeline_first_stage() else chunks[-1]
    weight = chunk.module.shared_embedding_or_output_weight().detach().clone()
    other = torch.empty_like(weight)
    group = ps.get_embedding_group()
    peer = [r for r in dist.get_process_group_ranks(group) if r != dist.get_rank()][0]
    ops = [dist.P2POp(dist.isend, weight, peer), dist.P2POp(dist.irecv, other, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return float((weight - other).abs().max())


def pipeline_worker(rank, world, cases, modes, steps):
    """Each case ``(vp, overlap)``: train every mode; returns ``{case: {mode: result}}``."""
    results = {}
    for vp, overlap in cases:
        setup_pipeline(vp)
        results[(vp, overlap)] = {mode: train(mode, vp, overlap, steps) for mode in modes}
    return results
