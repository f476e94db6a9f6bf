"""LoCo on a tiny megatron-core MoE GPT: 4 experts, EP 2, world 4 (dense DP 4, expert-DP 2).

Dense buckets reduce-scatter over the 4-rank DP group, expert buckets over the 2-rank expert-DP
group (``ddp.expert_parallel_buffers``); LoCo compresses both, and their error buffers are
checkpointed with the ChainedOptimizer's dense and expert DistributedOptimizers. CPU ranks
(gloo + CUDA emulation), all-gather token dispatcher.
"""

import re

import pytest
import torch

from tests.helpers.multiproc import run_ranks
from .worker_moe import corrupt_load_worker, moe_worker, startup_lines_worker
from .worker_resume import FORMATS

STEPS = 4


def test_moe_expert_buckets_compressed_and_checkpointed(tmp_path):
    results = run_ranks(moe_worker, 4, True, STEPS, str(tmp_path))
    for res in results:
        stock, bits16, loco = res["stock"], res["bits16"], res["loco4"]
        assert stock["optimizers"] == ["DistributedOptimizer", "DistributedOptimizer"]
        assert stock["expert_dp"] == 2 and stock["num_expert_buckets"] > 1
        # LoCo off (bits 16): bit-identical to stock megatron-core
        assert bits16["losses"] == stock["losses"]
        assert all(torch.equal(stock["params"][n], bits16["params"][n]) for n in stock["params"])
        # LoCo 4-bit: every dense and every expert bucket compressed on every step, the expert
        # ones over the 2-rank expert-DP group, the dense ones over the 4-rank DP group
        c = loco["counters"]
        assert c["expert_buckets"] == stock["num_expert_buckets"]
        assert len(c["expert_steps"]) == c["expert_buckets"] and set(c["expert_steps"]) == {STEPS}
        assert len(c["dense_steps"]) == c["buckets"] - c["expert_buckets"] > 0
        assert set(c["dense_steps"]) == {STEPS}
        assert c["expert_sizes"] == [2] and c["dense_sizes"] == [4]
        # reduced shards within the quantization bound of the exact reduction, both kinds
        assert 0 < loco["shard_check"]["dense"] <= 1.0, loco["shard_check"]
        assert 0 < loco["shard_check"]["expert"] <= 1.0, loco["shard_check"]
        # it really compressed, and the loss falls
        assert loco["losses"] != stock["losses"]
        assert loco["losses"][-1] < 0.95 * loco["losses"][0], loco["losses"]
        # checkpoint: every error buffer (dense and expert) restored bit for bit, and the
        # resumed run continues exactly as the uninterrupted one
        assert res["fully_reshardable_saved"]  # dense and expert LoCo keys do not collide
        ck = res["ckpt"]
        assert ck["nonzero"] == {"dense": True, "expert": True}
        assert ck["torch_dirs"] == ["mp_rank_00_000", "mp_rank_00_001"]  # one per EP rank
        for fmt in FORMATS:
            assert ck[fmt]["same_keys"] and ck[fmt]["dense"] and ck[fmt]["expert"], (fmt, ck[fmt])
            assert ck[fmt]["resumed"] == ck["continued"], fmt


@pytest.mark.parametrize("optimizer_index,dp_file", [(0, "dp003"), (1, "dp001")],
                         ids=["dense_non_leader", "expert"])
def test_one_rank_failing_to_load_stops_every_rank(tmp_path, optimizer_index, dp_file):
    """A truncated LoCo file read by one rank only (dense optimizer: DP rank 3's own file, in
    EP rank 1's directory, where DP rank 1 reads the metadata) used to hang: the failed rank
    skipped the expert optimizer's DP-group collective its partner waited in. Every rank now
    raises, the failed one naming the file, the others the failed rank."""
    errors = run_ranks(corrupt_load_worker, 4, str(tmp_path), optimizer_index, dp_file,
                       timeout_s=180)
    assert all(errors), errors
    assert any(f"loco_state_{optimizer_index}_{dp_file}.pt" in e for e in errors), errors
    assert any("loading the checkpoint failed on rank" in e for e in errors), errors


@pytest.mark.parametrize("world,ep,dense,expert", [
    # EP 1: megatron-core keeps the experts in the dense buffer (one buffer, all parameters)
    (2, 1, "data-parallel group of 2 ranks", None),
    # EP 2 on 2 ranks: the expert-DP group has 1 rank, the expert gradients are not sent
    (2, 2, "data-parallel group of 2 ranks",
     "expert data-parallel group of 1 rank: not communicated (nothing to reduce)"),
    # EP 2 on 4 ranks: dense over 4 ranks, experts compressed over the 2-rank expert-DP group
    (4, 2, "data-parallel group of 4 ranks",
     "reduce-scattered over its expert data-parallel group of 2 ranks, compressed at 4 bits"),
])
def test_startup_lines_name_every_gradient_buffer(world, ep, dense, expert):
    """One start-up line per gradient buffer, dense and expert, saying whether it is
    compressed (and over which group), or not communicated and why; the chunk's totals are
    the sum of the compressed buffers' figures."""
    lines = run_ranks(startup_lines_worker, world, ep, timeout_s=600)[0]
    buffers = [line for line in lines if "gradient buffer" in line]
    kinds = [line.split(" gradient buffer")[0].rsplit(", ", 1)[1] for line in buffers]
    assert kinds == (["dense"] if expert is None else ["dense", "expert"]), lines
    assert f"reduce-scattered over its {dense}, compressed at 4 bits: " in buffers[0], buffers[0]
    if expert is not None:
        assert expert in buffers[1], buffers[1]
    figures = re.compile(r"(\d+) bytes/step per rank on the wire vs (\d+) stock")
    per_buffer = [tuple(map(int, figures.search(line).groups())) for line in buffers
                  if "compressed at" in line]
    assert len(per_buffer) == (2 if world == 4 else 1)
    total = [line for line in lines if line.startswith("> LoCo: model chunk 0: ")][0]
    assert tuple(map(int, figures.search(total).groups())) == tuple(map(sum, zip(*per_buffer)))
