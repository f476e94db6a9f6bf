"""Exact byte counts of LoCo: wire bytes per optimizer step and error-state bytes per rank.

Pure arithmetic on :class:`~loco_megatron.layout.BucketLayout` (no torch.distributed, no
megatron): used by the start-up lines (:mod:`loco_megatron.megatron.report`), the planner
(:mod:`loco_megatron.planner.buckets`) and the benchmarks, so every place counts the same bytes.
"""

import dataclasses
from typing import List, Tuple

from .config import LoCoConfig, LoCoConfigError
from .layout import BucketLayout
from .quantization import wire_bytes


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


def param_gather_bytes_per_step(param_bits: int,
                                buckets: List[Tuple[BucketLayout, int]]) -> Tuple[int, int]:
    """Exact bytes one rank sends per optimizer step in the parameter all-gather with weight
    differences (``--loco-param-bits``; loco_megatron/weight_difference.py): ``(LoCo, stock
    all-gather)``, i.e. ``(world - 1) * (bits * P + 32 * P / block) / 8`` against
    ``(world - 1) * shard * element size`` per bucket (``P``: the padded shard).

    Args:
        buckets: ``(layout, parameter element size in bytes)`` per bucket.
    """
    loco = sum((lay.world - 1) * (lay.padded_shard * param_bits // 8
                                  + 4 * (lay.padded_shard // lay.block_size))
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


def stage_error_elements(config: LoCoConfig, M: int, L: int, lay: BucketLayout) -> int:
    """Error-buffer elements of one bucket in the hierarchical mode (``N * P`` for the 8-bit
    intra stage, ``M * P`` for the inter stage; the flat buffer when ``L == 1``)."""
    if L == 1:
        return lay.world * lay.padded_shard
    intra = lay.world * lay.padded_shard if config.intra_node_bits == 8 else 0
    return intra + (M * lay.padded_shard if M > 1 else 0)


def _rebuilt(lay: BucketLayout, block_size: int) -> BucketLayout:
    """``lay`` cut at the same parameter and shard boundaries, blocks of ``block_size``."""
    bounds = {x for segs in lay.segments for s, _, n in segs for x in (s, s + n)}
    return BucketLayout.build(lay.numel, lay.world, block_size, bounds)


def check_wire_not_above_stock(config: LoCoConfig,
                               buckets: List[Tuple[BucketLayout, int]]) -> None:
    """Refuse a block size at which LoCo would send more bytes than megatron's stock
    reduce-scatter: blocks are padded at every parameter and DP-shard boundary, so on small
    models (or shards) a large ``--loco-block-size`` sends mostly padding.

    Args:
        buckets: ``(layout, grad element size in bytes)`` of every compressed bucket of a
            buffer (or a model chunk), as :func:`expected_bytes_per_step` takes them.

    Raises:
        LoCoConfigError: naming ``--loco-block-size``, the bytes, and the largest power-of-two
            block size (down to 16) at which LoCo sends no more than stock, or, if none does,
            that this model is too small to gain from compression.
    """
    loco, stock = expected_bytes_per_step(config, buckets)
    if not buckets or loco <= stock:
        return
    fits = None
    size = 1 << (config.block_size.bit_length() - 1)
    while size >= 16:
        if size < config.block_size:
            trial = [(_rebuilt(lay, size), elem) for lay, elem in buckets]
            b, s = expected_bytes_per_step(dataclasses.replace(config, block_size=size), trial)
            if b <= s:
                fits = size
                break
        size //= 2
    advice = (f"use --loco-block-size {fits} or smaller" if fits else
              "no block size from 16 up sends less here: this model's shards are too small to "
              "gain from compression; run with --loco-bits 16")
    raise LoCoConfigError(
        f"--loco-block-size {config.block_size}: LoCo would send {loco} bytes/step per rank vs "
        f"{stock} for megatron's stock reduce-scatter ({loco / stock:.3f}x): blocks are padded "
        f"at every parameter and data-parallel shard boundary, and at this block size the "
        f"padding outweighs the compression; {advice}.")
