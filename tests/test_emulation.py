"""CPU stand-in for CUDA (loco_megatron.emulation): each check runs in a fresh process."""

import pytest
import torch

from .multiproc import run_ranks


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

    ps.initialize_model_parallel(1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(7)
    outside_before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        a = torch.rand(4)
    restored = torch.equal(outside_before, torch.get_rng_state())
    with get_cuda_rng_tracker().fork():
        b = torch.rand(4)  # continues the tracker's stream
    model_parallel_cuda_manual_seed(7)
    with get_cuda_rng_tracker().fork():
        a2 = torch.rand(4)  # same seed, same stream
    torch.cuda.manual_seed(3)
    x = torch.rand(2)
    torch.cuda.manual_seed(3)
    y = torch.rand(2)
    return {"restored": restored, "a": a, "b": b, "a2": a2, "x": x, "y": y}


def test_rng_tracker_forks_the_generator_cpu_ops_use():
    r = run_ranks(_rng_tracker, 1)[0]
    assert r["restored"]  # fork() leaves the outside stream untouched
    assert not torch.equal(r["a"], r["b"])  # the tracker state advanced inside fork
    assert torch.equal(r["a"], r["a2"])  # reseeding reproduces the stream
    assert torch.equal(r["x"], r["y"])  # torch.cuda.manual_seed drives CPU random ops


def test_refuses_to_activate_on_a_gpu_machine(monkeypatch):
    from loco_megatron import emulation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="GPU is present"):
        emulation.activate()
    assert emulation.activate_if_no_gpu() is False
    assert not emulation.is_active()
