"""The padding-free wire format on the smallest model (loco_megatron/layout.py): a 1-layer,
hidden-8, vocabulary-61 GPT on 3 DP ranks, fp32 gradients, blocks of 2, 6, 256 and 65536
elements. Blocks are cut short at every parameter and shard boundary instead of padded, so the
start-up line's bytes stay below stock's at every block size and equal what the all-to-alls are
handed; the int8 error state stays near 1 byte per gradient element."""

import pytest
import torch

from tests.helpers.multiproc import run_ranks
from .worker_tiny_wire import full_precision_1d_worker, tiny_wire_worker

BLOCKS = (2, 6, 256, 65536)


@pytest.fixture(scope="module")
def tiny():
    return run_ranks(tiny_wire_worker, 3, BLOCKS)


@pytest.mark.parametrize("block", BLOCKS)
def test_startup_bytes_are_what_the_all_to_alls_are_handed_and_below_stock(tiny, block):
    line = tiny[0][block]  # rank 0 prints the start-up lines
    assert line["line"] is not None and line["loco"] <= line["stock"], line["line"]
    for rank, res in enumerate(tiny):
        r = res[block]
        assert line["loco"] == r["handed"] == r["wire"], (rank, line["line"], r)
        assert all(x == x and x < 10 for x in r["losses"]), r["losses"]  # trains, no NaN
    # one more element per block (block 2) costs 4 bytes of scale; a huge block costs nothing
    if block == 65536:
        assert tiny[0][65536]["loco"] <= tiny[0][256]["loco"] < tiny[0][2]["loco"]


@pytest.mark.parametrize("block", [b for b in BLOCKS if b >= 64])
def test_error_state_about_one_byte_per_element(tiny, block):
    """int8 codes for every wire element + one fp32 scale per block: <= 1.1 B/element."""
    for res in tiny:
        r = res[block]
        assert r["error_bytes"] <= 1.1 * r["elements"], (r["error_bytes"], r["elements"])
        assert r["error_bytes"] >= r["elements"]  # one int8 code per gradient element at least


def test_full_precision_1d_is_stock_for_1d_parameters_with_exact_bytes():
    """--loco-full-precision-1d on 2 ranks: every 1-D parameter's reduced gradient equals
    stock's bit for bit (2 ranks: the fp32 sum of two is the same in any order), the other
    elements are compressed (they differ), and the start-up line's bytes are exactly what the
    all-to-alls (codes, scales and the fp32 lane) were handed."""
    results = run_ranks(full_precision_1d_worker, 2)
    for rank, res in enumerate(results):
        stock, fp = res["stock"], res["fp1d"]
        covered = 0
        for s_shard, f_shard, ranges in zip(stock["shards"], fp["shards"], fp["one_d"]):
            mask = torch.zeros(s_shard.numel(), dtype=torch.bool)
            for start, end in ranges:
                mask[max(start, 0):max(min(end, s_shard.numel()), 0)] = True
            covered += int(mask.sum())
            assert torch.equal(s_shard[mask], f_shard[mask]), rank
            assert not torch.equal(s_shard[~mask], f_shard[~mask])  # the rest is compressed
        assert covered > 0  # this rank's shards hold 1-D parameters
        codes = [b for d, b in fp["handed"] if d == "torch.uint8"]
        fp32 = [b for d, b in fp["handed"] if d == "torch.float32"]
        assert codes and len(fp32) == 2 * len(codes)  # per bucket: scales and the fp32 lane
        assert fp["wire"] == sum(b for _, b in fp["handed"])
    line = results[0]["fp1d"]
    assert line["loco"] == line["wire"] < line["stock"], line["line"]
    assert any("1-D parameters at full precision" in x for x in line["buffer_lines"])
