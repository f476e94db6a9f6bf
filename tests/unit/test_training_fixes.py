"""megatron.training workarounds for megatron-core's torch-optimizer fallback (no TE/apex)."""

from types import SimpleNamespace

import pytest

from tests.helpers.markers import requires_megatron_training

pytestmark = requires_megatron_training


@pytest.fixture(autouse=True)
def _workarounds_removed(monkeypatch):  # removed before monkeypatch undoes its own
    """Each test applies its workaround on megatron as the test left it; removed afterwards."""
    yield
    from loco_megatron.training import workarounds

    workarounds.remove()


@pytest.mark.parametrize("flags,expect_dummy_step", [
    ({}, True),                       # resuming: states must exist before megatron builds the load template
    ({"finetune": True}, False),      # optimizer state is not loaded: no dummy Adam step
    ({"no_load_optim": True}, False),
])
def test_dummy_optimizer_states_only_when_the_optimizer_is_loaded(tmp_path, monkeypatch, flags,
                                                                  expect_dummy_step):
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.training
    import megatron.training.training as training

    from loco_megatron.training import workarounds as training_fixes

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    args = SimpleNamespace(**{"load": str(tmp_path), "finetune": False, "no_load_optim": False,
                              **flags})
    monkeypatch.setattr(megatron.training, "get_args", lambda: args)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    monkeypatch.setattr(training, "load_checkpoint", lambda *a, **k: "loaded")
    calls = []

    class FakeOptimizer(distrib_optimizer.DistributedOptimizer):
        def __init__(self):
            self.optimizer = SimpleNamespace(state={})

        def _init_optimizer_states_with_dummy_values(self):
            calls.append("dummy step")

    training_fixes.init_torch_optimizer_states_before_load()
    assert training.load_checkpoint([], FakeOptimizer(), None) == "loaded"
    assert calls == (["dummy step"] if expect_dummy_step else [])
