"""CUDA tensors and NCCL on one GPU (DP=1): the compensated reduce-scatter and the quantizer.

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
