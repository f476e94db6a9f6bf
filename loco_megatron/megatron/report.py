"""LoCo log lines in Megatron's style (rank 0 only): the start-up summary, one line per
gradient buffer (dense / expert: compressed, full precision or not communicated, and why), the
chunk's totals, the parameter all-gather and the hierarchical topology."""

import logging
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ..config import LoCoConfig
from . import compat
from ..layout import BucketLayout
from ..accounting import (error_state_bytes, expected_bytes_per_step,
                          hierarchical_bytes_per_step, param_gather_bytes_per_step,
                          stage_error_bytes)
from ..step_memory import describe, step_memory

logger = logging.getLogger("loco_megatron")


def print_rank_0(msg: str) -> None:
    """Print on global rank 0 (before init_process_group: the launcher's ``RANK``)."""
    if torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(msg, flush=True)




@dataclass
class BufferReport:
    """One gradient buffer of a model chunk, as the start-up lines describe it.

    Attributes:
        kind: ``"dense"`` (``ddp.buffers``) or ``"expert"`` (``ddp.expert_parallel_buffers``).
        index: the buffer's index in LoCo's stable order (dense first, then expert).
        dtype: gradient dtype, e.g. ``"float32"``.
        numel: gradient elements of the buffer (megatron's padding included).
        buckets: number of buckets.
        group_size: ranks its gradients are reduced over (1: nothing is communicated).
        compressed: ``(process group, layout, grad element size)`` of each bucket LoCo
            compresses (empty: megatron's own path).
    """

    kind: str
    index: int
    dtype: str
    numel: int
    buckets: int
    group_size: int
    compressed: List[tuple] = field(default_factory=list)


def buffer_reports(ddp, compressed) -> List[BufferReport]:
    """A :class:`~loco_megatron.megatron.report.BufferReport` per gradient buffer of ``ddp``
    (dense, then expert), with the compressed buckets of ``compressed``
    (``(bucket group, bucket, layout)`` of the plugin's layout agreement)."""
    group_of = {id(b): g for g in compat.ddp_bucket_groups(ddp) for b in g.buckets}
    mine = {id(b): (g, lay) for g, b, lay in compressed}
    dense = list(ddp.buffers)
    out = []
    for index, buffer in enumerate(compat.ddp_buffers(ddp)):
        groups = [group_of[id(b)] for b in buffer.buckets if id(b) in group_of]
        out.append(BufferReport(
            kind="dense" if index < len(dense) else "expert", index=index,
            dtype=str(buffer.grad_data.dtype).replace("torch.", ""),
            numel=buffer.grad_data.numel(), buckets=len(buffer.buckets),
            group_size=max((compat.gradient_group_size(g) for g in groups), default=1),
            compressed=[(mine[id(b)][0].intra_distributed_optimizer_instance_group,
                         mine[id(b)][1], b.grad_data.element_size())
                        for b in buffer.buckets if id(b) in mine]))
    return out


def wire_figures(config: LoCoConfig, compressed: List[tuple]) -> Tuple[int, int, str]:
    """``(LoCo bytes, stock bytes, detail)`` one rank sends per step for ``compressed``
    buckets (``(process group, layout, grad element size)``): flat, or under
    ``--loco-hierarchical`` both stages together (detail: ``"A intra-node + B inter-node"``),
    the traffic the iteration line measures; stock is megatron's flat reduce-scatter.

    Raises:
        LoCoConfigError: ``--loco-hierarchical`` with a bad ``LOCAL_WORLD_SIZE``.
    """
    loco, stock = expected_bytes_per_step(config, [(lay, elem) for _, lay, elem in compressed])
    if not config.hierarchical:
        return loco, stock, ""
    from ..hierarchical import group_topology

    intra = inter = 0
    for group, lay, elem in compressed:
        topo = group_topology(group)
        a, b = hierarchical_bytes_per_step(config, topo.num_nodes, topo.per_node, [(lay, elem)])
        intra, inter = intra + a, inter + b
    return intra + inter, stock, f"{intra} intra-node + {inter} inter-node"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def log_buffers(chunk: int, config: LoCoConfig, buffers: List[BufferReport]) -> None:
    """One line per gradient buffer of a model chunk (dense and expert): its group, and
    whether it is compressed (bytes per step against stock), sent at full precision, or not
    communicated, and why."""
    for buf in buffers:
        head = (f"> LoCo: model chunk {chunk}, {buf.kind} gradient buffer {buf.index} "
                f"({buf.dtype}, {buf.numel} elements, {_plural(buf.buckets, 'bucket')}): ")
        group = f"{'expert ' if buf.kind == 'expert' else ''}data-parallel group of " \
                f"{_plural(buf.group_size, 'rank')}"
        if buf.group_size <= 1:
            print_rank_0(head + f"{group}: not communicated (nothing to reduce), megatron's "
                                f"own path")
        elif not buf.compressed:
            why = ("--loco-bits off" if not config.enabled else
                   f"--loco-start-iter {config.start_iter} first" if config.start_iter else
                   "not reduce-scattered")
            print_rank_0(head + f"reduced over its {group} at full precision ({why})")
        else:
            loco, stock, detail = wire_figures(config, buf.compressed)
            exact = sum(lay.exact_shard for _, lay, _ in buf.compressed)
            if exact:  # --loco-full-precision-1d
                lane = sum((lay.world - 1) * lay.exact_bytes_per_peer(elem)
                           for _, lay, elem in buf.compressed)
                detail = (f"{detail}; " if detail else "") + (
                    f"1-D parameters at full precision: {exact} elements per rank, {lane} of the "
                    f"bytes")
            print_rank_0(
                head + f"reduce-scattered over its {group}, compressed at {config.bits} bits"
                + (" (hierarchical)" if config.hierarchical else "")
                + f": {loco} bytes/step per rank on the wire vs {stock} stock "
                  f"({loco / stock if stock else 0.0:.3f}x)" + (f"; {detail}" if detail else ""))


def log_chunk_layout(chunk: int, config: LoCoConfig, buffers: List[BufferReport], *,
                     overlap: bool = True, kernel_device: Optional[str] = None,
                     launch: Optional[List[List[Tuple[BucketLayout, int, bool]]]] = None
                     ) -> None:
    """The chunk's totals over its compressed buckets: buckets, elements, bytes per step per
    rank on the wire against stock (both hierarchical stages together under
    ``--loco-hierarchical``), the error state's memory and checkpoint bytes, and LoCo's
    persistent and peak transient memory in a step for this chunk's buckets
    (:func:`loco_megatron.step_memory.step_memory`, flat LoCo with the fused kernels:
    ``kernel_device`` ``"cuda"`` (Triton) or ``"cpu"`` (C); None, the torch reference, prints
    no memory line). ``launch``: the compressed buckets' ``(layout, grad element size, fp16)``
    per megatron bucket group, in the order megatron waits for them (``ddp.bucket_groups``);
    None, one group per bucket in ``buffers``' order, none fp16."""
    compressed = [b for buf in buffers for b in buf.compressed]
    if not compressed:
        why = ("data-parallel size 1, no gradient is communicated" if all(
            buf.group_size <= 1 for buf in buffers) else "no gradient is compressed")
        print_rank_0(f"> LoCo: model chunk {chunk}: {why}; stock path")
        return
    loco, stock, detail = wire_figures(config, compressed)
    layouts = [lay for _, lay, _ in compressed]
    numel = sum(lay.numel for lay in layouts)
    ratio = loco / stock if stock else 0.0
    print_rank_0(
        f"> LoCo: model chunk {chunk}: {len(compressed)} buckets, {numel} gradient elements, "
        f"{loco} bytes/step per rank on the wire vs {stock} stock ({ratio:.3f}x"
        + (f"; hierarchical: {detail}" if detail else "") + ")")
    if not config.hierarchical:  # hierarchical: per-stage buffers, on the topology line
        memory, disk = error_state_bytes(config, layouts)
        print_rank_0(
            f"> LoCo: model chunk {chunk}: error state {memory} bytes per rank in memory "
            f"({memory / numel:.3f} B/element), <= {disk} tensor bytes per rank per checkpoint "
            f"({disk / numel:.3f} B/element)")
        if kernel_device is not None and not any(lay.exact_shard for lay in layouts):
            launch = launch or [[(lay, elem, False)] for _, lay, elem in compressed]
            wire = [(lay, elem) for group in launch for lay, elem, _ in group]
            args = dict(overlap=overlap, device=kernel_device,
                        fp16=[half for group in launch for _, _, half in group],
                        groups=[len(group) for group in launch])
            bound = step_memory(config, wire, **args)
            least = step_memory(config, wire, in_flight=1, **args)
            print_rank_0(f"> LoCo: model chunk {chunk}: {describe(bound, overlap, least)}")


def log_param_gather(chunk: int, config: LoCoConfig,
                     buckets: List[Tuple[BucketLayout, int]]) -> None:
    """One line per model chunk for ``--loco-param-bits``: the parameter all-gather's bytes
    per step against stock's, and the memory it takes."""
    if not buckets:
        print_rank_0(f"> LoCo: model chunk {chunk}: data-parallel size 1, no parameter is "
                     f"all-gathered; stock path")
        return
    loco, stock = param_gather_bytes_per_step(config.param_bits, buckets)
    shard = max(lay.shard for lay, _ in buckets)
    print_rank_0(
        f"> LoCo: model chunk {chunk}: parameter all-gather as {config.param_bits}-bit weight "
        f"differences, {len(buckets)} buckets: {loco} bytes/step per rank on the wire vs "
        f"{stock} stock ({loco / stock if stock else 0.0:.3f}x); before the first difference "
        f"and after a checkpoint load one exact all-gather of the parameters (stock bytes); "
        f"memory: an fp32 copy of the rank's own shard of "
        f"fp32 parameters only (bf16/fp16 ones use megatron's main copy), <= {4 * shard} "
        f"bytes per bucket transient")
    if loco > stock:
        print_rank_0(
            f"> LoCo WARNING: the parameter all-gather sends {loco / stock:.2f}x stock's bytes: "
            f"every block sends a 4-byte scale, and at --loco-block-size {config.block_size} "
            f"the scales outweigh the compression of these parameters; use a larger "
            f"--loco-block-size, or drop --loco-param-bits.")


def log_hierarchical_topology(chunk: int, config: LoCoConfig, buckets) -> None:
    """One line per DP group of a model chunk under ``--loco-hierarchical``: ``M`` nodes x ``L``
    ranks and the expected bytes per step per rank on each kind of link.

    Args:
        buckets: ``(DP process group, layout, grad element size)`` per bucket.

    Raises:
        LoCoConfigError: LOCAL_WORLD_SIZE missing or invalid, or uneven nodes (at start-up,
            from :func:`loco_megatron.hierarchical.group_topology`).
    """
    from ..hierarchical import group_topology

    by_group = {}
    for group, lay, elem in buckets:
        by_group.setdefault(id(group), (group, []))[1].append((lay, elem))
    for group, lays in by_group.values():
        topo = group_topology(group)
        M, L = topo.num_nodes, topo.per_node
        memory = sum(stage_error_bytes(config, M, L, lay) for lay, _ in lays)
        stage1 = ("full precision (grad dtype)" if config.intra_node_bits == 16
                  else "8-bit compensated")
        mode = (f"intra-node stage {stage1}, inter-node stage {config.bits}-bit compensated"
                if M > 1 and L > 1 else
                f"one rank per node: flat {config.bits}-bit LoCo" if L == 1 else
                f"one node, no inter-node link: intra-node stage {stage1} only"
                + (" (megatron's stock reduce-scatter: nothing is compressed; launch on 2 or "
                   "more nodes, docs/hierarchical.md)" if config.intra_node_bits == 16 else ""))
        print_rank_0(
            f"> LoCo hierarchical: model chunk {chunk}, data-parallel group of {M * L} ranks = "
            f"{M} node{'s' if M != 1 else ''} x {L} ranks "
            f"(LOCAL_WORLD_SIZE={topo.local_world_size}): {mode}; error state {memory} "
            f"bytes per rank in memory (both stages)")



def _kernels_note(cfg, emulated: bool) -> str:
    """Which hot-path implementation ``--loco-kernels`` resolves to on this rank's device."""
    import torch

    from .. import kernels

    probe = torch.empty(0, device="cpu" if emulated or not torch.cuda.is_available() else "cuda")
    try:
        impl = kernels.select(cfg.kernels, probe)
    except ValueError as exc:
        return f"kernels: {exc}"
    return f"kernels {impl}" + (" (auto)" if cfg.kernels == "auto" else "")


def log_loco_startup(state, args, emulated: bool) -> None:
    """The start-up line: whether LoCo is active, with its settings (``state`` None: not
    installed, ``--loco-bits`` unset)."""
    where = "CPU ranks (CUDA emulation, gloo)" if emulated else "GPU"
    if state is None:
        print_rank_0(f"> LoCo off (--loco-bits unset): nothing installed, megatron-core runs "
                      f"as shipped; on {where}")
        return
    cfg = state.config
    if state.active:
        print_rank_0(
            f"> LoCo active: {cfg.bits}-bit compensated reduce-scatter, block {cfg.block_size}, "
            f"err-beta {cfg.beta}, reset every {cfg.reset_interval} steps, error storage "
            f"{cfg.error_dtype}"
            + (f", quantizer grid {cfg.grid}" if cfg.grid != "symmetric" else "")  # --loco-grid
            + f"; {_kernels_note(cfg, emulated)}; on {where}"
            + (f"; hierarchical: intra-node stage "
               f"{'full precision' if cfg.intra_node_bits == 16 else '8-bit compensated'}, "
               f"inter-node stage {cfg.bits}-bit, nodes of LOCAL_WORLD_SIZE="
               f"{os.environ.get('LOCAL_WORLD_SIZE', '(unset)')} ranks (M nodes x L ranks per "
               f"DP group logged when the model is wrapped)" if cfg.hierarchical else "")
            + (f"; full precision for the first {cfg.start_iter} steps (--loco-start-iter)"
               if cfg.start_iter else ""))
    else:
        print_rank_0(f"> LoCo off (--loco-bits {cfg.bits}): stock megatron-core reduce-scatter; "
                      f"on {where}")
    if state.param_active:
        print_rank_0(f"> LoCo parameter all-gather: {cfg.param_bits}-bit weight differences "
                     f"(--loco-param-bits), block {cfg.block_size}; per-chunk bytes logged when "
                     f"the model is wrapped")
