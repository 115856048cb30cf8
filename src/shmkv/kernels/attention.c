/*
 * kernels/attention.c -- the paged-attention kernel: work split, thread pool, ISA dispatch.
 * See attention.h for the contract.  The per-ISA inner loops are attention_isa.inc, compiled
 * three times below (scalar, AVX2+F16C+FMA, AVX-512 F/BW/VL+F16C) under GCC target pragmas
 * (clang: `#pragma clang attribute` target attributes, since clang ignores GCC's);
 * the path is chosen at run time from the CPU's level (cpu.h; SHMKV_ISA caps it).
 * Its other parts, each included once below: attention_amx.inc (prefill on AMX tiles),
 * attention_dot.inc and attention_dot_gemm.inc (the opt-in bf16 mode on vdpbf16ps / vpdpbusd),
 * attention_pool.inc (the threads), attention_plan.inc (the work split and the merge).  The
 * benchmarks' read floor and FMA peak are shmkv._bench's (bench_floor.h), on this pool's
 * threads through shmkv_attn_run_timed.
 */
#define _GNU_SOURCE 1
#include "attention.h"
#include "cpu.h"

#include <dlfcn.h>
#include <link.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if SHMKV_X86
#include <immintrin.h>
#endif

#define TILE 16                 /* tokens per online-softmax step */
#define QV_MAX 32               /* query vectors per kv head in one work item (rows = QV_MAX / G) */
#define MIN_CHUNK 256           /* fewest tokens a split-KV chunk gets */

/* ---- portable conversions (q rows, and the scalar path) ------------------------------- */
static inline float shmkv_f16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0) {
        if (m == 0) bits = s;
        else {                                   /* subnormal: normalise */
            e = 113;
            while (!(m & 0x400u)) { m <<= 1; e--; }
            bits = s | (e << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) bits = s | 0x7f800000u | (m << 13);
    else bits = s | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline float shmkv_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
/* x rounded to bfloat16 (to nearest even), kept as a float; a NaN stays a quiet NaN.  The
 * opt-in bf16 mode rounds q and the softmax weights with it (and its vector twins). */
static inline float shmkv_round_bf16(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) b |= 0x00400000u;
    else b += 0x7fffu + ((b >> 16) & 1u);
    b &= 0xffff0000u;
    memcpy(&x, &b, 4);
    return x;
}
/* bytes per element of a kernel element type */
#define SHMKV_ESZ(dt) ((dt) == SHMKV_ATT_F32 ? 4u : ((dt) == SHMKV_ATT_I8 || (dt) == SHMKV_ATT_E4M3) ? 1u : 2u)
#define SHMKV_QUANT(dt) ((dt) == SHMKV_ATT_I8 || (dt) == SHMKV_ATT_E4M3)
/* e4m3fn code -> float16 bits by a shift: (s eeee mmm) -> (s 0eeee mmm0000000) reads as
 * the code's value times 2^-8 (exponent bias 15 instead of 7), subnormal codes included
 * (as float16 subnormals, which the F16C conversion turns into normal floats).  The
 * kernel loads e4m3 codes this way -- one conversion the hardware does, no float32
 * denormal arithmetic (a multiply by 2^120 of float32 denormals took a microcode assist
 * per vector: 2.2x fp16's time) -- and folds the 2^8 into the per-head scale. */
#define SHMKV_E4M3_F16_BITS(x) ((uint16_t)((((x) & 0x80u) << 8) | (((x) & 0x7fu) << 7)))
#define SHMKV_E4M3_UNIT 256.0f             /* what an e4m3 load is off by: times the scale */
static inline float shmkv_load_elem(const uint8_t *p, int dt, uint32_t i) {
    uint16_t h;
    switch (dt) {
    case SHMKV_ATT_I8: return (float)(int8_t)p[i];
    case SHMKV_ATT_E4M3: return shmkv_f16_to_f32(SHMKV_E4M3_F16_BITS(p[i]));   /* / 2^8 */
    case SHMKV_ATT_F16: memcpy(&h, p + 2 * (size_t)i, 2); return shmkv_f16_to_f32(h);
    case SHMKV_ATT_BF16: memcpy(&h, p + 2 * (size_t)i, 2); return shmkv_bf16_to_f32(h);
    default: { float f; memcpy(&f, p + 4 * (size_t)i, 4); return f; }
    }
}

/* ---- the work: items and per-thread scratch ------------------------------------------- */
typedef struct {
    uint32_t seq;               /* sequence index */
    uint32_t row0, nrows;       /* query rows [row0, row0 + nrows) of the sequence */
    uint32_t t0, t1;            /* keys [t0, t1) this item reads */
    int64_t part;               /* -1: final, written to out; else the partial's slot */
} shmkv_item_t;


typedef struct {
    const shmkv_attn_args_t *a;
    const shmkv_item_t *items;
    float *parts;               /* [nparts][QV][d + 2]: acc, then m, l */
    uint32_t qv_stride;         /* query vectors per partial record */
    volatile int err;
    volatile int bad_seq;
} shmkv_job_t;

/* A hint to bring the n bytes at p into the cache (one prefetch per 64-byte line). */
static inline __attribute__((always_inline)) void shmkv_att_prefetch(const uint8_t *p, size_t n) {
    for (size_t x = 0; x < n; x += 64) __builtin_prefetch(p + x, 0, 2);
}

/* Reads a block id once from shared memory and checks it. */
static inline int shmkv_att_block(const shmkv_attn_args_t *a, const int32_t *table, uint32_t bi,
                                  uint32_t *out) {
    int32_t b = __atomic_load_n(&table[bi], __ATOMIC_RELAXED);
    if (b < 0 || (uint32_t)b >= a->num_blocks) return -1;
    *out = (uint32_t)b;
    return 0;
}

/* The pool slots (block * block_size + offset) of keys [t0, t0 + n) of a sequence, each
 * block id read once from shared memory and checked.  0, or -1 on a corrupt id. */
static inline int shmkv_att_slots(const shmkv_attn_args_t *a, const int32_t *table, uint32_t t0,
                                  uint32_t n, size_t *slot) {
    const uint32_t bs = a->block_size;
    uint32_t cur = UINT32_MAX, blk = 0;
    for (uint32_t j = 0; j < n; j++) {
        const uint32_t t = t0 + j, bi = t / bs;
        if (bi != cur) {
            if (shmkv_att_block(a, table, bi, &blk)) return -1;
            cur = bi;
        }
        slot[j] = (size_t)blk * bs + t % bs;
    }
    return 0;
}

/* ---- the walk over an item's keys (every item's: one walk) -----------------------------
 * Keys [t0, t1) in steps of up to n keys (the row items' tiles of TILE, the GEMM items'
 * steps, the AMX item's chunks), double-buffered: the block ids of the step after this one
 * are read (once, checked) before this one is worked on, so that its rows can be
 * prefetched a step ahead.  The caller gives two buffers of n slots and, when it wants the
 * row addresses too, two of n K and V rows (tok: bytes per token, every head):
 *     shmkv_walk_t k = { .a = a, .table = table, .t1 = t1, .n = n, .slot = { s0, s1 } };
 *     if (shmkv_walk_start(&k, t0)) return -1;
 *     for (; k.nt; shmkv_walk_next(&k)) {
 *         if (shmkv_walk_ahead(&k)) return -1;
 *         ... keys [k.ts, k.ts + k.nt) in slot[k.w]; the next step's k.nn in slot[k.w ^ 1]
 *     }
 * A corrupt block id fails the item (-1) before the step that holds it, or the one before
 * it, is worked on. */
typedef struct {
    const shmkv_attn_args_t *a;
    const int32_t *table;
    uint32_t t1, n;                 /* the end of the keys, keys per step */
    uint32_t ts, nt;                /* this step: keys [ts, ts + nt); nt 0: the walk is over */
    uint32_t tn, nn;                /* the next step: keys [tn, tn + nn); nn 0: none */
    int w;                          /* this step's buffers are [w], the next one's [w ^ 1] */
    size_t *slot[2];                /* the caller's buffers of n slots */
    const uint8_t **kb[2], **vb[2]; /* NULL, or the caller's buffers of n K / V rows */
    size_t tok;                     /* bytes per token, every head (with kb, vb) */
} shmkv_walk_t;

static inline uint32_t shmkv_walk_len(const shmkv_walk_t *k, uint32_t t) {
    return t >= k->t1 ? 0 : k->t1 - t < k->n ? k->t1 - t : k->n;
}

static inline int shmkv_walk_load(shmkv_walk_t *k, int b, uint32_t t, uint32_t n) {
    if (n == 0) return 0;
    if (shmkv_att_slots(k->a, k->table, t, n, k->slot[b])) return -1;
    if (k->kb[b] != NULL)
        for (uint32_t j = 0; j < n; j++) {
            k->kb[b][j] = k->a->kpool + k->slot[b][j] * k->tok;
            k->vb[b][j] = k->a->vpool + k->slot[b][j] * k->tok;
        }
    return 0;
}

/* The first step, its slots (and rows) loaded.  0, or -1 on a corrupt block id. */
static inline int shmkv_walk_start(shmkv_walk_t *k, uint32_t t0) {
    k->w = 0;
    k->ts = t0;
    k->nt = shmkv_walk_len(k, t0);
    k->tn = t0 + k->n;
    k->nn = shmkv_walk_len(k, k->tn);
    return shmkv_walk_load(k, 0, t0, k->nt);
}

/* The next step's slots (and rows), loaded at the top of each step.  0, or -1. */
static inline int shmkv_walk_ahead(shmkv_walk_t *k) {
    return shmkv_walk_load(k, k->w ^ 1, k->tn, k->nn);
}

static inline void shmkv_walk_next(shmkv_walk_t *k) {
    k->ts = k->tn;
    k->nt = k->nn;
    k->w ^= 1;
    k->tn = k->ts + k->n;
    k->nn = shmkv_walk_len(k, k->tn);
}

/* Prefill rows go to the AMX tiles under this ISA (every pool dtype: quantized pools' codes
 * are exact in bf16; head_dim a multiple of 32); the item then needs nrows > 1 as well. */
static inline int shmkv_att_tiles(const shmkv_attn_args_t *a, int isa) {
    /* the opt-in bf16 mode runs on AVX512_BF16 instead: its q is q * scale rounded, the
     * tiles take q as given and scale the scores (see attention_dot.inc) */
    return isa >= SHMKV_ISA_AMX && a->d % 32 == 0 && a->precision != SHMKV_PREC_BF16;
}

/* Offset, in elements, of query/output vector (row r, kv head h, group member g) of an item,
 * and the item-local index of that vector: v = (h * nrows + r) * G + g (grouped by kv head). */
static inline uint64_t shmkv_att_qoff(const shmkv_attn_args_t *a, const shmkv_item_t *it,
                                      uint32_t h, uint32_t r, uint32_t g) {
    const uint64_t row = a->q_start[it->seq] + it->row0 + r;
    return (row * a->hq + (uint64_t)h * (a->hq / a->hkv) + g) * a->d;
}
#define SHMKV_ATT_V(it, G, h, r, g) (((h) * (it)->nrows + (r)) * (G) + (g))

/* Converts the item's query vectors into qf [nqv][d], times qscale (the FMA items take them
 * pre-scaled; the tiles scale the scores instead). */
static void shmkv_att_load_q(const shmkv_attn_args_t *a, const shmkv_item_t *it, float *qf,
                             float qscale) {
    const uint32_t G = a->hq / a->hkv, d = a->d;
    const size_t esz = a->q_dtype == SHMKV_ATT_F32 ? 4 : 2;
    for (uint32_t h = 0; h < a->hkv; h++)
        for (uint32_t r = 0; r < it->nrows; r++)
            for (uint32_t g = 0; g < G; g++) {
                const uint8_t *src = (const uint8_t *)a->q + shmkv_att_qoff(a, it, h, r, g) * esz;
                float *dst = qf + (size_t)SHMKV_ATT_V(it, G, h, r, g) * d;
                /* one loop per dtype, so the conversion's switch folds away (per element
                 * it cost 3% of a bf16 prefill); float32 unscaled (the tiles) is a copy */
                if (a->q_dtype == SHMKV_ATT_F32 && qscale == 1.0f)
                    memcpy(dst, src, (size_t)d * 4);
                else if (a->q_dtype == SHMKV_ATT_F32)
                    for (uint32_t i = 0; i < d; i++)
                        dst[i] = shmkv_load_elem(src, SHMKV_ATT_F32, i) * qscale;
                else if (a->q_dtype == SHMKV_ATT_BF16)
                    for (uint32_t i = 0; i < d; i++)
                        dst[i] = shmkv_load_elem(src, SHMKV_ATT_BF16, i) * qscale;
                else
                    for (uint32_t i = 0; i < d; i++)
                        dst[i] = shmkv_load_elem(src, SHMKV_ATT_F16, i) * qscale;
                if (a->precision == SHMKV_PREC_BF16)
                    for (uint32_t i = 0; i < d; i++) dst[i] = shmkv_round_bf16(dst[i]);
            }
}

/* ---- the per-ISA item loop ------------------------------------------------------------ */
#define SHMKV_ISA_SUFFIX scalar
#define SHMKV_ISA_PASS 0
#include "attention_isa.inc"
#undef SHMKV_ISA_SUFFIX

#if SHMKV_X86
#if defined(__clang__)     /* clang ignores GCC target pragmas: an attribute on each function */
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#define SHMKV_ISA_SUFFIX avx2
#undef SHMKV_ISA_PASS
#define SHMKV_ISA_PASS 1
#include "attention_isa.inc"
#undef SHMKV_ISA_SUFFIX
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#endif
#define SHMKV_ISA_SUFFIX avx512
#undef SHMKV_ISA_PASS
#define SHMKV_ISA_PASS 2
#include "attention_isa.inc"
#undef SHMKV_ISA_SUFFIX
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
#include "attention_amx.inc"
#include "attention_dot.inc"
#include "attention_dot_gemm.inc"

typedef int (*shmkv_item_fn)(const shmkv_attn_args_t *, const shmkv_item_t *, float *, float *,
                             uint32_t);
/* the prefill items on FMAs (attention_gemm.inc): the row item's arguments and a scratch */
typedef int (*shmkv_gemm_fn)(const shmkv_attn_args_t *, const shmkv_item_t *, float *, float *,
                             uint32_t, float *);
typedef size_t (*shmkv_gemm_scratch_fn)(uint32_t, uint32_t);
/* fewest query vectors per kv head for the GEMM item: below, its padded lanes cost more
 * than the row item's horizontal sums (measured: 4 rows x 4 heads 1.4x the row item's
 * time, 8 x 4 0.9x, on AVX-512 and AVX2 alike) */
#define GEMM_MIN_QV 32
static int shmkv_att_gemm_off;  /* _attention._force_rows(True): the row item always */

static int shmkv_att_isa_forced = -1;  /* _attention._force_isa; -1: the default */

int shmkv_attn_cpu_isa(void) { return shmkv_cpu_best(); }

int shmkv_attn_isa(void) {
    const int f = __atomic_load_n(&shmkv_att_isa_forced, __ATOMIC_RELAXED);
    return f >= 0 ? f : shmkv_cpu_isa();
}

int shmkv_attn_force_isa(int isa) {
    if (isa > shmkv_cpu_best()) return -1;
    __atomic_store_n(&shmkv_att_isa_forced, isa < 0 ? -1 : isa, __ATOMIC_RELAXED);
    return 0;
}

/* The widest vector path whose width divides d (the inner loops have no tails). */
static shmkv_item_fn shmkv_att_pick(uint32_t d) {
    int isa = shmkv_attn_isa();
#if SHMKV_X86
    if (isa >= SHMKV_ISA_AVX512 && d % 16 == 0) return shmkv_att_item_avx512;
    if (isa >= SHMKV_ISA_AVX2 && d % 8 == 0) return shmkv_att_item_avx2;
#else
    (void)isa;
#endif
    return shmkv_att_item_scalar;
}

/* The GEMM-shaped prefill item of the widest path whose width divides d; NULL: none (the
 * scalar path, or switched off). */
static shmkv_gemm_fn shmkv_att_pick_gemm(uint32_t d, shmkv_gemm_scratch_fn *scratch) {
    int isa = shmkv_attn_isa();
    *scratch = NULL;
    if (shmkv_att_gemm_off) return NULL;
#if SHMKV_X86
    if (isa >= SHMKV_ISA_AVX512 && d % 16 == 0) {
        *scratch = shmkv_gemm_scratch_avx512;
        return shmkv_att_item_gemm_avx512;
    }
    if (isa >= SHMKV_ISA_AVX2 && d % 8 == 0) {
        *scratch = shmkv_gemm_scratch_avx2;
        return shmkv_att_item_gemm_avx2;
    }
#else
    (void)isa; (void)d;
#endif
    return NULL;
}

int shmkv_attn_force_rows(int on) {
    shmkv_att_gemm_off = on != 0;
    return 0;
}

/* the opt-in mode's items on the dot instructions (attention_dot.inc): the row item's
 * arguments and a scratch */
typedef int (*shmkv_dot_fn)(const shmkv_attn_args_t *, const shmkv_item_t *, float *, float *,
                            uint32_t, float *);
static int shmkv_att_dots_off;  /* _attention._force_dots(False): the FMA paths */

int shmkv_attn_force_dots(int on) {
    shmkv_att_dots_off = on == 0;
    return 0;
}

int shmkv_attn_dot_isa(void) {
#if SHMKV_X86
    if (!shmkv_att_dots_off && shmkv_attn_isa() >= SHMKV_ISA_AVX512) return shmkv_cpu_dots();
#endif
    return 0;
}

/* The call's row item on dot instructions, or NULL: the opt-in mode, a bfloat16 pool on
 * AVX512_BF16 (d a multiple of 32), an int8 pool on AVX512_VNNI (d a multiple of 64, at
 * most 256: the integer sums stay exact in float32). */
static shmkv_dot_fn shmkv_att_pick_dot(const shmkv_attn_args_t *a) {
    if (a->precision != SHMKV_PREC_BF16) return NULL;
#if SHMKV_X86
    const int dots = shmkv_attn_dot_isa();
    if (a->kv_dtype == SHMKV_ATT_BF16 && (dots & SHMKV_DOT_BF16) && a->d % 32 == 0)
        return shmkv_att_item_dpbf16;
    if (a->kv_dtype == SHMKV_ATT_I8 && (dots & SHMKV_DOT_VNNI) && a->d % 64 == 0 && a->d <= 256)
        return shmkv_att_item_vnni;
#endif
    return NULL;
}

#include "attention_pool.inc"     /* the thread pool, and the OpenMP team it may borrow */

/* ---- the attention job ---------------------------------------------------------------- */
static shmkv_item_fn shmkv_att_fn;
static shmkv_gemm_fn shmkv_att_gemm;    /* the call's GEMM prefill item, or NULL */
static shmkv_gemm_scratch_fn shmkv_att_gemm_scratch;
static shmkv_dot_fn shmkv_att_dot;      /* the call's dot row item, or NULL */
static int shmkv_att_isa_now;           /* the call's ISA (call_mu held) */

static float *shmkv_scratch_get(int tid, size_t floats) {
    shmkv_scratch_t *s = &P.scratch[tid];
    if (s->cap < floats) {
        float *nb = NULL;
        if (posix_memalign((void **)&nb, 64, floats * sizeof(float))) return NULL;
        free(s->buf);
        s->buf = nb;
        s->cap = floats;
    }
    return s->buf;
}

static void shmkv_att_task(void *ctx, uint32_t i, int tid) {
    shmkv_job_t *j = ctx;
    if (j->err) return;
    const shmkv_attn_args_t *a = j->a;
    const shmkv_item_t *it = &j->items[i];
    const uint32_t G = a->hq / a->hkv, nqv = it->nrows * a->hq, d = a->d;
    /* prefill rows go to the tiles where the CPU has them */
    const int amx = SHMKV_X86 && it->nrows > 1 && shmkv_att_tiles(a, shmkv_att_isa_now);
    /* other prefill rows, enough query vectors to fill the lanes: the GEMM-shaped item */
    const int gemm = !amx && shmkv_att_gemm != NULL && it->nrows > 1 && it->nrows * G >= GEMM_MIN_QV;
    /* the opt-in mode's row item on dot instructions, where there is one */
    const int dot = !amx && !gemm && shmkv_att_dot != NULL;
    /* scratch: qf [nqv][d], acc [nqv][d], m [nqv], l [nqv] (then the tiles' own) */
    const size_t base = ((size_t)nqv * (2 * d + 2) + 64 + 15) / 16 * 16;
#if SHMKV_X86
    const size_t extra = amx ? shmkv_amx_scratch(it->nrows * G, d, a->hkv)
                       : gemm ? shmkv_att_gemm_scratch(it->nrows * G, d)
                       : dot ? shmkv_dot_scratch(nqv, d) : 0;
#else
    const size_t extra = gemm ? shmkv_att_gemm_scratch(it->nrows * G, d) : 0;
#endif
    float *s = shmkv_scratch_get(tid, base + extra);
    if (s == NULL) { j->err = SHMKV_ATT_ENOMEM; return; }
    float *qf = s, *acc = s + (size_t)nqv * d, *m = acc + (size_t)nqv * d, *l = m + nqv;
    shmkv_att_load_q(a, it, qf, amx ? 1.0f : a->scale);
#if SHMKV_X86
    const int rc = amx ? shmkv_att_item_amx(a, it, qf, acc, nqv, s + base)
                 : gemm ? shmkv_att_gemm(a, it, qf, acc, nqv, s + base)
                 : dot ? shmkv_att_dot(a, it, qf, acc, nqv, s + base)
                       : shmkv_att_fn(a, it, qf, acc, nqv);
#else
    (void)dot;
    const int rc = gemm ? shmkv_att_gemm(a, it, qf, acc, nqv, s + base)
                        : shmkv_att_fn(a, it, qf, acc, nqv);
#endif
    if (rc != 0) {
        j->bad_seq = (int)it->seq;
        j->err = SHMKV_ATT_ECORRUPT;
        return;
    }
    if (it->part < 0) {                         /* final: normalise into out */
        for (uint32_t h = 0; h < a->hkv; h++)
            for (uint32_t r = 0; r < it->nrows; r++)
                for (uint32_t g = 0; g < G; g++) {
                    const uint32_t v = SHMKV_ATT_V(it, G, h, r, g);
                    float *o = a->out + shmkv_att_qoff(a, it, h, r, g);
                    const float inv = l[v] > 0 ? 1.0f / l[v] : 0.0f;
                    for (uint32_t x = 0; x < d; x++) o[x] = acc[(size_t)v * d + x] * inv;
                }
    } else {                                    /* partial: acc, m, l for the merge */
        float *p = j->parts + (size_t)it->part * j->qv_stride * (d + 2);
        for (uint32_t v = 0; v < nqv; v++) {
            memcpy(p + (size_t)v * (d + 2), acc + (size_t)v * d, d * sizeof(float));
            p[(size_t)v * (d + 2) + d] = m[v];
            p[(size_t)v * (d + 2) + d + 1] = l[v];
        }
    }
}

/* Grow-only buffers for items and partials (call_mu held). */
static shmkv_item_t *shmkv_items_buf;
static size_t shmkv_items_cap;
static float *shmkv_parts_buf;
static size_t shmkv_parts_cap;

static int shmkv_grow(void **buf, size_t *cap, size_t need, size_t elem) {
    if (*cap >= need) return 0;
    size_t n = need + need / 2 + 16;
    void *nb = realloc(*buf, n * elem);
    if (nb == NULL) return -1;
    *buf = nb;
    *cap = n;
    return 0;
}

#include "attention_plan.inc"     /* the work split and the merge of split keys */

int shmkv_attention(const shmkv_attn_args_t *a, int *bad_seq) {
    pthread_once(&shmkv_att_once, shmkv_att_init);
    if (a->hkv == 0 || a->hq % a->hkv || a->d == 0 || a->block_size == 0) return SHMKV_ATT_EARG;
    const uint32_t G = a->hq / a->hkv;
    pthread_mutex_lock(&P.call_mu);
    int st = SHMKV_ATT_OK;
    if (shmkv_pool_start() != 0) { st = SHMKV_ATT_ENOMEM; goto out; }
    const int threads = P.wanted;
    shmkv_att_fn = shmkv_att_pick(a->d);
    shmkv_att_gemm = shmkv_att_pick_gemm(a->d, &shmkv_att_gemm_scratch);
    shmkv_att_isa_now = shmkv_attn_isa();
    shmkv_att_dot = shmkv_att_pick_dot(a);
#if SHMKV_X86
    /* the opt-in mode's prefill rows on vdpbf16ps where the FMA GEMM item would run */
    if (shmkv_att_gemm != NULL && shmkv_att_dot == shmkv_att_item_dpbf16) {
        shmkv_att_gemm = shmkv_att_item_gemm_dpbf16;
        shmkv_att_gemm_scratch = shmkv_dg_scratch;
    }
#endif
    /* query rows per item; eight times as many on the GEMM items and the tiles (a step's
     * K/V rows, read and converted once, serve more query vectors: a 4k float32 context is
     * 4 MiB per kv head, read once per item; 512 rows into 4k took 1.3x the time with 32
     * query vectors per head, 1.04x with 128, against 256; bf16 on the tiles 1.2x with 128,
     * 1.15x with 512) */
    const uint32_t qvmax = shmkv_att_gemm != NULL || shmkv_att_tiles(a, shmkv_att_isa_now)
                         ? 8 * QV_MAX : QV_MAX;
    uint32_t rt;
    uint64_t chunk, work = 0;
    shmkv_att_plan(a->q_lens, a->seq_lens, a->nseq, G, qvmax, threads, &rt, &chunk);
    for (uint32_t s = 0; s < a->nseq; s++) work += (uint64_t)a->seq_lens[s] * a->q_lens[s];
    work *= a->hkv;
    uint64_t nitems = 0;
    for (int pass = 0; pass < 2; pass++) {
        uint64_t k = 0, part = 0;
        for (uint32_t s = 0; s < a->nseq; s++) {
            const uint32_t L = a->seq_lens[s], ql = a->q_lens[s];
            for (uint32_t r0 = 0; r0 < ql; r0 += rt) {
                const uint32_t nr = ql - r0 < rt ? ql - r0 : rt;
                const uint32_t end = L - ql + r0 + nr;         /* keys the last row sees */
                const uint64_t nch = chunk == UINT64_MAX ? 1 : (end + chunk - 1) / chunk;
                for (uint64_t c = 0; c < nch; c++) {
                    if (pass) {
                        shmkv_item_t *it = &shmkv_items_buf[k];
                        it->seq = s; it->row0 = r0; it->nrows = nr;
                        it->t0 = (uint32_t)(c * (nch > 1 ? chunk : 0));
                        it->t1 = nch > 1 && (c + 1) * chunk < end ? (uint32_t)((c + 1) * chunk) : end;
                        it->part = nch > 1 ? (int64_t)part++ : -1;
                    } else if (nch > 1) part++;
                    k++;
                }
            }
        }
        if (!pass) {
            nitems = k;
            if (nitems > UINT32_MAX ||
                shmkv_grow((void **)&shmkv_items_buf, &shmkv_items_cap, nitems, sizeof(shmkv_item_t)) ||
                shmkv_grow((void **)&shmkv_parts_buf, &shmkv_parts_cap,
                           part * (uint64_t)rt * a->hq * (a->d + 2) + 1, sizeof(float))) {
                st = SHMKV_ATT_ENOMEM;
                goto out;
            }
        }
    }
    shmkv_job_t job = { a, shmkv_items_buf, shmkv_parts_buf, rt * a->hq, 0, -1 };
    /* small calls (a decode step of a few short sequences) stay on the caller's thread: a
     * wake-up costs more than it saves */
    const int use = nitems >= 2 && work >= 8192 ? threads : 1;
    shmkv_pool_run(shmkv_att_task, &job, (uint32_t)nitems, use);
    if (job.err) {
        st = job.err;
        if (bad_seq) *bad_seq = job.bad_seq;
        goto out;
    }
    if (chunk != UINT64_MAX)
        shmkv_att_merge(a, shmkv_items_buf, (uint32_t)nitems, shmkv_parts_buf, rt * a->hq);
out:
    pthread_mutex_unlock(&P.call_mu);
    return st;
}

/* ---- the build ------------------------------------------------------------------------
 * The compiler and whether it optimised: what the default mode's recorded result digests
 * (tests/data/attention_default.json) belong to -- another compiler, or -O0, may contract
 * and order float operations differently. */
#if defined(__clang__)
#define SHMKV_CC "clang " __clang_version__
#elif defined(__GNUC__)
#define SHMKV_CC "gcc " __VERSION__
#else
#define SHMKV_CC "cc"
#endif
#if defined(__OPTIMIZE__)
#define SHMKV_OPT ", optimised"
#else
#define SHMKV_OPT ", -O0"
#endif
const char *shmkv_attn_build(void) { return SHMKV_CC SHMKV_OPT; }

/* ---- one timed task per thread (the benchmarks' floors, shmkv._bench) ------------------ */
double shmkv_attn_run_timed(shmkv_task_fn fn, void *job, int threads, int *used,
                            void (*setup)(void *job, int t)) {
    pthread_once(&shmkv_att_once, shmkv_att_init);
    pthread_mutex_lock(&P.call_mu);
    double secs = -1;
    if (shmkv_pool_start() == 0) {
        int t = threads <= 0 || threads > P.wanted ? P.wanted : threads;
        if (t > 256) t = 256;
        setup(job, t);
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        shmkv_pool_run(fn, job, (uint32_t)t, t);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
        *used = t;
    }
    pthread_mutex_unlock(&P.call_mu);
    return secs;
}
