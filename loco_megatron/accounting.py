"""Exact byte counts of LoCo: wire bytes per optimizer step and error-state bytes per rank.

Pure arithmetic on :class:`~loco_megatron.layout.BucketLayout` (no torch.distributed, no
megatron): used by the start-up lines (:mod:`loco_megatron.megatron.report`), the planner
(:mod:`loco_megatron.planner.buckets`) and the benchmarks, so every place counts the same bytes.
"""

import dataclasses
from typing import List, Tuple

from .config import MAX_BLOCK_SIZE, LoCoConfig, LoCoConfigError
from .layout import BucketLayout


def expected_bytes_per_step(config: LoCoConfig,
                            buckets: List[Tuple[BucketLayout, int]]) -> Tuple[int, int]:
    """Exact bytes one rank sends per optimizer step: ``(LoCo, stock reduce-scatter)``.

    Args:
        buckets: ``(layout, grad element size in bytes)`` per bucket.
    """
    loco = sum((lay.world - 1) * (lay.wire_bytes_per_peer(config.bits)
                                  + lay.exact_bytes_per_peer(elem)) for lay, elem in buckets)
    stock = sum((lay.world - 1) * lay.shard * elem for lay, elem in buckets)
    return loco, stock


def param_gather_bytes_per_step(param_bits: int,
                                buckets: List[Tuple[BucketLayout, int]]) -> Tuple[int, int]:
    """Exact bytes one rank sends per optimizer step in the parameter all-gather with weight
    differences (``--loco-param-bits``; loco_megatron/weight_difference.py): ``(LoCo, stock
    all-gather)``, i.e. ``(world - 1) * (bits * P / 8 + 4 * K)`` against
    ``(world - 1) * shard * element size`` per bucket (``P``: the wire shard, ``K``: its
    blocks).

    Args:
        buckets: ``(layout, parameter element size in bytes)`` per bucket.
    """
    loco = sum((lay.world - 1) * lay.wire_bytes_per_peer(param_bits) for lay, _ in buckets)
    stock = sum((lay.world - 1) * lay.shard * elem for lay, elem in buckets)
    return loco, stock


def error_state_bytes(config: LoCoConfig, layouts: List[BucketLayout]) -> Tuple[int, int]:
    """Bytes of one rank's LoCo error state: ``(in memory, per checkpoint on disk)``.

    In memory each bucket keeps its error in the wire layout (``world * padded_shard``
    elements): int8 storage 1 byte per element + one fp32 scale per block (``world *
    blocks_per_shard``), fp32 storage 4 bytes per element. A checkpoint holds that (the exact
    form) plus the rank's fp32 shard of the DP-summed error, 4 bytes x ``shard`` (the last ranks'
    shards can be shorter by the bucket's end padding, so this is exact for DP rank 0 and an upper
    bound for the others). Pickle framing of the ``torch`` format is not counted.
    """
    memory = disk = 0
    for lay in layouts:
        n = lay.world * lay.padded_shard
        memory += n + 4 * lay.nblocks if config.error_dtype == "int8" else 4 * n
        disk += 4 * lay.shard if lay.world > 1 else 0
    return memory, memory + disk


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
        P, K = lay.padded_shard, lay.blocks_per_shard
        if L == 1:
            inter += (M - 1) * lay.wire_bytes_per_peer(config.bits)
        elif M == 1 and config.intra_node_bits == 16:
            intra += (L - 1) * lay.shard * elem
        else:
            intra += (L - 1) * (M * P * elem if config.intra_node_bits == 16 else
                                M * lay.wire_bytes_per_peer(8))
            inter += (M - 1) * lay.wire_bytes_per_peer(config.bits)
    return intra, inter


def stage_error_elements(config: LoCoConfig, M: int, L: int, lay: BucketLayout,
                         unit: int = None) -> int:
    """Error-buffer elements of one bucket in the hierarchical mode (``N * P`` for the 8-bit
    intra stage, ``M * P`` for the inter stage; the flat buffer when ``L == 1``); with ``unit``
    the same count of ``unit`` per shard instead of ``P`` (the blocks: ``unit = K``)."""
    unit = lay.padded_shard if unit is None else unit
    if L == 1:
        return lay.world * unit
    intra = lay.world * unit if config.intra_node_bits == 8 else 0
    return intra + (M * unit if M > 1 else 0)


def stage_error_bytes(config: LoCoConfig, M: int, L: int, lay: BucketLayout) -> int:
    """Memory of one bucket's error buffers in the hierarchical mode: int8 storage 1 byte per
    element and 4 per block, fp32 storage 4 bytes per element."""
    n = stage_error_elements(config, M, L, lay)
    if config.error_dtype != "int8":
        return 4 * n
    return n + 4 * stage_error_elements(config, M, L, lay, lay.blocks_per_shard)


def _rebuilt(lay: BucketLayout, block_size: int) -> BucketLayout:
    """``lay`` cut at the same parameter and shard boundaries, blocks of ``block_size``."""
    bounds = {x for segs in lay.segments for s, _, n in segs for x in (s, s + n)}
    exact = [(s, s + n) for segs in lay.exact_segments for s, _, n in segs]
    return BucketLayout.build(lay.numel, lay.world, block_size, bounds, exact)


def check_wire_not_above_stock(config: LoCoConfig,
                               buckets: List[Tuple[BucketLayout, int]]) -> None:
    """Refuse a block size at which LoCo would send more bytes than megatron's stock
    reduce-scatter. Blocks are not padded (loco_megatron/layout.py), but every block sends a
    4-byte scale, so very small blocks (or tiny parameters, each at least one block) can cost
    more than the codes save.

    Args:
        buckets: ``(layout, grad element size in bytes)`` of every compressed bucket of a
            buffer (or a model chunk), as :func:`expected_bytes_per_step` takes them.

    Raises:
        LoCoConfigError: naming ``--loco-block-size``, the bytes, and the smallest power-of-two
            block size above it at which LoCo sends no more than stock, or, if none does, that
            this model is too small to gain from compression.
    """
    loco, stock = expected_bytes_per_step(config, buckets)
    if not buckets or loco <= stock:
        return
    fits = None
    size = 1 << config.block_size.bit_length()
    while size <= MAX_BLOCK_SIZE:
        trial = [(_rebuilt(lay, size), elem) for lay, elem in buckets]
        b, s = expected_bytes_per_step(dataclasses.replace(config, block_size=size), trial)
        if b <= s:
            fits = size
            break
        size *= 2
    advice = (f"use --loco-block-size {fits} or larger" if fits else
              "no larger block size sends less here: this model's parameters are too small to "
              "gain from compression; run with --loco-bits 16")
    raise LoCoConfigError(
        f"--loco-block-size {config.block_size}: LoCo would send {loco} bytes/step per rank vs "
        f"{stock} for megatron's stock reduce-scatter ({loco / stock:.3f}x): every block sends a "
        f"4-byte scale, and at this block size the scales outweigh the compression; {advice}.")
