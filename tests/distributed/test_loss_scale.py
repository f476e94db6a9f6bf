"""LoCo under megatron-core's fp16 loss scaling (loco_megatron/megatron/loss_scale.py).

An overflow step (megatron skips it) clears every error buffer; a loss-scale change rescales
them by new/old; megatron's ``check_for_nan_in_grad`` fires before any LoCo work. One spawn of
2 gloo ranks (CUDA emulation) runs every phase (worker_loss_scale.py); the tests below
assert on its results.
"""

import pytest
import torch

from tests.helpers.multiproc import run_ranks
from .worker_loss_scale import INF_STEP, INITIAL_SCALE, STEPS, WINDOW, loss_scale_worker


@pytest.fixture(scope="module")
def results():
    return run_ranks(loss_scale_worker, 2)


@pytest.mark.parametrize("error_dtype,growth", [("int8", 2.0), ("fp32", 2.0), ("fp32", 3.0)])
def test_real_scaler_rescales_and_clears_error_buffers(results, error_dtype, growth):
    """DynamicGradScaler (growth interval 2, hysteresis 2) driven by hand, compress calls in
    between: after every update the buffers equal the fp64 reference (zero after found_inf,
    times new/old after a change); exact for factor 2, one fp32 rounding for factor 3."""
    for res in results:
        unit = res["unit"][(error_dtype, growth)]
        ratios = [ratio for _, ratio, _, _ in unit["events"]]
        assert ratios == [1, growth, 1, 1, 1, 0.5, 0.5, 1, growth]  # the scaler really moved
        for found_inf, ratio, exact, nonzero in unit["events"]:
            assert nonzero != found_inf  # cleared exactly when found_inf
            if growth == 2.0 or ratio == 1 or found_inf:
                assert exact, (found_inf, ratio)
        assert unit["worst_rel"] <= (0 if growth == 2.0 else 2.0 ** -24)
        assert unit["clears"] == 3 and unit["rescales"] == 2


def test_chained_scalers_rescale_once_and_uninstall_restores(results):
    for res in results:
        chain = res["chain"]
        assert chain["patched"] and chain["restored"] and chain["off_untouched"]
        assert chain["chain_once"] and chain["rescales"] == 1  # two scalers grew: x2, not x4
        assert chain["constant_clears"]  # a constant scale's found_inf skips the step too
        assert chain["after_uninstall"]  # update() after uninstall leaves the buffers alone


def _expected_scales():
    """The scale after each step: x2 every WINDOW clean steps, /2 on the overflow step."""
    scale, clean, out = INITIAL_SCALE, 0, []
    for step in range(STEPS):
        if step == INF_STEP:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == WINDOW:
                scale, clean = scale * 2, 0
        out.append(scale)
    return out


def test_fp16_bits16_is_stock(results):
    """LoCo off (bits 16): fp16 training with the dynamic scaler and the overflow step is
    bit-identical to stock megatron-core (losses, parameters, loss-scale sequence)."""
    for res in results:
        stock, bits16 = res["stock"], res["bits16"]
        for key in ("loss", "scale_after", "ok"):
            assert [s[key] for s in bits16["steps"]] == [s[key] for s in stock["steps"]]
        assert all(torch.equal(stock["params"][n], p) for n, p in bits16["params"].items())
        assert [s["scale_after"] for s in stock["steps"]] == _expected_scales()
        assert [s["ok"] for s in stock["steps"]] == [s != INF_STEP for s in range(STEPS)]


@pytest.mark.parametrize("mode", ["loco4", "loco4_fp32"])
def test_fp16_overflow_clears_and_growth_rescales(results, mode):
    """LoCo 4-bit in fp16 (int8 and fp32 error storage): the overflow step is skipped by
    megatron (parameters unchanged, scale halved) and leaves every error buffer zero on both
    ranks, including the rank whose gradients were finite; at each growth the buffers are
    exactly 2x their values before the update; every other step leaves them as compress left
    them; training goes on (finite, falling loss) and the reduced shards stay within the
    quantization bound of the exact reduction."""
    for rank, res in enumerate(results):
        run, steps = res[mode], res[mode]["steps"]
        assert [s["scale_after"] for s in steps] == _expected_scales()
        assert [s["ok"] for s in steps] == [s != INF_STEP for s in range(STEPS)]
        assert [s["params_moved"] for s in steps] == [s != INF_STEP for s in range(STEPS)]
        for i, s in enumerate(steps):
            assert s["post_finite"]
            if i == INF_STEP:
                assert s["post_zero"]
                # rank 0's blocks were non-finite (they kept their previous errors: the kernel
                # skips their update); rank 1's were finite and had updated their buffers: the
                # hook cleared both
                assert s["pre_nonzero"]
            else:
                assert s["pre_nonzero"] and not s["post_zero"]
                assert s["post_is_factor_pre"], i  # x2 at growth, untouched otherwise
        growths = sum(s["scale_after"] > s["scale_before"] for s in steps)
        assert run["rescales"] == growths == 2 and run["clears"] == 1
        # counted per non-finite block: at least one in every bucket of rank 0, none on rank 1
        assert (run["nonfinite"] >= run["buckets"]) if rank == 0 else run["nonfinite"] == 0
        # the overflow step counts as a LoCo step, as megatron.training counts the iteration
        assert run["compress"] == STEPS * run["buckets"] and run["counter_steps"] == [STEPS]
        assert run["shard_check"] <= 1.0, run["shard_check"]
        losses = [s["loss"] for s in steps]
        assert all(torch.isfinite(torch.tensor(losses)))
        assert losses[-1] < 0.8 * losses[0], losses
        assert losses[INF_STEP + 1] == losses[INF_STEP]  # same batch, parameters unchanged
        stock = [s["loss"] for s in res["stock"]["steps"]]
        assert losses != stock and abs(losses[-1] - stock[-1]) < 0.05 * stock[0]


def test_nan_check_fires_before_loco(results):
    """check_for_nan_in_grad (megatron.training keeps it on with a constant loss scale): a NaN
    in rank 0's gradients raises megatron's RuntimeError before any LoCo work (no compress
    call, every error buffer bit-identical)."""
    nan = results[0]["nan"]
    assert nan["message"] is not None and "found NaN in local grad norm" in nan["message"]
    assert "before data-parallel communication collective" in nan["message"]
    assert nan["had_errors"] and nan["errors_untouched"] and nan["nonfinite_unchanged"]
    assert nan["calls_after"] == nan["calls_before"] > 0
    assert results[1]["nan"] is None
