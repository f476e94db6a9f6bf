/* LoCo fused compression kernels for CPU tensors (loco_megatron/kernels/cpu.py builds this).
 *
 * Same contract and the same IEEE fp32 operations, in the same order, as the torch reference
 * (loco_megatron/kernels/reference.py): build without -ffast-math and with -ffp-contract=off.
 * Round-half-to-even by the 1.5 * 2^23 trick (exact for |x| < 2^22; the products here are at
 * most 128 in magnitude, larger ones are clamped). Codes are round(x * r), r the block's
 * reciprocal scale (quantization.reciprocal): one IEEE division per block.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define RNE(x) (((x) + 12582912.f) - 12582912.f)

/* max |x| as a bit pattern: an integer max, which compilers vectorize (a float max reduction
 * they do not, without fast-math). Above 0x7F800000 (inf) means a NaN is present. */
static uint32_t absmax_bits(const float *x, int n) {
  uint32_t m = 0;
  for (int i = 0; i < n; i++) {
    union { float f; uint32_t u; } v = {x[i]};
    const uint32_t a = v.u & 0x7FFFFFFFu;
    m = a > m ? a : m;
  }
  return m;
}

static float bits_to_float(uint32_t u) {
  union { uint32_t u; float f; } v = {u};
  return v.f;
}

/* amax / div, raised to FLT_MIN for a nonzero block (quantization.floor_scale): a finite
 * reciprocal, exact powers of two for subnormal blocks */
static float floored(float amax, float div) {
  const float s = amax / div;
  return amax > 0.f && s < FLT_MIN ? FLT_MIN : s;
}

static float clamp_code(float r, float lo, float hi) {
  r = r < lo ? lo : r;
  r = r > hi ? hi : r;
  return r == r ? r : 0.f; /* NaN (a non-finite block) -> code 0; the scale carries the NaN */
}

/* One pass per block: h = g + e; codes/scale of h; e = beta * e + (1 - beta) * (h - deQ).
 * g: fp32 (or bf16 when g_bf16) bucket; src/off/len: block table (block b: len[b] valid
 * elements read from g + src[b]; its codes and its error at wire offset off[b], even; the
 * elements len..B of the B-wide work tile are zeros, never stored except the zero high nibble
 * of an odd-length block's last byte); err: int8 codes + fp32 scale per block (err_int8) or
 * fp32 values. Writes payload (bits 4: two codes per byte, even element in the low nibble; bits
 * 8: int8 codes), scales, the error, *err_sq (sum of (h - deQ)^2, may be NULL) and *buf_sq
 * (||e||^2 of the stored int8 error, -1 for fp32 storage; may be NULL). The scale is
 * amax / qdiv (the grid: 2^(bits-1) - 1 symmetric, 2^(bits-1) full-range), at most smax; codes
 * are clamped to [-2^(bits-1), 2^(bits-1) - 1] on either grid. A non-finite block
 * (NaN/inf in h) is still encoded (its scale carries the NaN/inf) but keeps its previous error
 * (zero on a reset step) and adds nothing to *err_sq. Returns the number of non-finite blocks,
 * -1 when out of memory. */
int64_t loco_compress(const void *g, int g_bf16, const int64_t *src, const int64_t *woff,
                  const int32_t *len, int64_t nblocks,
                  int B, int bits, int err_int8, int8_t *ecodes, float *escales, float *evalues,
                  uint8_t *payload, float *scales, float beta, float omb, int use_beta,
                  int reset, float smax, float qdiv, double *err_sq, double *buf_sq) {
  float *h = malloc(sizeof(float) * 3 * (size_t)B);
  if (!h) return -1;
  float *e = h + B, *q = h + 2 * B;
  const float qmax = (float)((1 << (bits - 1)) - 1);
  int64_t nonfinite = 0;
  double total = 0.0, total_buf = 0.0;
  for (int64_t b = 0; b < nblocks; b++) {
    const float *gb = (const float *)g + src[b];
    const uint16_t *gh = (const uint16_t *)g + src[b];
    const int L = len[b];
    const int64_t off = woff[b];
    for (int i = L; i < B; i++) e[i] = 0.f;
    if (reset) {
      for (int i = 0; i < L; i++) e[i] = 0.f;
    } else if (err_int8) {
      const float es = escales[b];
      for (int i = 0; i < L; i++) e[i] = (float)ecodes[off + i] * es;
    } else {
      for (int i = 0; i < L; i++) e[i] = evalues[off + i];
    }
    if (g_bf16) /* bf16 -> fp32 is exact: the high half of the fp32 bit pattern */
      for (int i = 0; i < L; i++) h[i] = bits_to_float((uint32_t)gh[i] << 16) + e[i];
    else
      for (int i = 0; i < L; i++) h[i] = gb[i] + e[i];
    for (int i = L; i < B; i++) h[i] = 0.f + e[i];
    const uint32_t abits = absmax_bits(h, B);
    const int nan = abits > 0x7F800000u;
    const float amax = bits_to_float(abits);
    const int bad = nan || amax > FLT_MAX;
    /* qdiv: the grid's divisor (quantization.divisor: qmax symmetric, qmax + 1 full-range);
     * smax: the largest scale whose qdiv * scale is finite (quantization.max_scale) */
    const float s = floored(amax, qdiv);
    const float scale = nan ? NAN : (!bad && s > smax ? smax : s);
    nonfinite += bad;
    const float inv = 1.f / (scale > 0.f ? scale : 1.f); /* quantization.reciprocal */
    scales[b] = scale;
    for (int i = 0; i < B; i++) q[i] = clamp_code(RNE(h[i] * inv), -qmax - 1.f, qmax);
    if (err_sq && !bad) { /* 8 independent fp32 lanes (vectorizable), summed in fp64 per block */
      float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int i = 0;
      for (; i + 8 <= B; i += 8)
        for (int k = 0; k < 8; k++) {
          const float err = h[i + k] - q[i + k] * scale;
          lane[k] += err * err;
        }
      double sq = 0.0;
      for (; i < B; i++) {
        const float err = h[i] - q[i] * scale;
        sq += (double)err * (double)err;
      }
      for (int k = 0; k < 8; k++) sq += lane[k];
      total += sq;
    }
    if (use_beta) {
      for (int i = 0; i < B; i++) h[i] = beta * e[i] + omb * (h[i] - q[i] * scale);
    } else {
      for (int i = 0; i < B; i++) h[i] = h[i] - q[i] * scale; /* h now holds the new error */
    }
    if (bits == 4) { /* q[L] is 0 (h = 0) when L is odd: the padding nibble */
      uint8_t *p = payload + off / 2;
      for (int i = 0; i < (L + 1) / 2; i++)
        p[i] = (uint8_t)(((int)q[2 * i] & 15) | (((int)q[2 * i + 1] & 15) << 4));
    } else {
      int8_t *p = (int8_t *)payload + off;
      for (int i = 0; i < L; i++) p[i] = (int8_t)q[i];
    }
    if (bad) { /* keep the previous error: cleared only by a reset */
      if (reset && err_int8) {
        escales[b] = 0.f;
        for (int i = 0; i < L; i++) ecodes[off + i] = 0;
      } else if (reset) {
        for (int i = 0; i < L; i++) evalues[off + i] = 0.f;
      } else if (err_int8) {
        int32_t isum = 0;
        for (int i = 0; i < L; i++) isum += (int32_t)ecodes[off + i] * ecodes[off + i];
        total_buf += (double)escales[b] * (double)escales[b] * (double)isum;
      }
      continue;
    }
    if (err_int8) {
      const float emax = bits_to_float(absmax_bits(h, B));
      const float es = floored(emax, 127.f);
      const float einv = 1.f / (es > 0.f ? es : 1.f);
      escales[b] = es;
      int32_t isum = 0;
      for (int i = 0; i < L; i++) {
        const int8_t c = (int8_t)clamp_code(RNE(h[i] * einv), -128.f, 127.f);
        ecodes[off + i] = c;
        isum += (int32_t)c * c;
      }
      total_buf += (double)es * (double)es * (double)isum;
    } else {
      for (int i = 0; i < L; i++) evalues[off + i] = h[i];
    }
  }
  free(h);
  if (err_sq) *err_sq = total;
  if (buf_sq) *buf_sq = err_int8 ? total_buf : -1.0;
  return nonfinite;
}

/* fp32 -> bf16 bit pattern, round half to even, NaN -> the quiet NaN 0x7FC0 (as torch and the
 * Triton kernels' _bf16_bits) */
static uint16_t bf16_bits(float x) {
  union { float f; uint32_t u; } v = {x};
  if (x != x) return 0x7FC0;
  return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

/* Sum the world received chunks of one shard: chunk r's block b has its codes at wire element
 * r * chunk + woff[first + b] - off_base (even) and scale scales[r * nbs + b]; fp32 sum in rank
 * order, divided by world when average; the len valid elements written to
 * out[src[first + b] - out_base ...], fp32 (or bf16 bit patterns when out_bf16). With
 * accumulate, out <- RN(out + sum) instead (the weight-difference apply). */
int loco_decompress(const uint8_t *payload, const float *scales, const int64_t *src,
                    const int64_t *woff, const int32_t *len, int64_t nbs, int64_t first,
                    int64_t out_base, int64_t chunk, int64_t off_base, int world,
                    int B, int bits, int average, int accumulate, int out_bf16, void *out) {
  float *acc = malloc(sizeof(float) * (size_t)B);
  if (!acc) return -1;
  const float w = (float)world;
  for (int64_t b = 0; b < nbs; b++) {
    const int L = len[first + b];
    for (int i = 0; i < B; i++) acc[i] = 0.f;
    for (int r = 0; r < world; r++) {
      const int64_t blk = (int64_t)r * nbs + b;
      const int64_t at = (int64_t)r * chunk + woff[first + b] - off_base;
      const float s = scales[blk];
      if (bits == 4) {
        const uint8_t *p = payload + at / 2;
        for (int i = 0; i < (L + 1) / 2; i++) {
          const int lo = p[i] & 15, hi = p[i] >> 4;
          acc[2 * i] += (float)(lo >= 8 ? lo - 16 : lo) * s;
          acc[2 * i + 1] += (float)(hi >= 8 ? hi - 16 : hi) * s;
        }
      } else {
        const int8_t *p = (const int8_t *)payload + at;
        for (int i = 0; i < L; i++) acc[i] += (float)p[i] * s;
      }
    }
    if (average)
      for (int i = 0; i < L; i++) acc[i] = acc[i] / w;
    const int64_t at = src[first + b] - out_base;
    if (out_bf16) {
      uint16_t *dst = (uint16_t *)out + at;
      for (int i = 0; i < L; i++)
        dst[i] = bf16_bits(accumulate ? bits_to_float((uint32_t)dst[i] << 16) + acc[i] : acc[i]);
    } else {
      float *dst = (float *)out + at;
      for (int i = 0; i < L; i++) dst[i] = accumulate ? dst[i] + acc[i] : acc[i];
    }
  }
  free(acc);
  return 0;
}
