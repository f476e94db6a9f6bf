"""install()/uninstall() of the megatron-core seam: explicit, reversible, refusing what it
cannot compress."""

import pytest
import torch

import loco_megatron
from loco_megatron.config import LoCoConfig, LoCoConfigError
from loco_megatron.megatron import compat, plugin


@pytest.fixture(autouse=True)
def _clean():
    loco_megatron.uninstall()
    yield
    loco_megatron.uninstall()


def test_install_patches_and_uninstall_restores():
    ddp, group = compat.ddp_class(), compat.bucket_group_class()
    before = (ddp.__init__, group.start_grad_sync)
    state = loco_megatron.install(LoCoConfig(bits=4))
    assert state.active and plugin.get_state() is state
    assert (ddp.__init__, group.start_grad_sync) != before
    loco_megatron.uninstall()
    assert (ddp.__init__, group.start_grad_sync) == before
    assert plugin.get_state() is None


@pytest.mark.parametrize("bits", [None, 16, 32])
def test_full_precision_patches_no_reduce_path(bits):
    """LoCo off: the reduce path is megatron-core's own; DDP construction only gains the
    start-up agreement check (a rank with LoCo on next to one with it off fails there,
    tests/distributed/test_failure_modes.py); uninstall restores both."""
    ddp, group = compat.ddp_class(), compat.bucket_group_class()
    before = (ddp.__init__, group.start_grad_sync)
    state = loco_megatron.install(LoCoConfig(bits=bits))
    assert not state.active and state.compensator is None
    assert group.start_grad_sync is before[1]
    assert ddp.__init__ is not before[0] and ddp.__init__.__wrapped__ is before[0]
    loco_megatron.uninstall()
    assert (ddp.__init__, group.start_grad_sync) == before


def test_checkpoint_hooks_installed_and_restored_for_every_setting():
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    names = ("sharded_state_dict", "load_state_dict", "save_parameter_state",
             "load_parameter_state")

    def current():
        return ([getattr(DistributedOptimizer, n) for n in names]
                + [ChainedOptimizer.save_parameter_state, ChainedOptimizer.load_parameter_state,
                   dist_checkpointing.load])

    before = current()
    for bits in (4, 16):
        loco_megatron.install(LoCoConfig(bits=bits))
        assert all(a is not b for a, b in zip(current(), before))
        loco_megatron.uninstall()
        assert current() == before


def test_double_install_is_an_error():
    loco_megatron.install(LoCoConfig(bits=4))
    with pytest.raises(RuntimeError, match="already installed"):
        loco_megatron.install(LoCoConfig(bits=8))


class _DDPConfig:
    use_distributed_optimizer = True
    num_distributed_optimizer_instances = 1
    reduce_scatter_with_fp32_accumulation = False


@pytest.mark.parametrize("attr,value,flag", [
    ("use_distributed_optimizer", False, "--use-distributed-optimizer"),
    ("reduce_scatter_with_fp32_accumulation", True, "--ddp-reduce-scatter-with-fp32-accumulation"),
])
def test_unsupported_ddp_configs_refused_with_flag(attr, value, flag):
    cfg = _DDPConfig()
    setattr(cfg, attr, value)
    with pytest.raises(LoCoConfigError, match=flag):
        plugin.check_ddp_config(cfg)
    plugin.check_ddp_config(_DDPConfig())  # the supported configuration passes


def test_several_distributed_optimizer_instances_accepted():
    """LoCo compresses the reduce-scatter inside each instance; megatron-core's all-reduce
    across instances follows (tests/distributed/test_instances_grid.py trains it)."""
    cfg = _DDPConfig()
    cfg.num_distributed_optimizer_instances = 2
    plugin.check_ddp_config(cfg)


def test_uninstall_forgets_inter_stages_never_issued():
    """A step interrupted before megatron waited on its hierarchical buckets leaves handles
    waiting to issue their inter-node stage; uninstall() drops them (and their buffers), so a
    later install never issues a stale collective."""
    from loco_megatron import hierarchical

    loco_megatron.install(LoCoConfig(bits=4, hierarchical=True))
    stale = hierarchical.HierarchicalWork("group", [], lambda: [], lambda: None, None,
                                           torch.zeros(1))
    hierarchical._PENDING.setdefault("group", []).append(stale)
    loco_megatron.uninstall()
    assert hierarchical._PENDING == {}
