"""The weight-difference parameter all-gather inside megatron-core (``--loco-param-bits``).

The arithmetic: :mod:`loco_megatron.weight_difference`; the semantics and bound:
docs/param_gather.md. Three megatron-core calls are wrapped (the same in 0.13-0.19;
megatron/core/optimizer/distrib_optimizer.py and distributed/param_and_grad_buffer.py):

``DistributedOptimizer.__init__``
    fp32 model parameters are their own main parameters in megatron-core (the optimizer steps a
    view of the bucket's ``param_data``). Here the replicas' ``held`` value and the exact main
    value differ, so each such shard gets its own fp32 copy (one copy of the rank's own shard,
    not of the bucket), swapped into the optimizer's parameter groups and ``shard_fp32_groups``
    before any optimizer state exists; bf16/fp16 parameters already have fp32 main copies.
``DistributedOptimizer._copy_main_params_to_model_params``
    runs as stock for every parameter outside the buckets with weight differences on (their
    entries are hidden from its group lists while it runs); for each of those buckets, one at a
    time, the owner encodes ``Q(main - held)`` from the fp32 main parameters and keeps the
    codes for the all-gather (every rank applies them there, the owner too). A bucket whose
    ``held`` may differ between replicas (the first step, any checkpoint load) first gets an
    exact all-gather of ``held`` itself (stock bytes, once).
``_ParamAndGradBucketGroup.start_param_sync``
    runs as stock, with the module global ``dist_all_gather_func`` pointing at a function that
    records which buckets have pending codes instead of gathering them; when the original
    returns (after megatron's ``_coalescing_manager`` block, which would group NCCL collectives
    until it ends and whose ``wait()`` never waits on a custom handle), their all-gathers are
    launched, synchronously or not as megatron asked, and the group's ``param_gather_handle``
    becomes a handle over megatron's and LoCo's, so ``finish_param_sync`` (overlapped gather)
    and the synchronous path both end with the parameters applied. A bucket with no
    pending codes and ``held`` in sync sends nothing (an fp16 step skipped on overflow, a second
    ``force_sync``).
"""

import functools
import weakref
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional

import torch
import torch.distributed as dist

from .. import kernels, weight_difference
from ..collectives import GroupWork, step_timer
from ..config import LoCoConfig, LoCoConfigError, check_param_bits_conflicts, flag
from ..layout import BucketLayout
from ..patching import PatchSet
from ..weight_difference import ParamGatherStats
from . import compat

#: the patch set that hides the differenced buckets' parameters from megatron-core's own copy
#: while it runs (``_copy_main_params_to_model_params``)
COPY_PATCH_SET = "loco-param-copy"

@dataclass
class _Bucket:
    bucket: object
    group: object
    world: int
    rank: int
    layout: BucketLayout

    def own(self) -> torch.Tensor:
        """This rank's shard of the bucket's ``param_data`` (a view)."""
        shard = self.layout.shard
        return self.bucket.param_data.view(-1)[self.rank * shard:(self.rank + 1) * shard]


class ParamSync:
    """Per-install state of the weight-difference all-gather.

    Attributes:
        config: the :class:`LoCoConfig` (``param_bits`` 4 or 8).
        stats: exact bytes and drift (:class:`~loco_megatron.weight_difference.ParamGatherStats`).
        buckets: stable bucket key -> the bucket, its DP group, size, rank and layout.
        pending: bucket key -> ``(payload, scales)`` encoded at the optimizer step, not yet sent.
        synced: keys whose ``held`` is known to be the same on every replica (exact all-gather
            done since the start or the last checkpoint load).
        fp32_copies: elements of fp32 main-parameter copies made (the start-up line's memory).
        optimizers: weak references to the distributed optimizers holding differenced buckets
            (their main parameters are refreshed after a model load:
            :mod:`loco_megatron.megatron.param_reload`).
        load_snapshot: ``{id(param): checksums}`` taken when a load began
            (:func:`loco_megatron.megatron.param_reload.snapshot`); None again once the next
            difference is encoded.
    """

    def __init__(self, config: LoCoConfig):
        self.config = config
        self.stats = ParamGatherStats()
        self.buckets: Dict[Hashable, _Bucket] = {}
        self.pending: Dict[Hashable, tuple] = {}
        self.synced = set()
        self.fp32_copies = 0
        self.optimizers: List[weakref.ref] = []
        self.timers = None
        self.load_snapshot = None
        #: bucket key -> scales of the last difference this rank encoded (the bound's step)
        self.last_scales: Dict[Hashable, torch.Tensor] = {}

    def register(self, bucket, group, world: int, rank: int, layout: BucketLayout) -> None:
        """Send ``bucket``'s parameter all-gather (over ``group``, ``world`` ranks) as weight
        differences from now on."""
        self.buckets[bucket.loco_key] = _Bucket(bucket, group, world, rank, layout)

    def entry(self, bucket) -> Optional[_Bucket]:
        """The registration of ``bucket`` (None: megatron-core's own all-gather)."""
        e = self.buckets.get(getattr(bucket, "loco_key", None))
        return e if e is not None and e.bucket is bucket else None

    def invalidate(self, keys=None) -> None:
        """Parameters were loaded (those of the buckets in ``keys``; None: all): resynchronise
        ``held`` exactly before the next difference and drop differences not yet sent."""
        if keys is None:
            self.synced.clear()
            self.pending.clear()
            return
        self.synced.difference_update(keys)
        for key in keys:
            self.pending.pop(key, None)

    def _impl(self, tensor) -> str:
        return kernels.select(self.config.kernels, tensor)

    def resync(self, entries: List[_Bucket]) -> None:
        """Exact all-gather of ``held`` for ``entries`` (stock bytes; synchronous)."""
        for e in entries:
            flat = e.bucket.param_data.view(-1)
            chunks = list(flat.split(e.layout.shard))
            dist.all_gather(chunks, e.own().clone(), group=e.group)
            self.count_exact(e, instead_of_stock=False)

    def count_exact(self, e: _Bucket, instead_of_stock: bool) -> None:
        """An exact all-gather of ``e``'s ``held`` (stock bytes); ``e`` is in sync from now on.
        ``instead_of_stock``: it is the all-gather megatron-core would have made (counted in
        the stock equivalent too), not an extra one before a difference."""
        nbytes = (e.world - 1) * e.layout.shard * e.bucket.param_data.element_size()
        self.stats.exact_gathers += 1
        self.stats.bytes_sent += nbytes
        if instead_of_stock:
            self.stats.stock_bytes += nbytes
        self.synced.add(e.bucket.loco_key)

    def encode(self, e: _Bucket, mains) -> None:
        """Encode ``Q(main - held)`` of ``e``'s own shard (``held``: its ``param_data`` slice;
        ``mains``: its ``[(main shard, world offset)]``) and keep it for the all-gather, which
        applies it on every rank, the owner included (so parameters loaded in between, e.g.
        ``model.load_state_dict``, get the same difference on every replica). A difference
        still pending from an earlier step (two optimizer steps without a forward under
        ``--overlap-param-gather``) is all-gathered and applied first, on every rank of the
        group: they all reach this step."""
        key = e.bucket.loco_key
        self.load_snapshot = None  # a load from now on compares against the state it finds
        if key in self.pending:
            self.gather(e, async_op=False)
        own, bits = e.own(), self.config.param_bits
        impl = self._impl(own)
        payload, scales = weight_difference.encode_difference(
            impl, difference(e, mains), e.layout, e.rank, bits)
        if self.stats.track_drift:  # held as it will be after the all-gather
            after = own.clone()
            weight_difference.apply(impl, after, payload, scales, e.layout, e.rank, bits)
            self.stats.add_drift(main_shard(e, mains), after)
        self.pending[key] = (payload, scales)
        self.last_scales[key] = scales

    def gather(self, e: _Bucket, async_op: bool):
        """Launch the all-gather of ``e``'s pending codes (None when nothing is pending)."""
        chunk = self.pending.pop(e.bucket.loco_key, None)
        if chunk is None:
            return None
        impl = self._impl(e.bucket.param_data)
        timers = self.timers() if self.timers is not None else None
        return weight_difference.all_gather_differences(
            e.bucket.param_data, chunk[0], chunk[1], e.layout, e.group, async_op, impl=impl,
            bits=self.config.param_bits, stats=self.stats, timers=timers)


def check_ddp_config(ddp_config, dp_size: int, param_bits: Optional[int] = None) -> None:
    """Refuse DDP settings whose parameter all-gather LoCo cannot replace (LoCoConfigError
    naming ``--loco-param-bits``: :data:`~loco_megatron.config.PARAM_BITS_CONFLICTS`,
    plain DDP and the layer-wise optimizer's path); DP size 1 sends nothing and is never
    refused."""
    if dp_size <= 1:
        return
    check_param_bits_conflicts(ddp_config, param_bits)
    if not ddp_config.use_distributed_optimizer:
        name = flag("param_bits")
        raise LoCoConfigError(
            f"{name} needs the distributed optimizer (--use-distributed-optimizer): without it "
            f"there is no parameter all-gather (plain DDP) or it is the layer-wise optimizer's "
            f"variable-size gather, which LoCo does not compress; drop {name}.")


def _wrap_optimizer_init(orig, state):
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        sync = state.param_sync
        if getattr(self, "is_stub_optimizer", False) or not sync.buckets:
            return
        check_param_bits_conflicts(self.config, sync.config.param_bits)  # the precision-aware optimizer
        sync.fp32_copies += _separate_fp32_main_params(self, sync)
        sync.optimizers.append(weakref.ref(self))  # model loads refresh its main parameters
    return __init__


def _separate_fp32_main_params(opt, sync: ParamSync) -> int:
    """Give every fp32 main-parameter shard of a registered bucket its own storage (a clone of
    the view megatron-core made into ``param_data``), in ``shard_fp32_groups`` and in the
    optimizer's parameter groups. Returns the elements copied."""
    copied, swaps = 0, {}
    for shard_group, model_group in zip(opt.shard_fp32_groups, opt.model_fp32_groups):
        for i, (shard, param) in enumerate(zip(shard_group, model_group)):
            if sync.entry(_bucket_of(opt, param)) is None:
                continue
            copy = shard.detach().clone()
            copy.__dict__.update(shard.__dict__)  # tensor-parallel and optimizer attributes
            swaps[id(shard)] = copy
            shard_group[i] = copy
            copied += copy.numel()
    for group in opt.optimizer.param_groups:
        group["params"] = [swaps.get(id(p), p) for p in group["params"]]
    return copied


def _bucket_of(opt, param):
    """The bucket holding ``param`` (``model_param_gbuf_map``, distrib_optimizer.py 0.13-0.19)."""
    gbuf_index, _, bucket_id = opt.model_param_gbuf_map[param]
    return opt.buffers[gbuf_index].buckets[bucket_id]


#: the distributed optimizer's (main shard, model parameter) group lists that
#: ``_copy_main_params_to_model_params`` copies (megatron-core 0.13-0.19)
GROUP_PAIRS = (("shard_fp32_from_float16_groups", "model_float16_groups"),
               ("shard_fp32_groups", "model_fp32_groups"))


def _split_groups(opt, keys):
    """The optimizer's group lists without the parameters of buckets in ``keys`` (what the
    stock copy still does), and per key ``[(main shard, offset in the rank's bucket shard)]``."""
    kept, mains = {}, {k: [] for k in keys}
    for shard_attr, model_attr in GROUP_PAIRS:
        shards, models = [], []
        for shard_group, model_group in zip(getattr(opt, shard_attr), getattr(opt, model_attr)):
            shards.append([])
            models.append([])
            for main, param in zip(shard_group, model_group):
                key = getattr(_bucket_of(opt, param), "loco_key", None)
                if key in mains:
                    world_range = opt._get_model_param_range_map(param)["gbuf_world_in_bucket"]
                    mains[key].append((main, world_range.start))
                else:
                    shards[-1].append(main)
                    models[-1].append(param)
        kept[shard_attr], kept[model_attr] = shards, models
    return kept, mains


def main_shard(e: _Bucket, mains) -> torch.Tensor:
    """fp32 ``[shard]``: the main parameters of ``e``'s own shard in the bucket's layout;
    elements no parameter covers keep ``held``'s value (difference 0). ``mains``: that bucket's
    ``[(main shard, world offset)]`` from :func:`_split_groups`."""
    new = e.own().to(torch.float32, copy=True)
    base = e.rank * e.layout.shard
    for main, start in mains:
        new[start - base:start - base + main.numel()].copy_(main.detach().view(-1))
    return new


def difference(e: _Bucket, mains) -> torch.Tensor:
    """fp32 ``[shard]``: ``main - held`` over ``e``'s own shard (0 where no parameter is),
    in two passes (a zero fill and one subtraction per parameter)."""
    diff = torch.zeros(e.layout.shard, dtype=torch.float32, device=e.bucket.param_data.device)
    own, base = e.own(), e.rank * e.layout.shard
    for main, start in mains:
        lo, hi = start - base, start - base + main.numel()
        torch.sub(main.detach().view(-1), own[lo:hi], out=diff[lo:hi])
    return diff


def main_shards(opt, entries: List[_Bucket]) -> Dict[Hashable, torch.Tensor]:
    """:func:`main_shard` of each entry (for tests and telemetry: the exact ``main``)."""
    _, mains = _split_groups(opt, {e.bucket.loco_key for e in entries})
    return {e.bucket.loco_key: main_shard(e, mains[e.bucket.loco_key]) for e in entries}


def _optimizer_entries(opt, sync: ParamSync) -> List[_Bucket]:
    out = []
    for buffer in opt.buffers:
        for bucket in buffer.buckets:
            e = sync.entry(bucket)
            if e is not None:
                out.append(e)
    return out


def _wrap_copy_main_params(orig, state):
    @functools.wraps(orig)
    @torch.no_grad()
    def _copy_main_params_to_model_params(self, *args, **kwargs):
        sync = state.param_sync
        entries = ([] if getattr(self, "is_stub_optimizer", False)
                   else _optimizer_entries(self, sync))
        if not entries:
            return orig(self, *args, **kwargs)
        sync.resync([e for e in entries if e.bucket.loco_key not in sync.synced])
        kept, mains = _split_groups(self, {e.bucket.loco_key for e in entries})
        # the stock copy for every other parameter; these buckets' owners apply differences
        with PatchSet(COPY_PATCH_SET).applied() as patches:
            for attr, value in kept.items():
                patches.replace(self, attr, value)
            result = orig(self, *args, **kwargs)
        timers = sync.timers() if sync.timers is not None else None
        timer = step_timer(timers, weight_difference.TIMER_NAMES[0])
        timer.start()
        for e in entries:  # one bucket at a time: transient memory of one shard
            sync.encode(e, mains[e.bucket.loco_key])
        timer.stop()
        return result
    return _copy_main_params_to_model_params


def _wrap_start_param_sync(orig, state):
    @functools.wraps(orig)
    def start_param_sync(self, *args, **kwargs):
        sync = state.param_sync
        entries = [sync.entry(b) for b in self.buckets]
        if not self.ddp_config.use_distributed_optimizer or not any(entries):
            return orig(self, *args, **kwargs)
        module = compat.param_and_grad_buffer_module()
        stock = module.dist_all_gather_func
        order, requested = iter(zip(self.buckets, entries)), []

        def all_gather(output, input, group=None, async_op=False):
            bucket, e = next(order)
            if bucket.param_data.data_ptr() != output.data_ptr():
                raise RuntimeError(
                    "LoCo: megatron-core all-gathered a tensor that is not the next bucket's "
                    "param_data (unsupported megatron-core version).")
            if e is None:
                return stock(output, input, group=group, async_op=async_op)
            if bucket.loco_key not in sync.synced:  # not stepped under LoCo yet: exact
                sync.count_exact(e, instead_of_stock=True)
                return stock(output, input, group=group, async_op=async_op)
            requested.append((e, async_op))  # launched after megatron's coalescing block
            return None

        module.dist_all_gather_func = all_gather
        try:
            result = orig(self, *args, **kwargs)
        finally:
            module.dist_all_gather_func = stock
        # outside megatron's _coalescing_manager: NCCL would group collectives issued inside
        # it until the block ends, and its wait() never waits on LoCo's handles
        works = [sync.gather(e, async_op) for e, async_op in requested]
        if any(w is not None for w in works):  # GroupWork skips the None entries
            self.param_gather_handle = GroupWork([self.param_gather_handle] + works)
        return result
    return start_param_sync


def patches(state) -> list:
    """``[(owner, attribute, wrapper factory)]`` of the parameter path (``--loco-param-bits``)."""
    DistributedOptimizer = compat.distributed_optimizer_class()
    return [
        (DistributedOptimizer, "__init__", functools.partial(_wrap_optimizer_init, state=state)),
        (DistributedOptimizer, "_copy_main_params_to_model_params",
         functools.partial(_wrap_copy_main_params, state=state)),
        (compat.bucket_group_class(), "start_param_sync",
         functools.partial(_wrap_start_param_sync, state=state)),
    ]
