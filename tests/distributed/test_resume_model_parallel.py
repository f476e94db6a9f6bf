"""Resume at another tensor-parallel size: every rank takes the same LoCo decision.

LoCo's checkpointed state is keyed by DP group. Saved at TP1 x DP4 and resumed at TP2 x DP2,
TP rank 0 found a layout it could not map and TP rank 1 found nothing; their step counters
differed, so the periodic reset fell on different steps on the two TP ranks and the
TP-replicated parameters (LayerNorms, row-parallel biases) drifted apart. Now the load is
agreed over every rank (loco_megatron/megatron/checkpoint/agree.py): one true message, equal
counters, replicas bit-identical at every step for more than two reset intervals.
torch_dist with the fully reshardable optimizer format (``--dist-ckpt-optim-fully-
reshardable``, which stock megatron-core needs for a TP change).
"""

import os

import pytest

from loco_megatron.megatron import compat

from tests.distributed.worker_ckpt import ckpt_worker
from tests.helpers.multiproc import run_ranks

LOCO4 = dict(bits=4, block_size=64, reset_interval=3)
SAVED_STEPS, RESUMED_STEPS = 4, 7  # resets at 6 and 9: two intervals after the resume


def _save(d):
    return {"phase": "save", "config": LOCO4, "steps": SAVED_STEPS, "formats": ["torch_dist"],
            "dir": d, "sharding": "fully"}


def _load(d, strict=None):
    return {"phase": "load", "config": LOCO4, "steps": RESUMED_STEPS, "format": "torch_dist",
            "dir": os.path.join(d, "torch_dist"), "sharding": "fully", "tp_drift": True,
            "strict": strict}


def _check(results, tp_before, tp_after):
    loads = [r[0] for r in results]
    for r in loads:
        assert "error" not in r, r.get("error")
    # replicas across TP ranks identical after every step (resets at 6 and 9 included)
    assert all(d == 0.0 for r in loads for d in r["tp_drift"]), [r["tp_drift"] for r in loads]
    # one counter value per rank and step, the same on every rank, continuing from the save
    per_step = [r["step_counters"] for r in loads]
    assert all(c == per_step[0] for c in per_step), per_step
    assert per_step[0] == [[SAVED_STEPS + i + 1] for i in range(RESUMED_STEPS)], per_step[0]
    logs = [line for r in loads for line in r["logs"]]
    assert len(logs) == 1, logs  # said once, and true
    assert f"model-parallel layout changed TP{tp_before}" in logs[0], logs
    assert f"-> TP{tp_after}" in logs[0] and "every rank resets them to zero" in logs[0], logs
    assert f"step counters continue at {SAVED_STEPS}" in logs[0], logs
    assert "saved without LoCo" not in logs[0]


@pytest.mark.skipif(not compat.supports_uneven_sharded_tensors(),
                    reason="torch_dist LoCo state across a reshard needs megatron-core >= 0.15")
@pytest.mark.parametrize("tp_before,tp_after", [(1, 2), (2, 1)], ids=["TP1xDP4-TP2xDP2",
                                                                       "TP2xDP2-TP1xDP4"])
def test_resume_at_another_tp_size_keeps_replicas_identical(tmp_path, tp_before, tp_after):
    """TP 1 -> 2 also under ``--dist-ckpt-strictness raise_all``: the saved LoCo keys of DP
    groups and buckets that no longer exist are optional, not missing."""
    d = str(tmp_path)
    run_ranks(ckpt_worker, 4, tp_before, [_save(d)])
    _check(run_ranks(ckpt_worker, 4, tp_after, [_load(d, "raise_all" if tp_after == 2 else None)]),
           tp_before, tp_after)


@pytest.mark.skipif(not compat.supports_uneven_sharded_tensors(),
                    reason="torch_dist LoCo state across a reshard needs megatron-core >= 0.15")
@pytest.mark.parametrize("pp_before,pp_after", [(2, 1), (1, 2)], ids=["PP2xDP2-PP1xDP4",
                                                                       "PP1xDP4-PP2xDP2"])
def test_resume_at_another_pp_size_keeps_tied_embeddings_identical(tmp_path, pp_before,
                                                                   pp_after):
    """The word embedding of the first stage and the output weight of the last are one
    parameter on two pipeline ranks: they stay identical after a resume at another PP size."""
    from tests.distributed.worker_resume_pp import pp_resume_worker

    d = str(tmp_path)
    run_ranks(pp_resume_worker, 4, pp_before, "save", d, LOCO4, SAVED_STEPS)
    loads = run_ranks(pp_resume_worker, 4, pp_after, "load", d, LOCO4, RESUMED_STEPS)
    assert all(x == 0.0 for r in loads for x in r["tied_drift"]), [r["tied_drift"] for r in loads]
    per_step = [r["step_counters"] for r in loads]
    assert all(c == per_step[0] for c in per_step), per_step
    assert per_step[0] == [[SAVED_STEPS + i + 1] for i in range(RESUMED_STEPS)], per_step[0]
    logs = [line for r in loads for line in r["logs"]]
    assert len(logs) == 1 and f"PP{pp_before}" in logs[0] and f"-> TP1 PP{pp_after}" in logs[0], logs


@pytest.mark.skipif(compat.fully_reshardable_sharding_type() != "fully_reshardable",
                    reason="an EP change needs the fully_reshardable format (megatron-core 0.15+)")
def test_resume_at_another_ep_size_agrees(tmp_path):
    """MoE saved at EP 2 (expert-DP 2), resumed at EP 4 (expert-DP 1, where nothing of the
    experts is compressed): equal step counters on every rank at every step, one message naming
    the change."""
    from tests.distributed.worker_resume_ep import ep_resume_worker

    d = str(tmp_path / "ckpt")
    run_ranks(ep_resume_worker, 4, 2, "save", d, LOCO4, SAVED_STEPS)
    loads = run_ranks(ep_resume_worker, 4, 4, "load", d, LOCO4, RESUMED_STEPS)
    per_step = [r["step_counters"] for r in loads]
    assert all(c == per_step[0] for c in per_step), per_step
    # compressed (dense) buckets continue from the save; expert buckets at expert-DP 1 send
    # nothing and keep the agreed counter
    assert per_step[0] == [[SAVED_STEPS, SAVED_STEPS + i + 1] for i in range(RESUMED_STEPS)]
    logs = [line for r in loads for line in r["logs"]]
    assert len(logs) == 1 and "EP2" in logs[0] and "-> TP1 PP1 EP4" in logs[0], logs
