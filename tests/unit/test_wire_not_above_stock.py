"""LoCo never sends more bytes than megatron's stock reduce-scatter. Blocks are not padded
(loco_megatron/layout.py), so only the 4-byte scale of every block can make LoCo dearer: a
block size at which it would is refused at start-up naming ``--loco-block-size`` and the
smallest larger power-of-two block size that fits (loco_megatron/accounting.py)."""

import re

import pytest

from loco_megatron.accounting import check_wire_not_above_stock, expected_bytes_per_step
from loco_megatron.config import LoCoConfig, LoCoConfigError
from loco_megatron.layout import BucketLayout


def _tiny(block_size, numel=3 * 120, world=3, param=8):
    """A bucket of ``numel`` elements over ``world`` ranks cut at a parameter every ``param``
    elements (a 1-layer hidden-8 model's shapes)."""
    return BucketLayout.build(numel, world, block_size, range(0, numel, param))


@pytest.mark.parametrize("block", [2, 6, 256, 65536])
def test_tiny_model_fp32_never_above_stock(block):
    """fp32 gradients, parameters of 8 elements: at any block size each 8-element segment sends
    4 bytes of codes and 4 or 16 of scales, against stock's 32."""
    cfg = LoCoConfig(bits=4, block_size=block)
    loco, stock = expected_bytes_per_step(cfg, [(_tiny(block), 4)])
    blocks = 3 * 120 // 8 * -(-8 // block)  # per rank: its 2 peers' shards
    assert loco == 2 * (120 // 2 + 4 * blocks // 3) and stock == 2 * 120 * 4
    check_wire_not_above_stock(cfg, [(_tiny(block), 4)])


def test_refused_with_the_smallest_block_size_that_fits():
    """bf16 gradients at block 2: 1 byte of codes + 4 of scale per 2 elements, stock 4."""
    cfg = LoCoConfig(bits=4, block_size=2)
    with pytest.raises(LoCoConfigError) as info:
        check_wire_not_above_stock(cfg, [(_tiny(2), 2)])
    msg = str(info.value)
    assert msg.startswith("--loco-block-size 2: LoCo would send ")
    fits = int(re.search(r"use --loco-block-size (\d+) or larger", msg).group(1))
    # the suggestion really fits, and half of it (if above the refused size) does not
    loco, stock = expected_bytes_per_step(LoCoConfig(bits=4, block_size=fits), [(_tiny(fits), 2)])
    assert loco <= stock
    if fits // 2 > 2:
        lo, st = expected_bytes_per_step(LoCoConfig(bits=4, block_size=fits // 2),
                                         [(_tiny(fits // 2), 2)])
        assert lo > st
    check_wire_not_above_stock(LoCoConfig(bits=4, block_size=fits), [(_tiny(fits), 2)])


def test_no_block_size_fits_says_to_turn_loco_off():
    """bf16 gradients cut every 2 elements at 8 bits: 2 bytes of codes + 4 of scale per
    segment against stock's 4, whatever the block size."""
    cfg = LoCoConfig(bits=8, block_size=256)
    with pytest.raises(LoCoConfigError, match="too small to gain from compression; run with "
                                              "--loco-bits 16"):
        check_wire_not_above_stock(cfg, [(_tiny(256, param=2), 2)])


def test_default_block_on_a_real_bucket_passes():
    lay = BucketLayout.build(8 * 1_000_000, 8, 256, range(0, 8 * 1_000_000, 4096))
    check_wire_not_above_stock(LoCoConfig(bits=4), [(lay, 2)])
    check_wire_not_above_stock(LoCoConfig(bits=4), [])  # nothing compressed: nothing to check
