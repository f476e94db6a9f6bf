"""Hierarchical compensated reduce-scatter: intra-node stage, then a 4/8-bit inter-node stage.

docs/hierarchical.md (hierarchical variant, as in the authors' DeepSpeed/ZeRO++ implementation);
docs/hierarchical.md. A data-parallel group of ``N = M * L`` ranks spans ``M`` nodes with ``L``
of its ranks each (node of global rank ``g``: ``g // LOCAL_WORLD_SIZE``; torchrun and Slurm
place ranks contiguously per node). Group rank ``s`` has node ``m`` and local index ``l`` (its
position among the group's ranks on its node). The bucket is worked on in its padded wire layout
(:class:`~loco_megatron.layout.BucketLayout`: ``N`` shards of ``P`` elements):

1. intra-node (fast links): rank ``s`` sends each node peer ``j`` the ``M`` shards owned by the
   ranks with ``j``'s local index (one per node), in the grad buffer's dtype
   (``--loco-intra-node-bits 16``; summed in fp32 in rank order) or as compensated 8-bit codes
   with their own error buffer (key ``(bucket key, "intra")``). It receives ``[L, M, P]`` and
   sums it: ``[M, P]``, its node's partial sums of the shards owned by the ranks with local index
   ``l`` (one per node);
2. inter-node (slow links): the compensated ``bits``-bit partial sums (error buffer key
   ``(bucket key, "inter")``, ``M * P`` elements) go row ``k`` to the ``k``-th rank with local
   index ``l``; each rank sums the ``M`` rows it receives: its padded shard of the full sum.

Both stages are one ``all_to_all_single`` over all the DP group's ranks with zero split sizes
for non-peers (no per-node subgroups: ``dist.new_group`` would have to be called by every rank
in the same order for each of megatron's DP groups - dense and expert, per TP/PP rank): the
intra-node stage over the DP group itself, the inter-node stage over a copy of it
(:func:`~loco_megatron.node_topology.inter_node_group`, created by the group's own ranks only),
so that with NCCL the two stages run on two streams. With ``async_op`` LoCo's side stream
(:mod:`loco_megatron.streams`) runs the compress of both stages and the inter-node launch; the
compute stream waits only for the inter-node result it reads. Bytes each rank sends per bucket:
intra ``(L - 1) * M * P`` elements, inter ``(M - 1) * P`` elements at ``bits + 32 /
block_size`` bits each.

Degenerate topologies: ``L == 1`` (one rank of the group per node) is exactly the flat
compensated reduce-scatter (:func:`~loco_megatron.collectives.compensated_reduce_scatter`, same
error buffer key); ``M == 1`` (the whole group inside one node) has no inter-node link, so only
the intra-node stage runs: megatron's stock reduce-scatter with ``--loco-intra-node-bits 16``,
flat compensated 8-bit with 8.
"""

from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import kernels, streams
from .algorithm import sum_in_rank_order
from .caches import on_clear
from .collectives import (TIMER_NAMES, WireStats, check_launch, checked_layout,
                          compensated_reduce_scatter, launch, step_timer)
from .compensator import Compensator
from .layout import BucketLayout, ChunkView
from .node_topology import NodeTopology, group_topology, inter_node_group, local_world_size

__all__ = ["INTRA", "INTER", "NodeTopology", "group_topology", "local_world_size",
           "HierarchicalWork", "forget_pending_inter_stages", "hierarchical_reduce_scatter",
           "inter_view"]

#: error-buffer key suffixes of the two stages: ``(bucket key, STAGE)``
INTRA, INTER = "intra", "inter"


def _shard_layout(layout: BucketLayout, rank: int, copies: int) -> ChunkView:
    """``copies`` chunks of ``P`` wire elements, each laid out like ``rank``'s wire shard of
    ``layout``: decompressing chunk 0 writes ``rank``'s shard through its blocks."""
    return ChunkView(layout, ((rank,),) * copies)


def _intra_view(layout: BucketLayout, column: Tuple[int, ...], peers: int) -> ChunkView:
    """What a rank receives in the 8-bit intra-node stage: ``peers`` chunks, each the wire
    shards of ``column`` (the ranks with its local index, one per node), in wire order."""
    return ChunkView(layout, (tuple(column),) * peers, wire_order=True)


def inter_view(layout: BucketLayout, column: Tuple[int, ...]) -> ChunkView:
    """The inter-node stage's partial sums ``[M * P]``, in wire order: row ``k`` is the wire
    shard of ``column[k]`` and goes to that rank (its error buffer's layout too)."""
    return ChunkView(layout, tuple((c,) for c in column), wire_order=True)


def _splits(peers: Sequence[int], world: int, size: int):
    members = set(peers)
    return [size if j in members else 0 for j in range(world)]


#: ``(order, device) -> int64 index tensor`` of :func:`_reorder`: built once per layout, not in
#: every backward hook (a host-to-device copy on GPUs); emptied with the model's caches
#: (:func:`loco_megatron.caches.clear`, called by ``uninstall()``)
_ORDER_INDEX: Dict[Tuple[Tuple[int, ...], str], torch.Tensor] = {}
on_clear(_ORDER_INDEX.clear)


def _reorder(x: torch.Tensor, rows: int, order: Tuple[int, ...]) -> torch.Tensor:
    """Rows of ``x`` (viewed as ``[rows, -1]``) in ``order``, flat."""
    if order == tuple(range(rows)):
        return x.reshape(-1)
    key = (order, str(x.device))
    index = _ORDER_INDEX.get(key)
    if index is None:
        index = _ORDER_INDEX[key] = torch.tensor(order, dtype=torch.int64, device=x.device)
    return x.reshape(rows, -1).index_select(0, index).reshape(-1)


#: per process group: the asynchronous hierarchical handles whose inter-node stage is not issued
#: yet, in launch order (every rank of a group launches the same buckets in the same order)
_PENDING: Dict[object, List["HierarchicalWork"]] = {}


class HierarchicalWork:
    """Handle of an asynchronous hierarchical reduce-scatter (``async_op=True``, 2+ nodes).

    The slow inter-node stage does not wait for :meth:`wait`: the next LoCo reduce-scatter on
    the same group (the next bucket's backward hook) first completes the intra-node stage of
    every earlier bucket still pending, compresses its partial sums and issues its inter-node
    all-to-all asynchronously, then launches its own intra-node stage. So bucket ``k``'s
    inter-node transfer overlaps the backward pass of the buckets after it, and :meth:`wait`
    only finishes (the last bucket's inter stage is issued by its own ``wait``). Every rank
    issues the collectives in the same order (bucket order, then waits in order).

    Streams (loco_megatron/streams.py): the wait for the intra-node stage, its sum and the
    inter-node compress and launch run on LoCo's side stream, and the inter-node all-to-all goes
    through a process group of its own (:func:`~loco_megatron.node_topology.inter_node_group`:
    its own NCCL stream), so the compute stream waits only in :meth:`wait`, for the inter-node
    transfer whose result it reads.

    Args:
        group_key: the process group (``_PENDING`` key).
        intra: the intra-node stage's outstanding works.
        stage2: finishes the intra stage and issues the inter stage; returns its works.
        final: decompresses the inter stage into the output shard.
        comm_timer: started and stopped around waits (a Megatron timer).
        anchor: a tensor of the bucket (its device picks the side stream).
    """

    def __init__(self, group_key, intra: List, stage2: Callable[[], List],
                 final: Callable[[], None], comm_timer, anchor: torch.Tensor):
        self._group_key, self._intra, self._stage2, self._final = group_key, intra, stage2, final
        self._comm_timer, self._inter, self._done = comm_timer, None, False
        self._anchor = anchor

    @property
    def inter_issued(self) -> bool:
        """True once the inter-node all-to-all has been issued."""
        return self._inter is not None

    def issue_inter(self) -> None:
        """On the side stream: wait for the intra-node stage, then compress and issue the
        inter-node stage (once)."""
        if self._inter is not None:
            return
        pending = _PENDING.get(self._group_key, [])
        if self in pending:
            pending.remove(self)
        with streams.launch_stream(self._anchor):
            self._comm_timer.start()
            for w in self._intra:
                w.wait()
            self._comm_timer.stop()
            self._intra = []
            self._inter = self._stage2()

    def wait(self, timeout=None) -> bool:
        """Issue the inter-node stage if no later call did, wait for it, write the shard."""
        if not self._done:
            self.issue_inter()
            self._comm_timer.start()
            for w in self._inter:
                w.wait()
            self._comm_timer.stop()
            self._final()
            self._done = True
        return True

    def is_completed(self) -> bool:
        """True once :meth:`wait` has written the reduced shard."""
        return self._done


def forget_pending_inter_stages() -> None:
    """Drop every handle still waiting to issue its inter-node stage (``uninstall()``: a step
    interrupted before megatron waited on its buckets leaves them; their buffers go too)."""
    _PENDING.clear()


def _issue_pending(group_key) -> None:
    """Issue the inter-node stage of every pending handle of ``group_key``, oldest first."""
    for work in list(_PENDING.get(group_key, [])):
        work.issue_inter()


def hierarchical_reduce_scatter(output: torch.Tensor, input: torch.Tensor,
                                op=dist.ReduceOp.SUM, group=None, async_op: bool = False, *,
                                compensator: Optional[Compensator], key: Hashable = None,
                                layout: Optional[BucketLayout] = None,
                                stats: Optional[WireStats] = None, timers=None,
                                topology: Optional[NodeTopology] = None):
    """Two-stage LoCo reduce-scatter of ``input`` into ``output`` (module docstring).

    Same arguments, return value and handle contract as
    :func:`~loco_megatron.collectives.compensated_reduce_scatter`, plus ``topology`` (default:
    :func:`group_topology` of ``group``). With ``async_op`` the intra-node stage is launched and
    a :class:`HierarchicalWork` returned: the next call on the same group issues this bucket's
    inter-node stage (asynchronously) before its own intra-node stage, and ``wait()`` finishes.
    ``stats`` also gets ``intra_node_bytes`` and ``inter_node_bytes``. The bucket ``key``'s step
    counter schedules resets of both stage buffers and advances once per call.

    Raises:
        ValueError: an op other than SUM/AVG, sizes that do not split, a layout that does not
            fit.
        LoCoConfigError: see :func:`group_topology`.
        RuntimeError: see :func:`~loco_megatron.collectives.check_launch`.
    """
    if compensator is None:
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
    check_launch(input, "the hierarchical LoCo reduce-scatter")
    cfg = compensator.config
    topo = topology if topology is not None else group_topology(group)
    M, L = topo.num_nodes, topo.per_node
    if L == 1:  # one rank per node: every link is inter-node
        before = stats.bytes_sent if stats is not None else 0
        work = compensated_reduce_scatter(output, input, op=op, group=group, async_op=async_op,
                                          compensator=compensator, key=key, layout=layout,
                                          stats=stats, timers=timers)
        if stats is not None:
            stats.inter_node_bytes += stats.bytes_sent - before
        return work
    if dist.get_world_size(group) != M * L:
        raise ValueError(f"group size {dist.get_world_size(group)} is not the topology's "
                         f"{M} nodes x {L}")
    layout = checked_layout(output, input, op, group, cfg.block_size, layout,
                            nodes=f" ({M} nodes x {L})")
    world, n = layout.world, layout.numel
    step = compensator.step_of(key)  # the stage buffers follow the bucket's counter
    compensator.count_step(key)
    if M == 1 and cfg.intra_node_bits == 16:  # one node: the intra stage is all there is
        if stats is not None:
            sent = (world - 1) * (n // world) * input.element_size()
            stats.calls += 1
            stats.bytes_sent += sent
            stats.stock_bytes += sent
            stats.intra_node_bytes += sent
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
    group_key = group if group is not None else dist.group.WORLD
    if async_op:  # earlier buckets' inter-node stages go out before this bucket's intra stage
        _issue_pending(group_key)
    average, got = op == dist.ReduceOp.AVG, []
    rank, P, K = dist.get_rank(group), layout.padded_shard, layout.blocks_per_shard
    peers, column = topo.nodes[topo.node_of(rank)], topo.column(topo.local_of(rank))
    order = topo.stage1_order(rank)
    compress_timer, comm_timer, decompress_timer = (step_timer(timers, t) for t in TIMER_NAMES)

    inter_group = inter_node_group(group) if M > 1 else None  # its own NCCL stream

    # stage 1: intra-node all-to-all of M shards per peer, from the side stream when async
    # (streams.py: its receive buffers are read there too, by stage 2, or, with one node, on
    # the current stream after LoCoWork.wait waited for the all-to-all)
    with streams.launch_stream(input, enabled=async_op):
        compress_timer.start()
        if cfg.intra_node_bits == 16:
            send = [_reorder(layout.to_padded(input.view(-1), input.dtype), world, order)]
            units = [M * P]
        else:
            payload, scales = compensator.compress((key, INTRA), input.view(-1), layout,
                                                   bits=8, step=step)
            send = [_reorder(payload, world, order), _reorder(scales, world, order)]
            units = [M * P, M * K]  # 8-bit codes: one byte per element; K scales per shard
        compress_timer.stop()
        recv = [torch.empty(L * u, dtype=t.dtype, device=t.device) for t, u in zip(send, units)]
        comm_timer.start()
        works = [dist.all_to_all_single(r, t, output_split_sizes=_splits(peers, world, u),
                                        input_split_sizes=_splits(peers, world, u), group=group,
                                        async_op=async_op) for r, t, u in zip(recv, send, units)]
        comm_timer.stop()
    if stats is not None:
        intra = (L - 1) * sum(u * t.element_size() for t, u in zip(send, units))
        stats.calls += 1
        stats.intra_node_bytes += intra
        stats.bytes_sent += intra
        stats.stock_bytes += (world - 1) * layout.shard * input.element_size()

    def stage2():
        """Sum the intra-node stage; with 2+ nodes compress and issue the inter-node stage
        (asynchronously when ``async_op``); returns its works."""
        send.clear()  # stage 1 finished: its send buffers may go
        decompress_timer.start()
        impl = kernels.select(cfg.kernels, output)
        table_device = output.device if impl != "torch" else "cpu"
        if cfg.intra_node_bits == 16:
            partial = sum_in_rank_order(recv[0].view(L, M * P), torch.float32)
        else:
            partial = torch.empty(M * P, dtype=torch.float32, device=output.device)
            table = kernels.block_table(_intra_view(layout, column, L), table_device)
            kernels.decompress_shard(impl, recv[0], recv[1], table, 0, bits=8, average=False,
                                     out=partial)
        decompress_timer.stop()
        if M == 1:
            _write(partial, layout, rank, output, world if average else 1)
            return []
        compress_timer.start()
        payload, scales = compensator.compress((key, INTER), partial,
                                               inter_view(layout, column), step=step)
        compress_timer.stop()
        inter = [(payload, P * cfg.bits // 8), (scales, K)]
        got.extend(torch.empty(M * u, dtype=t.dtype, device=t.device) for t, u in inter)
        got.extend(t for t, _ in inter)  # the send buffers live until final() (async)
        comm_timer.start()
        works2 = [dist.all_to_all_single(r, t, output_split_sizes=_splits(column, world, u),
                                         input_split_sizes=_splits(column, world, u),
                                         group=inter_group, async_op=async_op)
                  for r, (t, u) in zip(got, inter)]
        comm_timer.stop()
        if stats is not None:
            sent = (M - 1) * sum(u * t.element_size() for t, u in inter)
            stats.inter_node_bytes += sent
            stats.bytes_sent += sent
        return [w for w in works2 if w is not None]

    def final():
        """Sum the ``M`` inter-node chunks received into the output shard."""
        if M == 1:
            return
        impl = kernels.select(cfg.kernels, output)
        table_device = output.device if impl != "torch" else "cpu"
        decompress_timer.start()
        table = kernels.block_table(_shard_layout(layout, rank, M), table_device)
        target = output if not average else torch.empty(output.numel(), dtype=torch.float32,
                                                         device=output.device)
        kernels.decompress_shard(impl, got[0], got[1], table, 0, bits=cfg.bits, average=False,
                                 out=target)
        if average:  # fp32 sum / N, one rounding to the output dtype
            target /= torch.full((), world, dtype=torch.float32, device=target.device)
            output.copy_(target)
        got.clear()
        decompress_timer.stop()

    if not async_op:
        stage2()
        final()
        return None
    if M == 1:  # no inter-node stage: finishing the intra stage is all wait() does
        return launch(works, lambda: (stage2(), final()), comm_timer, async_op)
    handle = HierarchicalWork(group_key, works, stage2, final, comm_timer, output)
    _PENDING.setdefault(group_key, []).append(handle)
    return handle


def _write(padded: torch.Tensor, layout: BucketLayout, rank: int, out: torch.Tensor,
           divisor: int) -> None:
    """``rank``'s padded shard (fp32 ``[P]``) / ``divisor`` into ``out`` through the layout."""
    if divisor != 1:
        padded = padded / torch.full((), divisor, dtype=padded.dtype, device=padded.device)
    layout.from_padded_shard(padded, rank, out)
