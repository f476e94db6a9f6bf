"""The planner (loco_megatron/planner, ``python -m loco_megatron plan``): megatron's real bucket
layout, exact bytes against LoCo's own formulas, alpha-beta formulas against hand-derived values,
monotonicity, the CLI and its refusals, and the committed validation table."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from loco_megatron.cli.command import main
from loco_megatron.config import LoCoConfig
from loco_megatron.layout import BucketLayout
from loco_megatron.accounting import hierarchical_bytes_per_step
from loco_megatron.planner import costs
from loco_megatron.planner.buckets import buffer_buckets, gpu_buckets
from loco_megatron.planner.cluster import GBIT, ClusterSpec, GroupSpread, ParallelSpec
from loco_megatron.planner.model import ModelSpec
from loco_megatron.planner.predict import PlanOptions, plan

REPO = Path(__file__).resolve().parent.parent.parent
LLAMA = ["plan", "--config", str(REPO / "configs/llama2_7b.yaml")]
#: benchmarks/wire_bytes.py's tiny LLaMA-style GPT (odd sizes: megatron pads starts and ends)
TINY = dict(num_layers=2, hidden_size=72, ffn_hidden_size=200, num_attention_heads=4,
            vocab_size=131, seq_length=16)


def tiny_spec(**kw):
    return ModelSpec(**TINY, make_vocab_size_divisible_by=1, swiglu=True,
                     normalization="RMSNorm", add_bias_linear=False,
                     position_embedding_type="rope",
                     untie_embeddings_and_output_weights=True, **kw)


def test_buckets_are_megatrons_real_layout():
    """megatron-core's DistributedDataParallel (meta device) builds the same buckets, cut at the
    same parameter ranges, for several DP sizes and bucket sizes."""
    from benchmarks import wire_bytes as wb

    spec = tiny_spec()
    with wb.single_process_megatron():
        for dp, size in ((4, 20000), (3, 9000), (8, None)):
            cfg, meta = wb.build_meta_gpt(**TINY)
            real = wb.megatron_buckets(cfg, meta, dp, bucket_size=size,
                                       overlap_grad_reduce=size is not None)
            got = buffer_buckets(spec.stage_params(1, 1, 0), dp, size)
            assert got == [(b["numel"], tuple(map(tuple, b["ranges"]))) for b in real]


def test_published_parameter_counts():
    import yaml

    llama = ModelSpec.from_flags(yaml.safe_load(open(REPO / "configs/llama2_7b.yaml")))
    assert llama.total_params() == 6_738_415_616  # benchmarks/wire_bytes.py LLAMA2_7B_PARAMS
    mixtral = ModelSpec.from_flags(yaml.safe_load(open(REPO / "configs/mixtral_8x7b.yaml")))
    assert round(mixtral.total_params() / 1e8) == 467  # 46.7e9 (configs/mixtral_8x7b.yaml)
    assert round(mixtral.active_params() / 1e8) == 127  # 12.9e9 with the input embeddings
    # FLOPs per token: 6 N_active + 12 L H Q S (PaLM App. B)
    assert llama.flops_per_token() == 6 * llama.active_params() + 12 * 32 * 32 * 128 * 4096


def _one_bucket_plan(dp, nodes, gpus, **opt):
    c = ClusterSpec(nodes, gpus, 100.0, 10.0, None, 5.0, 10.0)
    return plan(tiny_spec(), ParallelSpec(nodes * gpus), c,
                PlanOptions(overlap_grad_reduce=False, compute_ms=100.0, **opt))


def test_bytes_are_locos_own_formulas():
    """One bucket (no overlap): bytes equal BucketLayout + quantization.wire_bytes by hand and
    the hierarchical telemetry formula; error memory n + 4 n / block (int8)."""
    p = _one_bucket_plan(8, 2, 4)
    v = {r["name"]: r for r in p["variants"]}
    params = tiny_spec().stage_params(1, 1, 0)
    bounds, start = [], 0
    for prm in reversed(params):  # megatron: reverse order, starts padded to 64
        start = -(-start // 64) * 64
        bounds += [start, start + prm.numel]
        start += prm.numel
    numel = -(-start // math.lcm(8, 128)) * math.lcm(8, 128)
    lay = BucketLayout.build(numel, 8, 256, bounds)
    P, K = lay.padded_shard, lay.blocks_per_shard
    assert v["stock fp32"]["grad_bytes_sent"] == 7 * (numel // 8) * 4
    assert v["stock bf16"]["grad_bytes_sent"] == 7 * (numel // 8) * 2
    assert v["stock fp32"]["cross_node_bytes_per_gpu"] == pytest.approx(7 * (numel // 8) * 4 / 4)
    for bits in (4, 8):
        flat = v[f"LoCo {bits}-bit flat"]
        assert flat["grad_bytes_sent"] == 7 * (P * bits // 8 + 4 * K)
        assert flat["error_buffer_bytes"] == 8 * P + 4 * 8 * K
        # DP 8 = 2 nodes x 4: intra (L-1) M P fp32 elements, inter (M-1) codes of P elements
        h16 = v[f"LoCo {bits}-bit hier. intra 16"]
        assert h16["intra_node_bytes"] == 3 * 2 * P * 4
        assert h16["inter_node_bytes"] == 1 * (P * bits // 8 + 4 * K)
        # what leaves the node per GPU: a ring's boundary load shared by L = 4 GPUs; an
        # all-to-all's 4 remote peers of 7; the hierarchical inter-node stage
        assert flat["cross_node_bytes_per_gpu"] == pytest.approx(flat["grad_bytes_sent"] * 4 / 7)
        assert h16["cross_node_bytes_per_gpu"] == h16["inter_node_bytes"]
        h8 = v[f"LoCo {bits}-bit hier. intra 8"]
        cfg = LoCoConfig(bits=bits, hierarchical=True, intra_node_bits=8)
        assert (h8["intra_node_bytes"], h8["inter_node_bytes"]) == \
            hierarchical_bytes_per_step(cfg, 2, 4, [(lay, 4)])


def test_transient_memory_is_the_memory_formula():
    from benchmarks.memory_formula import loco_memory_formula

    p = _one_bucket_plan(4, 2, 2)
    b = gpu_buckets(tiny_spec().stage_params(1, 1, 0), GroupSpread(4, 2, 2), None, None)[0]
    f = loco_memory_formula(b.layout(256), 4, 4, 256, impl="fused", device="cuda")
    row = next(r for r in p["variants"] if r["name"] == "LoCo 4-bit flat")
    assert row["transient_wire_bytes_largest_bucket"] == f["phase_bytes"]["all-to-all"]
    assert row["error_buffer_bytes"] == f["persistent"]


def test_alpha_beta_formulas_by_hand():
    a, bw = 7e-6, 3e9
    assert costs.ring_time(4, 3 / 4 * 1e6, a, bw) == pytest.approx(3 * a + 0.75e6 / bw, rel=1e-12)
    assert costs.ring_allreduce_time(4, 3e5, a, bw) == pytest.approx(2 * (3 * a + 3e5 / bw),
                                                                     rel=1e-12)
    assert costs.ring_time(1, 1e6, a, bw) == 0.0
    c = ClusterSpec(2, 4, intra_node_gbps=800.0, inter_node_gbps=100.0, nics_per_node=2,
                    intra_node_latency_us=2.0, inter_node_latency_us=9.0)
    b_gpu, b_in = 100 * GBIT * 2 / 4, 800 * GBIT
    # ring over 8 ranks = 2 nodes x 4: the node boundary (4 GPUs' NIC share) or NVLink
    g = GroupSpread(8, 2, 4)
    assert costs.ring_collective(g, c, 7e6) == pytest.approx(
        7 * 9e-6 + 7e6 / min(4 * b_gpu, b_in), rel=1e-12)
    # pairwise all-to-all: 4 of 7 peers on the other node (own NIC share), 3 on this one
    assert costs.alltoall_time(g, c, 7e6) == pytest.approx(
        7 * 9e-6 + max(4e6 / b_gpu, 3e6 / b_in), rel=1e-12)
    # inside one node: intra-node alpha and bandwidth
    assert costs.alltoall_time(GroupSpread(4, 1, 4), c, 3e6) == pytest.approx(
        3 * 2e-6 + 3e6 / b_in, rel=1e-12)


def test_overlap_queues_by_hand():
    # ready 1, 2, 3 s; 2 s each; window 3 s: ends 3, 5, 7 -> 4 s exposed
    assert costs.exposed_after_window([1, 2, 3], [2, 2, 2], 3) == pytest.approx(4)
    assert costs.exposed_after_window([1, 2], [0.5, 0.5], 3) == 0.0
    # needed at 0, 1, 2 s; 1 s each back to back: done 1, 2, 3 -> 1 s stall
    assert costs.exposed_before_use([0, 1, 2], [1, 1, 1]) == pytest.approx(1)
    assert costs.forward_needs([0.25, 1.0], 4.0) == [3.0, 0.0]


def _llama_plan(gbps, **kw):
    import yaml

    flags = yaml.safe_load(open(REPO / "configs/llama2_7b.yaml"))
    c = ClusterSpec(4, 8, 2400.0, gbps)
    return plan(ModelSpec.from_flags(flags), ParallelSpec(32, tp=8), c,
                PlanOptions(global_batch=32, **kw))


def test_monotone_in_link_speed_and_bits():
    """Faster inter-node link: the predicted ratio rises towards 1 while LoCo pays, then
    settles at LoCo's kernel overhead (the decompress, and the part of the side stream's
    compress after backward: not all of the compress). More bits: more bytes."""
    ratios, last = [], None
    for gbps in (10, 25, 100, 400, 1600, 6400, 1e6):
        v = {r["name"]: r for r in _llama_plan(gbps)["variants"]}
        ratios.append(v["LoCo 4-bit flat"]["ratio_to_stock"])
        assert v["LoCo 4-bit flat"]["grad_bytes_sent"] < v["LoCo 8-bit flat"]["grad_bytes_sent"]
        assert v["LoCo 8-bit flat"]["grad_bytes_sent"] < v["stock bf16"]["grad_bytes_sent"] \
            < v["stock fp32"]["grad_bytes_sent"]
        last = v
    assert ratios[0] < 0.9  # slow link: LoCo pays (prediction)
    assert all(x <= y for x, y in zip(ratios, ratios[1:]))
    paying = [1 - r for r in ratios if r < 1]
    assert len(paying) >= 3 and all(x > y for x, y in zip(paying, paying[1:]))
    loco, stock = last["LoCo 4-bit flat"], last["stock fp32"]
    kernels = loco["compress_ms"] + loco["decompress_ms"]  # compress on the side stream: hidden
    assert 1 + loco["decompress_ms"] / stock["step_ms"] - 2e-3 <= ratios[-1] \
        <= 1 + kernels / stock["step_ms"] + 2e-3  # but for the last bucket's
    assert ratios[-1] < 1 + kernels / stock["step_ms"] - 1e-3


def test_cli_prints_table_and_json(capsys):
    args = ["plan", "--config", str(REPO / "configs/mixtral_8x7b.yaml"), "--nodes", "8",
            "--inter-node-gbps", "100"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "LoCo 4-bit flat" in out and "expert DP 2" in out and "ratio to stock" in out
    assert main(args + ["--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["expert_dp"] == 2 and p["dp"] == 16 and len(p["variants"]) == 12


def test_data_parallel_size_one_changes_nothing(capsys):
    assert main(LLAMA + ["--nodes", "1", "--tensor-model-parallel-size", "8", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["dp"] == 1 and "Data-parallel size 1" in p["headline"]
    assert all(v["grad_bytes_sent"] == 0 and v["step_ms"] == p["compute_ms"]
               for v in p["variants"])


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "loco_megatron", "plan", "--nodes", "2",
                        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                        "--seq-length", "32", "--compute-ms", "10"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "stock fp32 (ref)" in r.stdout


@pytest.mark.parametrize("args,flag", [
    (LLAMA + ["--nodes", "4", "--inter-node-gbps", "0"], "--inter-node-gbps"),
    (LLAMA + ["--nodes", "4", "--intra-node-gbps", "-5"], "--intra-node-gbps"),
    (LLAMA + ["--nodes", "4", "--inter-node-latency-us", "0"], "--inter-node-latency-us"),
    (LLAMA + ["--nodes", "4", "--tensor-model-parallel-size", "3"],
     "--tensor-model-parallel-size 3"),
    (LLAMA + ["--nodes", "4", "--data-parallel-size", "7"], "--data-parallel-size 7"),
    (LLAMA + ["--nodes", "4", "--tensor-model-parallel-size", "8", "--num-attention-heads",
              "36", "--hidden-size", "4608"], "--num-attention-heads 36"),
    (["plan", "--config", "no/such.yaml", "--nodes", "1"], "--config no/such.yaml"),
    (["plan", "--config", str(REPO / "configs/mixtral_8x7b.yaml"), "--nodes", "8",
      "--expert-model-parallel-size", "16"], "--num-experts 8"),
    (LLAMA + ["--nodes", "4", "--global-batch-size", "100"], "--global-batch-size 100"),
    (LLAMA + ["--nodes", "4", "--mfu", "1.5"], "--mfu"),
    (LLAMA + ["--nodes", "0"], "--nodes"),
    (["plan", "--nodes", "1", "--hidden-size", "64"], "--num-layers"),
])
def test_bad_input_exits_2_naming_the_flag(capsys, args, flag):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err and err.count("\n") == 1


def test_validation_table_is_committed_and_within_bound():
    from loco_megatron.planner import validate

    report = json.loads((REPO / "benchmarks/results/report.json").read_text())
    rows = validate.cases(report)
    for r in rows:  # exact bytes: the planner's counts are what LoCo measured on the wire
        assert (r["pred_loco_bytes"], r["pred_stock_bytes"]) == tuple(r["startup_bytes"])
        assert r["pred_loco_bytes"] == r["meas_loco_bytes"]
    inside = validate.bounded(rows)
    assert len(inside) >= 1 and {r["baseline"] for r in rows} == {"a", "b"}
    assert all(abs(r["error_pct"]) < validate.ERROR_BOUND for r in inside)
    assert validate.conservative(rows)  # against megatron's all-to-all RS: never over-promises
    assert validate.markdown(rows) in (REPO / "BENCHMARKS.md").read_text()


def _readme_commands():
    """The ``python -m loco_megatron plan ...`` commands of docs/planner.md's examples."""
    text = (REPO / "docs" / "planner.md").read_text()
    section = text.split("### Will LoCo pay on my cluster?")[1].split("\n## ")[0]
    blocks = [b.split("```")[0] for b in section.split("```bash\n")[1:]]
    return section, [b.replace("\\\n", " ").split()[3:] for b in blocks]


def test_readme_examples_are_real_runs(capsys):
    """Every headline and table row quoted in docs/planner.md is what its command prints now (the
    400 Gbit/s one-NIC variant is the first command with --inter-node-gbps 400)."""
    section, commands = _readme_commands()
    assert len(commands) == 3 and all(c[0] == "plan" for c in commands)
    commands = [[str(REPO / a) if a.startswith("configs/") else a for a in c] for c in commands]
    variant = [a if a != "100" else "400" for a in commands[0]]
    for i, args in enumerate(commands + [variant]):
        assert main(args) == 0
        out = capsys.readouterr().out.splitlines()
        head = out[-1].split("; the step is")[0]
        assert head in section, head
        rows = [r for r in out if r.startswith(("stock fp32 (ref)", "LoCo 4-bit flat"))]
        assert len(rows) == 3  # also "LoCo 4-bit flat + param 4-bit"
        for row in rows if i < 2 else []:
            cells = [c.strip() for c in row.split("  ") if c.strip()]
            assert f"| {cells[0]} | {cells[1]} | {cells[2]} | {cells[9]} | {cells[10]} |" \
                in section, row


def test_headline_points_to_bf16_when_it_is_as_fast(capsys):
    """When stock with a bf16 reduce-scatter is predicted at least as fast as the best LoCo
    variant, the headline says so (the free option first), whatever LoCo's own ratio."""
    assert main(["plan", "--config", str(REPO / "configs/tiny_cpu.yaml"), "--nodes", "1",
                 "--gpus-per-node", "2", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    ratios = {v["name"]: v["ratio_to_stock"] for v in p["variants"]}
    best = min(r for n, r in ratios.items() if n.startswith("LoCo"))
    assert ratios["stock bf16"] <= best
    assert main(["plan", "--config", str(REPO / "configs/tiny_cpu.yaml"), "--nodes", "1",
                 "--gpus-per-node", "2"]) == 0
    head = capsys.readouterr().out.splitlines()[-1]
    assert f"stock with --grad-reduce-in-bf16 is predicted as fast or faster (ratio " \
           f"{ratios['stock bf16']:.3f}" in head


def test_config_block_size_in_either_spelling(capsys, tmp_path):
    """The planner reads the loco: section as training does: block-size and block_size give
    the same prediction, and a block size training would refuse is refused here too."""
    base = (REPO / "configs/tiny_cpu.yaml").read_text().split("\nloco:")[0]
    outs = []
    for key in ("block-size", "block_size"):
        path = tmp_path / f"{key}.yaml"
        path.write_text(base + f"\nloco:\n  bits: 4\n  {key}: 16\n")
        assert main(["plan", "--config", str(path), "--nodes", "2", "--gpus-per-node", "1",
                     "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1]
    assert main(["plan", "--config", str(REPO / "configs/tiny_cpu.yaml"), "--nodes", "2",
                 "--gpus-per-node", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) != outs[0]  # 16 is not the default 256
    assert main(["plan", "--config", str(path), "--nodes", "2", "--gpus-per-node", "1",
                 "--loco-block-size", "131072"]) == 2
    assert "--loco-block-size 131072 must be an even integer" in capsys.readouterr().err


def test_parameter_all_gather_rows_count_exact_bytes(capsys):
    """The "+ param N-bit" rows send the weight differences' bytes in the parameter all-gather
    ((DP-1) x (bits x P / 8 + 4 x P / block) per bucket, P the padded shard), the others the
    parameters' bytes; the gradient side equals the row without "+ param"."""
    from loco_megatron.planner.buckets import Bucket
    from loco_megatron.planner.cluster import GroupSpread
    from loco_megatron.planner.predict import PlanOptions, param_gather

    assert main(["plan", "--config", str(REPO / "configs/llama2_7b.yaml"), "--nodes", "2",
                 "--gpus-per-node", "8", "--inter-node-gbps", "100", "--nics-per-node", "1",
                 "--json"]) == 0
    rows = {v["name"]: v for v in json.loads(capsys.readouterr().out)["variants"]}
    plain, both = rows["LoCo 4-bit flat"], rows["LoCo 4-bit flat + param 4-bit"]
    assert plain["grad_bytes_sent"] == both["grad_bytes_sent"]
    assert plain["param_bytes_sent"] == rows["stock fp32"]["param_bytes_sent"]
    assert both["param_bits"] == 4 and both["param_bytes_sent"] < 0.3 * plain["param_bytes_sent"]
    assert both["step_ms"] < plain["step_ms"] and both["param_fp32_copy_bytes"] == 0
    # its kernels: the owner's encode of its shard and every rank's decode of the bucket
    assert both["compress_ms"] > plain["compress_ms"]
    assert both["decompress_ms"] > plain["decompress_ms"]
    # one bucket by hand: 3 ranks x 700 elements, parameters cut at 123 and 1000, block 64
    bucket = Bucket(2100, ((0, 123), (123, 1000), (1000, 2100)), False, 1.0, GroupSpread(3, 1, 3))
    cluster = ClusterSpec(nodes=1, gpus_per_node=3)
    opt = PlanOptions(block_size=64, param_elem=2)
    shards = ([123, 577], [300, 400], [700])
    wire = max(sum(n + n % 2 for n in seg) for seg in shards)  # codes, even offsets: 702
    blocks = max(sum(-(-n // 64) for n in seg) for seg in shards)  # last blocks short: 12
    assert param_gather([bucket], cluster, opt, 4)[1] == 2 * (4 * wire // 8 + 4 * blocks)
    assert param_gather([bucket], cluster, opt, None)[1] == 2 * 700 * 2
