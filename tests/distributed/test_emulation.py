"""CPU stand-in for CUDA (loco_megatron.emulation): each check runs in a fresh process."""

import pytest
import torch

from tests.helpers.multiproc import run_ranks


def _tensor_semantics(rank, world):
    from loco_megatron import emulation

    emulation.activate()
    emulation.activate()  # idempotent
    t = torch.zeros(3, device="cuda")
    u = torch.ones(2, device=torch.device("cuda", 0)).cuda()
    v = torch.empty(2, device=torch.cuda.current_device())
    w = t.to("cuda:0")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        pass
    facts = {
        "devices": {x.device.type for x in (t, u, v, w)},
        "is_cuda": t.is_cuda,
        "type": t.type(),
        "long_type": torch.zeros(1, dtype=torch.long).type(),
        "available": torch.cuda.is_available(),
        "accelerator": torch.accelerator.current_accelerator(),
    }
    emulation.deactivate()
    facts["after_available"] = torch.cuda.is_available()
    facts["after_is_cuda"] = torch.zeros(1).is_cuda
    return facts


def test_cuda_calls_run_on_cpu_and_deactivate_restores():
    facts = run_ranks(_tensor_semantics, 1)[0]
    assert facts["devices"] == {"cpu"}
    assert facts["is_cuda"] is True and facts["available"] is True
    assert facts["type"] == "torch.cuda.FloatTensor" and facts["long_type"] == "torch.cuda.LongTensor"
    assert facts["accelerator"] is None
    assert facts["after_available"] is False and facts["after_is_cuda"] is False


def _rng_tracker(rank, world):
    from loco_megatron import emulation

    emulation.activate()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    F = torch.nn.functional
    ps.initialize_model_parallel(1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(7)
    host_before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        a = torch.rand(4, device="cuda")
    with get_cuda_rng_tracker().fork():
        b = torch.rand(4, device="cuda")  # continues the tracker's stream
    host_untouched = torch.equal(host_before, torch.get_rng_state())
    model_parallel_cuda_manual_seed(7)
    with get_cuda_rng_tracker().fork():
        a2 = torch.rand(4, device="cuda")  # same seed, same stream
    ones = torch.ones(256)
    torch.cuda.manual_seed(3)
    m1 = F.dropout(ones, 0.5)
    torch.cuda.manual_seed(3)
    torch.rand(10)  # a host draw (e.g. a DataLoader's worker seed) between seed and dropout
    m2 = F.dropout(ones, 0.5)
    saved = torch.cuda.get_rng_state()
    m3 = F.dropout(ones, 0.5)
    torch.cuda.set_rng_state(saved)  # as a checkpoint restores it
    m4 = F.dropout(ones, 0.5)
    return {"host_untouched": host_untouched, "a": a, "b": b, "a2": a2, "m1": m1, "m2": m2,
            "m3": m3, "m4": m4}


def test_emulated_cuda_rng_is_its_own_generator():
    r = run_ranks(_rng_tracker, 1)[0]
    assert r["host_untouched"]  # device draws inside fork() leave the host stream alone
    assert not torch.equal(r["a"], r["b"])  # the tracker state advanced inside fork
    assert torch.equal(r["a"], r["a2"])  # reseeding reproduces the stream
    assert torch.equal(r["m1"], r["m2"])  # host draws do not shift dropout masks
    assert not torch.equal(r["m2"], r["m3"]) and torch.equal(r["m3"], r["m4"])  # state restore


def test_refuses_to_activate_on_a_gpu_machine(monkeypatch):
    from loco_megatron import emulation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="GPU is present"):
        emulation.activate()
    assert emulation.activate_if_no_gpu() is False
    assert not emulation.is_active()


def _tp_init(rank, world):
    from loco_megatron import emulation

    emulation.activate()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(7)
    torch.manual_seed(11)  # the host generator is the same on both ranks
    w = torch.empty(8, 8, device="cuda")
    with get_cuda_rng_tracker().fork():  # megatron's _initialize_affine_weight_gpu
        torch.nn.init.normal_(w, std=0.02)
    host = torch.empty(8).normal_()  # outside fork: the host generator (CPU initialisation)
    return w, host


def test_gpu_style_init_inside_fork_differs_per_tp_rank():
    (w0, h0), (w1, h1) = run_ranks(_tp_init, 2)
    assert not torch.equal(w0, w1)  # each TP rank's tracker seed gives its own shard
    assert torch.equal(h0, h1)  # host draws follow torch.manual_seed on every rank
