/*
 * kernels/quant.h -- quantized pools (issue 14): the int8 and float8 e4m3fn codecs and
 * the copy of a block's scales.  Owns no shared field; writes the caller's dense buffers,
 * and (shmkv_scales_block_copy) the scale rows of a copy-on-write target the caller holds.
 *
 * int8 (SHMKV_I8): symmetric, one float32 scale per token and kv head, K and V apart:
 *     s = max|x| / 127 over the head's d elements, q = round(x / s) in [-127, 127],
 *     x' = s * q, so |x - x'| <= s / 2 (a row of zeros has s = 0, q = 0).
 * float8 (SHMKV_E4M3): e4m3fn codes (1 sign, 4 exponent bits bias 7, 3 mantissa bits; no
 *     inf; 0x7f/0xff NaN) of x / s with s one float32 per layer and kv head (the
 *     segment's hscale table, set_kv_scales), round to nearest even, saturated to +-448:
 *     relative error <= 2^-4 in the normal range (|x / s| >= 2^-6), absolute <= s 2^-10
 *     below it.
 * Inputs are float32; a non-finite element fails the whole call (SHMKV_EINVAL) before
 * the first code is written, so a caller that quantizes into scratch first and copies
 * after changes nothing on bad input ("nothing is lost").
 * Codes and scales read back from the segment are untrusted data: any byte decodes to
 * some float (e4m3 NaN codes decode to 480, never trap), a NaN/inf scale gives NaN/inf
 * values, never a crash.
 */
#ifndef SHMKV_KERNELS_QUANT_H
#define SHMKV_KERNELS_QUANT_H

#include <math.h>

/* ---- scalar codecs -------------------------------------------------------------------- */
static inline float shmkv_bits_f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t shmkv_f32_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* e4m3fn code of x (finite), round to nearest even, saturating at +-448. */
static inline uint8_t shmkv_f32_to_e4m3(float x) {
    uint32_t b = shmkv_f32_bits(x);
    uint8_t sign = (uint8_t)((b >> 24) & 0x80u);
    float a = fabsf(x);
    if (!(a < 448.0f)) return sign | 0x7eu;                 /* 448 = e 15, m 6 */
    if (a < 0.015625f) {                                    /* below 2^-6: subnormal codes */
        /* code m = round(a * 2^9) in 0..8; 8 is the smallest normal (e 1, m 0) = 0x08 */
        return sign | (uint8_t)nearbyintf(a * 512.0f);
    }
    b &= 0x7fffffffu;
    b += 0x7ffffu + ((b >> 20) & 1u);                       /* RNE at mantissa bit 20 */
    uint32_t e = (b >> 23) - 120u, m = (b >> 20) & 7u;      /* bias 127 -> 7 */
    uint32_t code = (e << 3) | m;
    if (code > 0x7eu) code = 0x7eu;                         /* 447.x rounds to 448 at most */
    return sign | (uint8_t)code;
}

/* The float of an e4m3fn code: its bits placed in a float32 whose exponent bias is 127
 * instead of 7, times 2^120 (exact for normal and subnormal codes alike). */
#define SHMKV_E4M3_MUL 1.329227995784916e36f                    /* 2^120 */
static inline float shmkv_e4m3_to_f32(uint8_t q) {
    return shmkv_bits_f32(((uint32_t)(q & 0x7fu) << 20) | ((uint32_t)(q & 0x80u) << 24))
           * SHMKV_E4M3_MUL;
}

/* A scale from shared memory, read once (relaxed: set_kv_scales may store it meanwhile;
 * a torn read cannot happen for an aligned 4-byte word). */
static inline float shmkv_load_scale(const float *p) {
    uint32_t b = __atomic_load_n((const uint32_t *)p, __ATOMIC_RELAXED);
    return shmkv_bits_f32(b);
}

/* ---- int8 ---------------------------------------------------------------------------- */
/* rows rows of d floats -> rows rows of d int8 codes and one scale each.  SHMKV_EINVAL
 * (nothing written) if any element is not finite. */
static int shmkv_quant_i8(const float *x, uint64_t rows, uint32_t d, int8_t *q, float *s) {
    for (uint64_t r = 0; r < rows; r++) {       /* validate all first: all-or-nothing */
        const float *xr = x + r * d;
        float bad = 0.0f;
        for (uint32_t i = 0; i < d; i++) bad += xr[i] * 0.0f;   /* NaN iff any inf/NaN */
        if (bad != 0.0f) return SHMKV_EINVAL;
    }
    for (uint64_t r = 0; r < rows; r++) {
        const float *xr = x + r * d;
        int8_t *qr = q + r * d;
        float amax = 0.0f;
        for (uint32_t i = 0; i < d; i++) {
            float a = fabsf(xr[i]);
            amax = a > amax ? a : amax;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (uint32_t i = 0; i < d; i++) {
            float v = nearbyintf(xr[i] * inv);
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;   /* inv rounding */
            qr[i] = (int8_t)v;
        }
        s[r] = amax / 127.0f;
    }
    return SHMKV_OK;
}

/* rows rows of d codes with one scale each -> floats. */
static void shmkv_dequant_i8(const int8_t *q, const float *s, uint64_t rows, uint32_t d,
                             float *x) {
    for (uint64_t r = 0; r < rows; r++) {
        const float sc = s[r];
        const int8_t *qr = q + r * d;
        float *xr = x + r * d;
        for (uint32_t i = 0; i < d; i++) xr[i] = (float)qr[i] * sc;
    }
}

/* ---- float8 e4m3fn ---------------------------------------------------------------------- */
/* x [layers][n][heads][d] -> codes, each (layer, head) divided by hs[layer * heads + head]
 * (hs is read once per row into a local: the table is shared memory).  A scale that is not
 * finite and > 0 quantizes as if it were 1.  SHMKV_EINVAL (nothing written) on a
 * non-finite element. */
static int shmkv_quant_e4m3(const float *x, uint32_t layers, uint64_t n, uint32_t heads,
                            uint32_t d, const float *hs, uint8_t *q) {
    const uint64_t total = (uint64_t)layers * n * heads * d;
    float bad = 0.0f;
    for (uint64_t i = 0; i < total; i++) bad += x[i] * 0.0f;
    if (bad != 0.0f) return SHMKV_EINVAL;
    for (uint32_t l = 0; l < layers; l++)
        for (uint64_t t = 0; t < n; t++)
            for (uint32_t h = 0; h < heads; h++) {
                const uint64_t row = ((uint64_t)l * n + t) * heads + h;
                float sc = shmkv_load_scale(&hs[(uint64_t)l * heads + h]);
                if (!(sc > 0.0f) || !isfinite(sc)) sc = 1.0f;
                const float inv = 1.0f / sc;
                for (uint32_t i = 0; i < d; i++)
                    q[row * d + i] = shmkv_f32_to_e4m3(x[row * d + i] * inv);
            }
    return SHMKV_OK;
}

/* codes [layers][n][heads][d] -> floats, times hs[layer * heads + head].  Through a
 * 256-entry table built per call (the bit trick above multiplies float32 denormals for
 * the subnormal codes: a microcode assist each, 256 of them here instead of one per
 * element). */
static void shmkv_dequant_e4m3(const uint8_t *q, uint32_t layers, uint64_t n, uint32_t heads,
                               uint32_t d, const float *hs, float *x) {
    float lut[256];
    for (uint32_t i = 0; i < 256; i++) lut[i] = shmkv_e4m3_to_f32((uint8_t)i);
    for (uint32_t l = 0; l < layers; l++)
        for (uint64_t t = 0; t < n; t++)
            for (uint32_t h = 0; h < heads; h++) {
                const uint64_t row = ((uint64_t)l * n + t) * heads + h;
                const float sc = shmkv_load_scale(&hs[(uint64_t)l * heads + h]);
                for (uint32_t i = 0; i < d; i++) x[row * d + i] = lut[q[row * d + i]] * sc;
            }
}

/* ---- a block's scales ------------------------------------------------------------------- */
/* The scale rows of the first `tokens` tokens of block src, every layer, K and V, into
 * block dst (int8 pools; nothing otherwise).  Called by shmkv_block_copy (copy-on-write):
 * a block carries its scales. */
static void shmkv_scales_block_copy(shmkv_ctx_t *c, uint32_t src, uint32_t dst,
                                    uint32_t tokens) {
    if (c->kscale == NULL || c->vscale == NULL) return;
    const uint64_t rb = c->lay.scale_bytes * c->cfg.block_size;     /* one block, one layer */
    const uint64_t nbytes = (uint64_t)tokens * c->lay.scale_bytes;
    uint8_t *ks = (uint8_t *)c->kscale, *vs = (uint8_t *)c->vscale;
    for (uint32_t l = 0; l < c->cfg.num_layers; l++) {
        const uint64_t lo = (uint64_t)l * c->lay.scale_stride;
        memcpy(ks + lo + (uint64_t)dst * rb, ks + lo + (uint64_t)src * rb, nbytes);
        memcpy(vs + lo + (uint64_t)dst * rb, vs + lo + (uint64_t)src * rb, nbytes);
    }
}

#endif /* SHMKV_KERNELS_QUANT_H */
