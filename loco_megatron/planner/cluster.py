"""Parallel layout and cluster links, and where a data-parallel group's ranks fall on nodes.

Placement assumption (megatron-core ``parallel_state``, default ``order="tp-cp-ep-dp-pp"``):
global rank = ``tp + TP * (cp + CP * (dp + DP * pp))`` -- TP fastest, then CP, then DP, then
PP -- and nodes hold ``gpus_per_node`` consecutive global ranks (torchrun/Slurm). So the dense
DP group of (tp=0, cp=0, pp=0) is ranks ``0, TP*CP, 2*TP*CP, ...``; the expert-DP group
(expert grid ``tp-ep-dp-pp`` over ETP x EP) is ranks ``0, ETP*EP, 2*ETP*EP, ...``. With
``num_distributed_optimizer_instances = I`` the DP group splits into I consecutive parts that
reduce-scatter inside themselves, followed by an all-reduce across parts.
"""

from dataclasses import dataclass
from typing import List, NamedTuple, Optional

from .errors import PlannerError

GBIT = 1e9 / 8  # bytes per second in one Gbit/s


class GroupSpread(NamedTuple):
    """A process group on nodes: ``size`` ranks on ``nodes`` nodes, at most ``per_node`` of
    them on one node (``nodes * per_node == size`` when even)."""

    size: int
    nodes: int
    per_node: int


def spread(ranks: List[int], gpus_per_node: int) -> GroupSpread:
    """Where the global ``ranks`` of one group fall on nodes of ``gpus_per_node`` GPUs."""
    counts = {}
    for r in ranks:
        counts[r // gpus_per_node] = counts.get(r // gpus_per_node, 0) + 1
    return GroupSpread(len(ranks), len(counts), max(counts.values()))


@dataclass
class ClusterSpec:
    """Nodes and links. Bandwidths are per direction, in Gbit/s; latencies in microseconds.
    Raises :class:`PlannerError` naming the flag on invalid values."""

    nodes: int
    """Number of nodes (``--nodes``)."""
    gpus_per_node: int
    """GPUs (ranks) per node (``--gpus-per-node``)."""
    intra_node_gbps: float = 2400.0
    """Bandwidth of one GPU to the others of its node (``--intra-node-gbps``; 2400 = NVLink 3,
    A100: 300 GB/s per direction)."""
    inter_node_gbps: float = 400.0
    """Bandwidth of one inter-node NIC (``--inter-node-gbps``; 400 = NDR InfiniBand)."""
    nics_per_node: Optional[int] = None
    """Inter-node NICs per node (``--nics-per-node``); None: one per GPU (rail-optimised)."""
    intra_node_latency_us: float = 5.0
    """Per-message latency alpha inside a node (``--intra-node-latency-us``)."""
    inter_node_latency_us: float = 10.0
    """Per-message latency alpha between nodes (``--inter-node-latency-us``)."""

    def __post_init__(self):
        for flag, v in (("--nodes", self.nodes), ("--gpus-per-node", self.gpus_per_node),
                        ("--nics-per-node", self.nics_per_node)):
            if v is not None and (isinstance(v, bool) or int(v) != v or v < 1):
                raise PlannerError(f"{flag} {v!r} must be a positive integer.")
        if self.nics_per_node is None:
            self.nics_per_node = self.gpus_per_node
        for flag, v in (("--intra-node-gbps", self.intra_node_gbps),
                        ("--inter-node-gbps", self.inter_node_gbps)):
            if not v > 0 or v == float("inf"):
                raise PlannerError(f"{flag} {v!r} must be a positive, finite bandwidth in Gbit/s "
                                   f"(e.g. 400 for NDR InfiniBand, 2400 for NVLink).")
        for flag, v in (("--intra-node-latency-us", self.intra_node_latency_us),
                        ("--inter-node-latency-us", self.inter_node_latency_us)):
            if not v > 0 or v == float("inf"):
                raise PlannerError(f"{flag} {v!r} must be a positive, finite latency in "
                                   f"microseconds (e.g. 5 inside a node, 10 across nodes).")

    @property
    def world(self) -> int:
        """All GPUs: ``nodes * gpus_per_node``."""
        return self.nodes * self.gpus_per_node

    @property
    def inter_bytes_per_s_per_gpu(self) -> float:
        """One GPU's share of its node's inter-node bandwidth, bytes/s
        (``inter_node_gbps * nics_per_node / gpus_per_node``): every GPU of a node
        communicates at once in data-parallel collectives (one group per TP/PP rank)."""
        return self.inter_node_gbps * GBIT * self.nics_per_node / self.gpus_per_node

    @property
    def intra_bytes_per_s(self) -> float:
        """One GPU's intra-node bandwidth, bytes/s."""
        return self.intra_node_gbps * GBIT


@dataclass
class ParallelSpec:
    """Megatron's parallel layout. DP is derived: ``world / (TP * PP * CP)``. Raises
    :class:`PlannerError` naming the flag when the sizes do not fit ``world`` or the model."""

    world: int
    """All GPUs (``nodes * gpus_per_node``)."""
    tp: int = 1
    """Tensor parallel size (``--tensor-model-parallel-size``)."""
    pp: int = 1
    """Pipeline parallel size (``--pipeline-model-parallel-size``)."""
    cp: int = 1
    """Context parallel size (``--context-parallel-size``); gradients reduce over DP x CP."""
    ep: int = 1
    """Expert parallel size (``--expert-model-parallel-size``)."""
    etp: Optional[int] = None
    """Expert tensor parallel size (``--expert-tensor-parallel-size``); None: TP."""
    instances: int = 1
    """``--num-distributed-optimizer-instances``: reduce-scatter inside DP/I ranks, then a
    full-precision all-reduce across the I instances."""
    dp: Optional[int] = None
    """``--data-parallel-size`` when given: checked against ``world / (TP * PP * CP)``."""

    def __post_init__(self):
        for flag, v in (("--tensor-model-parallel-size", self.tp),
                        ("--pipeline-model-parallel-size", self.pp),
                        ("--context-parallel-size", self.cp),
                        ("--expert-model-parallel-size", self.ep),
                        ("--expert-tensor-parallel-size", self.etp),
                        ("--num-distributed-optimizer-instances", self.instances),
                        ("--data-parallel-size", self.dp)):
            if v is not None and (isinstance(v, bool) or int(v) != v or v < 1):
                raise PlannerError(f"{flag} {v!r} must be a positive integer.")
        if self.etp is None:
            self.etp = self.tp
        mp = self.tp * self.pp * self.cp
        if self.world % mp:
            raise PlannerError(
                f"--tensor-model-parallel-size {self.tp} x --pipeline-model-parallel-size "
                f"{self.pp} x --context-parallel-size {self.cp} = {mp} does not divide the "
                f"{self.world} GPUs (--nodes x --gpus-per-node): world = TP*PP*CP*DP.")
        derived = self.world // mp
        if self.dp is not None and self.dp != derived:
            raise PlannerError(
                f"--data-parallel-size {self.dp} does not fit: {self.world} GPUs = TP {self.tp} "
                f"x PP {self.pp} x CP {self.cp} x DP gives DP {derived}; change --nodes, "
                f"--gpus-per-node or the model-parallel sizes (or drop --data-parallel-size).")
        self.dp = derived
        emp = self.etp * self.ep * self.pp
        if self.world % emp:
            raise PlannerError(
                f"--expert-model-parallel-size {self.ep} x expert TP {self.etp} x PP {self.pp} "
                f"= {emp} does not divide the {self.world} GPUs.")
        if (self.dp * self.cp) % self.instances:
            raise PlannerError(f"--num-distributed-optimizer-instances {self.instances} must "
                               f"divide the data-parallel size {self.dp * self.cp}.")

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: ``world / (ETP * EP * PP)``."""
        return self.world // (self.etp * self.ep * self.pp)

    def check_model(self, model) -> None:
        """Raise :class:`PlannerError` when the model cannot be split this way (TP must divide
        heads and query groups, EP the experts, PP the layers)."""
        if model.num_attention_heads % self.tp or model.num_query_groups % self.tp:
            raise PlannerError(
                f"--tensor-model-parallel-size {self.tp} must divide --num-attention-heads "
                f"{model.num_attention_heads} and --num-query-groups {model.num_query_groups}.")
        if model.ffn_hidden_size % self.tp:
            raise PlannerError(f"--tensor-model-parallel-size {self.tp} must divide "
                               f"--ffn-hidden-size {model.ffn_hidden_size}.")
        if model.num_layers % self.pp:
            raise PlannerError(f"--pipeline-model-parallel-size {self.pp} must divide "
                               f"--num-layers {model.num_layers} (uneven stages are not "
                               f"modelled).")
        if model.num_experts is None:
            if self.ep > 1:
                raise PlannerError(f"--expert-model-parallel-size {self.ep} needs an MoE model "
                                   f"(--num-experts).")
        elif model.num_experts % self.ep:
            raise PlannerError(f"--expert-model-parallel-size {self.ep} must divide "
                               f"--num-experts {model.num_experts}.")
        elif model.moe_ffn_hidden_size % self.etp:
            raise PlannerError(f"expert TP {self.etp} must divide --moe-ffn-hidden-size "
                               f"{model.moe_ffn_hidden_size}.")

    def dense_groups(self, gpus_per_node: int):
        """``(reduce-scatter group, cross-instance group or None)`` spreads of the dense
        gradients of the group holding global rank 0."""
        n, stride = self.dp * self.cp, self.tp
        inner = n // self.instances
        rs = spread([k * stride for k in range(inner)], gpus_per_node)
        ar = (spread([j * inner * stride for j in range(self.instances)], gpus_per_node)
              if self.instances > 1 else None)
        return rs, ar

    def expert_group(self, gpus_per_node: int) -> GroupSpread:
        """Spread of the expert-DP group holding global rank 0 (stride ETP * EP)."""
        stride = self.etp * self.ep
        return spread([k * stride for k in range(self.expert_dp)], gpus_per_node)
