/*
 * kernels/attention_gemm.h -- prefill rows on FMAs, shaped as two small GEMMs per step.
 * Included by attention_isa.h in its vector passes (AVX2 and AVX-512), after
 * the vector vocabulary (VEC, W, VFMA, ...); owns nothing, reads pool rows and writes the
 * caller's scratch like the row path.
 *
 * The row path (attention_isa.h) takes 4 query vectors at a time and reduces each q.k dot
 * product across the lanes of d: a horizontal sum per score, and the K/V tile re-read per
 * 4 query vectors.  Here the lanes are query vectors instead, as on the AMX tiles
 * (attention_amx.h), and every product is a full-width FMA:
 *   S^T [32 keys][GQB q] = K [32][d] . Q^T     (Q^T packed once per head and block of GQB
 *                                              query vectors; each K element broadcast
 *                                              from a contiguous float32 copy of the
 *                                              step; GKB keys x GNV vectors of
 *                                              accumulators)
 *   online softmax down the columns: one vector op per key for W query vectors at once;
 *   the causal mask only on a step that crosses a row's last key
 *   O [GQB q][d] += P [GQB][32] . V [32][d]   (each probability broadcast, V rows loaded
 *                                              once per GRB query vectors, O rescaled as
 *                                              it is loaded into registers)
 * Scores are in log2 units (q times log2(e)): the softmax is 2^x; m goes out in e units.
 * fp32 throughout: the result contract is the row path's (float64 reference, fp32 error).
 */
#if SHMKV_ISA_PASS > 0

#undef GNV
#undef GKB
#undef GRB
#undef GCC
#undef GQB
#undef VI
#undef VLOADI
#undef VSET1I
#undef VMASKLT
#undef GEXP2_MIN
/* Register blocking, sized to the register file (32 zmm / 16 ymm):
 *   S^T: GKB keys x GNV vectors of query lanes (AVX-512: 8 x 2 = 16 accumulators, per
 *        element of d 2 loads + 8 broadcasts for 16 FMAs; AVX2: 6 x 2 = 12 of 16 ymm);
 *   O:   GRB query vectors x GCC vectors of d (AVX-512: 4 x 4 = 16, per key 4 V loads + 4
 *        broadcasts for 16 FMAs; AVX2: 2 x 4 = 8, no embedded broadcast there). */
#if SHMKV_ISA_PASS == 2
#define GNV 2
#define GKB 8
#define GRB 4
#define GCC 4
#define VI __m512i
#define VLOADI(p) _mm512_loadu_si512((const void *)(p))
#define VSET1I(x) _mm512_set1_epi32(x)
/* s where t < lim (lane by lane), else -inf */
#define VMASKLT(s, tv, limv) _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY),              \
    _mm512_cmpgt_epi32_mask((limv), (tv)), (s))
#else
#define GNV 2
#define GKB 6
#define GRB 2
#define GCC 4
#define VI __m256i
#define VLOADI(p) _mm256_loadu_si256((const __m256i *)(p))
#define VSET1I(x) _mm256_set1_epi32(x)
#define VMASKLT(s, tv, limv) _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), (s),            \
    _mm256_castsi256_ps(_mm256_cmpgt_epi32((limv), (tv))))
#endif
#define GQB (GNV * W)                   /* query lanes per block */

/* 2^x for x <= 12 (the column max is subtracted; the AMX item, which calls the AVX-512
 * pass's copy, lets a score pass it by SHMKV_AMX_SLACK2): 2^r on [-1/2, 1/2] by its
 * degree-6 Taylor polynomial (error ~1e-7), times 2^n.  Exactly 0 where x <= -100 (and
 * -inf): 2^-100 of the max is far below fp32's precision of the sum, and a weight near
 * 2^-126 is a denormal, whose every product takes a microcode assist (a softmax with
 * scores spread ~16 had ~2% of them there and ran 2.5-4x slower) */
#define GEXP2_MIN (-100.0f)
SHMKV_AI VEC FN(gexp2)(VEC x0) {
    const VEC x = VMAX(x0, VSET1(-127.0f));
    const VEC n = VROUNDN(x);
    const VEC r = VSUB(x, n);
    VEC p = VSET1(1.5403530393e-4f);
    p = VFMA(p, r, VSET1(1.3333558146e-3f));
    p = VFMA(p, r, VSET1(9.6181291076e-3f));
    p = VFMA(p, r, VSET1(5.5504108665e-2f));
    p = VFMA(p, r, VSET1(2.4022650696e-1f));
    p = VFMA(p, r, VSET1(6.9314718056e-1f));
    p = VFMA(p, r, VSET1(1.0f));
    /* NaN stays NaN (its row's result is NaN, the other rows' untouched) */
#if SHMKV_ISA_PASS == 2
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x0, _mm512_set1_ps(GEXP2_MIN), _CMP_NLE_UQ),
                                  p, n);
#else
    return _mm256_and_ps(_mm256_cmp_ps(x0, _mm256_set1_ps(GEXP2_MIN), _CMP_NLE_UQ),
                         VMUL(p, VPOW2I(n)));
#endif
}

/* S^T rows [KBN keys][GQB lanes] = k[i] . Q^T over d (qt: this block's [d][GQB]) */
SHMKV_AI void FN(g_qk)(const float *qt, const float *const *kr, uint32_t d, float *st,
                       const int KBN) {
    VEC c[GKB][GNV];
#pragma GCC unroll 16
    for (int i = 0; i < KBN; i++)
#pragma GCC unroll 16
        for (int n = 0; n < GNV; n++) c[i][n] = VZERO();
    for (uint32_t x = 0; x < d; x++) {
        VEC q[GNV];
#pragma GCC unroll 16
        for (int n = 0; n < GNV; n++) q[n] = VLOADF(qt + (size_t)x * GQB + n * W);
#pragma GCC unroll 16
        for (int i = 0; i < KBN; i++) {
            const VEC k = VSET1(kr[i][x]);
#pragma GCC unroll 16
            for (int n = 0; n < GNV; n++) c[i][n] = VFMA(k, q[n], c[i][n]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < KBN; i++)
#pragma GCC unroll 16
        for (int n = 0; n < GNV; n++) VSTOREF(st + (size_t)i * GQB + n * W, c[i][n]);
}

/* O rows [RBN][c0, c0 + CCN W) = O * alpha + sum_j P^T[j][row] v[j][c0 ...) */
SHMKV_AI void FN(g_pv)(float *o, const float *alpha, const float *pt, const float *const *vr,
                       uint32_t nt, uint32_t d, uint32_t c0, const int RBN, const int CCN) {
    VEC acc[GRB][GCC];
#pragma GCC unroll 16
    for (int g = 0; g < RBN; g++) {
        const VEC al = VSET1(alpha[g]);
#pragma GCC unroll 16
        for (int i = 0; i < CCN; i++)
            acc[g][i] = VMUL(VLOADF(o + (size_t)g * d + c0 + i * W), al);
    }
    for (uint32_t j = 0; j < nt; j++) {
        VEC v[GCC];
#pragma GCC unroll 16
        for (int i = 0; i < CCN; i++) v[i] = VLOADF(vr[j] + c0 + i * W);
#pragma GCC unroll 16
        for (int g = 0; g < RBN; g++) {
            const VEC p = VSET1(pt[(size_t)j * GQB + g]);
#pragma GCC unroll 16
            for (int i = 0; i < CCN; i++) acc[g][i] = VFMA(p, v[i], acc[g][i]);
        }
    }
#pragma GCC unroll 16
    for (int g = 0; g < RBN; g++)
#pragma GCC unroll 16
        for (int i = 0; i < CCN; i++) VSTOREF(o + (size_t)g * d + c0 + i * W, acc[g][i]);
}

/* O += P V for query vectors [q, q + rbn) of a block, every column of d */
SHMKV_AI void FN(g_pv_rows)(float *o, const float *alpha, const float *pt,
                            const float *const *vr, uint32_t nt, uint32_t d, const int RBN) {
    uint32_t c = 0;
    for (; c + GCC * W <= d; c += GCC * W) FN(g_pv)(o, alpha, pt, vr, nt, d, c, RBN, GCC);
    for (; c < d; c += W) FN(g_pv)(o, alpha, pt, vr, nt, d, c, RBN, 1);
}

#define SHMKV_GTK 32                    /* keys per step */

/* Scratch floats the GEMM item needs beyond the row item's, for nqh query vectors per head. */
static size_t FN(shmkv_gemm_scratch)(uint32_t nqh, uint32_t d) {
    const size_t nq = ((size_t)nqh + GQB - 1) / GQB * GQB;
    return 2 * nq * d                   /* Q^T (blocked), O */
         + 2 * SHMKV_GTK * (size_t)d    /* K, V of a step converted to float32 */
         + SHMKV_GTK * GQB              /* S^T, then P^T */
         + 4 * nq + 64;                 /* m, l, alpha, lim */
}

/* The prefill item on FMAs.  Same contract as shmkv_att_item_*: acc [nqv][d], then m [nqv],
 * l [nqv]; xs is FN(shmkv_gemm_scratch) floats, 64-byte aligned.  0, or -1 on a corrupt
 * block id. */
static int FN(shmkv_att_item_gemm)(const shmkv_attn_args_t *a, const shmkv_item_t *it,
                                   float *qf, float *acc, uint32_t nqv, float *xs) {
    const uint32_t d = a->d, G = a->hq / a->hkv, nqh = it->nrows * G;
    const uint32_t nqb = (nqh + GQB - 1) / GQB, nq = nqb * GQB;
    const int dt = a->kv_dtype;
    const size_t esz = SHMKV_ESZ(dt);
    const size_t tok = (size_t)a->hkv * d * esz, hstride = (size_t)d * esz;
    float *m_out = acc + (size_t)nqv * d, *l_out = m_out + nqv;
    const uint32_t L = a->seq_lens[it->seq], ql = a->q_lens[it->seq];
    const uint32_t first = L - ql + it->row0;          /* position of the item's first row */
    const uint32_t tend = first + it->nrows;            /* keys the last row sees */
    const int32_t *table = a->tables[it->seq];
    float *qt = xs, *O = qt + (size_t)nq * d;
    float *kc = O + (size_t)nq * d, *vc = kc + (size_t)SHMKV_GTK * d;
    float *st = vc + (size_t)SHMKV_GTK * d;
    float *m = st + SHMKV_GTK * GQB, *l = m + nq, *alpha = l + nq;
    int32_t *lim = (int32_t *)(alpha + nq);
    const float *krow[SHMKV_GTK], *vrow[SHMKV_GTK];
    size_t slot[2][SHMKV_GTK];
    const float lg2e = 1.44269504088896f;
    const int bf = a->precision == SHMKV_PREC_BF16;

    for (uint32_t v = 0; v < nq; v++) {
        const uint32_t r = v < nqh ? v / G : it->nrows - 1;   /* padding: the last row */
        lim[v] = (int32_t)(first + r + 1);
    }
    const uint32_t tlast = it->t1 < tend ? it->t1 : tend;  /* keys past it: no row sees */
    for (uint32_t h = 0; h < a->hkv; h++) {
        /* Q^T of this head, blocked [nqb][d][GQB], padding lanes 0 */
        for (uint32_t b = 0; b < nqb; b++)
            for (uint32_t c = 0; c < GQB; c++) {
                const uint32_t v = b * GQB + c;
                float *dst = qt + (size_t)b * d * GQB + c;
                if (v >= nqh) {
                    for (uint32_t x = 0; x < d; x++) dst[(size_t)x * GQB] = 0.0f;
                    continue;
                }
                const float *q = qf + ((size_t)h * nqh + v) * d;
                if (bf)     /* the opt-in bf16 mode: q as rounded (load_q); log2(e) on S */
                    for (uint32_t x = 0; x < d; x++) dst[(size_t)x * GQB] = q[x];
                else
                    for (uint32_t x = 0; x < d; x++) dst[(size_t)x * GQB] = q[x] * lg2e;
            }
        for (uint32_t v = 0; v < nq; v++) { m[v] = -INFINITY; l[v] = 0; }
        memset(O, 0, (size_t)nq * d * sizeof(float));
        int w = 0;
        /* the slots of a step into slot[w]; block ids read once and checked */
        if (it->t0 < tlast &&
            shmkv_att_slots(a, table, it->t0, tlast - it->t0 < SHMKV_GTK ? tlast - it->t0 : SHMKV_GTK,
                            slot[0]))
            return -1;
        for (uint32_t ts = it->t0; ts < tlast; ts += SHMKV_GTK, w ^= 1) {
            const uint32_t nt = tlast - ts < SHMKV_GTK ? tlast - ts : SHMKV_GTK;
            const uint32_t tn = ts + SHMKV_GTK;
            const uint32_t nn = tn >= tlast ? 0 : (tlast - tn < SHMKV_GTK ? tlast - tn : SHMKV_GTK);
            if (nn && shmkv_att_slots(a, table, tn, nn, slot[w ^ 1])) return -1;
            /* the step's rows as contiguous float32 (converted; quantized: times their
             * scale).  float32 is copied too: one head's rows in the pool are tok bytes
             * apart, so a step's rows share their L1 sets and each sits on its own page;
             * the copy is read by every block of query vectors */
            for (uint32_t j = 0; j < nt; j++) {
                const uint8_t *kp = a->kpool + slot[w][j] * tok + h * hstride;
                const uint8_t *vp = a->vpool + slot[w][j] * tok + h * hstride;
                float ks = 1.0f, vs = 1.0f;
                if (dt == SHMKV_ATT_I8) {
                    ks = a->kscale[slot[w][j] * a->hkv + h];
                    vs = a->vscale[slot[w][j] * a->hkv + h];
                } else if (dt == SHMKV_ATT_E4M3) {
                    ks = a->khead[h] * SHMKV_E4M3_UNIT;
                    vs = a->vhead[h] * SHMKV_E4M3_UNIT;
                }
                float *kd = kc + (size_t)j * d, *vd = vc + (size_t)j * d;
                const VEC ksv = VSET1(ks), vsv = VSET1(vs);
                for (uint32_t x = 0; x < d; x += W) {
                    VSTOREF(kd + x, VMUL(FN(vld)(kp + x * esz, dt), ksv));
                    VSTOREF(vd + x, VMUL(FN(vld)(vp + x * esz, dt), vsv));
                }
                krow[j] = kd;
                vrow[j] = vd;
            }
            for (uint32_t b = 0; b < nqb; b++) {
                const uint32_t q0 = b * GQB;
                /* the next step's rows of this head into the cache, a share per block:
                 * spread (a burst of prefetches stalls the core once its miss buffers are
                 * full), and nothing else brings them in (one head's rows are hstride
                 * bytes every tok bytes, a stride the hardware prefetchers miss) */
                for (uint32_t j = b * nn / nqb; j < (b + 1) * nn / nqb; j++) {
                    shmkv_att_prefetch(a->kpool + slot[w ^ 1][j] * tok + h * hstride, hstride);
                    shmkv_att_prefetch(a->vpool + slot[w ^ 1][j] * tok + h * hstride, hstride);
                }
                const uint32_t qe = nqh - q0 < GQB ? nqh - q0 : GQB;     /* real lanes */
                const int32_t lo_lim = lim[q0], hi_lim = lim[q0 + qe - 1];
                if ((int64_t)ts >= hi_lim) continue;        /* past every row's last key */
                const float *qb = qt + (size_t)b * d * GQB;
                uint32_t j = 0;
                for (; j + GKB <= nt; j += GKB) FN(g_qk)(qb, krow + j, d, st + (size_t)j * GQB, GKB);
                for (; j < nt; j++) FN(g_qk)(qb, krow + j, d, st + (size_t)j * GQB, 1);
                /* online softmax down the columns, W query vectors per vector op */
                const int full = (int64_t)ts + nt <= lo_lim;
                for (int n = 0; n < GNV; n++) {
                    const uint32_t c0 = q0 + n * W;
                    const VI limv = VLOADI(lim + c0);
                    VEC mt = VSET1(-INFINITY);
                    for (uint32_t jj = 0; jj < nt; jj++) {
                        VEC s = VLOADF(st + (size_t)jj * GQB + n * W);
                        if (bf) s = VMUL(s, VSET1(lg2e));
                        if (!full) s = VMASKLT(s, VSET1I((int)(ts + jj)), limv);
                        if (!full || bf) VSTOREF(st + (size_t)jj * GQB + n * W, s);
                        mt = VMAX(mt, s);
                    }
                    const VEC mo = VLOADF(m + c0), mn = VMAX(mt, mo);
                    /* a column with nothing visible yet subtracts 0 (-inf - -inf is NaN) */
                    const VEC mu = VLIVE(mn, mn);
                    VEC sum = VZERO();
                    for (uint32_t jj = 0; jj < nt; jj++) {
                        VEC p = FN(gexp2)(VSUB(VLOADF(st + (size_t)jj * GQB + n * W), mu));
                        if (bf) p = FN(rbf)(p);
                        VSTOREF(st + (size_t)jj * GQB + n * W, p);
                        sum = VADD(sum, p);
                    }
                    const VEC al = FN(gexp2)(VSUB(mo, mu));
                    VSTOREF(alpha + c0, al);
                    VSTOREF(l + c0, VFMA(VLOADF(l + c0), al, sum));
                    VSTOREF(m + c0, mn);
                }
                /* O rows of the block's real lanes += P V, rescaled by alpha on the way */
                uint32_t q = 0;
                for (; q + GRB <= qe; q += GRB)
                    FN(g_pv_rows)(O + (size_t)(q0 + q) * d, alpha + q0 + q, st + q, vrow, nt, d, GRB);
                for (; q < qe; q++)
                    FN(g_pv_rows)(O + (size_t)(q0 + q) * d, alpha + q0 + q, st + q, vrow, nt, d, 1);
            }
        }
        for (uint32_t v = 0; v < nqh; v++) {                /* this head's vectors out */
            memcpy(acc + ((size_t)h * nqh + v) * d, O + (size_t)v * d, d * sizeof(float));
            m_out[h * nqh + v] = m[v] * 0.69314718055994531f;   /* back to e units */
            l_out[h * nqh + v] = l[v];
        }
    }
    return 0;
}

#undef VI
#undef VLOADI
#undef VSET1I
#undef VMASKLT
#endif
