"""LoCo through Megatron-Bridge's own ``pretrain`` on 2 CPU ranks (gloo, the CUDA emulation):
stock against LoCo, LoCo off bit-identical to Bridge without the package, the weight-difference
all-gather's replicas identical, and LoCoCallback's figures against the seam's counters."""

import pytest
import torch

from tests.helpers.multiproc import run_ranks
from .worker_bridge import run

TIMEOUT_S = 600


def _same(a, b) -> bool:
    return a["losses"] == b["losses"] and all(
        torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def test_loco_4_bit_compresses_and_differs_from_stock():
    """The smallest check that LoCo runs inside Bridge: its start-up lines, 0.129x stock's
    bytes on the wire, and losses that differ from stock's after the first compressed step
    (the first iteration's loss is computed before any update)."""
    stock = run_ranks(run, 2, {"path": "stock", "iters": 3}, timeout_s=TIMEOUT_S)
    loco = run_ranks(run, 2, {"loco": {"bits": 4}, "iters": 3}, timeout_s=TIMEOUT_S)
    assert stock[0]["losses"][0] == loco[0]["losses"][0]
    assert stock[0]["losses"][1:] != loco[0]["losses"][1:]
    assert loco[0]["printed"].count("> LoCo active: 4-bit compensated reduce-scatter") == 1
    assert "vs 154624 stock (0.129x)" in loco[0]["printed"]
    sent, stock_bytes = loco[0]["wire"]
    assert 0 < sent < 0.13 * stock_bytes
    assert "wire" not in stock[0] and "LoCo" not in stock[0]["printed"]


def test_loco_off_is_bridge_without_the_package_bit_for_bit():
    """``loco.bits=16`` (installed, off) against Bridge's ``pretrain`` called without the
    package's install: the same losses and final parameters, bit for bit."""
    stock = run_ranks(run, 2, {"path": "stock", "iters": 3}, timeout_s=TIMEOUT_S)
    off = run_ranks(run, 2, {"loco": {"bits": 16}, "iters": 3}, timeout_s=TIMEOUT_S)
    for s, o in zip(stock, off):
        assert _same(s, o)
    assert "> LoCo off (--loco-bits 16)" in off[0]["printed"]
    assert off[0]["wire"] == (0, 0)


def test_param_bits_4_keeps_replicas_identical():
    """``loco.param_bits=4`` (the parameter all-gather as 4-bit weight differences): both
    ranks end with identical parameters, and the all-gather sent less than stock's."""
    res = run_ranks(run, 2, {"loco": {"bits": 4, "param-bits": 4}, "iters": 3},
                    timeout_s=TIMEOUT_S)
    assert all(torch.equal(res[0]["params"][n], res[1]["params"][n]) for n in res[0]["params"])
    sent, stock_bytes = res[0]["param_wire"]
    assert 0 < sent < stock_bytes
    tags = set(res[0]["figures"][-1][1])
    assert {"loco/param-gather-bytes-per-step", "loco/param-drift-max"} <= tags


def test_callback_figures_match_the_seam_counters(tmp_path):
    """LoCoCallback's figures every ``logger.log_interval`` iterations: the bytes per step and
    compression ratio equal the seam's exact counters (``LoCoState.wire``), the same values
    reach Bridge's TensorBoard logger (last rank), and the start-up line is printed once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = str(tmp_path / "tb")
    res = run_ranks(run, 2, {"loco": {"bits": 4}, "iters": 4, "log_interval": 2, "tb": tb},
                    timeout_s=TIMEOUT_S)
    sent, stock_bytes = res[0]["wire"]
    figures = res[0]["figures"]
    assert [it for it, _ in figures] == [2, 4]
    assert figures == res[1]["figures"]  # reduced over the ranks: the same everywhere
    for _, values in figures:
        assert values["loco/wire-bytes-per-step"] == sent / 4  # every step sends the same
        assert values["loco/compression-ratio"] == pytest.approx(stock_bytes / sent, rel=1e-12)
        assert values["loco/compression-error-norm"] > 0 and values["loco/error-buffer-norm"] > 0
    events = EventAccumulator(tb)
    events.Reload()
    for tag in figures[0][1]:
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert logged == [(it, pytest.approx(v[tag], rel=1e-6)) for it, v in figures]
    assert res[0]["printed"].count("> LoCo active") == 1
