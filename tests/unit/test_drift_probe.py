"""The convergence study's drift probe (loco_megatron/drift_probe.py) against direct
computations: error feedback's telescoping identity, plain quantization, zero codes without
the padding."""

import json

import pytest
import torch

from loco_megatron.compensator import Compensator
from loco_megatron.config import LoCoConfig
from loco_megatron.drift_probe import DriftProbe
from loco_megatron.layout import BucketLayout
from loco_megatron.quantization import dequantize_blockwise, quantize_blockwise

BLOCK = 32


def _layout():
    # 2 shards of 150 elements, a parameter boundary at 70: blocks of 32 cut short at both cuts
    return BucketLayout.build(300, 2, BLOCK, {70})


def _segment_roundtrip(layout, wire):
    """deQ(Q(x)) of each segment on its own (blocks of BLOCK, its last one short: the
    quantizer pads a segment with zeros, which never change a block's absmax), fp64."""
    out = torch.zeros(wire.numel(), dtype=torch.float64)
    for segs in layout.segments:
        for _, dst, n in segs:
            codes, scales = quantize_blockwise(wire[dst:dst + n], 4, BLOCK)
            out[dst:dst + n] = dequantize_blockwise(codes, scales, BLOCK, n, torch.float64)
    return out


def _grads(steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    drift = torch.randn(300, generator=gen, dtype=torch.float64)  # a persistent direction
    return [drift + 3 * torch.randn(300, generator=gen, dtype=torch.float64)
            for _ in range(steps)]


def test_error_feedback_drift_is_the_last_error():
    """beta = 0, exact fp32 storage, fp64 gradients (the reference kernel in fp64): the
    peers' decoded sum minus the gradient sum telescopes to minus the last error, so the
    probe's drift equals ||e_T|| / ||sum g|| (tolerance: fp64 rounding of the sums)."""
    layout = _layout()
    comp = Compensator(LoCoConfig(bits=4, beta=0.0, block_size=BLOCK, error_dtype="fp32",
                                  kernels="torch"))
    comp.probe = probe = DriftProbe()
    grads = _grads(20)
    for g in grads:
        comp.compress("b", g, layout)
        probe.end_step()
    e = comp.errors["b"].get().double()
    total = layout.to_padded(sum(grads), torch.float64)
    expected = float(e.norm() / total.norm())
    assert probe.steps == 20 and len(probe.series) == 20
    assert probe.drift() == pytest.approx(expected, rel=1e-9)
    assert probe.series[-1][1] == pytest.approx(expected, rel=1e-9)


def test_no_compensation_drift_is_the_sum_of_rounding_errors():
    """reset every step (no compensation): deQ(c_t) = deQ(Q(g_t)), the drift is
    ||sum (deQ(Q(g_t)) - g_t)|| / ||sum g_t||, computed here with the quantizer directly."""
    layout = _layout()
    comp = Compensator(LoCoConfig(bits=4, reset_interval=1, block_size=BLOCK, kernels="torch"))
    comp.probe = probe = DriftProbe()
    grads = [g.float() for g in _grads(12, seed=1)]
    diff = torch.zeros(layout.world * layout.padded_shard, dtype=torch.float64)
    for g in grads:
        comp.compress("b", g, layout)
        probe.end_step()
        gw = layout.to_padded(g, torch.float32)
        diff += _segment_roundtrip(layout, gw) - gw.double()
    total = layout.to_padded(sum(g.double() for g in grads), torch.float64)
    assert probe.drift() == pytest.approx(float(diff.norm() / total.norm()), rel=1e-9)
    # the uncompensated drift is far above error feedback's on the same gradients
    assert probe.drift() > 0.05


def test_zero_codes_counted_over_real_elements_only(tmp_path):
    """A step whose gradient is zero on a known set: zero codes = that set plus what rounds to
    zero; wire padding (alignment codes) never counts. The file is written."""
    layout = _layout()
    comp = Compensator(LoCoConfig(bits=4, reset_interval=1, block_size=BLOCK, kernels="torch"))
    comp.probe = probe = DriftProbe(tmp_path, rank=3)
    g = torch.ones(300)
    g[:100] = 0.0
    g[100] = 1e-3       # in a block whose absmax is 1: rounds to code 0
    comp.compress("b", g, layout)
    probe.end_step()
    assert probe.series[0][2] == pytest.approx(101 / 300)
    data = json.loads((tmp_path / "drift-rank3.json").read_text())
    assert data["rank"] == 3 and data["steps"] == 1
    assert data["series"][0][2] == pytest.approx(101 / 300)


def test_steps_without_compression_are_not_counted():
    probe = DriftProbe()
    probe.end_step()
    assert probe.steps == 0 and probe.series == []


def test_a_non_finite_step_does_not_poison_the_sums():
    """fp16 overflow: an inf in one step's gradient (megatron skips that step) is left out;
    the drift of the other steps stays finite and equals a run without that element."""
    layout = _layout()
    grads = [g.float() for g in _grads(4, seed=2)]
    probes = []
    for poison in (False, True):
        comp = Compensator(LoCoConfig(bits=4, reset_interval=1, block_size=BLOCK,
                                      kernels="torch"))
        comp.probe = probe = DriftProbe()
        for t, g in enumerate(grads):
            if poison and t == 1:
                g = g.clone()
                g[5] = float("inf")
            comp.compress("b", g, layout)
            probe.end_step()
        probes.append(probe)
    assert all(v == v for _, v, _ in probes[1].series)  # no NaN
    assert probes[1].series[0][1] == probes[0].series[0][1]
    assert probes[1].series[-1][1] != probes[0].series[-1][1]  # step 1 lost its poisoned block
