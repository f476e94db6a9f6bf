"""LoCo off is stock megatron-core, bit for bit, in DDP configurations LoCo never compresses.

Plain DDP (``use_distributed_optimizer=False``: an all-reduce), ``overlap_param_gather`` without
the distributed optimizer (megatron's layer-wise optimizer setting) and DP size 1: with the
plugin installed at bits unset / 16 the losses and parameters equal a run without the plugin,
and DDP construction issues no extra collective. At DP size 1 even bits 4 changes nothing
(nothing is communicated), instead of refusing the configuration. A replaced
``dist_reduce_scatter_func`` (another plugin, a test mock) is refused, not bypassed.
"""

import types

import pytest
import torch

import loco_megatron
from loco_megatron.config import LoCoConfig, LoCoConfigError
from loco_megatron.megatron import compat, plugin

from tests.helpers.multiproc import run_ranks
from .worker_megatron import loco_off_worker

OFF = ("stock", "unset", "bits16", "param16")


def _assert_same_as_stock(results, modes):
    for res in results:
        stock = res["stock"]
        for mode in modes:
            assert res[mode]["losses"] == stock["losses"], mode
            assert all(torch.equal(stock["params"][n], res[mode]["params"][n])
                       for n in stock["params"]), mode
            assert res[mode]["gathers"] == stock["gathers"], (mode, res[mode]["gathers"])
        assert stock["losses"][-1] < stock["losses"][0]  # it trained


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap_off", "overlap_on"])
@pytest.mark.parametrize("tp,world", [(1, 2), (2, 4)], ids=["TP1xDP2", "TP2xDP2"])
def test_plain_ddp_with_loco_off_is_stock(tp, world, overlap):
    """The crash this guards: the agreement check read a bucket-group attribute megatron-core
    only sets with the distributed optimizer (AttributeError while building DDP)."""
    kwargs = {"use_distributed_optimizer": False, "overlap_grad_reduce": overlap}
    _assert_same_as_stock(run_ranks(loco_off_worker, world, tp, OFF, kwargs), OFF[1:])


def test_overlap_param_gather_without_distributed_optimizer_is_stock():
    """megatron-core's layer-wise optimizer setting: ``overlap_param_gather`` with plain DDP.
    Its parameter all-gather needs the layer-wise optimizer's shard sizes, so the forward
    pre-hook is switched off (``param_sync=False``); the gradient all-reduce and DDP
    construction are what LoCo must leave alone."""
    kwargs = {"use_distributed_optimizer": False, "overlap_param_gather": True,
              "overlap_grad_reduce": True, "param_sync": False}
    _assert_same_as_stock(run_ranks(loco_off_worker, 2, 1, OFF, kwargs), OFF[1:])


@pytest.mark.parametrize("distributed_optimizer", [True, False], ids=["distopt", "plain_ddp"])
@pytest.mark.parametrize("tp,world", [(1, 1), (2, 2)], ids=["TP1xDP1", "TP2xDP1"])
def test_dp_size_1_is_stock_even_at_bits_4(tp, world, distributed_optimizer):
    """DP size 1: no gradient is communicated, so LoCo has nothing to compress or refuse."""
    modes = OFF + ("loco4", "param4")
    kwargs = {"use_distributed_optimizer": distributed_optimizer}
    results = run_ranks(loco_off_worker, world, tp, modes, kwargs)
    _assert_same_as_stock(results, modes[1:])
    assert all(r["loco4"]["counters"]["calls"] == 0 for r in results)


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap_off", "overlap_on"])
def test_distributed_optimizer_with_loco_off_is_stock_plus_one_check(overlap):
    """Where LoCo could compress, ``install()`` with LoCo off (bits None or 16) adds only the
    start-up agreement check: one ``all_gather_object`` per DP group while DDP is built. (The
    launch paths do not install at all without ``--loco-bits``:
    tests/launch/test_megatron_lm_wrapper.py.)"""
    kwargs = {"overlap_grad_reduce": overlap}
    results = run_ranks(loco_off_worker, 2, 1, OFF, kwargs)
    for res in results:
        for mode in OFF[1:]:
            res[mode]["gathers"] -= 1
    _assert_same_as_stock(results, OFF[1:])


@pytest.fixture
def _clean():
    loco_megatron.uninstall()
    module = compat.param_and_grad_buffer_module()
    saved = module.dist_reduce_scatter_func
    yield module
    module.dist_reduce_scatter_func = saved
    loco_megatron.uninstall()


def _mock_reduce_scatter(output, input, op=None, group=None, async_op=False):
    raise AssertionError("not to be called")


def test_replaced_reduce_scatter_refused_at_install(_clean):
    _clean.dist_reduce_scatter_func = _mock_reduce_scatter
    with pytest.raises(LoCoConfigError, match="_mock_reduce_scatter.*before install"):
        loco_megatron.install(LoCoConfig(bits=4))
    assert plugin.get_state() is None
    loco_megatron.install(LoCoConfig(bits=16))  # LoCo off replaces nothing: accepted


def test_replaced_reduce_scatter_refused_at_first_use(_clean):
    state = loco_megatron.install(LoCoConfig(bits=4))
    calls = []
    start = plugin._wrap_start_grad_sync(lambda self, *a, **k: calls.append(1))
    bucket = types.SimpleNamespace(loco_generation=state.generation, loco_key=(0, 0, 0),
                                   grad_data=torch.zeros(4))
    group = types.SimpleNamespace(
        ddp_config=types.SimpleNamespace(use_distributed_optimizer=True),
        intra_distributed_optimizer_instance_size=2, buckets=[bucket], grad_reduce_handle=None)
    _clean.dist_reduce_scatter_func = _mock_reduce_scatter
    with pytest.raises(LoCoConfigError, match="_mock_reduce_scatter.*since install"):
        start(group)
    assert calls == []  # megatron's start_grad_sync never ran with the mock bypassed


def test_tool_wrapping_torch_after_megatron_import_is_accepted(_clean):
    """A comms logger that wraps ``torch.distributed.reduce_scatter_tensor`` after megatron-core
    bound its global changes nothing megatron calls: no refusal."""
    import functools

    import torch.distributed as dist

    original = dist.reduce_scatter_tensor

    @functools.wraps(original)
    def logged(*args, **kwargs):
        return original(*args, **kwargs)

    dist.reduce_scatter_tensor = logged
    try:
        loco_megatron.install(LoCoConfig(bits=4))
    finally:
        dist.reduce_scatter_tensor = original


def test_wrapper_bound_by_megatron_is_refused_and_named(_clean):
    """The same wrapper bound by megatron-core (installed before megatron was imported) would
    be bypassed: refused, the message naming it and torch's function."""
    import functools

    import torch.distributed as dist

    @functools.wraps(dist.reduce_scatter_tensor)
    def logged(*args, **kwargs):
        raise AssertionError("not to be called")

    logged.__module__, logged.__qualname__ = "commslog", "logged_reduce_scatter"
    _clean.dist_reduce_scatter_func = logged
    with pytest.raises(LoCoConfigError, match="commslog.logged_reduce_scatter.*not torch"):
        loco_megatron.install(LoCoConfig(bits=4))
