"""Ranks of the in-process model-load tests of ``--loco-param-bits``: the tiny GPT of
:mod:`.worker_megatron` trained a few steps, then its step-0 state dict loaded back into the
DDP model (``model.load_state_dict``, with or without ``optimizer.reload_model_params()``), the
next all-gather and one more step."""

import contextlib
import os

import torch

from .worker_ckpt import load_model_only
from .worker_megatron import build_gpt, forward_backward, setup
from .worker_param_gather import replicas_identical

STEPS = 3
MODES = ("stock", "param4")


@contextlib.contextmanager
def _installed(mode):
    """``stock``: megatron-core alone; ``param4``: ``--loco-param-bits 4`` (block 64) for the
    block, uninstalled when it ends."""
    import loco_megatron

    if mode == "param4":
        loco_megatron.install(loco_megatron.LoCoConfig(param_bits=4, block_size=64))
    try:
        yield
    finally:
        loco_megatron.uninstall()


def _params(model):
    return {n: p.detach().float().clone() for n, p in model.module.named_parameters()}


def model_load_worker(rank, world, dtype, reload, dist_dir=None):
    """Per mode (``stock``: megatron-core alone, always with ``reload_model_params`` as
    Megatron-LM calls it; ``param4``: ``--loco-param-bits 4``, with ``reload`` as given):
    ``loaded_kept`` (after the load and the next all-gather every parameter equals the loaded
    one), ``identical`` (replicas bit-identical then and after the next step), ``after`` (the
    parameters after that step, fp32) and ``trained`` (before the load). ``dist_dir``: the
    step-0 state is saved with ``dist_checkpointing`` there and loaded as Megatron-LM's
    ``torch_dist`` format does (:func:`.worker_ckpt.load_model_only`), else ``model.load_state_dict`` of a copy."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    setup(1, "gloo")
    params_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    out = {}
    for mode in MODES:
        with _installed(mode):
            model, opt = build_gpt(False, 6000, dropout=0.0, params_dtype=params_dtype)
            snap = {k: v.clone() if torch.is_tensor(v) else v
                    for k, v in model.state_dict().items()}
            loaded = _params(model)
            path = f"{dist_dir}/{mode}" if dist_dir else None
            if path:
                if rank == 0:
                    os.makedirs(path)
                torch.distributed.barrier()
                dist_checkpointing.save({"model": model.module.sharded_state_dict()}, path)
            for _ in range(STEPS):
                forward_backward(model, opt)
                opt.step()
            trained = _params(model)
            with torch.no_grad():
                load_model_only(model, path) if path else model.load_state_dict(snap)
            if mode == "stock" or reload:
                opt.reload_model_params()
            model.start_param_sync(force_sync=True)  # what the next forward's hooks do
            now = _params(model)
            kept = all(torch.equal(now[n], loaded[n]) for n in loaded)
            group = ps.get_data_parallel_group()
            identical = [replicas_identical(model.module.parameters(), group)]
            forward_backward(model, opt)
            opt.step()
            model.start_param_sync(force_sync=True)
            identical.append(replicas_identical(model.module.parameters(), group))
            out[mode] = {"loaded_kept": kept, "identical": identical, "after": _params(model),
                         "trained": trained, "loaded": loaded}
    return out


def partial_load_worker(rank, world):
    """fp32, ``--overlap-param-gather``: 2 steps, a third whose all-gather waits for the next
    forward, then ``model.load_state_dict({embedding: its step-0 value}, strict=False)`` and the
    next forward's all-gather. Per mode: the embedding equals the loaded value, how far every
    other parameter moved by step 3 (``moved``, fp32 max per tensor), replicas identical."""
    from megatron.core import parallel_state as ps

    setup(1, "gloo")
    out = {}
    for mode in MODES:
        with _installed(mode):
            model, opt = build_gpt(True, 6000, dropout=0.0, overlap_param_gather=True)
            key = next(k for k in model.state_dict() if k.endswith("word_embeddings.weight"))
            loaded = model.state_dict()[key].clone()
            for _ in range(2):
                forward_backward(model, opt)
                opt.step()
            for group in model.bucket_groups:
                group.finish_param_sync(skip_next_bucket_dispatch=True)
            before = _params(model)
            forward_backward(model, opt)
            opt.step()
            with torch.no_grad():
                model.load_state_dict({key: loaded}, strict=False)
            for group in model.bucket_groups:  # what the next forward's pre-hooks do
                group.finish_param_sync(skip_next_bucket_dispatch=True)
            after = _params(model)
            emb = next(n for n in after if n.endswith("word_embeddings.weight"))
            out[mode] = {"kept": torch.equal(after[emb], loaded.float()),
                         "moved": {n: float((after[n] - before[n]).abs().max())
                                   for n in after if n != emb},
                         "identical": replicas_identical(model.module.parameters(),
                                                         ps.get_data_parallel_group())}
    return out
