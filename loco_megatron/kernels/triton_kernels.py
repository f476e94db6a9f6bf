"""Triton fused kernels (``--loco-kernels triton``): CUDA tensors; CPU under ``TRITON_INTERPRET=1``.

One program handles ``ROWS`` quantization blocks as a ``[ROWS, B/2]`` tile of even and odd
elements (the two nibbles of a packed byte). Bit-exact with the torch reference
(:mod:`loco_megatron.algorithm`): IEEE division (``div_rn``; Triton's default fp32 ``/`` is
approximate on GPUs), no FMA contraction (``enable_fp_fusion=False``), round-half-to-even by the 1.5 * 2^23
trick, and NaN handled explicitly (``max`` may drop NaN). A non-finite block keeps its previous
error (stores of the old codes/scale or values; zero on a reset step) and is counted in a device
counter, without a host sync.
"""

import os
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None

from ..quantization import divisor, max_scale

ROWS = 8  # blocks per program


def triton_interpret() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run on CPU tensors (slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason(tensor: torch.Tensor) -> Optional[str]:
    """None when the Triton kernels can process ``tensor``, else why not."""
    if triton is None:
        return "Triton is not installed (pip install triton)"
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {tensor.dtype} is not supported (fp32, bf16, fp16)"
    if tensor.device.type != "cuda" and not triton_interpret():
        return (f"tensor on {tensor.device}: Triton runs CUDA tensors (set TRITON_INTERPRET=1 "
                f"to interpret the kernels on CPU, for tests)")
    return None


if triton is not None:

    @triton.jit
    def _rne(x):
        return (x + 12582912.0) - 12582912.0

    @triton.jit
    def _codes(h, safe, lo: tl.constexpr, hi: tl.constexpr):
        r = _rne(tl.math.div_rn(h, safe))
        r = tl.minimum(tl.maximum(r, lo), hi)
        return tl.where(r == r, r, 0.0)

    @triton.jit
    def _bf16_bits(x):
        """fp32 -> bf16 bit pattern, round-half-to-even (NaN stays a quiet NaN), as int16:
        integer arithmetic, so the interpreter (which truncates) and GPUs agree with torch."""
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return tl.where(x != x, 0x7FC0, r).to(tl.int16)

    @triton.jit
    def _compress_kernel(g_ptr, src_ptr, off_ptr, len_ptr, nblocks, ecodes_ptr, escales_ptr, evalues_ptr,
                         payload_ptr, scales_ptr, flag_ptr, errsq_ptr, bufsq_ptr, beta, omb, smax,
                         B: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr,
                         BITS: tl.constexpr, DIV: tl.constexpr, INT8_ERR: tl.constexpr,
                         RESET: tl.constexpr, USE_BETA: tl.constexpr, ERRSQ: tl.constexpr):
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1  # codes in [-QMAX - 1, QMAX] on either grid
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rmask = rows < nblocks
        src = tl.load(src_ptr + rows, mask=rmask, other=0)
        length = tl.load(len_ptr + rows, mask=rmask, other=0)
        woff = tl.load(off_ptr + rows, mask=rmask, other=0)
        j = tl.arange(0, HALF)
        ev = 2 * j
        od = ev + 1
        m = rmask[:, None] & (j < B // 2)[None, :]
        me = m & (ev[None, :] < length[:, None])  # valid even / odd elements of each block
        mo = m & (od[None, :] < length[:, None])
        base = woff.to(tl.int64)[:, None]  # wire (and error) offset of each block, even
        ge = tl.load(g_ptr + src[:, None] + ev[None, :], mask=me, other=0.0).to(tl.float32)
        go = tl.load(g_ptr + src[:, None] + od[None, :], mask=mo, other=0.0).to(tl.float32)
        if RESET:
            ee = tl.zeros([ROWS, HALF], dtype=tl.float32)
            eo = tl.zeros([ROWS, HALF], dtype=tl.float32)
        elif INT8_ERR:
            es = tl.load(escales_ptr + rows, mask=rmask, other=0.0)
            ce0 = tl.load(ecodes_ptr + base + ev[None, :], mask=me, other=0)
            co0 = tl.load(ecodes_ptr + base + od[None, :], mask=mo, other=0)
            ee = ce0.to(tl.float32) * es[:, None]
            eo = co0.to(tl.float32) * es[:, None]
        else:
            ee = tl.load(evalues_ptr + base + ev[None, :], mask=me, other=0.0)
            eo = tl.load(evalues_ptr + base + od[None, :], mask=mo, other=0.0)
        he = ge + ee
        ho = go + eo
        amax = tl.maximum(tl.max(tl.abs(he), axis=1), tl.max(tl.abs(ho), axis=1))
        nan = tl.max(((he != he) | (ho != ho)).to(tl.int32), axis=1)
        bad = (nan > 0) | (amax > 3.4028234663852886e38)
        scale = tl.math.div_rn(amax, DIV * 1.0)  # DIV: the grid's divisor (QMAX or QMAX + 1)
        scale = tl.where(nan > 0, float("nan"), tl.where(~bad & (scale > smax), smax, scale))
        safe = tl.where(scale > 0, scale, 1.0)[:, None]
        qe = _codes(he, safe, -QMAX - 1.0, QMAX * 1.0)
        qo = _codes(ho, safe, -QMAX - 1.0, QMAX * 1.0)
        tl.store(scales_ptr + rows, scale, mask=rmask)
        if BITS == 4:
            byte = (qe.to(tl.int32) & 15) | ((qo.to(tl.int32) & 15) << 4)
            # an odd-length block's last byte: its high nibble is a zero code (h = 0 there)
            tl.store(payload_ptr + base // 2 + j[None, :], byte.to(tl.uint8), mask=me)
        else:
            tl.store(payload_ptr + base + ev[None, :], qe.to(tl.int8), mask=me)
            tl.store(payload_ptr + base + od[None, :], qo.to(tl.int8), mask=mo)
        erre = he - qe * scale[:, None]
        erro = ho - qo * scale[:, None]
        if ERRSQ:
            sq = tl.sum(erre * erre, axis=1) + tl.sum(erro * erro, axis=1)
            tl.store(errsq_ptr + rows, tl.where(bad, 0.0, sq), mask=rmask)
        if USE_BETA:
            ne = beta * ee + omb * erre
            no = beta * eo + omb * erro
        else:
            ne = erre
            no = erro
        keep = bad[:, None]  # a non-finite block keeps its previous error (zero after a reset)
        if INT8_ERR:
            emax = tl.maximum(tl.max(tl.abs(ne), axis=1), tl.max(tl.abs(no), axis=1))
            es2 = tl.math.div_rn(emax, 127.0)
            esafe = tl.where(es2 > 0, es2, 1.0)[:, None]
            ce = _codes(ne, esafe, -128.0, 127.0)
            co = _codes(no, esafe, -128.0, 127.0)
            if RESET:
                ce = tl.where(keep, 0.0, ce)
                co = tl.where(keep, 0.0, co)
                es2 = tl.where(bad, 0.0, es2)
            else:
                ce = tl.where(keep, ce0.to(tl.float32), ce)
                co = tl.where(keep, co0.to(tl.float32), co)
                es2 = tl.where(bad, es, es2)
            tl.store(ecodes_ptr + base + ev[None, :], ce.to(tl.int8), mask=me)
            tl.store(ecodes_ptr + base + od[None, :], co.to(tl.int8), mask=mo)
            tl.store(escales_ptr + rows, es2, mask=rmask)
            if ERRSQ:  # ||e||^2 of the stored error, per block: scale^2 * sum(codes^2)
                csq = tl.sum(ce * ce, axis=1) + tl.sum(co * co, axis=1)
                tl.store(bufsq_ptr + rows, es2 * es2 * csq, mask=rmask)
        else:
            tl.store(evalues_ptr + base + ev[None, :], tl.where(keep, ee, ne), mask=me)
            tl.store(evalues_ptr + base + od[None, :], tl.where(keep, eo, no), mask=mo)
        tl.atomic_add(flag_ptr, tl.sum((bad & rmask).to(tl.int32), axis=0))

    @triton.jit
    def _decompress_kernel(payload_ptr, scales_ptr, out_ptr, src_ptr, off_ptr, len_ptr, nbs,
                           first, out_base, chunk, off_base, world, B: tl.constexpr, HALF: tl.constexpr,
                           ROWS: tl.constexpr, BITS: tl.constexpr, AVERAGE: tl.constexpr,
                           OUT_BF16: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rmask = rows < nbs
        j = tl.arange(0, HALF)
        ev = 2 * j
        od = ev + 1
        m = rmask[:, None] & (j < B // 2)[None, :]
        length = tl.load(len_ptr + first + rows, mask=rmask, other=0)
        me = m & (ev[None, :] < length[:, None])
        mo = m & (od[None, :] < length[:, None])
        rel = tl.load(off_ptr + first + rows, mask=rmask, other=0).to(tl.int64) - off_base
        acc_e = tl.zeros([ROWS, HALF], dtype=tl.float32)
        acc_o = tl.zeros([ROWS, HALF], dtype=tl.float32)
        for r in range(world):
            blk = (r * nbs + rows).to(tl.int64)
            at = (r * chunk + rel)[:, None]  # wire element of the block's first code (even)
            s = tl.load(scales_ptr + blk, mask=rmask, other=0.0)[:, None]
            if BITS == 4:
                byte = tl.load(payload_ptr + at // 2 + j[None, :], mask=me, other=0).to(tl.int32)
                lo = byte & 15
                hi = (byte >> 4) & 15
                ce = tl.where(lo >= 8, lo - 16, lo)
                co = tl.where(hi >= 8, hi - 16, hi)
            else:
                ce = tl.load(payload_ptr + at + ev[None, :], mask=me, other=0)
                co = tl.load(payload_ptr + at + od[None, :], mask=mo, other=0)
            acc_e += ce.to(tl.float32) * s
            acc_o += co.to(tl.float32) * s
        if AVERAGE:
            acc_e = tl.math.div_rn(acc_e, world.to(tl.float32))
            acc_o = tl.math.div_rn(acc_o, world.to(tl.float32))
        src = tl.load(src_ptr + first + rows, mask=rmask, other=0) - out_base
        dst = out_ptr + src[:, None]
        if OUT_BF16:  # out_ptr is the bf16 output viewed as int16
            ve = _bf16_bits(acc_e)
            vo = _bf16_bits(acc_o)
        else:
            ve = acc_e.to(out_ptr.dtype.element_ty)
            vo = acc_o.to(out_ptr.dtype.element_ty)
        tl.store(dst + ev[None, :], ve, mask=me)
        tl.store(dst + od[None, :], vo, mask=mo)


def _half(block_size: int) -> int:
    return triton.next_power_of_2(block_size // 2)


def compress_bucket(g, table, err, *, bits, beta, reset, want_err_sq, grid="symmetric"):
    """Triton implementation of :func:`loco_megatron.kernels.compress_bucket`."""
    dev = g.device
    g = g.reshape(-1)
    if not g.is_contiguous():
        g = g.contiguous()
    # zeros: the wire elements no block covers (alignment, a shorter shard's end) are zero codes
    payload = torch.zeros(table.padded_numel * bits // 8, dtype=torch.uint8, device=dev)
    scales = torch.empty(table.nblocks, dtype=torch.float32, device=dev)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    errsq = torch.empty(table.nblocks, dtype=torch.float32, device=dev) if want_err_sq else flag
    bufsq = torch.empty_like(errsq) if want_err_sq else flag
    int8 = err.storage == "int8"
    if not int8 and err.values.dtype != torch.float32:
        raise ValueError(f"the Triton kernels keep fp32 error values, got {err.values.dtype}")
    dummy = scales
    _compress_kernel[(triton.cdiv(table.nblocks, ROWS),)](
        g, table.src, table.off, table.length, table.nblocks,
        err.codes if int8 else dummy, err.scales if int8 else dummy,
        dummy if int8 else err.values,
        payload.view(torch.int8) if bits == 8 else payload, scales, flag, errsq, bufsq,
        float(beta), 1.0 - float(beta), max_scale(bits, grid),
        B=table.block_size, HALF=_half(table.block_size), ROWS=ROWS, BITS=bits,
        DIV=divisor(bits, grid), INT8_ERR=int8, RESET=bool(reset), USE_BETA=beta != 0,
        ERRSQ=bool(want_err_sq), enable_fp_fusion=False)
    nonfinite = flag[0]
    err_sq = buf_sq = None
    if want_err_sq:
        err_sq = errsq.double().sum()
        if int8:
            buf_sq = bufsq.double().sum()
    return payload, scales, nonfinite, err_sq, buf_sq


def decompress_shard(payload, scales, table, rank, *, bits, average, out):
    """Triton implementation of :func:`loco_megatron.kernels.decompress_shard`."""
    nbs = table.blocks_per_shard
    target = out if out.is_contiguous() else torch.empty_like(out)
    bf16 = out.dtype == torch.bfloat16
    _decompress_kernel[(triton.cdiv(nbs, ROWS),)](
        payload.view(torch.int8) if bits == 8 else payload, scales,
        target.view(torch.int16) if bf16 else target, table.src, table.off,
        table.length, nbs, rank * nbs, rank * table.shard, table.padded_shard,
        rank * table.padded_shard, table.world,
        B=table.block_size, HALF=_half(table.block_size), ROWS=ROWS, BITS=bits,
        AVERAGE=bool(average), OUT_BF16=bf16, enable_fp_fusion=False)
    if target is not out:
        out.copy_(target)
