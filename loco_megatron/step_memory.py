"""LoCo's memory per rank in a training step, exactly: persistent state and the step's peak.

Pure arithmetic on :class:`~loco_megatron.layout.BucketLayout` (no torch.distributed, no
megatron), for the flat compensated reduce-scatter (loco_megatron/collectives.py) with the fused
kernels (Triton on GPUs, C on CPU ranks) and LoCo's telemetry off. It counts every tensor LoCo
allocates, in the order it allocates and frees them:

* **persistent**, held from the first step on: each bucket's error buffer
  (:class:`~loco_megatron.error_buffer.ErrorBuffer`: int8 codes ``n`` + fp32 scales ``4 s``, or
  fp32 values ``4 n``; ``n = world * padded_shard`` wire elements, ``s`` blocks), its block table
  (:mod:`loco_megatron.kernels.block_table`: source and wire offsets int64, lengths int32,
  ``20 s``, cached per distinct layout: buckets of equal layouts share one), its blocks' spans
  (int64 ``8 s``: the error buffer's copy on the device, per bucket; on CPU ranks the table's own
  tensor, per distinct layout, which on GPUs stays on the host), the bucket's latest NaN/Inf
  block count (int32, 4 B) and the rank's running count (int64, 8 B; its pinned host copy of
  :class:`~loco_megatron.nonfinite.NonfiniteMonitor`, 8 B, is host memory on GPUs);
* **transient**: a bucket's send buffers (payload ``n * bits / 8`` + scales ``4 s``), allocated by
  its compress, and its receive buffers (the same), allocated before its all-to-alls, both freed
  when megatron drops the bucket's handle after ``finish_grad_sync`` waited on it; the
  decompress's fp32 copy of the shard where the kernel cannot write the output directly (C
  kernel, output not fp32); the C kernel's fp32 copy of an fp16 bucket during its compress;
  the bucket's new NaN/Inf count (4 B) beside its last one during its compress.
  With ``overlap_grad_reduce`` megatron launches each bucket group (all its buckets at once)
  from its backward hooks and waits for all of them in ``finish_grad_sync``; LoCo finishes
  (decompresses and frees) each bucket whose all-to-alls have landed before the next group's
  launch (:class:`~loco_megatron.collectives.InFlight`), so the buffers live at once are those
  of the groups in flight: between one group's (communication keeps up with backward) and
  every bucket's (nothing lands before the end of backward, the bound). Without overlap each
  bucket is reduced synchronously: one bucket's.

Native workspace (the C kernels' per-block ``malloc``, NCCL's and gloo's own buffers) is not a
tensor and is not counted. benchmarks/memory_formula.py applies this to LLaMA-2 7B and 70B;
tests/distributed/test_memory_overlap.py checks it against
:class:`~loco_megatron.emulation.alloc_tracker.AllocationTracker` under the CPU emulation.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from .accounting import error_state_bytes
from .config import LoCoConfig
from .layout import BucketLayout

#: per bucket: the latest non-finite block count (int32); per rank: the running count (int64)
BUCKET_COUNTER, RANK_COUNTER = 4, 8


@dataclass(frozen=True)
class StepMemory:
    """LoCo's bytes on one rank (module doc). ``persistent`` and ``peak`` are device bytes
    (``device="cpu"``: every byte LoCo allocates, the host ones included, as the CPU emulation
    counts them); ``peak`` includes ``persistent``; ``host`` are host bytes on GPUs (0 on CPU).

    Attributes:
        error, tables, spans, counters: the parts of ``persistent``.
        wire_all: every bucket's send + receive buffers (the overlap-on peak's transient part
            without the decompress copy).
        transient: ``peak - persistent``.
    """

    persistent: int
    peak: int
    host: int
    error: int
    tables: int
    spans: int
    counters: int
    wire_all: int

    @property
    def transient(self) -> int:
        return self.peak - self.persistent


def step_memory(config: LoCoConfig, buckets: Sequence[Tuple[BucketLayout, int]], *,
                overlap: bool, device: str = "cuda", fp16=False,
                in_flight: Optional[int] = None,
                groups: Optional[Sequence[int]] = None) -> StepMemory:
    """LoCo's persistent bytes and the peak of one steady step on one rank (module doc).

    Args:
        config: bits, error storage (``config.error_dtype``).
        buckets: ``(layout, grad element size in bytes)`` of every compressed bucket, in the
            order megatron waits for them (``model.bucket_groups``; with several gradient
            buffers its backward hooks launch them interleaved: the bound does not depend on
            the launch order).
        overlap: ``overlap_grad_reduce``.
        device: ``"cuda"`` (Triton kernels) or ``"cpu"`` (C kernels, the CPU emulation).
        fp16: the gradients are fp16 (the C kernel compresses an fp32 copy): one flag for
            every bucket, or one per bucket.
        in_flight: with overlap, the most bucket groups whose all-to-alls have not landed
            when the next group launches, plus that one
            (:class:`~loco_megatron.collectives.InFlight` finishes and frees the landed ones
            first, once per group launch): 1 when each group lands before the next is ready
            (communication keeps up with backward), None (the default, the upper bound) when
            none lands before the end of backward.
        groups: buckets per megatron bucket group, in wait order (``model.bucket_groups``;
            megatron-core's ``partition_buckets``: a group launches all its buckets at once);
            None, one bucket per group (megatron's default for one gradient buffer). Several
            buckets share a group with fp8 parameters and in the model chunks after the first
            under virtual pipeline parallelism with several gradient buffers.

    Raises:
        ValueError: ``--loco-hierarchical`` or ``--loco-full-precision-1d`` (their stage and
            lane buffers are not in this formula), an unknown ``device``, ``groups`` that do
            not add up to the buckets, or ``fp16`` flags not one per bucket.
    """
    if config.hierarchical or any(lay.exact_shard for lay, _ in buckets):
        raise ValueError("step_memory covers the flat reduce-scatter without "
                         "--loco-full-precision-1d")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device {device!r} is not 'cuda' or 'cpu'")
    groups = [1] * len(buckets) if groups is None else list(groups)
    if sum(groups) != len(buckets) or any(g < 1 for g in groups):
        raise ValueError(f"groups {groups} do not split the {len(buckets)} buckets")
    cpu = device == "cpu"
    s = [lay.nblocks for lay, _ in buckets]
    error = error_state_bytes(config, [lay for lay, _ in buckets])[0]
    # block tables are cached per distinct layout (equal layouts share one: kernels/block_table.py);
    # an error buffer's spans are the table's own tensor on CPU ranks, its device copy on GPUs
    distinct = sum({lay: lay.nblocks for lay, _ in buckets}.values())
    tables = 20 * distinct
    spans = 8 * (distinct if cpu else sum(s))
    counters = BUCKET_COUNTER * len(buckets) + RANK_COUNTER + (RANK_COUNTER if cpu else 0)
    persistent = error + tables + spans + counters
    host = 0 if cpu else 8 * distinct + RANK_COUNTER
    wire = [lay.world * lay.wire_bytes_per_peer(config.bits) for lay, _ in buckets]  # one way
    # the decompress's fp32 shard copy (C kernel, output not fp32; Triton writes any
    # contiguous output); the C compress's fp32 copy of an fp16 bucket
    finish_tmp = [4 * lay.shard if cpu and elem != 4 else 0 for lay, elem in buckets]
    half = list(fp16) if isinstance(fp16, (list, tuple)) else [bool(fp16)] * len(buckets)
    if len(half) != len(buckets):
        raise ValueError(f"fp16 has {len(half)} entries for {len(buckets)} buckets")
    # during a compress the bucket's new NaN/Inf count (4 B) lives beside its last one
    compress_tmp = [BUCKET_COUNTER + (4 * lay.numel if cpu and h else 0)
                    for (lay, _), h in zip(buckets, half)]
    if not overlap:  # each bucket reduced synchronously, one at a time
        groups = [1] * len(buckets)
    window = 1 if not overlap else len(groups) if in_flight is None else max(1, in_flight)
    live, peak, queue = 0, 0, []

    def finish(ks):  # a group's decompresses, then its buffers are freed
        nonlocal live, peak
        for k in ks:
            peak = max(peak, live + finish_tmp[k])
            live -= 2 * wire[k]

    first = 0
    for size in groups:  # launch order
        while len(queue) >= window:  # landed before this group's launch
            finish(queue.pop(0))  # (InFlight.finish_landed)
        for k in range(first, first + size):
            w = wire[k]  # its send, then its receive buffers
            peak = max(peak, live + w + compress_tmp[k], live + 2 * w)
            live += 2 * w
        queue.append(range(first, first + size))
        first += size
    if overlap and in_flight is None and wire:  # the bound, whatever order the hooks launch
        # in (several buffers interleave): every bucket's buffers, the worst one compressing last
        peak = max(peak, 2 * sum(wire) + max(c - w for c, w in zip(compress_tmp, wire)))
    for ks in queue:  # finish_grad_sync (megatron waits in bucket-group order)
        finish(ks)
    return StepMemory(persistent=persistent, peak=persistent + peak, host=host, error=error,
                      tables=tables, spans=spans, counters=counters, wire_all=2 * sum(wire))


def describe(bound: StepMemory, overlap: bool, least: Optional[StepMemory] = None) -> str:
    """The start-up line's figures: ``"persistent P bytes (...), peak transient T bytes ..."``;
    with overlap, ``least`` (:func:`step_memory` with ``in_flight=1``) gives the low end (one
    figure when both ends are equal, e.g. one bucket group)."""
    if not overlap:
        when = f"{bound.transient} bytes in a step (one bucket's send and receive buffers)"
    else:
        low = least.transient if least is not None else bound.transient
        span = f"{low} to {bound.transient}" if low != bound.transient else f"{low}"
        when = (f"{span} bytes in a step (overlap_grad_reduce: the send and receive buffers of "
                f"the buckets whose all-to-alls have not landed; the low end when each bucket "
                f"group lands before the next is ready, the high end when none lands before the "
                f"end of backward)")
    return (f"LoCo memory per rank: persistent {bound.persistent} bytes (error buffers "
            f"{bound.error}, block tables {bound.tables + bound.spans}, counters "
            f"{bound.counters}), peak transient {when}")

