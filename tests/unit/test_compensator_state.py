"""Compensator.state_dict / load_state_dict: exact resume, and the documented resets."""

import io

import pytest
import torch

from loco_megatron.compensator import Compensator
from loco_megatron.config import LoCoConfig

BLOCK = 64


def _grads(step):
    g = torch.Generator().manual_seed(step)
    return {(0, 0, 0): torch.randn(BLOCK * 4, generator=g), (0, 0, 1): torch.randn(BLOCK * 2, generator=g)}


def _run(comp, steps):
    return [comp.compress(k, g) for s in steps for k, g in _grads(s).items()]


@pytest.mark.parametrize("error_dtype", ["int8", "fp32"])
def test_resume_is_bit_identical(error_dtype):
    cfg = LoCoConfig(bits=4, block_size=BLOCK, reset_interval=5, error_dtype=error_dtype)
    straight = Compensator(cfg)
    ref = _run(straight, range(8))
    first = Compensator(cfg)
    _run(first, range(4))
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = Compensator(cfg)
    assert resumed.load_state_dict(torch.load(buf)) == []
    out = _run(resumed, range(4, 8))
    for (p1, s1), (p2, s2) in zip(ref[8:], out):  # resets at step 5 happen in both runs
        assert torch.equal(p1, p2) and torch.equal(s1, s2)
    assert resumed.stats.steps == straight.stats.steps


def test_changed_bits_or_block_resets_with_warning():
    comp = Compensator(LoCoConfig(bits=4, block_size=BLOCK))
    _run(comp, range(2))
    state = comp.state_dict()
    other = Compensator(LoCoConfig(bits=8, block_size=BLOCK))
    notes = other.load_state_dict(state)
    assert len(notes) == 1 and "settings changed" in notes[0] and not other.errors
    assert other.stats.steps == comp.stats.steps


def test_numel_mismatch_resets_that_bucket_only():
    comp = Compensator(LoCoConfig(bits=4, block_size=BLOCK))
    _run(comp, range(2))
    state = comp.state_dict()
    fresh = Compensator(LoCoConfig(bits=4, block_size=BLOCK))
    fresh.compress((0, 0, 0), torch.randn(BLOCK * 3))  # the bucket now has another size
    notes = fresh.load_state_dict(state)
    assert len(notes) == 1 and "(0, 0, 0)" in notes[0] and "layout changed" in notes[0]
    assert (0, 0, 0) not in fresh.errors
    assert torch.equal(fresh.errors[(0, 0, 1)].codes, comp.errors[(0, 0, 1)].codes)


@pytest.mark.parametrize("corrupt,message", [
    (lambda e: e.pop("codes"), "expected fields"),
    (lambda e: e.update(codes=e["codes"][:-1]), "codes: expected 256 elements"),
    (lambda e: e.update(scales=e["scales"].double()), "scales: expected 4 elements of torch.float32"),
])
def test_corrupted_entry_is_a_clear_error(corrupt, message):
    comp = Compensator(LoCoConfig(bits=4, block_size=BLOCK))
    _run(comp, range(1))
    state = comp.state_dict()
    corrupt(state["errors"][(0, 0, 0)])
    with pytest.raises(ValueError, match=r"\(0, 0, 0\)"):
        try:
            Compensator(LoCoConfig(bits=4, block_size=BLOCK)).load_state_dict(state)
        except ValueError as e:
            assert message in str(e)
            raise
