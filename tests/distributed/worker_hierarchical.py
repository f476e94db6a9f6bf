"""Rank workers of test_hierarchical.py (the two-stage reduce-scatter on gloo ranks)."""

import contextlib
import io

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
    flat, hier, flat_stats, hier_stats = torch.empty(shard), torch.empty(shard), WireStats(), \
        WireStats()
    compensated_reduce_scatter(flat, g, compensator=Compensator(flat_cfg), key="b", layout=lay,
                               stats=flat_stats)
    hierarchical_reduce_scatter(hier, g, compensator=Compensator(
        LoCoConfig(bits=4, block_size=BLOCK, hierarchical=True)), key="b", layout=lay,
        topology=NodeTopology.build(ranks, 1), stats=hier_stats)
    out["L1"] = (torch.equal(flat, hier),
                 hier_stats.inter_node_bytes == hier_stats.bytes_sent == flat_stats.bytes_sent > 0)
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


def gpt_worker(rank, world, steps, check_steps):
    """TP1 x DP4 tiny GPT: stock, bits16 (with --loco-hierarchical: inert) and hierarchical
    loco4 (intra 16); the loco4 run checks every bucket's reduced shard at ``check_steps``."""
    from .worker_megatron import setup, train

    setup(1, "gloo")
    out = {"stock": train("stock", True, steps, bucket_size=6000, check_steps=())}
    out["bits16"] = _train_hierarchical(16, steps, ())
    out["loco4"] = _train_hierarchical(4, steps, check_steps)
    return out


def _train_hierarchical(bits, steps, check_steps):
    import loco_megatron
    from loco_megatron.megatron import plugin
    from megatron.core import parallel_state as ps

    from .worker_megatron import build_gpt, forward_backward

    state = loco_megatron.install(LoCoConfig(bits=bits, block_size=64, hierarchical=True))
    recorder = _Recorder(state) if state.active else None
    startup = io.StringIO()
    try:
        with contextlib.redirect_stdout(startup):  # the start-up lines (rank 0 prints them)
            model, opt = build_gpt(True, 6000)
        losses, worst = [], {"shard": 0.0, "partial": 0.0}
        for step in range(steps):
            if recorder is not None:
                recorder.on = step in check_steps
            losses.append(float(forward_backward(model, opt)))
            if recorder is not None and recorder.on:
                for k, v in recorder.check(model, ps.get_data_parallel_group()).items():
                    worst[k] = max(worst[k], v)
            opt.step()
        res = {"losses": losses, "startup": [line for line in startup.getvalue().splitlines()
                                             if line.startswith("> LoCo")],
               "params": {n: p.detach().clone() for n, p in model.module.named_parameters()}}
        if state.active:
            keys = {b.loco_key for g in model.bucket_groups for b in g.buckets}
            layouts = [state.layouts[k] for k in sorted(keys)]
            res.update(worst=worst, keys=sorted(map(str, keys)),
                       error_keys=sorted(map(str, state.compensator.errors)),
                       wire=vars(state.wire).copy(), layouts=layouts,
                       error_bytes=state.compensator.error_bytes(),
                       steps=sorted(set(state.compensator.stats.steps.values())))
        return res
    finally:
        plugin.hierarchical_reduce_scatter = recorder.orig if recorder else \
            plugin.hierarchical_reduce_scatter
        loco_megatron.uninstall()


class _Recorder:
    """Records, per bucket, the raw local gradient (padded layout) and the inter-stage input
    ``h = partial + e`` with the error before and after, to check both stages against fp64."""

    def __init__(self, state):
        from loco_megatron.megatron import plugin

        self.state, self.on, self.raw, self.inter = state, False, {}, {}
        self.orig = plugin.hierarchical_reduce_scatter
        comp = state.compensator
        compress = comp.compress

        def recording(output, input, *args, key=None, layout=None, **kwargs):
            if self.on:
                self.raw[key] = layout.to_padded(input, torch.float64)
            return self.orig(output, input, *args, key=key, layout=layout, **kwargs)

        def recording_compress(key, g, layout=None, **kwargs):
            before = comp.errors.get(key)
            e_prev = before.get().double() if before is not None else 0
            result = compress(key, g, layout, **kwargs)
            if self.on and isinstance(key, tuple) and key[1] == INTER:
                self.inter[key[0]] = (g.double() + e_prev, e_prev, comp.errors[key].get().double())
            return result

        plugin.hierarchical_reduce_scatter = recording
        comp.compress = recording_compress

    def check(self, model, group):
        """``{"shard": max |result - sum h| / bound, "partial": max |h - e_prev - exact
        partial|}`` over the buckets; bound = sum over nodes of the 4-bit half step of h."""
        from loco_megatron.hierarchical import group_topology, inter_view
        from loco_megatron.kernels import block_table
        from loco_megatron.quantization import divisor

        cfg, topo = self.state.config, group_topology(group)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        local = topo.local_of(rank)
        column, peers = topo.column(local), topo.nodes[topo.node_of(rank)]
        worst = {"shard": 0.0, "partial": 0.0}
        for bg in model.bucket_groups:
            for bucket in bg.buckets:
                key, lay = bucket.loco_key, self.state.layouts[bucket.loco_key]
                P = lay.padded_shard
                raws = [torch.empty_like(self.raw[key]) for _ in range(world)]
                dist.all_gather(raws, self.raw[key], group=group)
                h, e_prev, _ = self.inter[key]
                exact_partial = torch.cat([sum(raws[j][c * P:(c + 1) * P] for j in peers)
                                           for c in column])
                worst["partial"] = max(worst["partial"],
                                       float((h - e_prev - exact_partial).abs().max()))
                # the inter stage's blocks: the column's wire shards, their blocks in order
                spans = block_table(inter_view(lay, column), "cpu").spans
                amax = torch.segment_reduce(h.float().abs(), "max", lengths=spans, unsafe=True,
                                            initial=0.0)
                half = (amax.double() / divisor(cfg.bits, cfg.grid) / 2).repeat_interleave(spans)
                hs, halves = [torch.empty_like(h) for _ in range(world)], \
                    [torch.empty_like(half) for _ in range(world)]
                dist.all_gather(hs, h, group=group)
                dist.all_gather(halves, half, group=group)
                k = column.index(rank)
                exact = sum(hs[r][k * P:(k + 1) * P] for r in column)
                bound = sum(halves[r][k * P:(k + 1) * P] for r in column)
                exp, bnd = (torch.empty(lay.shard, dtype=torch.float64) for _ in range(2))
                lay.from_padded_shard(exact, rank, exp)
                lay.from_padded_shard(bound, rank, bnd)
                got = bucket.grad_data[rank * lay.shard:(rank + 1) * lay.shard].double()
                ratio = (got - exp).abs() / (bnd * (1 + 1e-5) + 1e-7)
                worst["shard"] = max(worst["shard"], float(ratio.max()))
        return worst


def two_nodes_worker(rank, world, steps, check_steps, ckpt_jobs):
    """One spawn for test_hierarchical.py: the collective cases, the GPT modes and the
    checkpoint save jobs (worker_ckpt.py), to pay for the 4 processes' start-up once."""
    from megatron.core import parallel_state as ps

    from .worker_ckpt import ckpt_worker

    out = {"collective": collective_worker(rank, world),
           "pipeline": pipeline_worker(rank, world),
           "gpt": gpt_worker(rank, world, steps, check_steps)}
    ps.destroy_model_parallel()  # ckpt_worker initialises its own
    out["ckpt"] = ckpt_worker(rank, world, 1, ckpt_jobs)
    return out


PIPELINE_BUCKETS = 4


def pipeline_worker(rank, world):
    """Several buckets launched asynchronously, as megatron's backward hooks do, then waited in
    order: the order in which this rank issued its all-to-alls and waits (``("intra" | "inter",
    bucket)`` / ``("wait", bucket)``), and whether outputs and both stages' error buffers equal a
    synchronous run's bit for bit, over 2 steps, for 16- and 8-bit intra-node stages."""
    lay, shard = layout(world), NUMEL // world
    topo = NodeTopology.build(list(range(world)), 2)
    peers = set(topo.nodes[topo.node_of(rank)])
    out = {}
    for intra in (16, 8):
        cfg = LoCoConfig(bits=4, block_size=BLOCK, hierarchical=True, intra_node_bits=intra)
        runs = {}
        for mode in ("sync", "async"):
            comp, events, seen = Compensator(cfg), [], {"intra": 0, "inter": 0}
            orig = dist.all_to_all_single

            def recording(output, input, output_split_sizes=None, input_split_sizes=None,
                          **kwargs):
                to = {j for j, n in enumerate(input_split_sizes) if n}
                stage = "intra" if to <= peers else "inter"
                events.append((stage, seen[stage] // (2 if stage == "inter" or intra == 8
                                                        else 1) % PIPELINE_BUCKETS))
                seen[stage] += 1
                return orig(output, input, output_split_sizes, input_split_sizes, **kwargs)

            dist.all_to_all_single = recording
            try:
                outputs = []
                for step in range(2):
                    works, outs = [], []
                    for b in range(PIPELINE_BUCKETS):
                        o = torch.empty(shard)
                        works.append(hierarchical_reduce_scatter(
                            o, grad(rank, 10 * step + b), async_op=mode == "async",
                            compensator=comp, key=f"b{b}", layout=lay, topology=topo))
                        outs.append(o)
                    for b, w in enumerate(works):
                        events.append(("wait", b))
                        if w is not None:
                            w.wait()
                    outputs.append(outs)
            finally:
                dist.all_to_all_single = orig
            runs[mode] = {"outputs": outputs, "events": events[:len(events) // 2],
                          "errors": {k: {n: t.clone() for n, t in buf.tensors().items()}
                                     for k, buf in comp.errors.items()}}
        same = (all(torch.equal(a, b) for s, t in zip(runs["sync"]["outputs"],
                                                      runs["async"]["outputs"])
                    for a, b in zip(s, t))
                and runs["sync"]["errors"].keys() == runs["async"]["errors"].keys()
                and all(torch.equal(runs["sync"]["errors"][k][n], t)
                        for k, fields in runs["async"]["errors"].items()
                        for n, t in fields.items()))
        out[intra] = {"events": runs["async"]["events"], "same": same,
                      "stages": sorted({str(k[1]) for k in runs["async"]["errors"]})}
    return out


def one_node_worker(rank, world, steps):
    """The whole DP group on one node (LOCAL_WORLD_SIZE = world), 16 intra-node bits, overlap
    on: the intra-node stage is megatron's stock reduce-scatter, issued inside megatron's
    ``_coalescing_manager``. Returns stock's and hierarchical LoCo's losses and parameters."""
    from .worker_megatron import setup, train

    setup(1, "gloo")
    out = {"stock": train("stock", True, steps, bucket_size=6000, check_steps=())}
    res = _train_hierarchical(4, steps, ())
    out["hier"] = {"losses": res["losses"], "params": res["params"], "startup": res["startup"]}
    return out
