"""The one patch mechanism (loco_megatron/patching.py) and everything that patches through it:
an install leaves megatron-core's classes and modules exactly as it found them (attribute sets
and values compared, inherited methods never shadowed), twice in a row and when the body of
``loco_megatron.installed`` raises."""

import types

import pytest

import loco_megatron
from loco_megatron.config import LoCoConfig
from loco_megatron.megatron import plugin
from loco_megatron.patching import PatchError, PatchSet, active

from ..helpers.markers import requires_megatron_training


class _Base:
    def method(self):
        return "base"


class _Child(_Base):
    pass


def _snapshot(owners):
    """Each owner's own attributes, by identity of their values."""
    return [{name: id(value) for name, value in vars(owner).items()} for owner in owners]


def test_restore_deletes_what_did_not_exist_and_never_shadows():
    module = types.ModuleType("fake_module")
    module.f = lambda: 1
    before = _snapshot([_Child, _Base, module])
    patches = PatchSet("test-restore")
    patches.wrap(_Child, "method", lambda orig: lambda self: "child of " + orig(self))
    patches.replace(module, "g", 2)
    patches.replace(module, "f", lambda: 3)
    assert _Child().method() == "child of base" and "method" in vars(_Child)
    assert module.f() == 3 and module.g == 2 and active("test-restore")
    patches.restore()
    assert _snapshot([_Child, _Base, module]) == before
    assert "method" not in vars(_Child) and _Child.method is _Base.method  # not shadowed
    assert not hasattr(module, "g") and module.f() == 1
    assert not active("test-restore")
    patches.restore()  # idempotent
    assert _snapshot([_Child, _Base, module]) == before


def test_double_application_is_refused():
    first = PatchSet("test-double")
    try:
        with pytest.raises(PatchError, match="already applied"):
            PatchSet("test-double")
        first.replace(_Child, "extra", 1)
        with pytest.raises(PatchError, match="already replaced"):
            first.replace(_Child, "extra", 2)
    finally:
        first.restore()
    assert "extra" not in vars(_Child)
    with pytest.raises(PatchError, match="was restored"):
        first.replace(_Child, "extra", 3)
    PatchSet("test-double").restore()  # the name is free again


def test_context_restores_when_the_body_raises():
    before = _snapshot([_Child])
    with pytest.raises(ValueError, match="boom"):
        with PatchSet("test-raise").applied() as patches:
            patches.replace(_Child, "method", lambda self: "patched")
            assert _Child().method() == "patched"
            raise ValueError("boom")
    assert _snapshot([_Child]) == before and not active("test-raise")


def _install_targets(config):
    state = loco_megatron.install(config)
    try:
        return list(dict.fromkeys(owner for owner, _ in state.patches.targets()))
    finally:
        loco_megatron.uninstall()


@pytest.mark.parametrize("bits", [4, 16])
def test_install_uninstall_restores_megatron_exactly_twice(bits):
    config = LoCoConfig(bits=bits)
    owners = _install_targets(config)
    assert len(owners) >= (4 if bits == 4 else 3)  # DDP, optimizers, dist_checkpointing, ...
    before = _snapshot(owners)
    for _ in range(2):
        state = loco_megatron.install(config)
        assert _snapshot(owners) != before and active(plugin.PATCH_SET)
        with pytest.raises(RuntimeError, match="already installed"):
            loco_megatron.install(config)
        loco_megatron.uninstall()
        assert _snapshot(owners) == before, "uninstall left megatron-core changed"
        assert not active(plugin.PATCH_SET) and plugin.get_state() is None
        assert state.patches.targets() == []


def test_installed_context_restores_when_the_body_raises():
    owners = _install_targets(LoCoConfig(bits=4))
    before = _snapshot(owners)
    with pytest.raises(RuntimeError, match="boom"):
        with loco_megatron.installed(LoCoConfig(bits=4)) as state:
            assert plugin.get_state() is state and state.active
            raise RuntimeError("boom")
    assert plugin.get_state() is None and _snapshot(owners) == before
    with loco_megatron.installed(LoCoConfig(bits=4)):  # and again, after the exception
        pass
    assert _snapshot(owners) == before


def test_cpu_emulation_restores_torch_exactly():
    import torch

    from loco_megatron.emulation import cpu_cuda

    if cpu_cuda.is_active() or torch.cuda.is_available():
        pytest.skip("the emulation is already active in this process, or a GPU is present")
    cpu_cuda.activate()  # the first activation imports what it patches
    owners = list(dict.fromkeys(owner for owner, _ in cpu_cuda._state["patches"].targets()))
    cpu_cuda.deactivate()
    assert torch.cuda in owners and torch.accelerator in owners
    before = _snapshot(owners)
    for _ in range(2):
        cpu_cuda.activate()
        assert torch.cuda.is_available() and _snapshot(owners) != before
        cpu_cuda.deactivate()
        assert _snapshot(owners) == before and not active(cpu_cuda.PATCH_SET)
    assert torch.cuda.is_available() is False


@requires_megatron_training
def test_workarounds_and_telemetry_restore_megatron_training_exactly():
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.training.training as training

    from loco_megatron.training import iteration_log, workarounds

    owners = [training, distrib_optimizer.DistributedOptimizer]
    before = _snapshot(owners)
    with loco_megatron.installed(LoCoConfig(bits=4)) as state:
        assert iteration_log.install(state) is True
        assert _snapshot([training]) != before[:1]
        iteration_log.uninstall()
    workarounds.init_torch_optimizer_states_before_load()
    workarounds.fix_torch_adamw_resume()
    workarounds.remove()
    assert _snapshot(owners) == before


def test_restore_out_of_order_or_under_a_mock_is_refused_and_changes_nothing():
    first, second = PatchSet("test-order-1"), PatchSet("test-order-2")
    first.wrap(_Base, "method", lambda orig: lambda self: "A(" + orig(self) + ")")
    second.wrap(_Base, "method", lambda orig: lambda self: "B(" + orig(self) + ")")
    with pytest.raises(PatchError, match="patch set 'test-order-2' \\(restore it first\\)"):
        first.restore()
    assert _Base().method() == "B(A(base))" and first.is_applied
    second.restore()
    first.restore()
    assert _Base().method() == "base" and "method" in vars(_Base)
    patches = PatchSet("test-mock")
    patches.replace(_Child, "method", lambda self: "patched")
    saved = vars(_Child)["method"]
    _Child.method = lambda self: "mock"  # someone else's patch on top of ours
    with pytest.raises(PatchError, match="outside loco_megatron"):
        patches.restore()
    assert _Child().method() == "mock"
    _Child.method = saved  # the mock undone: now ours restores
    patches.restore()
    assert "method" not in vars(_Child)
    lenient = PatchSet("test-lenient", strict=False)  # the CPU emulation's kind
    lenient.replace(_Child, "method", lambda self: "patched")
    _Child.method = lambda self: "mock"
    lenient.restore()
    assert "method" not in vars(_Child) and _Child().method() == "base"


def test_descriptors_are_refused():
    class Owner:
        @staticmethod
        def s():
            return 1

        @property
        def p(self):
            return 2

    with PatchSet("test-descriptors").applied() as patches:
        for owner, name in ((Owner, "s"), (Owner, "p"), (Owner(), "p")):
            with pytest.raises(PatchError, match="not supported"):
                patches.replace(owner, name, None)
    assert Owner.s() == 1 and Owner().p == 2


def test_uninstall_refuses_while_a_mock_covers_a_wrapped_method():
    from unittest import mock

    from loco_megatron.megatron import compat

    owner = compat.bucket_group_class()
    original = vars(owner)["start_grad_sync"]
    state = loco_megatron.install(LoCoConfig(bits=4))
    try:
        with mock.patch.object(owner, "start_grad_sync", lambda *a, **k: None):
            with pytest.raises(PatchError, match="start_grad_sync"):
                loco_megatron.uninstall()
            assert plugin.get_state() is state  # still installed, nothing half-restored
    finally:
        loco_megatron.uninstall()
    assert plugin.get_state() is None and vars(owner)["start_grad_sync"] is original
