"""Which node each rank of a data-parallel group is on, for ``--loco-hierarchical``.

Nodes come from the launcher's ``LOCAL_WORLD_SIZE`` (node of global rank ``g``:
``g // LOCAL_WORLD_SIZE``; torchrun and Slurm place ranks contiguously per node); the group's
ranks are grouped by node (:class:`NodeTopology`), ``M`` nodes x ``L`` ranks, used by
:mod:`loco_megatron.hierarchical` and the start-up lines.
"""

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence, Tuple

import torch.distributed as dist

from .config import LoCoConfigError


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


#: DP group -> a second process group over the same ranks for the inter-node stage
_INTER_GROUPS: dict = {}


def inter_node_group(group=None):
    """A process group over ``group``'s ranks (default WORLD), same backend, for the
    hierarchical inter-node stage (cached per group): with NCCL every process group has its own
    stream, so a bucket's intra-node all-to-all never queues behind the previous bucket's
    inter-node transfer on a shared stream (docs/hierarchical.md, "Streams").

    Collective over ``group``'s ranks only (``use_local_synchronization``): every rank of the
    group calls it at its first hierarchical reduce-scatter on that group, in bucket order, or
    earlier (``loco_megatron.megatron.plugin`` at the DDP wrap).
    """
    group = group if group is not None else dist.group.WORLD
    inter = _INTER_GROUPS.get(group)
    if inter is None:
        ranks = dist.get_process_group_ranks(group)
        inter = _INTER_GROUPS[group] = dist.new_group(
            ranks=ranks, backend=dist.get_backend(group), use_local_synchronization=True)
    return inter
