"""Triton fused kernels (``--loco-kernels triton``): CUDA tensors; CPU under
``TRITON_INTERPRET=1``.

One program handles ``ROWS`` quantization blocks as ``[ROWS, T]`` tiles of even and odd
elements (the two nibbles of a packed byte), ``ntiles`` tiles per block (:mod:`.launch`:
chosen by block size, so that no block size spills registers; helpers in
:mod:`.triton_tiles`). Every address computed from a runtime size is 64-bit (a launch passes
ints below 2^31 as i32). Bit-exact with the torch reference (:mod:`loco_megatron.algorithm`):
one IEEE division (``div_rn``; Triton's default fp32 ``/`` is approximate on GPUs) per block
for its scale and its reciprocal, a multiplication per element, no FMA contraction
(``enable_fp_fusion=False``), round-half-to-even by the 1.5 * 2^23 trick, and NaN kept by
integer reductions of the bit patterns (a float ``max`` may drop NaN). A non-finite block
keeps its previous error (stores of the old codes/scale or values; zero on a reset step) and
is counted in a device counter,
without a host sync. GPU contract and its compile check: docs/kernels.md.
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
from . import launch_keys
from .launch import LaunchConfig, launch_config

#: runtime arguments of the compress kernel Triton must not specialize (an int equal to 1
#: would become a constexpr: a reset step would compile a variant of its own)
COMPRESS_NOT_SPECIALIZED = ("ntiles", "reset")


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
    from .triton_tiles import (_bf16_bits, _bits_absmax, _emit, _quantize, _store_error_int8,
                               _tile, floored, reciprocal)

    @triton.jit(do_not_specialize=COMPRESS_NOT_SPECIALIZED)
    def _compress_kernel(g_ptr, src_ptr, off_ptr, len_ptr, nblocks, ecodes_ptr, escales_ptr,
                         evalues_ptr, payload_ptr, scales_ptr, flag_ptr, errsq_ptr, bufsq_ptr,
                         beta, omb, smax, ntiles, reset, B: tl.constexpr, T: tl.constexpr,
                         ONE_TILE: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr,
                         DIV: tl.constexpr, INT8_ERR: tl.constexpr, USE_BETA: tl.constexpr,
                         ERRSQ: tl.constexpr):
        """``ROWS`` blocks; each in ``ntiles`` tiles of ``T`` element pairs: one tile
        (``ONE_TILE``) is loaded once, more are loaded per pass (absmax; codes and error; int8
        error codes). ``ntiles`` is a runtime loop count and ``reset`` (1 on a reset step: the
        stored error reads as zero) a runtime flag, neither specialized: every multi-tile block
        size compiles to the same code, and a reset step launches the variant of every other
        step (no compile mid-run)."""
        QMAX: tl.constexpr = (1 << (BITS - 1)) - 1  # codes in [-QMAX - 1, QMAX] on either grid
        FULL: tl.constexpr = DIV > QMAX  # the full-range grid (its absmax element is clipped)
        # every address is 64-bit: the block index widens before it is scaled or offset
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rmask = rows < nblocks
        gsrc = tl.load(src_ptr + rows, mask=rmask, other=0).to(tl.int64)[:, None]
        length = tl.load(len_ptr + rows, mask=rmask, other=0)
        base = tl.load(off_ptr + rows, mask=rmask, other=0).to(tl.int64)[:, None]  # even
        live = reset == 0  # the stored error is read (zero on a reset step, without a load)
        if INT8_ERR:
            es = tl.load(escales_ptr + rows, mask=rmask & live, other=0.0)
        else:
            es = tl.zeros([ROWS], dtype=tl.float32)
        if ONE_TILE:  # pass 1: the block's absmax (and NaN), as an fp32 bit pattern
            he, ho, ee, eo, ce0, co0, bt, j, mp = _tile(
                g_ptr, ecodes_ptr, evalues_ptr, gsrc, base, es, length, rmask, 0, live, B,
                T, INT8_ERR)
            abits = _bits_absmax(he, ho)
        else:
            abits = tl.zeros([ROWS], dtype=tl.int32)
            for t in range(ntiles):
                the, tho, tee, teo, tce0, tco0, tbt, tj, tmp = _tile(
                    g_ptr, ecodes_ptr, evalues_ptr, gsrc, base, es, length, rmask, t, live, B,
                    T, INT8_ERR)
                abits = tl.maximum(abits, _bits_absmax(the, tho))
        nan = abits > 0x7F800000  # above inf's pattern: a NaN
        bad = abits >= 0x7F800000
        amax = abits.to(tl.float32, bitcast=True)
        scale = floored(amax, DIV * 1.0)  # DIV: the grid's divisor (QMAX or QMAX + 1)
        scale = tl.where(nan, float("nan"), tl.where(~bad & (scale > smax), smax, scale))
        inv = reciprocal(tl.where(scale > 0, scale, 1.0))[:, None]
        tl.store(scales_ptr + rows, scale, mask=rmask)
        keep = bad[:, None]  # a non-finite block keeps its previous error (zero after a reset)
        # pass 2: codes, this step's error, the new error (fp32 storage: stored)
        if ONE_TILE:
            sq, ebits, ne, no = _emit(payload_ptr, evalues_ptr, bt, he, ho, ee, eo, j, mp,
                                      scale, inv, keep, beta, omb, QMAX, FULL, USE_BETA, BITS,
                                      INT8_ERR)
        else:
            sq = tl.zeros([ROWS], dtype=tl.float32)
            ebits = tl.zeros([ROWS], dtype=tl.int32)
            for t in range(ntiles):
                the, tho, tee, teo, tce0, tco0, tbt, tj, tmp = _tile(
                    g_ptr, ecodes_ptr, evalues_ptr, gsrc, base, es, length, rmask, t, live, B,
                    T, INT8_ERR)
                tsq, tbits, tne, tno = _emit(payload_ptr, evalues_ptr, tbt, the, tho, tee, teo,
                                             tj, tmp, scale, inv, keep, beta, omb, QMAX, FULL,
                                             USE_BETA, BITS, INT8_ERR)
                sq += tsq
                ebits = tl.maximum(ebits, tbits)
        if ERRSQ:
            tl.store(errsq_ptr + rows, tl.where(bad, 0.0, sq), mask=rmask)
        if INT8_ERR:  # pass 3: the new error's int8 codes, on its own block scale
            es2 = floored(ebits.to(tl.float32, bitcast=True), 127.0)
            einv = reciprocal(tl.where(es2 > 0, es2, 1.0))[:, None]
            if ONE_TILE:
                csq = _store_error_int8(ecodes_ptr, bt, j, mp, ne, no, ce0, co0, einv, keep)
            else:
                csq = tl.zeros([ROWS], dtype=tl.int32)
                for t in range(ntiles):
                    the, tho, tee, teo, tce0, tco0, tbt, tj, tmp = _tile(
                        g_ptr, ecodes_ptr, evalues_ptr, gsrc, base, es, length, rmask, t, live,
                        B, T, INT8_ERR)
                    tqe, tqo, terre, terro, tne, tno = _quantize(
                        the, tho, tee, teo, scale, inv, beta, omb, QMAX, FULL, USE_BETA)
                    csq += _store_error_int8(ecodes_ptr, tbt, tj, tmp, tne, tno, tce0, tco0,
                                             einv, keep)
            es2 = tl.where(bad, es, es2)  # a kept block's old scale (zero on a reset step)
            tl.store(escales_ptr + rows, es2, mask=rmask)
            if ERRSQ:  # ||e||^2 of the stored error, per block: scale^2 * sum(codes^2)
                tl.store(bufsq_ptr + rows, es2 * es2 * csq.to(tl.float32), mask=rmask)
        nbad = tl.sum((bad & rmask).to(tl.int32), axis=0)  # the counter's atomic is predicated
        # off unless a block was non-finite; relaxed: the host reads it after the stream
        tl.atomic_add(flag_ptr, nbad, mask=nbad > 0, sem="relaxed")

    @triton.jit
    def _decompress_kernel(payload_ptr, scales_ptr, out_ptr, src_ptr, off_ptr, len_ptr, nbs,
                           first, out_base, chunk, off_base, world, B: tl.constexpr,
                           T: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr,
                           AVERAGE: tl.constexpr, OUT_BF16: tl.constexpr,
                           ACCUMULATE: tl.constexpr):
        """Sum the ``world`` received chunks of blocks ``first ..`` into ``out``; with
        ``ACCUMULATE``, ``out <- RN(out + sum)`` instead (the weight-difference apply: the
        output read, added in fp32 and written back in its dtype in the same pass)."""
        # every address is 64-bit: block and rank indices widen before they are scaled
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        rmask = rows < nbs
        j = tl.program_id(1).to(tl.int64) * T + tl.arange(0, T)  # this program's tile of pairs
        ev = 2 * j
        od = ev + 1
        m = rmask[:, None] & (j < B // 2)[None, :]
        mine = first + rows  # this rank's blocks in the table
        length = tl.load(len_ptr + mine, mask=rmask, other=0)
        me = m & (ev[None, :] < length[:, None])
        mo = m & (od[None, :] < length[:, None])
        rel = tl.load(off_ptr + mine, mask=rmask, other=0).to(tl.int64) - off_base
        acc_e = tl.zeros([ROWS, T], dtype=tl.float32)
        acc_o = tl.zeros([ROWS, T], dtype=tl.float32)
        for r in range(world):
            r64 = tl.cast(r, tl.int64)  # (r * chunk in 32 bits overflows at 2^31 elements)
            blk = r64 * nbs + rows
            at = (r64 * chunk + rel)[:, None]  # wire element of the block's first code (even)
            s = tl.load(scales_ptr + blk, mask=rmask, other=0.0)[:, None]
            if BITS == 4:
                byte = tl.load(payload_ptr + (at // 2 + j[None, :]), mask=me, other=0)
                byte = byte.to(tl.int32)
                lo = byte & 15
                hi = (byte >> 4) & 15
                ce = tl.where(lo >= 8, lo - 16, lo)
                co = tl.where(hi >= 8, hi - 16, hi)
            else:
                ce = tl.load(payload_ptr + (at + ev[None, :]), mask=me, other=0)
                co = tl.load(payload_ptr + (at + od[None, :]), mask=mo, other=0)
            acc_e += ce.to(tl.float32) * s
            acc_o += co.to(tl.float32) * s
        if AVERAGE:  # tl.cast: world == 1 is passed as a constexpr int (no .to() method)
            acc_e = tl.math.div_rn(acc_e, tl.cast(world, tl.float32))
            acc_o = tl.math.div_rn(acc_o, tl.cast(world, tl.float32))
        src = tl.load(src_ptr + mine, mask=rmask, other=0).to(tl.int64) - out_base
        dst = src[:, None]
        if ACCUMULATE:  # out + sum, the order of the reference's out.float() + delta
            oe = tl.load(out_ptr + (dst + ev[None, :]), mask=me, other=0)
            oo = tl.load(out_ptr + (dst + od[None, :]), mask=mo, other=0)
            if OUT_BF16:  # the bf16 pattern is the high half of its fp32 value
                oe = ((oe.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
                oo = ((oo.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
            acc_e = oe.to(tl.float32) + acc_e
            acc_o = oo.to(tl.float32) + acc_o
        if OUT_BF16:  # out_ptr is the bf16 output viewed as int16
            ve = _bf16_bits(acc_e)
            vo = _bf16_bits(acc_o)
        else:
            ve = acc_e.to(out_ptr.dtype.element_ty)
            vo = acc_o.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (dst + ev[None, :]), ve, mask=me)
        tl.store(out_ptr + (dst + od[None, :]), vo, mask=mo)


def _config(block_size: int, launch: Optional[LaunchConfig]) -> LaunchConfig:
    return launch_config(block_size) if launch is None else launch


def compress_bucket(g, table, err, *, bits, beta, reset, want_err_sq, grid="symmetric",
                    launch: Optional[LaunchConfig] = None):
    """Triton implementation of :func:`loco_megatron.kernels.compress_bucket` (same arguments,
    shapes and returns; CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``).

    ``launch``: the launch configuration (default :func:`~.launch.launch_config` of the block
    size; tests pass others: the output does not depend on it).

    Raises:
        ValueError: fp32 error storage whose values are not fp32.
    """
    dev = g.device
    g = g.reshape(-1)
    if not g.is_contiguous():
        g = g.contiguous()
    # zeros only where some wire elements no block covers (alignment, a shorter shard's end):
    # they are zero codes; the kernel writes every other byte
    payload = table.payload_alloc(bits)(table.padded_numel * bits // 8, dtype=torch.uint8,
                                        device=dev)
    scales = torch.empty(table.nblocks, dtype=torch.float32, device=dev)
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    errsq = torch.empty(table.nblocks, dtype=torch.float32, device=dev) if want_err_sq else flag
    bufsq = torch.empty_like(errsq) if want_err_sq else flag
    int8 = err.storage == "int8"
    if not int8 and err.values.dtype != torch.float32:
        raise ValueError(f"the Triton kernels keep fp32 error values, got {err.values.dtype}")
    dummy = scales
    cfg = _config(table.block_size, launch)
    args = (g, table.src, table.off, table.length, table.nblocks,
            err.codes if int8 else dummy, err.scales if int8 else dummy,
            dummy if int8 else err.values,
            payload.view(torch.int8) if bits == 8 else payload, scales, flag, errsq, bufsq,
            float(beta), 1.0 - float(beta), max_scale(bits, grid), cfg.ntiles, int(bool(reset)))
    kwargs = dict(B=table.block_size, T=cfg.tile, ONE_TILE=cfg.ntiles == 1, ROWS=cfg.rows,
                  BITS=bits, DIV=divisor(bits, grid), INT8_ERR=int8, USE_BETA=beta != 0,
                  ERRSQ=bool(want_err_sq), num_warps=cfg.num_warps, enable_fp_fusion=False)
    launch_keys.note(_compress_kernel, COMPRESS_NOT_SPECIALIZED, args, kwargs)
    _compress_kernel[(triton.cdiv(table.nblocks, cfg.rows),)](*args, **kwargs)
    nonfinite = flag[0]
    err_sq = buf_sq = None
    if want_err_sq:
        err_sq = errsq.double().sum()
        if int8:
            buf_sq = bufsq.double().sum()
    return payload, scales, nonfinite, err_sq, buf_sq


def _decompress(payload, scales, out, table, sizes, *, bits, average, accumulate, launch):
    """Launch the decompress kernel over ``sizes = (blocks, first, out_base, chunk, off_base,
    world)`` of ``table`` into the contiguous ``out``: the launch both entry points share."""
    bf16 = out.dtype == torch.bfloat16
    cfg = _config(table.block_size, launch)
    args = (payload.view(torch.int8) if bits == 8 else payload, scales,
            out.view(torch.int16) if bf16 else out, table.src, table.off, table.length) + sizes
    kwargs = dict(B=table.block_size, T=cfg.tile, ROWS=cfg.rows, BITS=bits,
                  AVERAGE=bool(average), OUT_BF16=bf16, ACCUMULATE=accumulate,
                  num_warps=cfg.num_warps, enable_fp_fusion=False)
    launch_keys.note(_decompress_kernel, (), args, kwargs)
    _decompress_kernel[(triton.cdiv(sizes[0], cfg.rows), cfg.ntiles)](*args, **kwargs)


def decompress_shard(payload, scales, table, rank, *, bits, average, out,
                     launch: Optional[LaunchConfig] = None):
    """Triton implementation of :func:`loco_megatron.kernels.decompress_shard` (same arguments;
    ``launch`` as for :func:`compress_bucket`). Any ``table.world``, 1 included."""
    nbs = table.blocks_per_shard
    target = out if out.is_contiguous() else torch.empty_like(out)
    _decompress(payload, scales, target, table,
                (nbs, rank * nbs, rank * table.shard, table.padded_shard,
                 rank * table.padded_shard, table.world),
                bits=bits, average=average, accumulate=False, launch=launch)
    if target is not out:
        out.copy_(target)


def apply_chunks(payload, scales, table, *, bits, out, launch: Optional[LaunchConfig] = None):
    """Triton implementation of :func:`loco_megatron.kernels.apply_chunks`: one launch of the
    decompress kernel over every block of ``table`` (``world == 1``, ``ACCUMULATE``), reading
    codes and scales, reading and writing ``out`` once.

    Raises:
        ValueError: ``out`` not contiguous.
    """
    if not out.is_contiguous():
        raise ValueError("apply_chunks writes a contiguous output (a bucket's param_data)")
    _decompress(payload, scales, out, table, (table.nblocks, 0, 0, 0, 0, 1), bits=bits,
                average=False, accumulate=True, launch=launch)
