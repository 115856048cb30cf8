/*
 * kernels/vamx.h -- the vLLM connector's copy for vLLM's AMX KV layout (shmkv._vcopy):
 * one shmkv block's K and V of one head <-> its piece of a vLLM (block, head) tile.
 * Owns no data; pointers come from _vcopy, which has checked every block id, the
 * sub-block offset and the shapes (bs % 16 == 0, D % 16 == 0, D % pack == 0) first.
 *
 * vLLM 0.32's AMX layout (csrc/cpu/cpu_attn_amx.hpp, reshape_and_cache; for an fp8 cache
 * the bf16 tiles' layout with 1-byte codes), per (block, head), pack = elements per
 * packed unit (2 for 16-bit and fp8 caches, 1 for float32):
 *   K [VB/16][D/pack][16][pack]   token groups of 16; in a group, unit u of token t at
 *                                 u * 16 + t: a transpose of pack-element units
 *   V [D/16][VB/pack][16][pack]   dim groups of 16; in a group, the pack tokens of a
 *                                 pair interleaved per dim: (t / pack) * 16 * pack +
 *                                 j * pack + t % pack
 * A shmkv block of bs tokens (bs % 16 == 0) at sub-block s of a vLLM block is one
 * contiguous run of bs * D elements of K (groups s*bs/16 ..) and, in each V dim group,
 * one run of bs * 16 elements starting at s * bs * 16.  shmkv's side: token t's head
 * slice at row + t * rs bytes (rs = H * D * itemsize), D elements.
 *
 * Fast paths: K with 4-byte units (bfloat16/float16 pairs, float32) is vtranspose.h's
 * shmkv_vt32 (16x16 AVX-512F register tiles, streamed stores); V of 16-bit pairs is an
 * AVX-512F zero-extend + shift + or per 16 dims (save: two truncations), float32 V is
 * plain 64-byte rows (shmkv_vrows).  Everything else (fp8 codes, AVX2-only and other
 * CPUs) goes through the portable loops, which every path equals bit for bit (tests
 * force each one through shmkv_vt_force_isa).
 */
#ifndef SHMKV_KERNELS_VAMX_H
#define SHMKV_KERNELS_VAMX_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include "vtranspose.h"

/* Portable transpose of w-byte units: dst unit (c, r) at dst + (c * ds + r) * w <- src unit
 * (r, c) at src + (r * ss + c) * w (strides in units). */
static inline void shmkv_amx_tw(const char *src, ptrdiff_t ss, char *dst, ptrdiff_t ds,
                                ptrdiff_t rows, ptrdiff_t cols, int w) {
    if (w == 2) {
        const uint16_t *s = (const uint16_t *)src;
        uint16_t *d = (uint16_t *)dst;
        for (ptrdiff_t c = 0; c < cols; c++)
            for (ptrdiff_t r = 0; r < rows; r++) d[c * ds + r] = s[r * ss + c];
        return;
    }
    for (ptrdiff_t c = 0; c < cols; c++)
        for (ptrdiff_t r = 0; r < rows; r++)
            memcpy(dst + (c * ds + r) * w, src + (r * ss + c) * w, (size_t)w);
}

/* V of one dim group (16 dims) of bs tokens: g (the group's run in the tile) <-> the 16
 * dims at row + t * rs.  Portable: element by element. */
static inline void shmkv_amx_v_c(char *g, char *row, ptrdiff_t rs, ptrdiff_t bs, int isz,
                                 int pack, int to_vllm) {
    if (pack == 2 && (isz == 1 || isz == 2)) {      /* typed pairs: loops compilers vectorize */
        for (ptrdiff_t q = 0; q < bs / 2; q++) {
            char *a = row + 2 * q * rs, *b = a + rs;
            if (isz == 2) {
                uint16_t *pa = (uint16_t *)a, *pb = (uint16_t *)b, *o = (uint16_t *)(g + q * 64);
                if (to_vllm) for (int j = 0; j < 16; j++) { o[2 * j] = pa[j]; o[2 * j + 1] = pb[j]; }
                else for (int j = 0; j < 16; j++) { pa[j] = o[2 * j]; pb[j] = o[2 * j + 1]; }
            } else {
                uint8_t *pa = (uint8_t *)a, *pb = (uint8_t *)b, *o = (uint8_t *)(g + q * 32);
                if (to_vllm) for (int j = 0; j < 16; j++) { o[2 * j] = pa[j]; o[2 * j + 1] = pb[j]; }
                else for (int j = 0; j < 16; j++) { pa[j] = o[2 * j]; pb[j] = o[2 * j + 1]; }
            }
        }
        return;
    }
    for (ptrdiff_t t = 0; t < bs; t++) {
        char *gt = g + ((t / pack) * 16 * pack + t % pack) * isz;
        char *rt = row + t * rs;
        for (int j = 0; j < 16; j++) {
            if (to_vllm) memcpy(gt + j * pack * isz, rt + j * isz, (size_t)isz);
            else memcpy(rt + j * isz, gt + j * pack * isz, (size_t)isz);
        }
    }
}

#if SHMKV_X86
/* 16-bit pairs: per token pair and 16 dims, one 64-byte row of 32-bit units
 * (lo = the even token, hi = the odd one, as the little-endian pair in memory). */
__attribute__((target("avx512f"))) static inline void
shmkv_amx_v16_avx512(char *g, char *row, ptrdiff_t rs, ptrdiff_t bs, int to_vllm) {
    for (ptrdiff_t q = 0; q < bs / 2; q++) {
        char *a = row + 2 * q * rs, *b = a + rs;
        char *o = g + q * 64;
        if (to_vllm) {
            __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)a));
            __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b));
            _mm512_storeu_si512(o, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        } else {
            __m512i w = _mm512_loadu_si512(o);
            _mm256_storeu_si256((__m256i *)a, _mm512_cvtepi32_epi16(w));
            _mm256_storeu_si256((__m256i *)b, _mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
        }
    }
}
#endif

/* One piece: K and V of one head of one shmkv block (bs tokens) <-> sub-block s of the
 * (block, head) tile `tile` (2 * VB * D elements: K then V).  k_row / v_row: the shmkv
 * pools' first token of this head; rs: bytes between tokens there. */
static inline void shmkv_amx_piece(char *tile, char *k_row, char *v_row, ptrdiff_t rs,
                                   ptrdiff_t VB, ptrdiff_t D, ptrdiff_t bs, ptrdiff_t s,
                                   int isz, int pack, int to_vllm) {
    const int w = isz * pack;                       /* bytes per packed unit */
    const ptrdiff_t units = D / pack;               /* units per token row */
    char *kt = tile + s * bs * D * isz;             /* this piece's K run */
    for (ptrdiff_t g0 = 0; g0 < bs; g0 += 16) {
        char *kg = kt + g0 * D * isz;               /* [units][16] of tokens g0.. */
        char *kr = k_row + g0 * rs;
        if (w == 4 && rs % 4 == 0) {
            if (to_vllm) shmkv_vt32((const uint32_t *)kr, rs / 4, (uint32_t *)kg, 16, 16, units);
            else shmkv_vt32((const uint32_t *)kg, 16, (uint32_t *)kr, rs / 4, units, 16);
        } else if (rs % w == 0) {
            if (to_vllm) shmkv_amx_tw(kr, rs / w, kg, 16, 16, units, w);
            else shmkv_amx_tw(kg, 16, kr, rs / w, units, 16, w);
        } else {                                    /* not reached: rs = H * D * isz */
            for (ptrdiff_t t = 0; t < 16; t++)
                for (ptrdiff_t u = 0; u < units; u++) {
                    if (to_vllm) memcpy(kg + (u * 16 + t) * w, kr + t * rs + u * w, (size_t)w);
                    else memcpy(kr + t * rs + u * w, kg + (u * 16 + t) * w, (size_t)w);
                }
        }
    }
    char *vt = tile + (VB * D + s * bs * 16) * isz; /* dim group 0's run of this piece */
    for (ptrdiff_t i = 0; i < D / 16; i++) {
        char *g = vt + i * VB * 16 * isz;
        char *vr = v_row + i * 16 * isz;
        if (pack == 1) {                            /* rows of 16 elements */
            if (to_vllm) shmkv_vrows(g, 16 * isz, vr, rs, bs, (size_t)(16 * isz));
            else shmkv_vrows(vr, rs, g, 16 * isz, bs, (size_t)(16 * isz));
            continue;
        }
#if SHMKV_X86
        if (pack == 2 && isz == 2 && shmkv_vt_isa() == 2) {
            shmkv_amx_v16_avx512(g, vr, rs, bs, to_vllm);
            continue;
        }
#endif
        shmkv_amx_v_c(g, vr, rs, bs, isz, pack, to_vllm);
    }
}

#endif /* SHMKV_KERNELS_VAMX_H */
