"""The hierarchical mode (--loco-hierarchical): collective, megatron GPT, config (docs/architecture.md).

Four gloo ranks with LOCAL_WORLD_SIZE=2 emulate 2 nodes x 2 ranks. References are exact fp64
reductions of what every rank holds; bounds are the quantizers' half steps.
"""

import pytest
import torch

from loco_megatron import LoCoConfig, LoCoConfigError
from loco_megatron.hierarchical import NodeTopology, local_world_size

from tests.helpers.blocks import block_absmax, roundtrip, shard_spans
from tests.helpers.multiproc import run_ranks
from .test_checkpoint import FORMATS, _assert_resumed_exactly, _load, _save_jobs
from .worker_ckpt import ckpt_worker
from .worker_hierarchical import (PIPELINE_BUCKETS, BLOCK, grad, layout, one_node_worker,
                                  two_nodes_worker)

WORLD, LOCAL = 4, 2
NODES = [[0, 1], [2, 3]]
GPT_STEPS, GPT_CHECKS = 6, (0, 4)
HIER_CKPT = dict(bits=4, block_size=64, reset_interval=3, hierarchical=True, intra_node_bits=8)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """One 4-rank spawn (2 nodes x 2): collective cases, GPT modes, checkpoint saves."""
    d = str(tmp_path_factory.mktemp("hier_ckpt"))
    results = run_ranks(two_nodes_worker, WORLD, GPT_STEPS, GPT_CHECKS, _save_jobs(d, HIER_CKPT),
                        local_world_size=LOCAL)
    return {"dir": d, "ranks": results}


@pytest.fixture(scope="module")
def collective(two_nodes):
    return [r["collective"] for r in two_nodes["ranks"]]


@pytest.mark.parametrize("intra", [16, 8])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_collective_within_bound_of_exact(collective, intra, op):
    """Step 0 (zero error buffers): |result - exact| <= sum over nodes of the 4-bit half step of
    the node's partial sum (+ the 8-bit half steps of the intra stage, when used)."""
    lay = layout(WORLD)
    P = lay.padded_shard
    G = [lay.to_padded(grad(r, 0).double(), torch.float64) for r in range(WORLD)]
    for s in range(WORLD):
        rows, spans = slice(s * P, (s + 1) * P), shard_spans(lay, s)
        exact = sum(g[rows] for g in G)
        bound = torch.zeros(P, dtype=torch.float64)
        for node in NODES:
            partial = sum(G[r][rows] for r in node)
            intra_err = (sum(block_absmax(G[r][rows], spans) / 127 / 2 for r in node)
                         if intra == 8 else torch.zeros(P, dtype=torch.float64))
            worst_intra = block_absmax(intra_err, spans)
            bound += intra_err + (block_absmax(partial, spans) + worst_intra) / 7 / 2
        bound += 1e-5 * sum(g[rows].abs() for g in G) + 1e-6  # fp32 sums
        if op == "avg":
            exact, bound = exact / WORLD, bound / WORLD
        exp, bnd = torch.empty(lay.shard, dtype=torch.float64), torch.empty(lay.shard,
                                                                            dtype=torch.float64)
        lay.from_padded_shard(exact, s, exp)
        lay.from_padded_shard(bound, s, bnd)
        got = collective[s][(intra, op)]["steps"][0]["out"].double()
        assert ((got - exp).abs() <= bnd).all(), float(((got - exp).abs() / bnd).max())
        assert ((got - exp).abs() > 0).any()  # really quantized


@pytest.mark.parametrize("intra", [16, 8])
def test_wire_bytes_exact(collective, intra):
    """Inter-node bytes per rank = (M-1) peers x (P codes at 4 bits + K scales); intra-node:
    (L-1) peers x M shards in the stage's format (P fp32, or P 8-bit codes + K scales), for a
    wire shard of P elements and K blocks (the largest shard's)."""
    lay = layout(WORLD)
    P, K, M, L, bits = lay.padded_shard, lay.blocks_per_shard, len(NODES), LOCAL, 4
    # by hand: shards of 301 elements cut at 100, 555, 900: segments 100 + 201, 254 + 47,
    # 298 + 3, 301; codes (odd segments + 1) 302 each; blocks of 32: 4 + 7, 8 + 2, 10 + 1, 10
    assert (P, K) == (302, 11)
    inter = (M - 1) * (P * bits // 8 + 4 * K)
    intra_bytes = (L - 1) * M * (4 * P if intra == 16 else P + 4 * K)
    for rank in range(WORLD):
        stats = collective[rank][(intra, "sum")]["stats"]
        assert stats["calls"] == 2
        assert stats["inter_node_bytes"] == 2 * inter
        assert stats["intra_node_bytes"] == 2 * intra_bytes
        assert stats["bytes_sent"] == stats["inter_node_bytes"] + stats["intra_node_bytes"]
        assert stats["stock_bytes"] == 2 * (WORLD - 1) * lay.shard * 4
        assert collective[rank][(intra, "sum")]["counter"] == 2  # the bucket's step counter


def test_inter_stage_error_identity(collective):
    """beta=0, fp32 error storage, intra at full precision: the inter-node buffer holds
    e = h - deQ(Q(h)) exactly, with h = this rank's partial sums (+ the previous e), and each
    shard is sum over nodes of deQ(c) = h - e, within fp32 rounding, over two steps."""
    lay = layout(WORLD)
    P = lay.padded_shard
    for op in ("sum", "avg"):
        h = {}
        for step in range(2):
            G = [lay.to_padded(grad(r, step), torch.float32) for r in range(WORLD)]
            for rank in range(WORLD):
                node = next(nd for nd in NODES if rank in nd)
                local = node.index(rank)
                column = [nd[local] for nd in NODES]
                partial = torch.cat([G[node[0]][c * P:(c + 1) * P] + G[node[1]][c * P:(c + 1) * P]
                                     for c in column])
                prev = collective[rank][(16, op)]["steps"][step - 1]["errors"]["inter"] \
                    if step else 0
                h[rank] = partial + prev
                spans = torch.cat([shard_spans(lay, c) for c in column])
                expected = h[rank] - roundtrip(h[rank], spans, 4)
                got = collective[rank][(16, op)]["steps"][step]["errors"]["inter"]
                assert torch.equal(got, expected), (op, step, rank)
            for s in range(WORLD):
                local = next(nd for nd in NODES if s in nd).index(s)
                column = [nd[local] for nd in NODES]
                k = column.index(s)
                total = sum((h[r] - collective[r][(16, op)]["steps"][step]["errors"]["inter"])
                            [k * P:(k + 1) * P].double() for r in column)
                if op == "avg":
                    total = total / WORLD
                exp = torch.empty(lay.shard, dtype=torch.float64)
                lay.from_padded_shard(total, s, exp)
                got = collective[s][(16, op)]["steps"][step]["out"].double()
                assert torch.allclose(got, exp, rtol=1e-5, atol=1e-5), (op, step, s)


def test_degenerate_topologies(collective):
    """L == 1 is the flat collective bit for bit; M == 1 at 16 bits is the stock reduce-scatter,
    at 8 bits the flat 8-bit collective (intra-stage buffer only)."""
    for rank in range(WORLD):
        assert collective[rank]["L1"] == (True, True)
        m1 = collective[rank]["M1"]
        assert m1["stock_equal"]
        assert m1["stats16"]["inter_node_bytes"] == 0 and m1["stats16"]["intra_node_bytes"] > 0
        assert m1["flat8_diff"] == 0.0
        assert m1["stage_keys"] == ["('b', 'intra')"]


def test_topology_from_group_ranks():
    """Nodes from global rank // LOCAL_WORLD_SIZE over the group's ranks (TP2 x DP4 on 2 nodes
    of 4: DP group [0, 2, 4, 6] is 2 nodes x 2); uneven nodes refused."""
    topo = NodeTopology.build([0, 2, 4, 6], 4)
    assert (topo.num_nodes, topo.per_node) == (2, 2)
    assert topo.column(1) == (1, 3) and topo.stage1_order(0) == (0, 2, 1, 3)
    assert NodeTopology.build([0, 1, 2, 3], 1).per_node == 1
    with pytest.raises(LoCoConfigError, match="--loco-hierarchical.*same number"):
        NodeTopology.build([0, 1, 2, 4], 3)


@pytest.mark.parametrize("value", [None, "", "zero", "0", "-2"])
def test_local_world_size_missing_or_invalid(monkeypatch, value):
    """Refused by the collective and at start-up (check_megatron_args), naming the flag."""
    import argparse

    from loco_megatron.cli.preflight import check_megatron_args

    if value is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(LoCoConfigError, match="--loco-hierarchical.*LOCAL_WORLD_SIZE"):
        local_world_size()
    args = argparse.Namespace(use_distributed_optimizer=True)
    with pytest.raises(LoCoConfigError, match="--loco-hierarchical.*LOCAL_WORLD_SIZE"):
        check_megatron_args(args, LoCoConfig(bits=4, hierarchical=True))
    check_megatron_args(args, LoCoConfig(bits=4))  # flat LoCo does not need it
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert local_world_size() == 8


def test_config_flags_and_yaml(tmp_path):
    from loco_megatron.cli.flags import (add_loco_args, config_from_args,
                                                  explicit_loco_flags)
    from loco_megatron.cli.yaml_config import config_to_argv, loco_section_to_fields
    import argparse

    cfg = LoCoConfig(bits=4, hierarchical=True, intra_node_bits=8)
    assert cfg.hierarchical and cfg.intra_node_bits == 8
    with pytest.raises(LoCoConfigError, match="--loco-intra-node-bits 4"):
        LoCoConfig(bits=4, hierarchical=True, intra_node_bits=4)
    with pytest.raises(LoCoConfigError, match="--loco-intra-node-bits 8.*--loco-hierarchical"):
        LoCoConfig(bits=4, intra_node_bits=8)
    with pytest.raises(LoCoConfigError, match="--loco-hierarchical takes no value"):
        LoCoConfig(bits=4, hierarchical="yes")
    parser = add_loco_args(argparse.ArgumentParser())
    args = parser.parse_args(["--loco-bits", "4", "--loco-hierarchical",
                              "--loco-intra-node-bits", "8"])
    assert config_from_args(args) == cfg
    assert config_from_args(parser.parse_args(["--loco-bits", "4"])).hierarchical is False
    assert explicit_loco_flags(["--loco-hierarchical", "--loco-intra-node-bits", "8"]) == {
        "hierarchical": True, "intra_node_bits": 8}
    # the command line switches off what a --config file switched on
    assert explicit_loco_flags(["--loco-hierarchical", "--no-loco-hierarchical"]) == {
        "hierarchical": False}
    assert parser.parse_args(["--loco-hierarchical", "--no-loco-hierarchical"]) \
        .loco_hierarchical is False
    assert loco_section_to_fields({"hierarchical": True, "intra-node-bits": 8}, "f") == {
        "hierarchical": True, "intra_node_bits": 8}
    with pytest.raises(LoCoConfigError, match="loco.hierarchical.*--loco-hierarchical"):
        loco_section_to_fields({"hierarchical": "false"}, "f")
    path = tmp_path / "c.yaml"
    path.write_text("loco:\n  bits: 4\n  hierarchical: true\n  intra_node_bits: 8\n")
    assert config_to_argv(str(path)) == ["--loco-bits", "4", "--loco-hierarchical",
                                         "--loco-intra-node-bits", "8"]
    path.write_text("loco:\n  bits: 4\n  hierarchical: false\n")
    assert config_to_argv(str(path)) == ["--loco-bits", "4"]
    # Megatron-LM --yaml-cfg: the loco section of the replaced namespace
    ns = argparse.Namespace(yaml_cfg="y.yaml", loco={"bits": 4, "hierarchical": True})
    assert config_from_args(ns, argv=[]).hierarchical


def test_megatron_gpt_two_nodes(two_nodes):
    """TP1 x DP4 as 2 nodes x 2 ranks: bits 16 (with --loco-hierarchical) is stock bit for bit;
    hierarchical 4-bit trains, reduces every shard within the inter stage's bound, sums the
    intra stage at full precision, keeps an inter-stage buffer per bucket and sends exactly
    the expected bytes on each kind of link."""
    from loco_megatron.accounting import (stage_error_elements,
                                                  hierarchical_bytes_per_step)

    steps, results = GPT_STEPS, [r["gpt"] for r in two_nodes["ranks"]]
    cfg = LoCoConfig(bits=4, block_size=64, hierarchical=True)
    for res in results:
        stock, bits16, loco4 = res["stock"], res["bits16"], res["loco4"]
        assert bits16["losses"] == stock["losses"]
        assert all(torch.equal(bits16["params"][n], p) for n, p in stock["params"].items())
        losses = loco4["losses"]
        assert losses[-1] < losses[0] - 0.05, losses
        assert loco4["worst"]["shard"] <= 1.0, loco4["worst"]
        assert loco4["worst"]["partial"] <= 1e-6, loco4["worst"]
        assert loco4["error_keys"] == sorted(str((eval(k), "inter")) for k in loco4["keys"])
        assert loco4["steps"] == [steps]
        intra, inter = hierarchical_bytes_per_step(
            cfg, 2, 2, [(lay, 4) for lay in loco4["layouts"]])  # fp32 grad buffers
        wire = loco4["wire"]
        assert wire["intra_node_bytes"] == steps * intra
        assert wire["inter_node_bytes"] == steps * inter
        assert wire["intra_node_bytes"] == steps * sum(2 * lay.padded_shard * 4
                                                        for lay in loco4["layouts"])
        assert wire["calls"] == steps * len(loco4["layouts"])
        elements = sum(stage_error_elements(cfg, 2, 2, lay) for lay in loco4["layouts"])
        blocks = sum(2 * lay.blocks_per_shard for lay in loco4["layouts"])  # M=2 shards each
        assert loco4["error_bytes"] == elements + 4 * blocks  # int8 + scales of the inter stage
    # start-up lines (rank 0): the real two-stage figures, printed once, on the buffer line and
    # the chunk's totals; the topology line names nodes x ranks and the stages' error state
    lines = results[0]["loco4"]["startup"]
    real = f"{intra + inter} bytes/step per rank on the wire vs "
    buffer = [line for line in lines if "dense gradient buffer 0" in line]
    assert len(buffer) == 1 and "compressed at 4 bits (hierarchical): " + real in buffer[0], lines
    assert buffer[0].endswith(f"; {intra} intra-node + {inter} inter-node"), buffer[0]
    total = [line for line in lines if line.startswith("> LoCo: model chunk 0: ")]
    assert len(total) == 1 and real in total[0] and "hierarchical: " in total[0], lines
    topology = [line for line in lines if line.startswith("> LoCo hierarchical: ")]
    assert len(topology) == 1 and "2 nodes x 2 ranks" in topology[0], lines
    assert "bytes/step" not in topology[0] and f"error state {loco4['error_bytes']} " in topology[0]
    assert sum(line.count(real) for line in lines) == 2  # buffer line and chunk total only


def test_checkpoint_resume_bit_identical_and_topology_change(two_nodes):
    """2 nodes x 2 ranks, intra 8 bits (both stage buffers): save after N steps, resume in new
    processes (torch and torch_dist) bit-identical to the straight run; loading into flat LoCo
    (a topology change) resets the errors with one warning."""
    d = two_nodes["dir"]
    loads = run_ranks(ckpt_worker, WORLD, 1, [_load(d, f, HIER_CKPT) for f in FORMATS] + [
        _load(d, "torch", dict(bits=4, block_size=64, reset_interval=3), steps=1)],
        local_world_size=LOCAL)
    for rank in range(WORLD):
        straight, first = two_nodes["ranks"][rank]["ckpt"]
        stages = {str(k[1]) for k in straight["errors"]}
        assert stages == {"intra", "inter"}, straight["errors"].keys()
        for i in range(len(FORMATS)):
            _assert_resumed_exactly(straight, first, loads[rank][i])
        flat = loads[rank][-1]
        assert all(not e["decoded"].any() for e in flat["errors_after_load"].values())
        logs = flat["logs"]
        assert len(logs) == (1 if rank == 0 else 0), logs
        assert all("topology changed 2 nodes x 2 ranks, intra-node 8 bits -> flat" in m
                   for m in logs)


@pytest.mark.parametrize("intra", [16, 8])
def test_inter_node_stage_issued_before_its_wait(two_nodes, intra):
    """Asynchronous buckets (megatron's overlapped backward hooks): bucket k's inter-node
    all-to-all is issued by bucket k+1's call, right before bucket k+1's intra-node stage, so the
    slow link overlaps the rest of the backward pass; only the last bucket's goes out in its own
    wait(). Outputs and both stages' error buffers equal the synchronous run's bit for bit."""
    last = PIPELINE_BUCKETS - 1
    for rank in two_nodes["ranks"]:
        res = rank["pipeline"][intra]
        assert res["same"], intra
        assert res["stages"] == (["inter", "intra"] if intra == 8 else ["inter"])
        events = list(dict.fromkeys(res["events"]))  # first occurrence of each (stage, bucket)
        expected = [("intra", 0)]
        for b in range(1, PIPELINE_BUCKETS):
            expected += [("inter", b - 1), ("intra", b)]
        expected += [("wait", 0)] + [("wait", b) for b in range(1, last)] + [("wait", last),
                                                                              ("inter", last)]
        assert events == expected, events


def test_one_node_with_overlap_is_stock():
    """4 ranks on one node (LOCAL_WORLD_SIZE=4), 16 intra-node bits, overlap on: nothing
    crosses nodes, so megatron's stock reduce-scatter runs (issued inside megatron's coalescing
    manager, whose handle LoCo keeps): losses and parameters equal stock's bit for bit."""
    results = run_ranks(one_node_worker, WORLD, 3, local_world_size=WORLD)
    for res in results:
        assert res["hier"]["losses"] == res["stock"]["losses"]
        assert all(torch.equal(p, res["hier"]["params"][n])
                   for n, p in res["stock"]["params"].items())
    assert any("one node, no inter-node link" in line
               for line in results[0]["hier"]["startup"]), results[0]["hier"]["startup"]
