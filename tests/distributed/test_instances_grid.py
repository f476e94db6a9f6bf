"""LoCo with two distributed-optimizer instances (``--num-distributed-optimizer-instances 2``):
world 4 = 2 instances x DP 2, overlap off and on, on CPU ranks (gloo + CUDA emulation).

megatron-core reduce-scatters inside each instance and all-reduces the shard across instances in
full precision; LoCo compresses the intra-instance reduce-scatter, so a reduced shard is the
exact sum over all 4 ranks within the sum of the 4 ranks' half quantization steps.
"""

import torch

from .worker_instances import instances_worker
from .worker_resume import FORMATS

STEPS = 6


def test_two_distributed_optimizer_instances(tmp_path, run_ranks):
    for res in run_ranks(instances_worker, 4, STEPS, str(tmp_path)):
        assert (res["dp"], res["intra"]) == (4, 2)
        for overlap in (False, True):
            stock, bits16, loco = (res[overlap, m] for m in ("stock", "bits16", "loco4"))
            # LoCo off (bits 16): bit-identical to stock megatron-core
            assert bits16["losses"] == stock["losses"]
            assert all(torch.equal(stock["params"][n], bits16["params"][n])
                       for n in stock["params"])
            assert (stock["num_bucket_groups"] > 1) == overlap
            # LoCo 4-bit: every bucket compressed every step, inside the 2-rank instance
            c = loco["counters"]
            assert c["buckets"] == stock["num_bucket_groups"]
            assert c["calls"] == c["compress"] == STEPS * c["buckets"]
            assert loco["sizes"] == [2]
            # shards within the bound of the exact 4-rank sum (after the inter-instance
            # all-reduce)
            assert 0 < loco["shard_check"] <= 1.0, loco["shard_check"]
            assert loco["losses"] != stock["losses"]
            assert loco["losses"][-1] < 0.85 * loco["losses"][0], loco["losses"]
        # checkpoint of the overlapped run: each instance's error buffers restored bit for bit
        ck = res[True, "loco4"]["ckpt"]
        assert ck["nonzero"] == {"dense": True}
        for fmt in FORMATS:
            assert ck[fmt]["same_keys"] and ck[fmt]["dense"], (fmt, ck[fmt])
            assert ck[fmt]["resumed"] == ck["continued"], fmt
        files = ck["torch_files"]  # instance 1 writes its own exact error buffers
        assert {"loco_state_0_dp000.pt", "loco_state_0_dp001.pt", "loco_state_0_dp000_inst1.pt",
                "loco_state_0_dp001_inst1.pt"} <= set(files), files
