"""Install / uninstall LoCo into megatron-core's gradient-buffer reduce path.

The seam (docs/architecture.md; megatron/core/distributed/param_and_grad_buffer.py, 0.13-0.19):
``_ParamAndGradBucketGroup.start_grad_sync`` reduce-scatters each bucket's ``grad_data`` into
its DP shard through the module global ``dist_reduce_scatter_func``, inside a
``torch.distributed._coalescing_manager``. Swapping only that global silently skips the
reduction with ``overlap_grad_reduce=True`` (the coalescing manager's ``wait()`` never waits on a
custom handle). So we wrap ``start_grad_sync``: the global points at our compensated
reduce-scatter only while the original method runs (it keeps its NaN checks, gradient scaling
and first-batch logic), and afterwards the stored ``grad_reduce_handle`` is replaced by one that
waits on ours.

Buckets get stable ids ``(model chunk, buffer index, bucket index)`` when
``DistributedDataParallel`` is constructed: model chunks are numbered in construction order,
buffers as ``ddp.buffers + ddp.expert_parallel_buffers``.
"""

import contextlib
import functools
import itertools
import logging
from typing import Optional

import torch

from ..accounting import check_wire_not_above_stock
from ..agreement import check_layouts_agree
from ..collectives import (GroupWork, InFlight, WireStats, check_launch,
                           compensated_reduce_scatter)
from ..hierarchical import forget_pending_inter_stages, hierarchical_reduce_scatter
from ..node_topology import group_topology, inter_node_group
from ..compensator import Compensator
from ..config import PER_TOKEN_LOSS, LoCoConfig, LoCoConfigError
from ..layout import BucketLayout
from ..metrics import StepMetrics
from ..nonfinite import NonfiniteMonitor
from ..patching import PatchSet
from .. import caches, kernels, streams
from . import compat, loss_scale, param_reload, param_sync
from .checkpoint import hooks as ckpt_hooks
from .report import (buffer_reports, log_buffers, log_chunk_layout,
                     log_hierarchical_topology, log_param_gather)

logger = logging.getLogger(__name__)


class LoCoState:
    """What :func:`install` returns: the config, the compensator and the counters.

    Attributes:
        config: the :class:`LoCoConfig` in force.
        compensator: the rank's error buffers (None when LoCo is off).
        wire: exact bytes sent by LoCo and the stock equivalent (:class:`WireStats`).
        num_chunks: model chunks (DDP instances) registered since install.
        generation: distinguishes installs in one process; a bucket registered under an
            earlier install is refused, so two models never share an error buffer.
        metrics: per-step norms and bytes (:class:`~loco_megatron.metrics.StepMetrics`) once
            :meth:`enable_metrics` was called, else None (no cost).
        timers: a zero-argument callable returning a ``megatron.core.timers.Timers`` (or None)
            for the ``loco-*`` timers; None: no timers.
        loss_scale: what fp16 loss scaling did to the error buffers
            (:class:`~loco_megatron.megatron.loss_scale.LossScaleTracker`).
        nonfinite: logs a warning when NaN/Inf gradients reached the compress kernels
            (:class:`~loco_megatron.nonfinite.NonfiniteMonitor`; None when LoCo is off).
    """

    def __init__(self, config: LoCoConfig):
        self.config = config
        self.generation = next(_GENERATIONS)
        self.compensator = Compensator(config) if config.enabled else None
        self.nonfinite = NonfiniteMonitor(self.compensator) if config.enabled else None
        self.wire = WireStats()
        #: flat LoCo handles launched from megatron's hooks, finished early once landed
        self.in_flight = InFlight()
        self.num_chunks = 0
        self.num_buckets = 0
        self.layouts = {}
        self.metrics: Optional[StepMetrics] = None
        self.timers = None
        self.loss_scale = loss_scale.LossScaleTracker()
        #: megatron-core's ``dist_reduce_scatter_func`` as found at install (LoCo active)
        self.stock_reduce_scatter = None
        #: what this install replaced in megatron-core (:class:`~loco_megatron.patching.PatchSet`)
        self.patches: Optional[PatchSet] = None
        #: the weight-difference parameter all-gather (``--loco-param-bits``), or None
        self.param_sync = param_sync.ParamSync(config) if config.params_enabled else None

    def enable_metrics(self) -> StepMetrics:
        """Start collecting :class:`~loco_megatron.metrics.StepMetrics` (LoCo active only);
        call ``metrics.end_step()`` once per optimizer step and ``metrics.reduce()`` to report."""
        if not self.active:
            raise RuntimeError("LoCo metrics need an active LoCo install (--loco-bits 4 or 8)")
        if self.metrics is None:
            self.metrics = StepMetrics(self.wire)
            self.compensator.metrics = self.metrics
        return self.metrics

    def layout_for(self, bucket, world: int) -> BucketLayout:
        """The bucket's :class:`BucketLayout` (blocks cut at DP shards and parameters), cached
        by its stable key."""
        layout = self.layouts.get(bucket.loco_key)
        numel = bucket.grad_data.numel()
        if layout is None or (layout.numel, layout.world) != (numel, world):
            ranges = bucket.loco_param_ranges
            bounds = {i for start_end in ranges.values() for i in start_end}
            exact = ([se for p, se in ranges.items() if p.dim() == 1]
                     if self.config.full_precision_1d else [])  # --loco-full-precision-1d
            layout = BucketLayout.build(numel, world, self.config.block_size, bounds, exact)
            self.layouts[bucket.loco_key] = layout
        return layout

    @property
    def active(self) -> bool:
        """True when megatron-core's reduce-scatter is replaced (bits 4 or 8)."""
        return self.compensator is not None

    @property
    def param_active(self) -> bool:
        """True when the parameter all-gather sends weight differences (param bits 4 or 8)."""
        return self.param_sync is not None


_STATE: Optional[LoCoState] = None
#: name of the :class:`~loco_megatron.patching.PatchSet` of an install
PATCH_SET = "loco"
_GENERATIONS = itertools.count()


def get_state() -> Optional[LoCoState]:
    """The installed :class:`LoCoState`, or None."""
    return _STATE


def check_ddp_config(ddp_config, dp_size: int = 2, per_token_loss: bool = False) -> None:
    """Refuse DDP settings LoCo does not compress (raises LoCoConfigError naming the flag).

    Args:
        ddp_config: megatron-core's ``DistributedDataParallelConfig``.
        dp_size: the largest number of ranks any bucket group of the model reduces its
            gradients over. At 1 nothing is sent, LoCo has nothing to compress and megatron's
            own path runs whatever the configuration (no refusal).
        per_token_loss: the model's ``TransformerConfig.calculate_per_token_loss``
            (``--calculate-per-token-loss``): refused, :data:`PER_TOKEN_LOSS` says why.
    """
    if dp_size <= 1:
        return
    if per_token_loss:
        raise LoCoConfigError(PER_TOKEN_LOSS)
    if not ddp_config.use_distributed_optimizer:
        raise LoCoConfigError(
            "--loco-bits needs the distributed optimizer (--use-distributed-optimizer): LoCo "
            "compresses the data-parallel reduce-scatter; plain DDP all-reduce is not supported yet."
        )
    if getattr(ddp_config, "reduce_scatter_with_fp32_accumulation", False):
        raise LoCoConfigError(
            "--loco-bits and --ddp-reduce-scatter-with-fp32-accumulation both replace the "
            "reduce-scatter; choose one."
        )


def _wrap_ddp_init(orig):
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        state = _STATE
        if state is None:
            return
        if not (state.active or state.param_active):  # LoCo off: only check that no rank of
            _check_agreement(state, self)  # a DP group has it on
            return
        groups = compat.ddp_bucket_groups(self)
        dp_size = max((compat.gradient_group_size(g) for g in groups), default=1)
        if state.active:
            check_ddp_config(self.ddp_config, dp_size, per_token_loss=bool(
                getattr(getattr(self, "config", None), "calculate_per_token_loss", False)))
        if state.param_active:
            param_sync.check_ddp_config(self.ddp_config, dp_size, state.config.param_bits)
        chunk = state.num_chunks
        state.num_chunks += 1
        for buf_idx, buffer in enumerate(compat.ddp_buffers(self)):
            for bucket in buffer.buckets:
                bucket.loco_key = (chunk, buf_idx, bucket.bucket_id)
                bucket.loco_param_ranges = compat.bucket_param_ranges(buffer, bucket)
                bucket.loco_generation = state.generation
                state.num_buckets += 1
        compressed = _check_agreement(state, self)
        impl = None
        for _, bucket, _ in compressed[:1]:  # --loco-kernels refusals at model build, not at
            impl = kernels.select(state.config.kernels, bucket.grad_data)  # the first step
        buffers = buffer_reports(self, compressed if state.active else [])
        if state.active and not state.config.hierarchical:  # never more bytes than stock
            for buf in buffers:
                check_wire_not_above_stock(state.config, [(lay, elem) for _, lay, elem
                                                          in buf.compressed])
        if state.param_active:
            for group, bucket, layout in compressed:
                state.param_sync.register(bucket, group.intra_distributed_optimizer_instance_group,
                                          layout.world, compat.param_gather_rank(group),
                                          layout.full())  # every parameter's difference
            log_param_gather(chunk, state.config, [
                (layout.full(), bucket.param_data.element_size())
                for _, bucket, layout in compressed])
        log_buffers(chunk, state.config, buffers)
        if not state.active:
            return
        launch = {}  # the compressed buckets per bucket group, in the order megatron waits
        for group, bucket, layout in compressed:
            launch.setdefault(id(group), []).append((layout, bucket.grad_data.element_size(),
                                                     bucket.grad_data.dtype == torch.float16))
        log_chunk_layout(chunk, state.config, buffers,
                         overlap=self.ddp_config.overlap_grad_reduce,
                         kernel_device={"triton": "cuda", "cpu": "cpu"}.get(impl),
                         launch=list(launch.values()))
        if state.config.hierarchical:  # topology errors (LOCAL_WORLD_SIZE) at start-up
            log_hierarchical_topology(chunk, state.config, [
                (group.intra_distributed_optimizer_instance_group, layout,
                 bucket.grad_data.element_size()) for group, bucket, layout in compressed])
            for pg in dict.fromkeys(group.intra_distributed_optimizer_instance_group
                                    for group, _, _ in compressed):
                topo = group_topology(pg)  # the groups with an inter-node stage (2+ nodes,
                if topo.num_nodes > 1 and topo.per_node > 1:  # 2+ ranks each): created now,
                    inter_node_group(pg)  # not in the first backward hook
    return __init__


def _check_agreement(state: LoCoState, ddp):
    """The ``(bucket group, bucket, layout)`` of every bucket reduce-scattered over more than
    one rank, after checking that the ranks of each group agree on them
    (:func:`loco_megatron.agreement.check_layouts_agree`; LoCo off: on the bits only)."""
    # only bucket groups that reduce-scatter over several ranks (distributed optimizer): plain
    # DDP's all-reduce is never compressed, so with LoCo off nothing is checked there
    groups = [(group, rs) for group in compat.ddp_bucket_groups(ddp)
              for rs in [compat.reduce_scatter_group(group)] if rs is not None and rs[1] > 1]
    if not (state.active or state.param_active):
        check_layouts_agree(state.config, [(pg, None, None, bucket.grad_data)
                                           for group, (pg, _) in groups for bucket in group.buckets])
        return []
    compressed = [(group, pg, bucket, state.layout_for(bucket, size))
                  for group, (pg, size) in groups for bucket in group.buckets]
    check_layouts_agree(state.config, [  # before any compressed collective: fail fast
        (pg, bucket.loco_key, layout, bucket.grad_data) for _, pg, bucket, layout in compressed])
    return [(group, bucket, layout) for group, _, bucket, layout in compressed]


def _wrap_start_grad_sync(orig):
    @functools.wraps(orig)
    def start_grad_sync(self, *args, **kwargs):
        state = _STATE
        if (state is None or not state.active or compat.force_all_reduce(args, kwargs)
                or not self.ddp_config.use_distributed_optimizer
                or self.intra_distributed_optimizer_instance_size == 1):
            return orig(self, *args, **kwargs)  # stock path (DP size 1: nothing is sent)
        if state.config.start_iter and _count_warmup_step(state, self):
            return orig(self, *args, **kwargs)  # --loco-start-iter: full precision for now
        for bucket in self.buckets[:1]:  # the launch guards (a CUDA graph being captured)
            check_launch(bucket.grad_data, "the LoCo reduce-scatter")  # before any query
        state.in_flight.finish_landed()  # earlier buckets whose all-to-alls landed
        buckets = iter(self.buckets)
        works = []
        timers = state.timers() if state.timers is not None else None

        def reduce_scatter(output, input, op=torch.distributed.ReduceOp.SUM, group=None,
                           async_op=False):
            bucket = next(buckets)
            if bucket.grad_data.data_ptr() != input.data_ptr():
                raise RuntimeError(
                    "LoCo: megatron-core reduce-scattered a tensor that is not the next bucket's "
                    "grad_data (unsupported megatron-core version).")
            if getattr(bucket, "loco_generation", None) != state.generation:
                raise RuntimeError(
                    "LoCo: this model was wrapped in DistributedDataParallel before the current "
                    "loco_megatron.install() (or under an earlier one); build the DDP model "
                    "after install() so that it gets its own error buffers.")
            layout = state.layout_for(bucket, torch.distributed.get_world_size(group))
            collective = (hierarchical_reduce_scatter if state.config.hierarchical
                          else compensated_reduce_scatter)
            work = collective(
                output, input, op=op, group=group, async_op=async_op,
                compensator=state.compensator, key=bucket.loco_key, layout=layout,
                stats=state.wire, timers=timers)
            works.append(work)
            return work

        module = compat.param_and_grad_buffer_module()
        saved = module.dist_reduce_scatter_func
        if saved is not state.stock_reduce_scatter:
            raise LoCoConfigError(_foreign_reduce_scatter_message(saved, "since install()"))
        module.dist_reduce_scatter_func = reduce_scatter
        try:
            result = orig(self, *args, **kwargs)
        finally:
            module.dist_reduce_scatter_func = saved
        if works and self.grad_reduce_handle is not None:
            # megatron's own handle (its _coalescing_manager) first: it finishes what torch
            # queued there (a stock reduce-scatter LoCo hands through, e.g. hierarchical on one
            # node at 16 intra-node bits, whose own handle is torch's placeholder _IllegalWork)
            self.grad_reduce_handle = GroupWork(
                [self.grad_reduce_handle] + [w for w in works if not _placeholder(w)])
        if not state.config.hierarchical:
            state.in_flight.add(works)
        state.nonfinite.poll()  # NaN/Inf met by this or an earlier launch: a warning
        return result
    return start_grad_sync


def _placeholder(work) -> bool:
    """True for torch's ``_IllegalWork``: what a collective issued inside a
    ``_coalescing_manager`` returns (the manager's handle finishes it; waiting on it raises)."""
    return type(work).__name__ == "_IllegalWork"


def _foreign_reduce_scatter_message(func, when: str) -> str:
    def name(f):
        return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"

    stock = " or ".join(name(f) for f in compat.stock_reduce_scatter_funcs())
    return (f"LoCo: megatron-core's param_and_grad_buffer.dist_reduce_scatter_func is "
            f"{name(func)} ({when}), not {stock}. LoCo replaces that call during "
            f"start_grad_sync, so this replacement (another plugin, a test mock, or "
            f"--ddp-reduce-scatter-with-fp32-accumulation) would be bypassed silently; remove it "
            f"or run with LoCo off (--loco-bits 16).")


def _count_warmup_step(state: LoCoState, group) -> bool:
    """True, and one step counted for each of the group's buckets, while the group is inside
    the warm-up (its step counter below ``config.start_iter``); False once LoCo has started."""
    if any(getattr(b, "loco_generation", None) != state.generation for b in group.buckets):
        return False  # not this install's model: the compressed path refuses it clearly
    comp = state.compensator
    keys = [bucket.loco_key for bucket in group.buckets]
    if max(comp.step_of(key) for key in keys) >= state.config.start_iter:
        return False
    for key in keys:
        comp.count_step(key)
    return True


def install(config: LoCoConfig) -> LoCoState:
    """Route megatron-core's distributed-optimizer gradient reduce-scatter through LoCo.

    Call before the model is wrapped in ``DistributedDataParallel``. Also routes the
    distributed optimizer's checkpoint calls through :mod:`loco_megatron.megatron.checkpoint.hooks`,
    so error buffers are saved and restored with the optimizer state, and megatron-core's fp16
    grad scalers' ``update`` through :mod:`loco_megatron.megatron.loss_scale` (an overflow step
    clears the error buffers, a loss-scale change rescales them). With ``config.bits``
    None, 16 or 32 the reduce path is not patched and megatron-core trains bit-for-bit as
    stock; only the checkpoint-load hooks run, to warn when a checkpoint's LoCo state is
    ignored, and DDP construction checks that no rank of a DP group has LoCo on
    (:func:`loco_megatron.agreement.check_layouts_agree`, with LoCo on for every bucket's
    layout: RELIABILITY.md). That check runs only on bucket groups that reduce-scatter (the
    distributed optimizer): plain DDP, ``overlap_param_gather`` without the distributed
    optimizer and DP size 1 see no LoCo collective at all. Checkpoint loads are decided on
    every rank together (:mod:`loco_megatron.megatron.checkpoint.agree`).

    Returns:
        the :class:`LoCoState` (also available from :func:`get_state`).

    Raises:
        RuntimeError: already installed (call :func:`uninstall` first).
        LoCoConfigError: LoCo on while megatron-core's ``dist_reduce_scatter_func`` is not
            torch's (another plugin, a mock, megatron's fp32-accumulation reduce-scatter): it
            would be bypassed; also raised at the first reduce if it is replaced later.
    """
    global _STATE
    if _STATE is not None:
        raise RuntimeError("loco_megatron is already installed; call uninstall() first")
    state = LoCoState(config)
    if state.active:  # someone else's reduce-scatter would be bypassed silently: refuse
        current = compat.param_and_grad_buffer_module().dist_reduce_scatter_func
        if not any(current is f for f in compat.stock_reduce_scatter_funcs()):
            raise LoCoConfigError(_foreign_reduce_scatter_message(current, "before install()"))
        state.stock_reduce_scatter = current
    if state.param_active:  # the same for the parameter all-gather
        current = compat.param_and_grad_buffer_module().dist_all_gather_func
        if not any(current is f for f in compat.stock_all_gather_funcs()):
            raise LoCoConfigError(
                f"LoCo: megatron-core's param_and_grad_buffer.dist_all_gather_func is "
                f"{getattr(current, '__module__', '?')}.{getattr(current, '__qualname__', current)}"
                f", not torch's all_gather_into_tensor; --loco-param-bits replaces that call, so "
                f"this replacement (another plugin or a mock) would be bypassed: remove it or "
                f"drop --loco-param-bits.")
    # DDP construction: with LoCo off only the bits agreement check (one all_gather_object per
    # DP group at start-up; gradients untouched)
    targets = ckpt_hooks.patches(state) + [(compat.ddp_class(), "__init__", _wrap_ddp_init)]
    if state.active:
        targets += [(compat.bucket_group_class(), "start_grad_sync", _wrap_start_grad_sync)]
        targets += loss_scale.patches(state)  # fp16: overflow clears, scale changes rescale errors
    if state.param_active:  # the parameter all-gather as weight differences
        targets += param_sync.patches(state) + param_reload.patches(state)
    state.patches = PatchSet(PATCH_SET)
    try:
        for owner, name, wrap in targets:
            state.patches.wrap(owner, name, wrap)
    except BaseException:
        state.patches.restore()
        raise
    _STATE = state
    return state


def uninstall() -> None:
    """Restore megatron-core's original methods and drop the LoCo state (no-op if not installed).

    Models wrapped while LoCo was installed keep their bucket ids but reduce at full precision.

    Raises:
        PatchError: a method LoCo wrapped was replaced again since (by a newer patch set or a
            mock; :meth:`loco_megatron.patching.PatchSet.restore`); LoCo stays installed.
    """
    global _STATE
    if _STATE is None:
        return
    _STATE.patches.restore()
    _STATE = None
    caches.clear()  # the layouts and block tables of the models it wrapped
    ckpt_hooks.forget_pending_loads()
    forget_pending_inter_stages()  # handles an interrupted step never waited on
    streams.forget()


@contextlib.contextmanager
def installed(config: LoCoConfig):
    """``with installed(LoCoConfig(bits=4)) as state: ...``: :func:`install` for the block,
    :func:`uninstall` when it ends, also when it raises (as TransformerEngine's
    ``fp8_autocast`` restores its global state in ``finally``).

    Yields:
        the :class:`LoCoState`.

    Raises:
        RuntimeError, LoCoConfigError: as :func:`install`.
    """
    state = install(config)
    try:
        yield state
    finally:
        if _STATE is state:
            uninstall()
