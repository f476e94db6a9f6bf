"""``@triton.jit`` helpers of the Triton kernels (:mod:`.triton_kernels`): one tile of
``[ROWS, T]`` even and odd elements of ``ROWS`` blocks (the two nibbles of a packed byte) at a
time. IEEE division (``div_rn``), round-half-to-even by the 1.5 * 2^23 trick, NaN handled
explicitly: bit-exact with the torch reference (:mod:`loco_megatron.algorithm`)."""

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None

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
    def _tile(g_ptr, ecodes_ptr, evalues_ptr, gsrc, base, es, length, rmask, t, live,
              B: tl.constexpr, T: tl.constexpr, INT8_ERR: tl.constexpr):
        """Tile ``t`` of each row's block: h = g + e of the even and odd elements, the old
        error (values; int8 codes), the tile's wire offsets ``bt`` (int64 ``[ROWS, 1]``: the
        block's ``base`` plus the tile's first element), the pairs ``j`` in the tile and the
        masks. ``gsrc``/``base``: int64 ``[ROWS, 1]``; ``t`` may be a runtime loop counter: it
        widens to int64 before it offsets an address (and is 32-bit in the masks only).
        ``live``: the stored error is read (a runtime predicate, false on a reset step: the
        old error is then zero without a load, and no variant is compiled for resets)."""
        tb = tl.cast(t, tl.int64) * (2 * T)  # the tile's first element in the block
        bt = base + tb
        gsrc = gsrc + tb
        j = tl.arange(0, T)
        ev = 2 * j
        od = ev + 1
        m = rmask[:, None] & ((t * T + j) < B // 2)[None, :]
        lim = length[:, None] - t * (2 * T)  # valid elements from the tile's first one
        me = m & (ev[None, :] < lim)  # valid even / odd elements of each block
        mo = m & (od[None, :] < lim)
        ge = tl.load(g_ptr + (gsrc + ev[None, :]), mask=me, other=0.0).to(tl.float32)
        go = tl.load(g_ptr + (gsrc + od[None, :]), mask=mo, other=0.0).to(tl.float32)
        if INT8_ERR:
            ce0 = tl.load(ecodes_ptr + (bt + ev[None, :]), mask=me & live, other=0)
            co0 = tl.load(ecodes_ptr + (bt + od[None, :]), mask=mo & live, other=0)
            ee = ce0.to(tl.float32) * es[:, None]
            eo = co0.to(tl.float32) * es[:, None]
        else:
            ce0 = tl.zeros_like(ge).to(tl.int8)
            co0 = ce0
            ee = tl.load(evalues_ptr + (bt + ev[None, :]), mask=me & live, other=0.0)
            eo = tl.load(evalues_ptr + (bt + od[None, :]), mask=mo & live, other=0.0)
        return ge + ee, go + eo, ee, eo, ce0, co0, bt, j, me, mo

    @triton.jit
    def _absmax(he, ho):
        """Per block of a tile: the absmax, and 1 where an element is NaN (``max`` may drop
        NaN, so it is detected apart)."""
        amax = tl.maximum(tl.max(tl.abs(he), axis=1), tl.max(tl.abs(ho), axis=1))
        return amax, tl.max(((he != he) | (ho != ho)).to(tl.int32), axis=1)

    @triton.jit
    def _quantize(he, ho, ee, eo, scale, safe, beta, omb, QMAX: tl.constexpr,
                  USE_BETA: tl.constexpr):
        """Codes of a tile, this step's error and the new (moving-average) error."""
        qe = _codes(he, safe, -QMAX - 1.0, QMAX * 1.0)
        qo = _codes(ho, safe, -QMAX - 1.0, QMAX * 1.0)
        erre = he - qe * scale[:, None]
        erro = ho - qo * scale[:, None]
        if USE_BETA:
            ne = beta * ee + omb * erre
            no = beta * eo + omb * erro
        else:
            ne = erre
            no = erro
        return qe, qo, erre, erro, ne, no

    @triton.jit
    def _emit(payload_ptr, evalues_ptr, base, he, ho, ee, eo, j, me, mo, scale, safe, keep,
              beta, omb, QMAX: tl.constexpr, USE_BETA: tl.constexpr, BITS: tl.constexpr,
              INT8_ERR: tl.constexpr):
        """Quantize a tile and pack its codes onto the wire; fp32 error storage: store its new
        error. Returns per block this step's squared error, the new error's absmax, and the
        new error."""
        qe, qo, erre, erro, ne, no = _quantize(he, ho, ee, eo, scale, safe, beta, omb, QMAX,
                                               USE_BETA)
        ev = 2 * j
        if BITS == 4:
            byte = (qe.to(tl.int32) & 15) | ((qo.to(tl.int32) & 15) << 4)
            # an odd-length block's last byte: its high nibble is a zero code (h = 0 there)
            tl.store(payload_ptr + (base // 2 + j[None, :]), byte.to(tl.uint8), mask=me)
        else:
            tl.store(payload_ptr + (base + ev[None, :]), qe.to(tl.int8), mask=me)
            tl.store(payload_ptr + (base + (ev + 1)[None, :]), qo.to(tl.int8), mask=mo)
        if not INT8_ERR:  # a non-finite block keeps its previous error (zero after a reset)
            tl.store(evalues_ptr + (base + ev[None, :]), tl.where(keep, ee, ne), mask=me)
            tl.store(evalues_ptr + (base + (ev + 1)[None, :]), tl.where(keep, eo, no), mask=mo)
        sq = tl.sum(erre * erre, axis=1) + tl.sum(erro * erro, axis=1)
        emax = tl.maximum(tl.max(tl.abs(ne), axis=1), tl.max(tl.abs(no), axis=1))
        return sq, emax, ne, no

    @triton.jit
    def _store_error_int8(ecodes_ptr, base, j, me, mo, ne, no, ce0, co0, esafe, keep):
        """int8 error storage: a tile's error codes (the kept ones for a non-finite block:
        ``ce0``/``co0``, zero on a reset step); returns their sum of squares per block."""
        ev = 2 * j
        ce = _codes(ne, esafe, -128.0, 127.0)
        co = _codes(no, esafe, -128.0, 127.0)
        ce = tl.where(keep, ce0.to(tl.float32), ce)
        co = tl.where(keep, co0.to(tl.float32), co)
        tl.store(ecodes_ptr + (base + ev[None, :]), ce.to(tl.int8), mask=me)
        tl.store(ecodes_ptr + (base + (ev + 1)[None, :]), co.to(tl.int8), mask=mo)
        return tl.sum(ce * ce, axis=1) + tl.sum(co * co, axis=1)
