"""CUDA tensors on one GPU: NCCL at DP 1 (the compensated reduce-scatter and the quantizer),
two ranks sharing the GPU over gloo with the Triton kernels (overlap on, 30 steps, replicas
identical), and a decompress above 2^31 elements against the reference (64-bit addressing).

Skipped without a GPU. Multi-GPU grids are in test_megatron_grid.py (``test_grid_nccl``).
"""

import pytest
import torch

from loco_megatron.collectives import compensated_reduce_scatter
from loco_megatron.compensator import Compensator
from loco_megatron.config import LoCoConfig
from loco_megatron.quantization import dequantize_blockwise, quantize_blockwise

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _nccl_dp1(rank, world):
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.randn(5000, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).to(dtype)
        comp = Compensator(LoCoConfig(bits=4, block_size=256))
        buf = g.clone()
        handle = compensated_reduce_scatter(buf, buf, async_op=True, compensator=comp, key=0)
        handle.wait()
        codes, scales = quantize_blockwise(g.float(), 4, 256)
        ref = dequantize_blockwise(codes, scales, 256, numel=5000).to(dtype)
        out[str(dtype)] = (buf.is_cuda, comp.errors[0].codes.is_cuda,
                           float((buf.float() - ref.float()).abs().max()))
        stock = g.clone()
        compensated_reduce_scatter(stock, g.clone(), compensator=None)
        out[str(dtype) + "_stock"] = bool(torch.equal(stock, g))
    return out


def test_compensated_reduce_scatter_nccl_dp1_cuda_tensors(run_ranks):
    r = run_ranks(_nccl_dp1, 1, backend="nccl")[0]
    for dtype in ("torch.float32", "torch.bfloat16"):
        on_gpu, err_on_gpu, diff = r[dtype]
        assert on_gpu and err_on_gpu
        assert diff <= (1e-6 if dtype == "torch.float32" else 1e-2)
        assert r[dtype + "_stock"]


def test_quantizer_cuda_matches_cpu():
    x = torch.randn(10_000)
    c_cpu, s_cpu = quantize_blockwise(x, 4, 256)
    c_gpu, s_gpu = quantize_blockwise(x.cuda(), 4, 256)
    assert torch.equal(c_cpu, c_gpu.cpu()) and torch.equal(s_cpu, s_gpu.cpu())


def _shared_gpu_worker(rank, world):
    """The tiny GPT on the shared GPU, ``--loco-bits 4 --loco-param-bits 4`` with the Triton
    kernels, overlap on, 30 steps: losses, replicas identical, LoCo's calls."""
    import loco_megatron
    from megatron.core import parallel_state as ps

    from .worker_megatron import build_gpt, forward_backward

    ps.initialize_model_parallel(1)
    state = loco_megatron.install(LoCoConfig(bits=4, param_bits=4, kernels="triton"))
    try:
        model, opt = build_gpt(True, 6000, dropout=0.0, overlap_param_gather=True,
                               module_fn=lambda m: m.cuda())
        losses = []
        for _ in range(30):
            losses.append(float(forward_backward(model, opt)))
            opt.step()
        model.start_param_sync(force_sync=True)
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.module.parameters()])
        copies = [torch.empty_like(flat.cpu()) for _ in range(world)]
        torch.distributed.all_gather(copies, flat.cpu())
        return {"losses": losses, "identical": all(torch.equal(c, copies[0]) for c in copies),
                "calls": state.wire.calls, "on_gpu": flat.is_cuda}
    finally:
        loco_megatron.uninstall()


def test_two_ranks_share_one_gpu_over_gloo(run_ranks):
    """Where torch's gloo runs LoCo's collectives on CUDA tensors; otherwise skipped with
    gloo's own message (the report lists it)."""
    from tests.helpers.multiproc import GLOO_CUDA

    try:
        results = run_ranks(_shared_gpu_worker, 2, backend=GLOO_CUDA)
    except Exception as e:  # noqa: BLE001 - gloo's CUDA support is the question asked
        text = str(e)
        if "gloo" in text.lower() and ("not supported" in text or "unsupported" in text.lower()
                                       or "Only CPU" in text):
            pytest.skip(f"torch's gloo cannot run these collectives on CUDA tensors: "
                        f"{text.strip().splitlines()[-1][:300]}")
        raise
    for r in results:
        assert r["on_gpu"] and r["identical"] and r["calls"] > 0
        assert all(x == x for x in r["losses"]) and r["losses"][-1] < r["losses"][0]


def test_decompress_above_2_31_elements_matches_reference():
    """A DP-2 bucket whose second shard starts past 2^31 wire elements: the Triton decompress
    of every rank's shard equals the torch reference bit for bit (a 32-bit ``r * chunk``
    wrapped and read the wrong codes). Needs about 40 GiB free."""
    from loco_megatron import kernels
    from loco_megatron.layout import BucketLayout

    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2 ** 30:
        pytest.skip(f"needs 40 GiB of free GPU memory, has {free / 2 ** 30:.1f}")
    shard = 2 ** 31 + 4096 * 3
    layout = BucketLayout.build(2 * shard, 2, 4096)
    table = kernels.block_table(layout, "cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    payload = torch.randint(0, 256, (table.padded_numel // 2,), dtype=torch.uint8,
                            device="cuda", generator=gen)
    scales = torch.rand(table.nblocks, device="cuda", generator=gen)
    for rank in (1, 0):
        got = torch.empty(table.shard, device="cuda")
        kernels.decompress_shard("triton", payload, scales, table, rank, bits=4, average=True,
                                 out=got)
        ref = torch.empty_like(got)
        kernels.decompress_shard("torch", payload, scales, table, rank, bits=4, average=True,
                                 out=ref)
        assert torch.equal(got, ref), rank
        del got, ref
        torch.cuda.empty_cache()
