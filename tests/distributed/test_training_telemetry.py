"""training_telemetry.install()/uninstall(): reversible, inert with LoCo off, no timers without
megatron.training's globals."""

import pytest

import loco_megatron
from loco_megatron.config import LoCoConfig
from loco_megatron.training import iteration_log as training_telemetry

pytest.importorskip("megatron.training",
                    reason="megatron-core wheels < 0.17 ship no megatron.training")


@pytest.fixture(autouse=True)
def _clean():
    yield
    training_telemetry.uninstall()
    loco_megatron.uninstall()


def test_install_wraps_training_log_and_uninstall_restores():
    from megatron.training import training

    original = training.training_log
    state = loco_megatron.install(LoCoConfig(bits=4))
    assert training_telemetry.install() is True
    assert training.training_log is not original
    assert state.metrics is not None and state.compensator.metrics is state.metrics
    assert state.timers is training_telemetry.megatron_timers
    with pytest.raises(RuntimeError, match="already installed"):
        training_telemetry.install(state)
    training_telemetry.uninstall()
    assert training.training_log is original
    assert state.metrics is None and state.compensator.metrics is None and state.timers is None


@pytest.mark.parametrize("bits", [None, 16])
def test_loco_off_installs_nothing(bits):
    from megatron.training import training

    original = training.training_log
    state = loco_megatron.install(LoCoConfig(bits=bits))
    assert training_telemetry.install(state) is False
    assert training.training_log is original and state.metrics is None and state.timers is None
    with pytest.raises(RuntimeError, match="active LoCo"):
        state.enable_metrics()


def test_not_installed_is_a_no_op():
    assert training_telemetry.install() is False


def test_no_megatron_training_globals_means_no_timers():
    from megatron.training import global_vars

    assert global_vars._GLOBAL_TIMERS is None  # core-only use: megatron.training not set up
    assert training_telemetry.megatron_timers() is None


def _fake_loop_worker(rank, world):
    """A training_log with core_v0.13's signature, wrapped: the line printed at iteration 2
    carries the figures of steps 1-2 (recorded by hand), iteration 1 prints no line."""
    import argparse
    import types

    import torch
    from megatron.training import global_vars

    global_vars.set_args(argparse.Namespace(timing_log_level=0))
    printed = []
    fake = types.ModuleType("fake_training")
    fake.print_rank_last = printed.append

    def training_log(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate,
                     iteration, loss_scale, report_memory_flag, skipped_iter, grad_norm,
                     params_norm, num_zeros_in_grad):
        if iteration % 2 == 0:
            fake.print_rank_last(f" iteration {iteration:8d}/      10 | lm loss: 1.0 |")
        return report_memory_flag

    state = loco_megatron.install(LoCoConfig(bits=4))
    metrics = state.enable_metrics()
    wrapped = training_telemetry._wrap_training_log(training_log, fake, state)
    for it, (err, buf) in enumerate([([3.0, 4.0], 36.0), ([6.0, 8.0], 64.0)], start=1):
        metrics.record(torch.tensor(sum(x * x for x in err), dtype=torch.float64),
                       torch.tensor(buf), torch.tensor(False))
        state.wire.bytes_sent += 100
        state.wire.stock_bytes += 800
        assert wrapped({}, {}, 1e-3, None, it, 1.0, True, 0, 1.0, None, None) is True
    assert fake.print_rank_last == printed.append  # restored
    return printed


def test_line_fields_with_core_v013_signature(run_ranks):
    (printed,) = run_ranks(_fake_loop_worker, 1)
    assert printed == [
        " iteration        2/      10 | lm loss: 1.0 |"
        " loco compression error norm: 7.500000E+00 | loco error buffer norm: 7.000000E+00 |"
        " loco wire bytes per step: 100 | loco compression ratio: 8.000 |"]
