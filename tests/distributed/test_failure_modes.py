"""Failure modes on a 2-rank DP grid (RELIABILITY.md): ranks that disagree on a
bucket's layout fail at start-up with the same clear error, NaN/Inf in one rank's gradients with
megatron's NaN check off never enters an error buffer (the bad block skips its update) and is
reported in a warning. CPU ranks: gloo + CUDA emulation, the tiny GPT of worker_megatron."""

import pytest
import torch

from loco_megatron.kernels import block_table

from tests.helpers.multiproc import run_ranks
from .worker_failures import MISMATCHES, agreement_worker, nan_worker, per_token_loss_worker

EXPECTED = {  # mismatch -> (field named, rank 0's value, rank 1's value)
    "block_size": ("block_size", "256", "128"),
    "bits_4_vs_8": ("bits", "4", "8"),
    "bits_4_vs_off": ("bits", "4", "'off (full precision)'"),
    "bucket_size": ("numel", None, None),
    "grad_dtype": ("dtype", "'float32'", "'bfloat16'"),
    "error_dtype": ("error_dtype", "'int8'", "'fp32'"),
}


@pytest.fixture(scope="module")
def agreement():
    # one spawn for all mismatches: after a refusal both ranks are at the same point again
    return run_ranks(agreement_worker, 2, list(MISMATCHES), timeout_s=600)


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_disagreeing_ranks_fail_at_startup_naming_the_field(agreement, name):
    field, v0, v1 = EXPECTED[name]
    for rank, out in enumerate(agreement):
        msg = out[name]
        assert msg is not None, (name, rank)
        assert msg.startswith("LoCo: the ranks of data-parallel group [0, 1] disagree"), msg
        assert f", {field}: global rank 0 has" in msg, msg
        if v0 is not None:
            assert f"global rank 0 has {v0}, global rank 1 has {v1}" in msg, msg
        assert "--loco-* flags" in msg and out[name + ".calls"] == 0
    assert agreement[0][name] == agreement[1][name]  # every rank raises the same error


def test_per_token_loss_refused_when_the_model_is_wrapped():
    """--calculate-per-token-loss (TransformerConfig.calculate_per_token_loss): megatron divides
    by the token count after the reduce-scatter, so LoCo's carried error would change units
    between steps; refused at DDP construction with the reason, on every rank; LoCo off builds."""
    for out in run_ranks(per_token_loss_worker, 2, timeout_s=600):
        assert out[4] is not None and out[4].startswith(
            "--loco-bits cannot be used with --calculate-per-token-loss"), out
        assert "finalize_model_grads" in out[4]
        assert out[16] is None


def _block_of(buckets, index):
    """(bucket index, block index in the wire layout) of grad-buffer element ``index``."""
    for i, b in enumerate(buckets):
        local = index - b["offset"]
        for segs in b["layout"].segments:
            for src, dst, n in segs:
                if src <= local < src + n:
                    t = block_table(b["layout"], "cpu")
                    at = dst + local - src
                    inside = (t.off <= at) & (at < t.off + t.length)
                    return i, int(inside.nonzero())
    raise AssertionError(f"element {index} is in no bucket")


def _mask(t, blk, table):
    """True on the stored values of block ``blk`` (its scale, or its elements)."""
    if t.numel() == table.nblocks:
        m = torch.zeros(table.nblocks, dtype=torch.bool)
        m[blk] = True
        return m
    m = torch.zeros(t.numel(), dtype=torch.bool)
    at, n = int(table.off[blk]), int(table.length[blk])
    m[at:at + n] = True
    return m


@pytest.mark.parametrize("storage", ["int8", "fp32"])
def test_nonfinite_gradient_skips_the_error_update_of_its_block(storage):
    """check_for_nan_in_grad off, a NaN (step 1) then an inf (step 2) in rank 1's gradients:
    the block holding it keeps its previous error bit for bit, every other block of every
    bucket is updated, no error buffer holds a NaN/inf, rank 1 logs one warning per bad step
    (rank 0 none), and the steps after train on."""
    results = run_ranks(nan_worker, 2, storage, timeout_s=600)
    rank1 = results[1]
    buckets = rank1["buckets"]
    for rank, res in enumerate(results):
        for step, st in enumerate(res["steps"]):
            for key, fields in st["after"].items():
                for name, t in fields.items():
                    assert torch.isfinite(t.float()).all(), (rank, step, key, name)
            bad = rank == 1 and step in (1, 2)
            assert len(st["warnings"]) == int(bad), (rank, step, st["warnings"])
            assert st["nonfinite"] == (0 if rank == 0 else min(max(step, 0), 2)), (rank, step)
            if step == 0:
                continue
            if bad:
                i, blk = _block_of(buckets, st["bad_index"])
                bad_key = buckets[i]["key"]
                assert "1 quantization block(s)" in st["warnings"][0]
                assert str(bad_key) in st["warnings"][0]
            for key, fields in st["after"].items():
                table = block_table(next(b["layout"] for b in buckets if b["key"] == key), "cpu")
                for name, t in fields.items():
                    old = st["before"][key][name]
                    if bad and key == bad_key:
                        m = _mask(t, blk, table)
                        assert torch.equal(t[m], old[m]), (step, name)
                        t, old = t[~m], old[~m]
                    assert not torch.equal(t, old), (rank, step, key, name)  # updated


def test_hierarchical_ranks_with_different_local_world_size_disagree(monkeypatch):
    """--loco-hierarchical takes the node topology (both stages' split sizes) from each rank's
    LOCAL_WORLD_SIZE: ranks that read different values would hang in the first all-to-all
    (reproduced with 4 ranks, LOCAL_WORLD_SIZE 2, 2, 4, 4), so the start-up descriptions must
    differ there; flat LoCo does not depend on it."""
    from loco_megatron.agreement import _first_difference, describe
    from loco_megatron.config import LoCoConfig
    from loco_megatron.layout import BucketLayout

    layout = BucketLayout.build(4 * 640, 4, 64)
    grad = torch.zeros(4 * 640)
    rows = {}
    for hierarchical in (True, False):
        cfg = LoCoConfig(bits=4, block_size=64, hierarchical=hierarchical)
        for lws in ("2", "4"):
            monkeypatch.setenv("LOCAL_WORLD_SIZE", lws)
            rows[hierarchical, lws] = [describe(cfg, (0, 0, 0), layout, grad)]
    problem = _first_difference([rows[True, "2"], rows[True, "4"]], [0, 2])
    assert problem == ("bucket (0, 0, 0) (#0 in the group), LOCAL_WORLD_SIZE: global rank 0 has "
                       "'2', global rank 2 has '4'"), problem
    assert _first_difference([rows[False, "2"], rows[False, "4"]], [0, 2]) == ""
