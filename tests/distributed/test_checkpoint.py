"""LoCo error buffers through megatron-core checkpoints (torch and torch_dist), docs/architecture.md (checkpoints).

Every phase runs in new processes (worker_ckpt.py): straight 2N steps vs N steps, save,
new processes, load, N more; DP-size changes 4 -> 2 and 2 -> 4; the resume policy's warnings;
corrupted files. The reset interval (3) falls inside the resumed half.
"""

import glob
import os
import shutil

import pytest
import torch

from loco_megatron.megatron import compat

from tests.distributed.worker_ckpt import ckpt_worker
from tests.helpers.multiproc import run_ranks

N = 3
LOCO4 = dict(bits=4, block_size=64, reset_interval=3)
FORMATS = ["torch", "torch_dist"]
# Formats that carry the DP-summed error (DP-size or padding change): torch_dist needs
# megatron-core >= 0.15 for its uneven shards (docs/compatibility.md).
SUM_FORMATS = FORMATS if compat.supports_uneven_sharded_tensors() else ["torch"]


def _save_jobs(d, config=LOCO4):
    return [{"phase": "straight", "config": config, "steps": 2 * N},
            {"phase": "save", "config": config, "steps": N, "formats": FORMATS, "dir": d}]


def _load(d, fmt, config=LOCO4, steps=N):
    return {"phase": "load", "config": config, "steps": steps, "format": fmt,
            "dir": os.path.join(d, fmt)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """TP1xDP2 checkpoints: LoCo 4-bit (int8 errors), without LoCo, and the straight runs."""
    root = tmp_path_factory.mktemp("ckpt")
    dp2, plain = str(root / "dp2"), str(root / "plain")
    results = run_ranks(ckpt_worker, 2, 1, _save_jobs(dp2) + [
        {"phase": "save", "config": {"bits": 16}, "steps": N, "formats": FORMATS, "dir": plain}])
    return {"root": root, "dp2": dp2, "plain": plain, "results": results}


def _assert_resumed_exactly(straight, first, second):
    assert first["losses"] + second["losses"] == straight["losses"]
    for name, p in straight["params"].items():
        assert torch.equal(p, second["params"][name]), name
    assert straight["errors"].keys() == second["errors"].keys() and straight["errors"]
    for key, fields in straight["errors"].items():
        for f in ("codes", "scales"):
            assert torch.equal(fields[f], second["errors"][key][f]), (key, f)
        assert torch.equal(first["errors"][key]["codes"], second["errors_after_load"][key]["codes"])
    assert second["steps"] == straight["steps"]
    assert first["resets"] + second["resets"] == straight["resets"] > 0  # reset at step 3
    assert second["logs"] == []  # exact restore: no warning


def test_resume_bit_identical_tp1_dp2(saved):
    loads = run_ranks(ckpt_worker, 2, 1, [_load(saved["dp2"], f) for f in FORMATS])
    for rank in range(2):
        straight, first, _ = saved["results"][rank]
        for i, _fmt in enumerate(FORMATS):
            _assert_resumed_exactly(straight, first, loads[rank][i])


def test_resume_bit_identical_tp2_dp2(tmp_path):
    d = str(tmp_path)
    saves = run_ranks(ckpt_worker, 4, 2, _save_jobs(d))
    loads = run_ranks(ckpt_worker, 4, 2, [_load(d, f) for f in FORMATS])
    for rank in range(4):
        for i, _fmt in enumerate(FORMATS):
            _assert_resumed_exactly(saves[rank][0], saves[rank][1], loads[rank][i])


def _compare_sums(before, after, tol):
    """DP-sums are in each run's bucket space; the padding at the end differs with DP size."""
    assert before.keys() == after.keys() and before
    for key in before:
        a, b = before[key], after[key]
        n = min(a.numel(), b.numel())
        assert not a[n:].any() and not b[n:].any()
        scale = float(a.abs().max())
        assert float((a[:n] - b[:n]).abs().max()) <= tol * scale, key


def test_dp_size_change_4_to_2_keeps_summed_error(saved):
    """fp32 error storage: the summed error survives up to one fp32 rounding of the sum; also
    under ``--dist-ckpt-strictness raise_all`` (the exact form LoCo cannot use at DP 2 is
    optional, not missing)."""
    fp32 = dict(LOCO4, error_dtype="fp32")
    d = str(saved["root"] / "dp4")
    saves = run_ranks(ckpt_worker, 4, 1, [
        {"phase": "save", "config": fp32, "steps": N, "formats": SUM_FORMATS, "dir": d}])
    strict = [dict(_load(d, "torch_dist", fp32, steps=2), strict="raise_all")
              ] if "torch_dist" in SUM_FORMATS else []
    loads = run_ranks(ckpt_worker, 2, 1, [_load(d, f, fp32, steps=2) for f in SUM_FORMATS]
                      + strict)
    before = saves[0][0]["sum_before_save"]
    for i, fmt in enumerate(SUM_FORMATS + ["torch_dist raise_all"] * len(strict)):
        assert "error" not in loads[0][i], (fmt, loads[0][i].get("error"))
        _compare_sums(before, loads[0][i]["sum_after_load"], tol=1e-6)
        logs = [line for r in range(2) for line in loads[r][i]["logs"]]
        assert len(logs) == 1 and "DP size changed 4 -> 2" in logs[0], (fmt, logs)
        assert all(torch.isfinite(torch.tensor(loads[r][i]["losses"])).all() for r in range(2))


def test_dp_size_change_2_to_4_keeps_summed_error(saved):
    """int8 error storage: the restored sum is re-stored in int8 (half a step of absmax/127)."""
    loads = run_ranks(ckpt_worker, 4, 1, [_load(saved["dp2"], f, steps=2) for f in SUM_FORMATS])
    before = saved["results"][0][1]["sum_before_save"]
    for i, fmt in enumerate(SUM_FORMATS):
        _compare_sums(before, loads[0][i]["sum_after_load"], tol=0.5 / 127 * 1.001)
        logs = [line for r in range(4) for line in loads[r][i]["logs"]]
        assert len(logs) == 1 and "DP size changed 2 -> 4" in logs[0], (fmt, logs)
        assert len(loads[0][i]["losses"]) == 2


#: every ``dist_checkpointing`` strictness (Megatron-LM's ``--dist-ckpt-strictness``;
#: megatron/core/dist_checkpointing/validation.py ``StrictHandling``)
STRICTNESS = ["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected",
              "raise_all", "return_unexpected", "return_all", "ignore_all"]


@pytest.mark.skipif(not compat.supports_uneven_sharded_tensors(),
                    reason="both error forms are saved from megatron-core 0.15 on")
def test_every_strictness_loads_a_loco_checkpoint(saved):
    """``torch_dist`` at the same layout under every strictness, ``raise_all`` and
    ``return_all`` (no missing or unexpected key) included: the DP-summed form LoCo does not
    read is optional, and the restore is exact. Also under ``raise_all``: LoCo off loading a
    LoCo checkpoint (nothing of it is read) and LoCo on loading a checkpoint without LoCo."""
    jobs = [dict(_load(saved["dp2"], "torch_dist"), strict=s) for s in STRICTNESS]
    jobs += [dict(_load(saved["dp2"], "torch_dist", {"bits": 16}, 1), strict="raise_all"),
             dict(_load(saved["plain"], "torch_dist", LOCO4, 1), strict="raise_all")]
    loads = run_ranks(ckpt_worker, 2, 1, jobs)
    for rank in range(2):
        straight, first, _ = saved["results"][rank]
        for i, strictness in enumerate(STRICTNESS):
            assert "error" not in loads[rank][i], (strictness, loads[rank][i].get("error"))
            _assert_resumed_exactly(straight, first, loads[rank][i])
        for extra in loads[rank][len(STRICTNESS):]:
            assert "error" not in extra and len(extra["losses"]) == 1, extra.get("error")


def test_resume_policy_warnings(saved):
    jobs, expect = [], []
    for fmt in FORMATS:
        jobs += [_load(saved["plain"], fmt, steps=1), _load(saved["dp2"], fmt, {"bits": 16}, 1),
                 _load(saved["dp2"], fmt, dict(LOCO4, bits=8), 1),
                 _load(saved["dp2"], fmt, dict(LOCO4, block_size=128), 1),
                 _load(saved["dp2"], fmt, dict(LOCO4, grid="full-range"), 1)]
        expect += ["has no LoCo state (saved without LoCo, or at DP size 1 where nothing is "
                   "compressed); error buffers start from zero",
                   "holds LoCo error buffers but LoCo is off (--loco-bits 16); they are ignored",
                   "bits changed 4 -> 8", "block_size changed 64 -> 128",
                   "grid changed symmetric -> full-range"]
    results = run_ranks(ckpt_worker, 2, 1, jobs + [_load(saved["dp2"], f, None, 1) for f in FORMATS])
    for r0 in results[0][len(jobs):]:  # stock megatron-core (no loco_megatron) loads them too
        assert "error" not in r0 and len(r0["losses"]) == 1 and r0["logs"] == []
    for job, text, r0, r1 in zip(jobs, expect, results[0], results[1]):
        assert "error" not in r0, r0.get("error")
        assert len(r0["logs"]) == 1 and text in r0["logs"][0], (job, r0["logs"])
        assert r1["logs"] == []  # logged once, on DP rank 0
        assert len(r0["losses"]) == 1
    straight = saved["results"][0][0]
    assert results[0][1]["errors"] == {}  # LoCo off: nothing compressed after the load
    assert results[0][0]["steps"] == {k: 1 for k in straight["steps"]}  # no LoCo state: from 0


def test_padding_change_at_same_dp_size_uses_the_summed_form(saved):
    """--ddp-pad-buckets-for-high-nccl-busbw pads buckets differently: the exact form no longer
    fits, the summed form does."""
    pad = {"pad_buckets_for_high_nccl_busbw": True}
    jobs = [dict(_load(saved["dp2"], f, steps=1), ddp=pad) for f in SUM_FORMATS]
    results = run_ranks(ckpt_worker, 2, 1, jobs)
    before = saved["results"][0][1]["sum_before_save"]
    for i in range(len(SUM_FORMATS)):
        r0 = results[0][i]
        assert "error" not in r0, r0.get("error")
        assert len(r0["logs"]) == 1 and "bucket padding changed at DP size 2" in r0["logs"][0]
        _compare_sums(before, r0["sum_after_load"], tol=0.5 / 127 * 1.001)


def test_dp_size_1_drops_the_error_and_says_so(saved):
    results = run_ranks(ckpt_worker, 1, 1, [_load(saved["dp2"], f, steps=1) for f in FORMATS])
    for r in results[0]:
        assert len(r["logs"]) == 1 and "DP size changed 2 -> 1" in r["logs"][0], r["logs"]
        assert "saved error buffers are dropped" in r["logs"][0]


def test_loco_off_save_removes_stale_loco_files(tmp_path):
    """Saving again into the same directory with LoCo off leaves no LoCo file to misload."""
    d = str(tmp_path)
    results = run_ranks(ckpt_worker, 2, 1, [
        {"phase": "save", "config": LOCO4, "steps": 1, "formats": ["torch"], "dir": d},
        {"phase": "save", "config": {"bits": 16}, "steps": 1, "formats": ["torch"], "dir": d},
        _load(d, "torch", steps=1)])
    assert not glob.glob(os.path.join(d, "torch", "*", "loco_state_*"))
    assert "has no LoCo state" in results[0][2]["logs"][0]


def test_missing_rank_0_file_is_a_clear_error(saved, tmp_path):
    def drop_rank0(d):
        os.remove(glob.glob(os.path.join(d, "*", "loco_state_0_dp000.pt"))[0])

    results = _corrupt(saved, tmp_path, "torch", drop_rank0)
    msg = results[0][0]["error"]
    assert "loco_state_0_dp000.pt (DP rank 0's, with the metadata) is missing" in msg, msg


def test_missing_non_leader_file_is_the_same_error_on_every_rank(saved, tmp_path):
    """DP rank 1's file is missing: every rank stops with one line naming it (no rank is left
    to die in a collective)."""
    def drop_rank1(d):
        os.remove(glob.glob(os.path.join(d, "*", "loco_state_0_dp001.pt"))[0])

    results = _corrupt(saved, tmp_path, "torch", drop_rank1)
    for res in results:
        msg = res[0]["error"]
        assert "loco_state_0_dp001.pt is missing" in msg and "\n" not in msg, msg
        assert "Connection" not in msg, msg
    assert "failed on rank 1 of the group" in results[0][0]["error"]


def _corrupt(saved, tmp_path, fmt, how):
    d = tmp_path / fmt
    shutil.copytree(os.path.join(saved["dp2"], fmt), d)
    how(str(d))
    return run_ranks(ckpt_worker, 2, 1, [{"phase": "load", "config": LOCO4, "steps": 1,
                                          "format": fmt, "dir": str(d)}])


def _truncate(pattern):
    def how(d):
        for path in glob.glob(os.path.join(d, pattern), recursive=True):
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
    return how


def _retype_codes(d):
    for path in glob.glob(os.path.join(d, "**", "loco_state_*.pt"), recursive=True):
        state = torch.load(path, weights_only=True)
        entry = state["exact"]["gbuf_idx_0.bucket_idx_0"]
        entry["codes"] = entry["codes"].float()
        torch.save(state, path)


def _legacy_padded(d):
    """Make the checkpoint look like one of the padded wire format (before short last blocks):
    no ``meta["wire"]``, and the exact form in a longer layout (whole blocks)."""
    for path in glob.glob(os.path.join(d, "**", "loco_state_*.pt"), recursive=True):
        state = torch.load(path, weights_only=True)
        meta = state.get("meta")
        if meta:
            assert meta.pop("wire") == "packed"
            for b in meta["buckets"].values():
                b["error_numel"] += 64
        for entry in (state.get("exact") or {}).values():
            entry["codes"] = torch.cat((entry["codes"], torch.zeros(64, dtype=torch.int8)))
            entry["scales"] = torch.cat((entry["scales"], torch.zeros(1)))
        torch.save(state, path)


def test_padded_wire_format_checkpoint_resumes_from_the_summed_form(saved, tmp_path):
    """A checkpoint of the older padded wire format resumes: its exact form does not fit the
    packed layout, so every bucket is restored from the DP-summed form, with one warning."""
    results = _corrupt(saved, tmp_path, "torch", _legacy_padded)
    for rank, res in enumerate(results):
        assert "error" not in res[0], res[0].get("error")
        assert len(res[0]["losses"]) == 1 and torch.isfinite(torch.tensor(res[0]["losses"])).all()
        after = res[0]["errors_after_load"]  # the rank's shard of the sum: not zero
        assert after and any(bool(f["codes"].any()) for f in after.values()), (rank, after)
    logs = results[0][0]["logs"]
    assert len(logs) == 1 and "wire format changed padded -> packed" in logs[0], logs
    assert "resharded from the DP-summed form" in logs[0]


def test_truncated_torch_file_is_a_clear_error(saved, tmp_path):
    results = _corrupt(saved, tmp_path, "torch", _truncate("**/loco_state_*.pt"))
    for res in results:  # DP rank 0's file is read first, for the metadata
        msg = res[0]["error"]
        assert "loco_state_0_dp000.pt cannot be read" in msg and "truncated" in msg, msg


def test_stale_rank_file_is_refused(saved, tmp_path):
    """A file left by another save (other step counters) in the directory is not loaded."""
    def stale(d):
        path = glob.glob(os.path.join(d, "*", "loco_state_0_dp001.pt"))[0]
        state = torch.load(path, weights_only=True)
        for b in state["meta"]["buckets"].values():
            b["step"] += 1
        torch.save(state, path)

    results = _corrupt(saved, tmp_path, "torch", stale)
    msg = results[1][0]["error"]
    assert "loco_state_0_dp001.pt does not belong to the same save" in msg, msg


def test_corrupted_torch_entry_names_file_and_key(saved, tmp_path):
    results = _corrupt(saved, tmp_path, "torch", _retype_codes)
    for r, res in enumerate(results):
        msg = res[0]["error"]
        assert f"loco_state_0_dp00{r}.pt key loco.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.exact" \
               ".codes: expected" in msg and "torch.float32" in msg, msg


def test_truncated_torch_dist_checkpoint_fails_loudly(saved, tmp_path):
    results = _corrupt(saved, tmp_path, "torch_dist", _truncate("*.distcp"))
    assert all("error" in res[0] for res in results), [res[0].keys() for res in results]


def test_documented_error_state_bytes_match_the_saved_files(saved):
    """telemetry.error_state_bytes == tensor bytes in DP rank 0's torch-format LoCo file."""
    from loco_megatron.config import LoCoConfig
    from loco_megatron.layout import BucketLayout
    from loco_megatron.accounting import error_state_bytes

    path = glob.glob(os.path.join(saved["dp2"], "torch", "*", "loco_state_0_dp000.pt"))[0]
    state = torch.load(path, weights_only=True)
    meta = state["meta"]
    layouts = [BucketLayout.build(b["numel"], meta["dp_size"], LOCO4["block_size"],
                                  {i for r in b["params"] for i in r})
               for b in meta["buckets"].values()]
    assert [lay.world * lay.padded_shard for lay in layouts] == [
        b["error_numel"] for b in meta["buckets"].values()]
    tensors = [t for e in state["exact"].values() for t in e.values()] + [
        s["values"] for s in state["sum"].values()]
    on_disk = sum(t.numel() * t.element_size() for t in tensors)
    memory, disk = error_state_bytes(LoCoConfig(**LOCO4), layouts)
    assert disk == on_disk
    assert memory == sum(t.numel() * t.element_size() for e in state["exact"].values()
                         for t in e.values())


def test_torch_format_messages_said_once_across_tp_ranks(tmp_path):
    """``torch`` format at TP 2, DP 2: each TP rank reads its own ``mp_rank_XX`` directory;
    the message names the iteration directory and is logged once, not once per TP rank. (At
    DP 1 nothing is compressed, nothing is saved and nothing is said.)"""
    d = str(tmp_path)
    jobs = [{"phase": "save", "config": None, "steps": 2, "formats": ["torch"],
             "dir": os.path.join(d, "stock")},
            _load(os.path.join(d, "stock"), "torch", steps=1),
            {"phase": "save", "config": LOCO4, "steps": 2, "formats": ["torch"],
             "dir": os.path.join(d, "loco")},
            _load(os.path.join(d, "loco"), "torch", {"bits": 16}, 1)]
    results = run_ranks(ckpt_worker, 4, 2, jobs)
    for job, text in ((1, "has no LoCo state"), (3, "they are ignored")):
        logs = [line for r in results for line in r[job]["logs"]]
        assert len(logs) == 1 and text in logs[0], logs
        assert "mp_rank_" not in logs[0], logs


def test_bucket_size_change_continues_every_buckets_counter(saved, tmp_path):
    """Saved with one bucket per buffer at step N; resumed with several (another
    ``--ddp-bucket-size``, overlap on) from ``torch`` and from fully reshardable ``torch_dist``
    (dp_reshardable cannot change buckets): the errors reset with one warning naming the buckets,
    and every new bucket's step counter continues from N (the optimizer step), so with
    ``--loco-start-iter`` N none of them runs the full-precision warm-up again."""
    config = dict(LOCO4, start_iter=N)
    ddp = {"overlap": True, "bucket_size": 9000}
    fully = str(tmp_path / "fully")
    jobs = [dict(_load(saved["dp2"], "torch", config, 1), ddp=ddp),
            {"phase": "save", "config": LOCO4, "steps": N, "formats": ["torch_dist"],
             "dir": fully, "sharding": "fully"},
            dict(_load(fully, "torch_dist", config, 1), ddp=ddp, sharding="fully")]
    results = run_ranks(ckpt_worker, 2, 1, jobs)
    for r in results:
        for res in (r[0], r[2]):
            assert "error" not in res, res.get("error")
            assert len(res["steps"]) > 1, res["steps"]  # several buckets now
            assert set(res["steps"].values()) == {N + 1}, res["steps"]
            assert res["calls"] == len(res["steps"]), res  # every bucket compressed: no warm-up
    for res in (results[0][0], results[0][2]):
        logs = res["logs"]
        assert len(logs) == 1 and "cannot be mapped" in logs[0], logs
        assert "--ddp-bucket-size changed" in logs[0], logs


def test_param_bits_records_say_only_what_is_true(tmp_path):
    """At DP 1 (TP 2 on 2 ranks) nothing is saved and a resume with the same settings says
    nothing; a checkpoint saved with only ``--loco-param-bits`` (DP 2) holds no error state,
    which a resume with ``--loco-bits 4`` (and the same ``--loco-param-bits``) says as such, not
    as a changed setting."""
    both = dict(LOCO4, param_bits=4)
    dp1, param_only = str(tmp_path / "dp1"), str(tmp_path / "param_only")
    run_ranks(ckpt_worker, 2, 2, [{"phase": "save", "config": both, "steps": 2,
                                   "formats": FORMATS, "dir": dp1}])
    loads = run_ranks(ckpt_worker, 2, 2, [_load(dp1, f, both, 1) for f in FORMATS])
    assert all(r[i]["logs"] == [] and "error" not in r[i] for r in loads
               for i in range(len(FORMATS))), loads
    run_ranks(ckpt_worker, 2, 1, [{"phase": "save", "config": {"param_bits": 4}, "steps": 2,
                                   "formats": FORMATS, "dir": param_only}])
    loads = run_ranks(ckpt_worker, 2, 1, [_load(param_only, f, both, 1) for f in FORMATS])
    for i, fmt in enumerate(FORMATS):
        logs = [line for r in loads for line in r[i]["logs"]]
        assert len(logs) == 1 and "holds no error buffers (saved with --loco-bits None" in logs[0], (
            fmt, logs)
