"""LoCo under the DDP settings a megatron user runs beyond the basic grid.

* bucket groups holding several buckets of two gradient buffers (fp32 and bf16 parameters),
  with ``overlap_grad_reduce`` on (asynchronous, coalesced) and off: ``disable_bucketing``
  (megatron.training's virtual-pipeline chunks > 0) and megatron-core's fp8 grouping;
* bucket sizes (9025, 18050 elements) not divisible by DP x block size, DP 3;
* gradient buffers in fp32 (``grad_reduce_in_fp32``) and bf16 (bf16 parameters);
* ``average_in_collective`` (``ReduceOp.AVG``) and the default pre-scaling by 1/DP (SUM);
* DP 1 (TP2 on two ranks): nothing to send, megatron-core's own path, bit-identical to stock.

Per variant: LoCo off (bits 16) is bit-identical to stock megatron-core (losses, parameters);
LoCo 4-bit compresses every bucket every step, its reduced shards lie within the quantization
bound of the exact reduction (``ShardChecker``) and, at the first step (error buffers zero),
within that bound of stock megatron-core's reduced shards; the loss falls.
CPU ranks (gloo + CUDA emulation), 6 steps per run.
"""

import torch

from tests.helpers.multiproc import run_ranks
from .worker_grid_variants import STEPS, BF16Adapter, dp2_then_dp1_worker, variants_worker

BF16 = dict(params_dtype=torch.bfloat16, grad_reduce_in_fp32=False)
MIXED = dict(module_fn=BF16Adapter)
DP3_VARIANTS = [
    ("overlap_b9025_sum", dict(overlap=True, bucket_size=9025)),
    ("overlap_b18050_avg", dict(overlap=True, bucket_size=18050, average_in_collective=True)),
    ("no_overlap_sum", dict(overlap=False)),
]
DP2_VARIANTS = [
    # one group = the fp32 buffer's bucket + the bf16 buffer's bucket (bf16 gradients)
    ("mixed_single_group_overlap", dict(overlap=True, disable_bucketing=True,
                                        grad_reduce_in_fp32=False, **MIXED)),
    ("mixed_single_group_no_overlap", dict(overlap=False, disable_bucketing=True,
                                           average_in_collective=True, **MIXED)),
    # several groups, the last one holding the bf16 bucket too (fp32 gradients)
    ("mixed_fp8_groups_avg", dict(overlap=True, bucket_size=9025, fp8_groups=True,
                                  average_in_collective=True, **MIXED)),
    ("bf16_overlap_avg", dict(overlap=True, bucket_size=18050, average_in_collective=True,
                              **BF16)),
]


def check_variant(name, res, dp):
    """The assertions every variant must pass (see the module docstring)."""
    stock, bits16, loco = res["stock"], res["bits16"], res["loco4"]
    assert bits16["losses"] == stock["losses"], name
    assert all(torch.equal(stock["params"][n], bits16["params"][n]) for n in stock["params"])
    assert loco["groups"] == stock["groups"], name
    num_buckets = sum(len(g) for g in stock["groups"])
    c = loco["counters"]
    # every bucket through LoCo every step
    assert c["buckets"] == c["keys"] == num_buckets, (name, c)
    assert c["calls"] == c["compress"] == STEPS * num_buckets and c["steps"] == [STEPS], c
    assert loco["shard_check"] <= 1.0, (name, loco["shard_check"])
    # step 0 (error buffers zero): same forward, reduced shards within the bound of stock's;
    # tolerance: the quantization bound plus the rounding of both reductions in the buffer
    # dtype (sum_i |h_i| <= 2 * 7 * bound for 4-bit blocks)
    assert loco["losses"][0] == stock["losses"][0]
    for key, stock_shard in stock["first"].items():
        got, exact, bound = loco["first_check"][key]
        assert torch.equal(got, loco["first"][key])
        eps = torch.finfo(_buffer_dtype(stock, key)).eps
        tol = bound * (1 + 14 * dp * eps) + 2 * dp * eps * exact.abs() + 1e-7
        assert ((got - stock_shard).abs() <= tol).all(), (name, key)
    # it really compressed, and trains
    assert loco["losses"] != stock["losses"], name
    assert loco["losses"][-1] < 0.92 * loco["losses"][0], (name, loco["losses"])
    assert abs(loco["losses"][-1] - stock["losses"][-1]) < 0.02 * stock["losses"][0], name


def _buffer_dtype(result, key):
    group, bucket = key
    return result["groups"][group][bucket][1]


def test_dp3_bucket_sizes_not_divisible_sum_and_avg():
    """World 3, TP1 x DP3, fp32 gradients: buckets of 9025 / 18050 elements (overlapped) and one
    bucket (not overlapped); SUM and AVG."""
    for rank, results in enumerate(run_ranks(variants_worker, 3, 1, DP3_VARIANTS)):
        for name, res in results.items():
            check_variant(name, res, dp=3)
            numels = [n for g in res["stock"]["groups"] for n, _ in g]
            # the bucket sizes really are not a multiple of DP x block: short last blocks
            assert any(n % (3 * 256) for n in numels), numels
            assert any(res["loco4"]["counters"]["short"]), name
        assert len(results["overlap_b9025_sum"]["stock"]["groups"]) > \
            len(results["overlap_b18050_avg"]["stock"]["groups"]) > 1
        assert len(results["no_overlap_sum"]["stock"]["groups"]) == 1


def test_dp2_multi_bucket_groups_dtypes_and_dp1():
    """World 2: bucket groups with buckets of two buffers (fp32 + bf16 parameters), bf16 and
    fp32 gradient buffers, AVG; then TP2 x DP1, where LoCo sends nothing."""
    dp1 = dict(overlap=True, bucket_size=9025)
    for results in run_ranks(dp2_then_dp1_worker, 2, DP2_VARIANTS, dp1):
        for name, _ in DP2_VARIANTS:
            check_variant(name, results[name], dp=2)
        f32, b16 = torch.float32, torch.bfloat16

        def groups(name):
            return [[dtype for _, dtype in g] for g in results[name]["stock"]["groups"]]

        assert groups("mixed_single_group_overlap") == [[f32, b16]]
        assert groups("mixed_single_group_no_overlap") == [[f32, f32]]
        fp8 = groups("mixed_fp8_groups_avg")
        assert len(fp8) > 2 and all(g == [f32] for g in fp8[:-1]) and fp8[-1] == [f32, f32]
        assert {d for g in groups("bf16_overlap_avg") for d in g} == {b16}
        assert len(groups("bf16_overlap_avg")) > 1
        # DP 1: megatron-core's own path, nothing compressed, bit-identical to stock
        stock, loco = results["dp1"]["stock"], results["dp1"]["loco4"]
        assert len(stock["groups"]) > 1
        for other in (results["dp1"]["bits16"], loco):
            assert other["losses"] == stock["losses"]
            assert all(torch.equal(stock["params"][n], other["params"][n])
                       for n in stock["params"])
        c = loco["counters"]
        assert c["buckets"] == sum(len(g) for g in stock["groups"])
        assert c["calls"] == c["compress"] == c["keys"] == 0, c
        assert stock["losses"][-1] < stock["losses"][0]
