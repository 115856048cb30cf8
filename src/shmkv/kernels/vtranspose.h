/*
 * kernels/vtranspose.h -- the 32-bit matrix transpose of the vLLM connector's K copy
 * (shmkv._vcopy): K rows [tokens, head_dim] of a shmkv block <-> vLLM's transposed K
 * [head_dim, block_size] of a (block, head).  Owns no data; pointers and strides come
 * from _vcopy, which has checked every block id before calling.
 *
 * shmkv_vt32(src, ss, dst, ds, rows, cols): dst[c * ds + r] = src[r * ss + c] for r < rows,
 * c < cols (strides in elements).  16x16 register tiles with AVX-512F, 8x8 with AVX2, the
 * portable loop for what is left over (and on other CPUs); the ISA is read once from the
 * CPU; shmkv_vt_force_isa() pins one (tests run every path).  A transpose moves bits: every
 * path gives the same bytes.
 *
 * Stores: a copy's destination is written once and not read soon (a save: another
 * instance reads it later; a load: 47 MB per 1k tokens of SmolLM2, past the caches), so
 * the AVX-512 and AVX2 paths stream it (non-temporal stores: no read-for-ownership of
 * the destination's lines) where it is aligned; shmkv_vrows does the same for the plain
 * rows (V, and K when not transposed).  The caller ends a copy with shmkv_vfence().
 */
#ifndef SHMKV_KERNELS_VTRANSPOSE_H
#define SHMKV_KERNELS_VTRANSPOSE_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include "cpu.h"

static int shmkv_vt_isa_v = -1;          /* 0 portable, 1 AVX2, 2 AVX-512F */

/* cpu.h's level (SHMKV_ISA caps it; amx counts as avx512), read once per module */
static inline int shmkv_vt_level(int isa) { return isa > SHMKV_ISA_AVX512 ? SHMKV_ISA_AVX512 : isa; }
static inline int shmkv_vt_isa(void) {
    if (shmkv_vt_isa_v < 0) shmkv_vt_isa_v = shmkv_vt_level(shmkv_cpu_isa());
    return shmkv_vt_isa_v;
}

/* -1: back to the default; 0/1/2 as above, capped at what the CPU has.  Returns the ISA
 * now. */
static inline int shmkv_vt_force_isa(int isa) {
    shmkv_vt_isa_v = -1;
    const int have = shmkv_vt_level(shmkv_cpu_best());
    if (isa >= 0) shmkv_vt_isa_v = isa < have ? isa : have;
    return shmkv_vt_isa();
}

static inline void shmkv_vt32_c(const uint32_t *src, ptrdiff_t ss, uint32_t *dst,
                                ptrdiff_t ds, ptrdiff_t rows, ptrdiff_t cols) {
    for (ptrdiff_t r0 = 0; r0 < rows; r0 += 16) {          /* 16x16 tiles: cache-friendly */
        ptrdiff_t r1 = r0 + 16 < rows ? r0 + 16 : rows;
        for (ptrdiff_t c0 = 0; c0 < cols; c0 += 16) {
            ptrdiff_t c1 = c0 + 16 < cols ? c0 + 16 : cols;
            for (ptrdiff_t c = c0; c < c1; c++)
                for (ptrdiff_t r = r0; r < r1; r++)
                    dst[c * ds + r] = src[r * ss + c];
        }
    }
}

#if SHMKV_X86
#include <immintrin.h>

/* 8x8: rows r[0..7] of 8 floats -> columns. */
__attribute__((target("avx2"))) static inline void
shmkv_vt8(const uint32_t *src, ptrdiff_t ss, uint32_t *dst, ptrdiff_t ds, int nt) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps((const float *)(src + i * ss));
    for (int p = 0; p < 4; p++) {
        t[2 * p] = _mm256_unpacklo_ps(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm256_unpackhi_ps(r[2 * p], r[2 * p + 1]);
    }
    for (int q = 0; q < 2; q++) {                   /* rows 4q..4q+3, columns c and c+4 */
        u[4 * q + 0] = _mm256_shuffle_ps(t[4 * q], t[4 * q + 2], 0x44);
        u[4 * q + 1] = _mm256_shuffle_ps(t[4 * q], t[4 * q + 2], 0xEE);
        u[4 * q + 2] = _mm256_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0x44);
        u[4 * q + 3] = _mm256_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        const __m256 lo = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20),
                     hi = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
        if (nt) {
            _mm256_stream_ps((float *)(dst + c * ds), lo);
            _mm256_stream_ps((float *)(dst + (c + 4) * ds), hi);
        } else {
            _mm256_storeu_ps((float *)(dst + c * ds), lo);
            _mm256_storeu_ps((float *)(dst + (c + 4) * ds), hi);
        }
    }
}

/* n bytes (a multiple of 32, dst 32-byte aligned) with non-temporal stores. */
__attribute__((target("avx2"))) static inline void
shmkv_vstream32(void *dst, const void *src, size_t n) {
    for (size_t i = 0; i < n; i += 32)
        _mm256_stream_si256((__m256i *)((char *)dst + i),
                            _mm256_loadu_si256((const __m256i *)((const char *)src + i)));
}

/* 16x16: stage 1 pairs rows by 32-bit elements, stage 2 by 64-bit (u[4q+c]: in 128-bit
 * lane L, column 4L+c of rows 4q..4q+3), stages 3-4 gather the four lanes of a column. */
__attribute__((target("avx512f"))) static inline void
shmkv_vt16(const uint32_t *src, ptrdiff_t ss, uint32_t *dst, ptrdiff_t ds, int nt) {
    __m512 r[16], t[16], u[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps((const float *)(src + i * ss));
    for (int p = 0; p < 8; p++) {
        t[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
        t[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
    }
    for (int q = 0; q < 4; q++) {
        __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]),
                c = _mm512_castps_pd(t[4 * q + 2]), d = _mm512_castps_pd(t[4 * q + 3]);
        u[4 * q + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int c = 0; c < 4; c++) {
        __m512 w0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44);      /* lanes 0,1 | 0,1 */
        __m512 w1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);      /* lanes 2,3 | 2,3 */
        __m512 x0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
        __m512 x1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
        const __m512 o0 = _mm512_shuffle_f32x4(w0, x0, 0x88), o1 = _mm512_shuffle_f32x4(w0, x0, 0xDD),
                     o2 = _mm512_shuffle_f32x4(w1, x1, 0x88), o3 = _mm512_shuffle_f32x4(w1, x1, 0xDD);
        if (nt) {
            _mm512_stream_ps((float *)(dst + (0 + c) * ds), o0);
            _mm512_stream_ps((float *)(dst + (4 + c) * ds), o1);
            _mm512_stream_ps((float *)(dst + (8 + c) * ds), o2);
            _mm512_stream_ps((float *)(dst + (12 + c) * ds), o3);
        } else {
            _mm512_storeu_ps((float *)(dst + (0 + c) * ds), o0);
            _mm512_storeu_ps((float *)(dst + (4 + c) * ds), o1);
            _mm512_storeu_ps((float *)(dst + (8 + c) * ds), o2);
            _mm512_storeu_ps((float *)(dst + (12 + c) * ds), o3);
        }
    }
}

/* n bytes (a multiple of 64, both 64-byte aligned) with non-temporal stores. */
__attribute__((target("avx512f"))) static inline void
shmkv_vstream64(void *dst, const void *src, size_t n) {
    for (size_t i = 0; i < n; i += 64)
        _mm512_stream_si512((__m512i *)((char *)dst + i),
                            _mm512_loadu_si512((const char *)src + i));
}
#endif

static inline void shmkv_vt32(const uint32_t *src, ptrdiff_t ss, uint32_t *dst, ptrdiff_t ds,
                              ptrdiff_t rows, ptrdiff_t cols) {
#if SHMKV_X86
    const int isa = shmkv_vt_isa();
    /* 16x16 tiles where the matrix has 16 rows and columns, else 8x8 (AVX-512 CPUs have
     * AVX2): a 16-token shmkv block of 16-bit K is 8 rows of token pairs */
    const ptrdiff_t n = isa == 2 && rows >= 16 && cols >= 16 ? 16 : isa >= 1 ? 8 : 0;
    if (n) {
        const ptrdiff_t R = rows - rows % n, C = cols - cols % n;
        /* streamed when every tile row starts on an aligned line (a tile row is n floats) */
        const int nt = ((uintptr_t)dst & (4 * n - 1)) == 0 && (ds & (n - 1)) == 0;
        for (ptrdiff_t r0 = 0; r0 < R; r0 += n)
            for (ptrdiff_t c0 = 0; c0 < C; c0 += n) {
                if (n == 16) shmkv_vt16(src + r0 * ss + c0, ss, dst + c0 * ds + r0, ds, nt);
                else shmkv_vt8(src + r0 * ss + c0, ss, dst + c0 * ds + r0, ds, nt);
            }
        if (C < cols)                                   /* the columns past the tiles */
            shmkv_vt32_c(src + C, ss, dst + C * ds, ds, R, cols - C);
        if (R < rows)                                   /* the rows past the tiles */
            shmkv_vt32_c(src + R * ss, ss, dst + R, ds, rows - R, cols);
        return;
    }
#endif
    shmkv_vt32_c(src, ss, dst, ds, rows, cols);
}

/* w[d] = a[d] | b[d] << 16 (to_w), or back, for d < D: a token pair's 32-bit words. */
static inline void shmkv_pair16_c(uint16_t *a, uint16_t *b, uint32_t *w, ptrdiff_t D,
                                  int to_w) {
    if (to_w) for (ptrdiff_t d = 0; d < D; d++) w[d] = (uint32_t)a[d] | ((uint32_t)b[d] << 16);
    else for (ptrdiff_t d = 0; d < D; d++) { a[d] = (uint16_t)w[d]; b[d] = (uint16_t)(w[d] >> 16); }
}

#if SHMKV_X86
__attribute__((target("avx512f"))) static inline void
shmkv_pair16_avx512(uint16_t *a, uint16_t *b, uint32_t *w, ptrdiff_t D, int to_w) {
    ptrdiff_t d = 0;
    for (; d + 16 <= D; d += 16) {
        if (to_w) {
            __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(a + d)));
            __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + d)));
            _mm512_storeu_si512(w + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        } else {
            __m512i x = _mm512_loadu_si512(w + d);
            _mm256_storeu_si256((__m256i *)(a + d), _mm512_cvtepi32_epi16(x));
            _mm256_storeu_si256((__m256i *)(b + d), _mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
        }
    }
    if (d < D) shmkv_pair16_c(a + d, b + d, w + d, D - d, to_w);
}
#endif

static inline void shmkv_pair16(uint16_t *a, uint16_t *b, uint32_t *w, ptrdiff_t D, int to_w) {
#if SHMKV_X86
    if (shmkv_vt_isa() == 2) { shmkv_pair16_avx512(a, b, w, D, to_w); return; }
#endif
    shmkv_pair16_c(a, b, w, D, to_w);
}

/* 16-bit K transpose through 32-bit units (bfloat16/float16 K of the vec layout):
 * n tokens, rows of D elements at rows + j * rs  <->  K^T rows d at kt + d * ks (element j).
 * Two tokens' d-th elements are one 32-bit word of K^T (the even token in the low half,
 * little-endian), so 16 token pairs at a time are interleaved into a stack tile of words
 * [16][D] and moved by shmkv_vt32 (register tiles, streamed stores); an odd last token
 * and D > 256 go element by element.  kt and ks must keep words 4-byte aligned (kt at an
 * even token of an aligned tile, ks even).  to_kt: rows -> K^T (a load), else back. */
static inline void shmkv_vt16_via32(uint16_t *rows, ptrdiff_t rs, uint16_t *kt, ptrdiff_t ks,
                                    ptrdiff_t n, ptrdiff_t D, int to_kt) {
    uint32_t w[16 * 256];
    ptrdiff_t j0 = 0;
    if (D <= 256 && ks % 2 == 0 && ((uintptr_t)kt & 3) == 0) {
        for (; j0 + 2 <= n; ) {
            ptrdiff_t np = (n - j0) / 2;
            if (np > 16) np = 16;
            if (to_kt) {
                for (ptrdiff_t q = 0; q < np; q++)
                    shmkv_pair16(rows + (j0 + 2 * q) * rs, rows + (j0 + 2 * q + 1) * rs,
                                 w + q * D, D, 1);
                shmkv_vt32(w, D, (uint32_t *)(kt + j0), ks / 2, np, D);
            } else {
                shmkv_vt32((const uint32_t *)(kt + j0), ks / 2, w, D, D, np);
                for (ptrdiff_t q = 0; q < np; q++)
                    shmkv_pair16(rows + (j0 + 2 * q) * rs, rows + (j0 + 2 * q + 1) * rs,
                                 w + q * D, D, 0);
            }
            j0 += 2 * np;
        }
    }
    for (ptrdiff_t j = j0; j < n; j++)              /* what is left: element by element */
        for (ptrdiff_t d = 0; d < D; d++) {
            if (to_kt) kt[d * ks + j] = rows[j * rs + d];
            else rows[j * rs + d] = kt[d * ks + j];
        }
}

/* rows rows of n bytes: dst + r * ds <- src + r * ss (byte strides). */
static inline void shmkv_vrows(void *dst, ptrdiff_t ds, const void *src, ptrdiff_t ss,
                               ptrdiff_t rows, size_t n) {
#if SHMKV_X86
    const int isa = shmkv_vt_isa();
    if (isa == 2 && (n & 63) == 0 && ((uintptr_t)dst & 63) == 0 && (ds & 63) == 0) {
        for (ptrdiff_t r = 0; r < rows; r++)
            shmkv_vstream64((char *)dst + r * ds, (const char *)src + r * ss, n);
        return;
    }
    if (isa >= 1 && (n & 31) == 0 && ((uintptr_t)dst & 31) == 0 && (ds & 31) == 0) {
        for (ptrdiff_t r = 0; r < rows; r++)
            shmkv_vstream32((char *)dst + r * ds, (const char *)src + r * ss, n);
        return;
    }
#endif
    for (ptrdiff_t r = 0; r < rows; r++)
        memcpy((char *)dst + r * ds, (const char *)src + r * ss, n);
}

/* After streamed stores: order them before what follows (a commit publishing the block). */
static inline void shmkv_vfence(void) {
#if SHMKV_X86
    __builtin_ia32_sfence();
#endif
}

#endif /* SHMKV_KERNELS_VTRANSPOSE_H */
