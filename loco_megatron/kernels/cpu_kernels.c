/* LoCo fused compression kernels for CPU tensors (loco_megatron/kernels/cpu.py builds this).
 *
 * Same contract and the same IEEE fp32 operations, in the same order, as the torch reference
 * (loco_megatron/kernels/reference.py): build without -ffast-math and with -ffp-contract=off.
 * Round-half-to-even by the 1.5 * 2^23 trick (exact for |x| < 2^22; the quotients here are at
 * most 128 in magnitude).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define RNE(x) (((x) + 12582912.f) - 12582912.f)

static float clamp_code(float r, float lo, float hi) {
  r = r < lo ? lo : r;
  r = r > hi ? hi : r;
  return r == r ? r : 0.f; /* NaN (a non-finite block) -> code 0; the scale carries the NaN */
}

/* One pass per block: h = g + e; codes/scale of h; e = beta * e + (1 - beta) * (h - deQ).
 * g: fp32 bucket; src/len: block table; err: int8 codes + fp32 scale per block (err_int8) or
 * fp32 values. Writes payload (bits 4: two codes per byte, even element in the low nibble; bits
 * 8: int8 codes), scales, the error, and *err_sq (sum of (h - deQ)^2, may be NULL). Returns 1
 * when some block is non-finite (the caller then clears the error buffer), 0 otherwise, -1 when
 * out of memory. */
int loco_compress(const float *g, const int64_t *src, const int32_t *len, int64_t nblocks,
                  int B, int bits, int err_int8, int8_t *ecodes, float *escales, float *evalues,
                  uint8_t *payload, float *scales, float beta, float omb, int use_beta,
                  int reset, double *err_sq) {
  float *h = malloc(sizeof(float) * 3 * (size_t)B);
  if (!h) return -1;
  float *e = h + B, *q = h + 2 * B;
  const float qmax = (float)((1 << (bits - 1)) - 1);
  int nonfinite = 0;
  double total = 0.0;
  for (int64_t b = 0; b < nblocks; b++) {
    const float *gb = g + src[b];
    const int L = len[b];
    const int64_t off = b * (int64_t)B;
    if (reset) {
      for (int i = 0; i < B; i++) e[i] = 0.f;
    } else if (err_int8) {
      const float es = escales[b];
      for (int i = 0; i < B; i++) e[i] = (float)ecodes[off + i] * es;
    } else {
      for (int i = 0; i < B; i++) e[i] = evalues[off + i];
    }
    for (int i = 0; i < L; i++) h[i] = gb[i] + e[i];
    for (int i = L; i < B; i++) h[i] = 0.f + e[i];
    float amax = 0.f;
    int nan = 0;
    for (int i = 0; i < B; i++) {
      const float a = fabsf(h[i]);
      amax = a > amax ? a : amax;
      nan |= h[i] != h[i];
    }
    const float scale = nan ? NAN : amax / qmax;
    if (nan || amax > FLT_MAX) nonfinite = 1;
    const float safe = scale > 0.f ? scale : 1.f;
    scales[b] = scale;
    for (int i = 0; i < B; i++) q[i] = clamp_code(RNE(h[i] / safe), -qmax - 1.f, qmax);
    double sq = 0.0;
    for (int i = 0; i < B; i++) {
      const float err = h[i] - q[i] * scale;
      sq += (double)err * (double)err;
      h[i] = use_beta ? beta * e[i] + omb * err : err; /* h now holds the new error */
    }
    total += sq;
    if (bits == 4) {
      uint8_t *p = payload + off / 2;
      for (int i = 0; i < B / 2; i++)
        p[i] = (uint8_t)(((int)q[2 * i] & 15) | (((int)q[2 * i + 1] & 15) << 4));
    } else {
      int8_t *p = (int8_t *)payload + off;
      for (int i = 0; i < B; i++) p[i] = (int8_t)q[i];
    }
    if (err_int8) {
      float emax = 0.f;
      for (int i = 0; i < B; i++) {
        const float a = fabsf(h[i]);
        emax = a > emax ? a : emax;
      }
      const float es = emax / 127.f;
      const float esafe = es > 0.f ? es : 1.f;
      escales[b] = es;
      for (int i = 0; i < B; i++) ecodes[off + i] = (int8_t)clamp_code(RNE(h[i] / esafe), -128.f, 127.f);
    } else {
      for (int i = 0; i < B; i++) evalues[off + i] = h[i];
    }
  }
  free(h);
  if (err_sq) *err_sq = total;
  return nonfinite;
}

/* Sum the world received chunks of one shard: chunk r's block b is at payload
 * (r * nbs + b) * B * bits / 8 with scale scales[r * nbs + b]; fp32 sum in rank order, divided
 * by world when average; valid elements written to out[src[first + b] - out_base ...]. */
int loco_decompress(const uint8_t *payload, const float *scales, const int64_t *src,
                    const int32_t *len, int64_t nbs, int64_t first, int64_t out_base, int world,
                    int B, int bits, int average, float *out) {
  float *acc = malloc(sizeof(float) * (size_t)B);
  if (!acc) return -1;
  const float w = (float)world;
  for (int64_t b = 0; b < nbs; b++) {
    for (int i = 0; i < B; i++) acc[i] = 0.f;
    for (int r = 0; r < world; r++) {
      const int64_t blk = (int64_t)r * nbs + b;
      const float s = scales[blk];
      if (bits == 4) {
        const uint8_t *p = payload + blk * B / 2;
        for (int i = 0; i < B / 2; i++) {
          const int lo = p[i] & 15, hi = p[i] >> 4;
          acc[2 * i] += (float)(lo >= 8 ? lo - 16 : lo) * s;
          acc[2 * i + 1] += (float)(hi >= 8 ? hi - 16 : hi) * s;
        }
      } else {
        const int8_t *p = (const int8_t *)payload + blk * B;
        for (int i = 0; i < B; i++) acc[i] += (float)p[i] * s;
      }
    }
    if (average)
      for (int i = 0; i < B; i++) acc[i] = acc[i] / w;
    float *dst = out + (src[first + b] - out_base);
    const int L = len[first + b];
    for (int i = 0; i < L; i++) dst[i] = acc[i];
  }
  free(acc);
  return 0;
}
