"""LoCo log lines in Megatron's style (rank 0 only): start-up summary and per-chunk layout."""

import logging
import os
from typing import List, Tuple

import torch

from ..config import LoCoConfig
from ..layout import BucketLayout
from ..accounting import (error_state_bytes, expected_bytes_per_step,
                          hierarchical_bytes_per_step, param_gather_bytes_per_step,
                          stage_error_elements)

logger = logging.getLogger("loco_megatron")


def print_rank_0(msg: str) -> None:
    """Print on global rank 0 (before init_process_group: the launcher's ``RANK``)."""
    if torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(msg, flush=True)




def log_chunk_layout(chunk: int, config: LoCoConfig,
                     buckets: List[Tuple[BucketLayout, int]]) -> None:
    """One line per model chunk: buckets, elements, expected wire bytes per step vs stock."""
    if not buckets:
        print_rank_0(f"> LoCo: model chunk {chunk}: data-parallel size 1, no gradient is "
                      f"communicated; stock path")
        return
    loco, stock = expected_bytes_per_step(config, buckets)
    numel = sum(lay.numel for lay, _ in buckets)
    ratio = loco / stock if stock else 0.0
    print_rank_0(
        f"> LoCo: model chunk {chunk}: {len(buckets)} buckets, {numel} gradient elements, "
        f"{loco} bytes/step per rank on the wire vs {stock} stock ({ratio:.3f}x)")
    memory, disk = error_state_bytes(config, [lay for lay, _ in buckets])
    print_rank_0(
        f"> LoCo: model chunk {chunk}: error state {memory} bytes per rank in memory "
        f"({memory / numel:.3f} B/element), <= {disk} tensor bytes per rank per checkpoint "
        f"({disk / numel:.3f} B/element)")
    padded = sum(lay.world * lay.padded_shard for lay, _ in buckets)
    if padded > 1.5 * numel:
        print_rank_0(
            f"> LoCo WARNING: {padded / numel:.2f}x elements on the wire after padding (LoCo "
            f"sends {ratio:.2f}x of stock bytes): blocks are padded at every parameter "
            f"and shard boundary, so --loco-block-size {config.block_size} is too large for "
            f"this model; use 256 (the default) or smaller.")



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
            f"blocks are padded at every parameter and shard boundary, so --loco-block-size "
            f"{config.block_size} is too large for this model's shards (or 4 bytes of scale per "
            f"block too many at this size); use a smaller --loco-block-size, or drop "
            f"--loco-param-bits.")


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
        elements = sum(stage_error_elements(config, M, L, lay) for lay, _ in lays)
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
        print_rank_0(
            f"> LoCo hierarchical: model chunk {chunk}, data-parallel group of {M * L} ranks = "
            f"{M} node{'s' if M != 1 else ''} x {L} ranks "
            f"(LOCAL_WORLD_SIZE={topo.local_world_size}): {mode}; "
            f"{intra} bytes/step per rank intra-node, {inter} inter-node; error state {memory} "
            f"bytes per rank in memory (these replace the flat figures)")



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
