"""LoCo under pipeline parallelism: PP2 x DP2 on 4 CPU ranks (gloo + CUDA emulation).

A tiny megatron-core GPTModel split over 2 stages, trained by megatron-core's own schedule
(worker_pipeline.py): 1F1B without virtual chunks (overlap_grad_reduce off, gradients
reduced in finalize_model_grads), and the interleaved schedule with 2 virtual chunks per rank
(overlap_grad_reduce on: no_sync_func / grad_sync_func as megatron.training sets them).
Embeddings are tied between the first and last stage (megatron's default).
"""

import torch

from .worker_pipeline import pipeline_worker

STEPS = 6
CASES = ((None, False), (2, True))  # (virtual chunks per rank, overlap_grad_reduce)


def test_pipeline_pp2_dp2_with_and_without_virtual_chunks(run_ranks):
    results = run_ranks(pipeline_worker, 4, CASES, ("stock", "bits16", "loco4"), STEPS)
    for rank, per_case in enumerate(results):
        for (vp, overlap), res in per_case.items():
            check_case(rank, vp, overlap, res)


def check_case(rank, vp, overlap, res):
    """Assertions for one rank of one (vp, overlap) case."""
    where = f"rank {rank} vp={vp} overlap={overlap}"
    stock, bits16, loco = res["stock"], res["bits16"], res["loco4"]
    last_stage = stock["stage"] == 1
    assert stock["stage"] == rank // 2  # megatron's default order: PP outermost, DP inside
    # LoCo off (bits 16): bit-identical to stock, losses (last stage) and every parameter
    assert bits16["losses"] == stock["losses"], where
    assert len(stock["params"]) == (vp or 1)
    for chunk_stock, chunk_bits16 in zip(stock["params"], bits16["params"]):
        assert chunk_stock.keys() == chunk_bits16.keys()
        assert all(torch.equal(chunk_stock[n], chunk_bits16[n]) for n in chunk_stock), where
    # tied embeddings: first stage's word embedding == last stage's output weight, exactly,
    # after finalize_model_grads' embedding all-reduce of the (LoCo-)reduced shards
    for mode in (stock, bits16, loco):
        assert mode["tied_drift"] == 0.0, where
    # LoCo 4-bit: every chunk on this stage compressed every bucket of every step, error
    # buffers keyed (chunk in DDP construction order, buffer, bucket)
    c = loco["counters"]
    assert c["chunks"] == len(c["keys"]) == (vp or 1), where
    for chunk, keys in enumerate(c["keys"]):
        assert keys and all(key[0] == chunk for key in keys), (where, c["keys"])
    all_keys = [key for keys in c["keys"] for key in keys]
    assert len(set(all_keys)) == len(all_keys) == c["buckets"]
    assert c["steps"] == {key: STEPS for key in all_keys}, where
    assert c["calls"] == c["compress"] == STEPS * c["buckets"], where
    # overlap on: every reduce-scatter was launched during the backward passes (by DDP's hooks /
    # grad_sync_func), before finalize_model_grads waits on them; off: launched in finalize
    launched = [(t + overlap) * c["buckets"] for t in range(STEPS)]
    assert c["calls_at_finalize"] == launched, (where, c["calls_at_finalize"])
    if overlap and rank < 2:  # first stage, first chunk: bucketed (megatron: later ones not)
        assert loco["buckets_per_chunk"][0] > 1
    # reduced shards within the quantization bound of the exact reduction (for the tied
    # embedding's bucket: of the sum over both stages' DP ranks)
    assert loco["shard_check"] <= 1.0, (where, loco["shard_check"])
    if not last_stage:
        assert stock["losses"] == loco["losses"] == [None] * STEPS
        return
    # loss falls, and LoCo really changed the run but stays close to stock
    first, last = loco["losses"][0], loco["losses"][-1]
    assert last < 0.85 * first, (where, loco["losses"])
    assert all(b < a for a, b in zip(loco["losses"], loco["losses"][1:])), (where, loco["losses"])
    assert loco["losses"] != stock["losses"], where
    assert abs(last - stock["losses"][-1]) < 0.05 * stock["losses"][0], (where, loco["losses"],
                                                                          stock["losses"])
