/*
 * kernels/attention_amx.h -- the prefill work item on AMX tiles (bf16 dot products, fp32
 * accumulation), included once by attention.c.  Owns nothing; reads pool rows and writes
 * the caller's scratch, like attention_isa.h.  Every function carries its own target
 * attribute (no pragma), so GCC and clang build it alike.
 *
 * One item = some query rows of one sequence over keys [t0, t1), every head (see attention.c).
 * Per kv head, the item's query vectors of that head (rows x group members, padded to tiles
 * of 16) meet the keys 32 at a time, as two small GEMMs on the tile unit:
 *   S^T [32 keys][16 q] = K [32][d] . Q^T     (K rows from the pool or a packed copy, Q^T
 *                                              packed once per head in the pairs layout AMX
 *                                              wants; two tiles of query vectors at once,
 *                                              four accumulations in flight)
 *   online softmax down the columns (one vector op per key: 16 query vectors at once; the
 *   causal mask only where the step crosses a row's last key)
 *   O [16 q][d] += P [16][32] . V [32][d]     (P transposed from S^T, V packed in pairs; O
 *                                              rescaled only when a column's max moves)
 * Scores are q.k times scale * log2(e) (applied to S, so q goes to the tiles as given), in
 * log2 units, so the softmax is 2^x; m goes out in e units.
 * Precision: AMX multiplies bf16.  An operand that is not exactly bf16 is split into bf16
 * pieces, x = x0 + x1 (+ x2), x0 = bf16(x), x1 = bf16(x - x0), x2 = bf16(x - x0 - x1), all
 * rounded (each piece at most 2^-9 of the one before), and the products of pieces summed in
 * fp32.  q goes in three pieces (a bf16 model's q is exact in one and skips the others), K
 * and V as stored (bf16), in two (float16: exact) or three (float32: 24 bits, exact).  A
 * quantized pool's K and V go as their codes (int8, and e4m3's values, are exact in bf16);
 * K's per-key scale multiplies the raw scores, V's the weights (P then in three pieces).
 * - S = q.K keeps every product of pieces i, j with i + j <= 2, so what it leaves out is
 *   ~2^-27 of q.k: an error in a score is an absolute error in the exponent, |s| times the
 *   relative one, and with first-order products only (i + j <= 1, the item before) a sharp
 *   softmax (scores spread ~8) was off by 2.3e-5 in float16, past the tests' 2e-5.
 * - P goes in two pieces (16 bits, ~2^-18 relative) times V's first piece, and P's first
 *   piece times each further piece of V, so a row that sees one key (p = 1) returns its v
 *   exactly; the products left out (P lo . V lo) are ~2^-18 of p.v.  An error in a weight
 *   is not amplified: the result stays within ~2x the FMA paths' error (RESULTS_attention_amx).
 */
#if SHMKV_HAVE_X86
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SHMKV_AMX_TGT __attribute__((target(                                           \
    "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,fma,f16c")))
#define SHMKV_AMX_KS 32                /* keys per step: one bf16 tile's K dimension */
#define SHMKV_AMX_SLACK2 12.0f         /* how far (log2 units) a score may pass its column's
                                          max before the max moves (lazy rescaling) */

/* The CPU has AMX-BF16 and AVX512-BF16 and the kernel let this process use the tiles. */
static int shmkv_amx_usable(void) {
    static int ok = -1;
    if (ok >= 0) return ok;
    unsigned a, b, c, d;
    ok = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return ok;
    const int amx = (d >> 22 & 1) && (d >> 24 & 1);           /* AMX-BF16, AMX-TILE */
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return ok;
    const int bf16 = a >> 5 & 1;                               /* AVX512_BF16 */
    /* ARCH_REQ_XCOMP_PERM (0x1023), XFEATURE_XTILEDATA (18): per process, kept by fork */
    if (amx && bf16 && syscall(SYS_arch_prctl, 0x1023, 18) == 0) ok = 1;
    return ok;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} shmkv_tilecfg_t;

/* Loads a configuration of ntiles tiles of 16 rows x 64 bytes.  The empty asm tells the
 * compiler that all 64 bytes of cfg are read: GCC 12's _tile_loadconfig declares only the
 * first 8 as its asm's input, so the stores of colsb and rows may be dropped as dead.  With
 * a constant tile count they were (a sixth-pass decode item faulted in ldtilecfg on the
 * stack's garbage); the prefill item's loop of 8 kept them only by the optimiser's choice. */
SHMKV_AMX_TGT static void shmkv_amx_config(int ntiles) {
    shmkv_tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < ntiles; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    __asm__ volatile("" : : "m"(cfg) : "memory");
    _tile_loadconfig(&cfg);
}

SHMKV_AMX_TGT static inline __m512 shmkv_amx_bf2f(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* hi and lo bf16 halves of 16 floats, both rounded */
SHMKV_AMX_TGT static inline void shmkv_amx_split(__m512 x, __m256i *hi, __m256i *lo) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    *hi = h;
    *lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, shmkv_amx_bf2f(h)));
}

/* three bf16 pieces of 16 floats, each rounded: x - (p0 + p1 + p2) is at most 2^-27 of x */
SHMKV_AMX_TGT static inline void shmkv_amx_split3(__m512 x, __m256i *p0, __m256i *p1, __m256i *p2) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
    const __m512 r = _mm512_sub_ps(x, shmkv_amx_bf2f(h));
    const __m256i m = (__m256i)_mm512_cvtneps_pbh(r);
    *p0 = h;
    *p1 = m;
    *p2 = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(r, shmkv_amx_bf2f(m)));
}

/* r[0..15] <- its transpose (16 x 16 floats) */
SHMKV_AMX_TGT static inline __attribute__((always_inline)) void shmkv_amx_tr16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* 16 elements of a pool row as floats (int8: the codes; e4m3: the codes' values / 2^8) */
SHMKV_AMX_TGT static inline __m512 shmkv_amx_ld(const uint8_t *p, int dt) {
    if (dt == SHMKV_ATT_F32) return _mm512_loadu_ps(p);
    if (SHMKV_QUANT(dt)) return vld_avx512(p, dt);
    const __m256i x = _mm256_loadu_si256((const __m256i *)p);
    return dt == SHMKV_ATT_F16 ? _mm512_cvtph_ps(x) : shmkv_amx_bf2f(x);
}

#define SHMKV_AMX_KC 256               /* keys per chunk: every head of a group meets them
                                          before the next chunk (see the item) */
#define SHMKV_AMX_STATE (1u << 20)     /* bytes of per-head state a head group may keep */

/* Heads per group: as many as keep their state (Q^T's 3 pieces, O, m, l) in SHMKV_AMX_STATE. */
static uint32_t shmkv_amx_heads(uint32_t nqh, uint32_t d, uint32_t hkv) {
    const size_t nq = ((size_t)nqh + 15) / 16 * 16, per = nq * d * 10 + nq * 8;
    const size_t hg = SHMKV_AMX_STATE / per;
    return hg < 1 ? 1 : hg > hkv ? hkv : (uint32_t)hg;
}

/* Scratch floats the AMX item needs beyond the FMA item's, for nqh query vectors per head. */
static size_t shmkv_amx_scratch(uint32_t nqh, uint32_t d, uint32_t hkv) {
    const size_t nq = ((size_t)nqh + 15) / 16 * 16, hg = shmkv_amx_heads(nqh, d, hkv);
    return hg * (3 * nq * d / 2           /* per head: Q^T in up to 3 bf16 pieces (as floats) */
                 + nq * d + 2 * nq)       /*           O, m, l */
         + 6 * SHMKV_AMX_KS * (size_t)d / 2   /* K's, V's pieces (up to 3 each) packed */
         + 2 * SHMKV_AMX_KS * 16 + 16 * 32 + 16 * 16   /* S^T of two tiles, P's pieces */
         + 2 * nq + 64;                   /* alpha, lim */
}

/* A cursor over the cache lines of some pool rows, K then V of each (no divisions). */
typedef struct {
    const size_t *slot;
    const uint8_t *k, *v;               /* the pools at the head's offset */
    size_t tok;
    uint32_t lpr, j, kv, ln;            /* lines per row; the cursor */
} shmkv_amx_pf_t;

static inline void shmkv_amx_pf_next(shmkv_amx_pf_t *c) {
    __builtin_prefetch((c->kv ? c->v : c->k) + c->slot[c->j] * c->tok + 64 * (size_t)c->ln, 0, 2);
    if (++c->ln < c->lpr) return;
    c->ln = 0;
    if (c->kv ^= 1) return;
    c->j++;
}

/* The step's online softmax and O += P.V for the 16 query vectors at q0, from their scores
 * st = S^T [32 keys][16 q] (raw q.k: times sc makes log2 units), V in npc pieces.  A
 * quantized pool's K and V go to the tiles as their codes (exact in bf16): ksc, vsc are the
 * step's per-key scales, which multiply the raw scores and the weights (else NULL).  Tiles 6,
 * 7 take P hi, lo, and tile 1 a quantized pool's third piece of P; O goes through tiles 5
 * and 0 and V's pieces through 2 and 4, 1 and 3, then 2 and 4 again: two independent
 * accumulations in flight, since a tile's dot products are latency-bound alone. */
SHMKV_AMX_TGT static inline void shmkv_amx_pv(const float *st, uint32_t q0, uint32_t ts, uint32_t nt,
                                              __m512 sc, const int32_t *lim, float *O, float *m,
                                              float *l, float *alpha, uint16_t *phi, uint16_t *plo,
                                              uint16_t *const *vp, uint32_t d, int npc,
                                              const float *ksc, const float *vsc) {
    __m512 s[SHMKV_AMX_KS];
    const __m512i limv = _mm512_loadu_si512(lim + q0);
    const int full = (int64_t)ts + nt <= lim[q0];      /* lim grows with the vector index */
    __m512 mt = _mm512_set1_ps(-INFINITY);
    for (uint32_t j = 0; j < SHMKV_AMX_KS; j++) {
        if (j >= nt) { s[j] = _mm512_set1_ps(-INFINITY); continue; }
        s[j] = _mm512_mul_ps(_mm512_loadu_ps(st + 16 * j),
                             ksc ? _mm512_mul_ps(sc, _mm512_set1_ps(ksc[j])) : sc);
        if (!full)                                     /* the causal diagonal */
            s[j] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY),
                                      _mm512_cmpgt_epi32_mask(limv, _mm512_set1_epi32((int)(ts + j))),
                                      s[j]);
        mt = _mm512_max_ps(mt, s[j]);
    }
    /* lazy rescaling: a column's reference max moves only when a score passes it by more
     * than SHMKV_AMX_SLACK2 (or on its first visible key), so most steps have alpha == 1
     * and accumulate straight into O on the tiles; p = 2^(s - m) <= 2^SLACK2 stays far from
     * fp32's range */
    const __m512 mo = _mm512_loadu_ps(m + q0), ninf = _mm512_set1_ps(-INFINITY);
    const __mmask16 up = _mm512_cmp_ps_mask(
        mt, _mm512_add_ps(mo, _mm512_set1_ps(SHMKV_AMX_SLACK2)), _CMP_GT_OQ);
    const __m512 mn = _mm512_mask_max_ps(mo, up, mo, mt);
    /* -inf - -inf: a column with nothing visible yet subtracts 0 instead */
    const __m512 mu = _mm512_mask_mov_ps(mn, _mm512_cmp_ps_mask(mn, ninf, _CMP_EQ_OQ),
                                         _mm512_setzero_ps());
    __m512 sum = _mm512_setzero_ps();
    for (uint32_t j = 0; j < SHMKV_AMX_KS; j++) {
        s[j] = gexp2_avx512(_mm512_sub_ps(s[j], mu));
        sum = _mm512_add_ps(sum, s[j]);
    }
    if (up) {                       /* some columns moved: rescale their O, l */
        const __m512 al = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), up,
                                             gexp2_avx512(_mm512_sub_ps(mo, mu)));
        _mm512_storeu_ps(l + q0, _mm512_fmadd_ps(_mm512_loadu_ps(l + q0), al, sum));
        _mm512_storeu_ps(alpha, al);
        for (uint32_t c = 0; c < 16; c++) {
            if (!(up >> c & 1)) continue;
            const __m512 ac = _mm512_set1_ps(alpha[c]);
            float *o = O + (size_t)(q0 + c) * d;
            for (uint32_t x = 0; x < d; x += 16)
                _mm512_storeu_ps(o + x, _mm512_mul_ps(_mm512_loadu_ps(o + x), ac));
        }
    } else {
        _mm512_storeu_ps(l + q0, _mm512_add_ps(_mm512_loadu_ps(l + q0), sum));
    }
    _mm512_storeu_ps(m + q0, mn);
    if (vsc)                        /* quantized V: its codes on the tiles, p times the scale */
        for (uint32_t j = 0; j < nt; j++) s[j] = _mm512_mul_ps(s[j], _mm512_set1_ps(vsc[j]));
    /* P [16 q][32 keys] = (S^T)^T, split hi + lo (hi rounded: lo is then at most 2^-9 of
     * p, and the products left out, P lo . V's further pieces, at most 2^-18).  A quantized
     * pool's P (p times V's scale) goes in three pieces, at plo + 512: P is then exact, and
     * a row that sees one key (p = 1) sums code . (s0 + s1), exact in fp32 (8 + 16 bits),
     * plus code . s2, rounded once: its v, as gather returns it. */
    shmkv_amx_tr16(s);
    shmkv_amx_tr16(s + 16);
    uint16_t *p3 = plo + 16 * 32;
    for (uint32_t c = 0; c < 16; c++) {
        const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(s[16 + c], s[c]);
        const __m512 h0 = shmkv_amx_bf2f(_mm512_castsi512_si256(hi));
        const __m512 h1 = shmkv_amx_bf2f(_mm512_extracti64x4_epi64(hi, 1));
        _mm512_storeu_si512(phi + 32 * c, hi);
        const __m512 r0 = _mm512_sub_ps(s[c], h0), r1 = _mm512_sub_ps(s[16 + c], h1);
        const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(r1, r0);
        _mm512_storeu_si512(plo + 32 * c, lo);
        if (vsc)
            _mm512_storeu_si512(p3 + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_sub_ps(r1, shmkv_amx_bf2f(_mm512_extracti64x4_epi64(lo, 1))),
                _mm512_sub_ps(r0, shmkv_amx_bf2f(_mm512_castsi512_si256(lo)))));
    }
    /* O += P . V, 32 columns of d at a time in two accumulations: P hi . V0, P lo . V0, and
     * P hi . each further piece of V (so a row that sees one key, p = 1, returns its v
     * exactly); quantized: P hi, lo, third . the codes */
    const long vs = (long)(4 * d);
    _tile_loadd(6, phi, 64);
    _tile_loadd(7, plo, 64);
    if (vsc) _tile_loadd(1, p3, 64);
    for (uint32_t x = 0; x < d; x += 32) {
        float *o0 = O + (size_t)q0 * d + x, *o1 = o0 + 16;
        _tile_loadd(5, o0, vs);
        _tile_loadd(0, o1, vs);
        _tile_loadd(2, vp[0] + 2 * x, vs);
        _tile_loadd(4, vp[0] + 2 * x + 32, vs);
        _tile_dpbf16ps(5, 6, 2);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(5, 7, 2);
        _tile_dpbf16ps(0, 7, 4);
        if (vsc) {                                  /* V is one piece: tile 1 is free */
            _tile_dpbf16ps(5, 1, 2);
            _tile_dpbf16ps(0, 1, 4);
        }
        if (npc > 1) {
            _tile_loadd(1, vp[1] + 2 * x, vs);
            _tile_loadd(3, vp[1] + 2 * x + 32, vs);
            _tile_dpbf16ps(5, 6, 1);
            _tile_dpbf16ps(0, 6, 3);
        }
        if (npc > 2) {
            _tile_loadd(2, vp[2] + 2 * x, vs);
            _tile_loadd(4, vp[2] + 2 * x + 32, vs);
            _tile_dpbf16ps(5, 6, 2);
            _tile_dpbf16ps(0, 6, 4);
        }
        _tile_stored(5, o0, vs);
        _tile_stored(0, o1, vs);
    }
}

/* The item on tiles (every kv dtype, d % 32 == 0, d <= 512).  Same contract as
 * shmkv_att_item_*, except that qf comes unscaled (the scale is applied to the scores, so a
 * q that is exactly bf16 -- a bf16 model's -- needs no lo half): acc [nqv][d], m [nqv],
 * l [nqv] after it; 0 or -1 (corrupt block id).
 * Loop order: head groups, then chunks of SHMKV_AMX_KC keys, then the group's heads, then
 * 32-key steps.  One head's rows are tok bytes apart, two or three to a page, so a 4k
 * context's K and V span thousands of pages: more than the TLB holds, and with the heads
 * outermost every head's pass walked the page tables again (the prefetches stalled on it,
 * 15% of the item).  A chunk's pages are walked once for the whole group. */
SHMKV_AMX_TGT static int shmkv_att_item_amx(const shmkv_attn_args_t *a, const shmkv_item_t *it,
                                            float *qf, float *acc, uint32_t nqv, float *xs) {
    const uint32_t d = a->d, G = a->hq / a->hkv, nqh = it->nrows * G;
    const uint32_t nqt = (nqh + 15) / 16, nq = nqt * 16;
    const int dt = a->kv_dtype, quant = SHMKV_QUANT(dt);
    const int split = dt == SHMKV_ATT_F32 || dt == SHMKV_ATT_F16;   /* K, V split in pieces */
    /* bf16 pieces of K and V (see the top) */
    const int npc = dt == SHMKV_ATT_F32 ? 3 : split ? 2 : 1;
    float *m_out = acc + (size_t)nqv * d, *l_out = m_out + nqv;
    const uint32_t L = a->seq_lens[it->seq], ql = a->q_lens[it->seq];
    const uint32_t first = L - ql + it->row0;
    const uint32_t tend = first + it->nrows;                /* keys the last row sees */
    const uint32_t tlast = it->t1 < tend ? it->t1 : tend;
    const int32_t *table = a->tables[it->seq];
    const size_t es = SHMKV_ESZ(dt);                        /* pool bytes per element */
    const size_t tok = (size_t)a->hkv * d * es, hstride = (size_t)d * es;
    const size_t prow = (size_t)d * 2;                      /* a packed bf16 row's bytes */
    const __m512 sc = _mm512_set1_ps(a->scale * 1.44269504088896f);   /* to log2 units */
    const uint32_t HG = shmkv_amx_heads(nqh, d, a->hkv);
    const size_t qsz = (size_t)nq * d;
    /* scratch, 64-byte pieces: per head of a group Q^T's pieces [3][nq * d] bf16, O, m, l */
    uint16_t *Qs = (uint16_t *)xs;
    float *Os = (float *)(Qs + 3 * HG * qsz), *ms = Os + HG * qsz, *ls = ms + (size_t)HG * nq;
    /* K's pieces [3][32][d], V's [3][16 pairs][d][2], bf16 */
    uint16_t *kp[3], *vp[3];
    for (int i = 0; i < 3; i++) {
        kp[i] = (uint16_t *)(ls + (size_t)HG * nq) + (size_t)i * SHMKV_AMX_KS * d;
        vp[i] = kp[0] + (size_t)(3 + i) * SHMKV_AMX_KS * d;
    }
    uint16_t *const khi = kp[0];
    float *st = (float *)(vp[2] + SHMKV_AMX_KS * d);    /* S^T [2 tiles][32][16] */
    uint16_t *phi = (uint16_t *)(st + 2 * SHMKV_AMX_KS * 16), *plo = phi + 16 * 32;
    float *alpha = (float *)(plo + 16 * 32) + 256;
    int32_t *lim = (int32_t *)(alpha + nq);
    size_t cs[2][SHMKV_AMX_KC], rows[SHMKV_AMX_KS];     /* a chunk's slots; a step's rows */
    float ksc[SHMKV_AMX_KS], vsc[SHMKV_AMX_KS];         /* quantized: a step's scales */
    /* per head of a group: q's pieces that are not all 0 (a head's state is at least
     * 16 x 32 x 10 bytes, so SHMKV_AMX_STATE / 4096 bounds HG) */
    uint8_t qn[SHMKV_AMX_STATE / 4096];

    shmkv_amx_config(8);

    for (uint32_t v = 0; v < nq; v++) {
        const uint32_t r = v < nqh ? v / G : it->nrows - 1;   /* padding: any valid row */
        lim[v] = (int32_t)(first + r + 1);
    }
    const __m512i ilv = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10,
                                         41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4,
                                         35, 3, 34, 2, 33, 1, 32, 0);
    int rc = 0;
    for (uint32_t h0 = 0; h0 < a->hkv; h0 += HG) {
        const uint32_t hn = a->hkv - h0 < HG ? a->hkv - h0 : HG;
        for (uint32_t hh = 0; hh < hn; hh++) {
            /* Q^T of the head in the pairs layout [tile][d/2][16 q][2], in three pieces:
             * per piece, tile and 32 dims, 16 rows of 16 dim pairs (one dword each)
             * transposed.  Products with a piece that is all 0 (q exactly bf16: every piece
             * past the first) are skipped. */
            uint16_t *qh = Qs + 3 * hh * qsz;
            qn[hh] = 1;
            for (int pc = 0; pc < 3; pc++) {
                __m512i nz = _mm512_setzero_si512();
                for (uint32_t q0 = 0; q0 < nq; q0 += 16)
                    for (uint32_t x = 0; x < d; x += 32) {
                        __m512 r[16];
                        for (uint32_t c = 0; c < 16; c++) {
                            if (q0 + c >= nqh) { r[c] = _mm512_setzero_ps(); continue; }
                            const float *q = qf + ((size_t)(h0 + hh) * nqh + q0 + c) * d + x;
                            __m256i a3[3], b3[3];
                            shmkv_amx_split3(_mm512_loadu_ps(q), a3, a3 + 1, a3 + 2);
                            shmkv_amx_split3(_mm512_loadu_ps(q + 16), b3, b3 + 1, b3 + 2);
                            r[c] = _mm512_castsi512_ps(
                                _mm512_inserti64x4(_mm512_castsi256_si512(a3[pc]), b3[pc], 1));
                            nz = _mm512_or_si512(nz, _mm512_castps_si512(r[c]));
                        }
                        shmkv_amx_tr16(r);
                        uint16_t *o = qh + (size_t)pc * qsz + (size_t)q0 * d + (size_t)x * 16;
                        for (uint32_t i = 0; i < 16; i++) _mm512_storeu_ps((float *)(o + 32 * i), r[i]);
                    }
                if (_mm512_test_epi32_mask(nz, nz)) qn[hh] = (uint8_t)(pc + 1);
            }
            for (uint32_t v = 0; v < nq; v++) { ms[hh * nq + v] = -INFINITY; ls[hh * nq + v] = 0; }
            memset(Os + hh * qsz, 0, qsz * sizeof(float));
        }
        int cw = 0;
        /* a chunk's slots into cs[cw]; block ids read once and checked */
        if (it->t0 < tlast &&
            shmkv_att_slots(a, table, it->t0, tlast - it->t0 < SHMKV_AMX_KC ? tlast - it->t0 : SHMKV_AMX_KC,
                            cs[0])) { rc = -1; goto done; }
        for (uint32_t tc = it->t0; tc < tlast; tc += SHMKV_AMX_KC, cw ^= 1) {
            const uint32_t nc = tlast - tc < SHMKV_AMX_KC ? tlast - tc : SHMKV_AMX_KC;
            const uint32_t tcn = tc + SHMKV_AMX_KC;
            const uint32_t ncn = tcn >= tlast ? 0 : (tlast - tcn < SHMKV_AMX_KC ? tlast - tcn : SHMKV_AMX_KC);
            if (ncn && shmkv_att_slots(a, table, tcn, ncn, cs[cw ^ 1])) { rc = -1; goto done; }
            for (uint32_t hh = 0; hh < hn; hh++) {
                const uint32_t h = h0 + hh;
                const uint16_t *qh = Qs + 3 * hh * qsz;
                float *O = Os + hh * qsz, *m = ms + (size_t)hh * nq, *l = ls + (size_t)hh * nq;
                /* the products summed into S^T: q's piece i times K's piece j for i + j up
                 * to 2 (every product down to 2^-18 of q.k), by K's piece: each of K's
                 * tiles is loaded once for all the q pieces it meets */
                const uint16_t *tq[6];
                int nterm = 0, kterm[6];
                for (int j = 0; j < npc; j++)
                    for (int i = 0; i + j <= 2 && i < qn[hh]; i++) {
                        tq[nterm] = qh + (size_t)i * qsz;
                        kterm[nterm++] = j;
                    }
                for (uint32_t ts = tc; ts < tc + nc; ts += SHMKV_AMX_KS) {
                    const uint32_t nt = tc + nc - ts < SHMKV_AMX_KS ? tc + nc - ts : SHMKV_AMX_KS;
                    /* the rows to bring in while this step computes: the chunk's next
                     * step, else the next head's first, else the next chunk's */
                    const size_t *pre = NULL;
                    uint32_t pn = 0, ph = h;
                    if (ts + SHMKV_AMX_KS < tc + nc) {
                        pre = cs[cw] + (ts + SHMKV_AMX_KS - tc);
                        pn = tc + nc - ts - SHMKV_AMX_KS;
                    } else if (hh + 1 < hn) {
                        pre = cs[cw], pn = nc, ph = h + 1;
                    } else if (ncn) {
                        pre = cs[cw ^ 1], pn = ncn, ph = h0;
                    }
                    if (pn > SHMKV_AMX_KS) pn = SHMKV_AMX_KS;
                    for (uint32_t j = 0; j < nt; j++) rows[j] = cs[cw][ts - tc + j] * tok + h * hstride;
                    for (uint32_t j = 0; quant && j < nt; j++) {   /* the keys' scales */
                        if (dt == SHMKV_ATT_I8) {
                            const size_t sl = cs[cw][ts - tc + j] * a->hkv + h;
                            ksc[j] = a->kscale[sl];
                            vsc[j] = a->vscale[sl];
                        } else {                        /* e4m3: one per head; loads are / 2^8 */
                            ksc[j] = a->khead[h] * SHMKV_E4M3_UNIT;
                            vsc[j] = a->vhead[h] * SHMKV_E4M3_UNIT;
                        }
                    }
                    /* K of a bfloat16 pool is loaded onto the tiles straight from the pool
                     * where a half step's 16 rows are evenly spaced (one block's rows: tok
                     * bytes apart), else packed; float16/float32 K is split, packed */
                    const uint8_t *kt[2];
                    long kts[2];
                    int kdir[2];
                    for (uint32_t half = 0; half < 2; half++) {
                        const uint32_t j0 = 16 * half;
                        int direct = dt == SHMKV_ATT_BF16 && j0 + 16 <= nt;
                        for (uint32_t j = j0 + 1; direct && j < j0 + 16; j++)
                            direct = rows[j] - rows[j - 1] == tok;
                        kt[half] = direct ? a->kpool + rows[j0] : (const uint8_t *)(khi + (size_t)j0 * d);
                        kts[half] = direct ? (long)tok : (long)prow;
                        kdir[half] = direct;
                    }
                    /* K's pieces [32][d] bf16 where not direct; V's packed in key pairs:
                     * [16 pairs][d][2]; rows past nt are zeros */
                    for (uint32_t j = 0; j < SHMKV_AMX_KS; j++) {
                        if (kdir[j / 16]) continue;                     /* read from the pool */
                        const size_t ko = (size_t)j * d;
                        if (j >= nt) {
                            for (int pc = 0; pc < npc; pc++) memset(kp[pc] + ko, 0, prow);
                            continue;
                        }
                        const uint8_t *kr = a->kpool + rows[j];
                        if (dt == SHMKV_ATT_BF16) { memcpy(kp[0] + ko, kr, prow); continue; }
                        if (quant) {                    /* the codes, exact in bf16 */
                            for (uint32_t x = 0; x < d; x += 16)
                                _mm256_storeu_si256((__m256i *)(kp[0] + ko + x),
                                                    (__m256i)_mm512_cvtneps_pbh(shmkv_amx_ld(kr + es * x, dt)));
                            continue;
                        }
                        for (uint32_t x = 0; x < d; x += 16) {
                            __m256i pc[3];
                            const __m512 kx = shmkv_amx_ld(kr + es * x, dt);
                            if (npc == 3) shmkv_amx_split3(kx, pc, pc + 1, pc + 2);
                            else shmkv_amx_split(kx, pc, pc + 1);
                            for (int i = 0; i < npc; i++)
                                _mm256_storeu_si256((__m256i *)(kp[i] + ko + x), pc[i]);
                        }
                    }
                    for (uint32_t p = 0; p < SHMKV_AMX_KS / 2; p++) {
                        const uint32_t j0 = 2 * p, j1 = 2 * p + 1;
                        const uint8_t *v0 = j0 < nt ? a->vpool + rows[j0] : NULL;
                        const uint8_t *v1 = j1 < nt ? a->vpool + rows[j1] : NULL;
                        const size_t vo = (size_t)p * 2 * d;
                        uint16_t *vh = vp[0] + vo;
                        if (!split) {       /* bf16 as stored, or codes: interleave the words */
                            for (uint32_t x = 0; x < d; x += 16) {
                                __m256i w0 = _mm256_setzero_si256(), w1 = w0;
                                if (quant) {
                                    if (v0) w0 = (__m256i)_mm512_cvtneps_pbh(shmkv_amx_ld(v0 + x, dt));
                                    if (v1) w1 = (__m256i)_mm512_cvtneps_pbh(shmkv_amx_ld(v1 + x, dt));
                                } else {
                                    if (v0) w0 = _mm256_loadu_si256((const __m256i *)(v0 + 2 * x));
                                    if (v1) w1 = _mm256_loadu_si256((const __m256i *)(v1 + 2 * x));
                                }
                                _mm512_storeu_si512(vh + 2 * x, _mm512_permutex2var_epi16(
                                    _mm512_castsi256_si512(w0), ilv, _mm512_castsi256_si512(w1)));
                            }
                            continue;
                        }
                        for (uint32_t x = 0; x < d; x += 16) {
                            const __m512 a0 = v0 ? shmkv_amx_ld(v0 + es * x, dt) : _mm512_setzero_ps();
                            const __m512 a1 = v1 ? shmkv_amx_ld(v1 + es * x, dt) : _mm512_setzero_ps();
                            __m256i p0[3], p1[3];
                            if (npc == 3) {
                                shmkv_amx_split3(a0, p0, p0 + 1, p0 + 2);
                                shmkv_amx_split3(a1, p1, p1 + 1, p1 + 2);
                            } else {
                                shmkv_amx_split(a0, p0, p0 + 1);
                                shmkv_amx_split(a1, p1, p1 + 1);
                            }
                            for (int i = 0; i < npc; i++)
                                _mm512_storeu_si512(vp[i] + vo + 2 * x, _mm512_permutex2var_epi16(
                                    _mm512_castsi256_si512(p0[i]), ilv, _mm512_castsi256_si512(p1[i])));
                        }
                    }
                    const int two = nt > 16;
                    const uint32_t npair = (nqt + 1) / 2;
                    const uint32_t lpr = (uint32_t)(hstride / 64), pft = pn * 2 * lpr;
                    const uint32_t spots = npair * (d / 32), pfper = (pft + spots - 1) / spots;
                    uint32_t pfc = 0;
                    shmkv_amx_pf_t pf = {pre, a->kpool + ph * hstride, a->vpool + ph * hstride, tok,
                                         lpr, 0, 0, 0};
                    for (uint32_t pq = 0; pq < npair; pq++) {
                        /* the tiles of the pair that still see a key of this step (lim grows
                         * with the vector index: if the first does, the second does) */
                        uint32_t act[2], na = 0;
                        for (uint32_t t = 2 * pq; t < 2 * pq + 2 && t < nqt; t++) {
                            const uint32_t qe = nqh - 16 * t < 16 ? nqh - 16 * t : 16;   /* real */
                            if ((int64_t)ts < lim[16 * t + qe - 1]) act[na++] = t;
                        }
                        if (na == 0) {
                            for (; pfc < pft && pfc < (pq + 1) * pfper * (d / 32); pfc++)
                                shmkv_amx_pf_next(&pf);
                            continue;
                        }
                        /* S^T = K . Q^T over d in chunks of 32, 2 tiles of keys x up to 2
                         * tiles of query vectors (accumulators 0, 1 and 5, 6; Q on 3, 7; K on
                         * 2, 4): four independent accumulations in flight */
                        const size_t qa = (size_t)act[0] * 16 * d, qb = na > 1 ? (size_t)act[1] * 16 * d : 0;
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(5);
                        _tile_zero(6);
                        for (uint32_t x = 0; x < d; x += 32) {
                            const size_t xo = (size_t)x * 16;
                            /* the rows to come into the cache, a few lines at a time (a
                             * burst of prefetches stalls the core once its miss buffers
                             * are full; nothing else brings them: their stride is one
                             * the hardware prefetchers miss) */
                            for (uint32_t e = pfc + pfper < pft ? pfc + pfper : pft; pfc < e; pfc++)
                                shmkv_amx_pf_next(&pf);
                            for (int term = 0; term < nterm; term++) {
                                if (term && kterm[term] == kterm[term - 1]) {
                                    /* K's piece is on tiles 2, 4 already */
                                } else if (kterm[term]) {
                                    const uint16_t *kk = kp[kterm[term]];
                                    _tile_loadd(2, kk + x, (long)prow);
                                    if (two) _tile_loadd(4, kk + 16 * d + x, (long)prow);
                                } else {
                                    _tile_loadd(2, kt[0] + 2 * x, kts[0]);
                                    if (two) _tile_loadd(4, kt[1] + 2 * x, kts[1]);
                                }
                                _tile_loadd(3, tq[term] + qa + xo, 64);
                                _tile_dpbf16ps(0, 2, 3);
                                if (two) _tile_dpbf16ps(1, 4, 3);
                                if (na > 1) {
                                    _tile_loadd(7, tq[term] + qb + xo, 64);
                                    _tile_dpbf16ps(5, 2, 7);
                                    if (two) _tile_dpbf16ps(6, 4, 7);
                                }
                            }
                        }
                        _tile_stored(0, st, 64);
                        if (two) _tile_stored(1, st + 256, 64);
                        if (na > 1) {
                            _tile_stored(5, st + 512, 64);
                            if (two) _tile_stored(6, st + 768, 64);
                        }
                        for (uint32_t i = 0; i < na; i++)
                            shmkv_amx_pv(st + 512 * i, act[i] * 16, ts, nt, sc, lim, O, m, l, alpha,
                                         phi, plo, vp, d, npc, quant ? ksc : NULL,
                                         quant ? vsc : NULL);
                    }
                }
            }
        }
        for (uint32_t hh = 0; hh < hn; hh++)                /* the group's vectors out */
            for (uint32_t v = 0; v < nqh; v++) {
                const size_t o = (size_t)(h0 + hh) * nqh + v;
                memcpy(acc + o * d, Os + hh * qsz + (size_t)v * d, d * sizeof(float));
                m_out[o] = ms[hh * nq + v] * 0.69314718055994531f;   /* back to e units */
                l_out[o] = ls[hh * nq + v];
            }
    }
done:
    _tile_release();
    return rc;
}
#endif
