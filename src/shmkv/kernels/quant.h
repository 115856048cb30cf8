/*
 * kernels/quant.h -- quantized pools: the int8 and float8 e4m3fn codecs and
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
 * lost").  AVX-512 and AVX2+F16C paths (runtime-chosen, any head_dim) and a portable one
 * give the same codes and scales, bit for bit (all round to nearest even).
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

/* Which quantizer: 0 portable C, 1 AVX2+F16C, 2 AVX-512 F/BW/VL (+F16C): the level of
 * cpu.h (SHMKV_ISA caps it; amx counts as avx512), read once per module (each Cython module
 * that includes this has its own switch; the test hook shmkv._quant._force_quant_isa sets
 * the one the quantizers read).  The three give the same codes and scales, bit for bit,
 * for every head_dim (the vector paths do a partial last vector: masked on AVX-512,
 * through a zero-padded copy on AVX2). */
static int shmkv_q_isa = -1;
static inline int shmkv_quant_level(int isa) { return isa > SHMKV_ISA_AVX512 ? SHMKV_ISA_AVX512 : isa; }
static inline int shmkv_quant_cpu_isa(void) { return shmkv_quant_level(shmkv_cpu_best()); }
static inline int shmkv_quant_isa(void) {
    if (shmkv_q_isa < 0) shmkv_q_isa = shmkv_quant_level(shmkv_cpu_isa());
    return shmkv_q_isa;
}

/* ---- int8 ------------------------------------------------------------------------------ */
/* A row whose largest |x| is so small (< ~3.7e-37) that 127 / amax overflows float: the
 * inverse in double.  A scale that rounds to 0 (amax < ~1.8e-43) gets codes 0, so the row
 * reads back as 0 (an error below 1e-43) and loads elsewhere byte for byte.  Every path
 * calls it, so they give the same codes.  A NaN element (no caller passes one: a row with
 * a NaN fails first) would get code 0, never a cast of NaN. */
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
/* The vector quantizers, AVX2 and AVX-512.  Both:
 * - find a row's max |x| as the max of the elements' bit patterns with the sign cleared
 *   (for floats >= 0 the integer order is the float order, so this is the scalar's
 *   fabsf max exactly), which also tells a row holding inf or NaN (bits >= 0x7f800000):
 *   an int8 call then fails at once, a float8 call at its end (its codes of NaN lanes are
 *   some byte, never undefined behaviour);
 * - round by cvtps2dq in the default mode (to nearest even, as nearbyintf), and narrow
 *   with saturation, then clamp to -127: the scalar's clamp to [-127, 127] exactly (the
 *   products are within +-127.0001 anyway: |x| <= amax and inv = 127 / amax);
 * - run independent accumulators over the row (a single one was a chain of dependent adds
 *   that bounded the old AVX2 quantizer at ~3 cycles per 8 elements). */
#define SHMKV_QT __attribute__((target("avx2,f16c"))) static
#define SHMKV_QLOAD(x, f16, off) ((f16) \
    ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(x) + (off)))) \
    : _mm256_loadu_ps((const float *)(x) + (off)))
/* n < 8 elements at off, zero-padded to 8 (a zero adds nothing to a max) */
SHMKV_QT inline __m256 shmkv_q_load_tail(const void *x, int f16, uint64_t off, uint32_t n) {
    if (f16) {
        uint16_t b[8] = {0};
        memcpy(b, (const uint16_t *)x + off, (size_t)n * 2);
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
    }
    float b[8] = {0};
    memcpy(b, (const float *)x + off, (size_t)n * 4);
    return _mm256_loadu_ps(b);
}
SHMKV_QT inline __m256i shmkv_q_absbits(__m256 v) {
    return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff));
}
SHMKV_QT inline uint32_t shmkv_q_hmax_u32(__m256i m) {
    __m128i x = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    x = _mm_max_epi32(x, _mm_shuffle_epi32(x, 0x4e));
    x = _mm_max_epi32(x, _mm_shuffle_epi32(x, 0xb1));
    return (uint32_t)_mm_cvtsi128_si32(x);
}
/* max of the |x| bit patterns of row elements [0, d) at off */
SHMKV_QT inline uint32_t shmkv_q_rowmax_avx2(const void *x, int f16, uint64_t off, uint32_t d) {
    __m256i m0 = _mm256_setzero_si256(), m1 = m0, m2 = m0, m3 = m0;
    uint32_t i = 0;
    for (; i + 32 <= d; i += 32) {
        m0 = _mm256_max_epi32(m0, shmkv_q_absbits(SHMKV_QLOAD(x, f16, off + i)));
        m1 = _mm256_max_epi32(m1, shmkv_q_absbits(SHMKV_QLOAD(x, f16, off + i + 8)));
        m2 = _mm256_max_epi32(m2, shmkv_q_absbits(SHMKV_QLOAD(x, f16, off + i + 16)));
        m3 = _mm256_max_epi32(m3, shmkv_q_absbits(SHMKV_QLOAD(x, f16, off + i + 24)));
    }
    for (; i + 8 <= d; i += 8)
        m0 = _mm256_max_epi32(m0, shmkv_q_absbits(SHMKV_QLOAD(x, f16, off + i)));
    if (i < d) m1 = _mm256_max_epi32(m1, shmkv_q_absbits(shmkv_q_load_tail(x, f16, off + i, d - i)));
    return shmkv_q_hmax_u32(_mm256_max_epi32(_mm256_max_epi32(m0, m1), _mm256_max_epi32(m2, m3)));
}
/* 4 x 8 int32 lanes -> 32 bytes in lane order, signed (int8) or unsigned (e4m3) saturation */
SHMKV_QT inline __m256i shmkv_q_pack32_s(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
SHMKV_QT inline __m256i shmkv_q_pack32_u(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
/* 8 int32 lanes -> n <= 8 bytes at p, saturating (signed: then clamped to -127) */
SHMKV_QT inline void shmkv_q_store8_s(int8_t *p, __m256i v, uint32_t n) {
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    w = _mm_max_epi8(_mm_packs_epi16(w, w), _mm_set1_epi8(-127));
    if (n == 8) { _mm_storel_epi64((__m128i *)p, w); return; }
    int8_t b[16];
    _mm_storeu_si128((__m128i *)b, w);
    memcpy(p, b, n);
}
SHMKV_QT inline void shmkv_q_store8_u(uint8_t *p, __m256i v, uint32_t n) {
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    w = _mm_packus_epi16(w, w);
    if (n == 8) { _mm_storel_epi64((__m128i *)p, w); return; }
    uint8_t b[16];
    _mm_storeu_si128((__m128i *)b, w);
    memcpy(p, b, n);
}
SHMKV_QT int shmkv_quant_i8_avx2(const void *x, int f16, uint64_t rows, uint32_t d,
                                 int8_t *q, float *s) {
    for (uint64_t r = 0; r < rows; r++) {
        const uint64_t off = r * d;
        const uint32_t mb = shmkv_q_rowmax_avx2(x, f16, off, d);
        if (mb >= 0x7f800000u) return SHMKV_EINVAL;         /* inf or NaN in the row */
        const float amax = shmkv_bits_f32(mb);
        s[r] = amax / 127.0f;
        if (SHMKV_Q_TINY(amax)) {
            shmkv_q_i8_tiny(x, f16, r, d, q + off, amax, s[r]);
            continue;
        }
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        int8_t *qr = q + off;
        uint32_t i = 0;
#define SHMKV_Q8(j) _mm256_cvtps_epi32(_mm256_mul_ps(SHMKV_QLOAD(x, f16, off + i + (j)), inv))
        for (; i + 32 <= d; i += 32) {
            const __m256i p = shmkv_q_pack32_s(SHMKV_Q8(0), SHMKV_Q8(8), SHMKV_Q8(16), SHMKV_Q8(24));
            _mm256_storeu_si256((__m256i *)(qr + i), _mm256_max_epi8(p, _mm256_set1_epi8(-127)));
        }
        for (; i + 8 <= d; i += 8) shmkv_q_store8_s(qr + i, SHMKV_Q8(0), 8);
#undef SHMKV_Q8
        if (i < d)
            shmkv_q_store8_s(qr + i, _mm256_cvtps_epi32(_mm256_mul_ps(
                shmkv_q_load_tail(x, f16, off + i, d - i), inv)), d - i);
    }
    return SHMKV_OK;
}
/* 8 floats -> 8 e4m3fn codes: the scalar shmkv_f32_to_e4m3, lane-wise (a NaN lane -- the
 * call fails then -- reads as |y| = 448 through min_ps's NaN rule, as !(a < 448) does) */
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
    __m256i m0 = _mm256_setzero_si256(), m1 = m0, m2 = m0, m3 = m0;   /* max |x| bits */
    for (uint32_t l = 0; l < layers; l++)
        for (uint64_t t = 0; t < n; t++)
            for (uint32_t h = 0; h < heads; h++) {
                const uint64_t off = (((uint64_t)l * n + t) * heads + h) * d;
                const __m256 inv = _mm256_set1_ps(shmkv_q_head_inv(&hs[(uint64_t)l * heads + h]));
                uint8_t *qr = q + off;
                uint32_t i = 0;
                for (; i + 32 <= d; i += 32) {
                    const __m256 v0 = SHMKV_QLOAD(x, f16, off + i);
                    const __m256 v1 = SHMKV_QLOAD(x, f16, off + i + 8);
                    const __m256 v2 = SHMKV_QLOAD(x, f16, off + i + 16);
                    const __m256 v3 = SHMKV_QLOAD(x, f16, off + i + 24);
                    m0 = _mm256_max_epi32(m0, shmkv_q_absbits(v0));
                    m1 = _mm256_max_epi32(m1, shmkv_q_absbits(v1));
                    m2 = _mm256_max_epi32(m2, shmkv_q_absbits(v2));
                    m3 = _mm256_max_epi32(m3, shmkv_q_absbits(v3));
                    _mm256_storeu_si256((__m256i *)(qr + i), shmkv_q_pack32_u(
                        shmkv_q_e4m3_8(_mm256_mul_ps(v0, inv)), shmkv_q_e4m3_8(_mm256_mul_ps(v1, inv)),
                        shmkv_q_e4m3_8(_mm256_mul_ps(v2, inv)), shmkv_q_e4m3_8(_mm256_mul_ps(v3, inv))));
                }
                for (; i < d; i += 8) {
                    const uint32_t k = d - i < 8 ? d - i : 8;
                    const __m256 v = k == 8 ? SHMKV_QLOAD(x, f16, off + i)
                                            : shmkv_q_load_tail(x, f16, off + i, k);
                    m0 = _mm256_max_epi32(m0, shmkv_q_absbits(v));
                    shmkv_q_store8_u(qr + i, shmkv_q_e4m3_8(_mm256_mul_ps(v, inv)), k);
                }
            }
    const uint32_t mb = shmkv_q_hmax_u32(_mm256_max_epi32(_mm256_max_epi32(m0, m1),
                                                          _mm256_max_epi32(m2, m3)));
    return mb >= 0x7f800000u ? SHMKV_EINVAL : SHMKV_OK;
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

/* ---- AVX-512 F/BW/VL: 16 lanes, the partial last vector under a mask -------------------- */
#define SHMKV_QT5 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"))) static
/* elements [off, off + 16) as floats, lanes outside m zero (masked loads never fault) */
SHMKV_QT5 inline __m512 shmkv_q_load16(const void *x, int f16, uint64_t off, __mmask16 m) {
    if (f16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)x + off));
    return _mm512_maskz_loadu_ps(m, (const float *)x + off);
}
SHMKV_QT5 inline __m512i shmkv_q_absbits16(__m512 v) {
    return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff));
}
SHMKV_QT5 inline __mmask16 shmkv_q_mask16(uint32_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}
SHMKV_QT5 int shmkv_quant_i8_avx512(const void *x, int f16, uint64_t rows, uint32_t d,
                                   int8_t *q, float *s) {
    const __mmask16 tail = shmkv_q_mask16(d % 16), all = 0xffff;
    const uint32_t dv = d - d % 16;                         /* elements in whole vectors */
    for (uint64_t r = 0; r < rows; r++) {
        const uint64_t off = r * d;
        __m512i m0 = _mm512_setzero_si512(), m1 = m0;
        uint32_t i = 0;
        for (; i + 32 <= dv; i += 32) {
            m0 = _mm512_max_epu32(m0, shmkv_q_absbits16(shmkv_q_load16(x, f16, off + i, all)));
            m1 = _mm512_max_epu32(m1, shmkv_q_absbits16(shmkv_q_load16(x, f16, off + i + 16, all)));
        }
        if (i < dv)
            m0 = _mm512_max_epu32(m0, shmkv_q_absbits16(shmkv_q_load16(x, f16, off + i, all)));
        if (tail)
            m1 = _mm512_max_epu32(m1, shmkv_q_absbits16(shmkv_q_load16(x, f16, off + dv, tail)));
        const uint32_t mb = _mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1));
        if (mb >= 0x7f800000u) return SHMKV_EINVAL;         /* inf or NaN in the row */
        const float amax = shmkv_bits_f32(mb);
        s[r] = amax / 127.0f;
        if (SHMKV_Q_TINY(amax)) {
            shmkv_q_i8_tiny(x, f16, r, d, q + off, amax, s[r]);
            continue;
        }
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i lo = _mm512_set1_epi32(-127);
        for (i = 0; i < dv; i += 16) {
            const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(shmkv_q_load16(x, f16, off + i, all), inv));
            _mm_storeu_si128((__m128i *)(q + off + i), _mm512_cvtsepi32_epi8(_mm512_max_epi32(c, lo)));
        }
        if (tail) {
            const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(shmkv_q_load16(x, f16, off + dv, tail), inv));
            _mm512_mask_cvtsepi32_storeu_epi8(q + off + dv, tail, _mm512_max_epi32(c, lo));
        }
    }
    return SHMKV_OK;
}
/* 16 floats -> 16 e4m3fn codes (shmkv_q_e4m3_8 on 16 lanes, the blend under a mask) */
SHMKV_QT5 inline __m512i shmkv_q_e4m3_16(__m512 y) {
    const __m512i b = _mm512_castps_si512(y);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(b, 24), _mm512_set1_epi32(0x80));
    const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(_mm512_and_si512(
                                       b, _mm512_set1_epi32(0x7fffffff))), _mm512_set1_ps(448.0f));
    const __m512i ab = _mm512_castps_si512(a);
    const __m512i rb = _mm512_add_epi32(ab, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff),
        _mm512_and_si512(_mm512_srli_epi32(ab, 20), _mm512_set1_epi32(1))));
    const __m512i nc = _mm512_min_epi32(_mm512_sub_epi32(_mm512_srli_epi32(rb, 20),
                                                         _mm512_set1_epi32(960)),
                                        _mm512_set1_epi32(0x7e));
    const __m512i sc = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)));
    const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
    return _mm512_or_si512(_mm512_mask_blend_epi32(small, nc, sc), sign);
}
SHMKV_QT5 int shmkv_quant_e4m3_avx512(const void *x, int f16, uint32_t layers, uint64_t n,
                                     uint32_t heads, uint32_t d, const float *hs, uint8_t *q) {
    const __mmask16 tail = shmkv_q_mask16(d % 16), all = 0xffff;
    const uint32_t dv = d - d % 16;
    __m512i m0 = _mm512_setzero_si512(), m1 = m0;           /* max |x| bits */
    for (uint32_t l = 0; l < layers; l++)
        for (uint64_t t = 0; t < n; t++)
            for (uint32_t h = 0; h < heads; h++) {
                const uint64_t off = (((uint64_t)l * n + t) * heads + h) * d;
                const __m512 inv = _mm512_set1_ps(shmkv_q_head_inv(&hs[(uint64_t)l * heads + h]));
                uint32_t i = 0;
                for (; i + 32 <= dv; i += 32) {
                    const __m512 v0 = shmkv_q_load16(x, f16, off + i, all);
                    const __m512 v1 = shmkv_q_load16(x, f16, off + i + 16, all);
                    m0 = _mm512_max_epu32(m0, shmkv_q_absbits16(v0));
                    m1 = _mm512_max_epu32(m1, shmkv_q_absbits16(v1));
                    _mm_storeu_si128((__m128i *)(q + off + i),
                                     _mm512_cvtepi32_epi8(shmkv_q_e4m3_16(_mm512_mul_ps(v0, inv))));
                    _mm_storeu_si128((__m128i *)(q + off + i + 16),
                                     _mm512_cvtepi32_epi8(shmkv_q_e4m3_16(_mm512_mul_ps(v1, inv))));
                }
                if (i < dv) {
                    const __m512 v = shmkv_q_load16(x, f16, off + i, all);
                    m0 = _mm512_max_epu32(m0, shmkv_q_absbits16(v));
                    _mm_storeu_si128((__m128i *)(q + off + i),
                                     _mm512_cvtepi32_epi8(shmkv_q_e4m3_16(_mm512_mul_ps(v, inv))));
                }
                if (tail) {
                    const __m512 v = shmkv_q_load16(x, f16, off + dv, tail);
                    m1 = _mm512_max_epu32(m1, shmkv_q_absbits16(v));
                    _mm512_mask_cvtepi32_storeu_epi8(q + off + dv, tail,
                                                     shmkv_q_e4m3_16(_mm512_mul_ps(v, inv)));
                }
            }
    return _mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1)) >= 0x7f800000u ? SHMKV_EINVAL
                                                                          : SHMKV_OK;
}
#define SHMKV_QUANT_HAVE_AVX512 1
#else
#define SHMKV_QUANT_HAVE_AVX2 0
#define SHMKV_QUANT_HAVE_AVX512 0
#endif

static inline int shmkv_quant_i8(const void *x, int f16, uint64_t rows, uint32_t d, int8_t *q,
                          float *s) {
#if SHMKV_QUANT_HAVE_AVX512
    if (shmkv_quant_isa() == 2) return shmkv_quant_i8_avx512(x, f16, rows, d, q, s);
#endif
#if SHMKV_QUANT_HAVE_AVX2
    if (shmkv_quant_isa() == 1) return shmkv_quant_i8_avx2(x, f16, rows, d, q, s);
#endif
    return shmkv_quant_i8_c(x, f16, rows, d, q, s);
}

static inline int shmkv_quant_e4m3(const void *x, int f16, uint32_t layers, uint64_t n,
                            uint32_t heads, uint32_t d, const float *hs, uint8_t *q) {
#if SHMKV_QUANT_HAVE_AVX512
    if (shmkv_quant_isa() == 2)
        return shmkv_quant_e4m3_avx512(x, f16, layers, n, heads, d, hs, q);
#endif
#if SHMKV_QUANT_HAVE_AVX2
    if (shmkv_quant_isa() == 1)
        return shmkv_quant_e4m3_avx2(x, f16, layers, n, heads, d, hs, q);
#endif
    return shmkv_quant_e4m3_c(x, f16, layers, n, heads, d, hs, q);
}

/* rows rows of d codes with one scale each -> floats. */
static inline void shmkv_dequant_i8(const int8_t *q, const float *s, uint64_t rows, uint32_t d,
                             float *x) {
#if SHMKV_QUANT_HAVE_AVX2
    if (d % 8 == 0 && shmkv_quant_isa() >= 1) { shmkv_dequant_i8_avx2(q, s, rows, d, x); return; }
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
static inline void shmkv_dequant_e4m3(const uint8_t *q, uint32_t layers, uint64_t n, uint32_t heads,
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
