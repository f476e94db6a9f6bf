"""LoCo error feedback: the two identities of error feedback (loco_megatron/algorithm.py), resets, int8 storage, NaN safety."""

import pytest
import torch

from loco_megatron.compensator import Compensator, ErrorBuffer
from loco_megatron.config import LoCoConfig
from loco_megatron.quantization import decode, quantize_blockwise, dequantize_blockwise

BLOCK = 64


def _deq(payload, scales, bits, dtype=torch.float32):
    return decode(payload, scales, bits, BLOCK, dtype=dtype)


@pytest.mark.parametrize("bits", [4, 8])
def test_beta0_identity_h_equals_deq_plus_error(bits):
    """beta=0: h_t == deQ(c_t) + e_t elementwise, up to the int8 storage rounding of e_t."""
    comp = Compensator(LoCoConfig(bits=bits, beta=0.0, block_size=BLOCK))
    torch.manual_seed(0)
    for _ in range(5):
        g = torch.randn(BLOCK * 10)
        e_prev = comp.errors["b"].get() if "b" in comp.errors else torch.zeros_like(g)
        h = g + e_prev
        payload, scales = comp.compress("b", g)
        e = comp.errors["b"].get()
        exact_e = h - _deq(payload, scales, bits)
        # int8 storage of e: per element within half an int8 step of its block.
        step = exact_e.view(-1, BLOCK).abs().amax(1, keepdim=True) / 127
        assert torch.all((h - (_deq(payload, scales, bits) + e)).view(-1, BLOCK).abs()
                         <= step / 2 * (1 + 1e-5) + 1e-7)
        assert exact_e.abs().max() > 0  # the identity is not vacuous


def test_telescoping_identity_float64():
    """sum_t deQ(c_t) == sum_t g_t + (e_0 - e_T) / (1 - beta), exact storage, no reset."""
    beta = 0.8
    comp = Compensator(LoCoConfig(bits=4, beta=beta, block_size=BLOCK, error_dtype="fp32",
                                  reset_interval=0))
    torch.manual_seed(1)
    sum_d = torch.zeros(BLOCK * 8, dtype=torch.float64)
    sum_g = torch.zeros_like(sum_d)
    for _ in range(50):
        g = torch.randn(BLOCK * 8, dtype=torch.float64)
        payload, scales = comp.compress(0, g)
        sum_d += _deq(payload, scales, 4, torch.float64)
        sum_g += g
    e_T = comp.errors[0].get()
    assert e_T.dtype == torch.float64 and e_T.abs().max() > 1e-3
    torch.testing.assert_close(sum_d, sum_g - e_T / (1 - beta), rtol=0, atol=1e-10)


def test_without_compensation_the_identity_fails():
    """Control: plain 4-bit rounding drifts far more than the compensated sum."""
    torch.manual_seed(1)
    gs = [torch.randn(BLOCK * 8, dtype=torch.float64) * 0.01 + 0.003 for _ in range(50)]
    plain = sum(dequantize_blockwise(*quantize_blockwise(g, 4, BLOCK), BLOCK, dtype=torch.float64)
                for g in gs)
    comp = Compensator(LoCoConfig(bits=4, beta=0.0, block_size=BLOCK, error_dtype="fp32"))
    loco = sum(_deq(*comp.compress(0, g), 4, torch.float64) for g in gs)
    exact = sum(gs)
    assert (loco - exact).abs().max() < 0.2 * (plain - exact).abs().max()


def test_reset_every_interval_in_steps():
    comp = Compensator(LoCoConfig(bits=4, beta=0.5, block_size=BLOCK, reset_interval=3))
    g = torch.randn(BLOCK * 2)
    norms = []
    for _ in range(7):
        before = comp.errors["k"].get().abs().sum().item() if "k" in comp.errors else 0.0
        norms.append(before)
        comp.compress("k", g)
        comp.compress("other", g)
    # error seen at the start of steps 0..6: zero at step 0, then reset at steps 3 and 6
    assert norms[0] == 0 and norms[1] > 0 and norms[2] > 0
    assert comp.stats.resets == 4  # two keys x steps 3 and 6
    assert comp.stats.steps == {"k": 7, "other": 7}


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("storage", ["int8", "fp32"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_block_skips_its_error_update(kernels, storage, bad):
    """A non-finite h still travels (non-finite scale for its block, so the reduced gradient is
    non-finite there) but its block keeps the previous error bit for bit; the finite blocks
    update exactly as if the bad element had been finite (blocks are independent)."""
    def run(value):
        comp = Compensator(LoCoConfig(bits=4, block_size=BLOCK, kernels=kernels,
                                      error_dtype=storage))
        gen = torch.Generator().manual_seed(0)
        comp.compress("k", torch.randn(BLOCK * 3, generator=gen))
        before = {n: t.clone() for n, t in comp.errors["k"].tensors().items()}
        g = torch.randn(BLOCK * 3, generator=gen)
        g[BLOCK + 3] = value
        _, scales = comp.compress("k", g)
        return comp, before, scales

    comp, before, scales = run(bad)
    ref, _, _ = run(0.0)
    assert not torch.isfinite(scales[1]) and torch.isfinite(scales[[0, 2]]).all()
    assert comp.nonfinite_updates() == 1 and ref.nonfinite_updates() == 0
    for name, t in comp.errors["k"].tensors().items():
        rows = t.view(3, -1)
        assert torch.equal(rows[1], before[name].view(3, -1)[1]), name  # kept
        assert torch.equal(rows[[0, 2]], ref.errors["k"].tensors()[name].view(3, -1)[[0, 2]])
    assert torch.isfinite(comp.errors["k"].get()).all()
    comp.compress("k", torch.randn(BLOCK * 3))  # the next finite step updates every block
    assert comp.nonfinite_updates() == 1


def test_nonfinite_monitor_warns_once_per_new_count(caplog):
    """The warning names the count and the bucket, and is not repeated without new blocks."""
    from loco_megatron.nonfinite import NonfiniteMonitor

    comp = Compensator(LoCoConfig(bits=4, block_size=BLOCK))
    monitor = NonfiniteMonitor(comp)
    comp.compress(("c", 0), torch.randn(BLOCK * 2))
    assert monitor.poll() == 0
    g = torch.randn(BLOCK * 2)
    g[[0, BLOCK]] = float("nan")
    comp.compress(("c", 0), g)
    with caplog.at_level("WARNING", logger="loco_megatron"):
        assert monitor.poll() == 2 and monitor.poll() == 0
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "2 quantization block(s)" in msg and "('c', 0)" in msg and "error update was skipped" in msg
    # later steps: warned at the 2nd, 4th and 8th step with NaN (fp16 overflows: no flood),
    # each warning counting the blocks since the previous one
    caplog.clear()
    with caplog.at_level("WARNING", logger="loco_megatron"):
        for _ in range(8):
            comp.compress(("c", 0), g)
            monitor.poll()
    assert [r.getMessage().split(" quantization")[0] for r in caplog.records] == [
        "LoCo: 2", "LoCo: 4", "LoCo: 8"]
    assert "Steps with NaN/Inf so far: 8 (16 blocks)" in caplog.records[-1].getMessage()


def test_layout_change_is_a_clear_error():
    comp = Compensator(LoCoConfig(bits=4, block_size=BLOCK))
    comp.compress((0, 0, 0), torch.randn(BLOCK * 2))
    with pytest.raises(RuntimeError, match=r"\(0, 0, 0\) holds 128 elements"):
        comp.compress((0, 0, 0), torch.randn(BLOCK * 3))


def test_int8_storage_is_about_one_byte_per_element():
    buf = ErrorBuffer(BLOCK * 100, BLOCK, "int8", torch.float32, "cpu")
    assert buf.nbytes() == BLOCK * 100 + 100 * 4
    e = torch.randn(BLOCK * 100)
    buf.set(e)
    step = e.view(-1, BLOCK).abs().amax(1, keepdim=True) / 127
    assert torch.all((buf.get() - e).view(-1, BLOCK).abs() <= step / 2 * (1 + 1e-5))
    buf.zero_()
    assert torch.equal(buf.get(), torch.zeros_like(e))


def test_compensator_refuses_full_precision_config():
    with pytest.raises(ValueError, match="bits 4 or 8"):
        Compensator(LoCoConfig(bits=16))


def test_same_elements_other_blocks_is_a_layout_change():
    """Short blocks: two layouts of 8 wire elements, 2 and 4 blocks. Reusing the buffer of one
    for the other would write scales past its end (C kernel): refused like any layout change."""
    from loco_megatron.layout import BucketLayout

    a, b = BucketLayout.build(8, 1, 4), BucketLayout.build(8, 1, 4, (2, 4, 6))
    assert a.padded_shard == b.padded_shard and a.nblocks != b.nblocks
    comp = Compensator(LoCoConfig(bits=4, block_size=4))
    comp.compress("k", torch.randn(8), a)
    comp.compress("k", torch.randn(8), a)  # the same layout again: fine
    with pytest.raises(RuntimeError, match="layout changed after install"):
        comp.compress("k", torch.randn(8), b)
