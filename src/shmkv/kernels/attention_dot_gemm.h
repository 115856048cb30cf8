/*
 * kernels/attention_dot_gemm.h -- the opt-in bf16 mode's prefill item on vdpbf16ps (bfloat16
 * pools); a part of attention.c, included after attention_dot.h, whose vocabulary
 * (SHMKV_DOT_TGT, shmkv_dot_ilv) and the AVX-512 pass's helpers it uses.
 */
#if SHMKV_HAVE_X86

/* ---- the prefill (GEMM) item on vdpbf16ps, bfloat16 pools ------------------------------
 * As attention_gemm.h's FMA item (its comment has the shape), with bf16 pairs:
 *   S^T [keys][32 q] = K . Q^T: Q^T packed [d/2][32] as pairs of d, each K pair (the pool's
 *   own two bf16) broadcast as one 32-bit value: 8 keys x 2 vectors of accumulators;
 *   O [q][d] += P . V: V packed once per step as pairs of keys [16][d] (vpermt2w), P^T as
 *   pairs of keys [16][32], each pair broadcast: 4 query vectors x 4 vectors of d. */
#define SHMKV_DG_QB 32                  /* query lanes per block (2 vectors) */
#define SHMKV_DG_KB 8                   /* keys per S^T register block */

SHMKV_DOT_AI void shmkv_dg_qk(const uint32_t *qt, const uint16_t *kc, uint32_t d, float *st,
                              const int KBN) {
    __m512 c[SHMKV_DG_KB][2];
#pragma GCC unroll 8
    for (int i = 0; i < KBN; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
    for (uint32_t x = 0; x < d / 2; x++) {
        const __m512i q0 = _mm512_loadu_si512(qt + (size_t)x * SHMKV_DG_QB);
        const __m512i q1 = _mm512_loadu_si512(qt + (size_t)x * SHMKV_DG_QB + 16);
#pragma GCC unroll 8
        for (int i = 0; i < KBN; i++) {
            int kp;
            memcpy(&kp, kc + (size_t)i * d + 2 * x, 4);
            const __m512i k = _mm512_set1_epi32(kp);
            c[i][0] = _mm512_dpbf16_ps(c[i][0], (__m512bh)q0, (__m512bh)k);
            c[i][1] = _mm512_dpbf16_ps(c[i][1], (__m512bh)q1, (__m512bh)k);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < KBN; i++) {
        _mm512_storeu_ps(st + (size_t)i * SHMKV_DG_QB, c[i][0]);
        _mm512_storeu_ps(st + (size_t)i * SHMKV_DG_QB + 16, c[i][1]);
    }
}

/* O rows [RBN][c0, c0 + 16 CCN) = O * alpha + sum over key pairs of P pair . V pair */
SHMKV_DOT_AI void shmkv_dg_pv(float *o, const float *alpha, const uint32_t *pt, const uint32_t *vc,
                              uint32_t npair, uint32_t d, uint32_t c0, const int RBN, const int CCN) {
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int g = 0; g < RBN; g++) {
        const __m512 al = _mm512_set1_ps(alpha[g]);
#pragma GCC unroll 4
        for (int i = 0; i < CCN; i++)
            acc[g][i] = _mm512_mul_ps(_mm512_loadu_ps(o + (size_t)g * d + c0 + 16 * i), al);
    }
    for (uint32_t jp = 0; jp < npair; jp++) {
        __m512i v[4];
#pragma GCC unroll 4
        for (int i = 0; i < CCN; i++) v[i] = _mm512_loadu_si512(vc + (size_t)jp * d + c0 + 16 * i);
#pragma GCC unroll 4
        for (int g = 0; g < RBN; g++) {
            const __m512i p = _mm512_set1_epi32((int)pt[(size_t)jp * SHMKV_DG_QB + g]);
#pragma GCC unroll 4
            for (int i = 0; i < CCN; i++)
                acc[g][i] = _mm512_dpbf16_ps(acc[g][i], (__m512bh)v[i], (__m512bh)p);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < RBN; g++)
#pragma GCC unroll 4
        for (int i = 0; i < CCN; i++) _mm512_storeu_ps(o + (size_t)g * d + c0 + 16 * i, acc[g][i]);
}

SHMKV_DOT_AI void shmkv_dg_pv_rows(float *o, const float *alpha, const uint32_t *pt,
                                   const uint32_t *vc, uint32_t npair, uint32_t d, const int RBN) {
    uint32_t c = 0;
    for (; c + 64 <= d; c += 64) shmkv_dg_pv(o, alpha, pt, vc, npair, d, c, RBN, 4);
    for (; c < d; c += 32) shmkv_dg_pv(o, alpha, pt, vc, npair, d, c, RBN, 2);
}

/* Scratch floats of the GEMM dot item, for nqh query vectors per head. */
static size_t shmkv_dg_scratch(uint32_t nqh, uint32_t d) {
    const size_t nq = ((size_t)nqh + SHMKV_DG_QB - 1) / SHMKV_DG_QB * SHMKV_DG_QB;
    return nq * d / 2 + nq * d                /* Q^T in pairs, O */
         + SHMKV_GTK * (size_t)d / 2          /* K rows of a step, bf16, contiguous */
         + SHMKV_GTK / 2 * (size_t)d          /* V of a step in pairs of keys */
         + SHMKV_GTK * SHMKV_DG_QB            /* S^T, then P^T */
         + SHMKV_GTK / 2 * SHMKV_DG_QB        /* P^T in pairs of keys */
         + 4 * nq + 64;                       /* m, l, alpha, lim */
}

/* The prefill item for bfloat16 pools on vdpbf16ps (d a multiple of 32); the contract of
 * shmkv_att_item_gemm_*, xs shmkv_dg_scratch floats, 64-byte aligned.  qf: q times the
 * scale, rounded to bf16 (load_q); the scores are taken to log2 units (times log2(e)). */
SHMKV_DOT_TGT static int shmkv_att_item_gemm_dpbf16(const shmkv_attn_args_t *a, const shmkv_item_t *it,
                                                    float *qf, float *acc, uint32_t nqv, float *xs) {
    const uint32_t d = a->d, G = a->hq / a->hkv, nqh = it->nrows * G;
    const uint32_t nqb = (nqh + SHMKV_DG_QB - 1) / SHMKV_DG_QB, nq = nqb * SHMKV_DG_QB;
    const size_t tok = (size_t)a->hkv * d * 2, hstride = (size_t)d * 2;
    float *m_out = acc + (size_t)nqv * d, *l_out = m_out + nqv;
    const uint32_t L = a->seq_lens[it->seq], ql = a->q_lens[it->seq];
    const uint32_t first = L - ql + it->row0, tend = first + it->nrows;
    const int32_t *table = a->tables[it->seq];
    uint32_t *qt = (uint32_t *)xs;
    float *O = xs + (size_t)nq * d / 2;
    uint16_t *kc = (uint16_t *)(O + (size_t)nq * d);
    uint32_t *vc = (uint32_t *)(kc + (size_t)SHMKV_GTK * d);
    float *st = (float *)(vc + (size_t)SHMKV_GTK / 2 * d);
    uint32_t *pt = (uint32_t *)(st + SHMKV_GTK * SHMKV_DG_QB);
    float *m = (float *)(pt + SHMKV_GTK / 2 * SHMKV_DG_QB), *l = m + nq, *alpha = l + nq;
    int32_t *lim = (int32_t *)(alpha + nq);
    size_t slot[2][SHMKV_GTK];
    const float lg2e = 1.44269504088896f;
    const __m512i ilo = _mm512_loadu_si512(shmkv_dot_ilv[0]), ihi = _mm512_loadu_si512(shmkv_dot_ilv[1]);

    for (uint32_t v = 0; v < nq; v++) {
        const uint32_t r = v < nqh ? v / G : it->nrows - 1;
        lim[v] = (int32_t)(first + r + 1);
    }
    const uint32_t tlast = it->t1 < tend ? it->t1 : tend;
    for (uint32_t h = 0; h < a->hkv; h++) {
        /* Q^T of this head in pairs of d, [nqb][d / 2][32], padding lanes 0 */
        for (uint32_t b = 0; b < nqb; b++)
            for (uint32_t c = 0; c < SHMKV_DG_QB; c++) {
                const uint32_t v = b * SHMKV_DG_QB + c;
                uint32_t *dst = qt + (size_t)b * d / 2 * SHMKV_DG_QB + c;
                const float *q = qf + ((size_t)h * nqh + (v < nqh ? v : 0)) * d;
                for (uint32_t x = 0; x < d / 2; x++) {
                    uint32_t lo = 0, hi = 0;
                    if (v < nqh) {                  /* exact: q is bf16 already */
                        memcpy(&lo, q + 2 * x, 4);
                        memcpy(&hi, q + 2 * x + 1, 4);
                    }
                    dst[(size_t)x * SHMKV_DG_QB] = (hi & 0xffff0000u) | (lo >> 16);
                }
            }
        for (uint32_t v = 0; v < nq; v++) { m[v] = -INFINITY; l[v] = 0; }
        memset(O, 0, (size_t)nq * d * sizeof(float));
        int w = 0;
        if (it->t0 < tlast &&
            shmkv_att_slots(a, table, it->t0, tlast - it->t0 < SHMKV_GTK ? tlast - it->t0 : SHMKV_GTK,
                            slot[0]))
            return -1;
        for (uint32_t ts = it->t0; ts < tlast; ts += SHMKV_GTK, w ^= 1) {
            const uint32_t nt = tlast - ts < SHMKV_GTK ? tlast - ts : SHMKV_GTK;
            const uint32_t tn = ts + SHMKV_GTK;
            const uint32_t nn = tn >= tlast ? 0 : (tlast - tn < SHMKV_GTK ? tlast - tn : SHMKV_GTK);
            const uint32_t npair = (nt + 1) / 2;
            if (nn && shmkv_att_slots(a, table, tn, nn, slot[w ^ 1])) return -1;
            /* the step's K rows contiguous; V in pairs of keys (an odd last key: a zero row) */
            for (uint32_t j = 0; j < nt; j++)
                memcpy(kc + (size_t)j * d, a->kpool + slot[w][j] * tok + h * hstride, hstride);
            for (uint32_t jp = 0; jp < npair; jp++) {
                const uint8_t *v0 = a->vpool + slot[w][2 * jp] * tok + h * hstride;
                const uint8_t *v1 = 2 * jp + 1 < nt ? a->vpool + slot[w][2 * jp + 1] * tok + h * hstride
                                                    : NULL;
                for (uint32_t c = 0; c < d; c += 32) {
                    const __m512i x = _mm512_loadu_si512(v0 + 2 * (size_t)c);
                    const __m512i y = v1 ? _mm512_loadu_si512(v1 + 2 * (size_t)c) : _mm512_setzero_si512();
                    _mm512_storeu_si512(vc + (size_t)jp * d + c, _mm512_permutex2var_epi16(x, ilo, y));
                    _mm512_storeu_si512(vc + (size_t)jp * d + c + 16, _mm512_permutex2var_epi16(x, ihi, y));
                }
            }
            for (uint32_t j = 0; j < nn; j++) {     /* the next step's rows of this head */
                shmkv_att_prefetch(a->kpool + slot[w ^ 1][j] * tok + h * hstride, hstride);
                shmkv_att_prefetch(a->vpool + slot[w ^ 1][j] * tok + h * hstride, hstride);
            }
            for (uint32_t b = 0; b < nqb; b++) {
                const uint32_t q0 = b * SHMKV_DG_QB;
                const uint32_t qe = nqh - q0 < SHMKV_DG_QB ? nqh - q0 : SHMKV_DG_QB;
                const int32_t lo_lim = lim[q0], hi_lim = lim[q0 + qe - 1];
                if ((int64_t)ts >= hi_lim) continue;
                const uint32_t *qb = qt + (size_t)b * d / 2 * SHMKV_DG_QB;
                uint32_t j = 0;
                for (; j + SHMKV_DG_KB <= nt; j += SHMKV_DG_KB)
                    shmkv_dg_qk(qb, kc + (size_t)j * d, d, st + (size_t)j * SHMKV_DG_QB, SHMKV_DG_KB);
                for (; j < nt; j++) shmkv_dg_qk(qb, kc + (size_t)j * d, d, st + (size_t)j * SHMKV_DG_QB, 1);
                const int full = (int64_t)ts + nt <= lo_lim;
                for (int n = 0; n < 2; n++) {
                    const uint32_t c0 = q0 + n * 16;
                    const __m512i limv = _mm512_loadu_si512(lim + c0);
                    __m512 mt = _mm512_set1_ps(-INFINITY);
                    for (uint32_t jj = 0; jj < nt; jj++) {
                        __m512 sv = _mm512_mul_ps(_mm512_loadu_ps(st + (size_t)jj * SHMKV_DG_QB + n * 16),
                                                  _mm512_set1_ps(lg2e));     /* log2 units */
                        if (!full)
                            sv = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY),
                                _mm512_cmpgt_epi32_mask(limv, _mm512_set1_epi32((int)(ts + jj))), sv);
                        _mm512_storeu_ps(st + (size_t)jj * SHMKV_DG_QB + n * 16, sv);
                        mt = _mm512_max_ps(mt, sv);
                    }
                    const __m512 mo = _mm512_loadu_ps(m + c0), mn = _mm512_max_ps(mt, mo);
                    const __m512 mu = _mm512_maskz_mov_ps(
                        _mm512_cmp_ps_mask(mn, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ), mn);
                    __m512 sum = _mm512_setzero_ps();
                    for (uint32_t jj = 0; jj < nt; jj++) {
                        const __m512 p = rbf_avx512(gexp2_avx512(
                            _mm512_sub_ps(_mm512_loadu_ps(st + (size_t)jj * SHMKV_DG_QB + n * 16), mu)));
                        _mm512_storeu_ps(st + (size_t)jj * SHMKV_DG_QB + n * 16, p);
                        sum = _mm512_add_ps(sum, p);
                    }
                    const __m512 al = gexp2_avx512(_mm512_sub_ps(mo, mu));
                    _mm512_storeu_ps(alpha + c0, al);
                    _mm512_storeu_ps(l + c0, _mm512_fmadd_ps(_mm512_loadu_ps(l + c0), al, sum));
                    _mm512_storeu_ps(m + c0, mn);
                    /* P^T in pairs of keys: (p[2 jp], p[2 jp + 1]) per lane */
                    for (uint32_t jp = 0; jp < npair; jp++) {
                        const __m512i lo = _mm512_loadu_si512(st + (size_t)2 * jp * SHMKV_DG_QB + n * 16);
                        const __m512i hi = 2 * jp + 1 < nt
                            ? _mm512_loadu_si512(st + (size_t)(2 * jp + 1) * SHMKV_DG_QB + n * 16)
                            : _mm512_setzero_si512();
                        _mm512_storeu_si512(pt + (size_t)jp * SHMKV_DG_QB + n * 16,
                            _mm512_or_si512(_mm512_and_si512(hi, _mm512_set1_epi32((int)0xffff0000u)),
                                            _mm512_srli_epi32(lo, 16)));
                    }
                }
                uint32_t q = 0;
                for (; q + 4 <= qe; q += 4)
                    shmkv_dg_pv_rows(O + (size_t)(q0 + q) * d, alpha + q0 + q, pt + q,
                                     vc, npair, d, 4);
                for (; q < qe; q++)
                    shmkv_dg_pv_rows(O + (size_t)(q0 + q) * d, alpha + q0 + q, pt + q, vc, npair, d, 1);
            }
        }
        for (uint32_t v = 0; v < nqh; v++) {
            memcpy(acc + ((size_t)h * nqh + v) * d, O + (size_t)v * d, d * sizeof(float));
            m_out[h * nqh + v] = m[v] * 0.69314718055994531f;
            l_out[h * nqh + v] = l[v];
        }
    }
    return 0;
}

#endif
