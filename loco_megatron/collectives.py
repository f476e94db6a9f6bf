"""Compensated low-bit reduce-scatter: all-to-all of codes and scales, then a local fp32 sum.

docs/architecture.md (data flow of one bucket). NCCL and gloo cannot sum 4-bit codes, so
``reduce_scatter_tensor`` becomes:

1. quantize the compensated bucket in its wire :class:`~loco_megatron.layout.BucketLayout`
   (blocks never straddle DP shards or parameters, a segment's last block is short; every
   rank's chunk holds the same number of codes and scales);
2. ``all_to_all_single`` of the packed codes and of the fp32 scales: rank j receives shard j
   from every rank;
3. dequantize the received chunks, sum them in fp32 and write the result into ``output`` in its
   own dtype (divided by the world size for ``ReduceOp.AVG``).

With ``--loco-full-precision-1d`` the layout's exact segments (1-D parameters) skip steps 1-3:
they are gathered into a lane of the gradient's dtype, sent by a third ``all_to_all_single``
issued with the other two, and summed in fp32 in rank order (like megatron's
``reduce_scatter_with_fp32_accumulation``); with 2 ranks that is the stock value bit for bit.

Steps 1 and 3 are one fused pass each (:mod:`loco_megatron.kernels`: Triton on CUDA tensors, C
on CPU tensors, the torch reference otherwise or with ``--loco-kernels torch``).

Same signature as ``torch.distributed.reduce_scatter_tensor`` and the same handle contract as
megatron-core's ``reduce_scatter_with_fp32_accumulation``
(megatron/core/distributed/reduce_scatter_with_fp32_accumulation.py): with ``async_op=True`` it
returns a handle whose ``wait()`` finishes the work (step 3).
"""

import collections
from dataclasses import dataclass
from typing import Callable, Deque, Hashable, List, Optional

import torch
import torch.distributed as dist

from . import kernels
from . import step_timers
from . import streams
from .caches import per_model
from .algorithm import sum_in_rank_order
from .compensator import Compensator
from .layout import BucketLayout

#: Megatron timers (log level 2) LoCo starts when given a ``timers`` object: compensate +
#: quantize + pack + error update; the all-to-alls (launch, and the wait for them); unpack +
#: dequantize + sum of the received chunks.
TIMER_NAMES = ("loco-compress", "loco-comm", "loco-decompress")


step_timer = step_timers.step_timer  # re-exported: the hierarchical and parameter paths


@dataclass
class WireStats:
    """Bytes this rank sent to other ranks, exactly, and the stock reduce-scatter equivalent.

    ``bytes_sent`` counts every byte sent to another rank; the hierarchical mode
    (:mod:`loco_megatron.hierarchical`) also splits it into ``intra_node_bytes`` (to ranks on
    the same node) and ``inter_node_bytes`` (to other nodes); the flat collective leaves both 0
    (it does not know the nodes)."""

    calls: int = 0
    bytes_sent: int = 0
    stock_bytes: int = 0
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0

    @property
    def ratio(self) -> float:
        """LoCo bytes / stock bytes (0 before the first call)."""
        return self.bytes_sent / self.stock_bytes if self.stock_bytes else 0.0


class LoCoWork:
    """Handle of an asynchronous compensated reduce-scatter; ``wait()`` finishes it (idempotent).

    Args:
        works: the outstanding ``torch.distributed`` work objects (None entries are skipped).
        finish: called once after all works completed; writes the reduced shard.
        comm_timer: started and stopped around the wait for ``works`` (a Megatron timer).
    """

    def __init__(self, works: List, finish: Callable[[], None], comm_timer=step_timers.NO_TIMER):
        self._works, self._finish, self._done = works, finish, False
        self._comm_timer = comm_timer

    def wait(self, timeout=None) -> bool:
        """Wait for the all-to-alls, then dequantize, sum and write the shard (once); then drop
        the works and the buffers they and ``finish`` hold (send and receive payloads and
        scales), whoever still holds this handle."""
        if not self._done:
            if self._works:
                self._comm_timer.start()
                for w in self._works:
                    if w is not None:
                        w.wait()
                self._comm_timer.stop()
            self._finish()
            self._done = True
            self._works, self._finish = [], None
        return True

    def landed(self) -> bool:
        """True when every all-to-all of this handle has completed: a query that never waits
        (NCCL: an event query; gloo: a flag), after which :meth:`wait` neither blocks the host
        nor makes the current stream wait."""
        return all(w is None or w.is_completed() for w in self._works)

    def is_completed(self) -> bool:
        """True once :meth:`wait` has written the reduced shard."""
        return self._done


def launch(works: List, finish: Callable[[], None], comm_timer, async_op: bool):
    """The end of every LoCo collective: with ``async_op`` a :class:`LoCoWork` over ``works``
    (its ``wait()`` runs ``finish``), else ``finish`` now, after ``works`` (issued
    synchronously), and None, as ``torch.distributed`` collectives return."""
    handle = LoCoWork(works if async_op else [], finish, comm_timer)
    if async_op:
        return handle
    handle.wait()
    return None


class InFlight:
    """A step's flat LoCo handles not finished yet, in launch order (with
    ``overlap_grad_reduce``, megatron launches each bucket from its backward hooks and waits for
    all of them in ``finish_grad_sync``).

    :meth:`finish_landed`, called before each launch, finishes the leading handles whose
    all-to-alls have landed: their shards are decompressed while backward goes on, and their
    send and receive buffers are freed then, not at ``finish_grad_sync``. The shard values are the
    same (a bucket's decompress reads only its own received buffers), and megatron reads a
    bucket's shard only after ``finish_grad_sync``; its later ``wait()`` is a no-op. Without it
    every bucket's buffers (~1 byte per gradient element at 4 bits) are live at the end of
    backward (loco_megatron/step_memory.py)."""

    def __init__(self):
        self._works: Deque[LoCoWork] = collections.deque()

    def add(self, works: List) -> None:
        """Queue the :class:`LoCoWork` handles of ``works`` (others are ignored)."""
        self._works.extend(w for w in works if isinstance(w, LoCoWork))

    def finish_landed(self) -> int:
        """Finish the queued handles, oldest first, up to the first that has not landed
        (:meth:`LoCoWork.landed`; no host sync); returns how many it finished."""
        finished = 0
        while self._works:
            work = self._works[0]
            if not work.is_completed():
                if not work.landed():
                    break
                work.wait()
                finished += 1
            self._works.popleft()
        return finished


class GroupWork:
    """One handle over several: what megatron-core's bucket group stores as
    ``grad_reduce_handle`` when LoCo replaced its coalesced reduce-scatters (megatron's own
    coalescing handle first, then LoCo's handles in bucket order)."""

    def __init__(self, works: List):
        self._works = works

    def wait(self, timeout=None) -> bool:
        """Wait on every handle in order (each :class:`LoCoWork` finishes its bucket)."""
        for w in self._works:
            if w is not None:
                w.wait()
        return True


@per_model
def shard_only_layout(numel: int, world: int, block_size: int) -> BucketLayout:
    """The layout of a bucket with blocks cut at shard boundaries only (cached)."""
    return BucketLayout.build(numel, world, block_size)


def check_launch(tensor: torch.Tensor, what: str) -> None:
    """The runtime guards of a LoCo collective, before it launches anything (host queries only,
    no sync): ``tensor`` (the bucket) must not be reduced while a CUDA graph is captured (a graph
    would replay LoCo's host-side decisions, its step counters and reset schedule, as captured;
    ``torch.cuda.is_current_stream_capturing``) and must live on the current device (the kernels
    and NCCL launch on the current device's stream). CPU tensors, the CPU emulation's included,
    pass.

    Raises:
        RuntimeError: one line naming ``what`` and the way out.
    """
    if tensor.device.type != "cuda":
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"LoCo: {what} was called while a CUDA graph is being captured; a graph would replay "
            f"LoCo's host-side decisions as captured. Keep the gradient reduction out of the "
            f"graph (per-layer --cuda-graph-modules, not full_iteration) or use --loco-bits 16.")
    current = torch.cuda.current_device()
    if tensor.device.index is not None and tensor.device.index != current:
        raise RuntimeError(
            f"LoCo: {what} got a tensor on {tensor.device} while the current device is "
            f"cuda:{current}; call torch.cuda.set_device(LOCAL_RANK) before building the model "
            f"(megatron's initialize_megatron does).")


def checked_layout(output: torch.Tensor, input: torch.Tensor, op, group, block_size: int,
                   layout: Optional[BucketLayout], nodes: str = "") -> BucketLayout:
    """The argument checks of the LoCo reduce-scatters (flat and hierarchical): returns
    ``layout``, or the shard-only layout when None.

    Raises:
        ValueError: an op other than SUM/AVG, sizes that do not split over the group, a layout
            for other sizes or another block size (``nodes`` adds the topology to the message).
    """
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"LoCo reduce-scatter supports ReduceOp.SUM and AVG, not {op}")
    world, n = dist.get_world_size(group), input.numel()
    if n % world or output.numel() != n // world:
        raise ValueError(
            f"reduce-scatter sizes do not split: input {n} elements, output {output.numel()}, "
            f"group size {world}{nodes}")
    if layout is None:
        return shard_only_layout(n, world, block_size)
    if (layout.numel, layout.world, layout.block_size) != (n, world, block_size):
        raise ValueError(
            f"bucket layout for {layout.numel} elements / {layout.world} ranks / block "
            f"{layout.block_size} used for {n} elements / {world} ranks / block {block_size}")
    return layout


def compensated_reduce_scatter(output: torch.Tensor, input: torch.Tensor,
                               op=dist.ReduceOp.SUM, group=None, async_op: bool = False, *,
                               compensator: Optional[Compensator], key: Hashable = None,
                               layout: Optional[BucketLayout] = None,
                               stats: Optional[WireStats] = None, timers=None):
    """Reduce-scatter ``input`` into ``output`` with LoCo compression.

    Args:
        output: this rank's shard, ``[n / world]``, any float dtype; may be a view into
            ``input`` (megatron-core passes ``shard_buffer(grad_data)[rank]``).
        input: flat bucket ``[n]``, ``n`` divisible by the group size. Read only.
        op: ``ReduceOp.SUM`` or ``ReduceOp.AVG``.
        group: process group (default: WORLD).
        async_op: return a :class:`LoCoWork` instead of finishing before returning.
        compensator: the rank's :class:`Compensator`; ``None`` runs the stock
            ``reduce_scatter_tensor`` unchanged (bits 16/32).
        key: stable bucket id for the error buffer.
        layout: the bucket's :class:`~loco_megatron.layout.BucketLayout` (blocks cut at shard and
            parameter boundaries); default: cut at shard boundaries only.
        stats: optional :class:`WireStats` updated with exact byte counts.
        timers: optional ``megatron.core.timers.Timers``; times :data:`TIMER_NAMES` at log
            level 2 (no-ops unless ``--timing-log-level 2``).

    Returns:
        ``LoCoWork`` if ``async_op`` else ``None``.

    Raises:
        ValueError: an op other than SUM/AVG, or sizes that do not split evenly.
        RuntimeError: called during CUDA graph capture, or ``input`` not on the current device
            (:func:`check_launch`).
    """
    if compensator is None:
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
    check_launch(input, "the LoCo reduce-scatter")
    cfg = compensator.config
    layout = checked_layout(output, input, op, group, cfg.block_size, layout)
    world, shard = layout.world, layout.shard
    compress_timer, comm_timer, decompress_timer = (step_timer(timers, n) for n in TIMER_NAMES)
    # the receive buffers are read on this (the compute) stream: allocated here, before the
    # switch to the side stream (loco_megatron/streams.py, lifetimes)
    recv_payload = torch.empty(world * layout.padded_shard * cfg.bits // 8, dtype=torch.uint8,
                               device=input.device)
    recv_scales = torch.empty(world * layout.blocks_per_shard, dtype=torch.float32,
                              device=input.device)
    lane_out = (torch.empty(world * layout.exact_shard, dtype=input.dtype, device=input.device)
                if layout.exact_shard else None)
    with streams.launch_stream(input, enabled=async_op):
        compress_timer.start()
        payload, scales = compensator.compress(key, input.view(-1), layout)
        compress_timer.stop()
        lane = None
        if lane_out is not None:  # --loco-full-precision-1d: a full-precision lane
            lane = layout.to_lane(input.view(-1))
        comm_timer.start()
        works = [
            dist.all_to_all_single(recv_payload, payload, group=group, async_op=async_op),
            dist.all_to_all_single(recv_scales, scales, group=group, async_op=async_op),
        ]
        if lane is not None:  # (a reduce_scatter_tensor here would join megatron's coalescing)
            works.append(dist.all_to_all_single(lane_out, lane, group=group, async_op=async_op))
        comm_timer.stop()
    if stats is not None:
        sent = (payload.numel() * payload.element_size() + scales.numel() * 4) // world
        stats.calls += 1
        stats.bytes_sent += (sent + layout.exact_bytes_per_peer(input.element_size())) * (world - 1)
        stats.stock_bytes += shard * input.element_size() * (world - 1)

    def finish():
        decompress_timer.start()
        impl = kernels.select(cfg.kernels, output)
        table = kernels.block_table(layout, output.device if impl != "torch" else "cpu")
        rank = dist.get_rank(group)
        kernels.decompress_shard(impl, recv_payload, recv_scales, table, rank,
                                 bits=cfg.bits, average=op == dist.ReduceOp.AVG, out=output)
        if lane_out is not None:  # after the decompress, which may rewrite the whole shard
            exact = sum_in_rank_order(lane_out.view(world, layout.exact_shard), torch.float32)
            if op == dist.ReduceOp.AVG:
                exact /= torch.full((), world, dtype=torch.float32, device=exact.device)
            layout.from_lane_shard(exact, rank, output.view(-1))
        decompress_timer.stop()

    return launch(works, finish, comm_timer, async_op)
