"""training_telemetry.install()/uninstall(): reversible, inert with LoCo off, no timers without
megatron.training's globals."""

import pytest

import loco_megatron
from loco_megatron.config import LoCoConfig
from loco_megatron.megatron import training_telemetry

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
