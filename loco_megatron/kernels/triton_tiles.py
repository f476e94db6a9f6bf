"""``@triton.jit`` helpers of the Triton kernels (:mod:`.triton_kernels`): one tile of
``[ROWS, T]`` even and odd elements of ``ROWS`` blocks (the two nibbles of a packed byte) at a
time. One IEEE division (``div_rn``) per block, a multiplication by its result per element
(:func:`reciprocal`), round-half-to-even by the 1.5 * 2^23 trick, NaN kept by integer
reductions of the bit patterns: bit-exact with the torch reference
(:mod:`loco_megatron.algorithm`)."""

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None

if triton is not None:

    @triton.jit
    def _magic(x):
        """``t = x + 1.5 * 2^23``: for ``|x| < 2^22`` the float ``t - 1.5 * 2^23`` is ``x``
        rounded half to even, and ``t``'s bit pattern is ``0x4B400000 + round(x)``: the code's
        two's complement in its low bits, with no float-to-int conversion."""
        return x + 12582912.0

    @triton.jit
    def floored(amax, div):
        """``amax / div`` (IEEE), raised to FLT_MIN for a nonzero block
        (:func:`loco_megatron.quantization.floor_scale`)."""
        s = tl.math.div_rn(amax, div)
        return tl.where((amax > 0) & (s < 1.1754943508222875e-38), 1.1754943508222875e-38, s)

    @triton.jit
    def reciprocal(safe):
        """``RN(1 / safe)`` (:func:`loco_megatron.quantization.reciprocal`): one IEEE
        division per block, none per element."""
        return tl.math.div_rn(tl.zeros_like(safe) + 1.0, safe)

    @triton.jit
    def _bits_absmax(a, b):
        """Per row, ``max(|a|, |b|)`` as an fp32 bit pattern (int32): an integer reduction
        (one ``REDUX`` per warp on sm_80+, no shuffle tree), which keeps NaN (a pattern above
        inf's ``0x7F800000``) where a float ``max`` may drop it."""
        ab = tl.maximum(tl.abs(a).to(tl.int32, bitcast=True), tl.abs(b).to(tl.int32, bitcast=True))
        return tl.max(ab, axis=1)

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
        masks: ``mp`` the pairs whose even element is valid, ``mo`` those whose odd one is.
        The wire slot after an odd-length block's last element is its own zero padding code
        (segments start at even offsets), so every wire access of a pair uses ``mp``; only
        the gradient's odd element (the next block's, or past the bucket's end) needs ``mo``.
        ``gsrc``/``base``: int64 ``[ROWS, 1]``; ``t`` may be a runtime loop counter: it
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
        mp = m & (ev[None, :] < lim)  # valid pairs (their even element) / odd elements
        mo = m & (od[None, :] < lim)
        ml = mp & live
        ge = tl.load(g_ptr + (gsrc + ev[None, :]), mask=mp, other=0.0).to(tl.float32)
        go = tl.load(g_ptr + (gsrc + od[None, :]), mask=mo, other=0.0).to(tl.float32)
        if INT8_ERR:
            ce0 = tl.load(ecodes_ptr + (bt + ev[None, :]), mask=ml, other=0)
            co0 = tl.load(ecodes_ptr + (bt + od[None, :]), mask=ml, other=0)
            ee = ce0.to(tl.float32) * es[:, None]
            eo = co0.to(tl.float32) * es[:, None]
        else:
            ce0 = tl.zeros_like(ge).to(tl.int8)
            co0 = ce0
            ee = tl.load(evalues_ptr + (bt + ev[None, :]), mask=ml, other=0.0)
            eo = tl.load(evalues_ptr + (bt + od[None, :]), mask=ml, other=0.0)
        return ge + ee, go + eo, ee, eo, ce0, co0, bt, j, mp

    @triton.jit
    def _quantize(he, ho, ee, eo, scale, inv, beta, omb, QMAX: tl.constexpr,
                  FULL: tl.constexpr, USE_BETA: tl.constexpr):
        """Codes of a tile (as ``_magic`` values: float ``te - 1.5 * 2^23`` is the code, the
        low bits of ``te``'s pattern its two's complement), this step's error and the new
        (moving-average) error. No clamp on the symmetric grid: ``|h| * inv`` is at most
        ``D (1 + 3 * 2^-24)`` for a finite block (``inv = RN(1 / RN(absmax / D))``, or the
        larger FLT_MAX-clamped scale), so its rounding is within ``[-D, D]``; on the
        full-range grid a positive absmax element rounds to ``D = QMAX + 1`` and is clipped
        to ``QMAX`` (what the reference's clamp does; the lower end ``-D`` is in range). A
        non-finite block's codes are unspecified (its scale carries the NaN/inf)."""
        te = _magic(he * inv)
        to = _magic(ho * inv)
        if FULL:
            te = tl.minimum(te, 12582912.0 + QMAX)
            to = tl.minimum(to, 12582912.0 + QMAX)
        qe = te - 12582912.0
        qo = to - 12582912.0
        erre = he - qe * scale[:, None]
        erro = ho - qo * scale[:, None]
        if USE_BETA:
            ne = beta * ee + omb * erre
            no = beta * eo + omb * erro
        else:
            ne = erre
            no = erro
        return te, to, erre, erro, ne, no

    @triton.jit
    def _emit(payload_ptr, evalues_ptr, base, he, ho, ee, eo, j, mp, scale, inv, keep,
              beta, omb, QMAX: tl.constexpr, FULL: tl.constexpr, USE_BETA: tl.constexpr,
              BITS: tl.constexpr, INT8_ERR: tl.constexpr):
        """Quantize a tile and pack its codes onto the wire; fp32 error storage: store its new
        error. Returns per block this step's squared error, the new error's absmax (an fp32
        bit pattern, :func:`_bits_absmax`), and the new error."""
        te, to, erre, erro, ne, no = _quantize(he, ho, ee, eo, scale, inv, beta, omb, QMAX,
                                               FULL, USE_BETA)
        ev = 2 * j
        be = te.to(tl.int32, bitcast=True)
        bo = to.to(tl.int32, bitcast=True)
        if BITS == 4:
            byte = (be & 15) | ((bo & 15) << 4)
            # an odd-length block's last byte: its high nibble is a zero code (h = 0 there)
            tl.store(payload_ptr + (base // 2 + j[None, :]), byte.to(tl.uint8), mask=mp)
        else:
            tl.store(payload_ptr + (base + ev[None, :]), be.to(tl.int8), mask=mp)
            tl.store(payload_ptr + (base + (ev + 1)[None, :]), bo.to(tl.int8), mask=mp)
        if not INT8_ERR:  # a non-finite block keeps its previous error (zero after a reset)
            tl.store(evalues_ptr + (base + ev[None, :]), tl.where(keep, ee, ne), mask=mp)
            tl.store(evalues_ptr + (base + (ev + 1)[None, :]), tl.where(keep, eo, no), mask=mp)
        sq = tl.sum(erre * erre + erro * erro, axis=1)
        return sq, _bits_absmax(ne, no), ne, no

    @triton.jit
    def _store_error_int8(ecodes_ptr, base, j, mp, ne, no, ce0, co0, einv, keep):
        """int8 error storage: a tile's error codes (the kept ones for a non-finite block:
        ``ce0``/``co0``, zero on a reset step); returns their sum of squares per block (int32,
        an integer reduction: at most ``128^2 * 65536 < 2^31``). No clamp: ``|e| * einv`` is at
        most ``127 (1 + 3 * 2^-24)`` (``einv = RN(1 / RN(absmax / 127))``), within int8."""
        ev = 2 * j
        ie = _magic(ne * einv).to(tl.int32, bitcast=True) - 0x4B400000
        io = _magic(no * einv).to(tl.int32, bitcast=True) - 0x4B400000
        ie = tl.where(keep, ce0.to(tl.int32), ie)
        io = tl.where(keep, co0.to(tl.int32), io)
        tl.store(ecodes_ptr + (base + ev[None, :]), ie.to(tl.int8), mask=mp)
        tl.store(ecodes_ptr + (base + (ev + 1)[None, :]), io.to(tl.int8), mask=mp)
        return tl.sum(ie * ie + io * io, axis=1)
