/*
 * kernels/attention_dot.h -- the opt-in reduced-precision items (precision="bf16")
 * on the CPU's narrow dot-product instructions; included once by attention.c after the
 * AVX-512 pass, whose helpers (vexpsub_avx512, hsum4_avx512, vacc_avx512, ...) it calls.
 * Every function carries its own target attribute, like attention_amx.h.  Owns nothing;
 * reads pool rows and writes the caller's scratch.
 *
 * The mode's contract, on every path (these items, and the FMA paths, which round the same
 * operands and multiply in float32): q (times the scale) and the softmax weights are
 * rounded to bf16 once (round to nearest even); products accumulate in float32.  Here:
 * - bfloat16 pools, AVX512_BF16: vdpbf16ps takes 32 bf16 products per instruction straight
 *   from the pool's rows (the FMA path converts every K and V element to float32 first and
 *   does 16 products per FMA).
 *   Decode (row item): q . k over pairs of d; P . V over pairs of keys, two V rows
 *   interleaved per 16 columns (vpermt2w) and the two weights broadcast as one 32-bit pair.
 *   Prefill (GEMM item, as attention_gemm.h): S^T = K . Q^T with Q^T packed in pairs of d
 *   and each K pair broadcast; O += P . V with V packed in pairs of keys once per step.
 * - int8 pools, AVX512_VNNI: q quantized to int8 per query vector (symmetric, max|q| / 127),
 *   q . k as vpdpbusd of (k + 128) as unsigned bytes and q as signed (64 products per
 *   instruction), less 128 * sum(q) -- exact integers, then times both scales; P . V on
 *   the FMA path with the weights rounded to bf16.
 */
#if SHMKV_HAVE_X86

#define SHMKV_DOT_TGT __attribute__((target(                                           \
    "avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,avx2,fma,f16c")))
#define SHMKV_DOT_AI SHMKV_DOT_TGT static inline __attribute__((always_inline))

enum { SHMKV_DOT_BF16 = 1, SHMKV_DOT_VNNI = 2 };

/* What this CPU has of AVX512_BF16 and AVX512_VNNI (bits), probed once. */
static int shmkv_dot_cpu(void) {
    static int v = -1;
    int r = __atomic_load_n(&v, __ATOMIC_RELAXED);
    if (r >= 0) return r;
    unsigned a, b, c, d;
    r = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (c >> 11 & 1)) r |= SHMKV_DOT_VNNI;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1)) r |= SHMKV_DOT_BF16;
    __atomic_store_n(&v, r, __ATOMIC_RELAXED);
    return r;
}

/* ---- the row (decode) item on vdpbf16ps, bfloat16 pools ------------------------------- */
/* s4[4 i + g] = q[g] . k[i] for KBN keys and NG query vectors (q: bf16 [NG][d]) */
SHMKV_DOT_AI void shmkv_dot_scores_blk(const uint16_t *q, const uint8_t *const *kr, uint32_t d,
                                       float *s4, const int NG, const int KBN) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int i = 0; i < KBN; i++)
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) acc[i][g] = _mm512_setzero_ps();
    for (uint32_t c = 0; c < d; c += 32) {
        __m512i qv[4];
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) qv[g] = _mm512_loadu_si512(q + (size_t)g * d + c);
#pragma GCC unroll 4
        for (int i = 0; i < KBN; i++) {
            const __m512i k = _mm512_loadu_si512(kr[i] + (size_t)c * 2);
#pragma GCC unroll 4
            for (int g = 0; g < NG; g++)
                acc[i][g] = _mm512_dpbf16_ps(acc[i][g], (__m512bh)k, (__m512bh)qv[g]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < KBN; i++) hsum4_avx512(acc[i][0], acc[i][1], acc[i][2], acc[i][3], s4 + 4 * i);
}

SHMKV_DOT_AI void shmkv_dot_scores_k(const uint16_t *q, const uint8_t *const *krow, uint32_t nt,
                                     uint32_t d, float *s, const int NG,
                                     const uint8_t *const *pf, uint32_t npf) {
    float s4[4 * TILE];
    uint32_t j = 0;
    for (; j + 4 <= nt; j += 4) {
        for (uint32_t i = j; i < j + 4 && i < npf; i++) shmkv_att_prefetch(pf[i], (size_t)d * 2);
        shmkv_dot_scores_blk(q, krow + j, d, s4 + 4 * j, NG, 4);
    }
    for (; j < nt; j++) {
        if (j < npf) shmkv_att_prefetch(pf[j], (size_t)d * 2);
        shmkv_dot_scores_blk(q, krow + j, d, s4 + 4 * j, NG, 1);
    }
    for (uint32_t i = j; i < npf; i++) shmkv_att_prefetch(pf[i], (size_t)d * 2);
    for (int g = 0; g < NG; g++)
        for (uint32_t t = 0; t < nt; t++) s[g * TILE + t] = s4[4 * t + g];
}

/* the columns of two bf16 rows a, b interleaved, 16 columns per vector: (a[c], b[c]) pairs
 * (vpermt2w indices: 0..31 pick from a, 32..63 from b) */
static const uint16_t shmkv_dot_ilv[2][32] = {
    { 0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47 },
    { 16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63 } };

/* acc[g][c0, c0 + 16 CCN) = acc * alpha[g] + sum over key pairs of (p, p') . (v, v') */
SHMKV_DOT_AI void shmkv_dot_pv_blk(float *acc, const float *alpha, const uint32_t *pp,
                                   const uint8_t *const *vrow, uint32_t npair, uint32_t d,
                                   uint32_t c0, const int NG, const int CCN,
                                   const uint8_t *const *pf, uint32_t npf) {
    __m512 o[4][4];
    const __m512i ilo = _mm512_loadu_si512(shmkv_dot_ilv[0]), ihi = _mm512_loadu_si512(shmkv_dot_ilv[1]);
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++) {
        const __m512 al = _mm512_set1_ps(alpha[g]);
#pragma GCC unroll 4
        for (int i = 0; i < CCN; i++)
            o[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)g * d + c0 + 16 * i), al);
    }
    for (uint32_t jp = 0; jp < npair; jp++) {
        if (2 * jp < npf) shmkv_att_prefetch(pf[2 * jp], (size_t)d * 2);
        if (2 * jp + 1 < npf) shmkv_att_prefetch(pf[2 * jp + 1], (size_t)d * 2);
        const uint8_t *v0 = vrow[2 * jp] + (size_t)c0 * 2, *v1 = vrow[2 * jp + 1] + (size_t)c0 * 2;
        __m512i vv[4];
#pragma GCC unroll 2
        for (int i = 0; i < CCN; i += 2) {
            const __m512i x = _mm512_loadu_si512(v0 + 32 * i), y = _mm512_loadu_si512(v1 + 32 * i);
            vv[i] = _mm512_permutex2var_epi16(x, ilo, y);
            vv[i + 1] = _mm512_permutex2var_epi16(x, ihi, y);
        }
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) {
            const __m512i pb = _mm512_set1_epi32((int)pp[g * (TILE / 2) + jp]);
#pragma GCC unroll 4
            for (int i = 0; i < CCN; i++)
                o[g][i] = _mm512_dpbf16_ps(o[g][i], (__m512bh)vv[i], (__m512bh)pb);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++)
#pragma GCC unroll 4
        for (int i = 0; i < CCN; i++) _mm512_storeu_ps(acc + (size_t)g * d + c0 + 16 * i, o[g][i]);
}

SHMKV_DOT_AI void shmkv_dot_pv_k(float *acc, const float *alpha, const uint32_t *pp,
                                 const uint8_t *const *vrow, uint32_t npair, uint32_t d,
                                 const int NG, const uint8_t *const *pf, uint32_t npf) {
    uint32_t c = 0;
    for (; c + 64 <= d; c += 64, npf = 0)                 /* prefetches with the first chunk */
        shmkv_dot_pv_blk(acc, alpha, pp, vrow, npair, d, c, NG, 4, pf, npf);
    for (; c < d; c += 32, npf = 0) shmkv_dot_pv_blk(acc, alpha, pp, vrow, npair, d, c, NG, 2, pf, npf);
}

#define SHMKV_DOT_NG(call)                                                             \
    switch (ng) {                                                                      \
    case 1: call(1); break;                                                            \
    case 2: call(2); break;                                                            \
    case 3: call(3); break;                                                            \
    default: call(4); break;                                                           \
    }

SHMKV_DOT_TGT static void shmkv_dot_scores(const uint16_t *q, uint32_t ng, const uint8_t *const *krow,
                                           uint32_t nt, uint32_t d, float *s,
                                           const uint8_t *const *pf, uint32_t npf) {
#define SHMKV_C(NG) shmkv_dot_scores_k(q, krow, nt, d, s, NG, pf, npf)
    SHMKV_DOT_NG(SHMKV_C)
#undef SHMKV_C
}

SHMKV_DOT_TGT static void shmkv_dot_pv(float *acc, uint32_t ng, const float *alpha, const uint32_t *pp,
                                       const uint8_t *const *vrow, uint32_t npair, uint32_t d,
                                       const uint8_t *const *pf, uint32_t npf) {
#define SHMKV_C(NG) shmkv_dot_pv_k(acc, alpha, pp, vrow, npair, d, NG, pf, npf)
    SHMKV_DOT_NG(SHMKV_C)
#undef SHMKV_C
}

/* Scratch floats the dot items need beyond the row item's: q as bf16 or int8, and the
 * int8 path's per-vector scale and sum. */
static size_t shmkv_dot_scratch(uint32_t nqv, uint32_t d) {
    return (size_t)nqv * d / 2 + 2 * (size_t)nqv + 32;
}

/* The tile's online-softmax update for NG query vectors (rows of s: TILE scores each),
 * as the row item's (attention_isa.h), the weights rounded to bf16; alpha out.  Returns
 * whether any vector saw a key. */
SHMKV_DOT_AI int shmkv_dot_softmax(float *s, uint32_t ng, uint32_t nt, uint32_t ts, uint32_t first,
                                   uint32_t q0, uint32_t G, uint32_t v0, float *m, float *l,
                                   float *alpha) {
    int any = 0;
    for (uint32_t g = 0; g < ng; g++) {
        const uint32_t v = v0 + g, lim = first + (q0 + g) / G + 1;
        float *sg = s + g * TILE, mt = -INFINITY;
        if (nt == TILE && ts + TILE <= lim) {
            mt = vmax16_avx512(sg);
            if (mt != mt) mt = -INFINITY;
        } else {
            for (uint32_t j = 0; j < TILE; j++) {
                if (j >= nt || ts + j >= lim) sg[j] = -INFINITY;
                else if (sg[j] > mt) mt = sg[j];
            }
        }
        if (mt == -INFINITY) {
            alpha[g] = 1.0f;
            for (uint32_t j = 0; j < TILE; j++) sg[j] = 0.0f;
            continue;
        }
        const float mn = m[v] > mt ? m[v] : mt;
        alpha[g] = m[v] == -INFINITY ? 0.0f : m[v] == mn ? 1.0f : expf(m[v] - mn);
        vexpsub_avx512(sg, mn);
        l[v] = l[v] * alpha[g] + round_tile_avx512(sg);
        m[v] = mn;
        any = 1;
    }
    return any;
}

/* The row item for bfloat16 pools (d a multiple of 32).  Same contract as
 * shmkv_att_item_*; qf holds q times the scale, already rounded to bf16 (load_q); xs is
 * shmkv_dot_scratch floats. */
SHMKV_DOT_TGT static int shmkv_att_item_dpbf16(const shmkv_attn_args_t *a, const shmkv_item_t *it,
                                               float *qf, float *acc, uint32_t nqv, float *xs) {
    const uint32_t d = a->d, G = a->hq / a->hkv, nqh = it->nrows * G;
    float *m = acc + (size_t)nqv * d, *l = m + nqv;
    const uint32_t L = a->seq_lens[it->seq], ql = a->q_lens[it->seq];
    const uint32_t first = L - ql + it->row0;
    const int32_t *table = a->tables[it->seq];
    const size_t tok = (size_t)a->hkv * d * 2, hstride = (size_t)d * 2;
    uint16_t *qb = (uint16_t *)xs;
    const uint8_t *kb[2][TILE], *vb[2][TILE], *krow[TILE], *vrow[TILE], *pk[TILE], *pv[TILE];
    size_t slot[2][TILE];
    float s[4 * TILE], alpha[4];
    uint32_t pp[4 * TILE / 2];
    for (size_t i = 0; i < (size_t)nqv * d; i += 16)        /* exact: qf is bf16 already */
        _mm256_storeu_si256((__m256i *)(qb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(qf + i)));
    memset(acc, 0, (size_t)nqv * d * sizeof(float));
    for (uint32_t v = 0; v < nqv; v++) { m[v] = -INFINITY; l[v] = 0; }
#define SHMKV_TILE_ROWS(ts_, w_, nt_)                                                  \
    do {                                                                               \
        if (shmkv_att_slots(a, table, (ts_), (nt_), slot[w_])) return -1;              \
        for (uint32_t j = 0; j < (nt_); j++) {                                         \
            kb[w_][j] = a->kpool + slot[w_][j] * tok;                                  \
            vb[w_][j] = a->vpool + slot[w_][j] * tok;                                  \
        }                                                                              \
    } while (0)
    int w = 0;
    if (it->t0 < it->t1) SHMKV_TILE_ROWS(it->t0, 0, (it->t1 - it->t0 < TILE ? it->t1 - it->t0 : TILE));
    for (uint32_t ts = it->t0; ts < it->t1; ts += TILE, w ^= 1) {
        const uint32_t nt = it->t1 - ts < TILE ? it->t1 - ts : TILE;
        const uint32_t tn = ts + TILE, nn = tn >= it->t1 ? 0 : (it->t1 - tn < TILE ? it->t1 - tn : TILE);
        if (nn) SHMKV_TILE_ROWS(tn, w ^ 1, nn);
        const uint32_t npair = (nt + 1) / 2;
        for (uint32_t h = 0; h < a->hkv; h++) {
            for (uint32_t j = 0; j < nt; j++) {
                krow[j] = kb[w][j] + h * hstride;
                vrow[j] = vb[w][j] + h * hstride;
            }
            if (nt & 1) vrow[nt] = vrow[nt - 1];     /* the odd tile's last pair: weight 0 */
            for (uint32_t j = 0; j < nn; j++) {
                pk[j] = kb[w ^ 1][j] + h * hstride;
                pv[j] = vb[w ^ 1][j] + h * hstride;
            }
            uint32_t npf = nn;
            for (uint32_t q0 = 0; q0 < nqh; q0 += 4) {
                const uint32_t ng = nqh - q0 < 4 ? nqh - q0 : 4, v0 = h * nqh + q0;
                if (first + (q0 + ng - 1) / G + 1 <= ts) continue;
                shmkv_dot_scores(qb + (size_t)v0 * d, ng, krow, nt, d, s, pk, npf);
                if (shmkv_dot_softmax(s, ng, nt, ts, first, q0, G, v0, m, l, alpha)) {
                    for (uint32_t g = 0; g < ng; g++)    /* the weights' bf16 pairs */
                        for (uint32_t jp = 0; jp < TILE / 2; jp++) {
                            uint32_t lo, hi;
                            memcpy(&lo, s + g * TILE + 2 * jp, 4);
                            memcpy(&hi, s + g * TILE + 2 * jp + 1, 4);
                            pp[g * (TILE / 2) + jp] = (hi & 0xffff0000u) | (lo >> 16);
                        }
                    shmkv_dot_pv(acc + (size_t)v0 * d, ng, alpha, pp, vrow, npair, d, pv, npf);
                } else {
                    for (uint32_t j = 0; j < npf; j++) shmkv_att_prefetch(pv[j], hstride);
                }
                npf = 0;
            }
        }
    }
    return 0;
}

/* ---- the row (decode) item on vpdpbusd, int8 pools ------------------------------------ */
/* s4[4 i + g] = q8[g] . (k[i] + 128), exact, as floats (|sum| < 2^24 for d <= 256) */
SHMKV_DOT_AI void shmkv_vnni_scores_blk(const int8_t *q, const uint8_t *const *kr, uint32_t d,
                                        float *s4, const int NG, const int KBN) {
    __m512i acc[4][4];
    const __m512i flip = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 4
    for (int i = 0; i < KBN; i++)
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) acc[i][g] = _mm512_setzero_si512();
    for (uint32_t c = 0; c < d; c += 64) {
        __m512i qv[4];
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) qv[g] = _mm512_loadu_si512(q + (size_t)g * d + c);
#pragma GCC unroll 4
        for (int i = 0; i < KBN; i++) {
            const __m512i k = _mm512_xor_si512(_mm512_loadu_si512(kr[i] + c), flip);
#pragma GCC unroll 4
            for (int g = 0; g < NG; g++) acc[i][g] = _mm512_dpbusd_epi32(acc[i][g], k, qv[g]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < KBN; i++)
        hsum4_avx512(_mm512_cvtepi32_ps(acc[i][0]), _mm512_cvtepi32_ps(acc[i][1]),
                     _mm512_cvtepi32_ps(acc[i][2]), _mm512_cvtepi32_ps(acc[i][3]), s4 + 4 * i);
}

/* s[g][t] = (q8[g] . k[t]) * qs[g] * ksc[t]: the int8 products, then both scales */
SHMKV_DOT_AI void shmkv_vnni_scores_k(const int8_t *q, const uint8_t *const *krow, uint32_t nt,
                                      uint32_t d, float *s, const int NG, const float *qs,
                                      const float *qsum, const float *ksc,
                                      const uint8_t *const *pf, uint32_t npf) {
    float s4[4 * TILE];
    uint32_t j = 0;
    for (; j + 4 <= nt; j += 4) {
        for (uint32_t i = j; i < j + 4 && i < npf; i++) shmkv_att_prefetch(pf[i], d);
        shmkv_vnni_scores_blk(q, krow + j, d, s4 + 4 * j, NG, 4);
    }
    for (; j < nt; j++) {
        if (j < npf) shmkv_att_prefetch(pf[j], d);
        shmkv_vnni_scores_blk(q, krow + j, d, s4 + 4 * j, NG, 1);
    }
    for (uint32_t i = j; i < npf; i++) shmkv_att_prefetch(pf[i], d);
    if (nt < TILE) memset(s4 + 4 * nt, 0, sizeof(float) * 4 * (TILE - nt));
    for (int g = 0; g < NG; g++)
        for (uint32_t t = 0; t < TILE; t++)
            s[g * TILE + t] = (s4[4 * t + g] - qsum[g]) * qs[g] * ksc[t];
}

SHMKV_DOT_TGT static void shmkv_vnni_scores(const int8_t *q, uint32_t ng, const uint8_t *const *krow,
                                            uint32_t nt, uint32_t d, float *s, const float *qs,
                                            const float *qsum, const float *ksc,
                                            const uint8_t *const *pf, uint32_t npf) {
#define SHMKV_C(NG) shmkv_vnni_scores_k(q, krow, nt, d, s, NG, qs, qsum, ksc, pf, npf)
    SHMKV_DOT_NG(SHMKV_C)
#undef SHMKV_C
}

/* The row item for int8 pools (d a multiple of 64, at most 256).  qf holds q times the
 * scale; each query vector goes to int8 codes with its own scale (max|q| / 127). */
SHMKV_DOT_TGT static int shmkv_att_item_vnni(const shmkv_attn_args_t *a, const shmkv_item_t *it,
                                             float *qf, float *acc, uint32_t nqv, float *xs) {
    const uint32_t d = a->d, G = a->hq / a->hkv, nqh = it->nrows * G;
    float *m = acc + (size_t)nqv * d, *l = m + nqv;
    const uint32_t L = a->seq_lens[it->seq], ql = a->q_lens[it->seq];
    const uint32_t first = L - ql + it->row0;
    const int32_t *table = a->tables[it->seq];
    const size_t tok = (size_t)a->hkv * d, hstride = d;
    int8_t *q8 = (int8_t *)xs;
    float *qs = xs + (size_t)nqv * d / 4, *qsum = qs + nqv;
    const uint8_t *kb[2][TILE], *vb[2][TILE], *krow[TILE], *vrow[TILE], *pk[TILE], *pv[TILE];
    size_t slot[2][TILE];
    float s[4 * TILE], alpha[4], ksc[TILE], vsc[TILE];
    for (uint32_t v = 0; v < nqv; v++) {                 /* q -> int8 codes, per vector */
        const float *x = qf + (size_t)v * d;
        __m512 mx = _mm512_setzero_ps();
        for (uint32_t c = 0; c < d; c += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + c)));
        const float amax = _mm512_reduce_max_ps(mx);
        const float sc = amax > 0 ? amax / 127.0f : 1.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
        __m512i sum = _mm512_setzero_si512();
        for (uint32_t c = 0; c < d; c += 16) {
            const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + c), _mm512_set1_ps(inv)));
            const __m512i cl = _mm512_max_epi32(_mm512_min_epi32(n, _mm512_set1_epi32(127)),
                                                _mm512_set1_epi32(-127));
            _mm_storeu_si128((__m128i *)(q8 + (size_t)v * d + c), _mm512_cvtepi32_epi8(cl));
            sum = _mm512_add_epi32(sum, cl);
        }
        qs[v] = sc;
        qsum[v] = 128.0f * (float)_mm512_reduce_add_epi32(sum);
    }
    memset(acc, 0, (size_t)nqv * d * sizeof(float));
    for (uint32_t v = 0; v < nqv; v++) { m[v] = -INFINITY; l[v] = 0; }
    int w = 0;
    if (it->t0 < it->t1) SHMKV_TILE_ROWS(it->t0, 0, (it->t1 - it->t0 < TILE ? it->t1 - it->t0 : TILE));
    for (uint32_t ts = it->t0; ts < it->t1; ts += TILE, w ^= 1) {
        const uint32_t nt = it->t1 - ts < TILE ? it->t1 - ts : TILE;
        const uint32_t tn = ts + TILE, nn = tn >= it->t1 ? 0 : (it->t1 - tn < TILE ? it->t1 - tn : TILE);
        if (nn) SHMKV_TILE_ROWS(tn, w ^ 1, nn);
        for (uint32_t h = 0; h < a->hkv; h++) {
            for (uint32_t j = 0; j < nt; j++) {
                krow[j] = kb[w][j] + h * hstride;
                vrow[j] = vb[w][j] + h * hstride;
                ksc[j] = a->kscale[slot[w][j] * a->hkv + h];
                vsc[j] = a->vscale[slot[w][j] * a->hkv + h];
            }
            for (uint32_t j = nt; j < TILE; j++) ksc[j] = vsc[j] = 0.0f;
            for (uint32_t j = 0; j < nn; j++) {
                pk[j] = kb[w ^ 1][j] + h * hstride;
                pv[j] = vb[w ^ 1][j] + h * hstride;
            }
            uint32_t npf = nn;
            for (uint32_t q0 = 0; q0 < nqh; q0 += 4) {
                const uint32_t ng = nqh - q0 < 4 ? nqh - q0 : 4, v0 = h * nqh + q0;
                if (first + (q0 + ng - 1) / G + 1 <= ts) continue;
                shmkv_vnni_scores(q8 + (size_t)v0 * d, ng, krow, nt, d, s, qs + v0, qsum + v0,
                                  ksc, pk, npf);
                if (shmkv_dot_softmax(s, ng, nt, ts, first, q0, G, v0, m, l, alpha))
                    vacc_avx512(acc + (size_t)v0 * d, ng, alpha, s, vrow, nt, d, SHMKV_ATT_I8, pv,
                                npf, vsc);
                else
                    for (uint32_t j = 0; j < npf; j++) shmkv_att_prefetch(pv[j], hstride);
                npf = 0;
            }
        }
    }
    return 0;
}

#undef SHMKV_TILE_ROWS
#undef SHMKV_DOT_NG

#endif
