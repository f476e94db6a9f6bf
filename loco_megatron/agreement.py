"""Fail fast when the ranks of a data-parallel group disagree on a bucket's LoCo layout.

A compensated reduce-scatter is two ``all_to_all_single`` calls whose sizes every rank derives
from its own bucket (elements, block size, bits). Ranks that disagree (different model, DDP
bucket size, ``--loco-*`` flags or gradient-buffer dtype on some rank) would exchange buffers of
different sizes: a hang, or sums of misaligned blocks without any error. So once per model, at
start-up (:mod:`loco_megatron.megatron.plugin` calls :func:`check_layouts_agree` when megatron-core
builds ``DistributedDataParallel``), every DP group gathers each rank's bucket descriptions with
``all_gather_object`` (which exchanges sizes first, so even lists of different lengths arrive)
and every rank raises the same :class:`~loco_megatron.config.LoCoConfigError` on a mismatch.
"""

import os
import zlib
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .config import LoCoConfig, LoCoConfigError, shared_settings
from .layout import BucketLayout

#: settings that must be equal on every rank of a group, from the settings registry
#: (``Setting.shared``; ``kernels`` is local: every implementation gives the same bits); ``bits``
#: and ``param_bits`` are described first, on their own (also with LoCo off)
SHARED_SETTINGS = tuple(name for name in shared_settings() if name not in ("bits", "param_bits"))


def describe(config: LoCoConfig, key: Hashable, layout: Optional[BucketLayout],
             grad_data: torch.Tensor) -> Dict[str, object]:
    """What the ranks of a bucket's group must agree on: bits first, then numel and dtype of
    the gradient buffer, and with LoCo on the stable bucket key, padded wire length, a CRC32
    of the block cuts (parameter boundaries) and the shared settings (:data:`SHARED_SETTINGS`).
    With ``hierarchical``, also ``LOCAL_WORLD_SIZE`` (the node topology both stages' split
    sizes come from: ranks that disagree would hang in the first all-to-all).
    LoCo off (``layout`` None): bits, numel and dtype only."""
    out = {"bits": config.bits if config.enabled else "off (full precision)",
           "param_bits": config.param_bits if config.params_enabled else "off (full precision)",
           "numel": grad_data.numel(), "dtype": str(grad_data.dtype).replace("torch.", "")}
    if layout is None:
        return out
    cuts = repr(layout.segments).encode()
    out = {**out, "bucket": str(key), **{name: getattr(config, name) for name in SHARED_SETTINGS},
           "padded_shard": layout.padded_shard, "block_cuts_crc32": zlib.crc32(cuts)}
    if layout.exact_shard:  # --loco-full-precision-1d: the full-precision lane's segments
        out["exact_lane_crc32"] = zlib.crc32(repr(layout.exact_segments).encode())
    if config.hierarchical:  # the node topology sets both stages' split sizes on every rank
        out["LOCAL_WORLD_SIZE"] = os.environ.get("LOCAL_WORLD_SIZE")
    return out


def check_layouts_agree(config: LoCoConfig,
                        buckets: Sequence[Tuple[object, Optional[Hashable],
                                                Optional[BucketLayout], torch.Tensor]]
                        ) -> None:
    """Collective over each DP group in ``buckets``: raise on every rank if any disagree.

    Args:
        config: this rank's LoCo settings.
        buckets: ``(process group, stable bucket key, layout, gradient buffer)`` of every
            bucket this rank reduce-scatters over more than one rank, in megatron-core's bucket
            order (key and layout None with LoCo off). Groups are visited in
            the order of their sorted global ranks, so all ranks issue the same collectives.

    Raises:
        LoCoConfigError: a bucket differs between ranks of its group (first difference named:
            bucket, field, each rank's value) or the ranks hold different numbers of buckets.
    """
    per_group: Dict[Tuple[int, ...], Tuple[object, List[Dict[str, object]]]] = {}
    for group, key, layout, grad_data in buckets:
        ranks = tuple(dist.get_process_group_ranks(group))
        per_group.setdefault(ranks, (group, []))[1].append(describe(config, key, layout, grad_data))
    for ranks in sorted(per_group):
        group, mine = per_group[ranks]
        gathered: List[object] = [None] * len(ranks)
        dist.all_gather_object(gathered, mine, group=group)
        problem = _first_difference(gathered, list(ranks))
        if problem:
            raise LoCoConfigError(
                f"LoCo: the ranks of data-parallel group {list(ranks)} disagree: {problem}. "
                f"Their compressed collectives (the gradient reduce-scatter, with "
                f"--loco-param-bits the parameter all-gather) would exchange blocks of different "
                f"sizes or codes on different grids (a hang or wrong sums), so LoCo stops at "
                f"start-up. Give every rank the "
                f"same model, --ddp-bucket-size, gradient dtype (--bf16 / --accumulate-allreduce-"
                f"grads-in-fp32) and --loco-* flags (a --config file or environment that "
                f"differs between nodes?).")


def _first_difference(gathered: List[List[Dict[str, object]]], ranks: List[int]) -> str:
    counts = [len(g) for g in gathered]
    for index in range(max(counts)):
        rows = [g[index] if index < len(g) else None for g in gathered]
        if any(r is None for r in rows):
            return ("number of LoCo buckets: " +
                    ", ".join(f"global rank {r} has {c}" for r, c in zip(ranks, counts)))
        for name in rows[0]:
            values = [row.get(name) for row in rows]
            if any(v != values[0] for v in values):
                return (f"bucket {rows[0].get('bucket', '')} (#{index} in the group), {name}: " +
                        ", ".join(f"global rank {r} has {v!r}" for r, v in zip(ranks, values)))
    return ""
