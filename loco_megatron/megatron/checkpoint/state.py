"""The LoCo state one ``DistributedOptimizer`` saves and restores, and the resume policy.

docs/architecture.md (checkpoints). Each DistributedOptimizer owns gradient buffers
(``optimizer.buffers``) whose buckets carry LoCo error buffers. Its checkpoint holds, with megatron-core's own bucket names
(``gbuf_idx_{g}.bucket_idx_{b}``, as in ``DistributedOptimizer.sharded_param_state_dp_reshardable``):

* ``meta``: format version, fingerprint (bits, block size, grid, error storage, beta, reset
  interval; :data:`LEGACY_FINGERPRINT` for settings older checkpoints lack),
  DP size, and per bucket its sizes, parameter ranges and step counter (resets stay on the
  same optimizer steps across a resume);
* ``exact``: this rank's error buffer as stored (int8 codes + fp32 scales, or fp32 values) in
  the padded wire layout; restored bit for bit when the DP size and layout are unchanged;
* with ``--loco-hierarchical`` the exact form holds the stage buffers instead (fields
  ``intra.*`` and ``inter.*``, :meth:`OptimizerLoCo.stages`) and ``meta`` the topology; there
  is no ``sum`` form (a DP-sum of per-stage buffers has no meaning in another topology), so a
  changed topology (nodes, ranks per node, intra-node bits, or flat <-> hierarchical) resets
  the error buffers with one warning;
* ``sum``: the DP-sum of all ranks' errors, reduce-scattered, in the bucket's
  ``dp_reshardable`` index space ``[0, numel_unpadded)`` (rank ``r`` keeps
  ``[r * shard, (r + 1) * shard)``). Error feedback only guarantees the summed error
  (loco_megatron/algorithm.py), so after a DP-size change each rank puts its shard of the sum in its own shard range of the
  new layout (zero elsewhere): the DP-sum is preserved up to one fp32 rounding (int8 storage
  adds its usual half step).

With several distributed-optimizer instances each instance's ranks keep their own error buffers:
the exact form has an instance axis before the DP axis, the summed form sums over all
instances (megatron-core all-reduces the instances' reduced shards, so their errors add up) and
is restored into instance 0. The expert optimizer of an MoE model uses the prefix
``loco.expert_dp_group_idx_{i}`` (its own DP group: expert-DP).

:func:`apply` implements the resume policy and returns the lines it logged.
"""

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ...config import COMPRESSED_BITS, CONVERT, RESET, fingerprint, fingerprint_fields
from ...hierarchical import INTER, INTRA, group_topology, inter_view
from ...kernels import block_table
from ...layout import BucketLayout
from .. import compat
from . import agree

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1

#: the wire layout the exact error form is saved in (``meta["wire"]``; loco_megatron/layout.py):
#: ``packed`` (short last blocks, no padding); checkpoints without the key were saved
#: ``padded`` (every segment padded to whole blocks) and resume through the summed form
WIRE_FORMAT = "packed"

#: fingerprint settings added after checkpoints of this format were first written, with the value
#: those older checkpoints were saved under: a missing key reads as this value, not as a change
#: (a RESET or CONVERT setting added to the registry later needs its entry here)
LEGACY_FINGERPRINT = {"grid": "symmetric", "full_precision_1d": False}


def saved_setting(saved_fp: dict, name: str):
    """Setting ``name`` as a checkpoint's fingerprint ``saved_fp`` recorded it
    (:data:`LEGACY_FINGERPRINT` for a checkpoint saved before the setting existed; None if it
    has no legacy value)."""
    return saved_fp.get(name, LEGACY_FINGERPRINT.get(name))


@dataclass
class BucketRef:
    """One bucket of the optimizer: megatron-core name, LoCo key and wire layout."""

    name: str
    bucket: object  # megatron-core _ParamAndGradBucket
    key: object
    layout: BucketLayout
    dp_rank: int

    @property
    def numel_unpadded(self) -> int:
        """Elements of the bucket without the end padding to a DP multiple."""
        return int(getattr(self.bucket, "numel_unpadded", self.bucket.grad_data.numel()))

    @property
    def error_numel(self) -> int:
        """Elements of the error buffer (the padded wire layout)."""
        return self.layout.world * self.layout.padded_shard

    @property
    def sum_range(self):
        """``(start, stop)`` of this rank's shard of the summed error (may be empty)."""
        start = self.layout.shard * self.dp_rank
        return start, max(start, min(start + self.layout.shard, self.numel_unpadded))

    def params(self) -> List[List[int]]:
        """Bucket-local ``[start, end)`` of every parameter, sorted."""
        return sorted([s, e] for s, e in self.bucket.loco_param_ranges.values())


class OptimizerLoCo:
    """The LoCo view of one megatron-core ``DistributedOptimizer``.

    Args:
        optimizer: a ``DistributedOptimizer`` (megatron/core/optimizer/distrib_optimizer.py).
        state: the installed :class:`~loco_megatron.megatron.plugin.LoCoState`.
    """

    def __init__(self, optimizer, state):
        self.optimizer, self.state = optimizer, state
        self.group = optimizer.data_parallel_group
        self.dp_rank, self.dp_size = self.group.rank(), self.group.size()
        # several distributed-optimizer instances: the DP group above is this instance's;
        # each instance's ranks keep their own error buffers
        self.instances, self.instance, self.inter_group = compat.optimizer_instances(optimizer)
        self.domain = int(getattr(optimizer, "data_parallel_group_idx", 0))
        expert = any(not getattr(p, "allreduce", True)
                     for buffer in optimizer.buffers for p in buffer.params)
        # the expert optimizer's own name: a ChainedOptimizer does not prefix its members'
        # keys for fully reshardable formats, where dense and expert domain 0 would collide
        self.prefix = f"loco.{'expert_' if expert else ''}dp_group_idx_{self.domain}"
        self.buckets: List[BucketRef] = []
        #: ``--loco-hierarchical`` topology saved in ``meta`` (None: flat LoCo)
        self.hierarchy: Optional[Dict[str, int]] = None
        if not state.active:
            return
        if state.config.hierarchical and self.dp_size > 1:
            topo = group_topology(self.group)
            self.hierarchy = {"nodes": topo.num_nodes, "per_node": topo.per_node,
                              "intra_node_bits": state.config.intra_node_bits}
        for g, buffer in enumerate(optimizer.buffers):
            for b, bucket in enumerate(buffer.buckets):
                if getattr(bucket, "loco_generation", None) != state.generation:
                    raise RuntimeError(
                        "LoCo: the model was wrapped in DistributedDataParallel before "
                        "loco_megatron.install(); its error buffers cannot be checkpointed.")
                self.buckets.append(BucketRef(
                    f"gbuf_idx_{g}.bucket_idx_{b}", bucket, bucket.loco_key,
                    state.layout_for(bucket, self.dp_size), self.dp_rank))

    @property
    def saves_state(self) -> bool:
        """A save holds LoCo state: the error buffers (LoCo on) or the record of the
        weight-difference all-gather (``--loco-param-bits``), and only where something is
        compressed (DP size > 1)."""
        return (self.state.active or self.state.param_active) and self.dp_size > 1

    @property
    def forms(self) -> List[str]:
        """Error forms saved: none at DP size 1 (nothing is compressed there); exact only in
        the hierarchical mode."""
        if not self.state.active or self.dp_size == 1:
            return []
        return ["exact"] if self.hierarchy is not None else ["exact", "sum"]

    def stages(self, ref: BucketRef) -> List[Tuple[str, object, int]]:
        """``(field prefix, error-buffer key, numel)`` of each error buffer of ``ref``: the
        bucket's own (prefix ``""``) in flat LoCo and with one rank per node; the hierarchical
        stages' otherwise (``intra``: ``N * P`` elements at 8 intra-node bits; ``inter``:
        ``M * P`` with more than one node; loco_megatron/hierarchical.py)."""
        h = self.hierarchy
        if h is None or h["per_node"] == 1:
            return [("", ref.key, ref.error_numel)]
        out = []
        if h["intra_node_bits"] == 8:
            out.append((INTRA, (ref.key, INTRA), ref.error_numel))
        if h["nodes"] > 1:
            out.append((INTER, (ref.key, INTER), h["nodes"] * ref.layout.padded_shard))
        return out

    def spans(self, ref: BucketRef, prefix: str = "") -> torch.Tensor:
        """The block spans (:class:`~loco_megatron.error_buffer.ErrorBuffer`) of ``ref``'s error
        buffer ``prefix`` (``""``/``intra``: the bucket's wire layout; ``inter``: this rank's
        inter-node partial sums, :func:`~loco_megatron.hierarchical.inter_view`)."""
        view = ref.layout
        if prefix == INTER:
            topo = group_topology(self.group)
            view = inter_view(ref.layout, topo.column(topo.local_of(self.dp_rank)))
        return block_table(view, "cpu").spans

    def meta(self) -> Dict[str, object]:
        """Plain-Python description of the saved state (same on every DP rank)."""
        cfg, comp = self.state.config, self.state.compensator
        extra = {"instances": self.instances} if self.instances > 1 else {}
        layout = agree.model_parallel_layout()
        if layout is not None:  # a resume at another TP/PP/EP size resets on every rank
            extra["model_parallel"] = layout
        return {
            **extra, "version": FORMAT_VERSION, "wire": WIRE_FORMAT, "forms": self.forms,
            "dp_size": self.dp_size,
            "hierarchical": self.hierarchy,
            "fingerprint": fingerprint(cfg),
            "buckets": {r.name: {"numel": r.bucket.grad_data.numel(),
                                 "numel_unpadded": r.numel_unpadded,
                                 "error_numel": r.error_numel, "params": r.params(),
                                 "stages": {p: n for p, _, n in self.stages(r)},
                                 "step": comp.step_of(r.key)} for r in self.buckets},
        }

    # ---- the one checkpoint state shape, serialised by both formats (torch_format, dist_format)

    def state_dict(self, forms: Optional[List[str]] = None) -> Dict[str, object]:
        """This optimizer's LoCo state, as both checkpoint formats save it (torchtitan-style
        ``Stateful``)::

            {"meta": meta(), "exact": {bucket name: {field: live tensor}},
             "sum": {bucket name: fp32 [len(sum_range)]}}

        Collective over the DP group (and instances) when the ``sum`` form is saved: every rank
        must call it. ``forms`` restricts the saved forms (default :attr:`forms`; megatron-core
        < 0.15 cannot save the uneven ``sum`` shards); ``meta["forms"]`` says what is there.
        Tensors are live (no copy): the torch format copies them to the CPU, the torch_dist
        format wraps them in ``ShardedTensor``.
        """
        meta = self.meta()
        if forms is not None:
            meta["forms"] = [f for f in meta["forms"] if f in forms]
        exact, sums = {}, {}
        if "exact" in meta["forms"]:
            exact = {ref.name: self.exact(ref) for ref in self.buckets}
        if "sum" in meta["forms"]:
            sums = {ref.name: self.summed_shard(ref) for ref in self.buckets}  # collective
        return {"meta": meta, "exact": exact, "sum": sums}

    def load_state_dict(self, state: Optional[Dict[str, object]], source: str,
                        data_file: Optional[str] = None) -> List[str]:
        """Restore from a saved :meth:`state_dict` by the resume policy (:func:`apply`).

        Args:
            state: ``{"meta", "exact", "sum"}`` as read back (``exact`` only when saved at the
                same DP grid, ``sum`` as this rank's range of each bucket's summed error), or
                None when the checkpoint holds no LoCo state.
            source: the checkpoint, for messages (the same on every rank).
            data_file: the file ``exact`` was read from, for errors (default ``source``).

        Returns and raises as :func:`apply`.
        """
        state = state or {}
        return apply(self, state.get("meta"), state.get("exact") or None,
                     state.get("sum") or None, source, data_file)

    def _error(self, ref: BucketRef, key=None, numel=None, prefix: str = ""):
        """``ref``'s :class:`ErrorBuffer` (or the stage buffer ``key`` of ``numel`` elements,
        field prefix ``prefix``), created as zeros if never used."""
        return self.state.compensator.error_buffer(ref.key if key is None else key,
                                                   ref.error_numel if numel is None else numel,
                                                   ref.bucket.grad_data.device,
                                                   self.spans(ref, prefix))

    def exact(self, ref: BucketRef) -> Dict[str, torch.Tensor]:
        """This rank's stored error tensors for ``ref`` (live tensors, zeros if never used);
        stage buffers' fields prefixed ``intra.`` / ``inter.``."""
        return {f"{prefix}.{field}" if prefix else field: t
                for prefix, key, numel in self.stages(ref)
                for field, t in self._error(ref, key, numel, prefix).tensors().items()}

    def summed_shard(self, ref: BucketRef) -> torch.Tensor:
        """Collective over the DP group (and across instances): this rank's ``sum_range`` of the
        error summed over every DP rank of every instance, fp32 (the inter-instance all-reduce
        adds the instances' reduced shards, so their errors add up too)."""
        layout = ref.layout
        err = self._error(ref).get().float()
        padded = torch.empty(layout.padded_shard, dtype=torch.float32, device=err.device)
        dist.reduce_scatter_tensor(padded, err, group=self.group)
        if self.inter_group is not None:
            dist.all_reduce(padded, group=self.inter_group)
        shard = torch.zeros(layout.shard, dtype=torch.float32, device=err.device)
        layout.from_padded_shard(padded, self.dp_rank, shard)
        start, stop = ref.sum_range
        return shard[:stop - start]

    def log(self, level: int, message: str) -> None:
        """Log once per DP group (on its rank 0), and with several distributed-optimizer
        instances only in instance 0 (they load the same checkpoint: one line, not one per
        instance)."""
        if self.dp_rank == 0 and self.instance == 0:
            logger.log(level, message)


def validate_meta(meta, where: str) -> None:
    """Raise ValueError naming ``where`` when a saved ``meta`` is malformed."""
    ok = (isinstance(meta, dict) and isinstance(meta.get("fingerprint"), dict)
          and isinstance(meta.get("buckets"), dict) and isinstance(meta.get("dp_size"), int)
          and meta["dp_size"] >= 1 and isinstance(meta.get("forms"), list)
          and all(isinstance(b, dict) and {"numel", "numel_unpadded", "error_numel", "params",
                                           "step"} <= set(b) for b in meta["buckets"].values()))
    if not ok:
        raise ValueError(f"LoCo checkpoint {where}: malformed LoCo metadata (expected version, "
                         f"forms, dp_size, fingerprint, buckets); the file is corrupted or was "
                         f"not written by loco_megatron")
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"LoCo checkpoint {where}: format version {meta.get('version')} is not "
                         f"supported (this loco_megatron reads version {FORMAT_VERSION})")


def apply(view: OptimizerLoCo, meta: Optional[dict], exact: Optional[dict],
          sums: Optional[dict], source: str, data_file: Optional[str] = None) -> List[str]:
    """Restore ``view``'s error buffers from a checkpoint by the resume policy
    (docs/checkpointing.md).

    Args:
        view: the optimizer being loaded.
        meta: the saved :meth:`OptimizerLoCo.meta`, or None when the checkpoint has no LoCo state.
        exact: ``{bucket name: entry}`` saved at the same DP size, or None.
        sums: ``{bucket name: fp32 [len(sum_range)]}`` of this rank's range of the DP-summed
            error, or None.
        source: checkpoint file or directory, for messages (the same on every rank).
        data_file: the file ``exact`` was read from, for errors naming it (default ``source``).

    Inside a :func:`~loco_megatron.megatron.checkpoint.agree.load_round` (the checkpoint hooks open
    one around megatron-core's load calls) the outcome is only recorded: when the round closes,
    every rank applies one agreed decision (step counters, resets, messages; see
    :mod:`loco_megatron.megatron.checkpoint.agree`). Outside one (a direct call) the notes are logged
    at once, on DP rank 0.

    Returns:
        the messages of this optimizer's own outcome (warnings for every case other than an
        exact restore); the round may replace them by the agreed ones (``Outcome.notes``).

    Raises:
        ValueError: malformed metadata or entries (message names ``source`` and the key).
    """
    notes: List[Tuple[int, str]] = []
    counts = {"restored": 0, "reset": 0}
    _apply(view, meta, exact, sums, source, notes, counts, data_file or source)
    saved_buckets = meta.get("buckets", {}) if isinstance(meta, dict) else {}
    saved_steps = [int(b.get("step", 0)) for b in saved_buckets.values() if isinstance(b, dict)]
    outcome = agree.Outcome(
        notes=notes, active=view.state.active, had_state=meta is not None,
        restored=counts["restored"], reset=counts["reset"],
        step=max(saved_steps) if saved_steps and view.buckets else None,
        saved_layout=meta.get("model_parallel") if isinstance(meta, dict) else None,
        source=source, reset_all=lambda: [_reset(view, ref) for ref in view.buckets],
        set_steps=lambda step: [view.state.compensator.set_step(ref.key, step)
                                for ref in view.buckets])
    if agree.in_round():
        agree.record(outcome)
    else:
        for level, text in notes:
            view.log(level, text)
    return [text for _, text in notes]


def _apply(view: OptimizerLoCo, meta, exact, sums, source: str,
           notes: List[Tuple[int, str]], counts: Dict[str, int], data_file: str) -> None:
    """The resume policy on this rank alone (see :func:`apply`); fills ``notes`` and
    ``counts`` (buckets restored / reset)."""
    state = view.state

    def note(level, text):
        notes.append((level, text))

    def reset(ref):
        _reset(view, ref)
        counts["reset"] += 1

    _param_mode_switch(view, meta, source, note)
    if not state.active:
        if isinstance(meta, dict) and meta.get("forms"):
            note(logging.WARNING, f"LoCo: {source} holds LoCo error buffers but LoCo is off "
                                  f"(--loco-bits {state.config.bits}); they are ignored")
        return
    comp = state.compensator
    if meta is None:
        for ref in view.buckets:
            reset(ref)
        if view.dp_size == 1:
            return  # nothing is compressed here: no state is needed
        note(logging.WARNING, f"LoCo: {source} {agree.NO_STATE} (saved without LoCo, or at DP "
                              f"size 1 where nothing is compressed); error buffers start from "
                              f"zero")
        return
    validate_meta(meta, data_file)
    saved_fp, saved = meta["fingerprint"], meta["buckets"]
    if saved_setting(saved_fp, "bits") not in COMPRESSED_BITS:  # --loco-param-bits only
        for ref in view.buckets:
            reset(ref)
        note(logging.WARNING, f"LoCo: {source} holds no error buffers (saved with --loco-bits "
                              f"{saved_setting(saved_fp, 'bits')}: the --loco-param-bits record "
                              f"only); error buffers start from zero")
        return
    # resets stay on the same optimizer steps. Every bucket counts one per optimizer step, so
    # the counter is the step itself: a new bucket (another --ddp-bucket-size) continues it too
    step = max((int(b.get("step", 0)) for b in saved.values() if isinstance(b, dict)), default=0)
    for ref in view.buckets:
        comp.set_step(ref.key, step)
    cfg = state.config
    changed = [k for k in fingerprint_fields(RESET)
               if saved_setting(saved_fp, k) != getattr(cfg, k)]
    if changed:
        for ref in view.buckets:
            reset(ref)
        note(logging.WARNING, "LoCo: " + ", ".join(
            f"{k} changed {saved_setting(saved_fp, k)} -> {getattr(cfg, k)}" for k in changed)
            + f" since {source}; error buffers reset to zero")
        return
    saved_dp = meta["dp_size"]
    if view.dp_size == 1 or saved_dp == 1:
        for ref in view.buckets:  # not a decision other ranks must share: nothing is sent
            _reset(view, ref)
        if saved_dp != view.dp_size:
            note(logging.WARNING, f"LoCo: DP size changed {saved_dp} -> {view.dp_size} since "
                                  f"{source}; nothing is compressed at DP size 1, so "
                                  f"{'the saved error buffers are dropped' if view.dp_size == 1 else 'there is no saved error'}: "
                                  f"error buffers start from zero")
        return
    if meta.get("hierarchical") != view.hierarchy:
        for ref in view.buckets:
            reset(ref)
        note(logging.WARNING, f"LoCo: --loco-hierarchical topology changed "
                              f"{_describe(meta.get('hierarchical'))} -> "
                              f"{_describe(view.hierarchy)} since {source}; the per-stage error "
                              f"buffers do not map onto it: error buffers reset to zero")
        return
    resharded, unmapped = 0, []
    saved_instances = meta.get("instances", 1)
    same_grid = saved_dp == view.dp_size and saved_instances == view.instances
    saved_wire = meta.get("wire", "padded")
    same_wire = saved_wire == WIRE_FORMAT
    for ref in view.buckets:
        where = f"{data_file} key {view.prefix}.{ref.name}"
        entry, reason = saved.get(ref.name), None
        if entry is None:
            reason = "not in the checkpoint"
        elif entry["numel_unpadded"] != ref.numel_unpadded or entry["params"] != ref.params():
            reason = "its parameters differ (model or --ddp-bucket-size changed)"
        if (reason is None and exact is not None and ref.name in exact and same_grid
                and same_wire and entry["error_numel"] == ref.error_numel):
            counts["restored"] += 1
            for prefix, key, numel in view.stages(ref):
                comp.restore_error(key, _stage_fields(exact[ref.name], prefix), numel,
                                   ref.bucket.grad_data.device,
                                   where=where + ".exact" + (f".{prefix}" if prefix else ""),
                                   spans=view.spans(ref, prefix))
        elif reason is None and sums is not None and ref.name in sums:
            _restore_from_sum(view, ref, sums[ref.name], where)
            resharded += 1
            counts["restored"] += 1
        else:
            reset(ref)
            if reason is None:
                reason = ("no usable error form saved" if same_wire else
                          f"saved in the {saved_wire} wire format, without a summed form")
            unmapped.append(f"{ref.name} ({reason})")
    if unmapped:
        note(logging.WARNING, f"LoCo: bucket layout of {source} cannot be mapped for "
                              f"{', '.join(unmapped)}; those error buffers reset to zero")
    if resharded:
        why = (f"DP size changed {saved_dp} -> {view.dp_size}" if saved_dp != view.dp_size else
               f"distributed-optimizer instances changed {saved_instances} -> {view.instances}"
               if saved_instances != view.instances else
               f"wire format changed {saved_wire} -> {WIRE_FORMAT}" if not same_wire else
               f"bucket padding changed at DP size {saved_dp} (e.g. "
               f"--ddp-pad-buckets-for-high-nccl-busbw)")
        note(logging.WARNING, f"LoCo: {why}: {resharded} error buffers resharded from the "
                              f"DP-summed form")
    for k in fingerprint_fields(CONVERT):  # error storage: int8 <-> fp32
        if saved_setting(saved_fp, k) != getattr(cfg, k):
            note(logging.WARNING, f"LoCo: error storage changed {saved_setting(saved_fp, k)} -> "
                                  f"{getattr(cfg, k)}; saved errors converted")


def _param_mode_switch(view: OptimizerLoCo, meta, source: str, note) -> None:
    """The parameter all-gather's mode changed since the checkpoint (``--loco-param-bits``
    recorded in its fingerprint): saved with weight differences and resumed without, the
    optimizer is marked for one exact all-gather of its fp32 parameters after the load
    (:func:`loco_megatron.megatron.param_reload.gather_loaded_params`; the checkpoint hooks run
    it); the other way round the first all-gather is exact anyway. One line each."""
    if view.dp_size == 1:
        return  # one replica: nothing is gathered, nothing was recorded
    saved_fp = meta.get("fingerprint") if isinstance(meta, dict) else None
    saved = saved_setting(saved_fp, "param_bits") if isinstance(saved_fp, dict) else None
    saved_on = saved in COMPRESSED_BITS
    unread = isinstance(meta, dict) and meta.get("unread")
    if (saved_on or unread) and not view.state.param_active:
        view.optimizer.loco_gather_params_after_load = True  # agreed over the DP group
        if saved_on:
            note(logging.WARNING, f"LoCo: {source} was saved with --loco-param-bits {saved} and "
                                  f"is resumed without it: fp32 parameters are all-gathered "
                                  f"exactly once from the loaded main parameters, so every "
                                  f"replica holds them")
    elif view.state.param_active and not saved_on and not unread:
        note(logging.WARNING, f"LoCo: {source} was saved without --loco-param-bits: the "
                           f"parameters are all-gathered exactly once before the first weight "
                           f"difference")


def _reset(view: OptimizerLoCo, ref: BucketRef) -> None:
    """Forget every error buffer of ``ref``: the flat one and the hierarchical stages'."""
    comp = view.state.compensator
    comp.reset_error(ref.key)
    for _, key, _ in view.stages(ref):
        comp.reset_error(key)


def _describe(hierarchy) -> str:
    if hierarchy is None:
        return "flat"
    return (f"{hierarchy['nodes']} nodes x {hierarchy['per_node']} ranks, intra-node "
            f"{hierarchy['intra_node_bits']} bits")


def _stage_fields(fields: Dict[str, torch.Tensor], prefix: str) -> Dict[str, torch.Tensor]:
    """The fields of one error buffer in an exact entry (``prefix.field``, or unprefixed)."""
    if not prefix:
        return {k: v for k, v in fields.items() if "." not in k}
    return {k[len(prefix) + 1:]: v for k, v in fields.items() if k.startswith(prefix + ".")}


def _restore_from_sum(view: OptimizerLoCo, ref: BucketRef, values, where: str) -> None:
    start, stop = ref.sum_range
    if not isinstance(values, torch.Tensor) or values.numel() != stop - start:
        raise ValueError(f"LoCo checkpoint {where}.error_sum: expected {stop - start} values "
                         f"for DP rank {view.dp_rank}, got "
                         f"{tuple(values.shape) if isinstance(values, torch.Tensor) else values}")
    if view.instance > 0:  # the sum is over all instances: instance 0 carries it
        view.state.compensator.reset_error(ref.key)
        return
    device = ref.bucket.grad_data.device
    shard = torch.zeros(ref.layout.shard, dtype=torch.float32, device=device)
    shard[:stop - start] = values.to(device, torch.float32)
    full = torch.zeros(ref.layout.numel, dtype=torch.float32, device=device)
    full[start:start + ref.layout.shard] = shard
    view.state.compensator.set_error(ref.key, ref.layout.to_padded(full, torch.float32),
                                     view.spans(ref))

