"""LoCo log lines in Megatron's style (rank 0 only): start-up summary and per-chunk layout."""

import logging
import os
from typing import List, Tuple

import torch

from ..config import LoCoConfig
from ..layout import BucketLayout
from ..quantization import wire_bytes

logger = logging.getLogger("loco_megatron")


def _print_rank_0(msg: str) -> None:
    """Print on global rank 0 (before init_process_group: the launcher's ``RANK``)."""
    if torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(msg, flush=True)


def expected_bytes_per_step(config: LoCoConfig,
                            buckets: List[Tuple[BucketLayout, int]]) -> Tuple[int, int]:
    """Exact bytes one rank sends per optimizer step: ``(LoCo, stock reduce-scatter)``.

    Args:
        buckets: ``(layout, grad element size in bytes)`` per bucket.
    """
    loco = sum((lay.world - 1) * wire_bytes(lay.padded_shard, config.bits, config.block_size)
               for lay, _ in buckets)
    stock = sum((lay.world - 1) * lay.shard * elem for lay, elem in buckets)
    return loco, stock


def error_state_bytes(config: LoCoConfig, layouts: List[BucketLayout]) -> Tuple[int, int]:
    """Bytes of one rank's LoCo error state: ``(in memory, per checkpoint on disk)``.

    In memory each bucket keeps its error in the padded wire layout
    (``world * padded_shard`` elements): int8 storage 1 byte per element + one fp32 scale per
    ``block_size`` elements, fp32 storage 4 bytes per element. A checkpoint holds that (the exact
    form) plus the rank's fp32 shard of the DP-summed error, 4 bytes x ``shard`` (the last ranks'
    shards can be shorter by the bucket's end padding, so this is exact for DP rank 0 and an upper
    bound for the others). Pickle framing of the ``torch`` format is not counted.
    """
    memory = disk = 0
    for lay in layouts:
        n = lay.world * lay.padded_shard
        memory += n + 4 * (n // lay.block_size) if config.error_dtype == "int8" else 4 * n
        disk += 4 * lay.shard if lay.world > 1 else 0
    return memory, memory + disk


def log_chunk_layout(chunk: int, config: LoCoConfig,
                     buckets: List[Tuple[BucketLayout, int]]) -> None:
    """One line per model chunk: buckets, elements, expected wire bytes per step vs stock."""
    if not buckets:
        _print_rank_0(f"> LoCo: model chunk {chunk}: data-parallel size 1, no gradient is "
                      f"communicated; stock path")
        return
    loco, stock = expected_bytes_per_step(config, buckets)
    numel = sum(lay.numel for lay, _ in buckets)
    ratio = loco / stock if stock else 0.0
    _print_rank_0(
        f"> LoCo: model chunk {chunk}: {len(buckets)} buckets, {numel} gradient elements, "
        f"{loco} bytes/step per rank on the wire vs {stock} stock ({ratio:.3f}x)")
    memory, disk = error_state_bytes(config, [lay for lay, _ in buckets])
    _print_rank_0(
        f"> LoCo: model chunk {chunk}: error state {memory} bytes per rank in memory "
        f"({memory / numel:.3f} B/element), <= {disk} tensor bytes per rank per checkpoint "
        f"({disk / numel:.3f} B/element)")
    padded = sum(lay.world * lay.padded_shard for lay, _ in buckets)
    if padded > 1.5 * numel:
        _print_rank_0(
            f"> LoCo WARNING: {padded / numel:.2f}x elements on the wire after padding (LoCo "
            f"sends {ratio:.2f}x of stock bytes): blocks are padded at every parameter "
            f"and shard boundary, so --loco-block-size {config.block_size} is too large for "
            f"this model; use 256 (the default) or smaller.")


def hierarchical_bytes_per_step(config: LoCoConfig, M: int, L: int,
                                buckets: List[Tuple[BucketLayout, int]]) -> Tuple[int, int]:
    """Exact bytes one rank sends per optimizer step in the hierarchical mode:
    ``(intra-node, inter-node)`` for ``M`` nodes x ``L`` ranks (loco_megatron/hierarchical.py;
    ``L == 1``: all flat LoCo bytes are inter-node; ``M == 1`` at 16 bits: the stock bytes).

    Args:
        buckets: ``(layout, grad element size in bytes)`` per bucket.
    """
    intra = inter = 0
    for lay, elem in buckets:
        P = lay.padded_shard
        if L == 1:
            inter += (M - 1) * wire_bytes(P, config.bits, config.block_size)
        elif M == 1 and config.intra_node_bits == 16:
            intra += (L - 1) * lay.shard * elem
        else:
            intra += (L - 1) * (M * P * elem if config.intra_node_bits == 16 else
                                wire_bytes(M * P, 8, config.block_size))
            inter += (M - 1) * wire_bytes(P, config.bits, config.block_size)
    return intra, inter


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
        intra, inter = hierarchical_bytes_per_step(config, M, L, lays)
        elements = sum(_stage_error_elements(config, M, L, lay) for lay, _ in lays)
        memory = (elements + 4 * (elements // config.block_size) if config.error_dtype == "int8"
                  else 4 * elements)
        stage1 = ("full precision (grad dtype)" if config.intra_node_bits == 16
                  else "8-bit compensated")
        mode = (f"intra-node stage {stage1}, inter-node stage {config.bits}-bit compensated"
                if M > 1 and L > 1 else
                f"one rank per node: flat {config.bits}-bit LoCo" if L == 1 else
                f"one node, no inter-node link: intra-node stage {stage1} only"
                + (" (megatron's stock reduce-scatter: nothing is compressed; launch on 2 or "
                   "more nodes, docs/hierarchical.md)" if config.intra_node_bits == 16 else ""))
        _print_rank_0(
            f"> LoCo hierarchical: model chunk {chunk}, data-parallel group of {M * L} ranks = "
            f"{M} node{'s' if M != 1 else ''} x {L} ranks "
            f"(LOCAL_WORLD_SIZE={topo.local_world_size}): {mode}; "
            f"{intra} bytes/step per rank intra-node, {inter} inter-node; error state {memory} "
            f"bytes per rank in memory (these replace the flat figures)")


def _stage_error_elements(config: LoCoConfig, M: int, L: int, lay: BucketLayout) -> int:
    """Error-buffer elements of one bucket in the hierarchical mode (``N * P`` for the 8-bit
    intra stage, ``M * P`` for the inter stage; the flat buffer when ``L == 1``)."""
    if L == 1:
        return lay.world * lay.padded_shard
    intra = lay.world * lay.padded_shard if config.intra_node_bits == 8 else 0
    return intra + (M * lay.padded_shard if M > 1 else 0)


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
        _print_rank_0(f"> LoCo off (--loco-bits unset): nothing installed, megatron-core runs "
                      f"as shipped; on {where}")
        return
    cfg = state.config
    if state.active:
        _print_rank_0(
            f"> LoCo active: {cfg.bits}-bit compensated reduce-scatter, block {cfg.block_size}, "
            f"err-beta {cfg.beta}, reset every {cfg.reset_interval} steps, error storage "
            f"{cfg.error_dtype}; {_kernels_note(cfg, emulated)}; on {where}"
            + (f"; hierarchical: intra-node stage "
               f"{'full precision' if cfg.intra_node_bits == 16 else '8-bit compensated'}, "
               f"inter-node stage {cfg.bits}-bit, nodes of LOCAL_WORLD_SIZE="
               f"{os.environ.get('LOCAL_WORLD_SIZE', '(unset)')} ranks (M nodes x L ranks per "
               f"DP group logged when the model is wrapped)" if cfg.hierarchical else "")
            + (f"; full precision for the first {cfg.start_iter} steps (--loco-start-iter)"
               if cfg.start_iter else ""))
    else:
        _print_rank_0(f"> LoCo off (--loco-bits {cfg.bits}): stock megatron-core reduce-scatter; "
                      f"on {where}")
