"""Model loads and mode switches with the weight-difference parameter all-gather.

docs/param_gather.md ("Loads"). With ``--loco-param-bits`` the distributed optimizer's fp32 main
parameters and the model's parameters (``held``) are different tensors for every dtype: bf16 and
fp16 parameters have megatron-core's own fp32 main copies, and fp32 parameters get a private copy
(:mod:`loco_megatron.megatron.param_sync`). Stock megatron-core needs no refresh of fp32 main
parameters after a model load (they are views of the model's ``param_data``), so Megatron-LM's
``load_checkpoint`` (megatron/training/checkpointing.py, core_v0.13-0.19) calls
``optimizer.reload_model_params()`` after a model-only load (``--finetune``,
``--no-load-optim``, a release checkpoint) only for fp16/bf16. Without a refresh here the first
weight difference would pull every replica back to the main copy's old values.

Two things are wrapped or provided here:

``DistributedDataParallel.load_state_dict`` (megatron/core/distributed/data_parallel_base.py)
    the path of every Megatron-LM model load (``torch`` and ``torch_dist`` formats) and of an
    in-process ``model.load_state_dict``. After it, the main parameters of the parameters
    changed since the load began (two checksums of their bits per parameter, :func:`snapshot`)
    are copied from them, as ``DistributedOptimizer._copy_model_params_to_main_params`` does,
    and their buckets are all-gathered exactly before their next difference; parameters a
    partial load (``strict=False``) did not touch keep their exact main values. A full resume
    loads the optimizer right after and overwrites the main parameters with the saved exact
    values.
:func:`snapshot`
    the start of a load: the checkpoint hooks' wrapped ``dist_checkpointing.load`` of a
    model-only load (the ``torch_dist`` format loads the model's tensors in place, before the
    model's ``load_state_dict`` is called; a load with the optimizer's state restores the main
    parameters in place too, so it takes no snapshot there and :func:`full_load` drops what
    was pending) or the model's ``load_state_dict``, whichever comes first.
    Differences still pending (encoded at the last optimizer step, not yet all-gathered) are
    all-gathered and applied first, as stock's pending all-gather would deliver that step, then
    the checksums are taken. The snapshot lasts until the next weight difference is encoded,
    so several loads in between (model chunks, a retried load) compare against it.
:func:`gather_loaded_params`
    a checkpoint saved with ``--loco-param-bits`` holds ``held`` as the model's parameters and
    the exact ``main`` in the optimizer state. Resumed without the flag, stock megatron-core
    loads ``main`` into each rank's own shard of an fp32 ``param_data`` (it is the main
    parameter there) while the other shards keep ``held``: the replicas differ until the first
    all-gather. The checkpoint hooks call this after the optimizer load, when the checkpoint's
    LoCo record says it was saved with weight differences: an exact all-gather of every fp32
    bucket's ``param_data`` (stock bytes, once) makes every replica equal the loaded ``main``.
"""

import functools
from typing import Set

import torch
import torch.distributed as dist

from . import compat
from .param_sync import GROUP_PAIRS, _bucket_of


def refresh_main_params(opt, params) -> Set:
    """Copy the model parameters ``params`` (a set of ``id``) into ``opt``'s main parameters (the
    rank's own shard of each, cast to fp32), as megatron-core's
    ``DistributedOptimizer._copy_model_params_to_main_params`` does for all of them. Returns
    the keys of the buckets holding them."""
    keys = set()
    for shard_attr, model_attr in GROUP_PAIRS:
        for shard_group, model_group in zip(getattr(opt, shard_attr), getattr(opt, model_attr)):
            for main, param in zip(shard_group, model_group):
                if id(param) not in params:
                    continue
                rng = opt._get_model_param_range_map(param)["param"]
                main.data.copy_(param.detach().view(-1)[rng.start:rng.end])
                keys.add(getattr(_bucket_of(opt, param), "loco_key", None))
    return keys


def _differenced(state, ddp) -> list:
    """The parameters of ``ddp``'s buckets with weight differences."""
    sync = state.param_sync
    return [p for buffer in compat.ddp_buffers(ddp) for bucket in buffer.buckets
            if sync.entry(bucket) is not None for p in bucket.params]


#: elements checksummed at a time (bounds the int64 temporaries of a large parameter)
_CHUNK = 1 << 24


def _fingerprints(params) -> torch.Tensor:
    """int64 ``[len(params), 2]``: two checksums of each parameter's bits (their sum and an
    index-weighted sum), to tell which parameters a load changed without copying them."""
    rows = []
    for p in params:
        flat = p.detach().reshape(-1)
        bits = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32,
                          8: torch.int64}[flat.element_size()])
        row = torch.zeros(2, dtype=torch.int64, device=bits.device)
        for start in range(0, bits.numel(), _CHUNK):
            part = bits[start:start + _CHUNK].to(torch.int64)
            weights = (torch.arange(start, start + part.numel(), device=bits.device,
                                    dtype=torch.int64) % 65521 + 1)
            row += torch.stack([part.sum(), (part * weights).sum()])
        rows.append(row)
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)


def snapshot(state) -> None:
    """A load begins on every rank of the DP groups (a collective when differences are
    pending): all-gather and apply the pending differences of every differenced bucket, then
    keep the :func:`_fingerprints` of their parameters in ``state.param_sync.load_snapshot``
    (``{id(param): [2] int64}``), unless a snapshot is already held (a load since the last
    encoded difference: the earlier one is the reference)."""
    sync = getattr(state, "param_sync", None)
    if sync is None or sync.load_snapshot is not None:
        return
    entries = list(sync.buckets.values())
    for e in entries:  # differences still pending reach every replica first, as stock's
        sync.gather(e, async_op=False)  # all-gather would (all ranks load)
    params = [p for e in entries for p in e.bucket.params]
    sync.load_snapshot = dict(zip(map(id, params), _fingerprints(params)))


def full_load(state) -> None:
    """A load with the optimizer's state begins (the ``torch_dist`` format: model tensors and
    main parameters restored in place): differences still pending are dropped (the loaded
    parameters replace what they would have changed) and an earlier snapshot is forgotten, so
    the model's ``load_state_dict`` compares against the loaded tensors and refreshes nothing
    (the main parameters are the loaded ones)."""
    sync = getattr(state, "param_sync", None)
    if sync is not None:
        sync.invalidate()
        sync.load_snapshot = None


def model_loaded(state, ddp, params) -> Set:
    """``ddp``'s parameters ``params`` (its differenced ones) were loaded: the main parameters
    of those changed since the :func:`snapshot` are refreshed from them, and their buckets are
    all-gathered exactly before the next difference. Returns those buckets' keys."""
    sync = state.param_sync
    after = _fingerprints(params)
    changed = [not torch.equal(sync.load_snapshot[id(p)], row) if id(p) in sync.load_snapshot
               else True for p, row in zip(params, after)]
    loaded = {id(p) for p, c in zip(params, changed) if c}
    keys = set()
    if loaded:
        with torch.no_grad():
            for ref in list(sync.optimizers):
                opt = ref()
                if opt is None:
                    sync.optimizers.remove(ref)
                else:
                    keys |= refresh_main_params(opt, loaded)
        sync.invalidate(keys)
    return keys


def _wrap_ddp_load_state_dict(orig, state):
    @functools.wraps(orig)
    def load_state_dict(self, *args, **kwargs):
        if state.param_sync is None:
            return orig(self, *args, **kwargs)
        snapshot(state)
        result = orig(self, *args, **kwargs)
        model_loaded(state, self, _differenced(state, self))
        return result
    return load_state_dict


def agreed(opt, marked: bool) -> bool:
    """True on every rank of ``opt``'s DP group when ``marked`` is on any (one all-reduce at a
    checkpoint load): ranks that read different LoCo files (expert parallelism) still take the
    collective :func:`gather_loaded_params` together."""
    group = opt.data_parallel_group
    if group.size() <= 1:
        return False
    device = next((b.param_data.device for buf in opt.buffers for b in buf.buckets
                   if b.param_data is not None), torch.device("cpu"))
    flag = torch.tensor([int(marked)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def gather_loaded_params(opt) -> int:
    """Exact all-gather of every fp32 bucket's ``param_data`` of ``opt`` over its DP group
    (each rank sends its own shard, as megatron-core's ``start_param_sync`` does), so that all
    replicas hold what this load put into the owners' shards. Returns the buckets gathered;
    bf16/fp16 buckets are left alone (their main parameters are separate, the loaded model
    parameters already agree)."""
    group = opt.data_parallel_group
    world, rank = group.size(), group.rank()
    gathered = 0
    if world <= 1:
        return gathered
    for buffer in opt.buffers:
        for bucket in buffer.buckets:
            data = bucket.param_data
            if data is None or data.dtype != torch.float32:
                continue
            flat = data.view(-1)
            chunks = list(flat.split(flat.numel() // world))
            dist.all_gather(chunks, chunks[rank].clone(), group=group)
            gathered += 1
    return gathered


def patches(state) -> list:
    """``[(owner, attribute, wrapper factory)]`` of model loads (``--loco-param-bits``)."""
    return [(compat.ddp_class(), "load_state_dict",
             functools.partial(_wrap_ddp_load_state_dict, state=state))]
