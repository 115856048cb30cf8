/*
 * kernels/bench_floor.h -- what the benchmarks compare the attention kernel with: the read
 * floor (every byte read once on the kernel pool's threads) and the FMA peak.  A header of
 * shmkv._bench (the benchmark and test hooks' module), not of the product: the tasks run
 * on the attention kernel's pool through the runner shmkv._attention exports
 * (shmkv_attn_run_timed), handed in as `run`.  Owns no data.
 */
#ifndef SHMKV_KERNELS_BENCH_FLOOR_H
#define SHMKV_KERNELS_BENCH_FLOOR_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu.h"
#include "attention.h"
#if SHMKV_X86
#include <immintrin.h>
#endif

typedef double (*shmkv_runner_fn)(shmkv_task_fn fn, void *job, int threads, int *used,
                                  void (*setup)(void *job, int t));

/* ---- the read floor ------------------------------------------------------------------- */
typedef struct {
    const uint8_t *buf;
    uint64_t n, per;
    int isa;                    /* SHMKV_ISA_*: the AVX2 loop from SHMKV_ISA_AVX2 up */
    uint64_t sums[256];
} shmkv_read_job_t;

#if SHMKV_X86
__attribute__((target("avx2")))
static uint64_t shmkv_read_avx2(const uint8_t *p, uint64_t n) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    uint64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(p + i)));
        b = _mm256_xor_si256(b, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        c = _mm256_xor_si256(c, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        d = _mm256_xor_si256(d, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    a = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, a);
    uint64_t s = out[0] ^ out[1] ^ out[2] ^ out[3];
    for (; i < n; i++) s += p[i];
    return s;
}
#endif

static uint64_t shmkv_read_plain(const uint8_t *p, uint64_t n) {
    uint64_t s = 0, i = 0, w;
    for (; i + 8 <= n; i += 8) { memcpy(&w, p + i, 8); s ^= w; }
    for (; i < n; i++) s += p[i];
    return s;
}

static void shmkv_read_task(void *ctx, uint32_t i, int tid) {
    (void)tid;
    shmkv_read_job_t *j = ctx;
    uint64_t a = (uint64_t)i * j->per, b = a + j->per > j->n ? j->n : a + j->per;
    if (a >= b) return;
#if SHMKV_X86
    if (j->isa >= SHMKV_ISA_AVX2) { j->sums[i] = shmkv_read_avx2(j->buf + a, b - a); return; }
#endif
    j->sums[i] = shmkv_read_plain(j->buf + a, b - a);
}

/* ---- the FMA peak ---------------------------------------------------------------------
 * float32 lane-FMAs per second: independent FMA chains per thread, registers only, in the
 * vector width of the path in use. */
typedef struct {
    uint64_t n;
    int isa;
    float sums[256];
} shmkv_fma_job_t;

#if SHMKV_X86
/* NC independent chains (distinct starts: equal chains would be merged by the compiler),
 * plus the two constants, all in registers: 16 of 32 zmm, 12 of 16 ymm (enough for 2 FMA
 * ports x 4 cycles of latency) */
#define SHMKV_FMA_CHAINS(T, NC, FMA, SET1, ADD, OUT)                                     \
    do {                                                                               \
        T a[NC];                                                                       \
        _Pragma("GCC unroll 16") for (int k = 0; k < NC; k++) a[k] = SET1(1e-3f * (float)(k + 1)); \
        const T b = SET1(0.9999f), c = SET1(1e-7f);                                    \
        for (uint64_t i = 0; i < n; i++) {                                             \
            _Pragma("GCC unroll 16") for (int k = 0; k < NC; k++) a[k] = FMA(a[k], b, c); \
        }                                                                              \
        T t = a[0];                                                                    \
        _Pragma("GCC unroll 16") for (int k = 1; k < NC; k++) t = ADD(t, a[k]);        \
        float f[16];                                                                   \
        memcpy(f, &t, sizeof t);                                                       \
        OUT = f[0];                                                                    \
    } while (0)
__attribute__((target("avx512f"))) static float shmkv_fma_avx512(uint64_t n) {
    float r;
    SHMKV_FMA_CHAINS(__m512, 16, _mm512_fmadd_ps, _mm512_set1_ps, _mm512_add_ps, r);
    return r;
}
__attribute__((target("avx2,fma"))) static float shmkv_fma_avx2(uint64_t n) {
    float r;
    SHMKV_FMA_CHAINS(__m256, 12, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_add_ps, r);
    return r;
}
#endif

static float shmkv_fma_scalar(uint64_t n) {
    float a[16], r = 0;
    for (int k = 0; k < 16; k++) a[k] = 1e-3f * (float)(k + 1);
    for (uint64_t i = 0; i < n; i++)
        for (int k = 0; k < 16; k++) a[k] = fmaf(a[k], 0.9999f, 1e-7f);
    for (int k = 0; k < 16; k++) r += a[k];
    return r;
}

static void shmkv_fma_task(void *ctx, uint32_t i, int tid) {
    (void)tid;
    shmkv_fma_job_t *j = ctx;
#if SHMKV_X86
    if (j->isa >= SHMKV_ISA_AVX512) { j->sums[i] = shmkv_fma_avx512(j->n); return; }
    if (j->isa == SHMKV_ISA_AVX2) { j->sums[i] = shmkv_fma_avx2(j->n); return; }
#endif
    j->sums[i] = shmkv_fma_scalar(j->n);
}

static void shmkv_fma_setup(void *job, int t) { (void)job; (void)t; }

/* The FMA peak: float32 lane-FMAs per second of `threads` threads (0 = the pool's), each
 * running n rounds of independent FMAs from registers in the width of `isa` (16 chains of
 * 16 lanes for avx512/amx, 12 of 8 for avx2, 16 scalar).  *sink receives the results' sum;
 * -1: the pool did not start. */
static double shmkv_bench_fma(shmkv_runner_fn run, int isa, uint64_t n, int threads,
                              double *sink) {
    shmkv_fma_job_t j;
    memset(&j, 0, sizeof j);
    j.n = n;
    j.isa = isa;
    int t = 0;
    const double secs = run(shmkv_fma_task, &j, threads, &t, shmkv_fma_setup);
    if (secs <= 0) return -1;
    const int lanes = j.isa >= SHMKV_ISA_AVX512 ? 16 : j.isa == SHMKV_ISA_AVX2 ? 8 : 1;
    const double chains = j.isa == SHMKV_ISA_AVX2 ? 12.0 : 16.0;
    double s = 0;
    for (int i = 0; i < t; i++) s += j.sums[i];
    if (sink) *sink = s;
    return (double)t * (double)n * chains * lanes / secs;
}

static void shmkv_read_setup(void *job, int t) {
    shmkv_read_job_t *j = job;
    j->per = ((j->n + (uint64_t)t - 1) / (uint64_t)t + 4095) / 4096 * 4096;
}

/* The read floor: every byte of buf read once by `threads` threads (0 = the pool's), with
 * the AVX2 loop where `isa` has it.  Returns seconds (-1: the pool did not start); *sink
 * receives a checksum so the reads cannot be optimised away. */
static double shmkv_bench_read(shmkv_runner_fn run, int isa, const uint8_t *buf, uint64_t n,
                               int threads, uint64_t *sink) {
    shmkv_read_job_t j;
    memset(&j, 0, sizeof j);
    j.isa = isa;
    j.buf = buf;
    j.n = n;
    int t = 0;
    const double secs = run(shmkv_read_task, &j, threads, &t, shmkv_read_setup);
    if (secs >= 0 && sink) {
        uint64_t s = 0;
        for (int i = 0; i < t; i++) s ^= j.sums[i];
        *sink = s;
    }
    return secs;
}

#endif /* SHMKV_KERNELS_BENCH_FLOOR_H */
