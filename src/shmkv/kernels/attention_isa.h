/*
 * kernels/attention_isa.h -- the inner loops of the attention kernel, one source compiled
 * once per instruction set (numpy-style dispatch).  attention.c includes it three times,
 * with SHMKV_ISA_SUFFIX = scalar / avx2 / avx512 and, for the vector ones, a GCC target
 * pragma around it.  Owns nothing; reads pool rows and writes the caller's scratch.
 *
 * One work item = the query vectors of some rows of one sequence (every q head) over keys
 * [t0, t1) of that sequence.  Per tile of 16 keys: scores for up to 4 query
 * vectors at once (each K row loaded and converted once for the 4), the online-softmax
 * update, then the V rows (each loaded once for the 4) accumulated with the probabilities.
 */
#define SHMKV_CAT2(a, b) a##_##b
#define SHMKV_CAT(a, b) SHMKV_CAT2(a, b)
#define FN(name) SHMKV_CAT(name, SHMKV_ISA_SUFFIX)
#define SHMKV_AI static inline __attribute__((always_inline))

/* ---- the vector vocabulary of this pass --------------------------------------------- */
#undef VEC
#undef W
#if SHMKV_ISA_PASS == 2                         /* AVX-512: 16 fp32 lanes */
#define VEC __m512
#define W 16
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VLOADF(p) _mm512_loadu_ps(p)
#define VSTOREF(p, v) _mm512_storeu_ps((p), (v))
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VHSUM(v) _mm512_reduce_add_ps(v)
SHMKV_AI VEC FN(vld)(const uint8_t *p, const int dt) {
    if (dt == SHMKV_ATT_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    if (dt == SHMKV_ATT_E4M3) {             /* 16 codes -> float16 bits -> floats / 2^8 */
        /* sign-extended to 16 bits and shifted by 7: the sign lands on bits 15 and 14,
         * (eeee mmm) on 13..7; clearing bit 14 leaves the float16 of SHMKV_E4M3_F16_BITS */
        const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
        return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(x, 7),
                                                _mm256_set1_epi16((short)0xbfff)));
    }
    if (dt == SHMKV_ATT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    if (dt == SHMKV_ATT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}
SHMKV_AI __m256 FN(hi256)(__m512 a) {        /* AVX512F only (no DQ) */
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}
/* the four sums of a0..a3 into d[0..3] (one reduction tree for the four) */
SHMKV_AI void FN(hsum4)(VEC a0, VEC a1, VEC a2, VEC a3, float *d) {
    const __m256 r0 = _mm256_add_ps(_mm512_castps512_ps256(a0), FN(hi256)(a0));
    const __m256 r1 = _mm256_add_ps(_mm512_castps512_ps256(a1), FN(hi256)(a1));
    const __m256 r2 = _mm256_add_ps(_mm512_castps512_ps256(a2), FN(hi256)(a2));
    const __m256 r3 = _mm256_add_ps(_mm512_castps512_ps256(a3), FN(hi256)(a3));
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(r0, r1), _mm256_hadd_ps(r2, r3));
    _mm_storeu_ps(d, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
SHMKV_AI float FN(vmax16)(const float *s) { return _mm512_reduce_max_ps(_mm512_loadu_ps(s)); }
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VSUB(a, b) _mm512_sub_ps((a), (b))
#define VMIN(a, b) _mm512_min_ps((a), (b))
#define VMAX(a, b) _mm512_max_ps((a), (b))
#define VFNMA(a, b, c) _mm512_fnmadd_ps((a), (b), (c))
#define VROUNDN(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VPOW2I(n) _mm512_castsi512_ps(_mm512_slli_epi32(                                \
    _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
/* p where x0 != -inf, else exactly 0 */
#define VLIVE(x0, p) _mm512_maskz_mov_ps(                                                \
    _mm512_cmp_ps_mask((x0), _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ), (p))
#elif SHMKV_ISA_PASS == 1                       /* AVX2 + FMA + F16C: 8 fp32 lanes */
#define VEC __m256
#define W 8
#define VZERO() _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VLOADF(p) _mm256_loadu_ps(p)
#define VSTOREF(p, v) _mm256_storeu_ps((p), (v))
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VMUL(a, b) _mm256_mul_ps((a), (b))
SHMKV_AI float FN(hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#define VHSUM(v) FN(hsum)(v)
SHMKV_AI void FN(hsum4)(VEC a0, VEC a1, VEC a2, VEC a3, float *d) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(d, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
SHMKV_AI float FN(vmax16)(const float *s) {
    __m256 m = _mm256_max_ps(_mm256_loadu_ps(s), _mm256_loadu_ps(s + 8));
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}
SHMKV_AI VEC FN(vld)(const uint8_t *p, const int dt) {
    if (dt == SHMKV_ATT_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    if (dt == SHMKV_ATT_E4M3) {             /* 8 codes -> float16 bits -> floats / 2^8 */
        const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
        return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(x, 7),
                                             _mm_set1_epi16((short)0xbfff)));
    }
    if (dt == SHMKV_ATT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    if (dt == SHMKV_ATT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    return _mm256_loadu_ps((const float *)p);
}
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VSUB(a, b) _mm256_sub_ps((a), (b))
#define VMIN(a, b) _mm256_min_ps((a), (b))
#define VMAX(a, b) _mm256_max_ps((a), (b))
#define VFNMA(a, b, c) _mm256_fnmadd_ps((a), (b), (c))
#define VROUNDN(x) _mm256_round_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VPOW2I(n) _mm256_castsi256_ps(_mm256_slli_epi32(                                \
    _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#define VLIVE(x0, p) _mm256_and_ps(                                                      \
    _mm256_cmp_ps((x0), _mm256_set1_ps(-INFINITY), _CMP_NEQ_UQ), (p))
#else                                           /* portable scalar: 1 lane */
#define VEC float
#define W 1
#define VZERO() 0.0f
#define VSET1(x) (x)
#define VLOADF(p) (*(p))
#define VSTOREF(p, v) (*(p) = (v))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VMUL(a, b) ((a) * (b))
#define VHSUM(v) (v)
SHMKV_AI void FN(hsum4)(VEC a0, VEC a1, VEC a2, VEC a3, float *d) {
    d[0] = a0; d[1] = a1; d[2] = a2; d[3] = a3;
}
SHMKV_AI float FN(vmax16)(const float *s) {
    float m = s[0];
    for (int j = 1; j < TILE; j++) m = s[j] > m ? s[j] : m;
    return m;
}
SHMKV_AI VEC FN(vld)(const uint8_t *p, const int dt) { return shmkv_load_elem(p, dt, 0); }
SHMKV_AI float FN(vexpsub)(float *s, float mx) {
    float sum = 0;
    for (int j = 0; j < TILE; j++) {
        /* 0 below e^-87 (and for -inf): expf's denormals there cost a microcode assist
         * in every later product (decode 2.4x slower with scores spread ~16) */
        const float x = s[j] - mx;
        s[j] = s[j] == -INFINITY || x < -87.0f ? 0.0f : expf(x);
        sum += s[j];
    }
    return sum;
}
#endif

#if SHMKV_ISA_PASS > 0
/* exp(x - mx) for the W scores at s (Cephes-style: 2^n * poly(r), |r| <= ln2/2), exactly
 * 0 where x == -inf; stored back, their sum returned.  The vector passes share it. */
SHMKV_AI float FN(vexpw)(float *s, float mx) {
    const VEC x0 = VLOADF(s);
    VEC x = VSUB(x0, VSET1(mx));
    x = VMAX(VMIN(x, VSET1(88.0f)), VSET1(-87.0f));
    const VEC n = VROUNDN(VMUL(x, VSET1(1.44269504f)));
    VEC r = VFNMA(n, VSET1(0.693359375f), x);
    r = VFNMA(n, VSET1(-2.12194440e-4f), r);
    VEC p = VSET1(1.9875691500e-4f);
    p = VFMA(p, r, VSET1(1.3981999507e-3f));
    p = VFMA(p, r, VSET1(8.3334519073e-3f));
    p = VFMA(p, r, VSET1(4.1665795894e-2f));
    p = VFMA(p, r, VSET1(1.6666665459e-1f));
    p = VFMA(p, r, VSET1(5.0000001201e-1f));
    p = VFMA(p, VMUL(r, r), VADD(r, VSET1(1.0f)));
    p = VLIVE(x0, VMUL(p, VPOW2I(n)));
    VSTOREF(s, p);
    return VHSUM(p);
}
/* exp(x - mx) over a tile of TILE scores; returns the sum */
SHMKV_AI float FN(vexpsub)(float *s, float mx) {
    float sum = 0;
    for (int i = 0; i < TILE; i += W) sum += FN(vexpw)(s + i, mx);
    return sum;
}
#endif

/* ---- the opt-in bf16 mode (precision="bf16"): operands rounded to bf16, kept as float32 */
#if SHMKV_ISA_PASS == 2
/* round to nearest even at bit 16; a NaN stays a (quiet) NaN */
SHMKV_AI VEC FN(rbf)(VEC x) {
    const __m512i b = _mm512_castps_si512(x);
    __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
        _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                              _mm512_or_si512(b, _mm512_set1_epi32(0x00400000)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}
#elif SHMKV_ISA_PASS == 1
SHMKV_AI VEC FN(rbf)(VEC x) {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
        _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1))));
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 q = _mm256_castsi256_ps(_mm256_or_si256(b, _mm256_set1_epi32(0x00400000)));
    return _mm256_and_ps(_mm256_blendv_ps(_mm256_castsi256_ps(r), q, nan),
                         _mm256_castsi256_ps(_mm256_set1_epi32((int)0xffff0000u)));
}
#else
SHMKV_AI VEC FN(rbf)(VEC x) { return shmkv_round_bf16(x); }
#endif
/* the tile's TILE weights rounded to bf16 in place; returns the sum of the rounded */
SHMKV_AI float FN(round_tile)(float *s) {
    float sum = 0;
    for (int i = 0; i < TILE; i += W) {
        const VEC v = FN(rbf)(VLOADF(s + i));
        VSTOREF(s + i, v);
        sum += VHSUM(v);
    }
    return sum;
}

/* Register blocking, per pass: KB keys at a time in the scores (each q chunk loaded once
 * for KB keys: KB * NG accumulators), CC vector chunks of d at a time in the V pass (each
 * probability broadcast once for CC chunks: NG * CC accumulators, which stay in registers
 * across the tile's keys).  Sized to the register file: 32 zmm, 16 ymm. */
#undef KB
#undef CC
#if SHMKV_ISA_PASS == 2
#define KB 4
#define CC 4
#elif SHMKV_ISA_PASS == 1
#define KB 2
#define CC 3
#else
#define KB 4
#define CC 4
#endif

/* ---- scores: s4[4 j + g] = q[g] . k[j] for KBN keys and NG query vectors ------------- */
SHMKV_AI void FN(scores_blk)(const float *q, const uint8_t *const *kr, uint32_t d, float *s4,
                             const int dt, const int NG, const int KBN) {
    const size_t esz = SHMKV_ESZ(dt);
    VEC a[KB][4];
#pragma GCC unroll 4
    for (int i = 0; i < KBN; i++)
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++) a[i][g] = VZERO();
    for (uint32_t c = 0; c < d; c += W) {
        VEC qv[4];
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) qv[g] = VLOADF(q + (size_t)g * d + c);
#pragma GCC unroll 4
        for (int i = 0; i < KBN; i++) {
            const VEC k = FN(vld)(kr[i] + c * esz, dt);
#pragma GCC unroll 4
            for (int g = 0; g < NG; g++) a[i][g] = VFMA(k, qv[g], a[i][g]);
        }
    }
    if (KB >= 4 && NG == 1 && KBN == 4) {   /* one query vector: the four keys' sums at once */
        float t[4];
        FN(hsum4)(a[0][0], a[1][0], a[2][0], a[3][0], t);
        for (int i = 0; i < 4; i++) s4[4 * i] = t[i];
    } else {
#pragma GCC unroll 4
        for (int i = 0; i < KBN; i++) FN(hsum4)(a[i][0], a[i][1], a[i][2], a[i][3], s4 + 4 * i);
    }
}

/* ---- scores: s[g][j] = q[g] . k[j] for NG query vectors (q pre-scaled) ---------------- */
SHMKV_AI void FN(scores_k)(const float *q, const uint8_t *const *krow, uint32_t nt, uint32_t d,
                           float *s, const int dt, const int NG, const uint8_t *const *pf,
                           uint32_t npf, const float *ksc) {
    const size_t rb = (size_t)d * SHMKV_ESZ(dt);
    float s4[4 * TILE];
    uint32_t j = 0;
    for (; j + KB <= nt; j += KB) {
        /* the next tile's K rows of this head, a few per block of keys (spread: a burst
         * of prefetches stalls the core once the miss buffers are full) */
        for (uint32_t i = j; i < j + KB && i < npf; i++) shmkv_att_prefetch(pf[i], rb);
        FN(scores_blk)(q, krow + j, d, s4 + 4 * j, dt, NG, KB);
    }
    for (; j < nt; j++) {
        if (j < npf) shmkv_att_prefetch(pf[j], rb);
        FN(scores_blk)(q, krow + j, d, s4 + 4 * j, dt, NG, 1);
    }
    for (uint32_t i = j; i < npf; i++) shmkv_att_prefetch(pf[i], rb);
    if (SHMKV_QUANT(dt)) {                      /* q . (s k) = s (q . k): one multiply per score */
        /* the whole tile (a constant trip count): past nt the scores are masked to -inf
         * by the item before any use; the unused s4 entries are zeroed, not read raw */
        if (nt < TILE) memset(s4 + 4 * nt, 0, sizeof(float) * 4 * (TILE - nt));
        for (int g = 0; g < NG; g++)
            for (uint32_t t = 0; t < TILE; t++) s[g * TILE + t] = s4[4 * t + g] * ksc[t];
    } else {
        for (int g = 0; g < NG; g++)            /* [token][g] -> [g][token] */
            for (uint32_t t = 0; t < nt; t++) s[g * TILE + t] = s4[4 * t + g];
    }
}

/* ---- acc[g][c0, c0 + CCN W) = acc * alpha[g] + sum_j p[g][j] v[j][c0, ...) ----------- */
SHMKV_AI void FN(vacc_blk)(float *acc, const float *alpha, const float *p,
                           const uint8_t *const *vrow, uint32_t nt, uint32_t d, uint32_t c0,
                           const int dt, const int NG, const int CCN, const uint8_t *const *pf,
                           uint32_t npf) {
    const size_t esz = SHMKV_ESZ(dt);
    VEC o[4][CC];
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++) {
        const VEC al = VSET1(alpha[g]);
#pragma GCC unroll 4
        for (int i = 0; i < CCN; i++) o[g][i] = VMUL(VLOADF(acc + (size_t)g * d + c0 + i * W), al);
    }
    for (uint32_t j = 0; j < nt; j++) {
        if (j < npf) shmkv_att_prefetch(pf[j], (size_t)d * esz);   /* next tile's V row */
        const uint8_t *vr = vrow[j] + (size_t)c0 * esz;
        VEC vv[CC];
#pragma GCC unroll 4
        for (int i = 0; i < CCN; i++) vv[i] = FN(vld)(vr + (size_t)i * W * esz, dt);
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) {
            const VEC pg = VSET1(p[g * TILE + j]);
#pragma GCC unroll 4
            for (int i = 0; i < CCN; i++) o[g][i] = VFMA(pg, vv[i], o[g][i]);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; g++)
#pragma GCC unroll 4
        for (int i = 0; i < CCN; i++) VSTOREF(acc + (size_t)g * d + c0 + i * W, o[g][i]);
}

/* ---- acc[g] = acc[g] * alpha[g] + sum_j p[g][j] v[j] ---------------------------------- */
SHMKV_AI void FN(vacc_k)(float *acc, const float *alpha, const float *p,
                         const uint8_t *const *vrow, uint32_t nt, uint32_t d, const int dt,
                         const int NG, const uint8_t *const *pf, uint32_t npf) {
    uint32_t c = 0;
#if SHMKV_ISA_PASS == 1
    /* AVX2: 3 chunks at a time (12 accumulators in 16 ymm: with 8, one key step's FMAs
     * just covered the FMA latency and any stall showed), then 2 + 2 rather than 3 + 1 at
     * the end (a lone chunk is 4 dependent chains: half the FMA rate).  Prefetches go
     * with the first call, as below. */
    for (; c + 3 * W <= d && d - c != 4 * W; c += 3 * W, npf = 0)
        FN(vacc_blk)(acc, alpha, p, vrow, nt, d, c, dt, NG, 3, pf, npf);
    for (; c + 2 * W <= d; c += 2 * W, npf = 0)
        FN(vacc_blk)(acc, alpha, p, vrow, nt, d, c, dt, NG, 2, pf, npf);
#else
    for (; c + CC * W <= d; c += CC * W, npf = 0)       /* prefetches with the first chunk */
        FN(vacc_blk)(acc, alpha, p, vrow, nt, d, c, dt, NG, CC, pf, npf);
#endif
    for (; c < d; c += W, npf = 0) FN(vacc_blk)(acc, alpha, p, vrow, nt, d, c, dt, NG, 1, pf, npf);
    for (uint32_t j = nt; j < npf; j++) shmkv_att_prefetch(pf[j], (size_t)d * SHMKV_ESZ(dt));
}

#define SHMKV_NG_SWITCH(call, dtv)                                                     \
    switch (ng) {                                                                      \
    case 1: call(dtv, 1); break;                                                       \
    case 2: call(dtv, 2); break;                                                       \
    case 3: call(dtv, 3); break;                                                       \
    default: call(dtv, 4); break;                                                      \
    }
#define SHMKV_DT_SWITCH(call)                                                          \
    switch (dt) {                                                                      \
    case SHMKV_ATT_F16: SHMKV_NG_SWITCH(call, SHMKV_ATT_F16) break;                    \
    case SHMKV_ATT_BF16: SHMKV_NG_SWITCH(call, SHMKV_ATT_BF16) break;                  \
    case SHMKV_ATT_I8: SHMKV_NG_SWITCH(call, SHMKV_ATT_I8) break;                      \
    case SHMKV_ATT_E4M3: SHMKV_NG_SWITCH(call, SHMKV_ATT_E4M3) break;                  \
    default: SHMKV_NG_SWITCH(call, SHMKV_ATT_F32) break;                               \
    }

static void FN(scores)(const float *q, uint32_t ng, const uint8_t *const *krow, uint32_t nt,
                       uint32_t d, int dt, float *s, const uint8_t *const *pf, uint32_t npf,
                       const float *ksc) {
#define SHMKV_SC(DT, NG) FN(scores_k)(q, krow, nt, d, s, DT, NG, pf, npf, ksc)
    SHMKV_DT_SWITCH(SHMKV_SC)
#undef SHMKV_SC
}

static void FN(vacc)(float *acc, uint32_t ng, const float *alpha, const float *p,
                     const uint8_t *const *vrow, uint32_t nt, uint32_t d, int dt,
                     const uint8_t *const *pf, uint32_t npf, const float *vsc) {
    float ps[4 * TILE];
    if (SHMKV_QUANT(dt)) {                      /* sum_j p_j (s_j v_j) = sum_j (p_j s_j) v_j */
        /* p and vsc are 0 past nt (masked keys; see the item): one vector multiply per g */
        for (uint32_t g = 0; g < ng; g++)
            for (uint32_t j = 0; j < TILE; j++) ps[g * TILE + j] = p[g * TILE + j] * vsc[j];
        p = ps;
    }
#define SHMKV_VA(DT, NG) FN(vacc_k)(acc, alpha, p, vrow, nt, d, DT, NG, pf, npf)
    SHMKV_DT_SWITCH(SHMKV_VA)
#undef SHMKV_VA
}

/* ---- one work item -------------------------------------------------------------------- */
/* The item's query vectors are grouped by kv head: v = (h * nrows + r) * G + g.  Per tile of
 * TILE keys, every kv head is done in turn, so the item walks the pools in address order
 * (one block's K rows for all heads are contiguous).  acc [nqv][d] is followed by m [nqv]
 * and l [nqv].  Returns 0, or -1 on a corrupt block id. */
SHMKV_AI int FN(att_item_body)(const shmkv_attn_args_t *a, const shmkv_item_t *it, float *qf,
                               float *acc, uint32_t nqv, const int bf) {
    const uint32_t d = a->d, G = a->hq / a->hkv, nqh = it->nrows * G;
    const int dt = a->kv_dtype;
    float *m = acc + (size_t)nqv * d, *l = m + nqv;
    const uint32_t L = a->seq_lens[it->seq], ql = a->q_lens[it->seq];
    const uint32_t first = L - ql + it->row0;          /* position of the item's first row */
    const int32_t *table = a->tables[it->seq];
    const size_t esz = SHMKV_ESZ(dt);
    const size_t tok = (size_t)a->hkv * d * esz, hstride = (size_t)d * esz;
    const uint8_t *kb[2][TILE], *vb[2][TILE], *krow[TILE], *vrow[TILE], *pk[TILE], *pv[TILE];
    float s[4 * TILE], alpha[4];
    size_t slot[2][TILE];                      /* int8: the tile's slots, for the scales */
    float ksc[TILE], vsc[TILE];                /* quantized: this head's scales of the tile */
    memset(acc, 0, (size_t)nqv * d * sizeof(float));
    for (uint32_t v = 0; v < nqv; v++) { m[v] = -INFINITY; l[v] = 0; }
    /* the row addresses of tile ts into kb[w], vb[w]; block ids read once and checked */
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
        const uint8_t *const *kbase = kb[w], *const *vbase = vb[w];
        for (uint32_t h = 0; h < a->hkv; h++) {
            for (uint32_t j = 0; j < nt; j++) {
                krow[j] = kbase[j] + h * hstride;
                vrow[j] = vbase[j] + h * hstride;
            }
            if (dt == SHMKV_ATT_I8) {
                for (uint32_t j = 0; j < nt; j++) {
                    ksc[j] = a->kscale[slot[w][j] * a->hkv + h];
                    vsc[j] = a->vscale[slot[w][j] * a->hkv + h];
                }
            } else if (dt == SHMKV_ATT_E4M3) {
                /* the loads read codes / 2^8 (see SHMKV_E4M3_F16_BITS) */
                const float kh = a->khead[h] * SHMKV_E4M3_UNIT, vh = a->vhead[h] * SHMKV_E4M3_UNIT;
                for (uint32_t j = 0; j < nt; j++) { ksc[j] = kh; vsc[j] = vh; }
            }
            if (SHMKV_QUANT(dt))                 /* past the tile's keys: 0 (vacc's multiply) */
                for (uint32_t j = nt; j < TILE; j++) ksc[j] = vsc[j] = 0.0f;
            /* the next tile's rows of this head are prefetched a tile ahead, spread over
             * the score and V loops of the first query group: the rows of one head are
             * hstride bytes every tok bytes, a stride the hardware prefetchers miss */
            for (uint32_t j = 0; j < nn; j++) {
                pk[j] = kb[w ^ 1][j] + h * hstride;
                pv[j] = vb[w ^ 1][j] + h * hstride;
            }
            uint32_t npf = nn;
            for (uint32_t q0 = 0; q0 < nqh; q0 += 4) {
                const uint32_t ng = nqh - q0 < 4 ? nqh - q0 : 4, v0 = h * nqh + q0;
                /* a tile wholly past every row's last key is skipped */
                if (first + (q0 + ng - 1) / G + 1 <= ts) continue;
                FN(scores)(qf + (size_t)v0 * d, ng, krow, nt, d, dt, s, pk, npf, ksc);
                int any = 0;
                for (uint32_t g = 0; g < ng; g++) {
                    const uint32_t v = v0 + g, lim = first + (q0 + g) / G + 1;
                    float *sg = s + g * TILE, mt = -INFINITY;
                    if (nt == TILE && ts + TILE <= lim) {
                        mt = FN(vmax16)(sg);            /* the whole tile is visible */
                        if (mt != mt) mt = -INFINITY;   /* NaN scores: nothing sensible */
                    } else {
                        for (uint32_t j = 0; j < TILE; j++) {
                            if (j >= nt || ts + j >= lim) sg[j] = -INFINITY;
                            else if (sg[j] > mt) mt = sg[j];
                        }
                    }
                    if (mt == -INFINITY) {                 /* nothing visible (or NaN) */
                        alpha[g] = 1.0f;
                        for (uint32_t j = 0; j < TILE; j++) sg[j] = 0.0f;
                        continue;
                    }
                    const float mn = m[v] > mt ? m[v] : mt;
                    alpha[g] = m[v] == -INFINITY ? 0.0f : m[v] == mn ? 1.0f : expf(m[v] - mn);
                    if (bf) {                                   /* weights rounded to bf16 */
                        FN(vexpsub)(sg, mn);
                        l[v] = l[v] * alpha[g] + FN(round_tile)(sg);
                    } else {
                        l[v] = l[v] * alpha[g] + FN(vexpsub)(sg, mn);
                    }
                    m[v] = mn;
                    any = 1;
                }
                if (any) FN(vacc)(acc + (size_t)v0 * d, ng, alpha, s, vrow, nt, d, dt, pv, npf, vsc);
                else
                    for (uint32_t j = 0; j < npf; j++) shmkv_att_prefetch(pv[j], hstride);
                npf = 0;
            }
        }
    }
    return 0;
#undef SHMKV_TILE_ROWS
}
/* the item, compiled twice: the default (bf a constant 0: the code as it was, bit for bit)
 * and the opt-in bf16 mode's (the weights rounded) */
static int FN(shmkv_att_item)(const shmkv_attn_args_t *a, const shmkv_item_t *it, float *qf,
                              float *acc, uint32_t nqv) {
    return a->precision == SHMKV_PREC_BF16 ? FN(att_item_body)(a, it, qf, acc, nqv, 1)
                                           : FN(att_item_body)(a, it, qf, acc, nqv, 0);
}

#include "attention_gemm.h"

#undef FN
#undef SHMKV_NG_SWITCH
#undef SHMKV_DT_SWITCH
#undef VZERO
#undef VSET1
#undef VLOADF
#undef VSTOREF
#undef VFMA
#undef VMUL
#undef VHSUM
#undef VLIVE
#undef VPOW2I
#undef VROUNDN
#undef VFNMA
#undef VMAX
#undef VMIN
#undef VSUB
#undef VADD
#undef KB
#undef CC
