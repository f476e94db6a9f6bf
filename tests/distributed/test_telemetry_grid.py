"""LoCo telemetry on megatron-core GPT + DDP + DistributedOptimizer (CPU ranks, gloo): every
figure equals an independent reference computed from the compensator's inputs and state and
from the bytes actually handed to the all-to-alls."""

import math

import pytest

from .worker_telemetry import telemetry_worker

WINDOWS = (range(0, 1), range(1, 4))  # reduce after step 1, then after steps 2-4


@pytest.mark.parametrize("tp,world", [pytest.param(1, 2, id="TP1xDP2"),
                                      pytest.param(2, 4, id="TP2xDP2")])
def test_figures_equal_independent_reference(tp, world, run_ranks):
    """Norms: global over all ranks (DP and TP), averaged over the window's steps; relative
    tolerance 1e-5 (fp32 device sums vs fp64 reference). Bytes: exact."""
    results = run_ranks(telemetry_worker, world, tp, True)
    rows = results[0]["rows"]  # [rank][step] = (err_sq, buf_sq, bytes sent)
    assert results[0]["num_buckets"] > 1  # overlap on: several buckets per step
    for res in results:
        assert res["rows"] == rows
        assert res["timers"] == ["loco-comm", "loco-compress", "loco-decompress"]
        for fig, steps in zip(res["figures"], WINDOWS):
            err = sum(math.sqrt(sum(r[s][0] for r in rows)) for s in steps) / len(steps)
            buf = sum(math.sqrt(sum(r[s][1] for r in rows)) for s in steps) / len(steps)
            sent = [sum(r[s][2] for s in steps) for r in rows]
            stock = sum(x["stock_per_step"] for x in results) * len(steps)
            assert fig.steps == len(steps) and fig.nonfinite_steps == 0
            assert err > 0 and abs(fig.error_norm - err) <= 1e-5 * err, (fig.error_norm, err)
            assert buf > 0 and abs(fig.buffer_norm - buf) <= 1e-5 * buf, (fig.buffer_norm, buf)
            assert fig.bytes_per_step * len(steps) == max(sent)
            assert fig.stock_bytes_per_step == max(x["stock_per_step"] for x in results)
            assert fig.compression_ratio == stock / sum(sent)
