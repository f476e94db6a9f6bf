"""Rank workers of tests/test_hierarchical.py (the two-stage reduce-scatter on gloo ranks)."""

import torch
import torch.distributed as dist

from loco_megatron import LoCoConfig
from loco_megatron.collectives import WireStats, compensated_reduce_scatter
from loco_megatron.compensator import Compensator
from loco_megatron.hierarchical import INTER, INTRA, NodeTopology, hierarchical_reduce_scatter
from loco_megatron.layout import BucketLayout

NUMEL, BLOCK, BOUNDS = 4 * 301, 32, (100, 555, 900)  # odd shard, parameter cuts mid-shard


def layout(world: int) -> BucketLayout:
    """The test bucket's layout (blocks cut at shards and at :data:`BOUNDS`)."""
    return BucketLayout.build(NUMEL, world, BLOCK, BOUNDS)


def grad(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s fp32 gradient at ``step``: scales differing by rank and position."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ramp = torch.linspace(0.1, 3.0, NUMEL)
    return (torch.randn(NUMEL, generator=gen) * ramp * (1 + rank)).float()


def _errors(comp: Compensator, key):
    return {stage: comp.errors[(key, stage)].get().clone()
            for stage in (INTRA, INTER) if (key, stage) in comp.errors}


def collective_worker(rank, world):
    """Every case on one spawn; returns per case what the parent checks against fp64."""
    lay = layout(world)
    shard = NUMEL // world
    out = {}
    for intra in (16, 8):
        for op in ("sum", "avg"):
            cfg = LoCoConfig(bits=4, block_size=BLOCK, hierarchical=True, intra_node_bits=intra,
                             beta=0.0, error_dtype="fp32")
            comp, stats = Compensator(cfg), WireStats()
            results = []
            for step in range(2):
                g = grad(rank, step)
                o = torch.empty(shard)
                work = hierarchical_reduce_scatter(
                    o, g, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG,
                    async_op=step == 1, compensator=comp, key="b", layout=lay, stats=stats)
                if work is not None:
                    work.wait()
                results.append({"out": o, "errors": _errors(comp, "b")})
            out[(intra, op)] = {"steps": results, "stats": vars(stats).copy(),
                                "counter": comp.stats.steps.get("b")}
    # degenerate topologies, given explicitly: L == 1 (4 nodes x 1) is the flat collective
    ranks = list(range(world))
    flat_cfg = LoCoConfig(bits=4, block_size=BLOCK)
    g = grad(rank, 0)
    flat, hier = torch.empty(shard), torch.empty(shard)
    compensated_reduce_scatter(flat, g, compensator=Compensator(flat_cfg), key="b", layout=lay)
    hierarchical_reduce_scatter(hier, g, compensator=Compensator(
        LoCoConfig(bits=4, block_size=BLOCK, hierarchical=True)), key="b", layout=lay,
        topology=NodeTopology.build(ranks, 1))
    out["L1"] = torch.equal(flat, hier)
    # M == 1 (one node of 4): full precision = the stock reduce-scatter; 8 bits = flat 8-bit
    stock, one16, one8 = torch.empty(shard), torch.empty(shard), torch.empty(shard)
    dist.reduce_scatter_tensor(stock, g)
    one_node = NodeTopology.build(ranks, world)
    stats16 = WireStats()
    hierarchical_reduce_scatter(one16, g, compensator=Compensator(
        LoCoConfig(bits=4, block_size=BLOCK, hierarchical=True)), key="b", layout=lay,
        topology=one_node, stats=stats16)
    comp8 = Compensator(LoCoConfig(bits=4, block_size=BLOCK, hierarchical=True,
                                   intra_node_bits=8))
    hierarchical_reduce_scatter(one8, g, compensator=comp8, key="b", layout=lay,
                                topology=one_node)
    flat8 = torch.empty(shard)
    compensated_reduce_scatter(flat8, g, compensator=Compensator(
        LoCoConfig(bits=8, block_size=BLOCK)), key="b", layout=lay)
    out["M1"] = {"stock_equal": torch.equal(stock, one16), "stats16": vars(stats16).copy(),
                 "flat8_diff": float((one8 - flat8).abs().max()),
                 "stage_keys": sorted(str(k) for k in comp8.errors)}
    return out
