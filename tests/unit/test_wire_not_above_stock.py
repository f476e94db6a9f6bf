"""LoCo never sends more bytes than megatron's stock reduce-scatter: a block size at
which the padded blocks would, is refused at start-up naming ``--loco-block-size`` and the
largest power-of-two block size that fits (loco_megatron/accounting.py)."""

import re

import pytest

from loco_megatron.accounting import check_wire_not_above_stock, expected_bytes_per_step
from loco_megatron.config import LoCoConfig, LoCoConfigError
from loco_megatron.layout import BucketLayout


def _tiny(block_size, numel=3 * 120, world=3, param=8):
    """A bucket of ``numel`` elements over ``world`` ranks cut at a parameter every ``param``
    elements (a 1-layer hidden-8 model's shapes)."""
    return BucketLayout.build(numel, world, block_size, range(0, numel, param))


def test_refused_with_the_largest_block_size_that_fits():
    cfg = LoCoConfig(bits=4, block_size=65536)
    with pytest.raises(LoCoConfigError) as info:
        check_wire_not_above_stock(cfg, [(_tiny(65536), 4)])
    msg = str(info.value)
    assert msg.startswith("--loco-block-size 65536: LoCo would send ")
    fits = int(re.search(r"use --loco-block-size (\d+) or smaller", msg).group(1))
    # the suggestion really fits, and twice it does not (largest power of two)
    loco, stock = expected_bytes_per_step(LoCoConfig(bits=4, block_size=fits), [(_tiny(fits), 4)])
    assert loco <= stock
    loco2, stock2 = expected_bytes_per_step(LoCoConfig(bits=4, block_size=2 * fits),
                                            [(_tiny(2 * fits), 4)])
    assert loco2 > stock2
    check_wire_not_above_stock(LoCoConfig(bits=4, block_size=fits), [(_tiny(fits), 4)])


def test_no_block_size_fits_says_to_turn_loco_off():
    """bf16 gradients cut every 2 elements: even 16-element blocks send 8x padding."""
    cfg = LoCoConfig(bits=8, block_size=256)
    with pytest.raises(LoCoConfigError, match="too small to gain from compression; run with "
                                              "--loco-bits 16"):
        check_wire_not_above_stock(cfg, [(_tiny(256, param=2), 2)])


def test_default_block_on_a_real_bucket_passes():
    lay = BucketLayout.build(8 * 1_000_000, 8, 256, range(0, 8 * 1_000_000, 4096))
    check_wire_not_above_stock(LoCoConfig(bits=4), [(lay, 2)])
    check_wire_not_above_stock(LoCoConfig(bits=4), [])  # nothing compressed: nothing to check
