"""LoCo step metrics: what the compensator records, and the reduction over ranks and steps."""

import math

import pytest
import torch

from loco_megatron.collectives import WireStats
from loco_megatron.compensator import Compensator, ErrorBuffer
from loco_megatron.config import LoCoConfig
from loco_megatron.metrics import StepMetrics
from loco_megatron.quantization import dequantize_blockwise, quantize_blockwise

from tests.helpers.multiproc import run_ranks

BLOCK = 64


class _Recorder:
    def __init__(self):
        self.calls = []

    def record(self, err_sq, buf_sq, nonfinite):
        self.calls.append((err_sq.clone(), buf_sq.clone(), bool(nonfinite)))


@pytest.mark.parametrize("storage", ["int8", "fp32"])
@pytest.mark.parametrize("bits,beta", [(4, 0.8), (8, 0.0)])
def test_compensator_records_error_and_stored_buffer(bits, beta, storage):
    """Per compress: err == h - deQ(Q(h)) recomputed from g and the previous stored error
    (exact: same fp32 ops), and buf_sq == ||e_stored||^2 in fp64 within 1e-6 relative."""
    comp = Compensator(LoCoConfig(bits=bits, beta=beta, block_size=BLOCK, error_dtype=storage,
                                  reset_interval=3))
    comp.metrics = rec = _Recorder()
    torch.manual_seed(0)
    for step in range(5):
        g = torch.randn(BLOCK * 8)
        e_prev = comp.errors["b"].get() if "b" in comp.errors and step != 3 else torch.zeros_like(g)
        h = g + e_prev  # step 3 resets the buffer first
        codes, scales = quantize_blockwise(h, bits, BLOCK)
        expected_err = h - dequantize_blockwise(codes, scales.float(), BLOCK)
        comp.compress("b", g)
        err_sq, buf_sq, nonfinite = rec.calls[-1]
        exact = expected_err.double().square().sum()
        assert abs(float(err_sq) - float(exact)) <= 1e-6 * float(exact) and not nonfinite
        stored = comp.errors["b"].get().double().square().sum()
        assert abs(float(buf_sq) - float(stored)) <= 1e-6 * float(stored)
        assert float(stored) > 0
    assert len(rec.calls) == 5


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_nonfinite_gradient_records_no_error(kernels):
    comp = Compensator(LoCoConfig(bits=4, block_size=BLOCK, kernels=kernels))
    comp.metrics = rec = _Recorder()
    comp.compress("b", torch.randn(BLOCK * 2))
    _block1_before = comp.errors["b"].get()[BLOCK:].clone()
    g = torch.randn(BLOCK * 2)
    g[5] = float("inf")
    comp.compress("b", g)
    err_sq, buf_sq, nonfinite = rec.calls[1]
    assert int(nonfinite) == 1  # one block (of 2) non-finite: it keeps its error, adds nothing
    e_prev = comp.errors["b"].get()  # block 0 kept; block 1: as the reference computes it
    h1 = (g[BLOCK:] + _block1_before).double()
    codes, scales = quantize_blockwise(h1.float(), 4, BLOCK)
    exact = float((h1 - dequantize_blockwise(codes, scales, BLOCK, dtype=torch.float64)).square().sum())
    assert abs(float(err_sq) - exact) <= 1e-6 * exact
    assert abs(float(buf_sq) - float(e_prev.double().square().sum())) <= 1e-6 * float(buf_sq)


def test_int8_squared_norm_matches_decoded_value():
    buf = ErrorBuffer(BLOCK * 16, BLOCK, "int8", torch.float32, "cpu")
    buf.set(torch.randn(BLOCK * 16) * torch.logspace(-3, 1, BLOCK * 16))
    ref = buf.get().double().square().sum()
    assert abs(float(buf.squared_norm()) - float(ref)) <= 1e-6 * float(ref)


# Synthetic records on 2 ranks: integer-valued tensors make every sum exact in fp64.
# rank r, step s: err entries and buffer squared norm; step 2 has a non-finite bucket on rank 1;
# step 3 compresses nothing anywhere; rank 1 sends more bytes than rank 0 (uneven stages).
ERR = {0: [[3.0], [1.0, 2.0], [2.0], None], 1: [[4.0], [2.0], None, None]}
BUF = {0: [1.0, 4.0, 9.0, None], 1: [3.0, 5.0, 2.0, None]}
BYTES = {0: (100, 800), 1: (150, 1000)}  # (LoCo, stock) per compressing step


def _metrics_worker(rank, world):
    wire = WireStats()
    m = StepMetrics(wire)
    out = []
    for step in range(4):
        if BUF[rank][step] is not None:
            e = ERR[rank][step]
            err_sq = torch.tensor(0.0 if e is None else sum(x * x for x in e), dtype=torch.float64)
            m.record(err_sq, torch.tensor(BUF[rank][step], dtype=torch.float64),
                     torch.tensor(e is None))
            wire.bytes_sent += BYTES[rank][0]
            wire.stock_bytes += BYTES[rank][1]
        m.end_step()
        if step == 0:
            out.append(m.reduce())  # a window of one step
    out.append(m.pending_steps())
    out.append(m.reduce())  # window: steps 1-3
    m.end_step()
    out.append(m.reduce())  # a window where nobody compressed
    return out


def test_reduce_over_ranks_and_steps_exact():
    for first, pending, window, empty in run_ranks(_metrics_worker, 2):
        assert first.steps == 1 and first.nonfinite_steps == 0
        assert first.error_norm == 5.0  # sqrt(3^2 + 4^2)
        assert first.buffer_norm == 2.0  # sqrt(1 + 3)
        assert first.bytes_per_step == 150 and first.stock_bytes_per_step == 1000  # max rank
        assert first.compression_ratio == 1800 / 250
        assert pending == 3
        # steps 1 and 2 compressed; step 2 non-finite on rank 1 -> left out of the norms
        assert window.steps == 2 and window.nonfinite_steps == 1
        assert window.error_norm == 3.0  # step 1 only: sqrt(1 + 4 + 4)
        assert window.buffer_norm == 3.0  # sqrt(4 + 5)
        assert window.bytes_per_step == 150 and window.compression_ratio == 1800 / 250
        assert empty is None


def test_all_nonfinite_window_reports_nan():
    def check(fig):
        return math.isnan(fig.error_norm) and math.isnan(fig.buffer_norm) and fig.steps == 1

    assert all(check(fig) for fig in run_ranks(_nonfinite_worker, 2))


def _nonfinite_worker(rank, world):
    wire = WireStats()
    m = StepMetrics(wire)
    m.record(torch.tensor(0.0), torch.tensor(1.0), torch.tensor(True))
    wire.bytes_sent, wire.stock_bytes = 10, 80
    m.end_step()
    return m.reduce()
