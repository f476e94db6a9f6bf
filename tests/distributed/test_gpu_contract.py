"""The GPU contract, checked on the CPU (docs/kernels.md, "GPU contract"): in steady state
(step >= 3; no logging step here: LoCo's telemetry is off) LoCo's step makes no call that on a
GPU would block the host (``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero``, boolean-mask
indexing, a device or event synchronize, ...) or copy pageable memory to the device, and builds
no tensor from host data, with more than 500 buckets of distinct layouts (one per parameter;
with overlap off megatron makes one bucket per buffer), megatron's timers at ``--timing-log-level 2``, overlap on
and off: flat LoCo, ``--loco-param-bits 4`` (its
``buckets x DP`` shard layouts), ``--loco-full-precision-1d`` and the hierarchical mode (2 nodes
x 2 ranks), each with overlap on and off. With overlap on, megatron runs LoCo's compress, its
launches and the hierarchical inter-node stage from its backward hooks, where the counter
re-enters itself (``HOOK_ENTRIES``). The mutation test rides on each leg: after the steady steps,
one more step with a host sync planted in ``Compensator.compress`` (and, hierarchical, in
``HierarchicalWork.issue_inter``) must be seen once per call (:data:`~.worker_gpu_contract.PLANTS`).
On a logging step with LoCo's telemetry on, at most
:data:`~.worker_gpu_contract.LOGGING_BOUND` (the metrics' reduction), whatever the buckets.
Counted by :class:`loco_megatron.emulation.host_sync.HostSyncCounter` under the CPU
emulation; calls attributed to megatron-core itself (its optimizer's norm, its own timers) are
not LoCo's and are reported, not asserted. Before: the 512-entry block-table cache missed on
every bucket of the parameter path, the weight difference built an error buffer per bucket,
and LoCo's megatron timers synchronized three times per bucket."""

import pytest

from .worker_gpu_contract import LOGGING_BOUND, contract_worker

MIN_BUCKETS = 500


def _check(results, overlap=True):
    for res in results:  # megatron builds one bucket per buffer with overlap off
        assert res["buckets"] >= (MIN_BUCKETS if overlap else 1), res["buckets"]
        assert res["loco_calls"] > 0  # LoCo did send (a case that sent nothing proves nothing)
        for loco, summary, _ in res["steps"]:
            assert loco == 0, summary
        for name, (calls, seen, summary) in res["planted"].items():  # the mutation test: a
            assert calls > 0 and seen == calls, (name, calls, summary)  # sync in each call seen
        if res["streams"] is not None:  # one step under the stream log, overlap on
            assert res["streams"]["hazards"] == [], res["streams"]["hazards"]
            assert res["streams"]["compress"] and "default" not in res["streams"]["compress"]


@pytest.mark.parametrize("case", ["flat", "param4", "fp1d"])
@pytest.mark.parametrize("overlap", [False, True], ids=["overlap_off", "overlap_on"])
def test_no_host_sync_per_step(run_ranks, case, overlap):
    _check(run_ranks(contract_worker, 2, case, overlap), overlap)


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap_off", "overlap_on"])
def test_no_host_sync_per_step_hierarchical(run_ranks, overlap):
    _check(run_ranks(contract_worker, 4, "hierarchical", overlap, local_world_size=2), overlap)


def test_logging_step_bounded_and_other_steps_free_with_metrics(run_ranks):
    """LoCo's telemetry on (error norms per bucket, summed on the device): still nothing on the
    steady steps; the logging step reads the window back within the bound."""
    for res in run_ranks(contract_worker, 2, "flat", True, True):
        _check([res])
        loco, summary, window = res["logging"]
        assert window == 5 and loco <= LOGGING_BOUND, summary
