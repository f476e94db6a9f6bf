"""benchmarks/wire_bytes.py: megatron-core's real bucket layout on the meta device, and byte
counts checked against what the compressed reduce-scatter really sends on gloo ranks."""

import math

import pytest
import torch
import torch.distributed as dist

from tests.helpers.multiproc import run_ranks

#: a tiny LLaMA-style GPT with odd sizes, so megatron pads parameter starts and bucket ends
TINY = dict(num_layers=2, hidden_size=72, ffn_hidden_size=200, num_attention_heads=4,
            vocab_size=131, seq_length=16)
TINY_BUCKET = 20000


def _buckets_worker(rank, world):
    """Real megatron DDP (real gloo DP group) vs the meta-device/fake-group path, and the bytes
    ``compensated_reduce_scatter`` really hands to ``all_to_all_single`` for each real bucket."""
    from benchmarks import wire_bytes as wb
    from loco_megatron import LoCoConfig
    from loco_megatron.collectives import WireStats, compensated_reduce_scatter
    from loco_megatron.compensator import Compensator
    from megatron.core import parallel_state as ps

    from loco_megatron.emulation import activate

    activate()
    ps.initialize_model_parallel(1)
    with wb.single_process_megatron():  # already open: reuses this world
        cfg, module = wb.build_meta_gpt(**TINY, device="cpu")
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)
        from loco_megatron.megatron import compat

        ddp = DistributedDataParallel(config=cfg, module=module, ddp_config=DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, grad_reduce_in_fp32=True,
            bucket_size=TINY_BUCKET))
        real = []
        for buffer in compat.ddp_buffers(ddp):
            for bucket in buffer.buckets:
                real.append({"numel": bucket.grad_data.numel(),
                             "ranges": sorted(compat.bucket_param_ranges(buffer, bucket).values())})
        cfg_m, meta = wb.build_meta_gpt(**TINY)
        fake = wb.megatron_buckets(cfg_m, meta, world, bucket_size=TINY_BUCKET)

    sent_bytes = {}
    real_all_to_all = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):  # bytes leaving this rank: all but own chunk
        sent_bytes["n"] += input.numel() * input.element_size() // world * (world - 1)
        return real_all_to_all(output, input, *args, **kwargs)

    measured = {}
    dist.all_to_all_single = counting
    try:
        for bits in (4, 8):
            comp = Compensator(LoCoConfig(bits=bits))
            stats, sent_bytes["n"] = WireStats(), 0
            for i, b in enumerate(real):
                layout = wb.loco_layout(b, world)
                x = torch.randn(b["numel"], generator=torch.Generator().manual_seed(rank + i))
                out = torch.empty(b["numel"] // world)
                compensated_reduce_scatter(out, x, compensator=comp, key=i, layout=layout,
                                           stats=stats)
            measured[bits] = (sent_bytes["n"], stats.bytes_sent, stats.stock_bytes)
    finally:
        dist.all_to_all_single = real_all_to_all
    return real, fake, measured


@pytest.fixture(scope="module")
def gloo4():
    return run_ranks(_buckets_worker, 4)


def test_meta_layout_is_megatrons_real_one(gloo4):
    """The meta-device, fake-group DDP gives the buckets of a real DDP on 4 gloo ranks, and
    megatron padded them (odd sizes), so the padding rules are really exercised."""
    real, fake, _ = gloo4[0]
    assert len(real) > 1
    assert [(b["numel"], b["ranges"]) for b in fake] == [(b["numel"], b["ranges"]) for b in real]
    params = sum(e - s for b in real for s, e in b["ranges"])
    assert sum(b["numel"] for b in real) > params  # megatron padding present
    assert all(b["numel"] % math.lcm(4, 128) == 0 for b in real)


def test_byte_counts_match_the_real_collective(gloo4):
    from benchmarks import wire_bytes as wb

    real, _, measured = gloo4[0]
    layouts = [wb.loco_layout(b, 4) for b in real]
    for bits in (4, 8):
        all_to_all, wire_stats, stock = measured[bits]
        expected = sum(wb.loco_bytes(lay, bits) for lay in layouts)
        assert all_to_all == expected
        assert wire_stats == expected
        assert stock == sum(wb.stock_bytes(lay, 4) for lay in layouts)
    for r in gloo4[1:]:  # every rank sends the same
        assert r[2] == measured


@pytest.fixture(scope="module")
def llama7b():
    from benchmarks import wire_bytes as wb

    return wb.llama2_7b_counts((8, 64, 512))


def test_llama2_7b_layout(llama7b):
    """The megatron layout holds exactly LLaMA-2-7B's published parameter count, plus padding
    that obeys megatron's rules."""
    for row in llama7b:
        assert row["model_params"] == 6_738_415_616
        assert row["params"] == 6_738_415_616
        assert row["numel"] == row["params"] + row["megatron_padding"] >= row["params"]
        assert row["numel"] % math.lcm(row["dp"], 128) == 0
        assert row["loco_wire_numel"] >= row["numel"]
    assert [r["buckets"] for r in llama7b] == sorted((r["buckets"] for r in llama7b), reverse=True)


def test_llama2_7b_acceptance_and_formula(llama7b):
    from benchmarks import wire_bytes as wb

    for row in llama7b:
        assert row["loco4_vs_bf16"] <= 0.27
        assert row["loco4_vs_fp32"] <= 0.135
        assert row["loco4_vs_bf16"] == pytest.approx(row["loco4"] / row["bf16"])
        assert row["exact_is_formula_padded"]
        assert row["loco4"] >= row["formula4"]  # short blocks' scales and alignment only add
        assert row["loco4"] <= row["loco4_padded_format"]  # never more than the padded format
        dp = row["dp"]
        stock_bf16 = (dp - 1) / dp * row["numel"] * 2
        assert row["bf16"] == pytest.approx(stock_bf16, rel=0, abs=0.5)
        assert wb.formula_bytes(row["numel"], dp, 4) / stock_bf16 == pytest.approx(
            (4 + 32 / wb.BLOCK_SIZE) / 16)


def test_loco_bytes_by_hand():
    """One small layout counted by hand: 2 ranks, 1000 elements cut at 130 -> shard 0 =
    segments of 130 (1 block) and 370 (2 blocks, the last short), shard 1 = 500 (2 blocks):
    500 codes and 3 blocks per rank on the wire; the padded format sent 256 + 512 codes."""
    from benchmarks import wire_bytes as wb
    from loco_megatron.layout import BucketLayout

    layout = BucketLayout.build(1000, 2, 256, [130])
    assert (layout.padded_shard, layout.blocks_per_shard) == (500, 3)
    # 500 codes at 4 bits + 3 scales, to the one peer
    assert wb.loco_bytes(layout, 4) == 500 // 2 + 3 * 4
    assert wb.padded_format_bytes(layout, 4) == 768 // 2 + 3 * 4
    assert wb.stock_bytes(layout, 2) == 500 * 2
