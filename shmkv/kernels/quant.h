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
 * Inputs are float32 or float16; a non-finite element fails the whole call
 * (SHMKV_EINVAL).  The output is always the caller's private scratch, copied into the
 * segment only after a call that succeeded, so bad input changes nothing ("nothing is
 * lost").  An AVX2+F16C path (runtime-chosen, head_dim % 8 == 0) and a portable one give
 * the same codes (both round to nearest even).
 * Codes and scales read back from the segment are untrusted data: any byte decodes to
 * some float (e4m3 NaN codes decode to 480, never trap), a NaN/inf scale gives NaN/inf
 * values, never a crash.
 */
#ifndef SHMKV_KERNELS_QUANT_H
#define SHMKV_KERNELS_QUANT_H

#include <math.h>

#include "cpu.h"

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

/* ---- the caller's input: float32 or float16 ------------------------------------------- */
static inline float shmkv_q_f16(uint16_t h) {         /* portable float16 -> float32 */
    uint32_t sgn = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, b;
    if (e == 0) {
        if (m == 0) b = sgn;
        else { e = 113; while (!(m & 0x400u)) { m <<= 1; e--; } b = sgn | (e << 23) | ((m & 0x3ffu) << 13); }
    } else if (e == 31) b = sgn | 0x7f800000u | (m << 13);
    else b = sgn | ((e + 112) << 23) | (m << 13);
    return shmkv_bits_f32(b);
}
static inline float shmkv_q_src(const void *x, int f16, uint64_t i) {
    if (f16) { uint16_t h; memcpy(&h, (const uint16_t *)x + i, 2); return shmkv_q_f16(h); }
    return ((const float *)x)[i];
}

/* Which quantizer: 0 portable C, 1 AVX2+F16C (chosen once per module from the CPU; a test
 * hook forces the portable one: shmkv._kvdata._force_quant_isa). */
static int shmkv_q_isa = -1;
static inline int shmkv_quant_isa(void) {
    if (shmkv_q_isa < 0) {
        shmkv_q_isa = 0;
#if defined(__x86_64__) && defined(__GNUC__)
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2") && shmkv_cpu_has_f16c()) shmkv_q_isa = 1;
#endif
    }
    return shmkv_q_isa;
}

/* ---- int8 ------------------------------------------------------------------------------ */
/* A row whose largest |x| is so small (< ~3.7e-37) that 127 / amax overflows float: the
 * inverse in double.  A scale that rounds to 0 (amax < ~1.8e-43) gets codes 0, so the row
 * reads back as 0 (an error below 1e-43) and loads elsewhere byte for byte.  Both paths
 * call it, so they give the same codes.  The AVX2 path may call it on a row holding a NaN
 * (its max ignores NaN lanes): that element gets code 0, never a cast of NaN. */
static void shmkv_q_i8_tiny(const void *x, int f16, uint64_t r, uint32_t d, int8_t *qr,
                            float amax, float s) {
    const double inv = s > 0.0f ? 127.0 / (double)amax : 0.0;
    for (uint32_t i = 0; i < d; i++) {
        double v = nearbyint((double)shmkv_q_src(x, f16, r * d + i) * inv);
        v = v > 127.0 ? 127.0 : v < -127.0 ? -127.0 : v;
        qr[i] = v == v ? (int8_t)v : 0;     /* NaN: no code (the call fails: see callers) */
    }
}
#define SHMKV_Q_TINY(amax) ((amax) > 0.0f && !(127.0f / (amax) < INFINITY))

/* rows rows of d values (float32, or float16 with f16) -> rows rows of d int8 codes and
 * one scale each.  SHMKV_EINVAL if any value is not finite: q and s are the caller's
 * scratch and may then hold anything; the segment is never the destination. */
static int shmkv_quant_i8_c(const void *x, int f16, uint64_t rows, uint32_t d, int8_t *q,
                            float *s) {
    float bad = 0.0f;
    for (uint64_t r = 0; r < rows; r++) {
        int8_t *qr = q + r * d;
        float amax = 0.0f;
        for (uint32_t i = 0; i < d; i++) {
            const float v = shmkv_q_src(x, f16, r * d + i), a = fabsf(v);
            bad += v - v;                                   /* NaN iff any inf/NaN */
            amax = a > amax ? a : amax;
        }
        /* a row with a NaN/inf fails the call here, before any code is made: the casts
         * below would turn a NaN (or inf * 0) into an int8 (undefined behaviour) */
        if (bad != 0.0f) return SHMKV_EINVAL;
        s[r] = amax / 127.0f;
        if (SHMKV_Q_TINY(amax)) {
            shmkv_q_i8_tiny(x, f16, r, d, qr, amax, s[r]);
            continue;
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (uint32_t i = 0; i < d; i++) {
            float v = nearbyintf(shmkv_q_src(x, f16, r * d + i) * inv);
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;   /* inv rounding */
            qr[i] = (int8_t)v;
        }
    }
    return SHMKV_OK;
}

/* float8 e4m3fn: x [layers][n][heads][d] -> codes, each (layer, head) divided by
 * hs[layer * heads + head] (read once per row: the table is shared memory; a scale that
 * is not finite and > 0 quantizes as 1).  SHMKV_EINVAL on a non-finite value (q is
 * scratch, as above). */
static inline float shmkv_q_head_inv(const float *hs) {
    float sc = shmkv_load_scale(hs);
    if (!(sc > 0.0f) || !isfinite(sc)) sc = 1.0f;
    return 1.0f / sc;
}
static int shmkv_quant_e4m3_c(const void *x, int f16, uint32_t layers, uint64_t n,
                              uint32_t heads, uint32_t d, const float *hs, uint8_t *q) {
    float bad = 0.0f;
    for (uint32_t l = 0; l < layers; l++)
        for (uint64_t t = 0; t < n; t++)
            for (uint32_t h = 0; h < heads; h++) {
                const uint64_t row = ((uint64_t)l * n + t) * heads + h;
                const float inv = shmkv_q_head_inv(&hs[(uint64_t)l * heads + h]);
                for (uint32_t i = 0; i < d; i++) {
                    const float v = shmkv_q_src(x, f16, row * d + i);
                    bad += v - v;
                    q[row * d + i] = bad == 0.0f ? shmkv_f32_to_e4m3(v * inv) : 0;
                }
            }
    return bad == 0.0f ? SHMKV_OK : SHMKV_EINVAL;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SHMKV_QT __attribute__((target("avx2,f16c"))) static
#define SHMKV_QLOAD(x, f16, off) ((f16) \
    ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(x) + (off)))) \
    : _mm256_loadu_ps((const float *)(x) + (off)))
/* 8 int32 lanes (each -128..255 as needed) -> 8 bytes at p, saturating */
SHMKV_QT inline void shmkv_q_store8_s(int8_t *p, __m256i v) {
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(w, w));
}
SHMKV_QT inline void shmkv_q_store8_u(uint8_t *p, __m256i v) {
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packus_epi16(w, w));
}
SHMKV_QT inline float shmkv_q_hmax(__m256 m) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}
/* d % 8 == 0.  Rounds by cvtps (the default mode: to nearest even, like nearbyintf). */
SHMKV_QT int shmkv_quant_i8_avx2(const void *x, int f16, uint64_t rows, uint32_t d,
                                 int8_t *q, float *s) {
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 bad = _mm256_setzero_ps();
    for (uint64_t r = 0; r < rows; r++) {
        __m256 mx = _mm256_setzero_ps();
        for (uint32_t i = 0; i < d; i += 8) {
            const __m256 v = SHMKV_QLOAD(x, f16, r * d + i);
            bad = _mm256_add_ps(bad, _mm256_sub_ps(v, v));
            mx = _mm256_max_ps(mx, _mm256_and_ps(v, absm));
        }
        const float amax = shmkv_q_hmax(mx);
        s[r] = amax / 127.0f;
        if (SHMKV_Q_TINY(amax)) {
            shmkv_q_i8_tiny(x, f16, r, d, q + r * d, amax, s[r]);
            continue;
        }
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        for (uint32_t i = 0; i < d; i += 8) {
            const __m256 v = SHMKV_QLOAD(x, f16, r * d + i);
            __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v, inv));
            c = _mm256_max_epi32(_mm256_min_epi32(c, _mm256_set1_epi32(127)),
                                 _mm256_set1_epi32(-127));
            shmkv_q_store8_s(q + r * d + i, c);
        }
    }
    return _mm256_movemask_ps(_mm256_cmp_ps(bad, bad, _CMP_UNORD_Q)) ? SHMKV_EINVAL : SHMKV_OK;
}
/* 8 floats (finite) -> 8 e4m3fn codes: the scalar shmkv_f32_to_e4m3, lane-wise */
SHMKV_QT inline __m256i shmkv_q_e4m3_8(__m256 y) {
    const __m256i b = _mm256_castps_si256(y);
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(b, 24), _mm256_set1_epi32(0x80));
    const __m256 a = _mm256_min_ps(_mm256_and_ps(y, _mm256_castsi256_ps(
                                       _mm256_set1_epi32(0x7fffffff))), _mm256_set1_ps(448.0f));
    const __m256i ab = _mm256_castps_si256(a);
    const __m256i rb = _mm256_add_epi32(ab, _mm256_add_epi32(_mm256_set1_epi32(0x7ffff),
        _mm256_and_si256(_mm256_srli_epi32(ab, 20), _mm256_set1_epi32(1))));
    /* (rb >> 20) = (exponent << 3) | mantissa; the bias goes from 127 to 7: - (120 << 3) */
    const __m256i nc = _mm256_min_epi32(_mm256_sub_epi32(_mm256_srli_epi32(rb, 20),
                                                         _mm256_set1_epi32(960)),
                                        _mm256_set1_epi32(0x7e));
    const __m256i sc = _mm256_cvtps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)));
    const __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ);
    return _mm256_or_si256(_mm256_blendv_epi8(nc, sc, _mm256_castps_si256(small)), sign);
}
SHMKV_QT int shmkv_quant_e4m3_avx2(const void *x, int f16, uint32_t layers, uint64_t n,
                                   uint32_t heads, uint32_t d, const float *hs, uint8_t *q) {
    __m256 bad = _mm256_setzero_ps();
    for (uint32_t l = 0; l < layers; l++)
        for (uint64_t t = 0; t < n; t++)
            for (uint32_t h = 0; h < heads; h++) {
                const uint64_t row = ((uint64_t)l * n + t) * heads + h;
                const __m256 inv = _mm256_set1_ps(shmkv_q_head_inv(&hs[(uint64_t)l * heads + h]));
                for (uint32_t i = 0; i < d; i += 8) {
                    const __m256 v = SHMKV_QLOAD(x, f16, row * d + i);
                    const __m256 z = _mm256_sub_ps(v, v);
                    bad = _mm256_add_ps(bad, z);
                    /* a NaN lane would make a garbage code: zero it (the call fails anyway) */
                    const __m256 y = _mm256_and_ps(_mm256_mul_ps(v, inv),
                                                   _mm256_cmp_ps(z, z, _CMP_ORD_Q));
                    shmkv_q_store8_u(q + row * d + i, shmkv_q_e4m3_8(y));
                }
            }
    return _mm256_movemask_ps(_mm256_cmp_ps(bad, bad, _CMP_UNORD_Q)) ? SHMKV_EINVAL : SHMKV_OK;
}
SHMKV_QT void shmkv_dequant_i8_avx2(const int8_t *q, const float *s, uint64_t rows,
                                    uint32_t d, float *x) {
    for (uint64_t r = 0; r < rows; r++) {
        const __m256 sc = _mm256_set1_ps(s[r]);
        for (uint32_t i = 0; i < d; i += 8)
            _mm256_storeu_ps(x + r * d + i, _mm256_mul_ps(sc, _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + r * d + i))))));
    }
}
#define SHMKV_QUANT_HAVE_AVX2 1
#else
#define SHMKV_QUANT_HAVE_AVX2 0
#endif

static int shmkv_quant_i8(const void *x, int f16, uint64_t rows, uint32_t d, int8_t *q,
                          float *s) {
#if SHMKV_QUANT_HAVE_AVX2
    if (d % 8 == 0 && shmkv_quant_isa() == 1) return shmkv_quant_i8_avx2(x, f16, rows, d, q, s);
#endif
    return shmkv_quant_i8_c(x, f16, rows, d, q, s);
}

static int shmkv_quant_e4m3(const void *x, int f16, uint32_t layers, uint64_t n,
                            uint32_t heads, uint32_t d, const float *hs, uint8_t *q) {
#if SHMKV_QUANT_HAVE_AVX2
    if (d % 8 == 0 && shmkv_quant_isa() == 1)
        return shmkv_quant_e4m3_avx2(x, f16, layers, n, heads, d, hs, q);
#endif
    return shmkv_quant_e4m3_c(x, f16, layers, n, heads, d, hs, q);
}

/* rows rows of d codes with one scale each -> floats. */
static void shmkv_dequant_i8(const int8_t *q, const float *s, uint64_t rows, uint32_t d,
                             float *x) {
#if SHMKV_QUANT_HAVE_AVX2
    if (d % 8 == 0 && shmkv_quant_isa() == 1) { shmkv_dequant_i8_avx2(q, s, rows, d, x); return; }
#endif
    for (uint64_t r = 0; r < rows; r++) {
        const float sc = s[r];
        const int8_t *qr = q + r * d;
        float *xr = x + r * d;
        for (uint32_t i = 0; i < d; i++) xr[i] = (float)qr[i] * sc;
    }
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
