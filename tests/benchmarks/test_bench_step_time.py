"""benchmarks/step_time*.py: namespace link set-up/teardown, rate cap, log parsing, schedule,
the flags of every variant as Megatron parses them, the check of each run's log, the ratios,
the markdown and the plot.

No training runs here (the section itself is ``python -m benchmarks --only step_time``); no
timing is asserted.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks import (netns, step_time, step_time_plot, step_time_report,
                        step_time_variants)
from benchmarks.step_log import LogParser, summarize


def _link_unavailable() -> str:
    """Why no namespace link can be built here: not root, no iproute2, or creation refused."""
    why = netns.unavailable()
    if not why:
        link = netns.TwoNodeLink("100mbit", tag=9)
        try:
            link.open()
        except (subprocess.SubprocessError, OSError) as e:
            why = f"cannot build the namespace link here: {getattr(e, 'stderr', '') or e}"
        finally:
            link.close()
    return why


_WHY = _link_unavailable()
needs_root = pytest.mark.skipif(bool(_WHY), reason=_WHY or "namespaces available")

# Captured from `python -m benchmarks --only step_time --quick` (megatron-core 0.19.2, DP=2).
LOCO_LOG = """\
> LoCo: model chunk 0: 1 buckets, 2895616 gradient elements, 746592 bytes/step per rank on the wire vs 5791232 stock (0.129x)
 [2026-11-30 10:47:02.749136] iteration        3/       6 | consumed samples:            6 | elapsed time per iteration (ms): 5694.0 | learning rate: 5.000000E-05 | global batch size:     2 | lm loss: 8.921298E+00 | loss scale: 1.0 | grad norm: 12.464 | number of skipped iterations:   0 | number of nan iterations:   0 | loco compression error norm: 1.677032E+00 | loco error buffer norm: 5.169279E-01 | loco wire bytes per step: 5419128 | loco compression ratio: 7.758 |
INFO:megatron.core.timers:(min, max) time across ranks (ms):
    forward-backward ...............................: (4840.02, 4840.98)
    all-grads-sync .................................: (3873.17, 4024.48)
    params-all-gather ..............................: (608.73, 615.95)
    optimizer ......................................: (787.71, 825.68)
    loco-compress ..................................: (1245.71, 3186.40)
    loco-comm ......................................: (124.88, 2225.48)
    loco-decompress ................................: (533.49, 534.51)
 [2026-11-30 10:47:07.227175] iteration        4/       6 | consumed samples:            8 | elapsed time per iteration (ms): 4476.9 | learning rate: 3.333333E-05 | global batch size:     2 | lm loss: 8.652111E+00 | loss scale: 1.0 | grad norm: 13.664 | number of skipped iterations:   0 | number of nan iterations:   0 | loco compression error norm: 1.912758E+00 | loco error buffer norm: 5.622619E-01 | loco wire bytes per step: 5419128 | loco compression ratio: 7.758 |
INFO:megatron.core.timers:(min, max) time across ranks (ms):
    all-grads-sync .................................: (2471.03, 3078.49)
    params-all-gather ..............................: (651.24, 716.64)
    loco-compress ..................................: (1273.78, 1615.56)
    loco-comm ......................................: (240.95, 797.48)
    loco-decompress ................................: (592.19, 984.81)
"""
STOCK_LOG = """\
 [2026-11-30 10:48:57.315086] iteration        3/       8 | consumed samples:            6 | elapsed time per iteration (ms): 313.6 | learning rate: 6.250000E-05 | global batch size:     2 | lm loss: 9.042263E+00 | loss scale: 1.0 | grad norm: 5.324 | number of skipped iterations:   0 | number of nan iterations:   0 |
INFO:megatron.core.timers:(min, max) time across ranks (ms):
    forward-backward ...............................: (200.70, 203.98)
    embedding-grads-all-reduce .....................: (0.02, 0.04)
    all-grads-sync .................................: (101.21, 103.50)
/work/x/cpu_cuda.py:119: UserWarning: another rank's warning in the same pipe
    params-all-gather ..............................: (75.65, 76.00)
"""


def test_parser_loco_log():
    p = LogParser().feed_text(LOCO_LOG)
    assert p.startup_bytes == (746592, 5791232)
    assert sorted(p.steps) == [3, 4]
    s3 = p.steps[3]
    assert s3.ms == 5694.0 and s3.loco_bytes == 5419128
    assert s3.timers["all-grads-sync"] == (3873.17, 4024.48)
    assert s3.timers["loco-comm"] == (124.88, 2225.48)
    summary = summarize([p.steps[3], p.steps[4]])
    assert summary["step_ms_median"] == pytest.approx((5694.0 + 4476.9) / 2)
    assert summary["all-grads-sync_ms_median"] == pytest.approx((4024.48 + 3078.49) / 2)
    assert summary["grad_sync_share"] == pytest.approx(
        summary["all-grads-sync_ms_median"] / summary["step_ms_median"])
    assert summary["loco_wire_bytes_per_step"] == 5419128
    assert summary["loco-comm_min_ms_median"] == pytest.approx((124.88 + 240.95) / 2)
    assert summary["loco_comm_share"] == pytest.approx(
        summary["loco-comm_min_ms_median"] / summary["step_ms_median"])
    assert summary["params_all_gather_share"] == pytest.approx(
        (615.95 + 716.64) / 2 / summary["step_ms_median"])


def test_parser_reads_the_parameter_all_gather_fields():
    """With --loco-param-bits the start-up line of the parameter all-gather is not summed into
    the gradient bytes, and the iteration line's param-gather bytes are read."""
    line = ("> LoCo: model chunk 0: parameter all-gather as 4-bit weight differences, 1 buckets: "
            "746592 bytes/step per rank on the wire vs 5791232 stock (0.129x); exact ...")
    it = (" iteration        3/       6 | elapsed time per iteration (ms): 10.0 | loco wire bytes "
          "per step: 7 | loco param-gather bytes per step: 9 (stock 40) |")
    p = LogParser().feed_text(LOCO_LOG.splitlines()[0] + "\n" + line + "\n" + it)
    assert p.startup_bytes == (746592, 5791232)  # the gradient line only
    assert summarize([p.steps[3]])["param_gather_bytes_per_step"] == 9


def test_parser_stock_log():
    p = LogParser().feed_text(STOCK_LOG)
    assert p.startup_bytes is None
    step = p.steps[3]
    assert step.ms == 313.6 and step.loco_bytes is None
    assert step.timers["params-all-gather"] == (75.65, 76.00)
    summary = summarize([step])
    assert summary["grad_sync_share"] == pytest.approx(103.50 / 313.6)
    assert "loco_wire_bytes_per_step" not in summary and "loco_comm_share" not in summary


def test_schedule():
    cfg = dict(step_time.CONFIG["quick"], rates=("a", "b", "c"), warmup=2, measure=3)
    assert step_time.schedule(cfg) == (13, [("a", [3, 4, 5]), ("b", [7, 8, 9]),
                                            ("c", [11, 12, 13])])
    with pytest.raises(ValueError):
        step_time.schedule(dict(cfg, warmup=1))
    for name in ("quick", "full"):  # the shipped configurations are valid
        step_time.schedule(step_time.CONFIG[name])


# megatron-core's start-up line for --ddp-reduce-scatter-with-fp32-accumulation (rank 0's log
# of variant (b) in a real run of the section)
FP32_ACC_LINE = ("INFO:megatron.core.distributed.param_and_grad_buffer:Using "
                 "reduce_scatter_with_fp32_accumulation as reduce-scatter implementation")
# Rank 0's log of a real run (megatron-core 0.19.2, the section's full configuration, variant
# (f) with overlap on, DP 4 over the two namespaces): lines of Megatron's argument dump (every
# checked argument, one long name printed without dots), the DDP config line, the bucket lines
# and LoCo's start-up lines, verbatim.
CONFIG_LOG = """\
accumulate and all-reduce gradients in fp32 for bfloat16 data type.
using torch.bfloat16 for parameters ...
------------------------ arguments ------------------------
  _is_global_batch_size_explicitly_specified ...... True
  account_for_embedding_in_pipeline_split ......... False
  account_for_loss_in_pipeline_split .............. False
  accumulate_allreduce_grads_in_fp32 .............. True
  bf16 ............................................ True
  data_parallel_size .............................. 4
  ddp_bucket_size ................................. 4000000
  ddp_param_name_patterns_for_fp32_local_accumulation  []
  ddp_reduce_scatter_with_fp32_accumulation ....... False
  grad_reduce_in_bf16 ............................. False
  loco_bits ....................................... 4
  loco_hierarchical ............................... True
  loco_intra_node_bits ............................ 16
  loco_param_bits ................................. None
  overlap_grad_reduce ............................. True
  overlap_param_gather ............................ True
  overlap_param_gather_with_optimizer_step ........ False
  params_dtype .................................... torch.bfloat16
  use_distributed_optimizer ....................... True
-------------------- end of arguments ---------------------
> LoCo active: 4-bit compensated reduce-scatter, block 256, err-beta 0.8, reset every 1024 steps, error storage int8; kernels cpu (auto); on CPU ranks (CUDA emulation, gloo); hierarchical: intra-node stage full precision, inter-node stage 4-bit, nodes of LOCAL_WORLD_SIZE=2 ranks (M nodes x L ranks per DP group logged when the model is wrapped)
INFO:megatron.core.distributed.distributed_data_parallel:Setting up DistributedDataParallel with config DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True, overlap_param_gather=True, align_param_gather=False, use_distributed_optimizer=True, num_distributed_optimizer_instances=1, check_for_nan_in_grad=True, check_for_large_grads=False, bucket_size=4000000, num_buckets=None, pad_buckets_for_high_nccl_busbw=False, reduce_scatter_with_fp32_accumulation=False, param_name_patterns_for_fp32_local_accumulation=(), average_in_collective=False, fp8_param_gather=False, fp4_param_gather=False, reuse_grad_buf_for_mxfp8_param_ag=False, use_megatron_fsdp=False, use_custom_fsdp=False, data_parallel_sharding_strategy='optim_grads_params', gradient_reduce_div_fusion=True, suggested_communication_unit_size=None, keep_fp8_transpose_cache=False, nccl_ub=False, fsdp_double_buffer=False, fsdp_db_use_persist_buf_on_alloc_fail=False, fsdp_all_gather_in_start_param_sync=True, outer_dp_sharding_strategy='no_shard', disable_symmetric_registration=False, fsdp_manual_registration=False, delay_wgrad_compute=False, megatron_fsdp_main_params_dtype=torch.float32, megatron_fsdp_main_grads_dtype=None, megatron_fsdp_grad_comm_dtype=None, megatron_fsdp_use_decoupled_grad=False, megatron_fsdp_cuda_graph_mode=False, megatron_fsdp_enable_fine_grained_param_gather=False, megatron_fsdp_max_pool_double_buffer=False)
INFO:megatron.core.distributed.param_and_grad_buffer:Number of buckets for gradient all-reduce / reduce-scatter: 4
Params for bucket 1 (4197376 elements, 4197376 padded size, 0 param(s) with extra main_grads):
Params for bucket 2 (4198400 elements, 4198400 padded size, 0 param(s) with extra main_grads):
Params for bucket 3 (4200448 elements, 4200448 padded size, 0 param(s) with extra main_grads):
Params for bucket 4 (8398848 elements, 8398848 padded size, 0 param(s) with extra main_grads):
> LoCo: model chunk 0: 4 buckets, 20995072 gradient elements, 8119188 bytes/step per rank on the wire vs 62985216 stock (0.129x)
> LoCo hierarchical: model chunk 0, data-parallel group of 4 ranks = 2 nodes x 2 ranks (LOCAL_WORLD_SIZE=2): intra-node stage full precision (grad dtype), inter-node stage 4-bit compensated; 41990144 bytes/step per rank intra-node, 2706396 inter-node; error state 10661560 bytes per rank in memory (these replace the flat figures)
"""


def test_parser_reads_megatron_configuration():
    p = LogParser().feed_text(CONFIG_LOG)
    assert p.arguments["overlap_grad_reduce"] == "True"
    assert p.arguments["loco_bits"] == "4" and p.arguments["loco_param_bits"] == "None"
    assert p.arguments["loco_hierarchical"] == "True"
    assert p.arguments["ddp_bucket_size"] == "4000000"
    assert p.arguments["params_dtype"] == "torch.bfloat16"
    assert p.arguments["ddp_param_name_patterns_for_fp32_local_accumulation"] == "[]"
    assert "accumulate and all-reduce gradients in fp32 for bfloat16 data type." not in str(
        p.arguments)  # lines outside the dump are not arguments
    assert len(p.arguments) == 19  # every line of the excerpt's dump
    assert p.ddp_config["overlap_param_gather"] == "True"
    assert p.ddp_config["bucket_size"] == "4000000"
    assert p.ddp_config["reduce_scatter_with_fp32_accumulation"] == "False"
    assert p.ddp_config["param_name_patterns_for_fp32_local_accumulation"] == "()"
    assert p.ddp_config["data_parallel_sharding_strategy"] == "'optim_grads_params'"
    assert p.buckets == [4]
    assert p.notices == {"loco_active", "loco_hierarchical"}
    assert p.startup_bytes == (8119188, 62985216)
    # the timer lines' regex does not take argument lines (no colon) and vice versa
    assert p.steps == {}


def test_check_flags_on_a_real_log():
    cfg, log = step_time.CONFIG["full"], LogParser().feed_text(CONFIG_LOG)
    by = step_time.BY_KEY
    assert step_time.check_flags(log, cfg, 4, by["f"], True) == []
    assert step_time.check_flags(log, cfg, 4, by["d"], True) == [
        "argument loco_hierarchical = True (want False)",
        "start-up line loco_hierarchical present"]
    assert step_time.check_flags(log, cfg, 4, by["e"], True) == [
        "argument loco_param_bits = None (want 4)",
        "argument loco_hierarchical = True (want False)",
        "start-up line loco_hierarchical present", "start-up line loco_param_gather missing"]
    assert set(step_time.check_flags(log, cfg, 4, by["c"], True)) == {
        "argument ddp_reduce_scatter_with_fp32_accumulation = False (want True)",
        "argument grad_reduce_in_bf16 = False (want True)", "argument loco_bits = 4 (want 16)",
        "argument loco_hierarchical = True (want False)",
        "argument accumulate_allreduce_grads_in_fp32 = True (want False)",
        "DDP config reduce_scatter_with_fp32_accumulation = False (want True)",
        "DDP config grad_reduce_in_fp32 = True (want False)",
        "start-up line fp32_accumulation_rs missing", "start-up line loco_active present",
        "start-up line loco_hierarchical present"}
    # megatron-core's line for (b)/(c) is recognised; without it (b) would not be (b)
    b_log = LogParser().feed_text(CONFIG_LOG + FP32_ACC_LINE + "\n")
    assert "fp32_accumulation_rs" in b_log.notices
    assert "start-up line fp32_accumulation_rs present" in step_time.check_flags(
        b_log, cfg, 4, by["f"], True)
    off = step_time.check_flags(log, cfg, 4, by["f"], False)
    assert "argument overlap_param_gather = True (want False)" in off
    assert "DDP config bucket_size = 4000000 (want None)" in off
    assert "argument data_parallel_size = 4 (want 2)" in step_time.check_flags(
        log, cfg, 2, by["f"], True)
    log.buckets = [2]
    assert step_time.check_flags(log, cfg, 4, by["f"], True) == [
        "2 gradient bucket(s) (want >= 3: lower bucket_size)"]
    assert step_time.check_flags(LogParser(), cfg, 4, by["a"], False) == [
        "no argument in the log", "no DDP config in the log"]


def test_variant_flags():
    flags = {v.key: list(v.flags) for v in step_time.VARIANTS}
    assert flags == {
        "a": ["--loco-bits", "16"],
        "b": ["--loco-bits", "16", "--ddp-reduce-scatter-with-fp32-accumulation"],
        "c": ["--loco-bits", "16", "--ddp-reduce-scatter-with-fp32-accumulation",
              "--grad-reduce-in-bf16"],
        "d": ["--loco-bits", "4"], "e": ["--loco-bits", "4", "--loco-param-bits", "4"],
        "f": ["--loco-bits", "4", "--loco-hierarchical"]}
    cfg = step_time.CONFIG["full"]
    assert step_time.run_flags(cfg, step_time.BY_KEY["d"], True) == [
        "--loco-bits", "4", "--overlap-grad-reduce", "--overlap-param-gather",
        "--ddp-bucket-size", str(cfg["bucket_size"])]
    for name in ("quick", "full"):
        c = step_time.CONFIG[name]
        assert set(c["variants"]) <= set(step_time.BY_KEY) and set(c["overlap"]) == {False, True}
        assert "f" not in c["variants"] or all(dp % 2 == 0 and dp >= 4 for dp in c["dp"])


# Megatron's own parser, validation and argument printer (megatron.training.arguments), in a
# child process: every run's command line as the benchmark builds it.
_DUMP_ARGS = r"""
import contextlib, io, json, os, sys
os.environ.update(WORLD_SIZE=sys.argv[2], RANK="0", LOCAL_RANK="0")
from benchmarks import step_time
from loco_megatron.training import startup
from megatron.training.arguments import parse_args, validate_args
cfg, dp, out = step_time.CONFIG[sys.argv[1]], int(sys.argv[2]), {}
for key in cfg["variants"]:
    for overlap in (False, True):
        flags = step_time.run_flags(cfg, step_time.BY_KEY[key], overlap)
        sys.argv = ["pretrain_gpt.py", *step_time.megatron_args(
            cfg, dp, flags, 15, ["--mock-data", "--tokenizer-type", "NullTokenizer",
                                 "--vocab-size", "8192"])]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            validate_args(parse_args(startup.extra_args_provider))
        out[step_time.run_key(dp, key, overlap)] = buf.getvalue()
print("DUMPS" + json.dumps(out))
"""


@pytest.mark.parametrize("name", ["full", "quick"])
def test_every_variants_flags_reach_megatrons_arguments(name):
    """Each run's command line, through Megatron's parser and validate_args, prints the intended
    overlap/reduce-scatter/LoCo settings in Megatron's argument dump (what each benchmark run
    also checks in its own log, with the DDP config and the bucket count)."""
    cfg, dp = step_time.CONFIG[name], 4
    proc = subprocess.run([sys.executable, "-c", _DUMP_ARGS, name, str(dp)], capture_output=True,
                          text=True, cwd=step_time.REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dumps = json.loads(proc.stdout.split("DUMPS", 1)[1])
    assert len(dumps) == 2 * len(cfg["variants"])
    for key in cfg["variants"]:
        v = step_time.BY_KEY[key]
        for overlap in (False, True):
            args = LogParser().feed_text(dumps[step_time.run_key(dp, key, overlap)]).arguments
            assert len(args) > 500  # the whole dump was parsed
            want = step_time.expected_arguments(cfg, dp, v, overlap)
            assert step_time_variants.mismatches("argument", args, want) == [], (key, overlap)
            assert args["overlap_grad_reduce"] == args["overlap_param_gather"] == str(overlap)
            assert args["ddp_reduce_scatter_with_fp32_accumulation"] == str(key in "bc")
            assert args["grad_reduce_in_bf16"] == str(key == "c")
            assert args["loco_bits"] == ("16" if key in "abc" else "4")
            assert args["loco_param_bits"] == ("4" if key == "e" else "None")
            assert args["loco_hierarchical"] == str(key == "f")
    # the check tells variants apart: (b)'s dump is not (c)'s
    b = LogParser().feed_text(dumps[step_time.run_key(dp, "b", True)]).arguments
    assert step_time_variants.mismatches("argument", b, step_time.expected_arguments(
        cfg, dp, step_time.BY_KEY["b"], False)) != []


def _runs(ms: dict, failed: dict = ()) -> dict:
    """Hand-made runs: ``{(key, overlap): ms at 1gbit}``; ``failed``: ``{(key, overlap): error}``."""
    runs = {}
    for (key, overlap), v in ms.items():
        runs[step_time.run_key(4, key, overlap)] = {
            "variant": key, "overlap": overlap, "error": "", "buckets": 4 if overlap else 1,
            "1gbit": {"step_ms_median": v, "grad_sync_share": 0.5, "link_tx_bytes_per_step":
                      3 * 2 ** 20, "link_rx_bytes_per_step": 2 ** 20}}
    for (key, overlap), err in dict(failed).items():
        runs[step_time.run_key(4, key, overlap)] = {
            "variant": key, "overlap": overlap, "error": err,
            "node0_log": ["error: --loco-bits and --ddp-reduce-scatter-with-fp32-accumulation "
                          "both replace the reduce-scatter; choose one."], "node1_log": []}
    return runs


def _cfg(**kw):
    return dict(step_time.CONFIG["full"], rates=("1gbit",), dp=(4,), **kw)


def test_speedups_against_the_right_baseline():
    runs = _runs({("a", False): 3000.0, ("b", False): 2000.0, ("c", False): 1600.0,
                  ("d", False): 1000.0, ("e", False): 800.0, ("b", True): 1500.0,
                  ("c", True): 1200.0, ("d", True): 600.0})
    assert step_time_report.speedup(runs, 4, "d", "b", False, "1gbit") == pytest.approx(2.0)
    assert step_time_report.speedup(runs, 4, "d", "c", False, "1gbit") == pytest.approx(1.6)
    assert step_time_report.speedup(runs, 4, "d", "b", True, "1gbit") == pytest.approx(2.5)
    assert step_time_report.speedup(runs, 4, "e", "c", False, "1gbit") == pytest.approx(2.0)
    assert step_time_report.speedup(runs, 4, "e", "b", True, "1gbit") is None  # not measured
    assert step_time_report.speedup(runs, 4, "d", "b", False, "10gbit") is None
    md = step_time_report.markdown(_cfg(), {"1gbit": 1.2e8}, runs, (1.5, 2.0))
    rows = step_time_report.table(_cfg(), runs)
    assert len(rows) == 2 + 2 * 6 and len({r.count("|") for r in rows}) == 1
    assert "| vs (b) | vs (c) |" in rows[0]
    assert "vs (c)" not in step_time_report.table(_cfg(variants="abd"), runs)[0]
    assert ("- **1gbit, DP 4, overlap off**: (d) vs (b): 2.00×, (d) vs (c): 1.60×, (e) vs (b): "
            "2.50×, (e) vs (c): 2.00×, (f) vs (b): –, (f) vs (c): –") in md
    assert "- **1gbit, DP 4, overlap on**: (d) vs (b): 2.50×, (d) vs (c): 2.00×, (e) vs (b): –" in md
    assert "| 1gbit | 4 | off | (a) stock | 3000 | 0.67× | 0.53× | 3.0 / 1.0 | 50% | – | – | 1 |" in md
    assert "| 1gbit | 4 | on | (d) LoCo 4-bit | 600 | 2.50× | 2.00× | 3.0 / 1.0 | 50% | – | – | 4 |" in md
    assert "| 1gbit | 4 | off | (f) LoCo 4-bit hierarchical | not run | – | – |" in md
    assert "120 MB/s" in md and "1.5 / 2.0 on" in md and "Not measured here: NCCL, GPUs" in md
    assert "reached only" not in md  # 0.96 Gbit/s of 1gbit: the shaper sets the pace
    md = step_time_report.markdown(_cfg(), {"1gbit": 1.2e8, "10gbit": 5e8}, runs)
    assert "At 10gbit one stream reached only 40% of the shaped rate" in md


def test_a_failed_variant_shows_its_error():
    err = "iterations 3-8 missing from the log (exit codes [1, 1]; logs in /x)"
    runs = _runs({("b", False): 2000.0, ("d", False): 1000.0},
                 failed={("c", False): err, ("b", True): "flags did not reach Megatron: "
                         "argument overlap_grad_reduce = False (want True)"})
    md = step_time_report.markdown(_cfg(), {"1gbit": None}, runs, png="step_time.png")
    assert "| 1gbit | 4 | off | (c) stock + fp32-acc RS + bf16 grads | **failed** | – | – |" in md
    assert f"- `dp4-c-off` (stock + fp32-acc RS + bf16 grads, overlap off): {err} — `error: " \
           "--loco-bits and --ddp-reduce-scatter-with-fp32-accumulation both replace" in md
    assert "- `dp4-b-on` (stock + fp32-acc RS, overlap on): flags did not reach Megatron: " \
           "argument overlap_grad_reduce = False (want True)" in md
    # a baseline that failed gives no ratio, not a ratio against something else
    assert "(d) vs (b): 2.00×, (d) vs (c): –" in md
    assert "- **1gbit, DP 4, overlap on**: (d) vs (b): –" in md
    assert "check failed" in md and "![step time per variant" in md and "(step_time.png)" in md


def test_plot_writes_a_png(tmp_path):
    runs = _runs({("a", False): 3000.0, ("b", False): 2000.0, ("d", True): 900.0},
                 failed={("c", False): "boom"})
    path = step_time_plot.plot(dict(step_time.CONFIG["full"], rates=("1gbit", "10gbit")),
                               runs, tmp_path / "sub" / "step_time.png")
    assert path == tmp_path / "sub" / "step_time.png"
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_skips_without_root(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    sec = step_time.run(quick=True, workdir=tmp_path)
    assert sec.name == "step_time" and "root" in sec.skipped


def _ours():
    return [ns for ns in netns.namespaces() if ns.startswith(f"{netns.PREFIX}{os.getpid()}-")]


@needs_root
def test_link_rate_cap_and_teardown():
    with netns.TwoNodeLink("100mbit") as link:
        assert sorted(_ours()) == sorted(link.ns)
        qdisc = subprocess.run(link.exec_prefix(0) + ["tc", "qdisc", "show", "dev", link.dev[0]],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        # The peer's address is reachable only inside: not from the host's namespace.
        host = subprocess.run(["ip", "route", "get", link.addr[1]], capture_output=True,
                              text=True).stdout
        assert link.dev[0] not in host
        rate = link.measure_rate(nbytes=3 * 2 ** 20)
        assert 2e6 < rate < 20e6, rate  # 100 Mbit/s = 12.5 MB/s
        link.set_rate("1gbit")
        qdisc = subprocess.run(link.exec_prefix(1) + ["tc", "qdisc", "show", "dev", link.dev[1]],
                               capture_output=True, text=True, check=True).stdout
        assert "1Gbit" in qdisc
        sleeper = link.popen(1, [sys.executable, "-c", "import time; time.sleep(60)"])
    assert _ours() == []
    assert sleeper.poll() is not None  # killed by close()
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert link.dev[0] not in links and link.dev[1] not in links
    link.close()  # idempotent


@needs_root
def test_teardown_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.TwoNodeLink("100mbit", tag=1) as link:
            proc = link.popen(0, [sys.executable, "-c", "import time; time.sleep(60)"])
            raise RuntimeError("boom")
    assert _ours() == [] and proc.poll() is not None


@needs_root
def test_sweeps_namespaces_of_dead_runs():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    name = f"{netns.PREFIX}{dead}-0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        left = subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c",
                                 "import time; time.sleep(60)"])
        for _ in range(100):  # until it has entered the namespace
            if subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                              text=True).stdout.strip():
                break
            time.sleep(0.05)
        assert name in netns.sweep_stale()
        assert name not in netns.namespaces()
        assert left.wait(timeout=10) != 0  # the left-over process was killed
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@needs_root
def test_section_without_training_runs(monkeypatch, tmp_path):
    """run() end to end with no time budget left for training: rate check, table, cleanup."""
    monkeypatch.setitem(step_time.CONFIG, "quick",
                        dict(step_time.CONFIG["quick"], section_budget_s=0))
    monkeypatch.setattr(step_time, "corpus_args", lambda: [])
    sec = step_time.run(quick=True, workdir=tmp_path)
    assert not sec.skipped
    assert set(sec.data["rate_check_bytes_per_s"]) == {"1gbit", "10gbit"}
    assert 20e6 < sec.data["rate_check_bytes_per_s"]["1gbit"] < 200e6  # 125 MB/s cap
    assert all("budget" in r["error"] for r in sec.data["runs"].values())
    assert len(sec.data["runs"]) == 2 * len(step_time.CONFIG["quick"]["variants"])
    assert "| 1gbit | 4 | off | (a) stock | not run | – | – / – |" in sec.markdown
    assert "Link check" in sec.markdown and "not run: section time budget" in sec.markdown
    assert sec.files == ["step_time.png"] and (tmp_path / "step_time.png").stat().st_size > 0
    assert _ours() == []
