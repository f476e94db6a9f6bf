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

Both stages are one ``all_to_all_single`` over the DP group itself with zero split sizes for
non-peers (no process subgroups: ``dist.new_group`` would have to be called by every rank in the
same order for each of megatron's DP groups - dense and expert, per TP/PP rank). Bytes each rank
sends per bucket: intra ``(L - 1) * M * P`` elements, inter ``(M - 1) * P`` elements at
``bits + 32 / block_size`` bits each.

Degenerate topologies: ``L == 1`` (one rank of the group per node) is exactly the flat
compensated reduce-scatter (:func:`~loco_megatron.collectives.compensated_reduce_scatter`, same
error buffer key); ``M == 1`` (the whole group inside one node) has no inter-node link, so only
the intra-node stage runs: megatron's stock reduce-scatter with ``--loco-intra-node-bits 16``,
flat compensated 8-bit with 8.
"""

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Hashable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import kernels
from .collectives import (TIMER_NAMES, WireStats, checked_layout, compensated_reduce_scatter,
                          launch, shard_only_layout, step_timer)
from .compensator import Compensator
from .config import LoCoConfigError
from .layout import BucketLayout

#: error-buffer key suffixes of the two stages: ``(bucket key, STAGE)``
INTRA, INTER = "intra", "inter"


def local_world_size() -> int:
    """Ranks per node from the launcher's ``LOCAL_WORLD_SIZE`` (torchrun sets it).

    Raises:
        LoCoConfigError: unset or not a positive integer (names --loco-hierarchical).
    """
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = 0
    if value < 1:
        raise LoCoConfigError(
            f"--loco-hierarchical needs the launcher's LOCAL_WORLD_SIZE (ranks per node), got "
            f"{raw!r}: launch with torchrun (it sets it), or export LOCAL_WORLD_SIZE (under "
            f"Slurm: $SLURM_NTASKS_PER_NODE); loco-megatron never guesses it from the GPU count.")
    return value


@dataclass(frozen=True)
class NodeTopology:
    """How one DP group's ranks fall on nodes.

    Attributes:
        ranks: global rank of each group rank.
        local_world_size: ranks per node (``LOCAL_WORLD_SIZE``).
        nodes: per node (ordered by node id), its group ranks in increasing order.
    """

    ranks: Tuple[int, ...]
    local_world_size: int
    nodes: Tuple[Tuple[int, ...], ...]

    @classmethod
    def build(cls, ranks: Sequence[int], local_world_size: int) -> "NodeTopology":
        """Group the group ranks by node ``global rank // local_world_size``.

        Raises:
            LoCoConfigError: the nodes hold different numbers of the group's ranks.
        """
        by_node = {}
        for i, g in enumerate(ranks):
            by_node.setdefault(g // local_world_size, []).append(i)
        nodes = tuple(tuple(v) for _, v in sorted(by_node.items()))
        if len({len(n) for n in nodes}) > 1:
            counts = {node: len(v) for node, v in sorted(by_node.items())}
            raise LoCoConfigError(
                f"--loco-hierarchical: the data-parallel group of global ranks {list(ranks)} "
                f"falls on nodes of LOCAL_WORLD_SIZE={local_world_size} ranks as {counts} "
                f"(node: ranks of the group); every node must hold the same number. Check "
                f"LOCAL_WORLD_SIZE, or drop --loco-hierarchical.")
        return cls(tuple(ranks), local_world_size, nodes)

    @property
    def num_nodes(self) -> int:
        """``M``: nodes the group spans."""
        return len(self.nodes)

    @property
    def per_node(self) -> int:
        """``L``: group ranks per node."""
        return len(self.nodes[0])

    def node_of(self, rank: int) -> int:
        """Node index (0..M-1) of group rank ``rank``."""
        return next(m for m, node in enumerate(self.nodes) if rank in node)

    def local_of(self, rank: int) -> int:
        """Local index (0..L-1) of group rank ``rank`` on its node."""
        return self.nodes[self.node_of(rank)].index(rank)

    def column(self, local: int) -> Tuple[int, ...]:
        """Group ranks with local index ``local``, one per node, increasing."""
        return tuple(sorted(node[local] for node in self.nodes))

    def stage1_order(self, rank: int) -> Tuple[int, ...]:
        """Shard indices in the order ``rank`` sends them in stage 1: for each node peer ``j``
        (increasing), the shards of :meth:`column` of ``j``'s local index."""
        return tuple(c for j in self.nodes[self.node_of(rank)]
                     for c in self.column(self.local_of(j)))


@lru_cache(maxsize=64)
def _topology(ranks: Tuple[int, ...], local_world_size: int) -> NodeTopology:
    return NodeTopology.build(ranks, local_world_size)


def group_topology(group=None) -> NodeTopology:
    """The :class:`NodeTopology` of process group ``group`` (default WORLD) under the current
    ``LOCAL_WORLD_SIZE`` (cached).

    Raises:
        LoCoConfigError: ``LOCAL_WORLD_SIZE`` missing or invalid, the world size not a
            multiple of it, or uneven nodes.
    """
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    lws, world = local_world_size(), dist.get_world_size()
    if world % lws:  # a last node with fewer ranks: some DP groups would look even, others not
        raise LoCoConfigError(
            f"--loco-hierarchical: {world} ranks do not fill nodes of LOCAL_WORLD_SIZE={lws} "
            f"ranks (node of a rank: global rank // LOCAL_WORLD_SIZE); every node must run the "
            f"same number of ranks. Check LOCAL_WORLD_SIZE, or drop --loco-hierarchical.")
    return _topology(ranks, lws)


@lru_cache(maxsize=256)
def _shard_layout(layout: BucketLayout, rank: int, copies: int) -> BucketLayout:
    """``copies`` chunks of ``P`` wire elements, each laid out like ``rank``'s padded shard of
    ``layout``: decompressing chunk 0 writes ``rank``'s shard through its segment table."""
    shard, ps = layout.shard, layout.padded_shard
    segs = tuple(tuple((s - rank * shard + k * shard, d - rank * ps + k * ps, n)
                       for s, d, n in layout.segments[rank]) for k in range(copies))
    return BucketLayout(copies * shard, copies, layout.block_size, ps, segs)


def _splits(peers: Sequence[int], world: int, size: int):
    members = set(peers)
    return [size if j in members else 0 for j in range(world)]


def _reorder(x: torch.Tensor, rows: int, order: Tuple[int, ...]) -> torch.Tensor:
    """Rows of ``x`` (viewed as ``[rows, -1]``) in ``order``, flat."""
    if order == tuple(range(rows)):
        return x.reshape(-1)
    index = torch.tensor(order, dtype=torch.int64, device=x.device)
    return x.reshape(rows, -1).index_select(0, index).reshape(-1)


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
    the returned handle's ``wait()`` runs the rest (the inter-node stage, synchronously).
    ``stats`` also gets ``intra_node_bytes`` and ``inter_node_bytes``. The bucket ``key``'s step
    counter schedules resets of both stage buffers and advances once per call.

    Raises:
        ValueError: an op other than SUM/AVG, sizes that do not split, a layout that does not
            fit.
        LoCoConfigError: see :func:`group_topology`.
    """
    if compensator is None:
        return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
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
    rank, P, bs = dist.get_rank(group), layout.padded_shard, cfg.block_size
    peers, column = topo.nodes[topo.node_of(rank)], topo.column(topo.local_of(rank))
    order = topo.stage1_order(rank)
    compress_timer, comm_timer, decompress_timer = (step_timer(timers, t) for t in TIMER_NAMES)

    # stage 1: intra-node all-to-all of M shards per peer
    compress_timer.start()
    if cfg.intra_node_bits == 16:
        send = [_reorder(layout.to_padded(input.view(-1), input.dtype), world, order)]
        units = [M * P]
    else:
        payload, scales = compensator.compress((key, INTRA), input.view(-1), layout, bits=8,
                                               step=step)
        send = [_reorder(payload, world, order), _reorder(scales, world, order)]
        units = [M * P, M * P // bs]  # 8-bit codes: one byte per element
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

    def finish():
        send.clear()  # stage 1 finished: its send buffers may go
        decompress_timer.start()
        impl = kernels.select(cfg.kernels, output)
        table_device = output.device if impl != "torch" else "cpu"
        if cfg.intra_node_bits == 16:
            rows = recv[0].view(L, M * P)
            partial = rows[0].to(torch.float32, copy=True)
            for k in range(1, L):  # fixed rank order
                partial += rows[k]
        else:
            partial = torch.empty(M * P, dtype=torch.float32, device=output.device)
            table = kernels.block_table(shard_only_layout(L * M * P, L, bs), table_device)
            kernels.decompress_shard(impl, recv[0], recv[1], table, 0, bits=8, average=False,
                                     out=partial)
        decompress_timer.stop()
        average = op == dist.ReduceOp.AVG
        if M == 1:
            _write(partial, layout, rank, output, world if average else 1)
            return
        compress_timer.start()
        payload, scales = compensator.compress((key, INTER), partial, None, step=step)
        compress_timer.stop()
        inter = [(payload, P * cfg.bits // 8), (scales, P // bs)]
        got = [torch.empty(M * u, dtype=t.dtype, device=t.device) for t, u in inter]
        comm_timer.start()
        for r, (t, u) in zip(got, inter):
            dist.all_to_all_single(r, t, output_split_sizes=_splits(column, world, u),
                                   input_split_sizes=_splits(column, world, u), group=group)
        comm_timer.stop()
        if stats is not None:
            sent = (M - 1) * sum(u * t.element_size() for t, u in inter)
            stats.inter_node_bytes += sent
            stats.bytes_sent += sent
        decompress_timer.start()
        table = kernels.block_table(_shard_layout(layout, rank, M), table_device)
        target = output if not average else torch.empty(output.numel(), dtype=torch.float32,
                                                         device=output.device)
        kernels.decompress_shard(impl, got[0], got[1], table, 0, bits=cfg.bits, average=False,
                                 out=target)
        if average:  # fp32 sum / N, one rounding to the output dtype
            target /= torch.full((), world, dtype=torch.float32, device=target.device)
            output.copy_(target)
        decompress_timer.stop()

    return launch(works, finish, comm_timer, async_op)


def _write(padded: torch.Tensor, layout: BucketLayout, rank: int, out: torch.Tensor,
           divisor: int) -> None:
    """``rank``'s padded shard (fp32 ``[P]``) / ``divisor`` into ``out`` through the layout."""
    if divisor != 1:
        padded = padded / torch.full((), divisor, dtype=padded.dtype, device=padded.device)
    layout.from_padded_shard(padded, rank, out)
