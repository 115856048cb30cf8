/*
 * benchmarks/micro/access_order.c -- does the order in which decode reads a paged K/V pool
 * matter, with and without decode's work per cache line?  (RESULTS_attention_amx.md, fifth
 * pass.)  A standalone measurement, built by `make micro` (benchmarks/out/micro/) or:
 *
 *   gcc -O2 -mavx512f -mavx512bw -mf16c -mfma -o /tmp/access_order \
 *       benchmarks/micro/access_order.c -lpthread && /tmp/access_order 2 [1]
 *
 * The optional second argument 1 asks for 2 MiB pages (madvise MADV_HUGEPAGE on the two
 * buffers; anonymous memory, so it needs /sys/kernel/mm/transparent_hugepage/enabled at
 * "madvise" or "always"): the same orders with a TLB entry per 2 MiB instead of per 4 KiB.
 *
 * The layout is the pool's: [block][16 tokens][8 kv heads][128] float16, K and V apart,
 * 8 sequences x 256 blocks (8 x 4k, 64 MiB each).  Each thread takes whole sequences.
 * Orders, per block: sequential (the read floor's), head-major (the kernel's: each head's
 * 16 rows, 2 KiB apart, K then V), head-major with the next block's rows of that head
 * prefetched (what the kernel does), token-major (address order), token-major with the
 * next block's first lines prefetched, 4-token groups, and head-major with the next block
 * touched sparsely in address order (two lines per page, every 4th or every 8th line), to
 * see whether a few prefetches start the L2 streamer on the rest, and the kernel's order
 * with one line per page prefetched two blocks ahead as well (the page walks done early).  "light": one add per line;
 * "work": per line two float16 -> float32 conversions and eight FMAs (a decode row's
 * share for 4 query vectors).  Best of 7 per order, three rounds.
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>

#define NSEQ 8
#define NBLK 256
#define BS 16
#define H 8
#define D 128
#define ESZ 2
static const size_t ROW = D * ESZ, TOK = H * D * ESZ, BLK = BS * H * D * ESZ;
static uint8_t *K, *V;
static int mode, nthr = 2, work;
static volatile float sink[64];  /* volatile: the sums must be kept */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct { __m512 c[8]; __m512i a; } acc_t;

static inline void rd(const uint8_t *p, size_t n, acc_t *s) {
    if (!work) {
        for (size_t i = 0; i < n; i += 64) s->a = _mm512_add_epi32(s->a, _mm512_loadu_si512(p + i));
        return;
    }
    const __m512 q0 = _mm512_set1_ps(1.0f), q1 = _mm512_set1_ps(2.0f);
    const __m512 q2 = _mm512_set1_ps(3.0f), q3 = _mm512_set1_ps(4.0f);
    for (size_t i = 0; i < n; i += 64) {
        const __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + i)));
        const __m512 y = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + i + 32)));
        s->c[0] = _mm512_fmadd_ps(x, q0, s->c[0]); s->c[1] = _mm512_fmadd_ps(x, q1, s->c[1]);
        s->c[2] = _mm512_fmadd_ps(x, q2, s->c[2]); s->c[3] = _mm512_fmadd_ps(x, q3, s->c[3]);
        s->c[4] = _mm512_fmadd_ps(y, q0, s->c[4]); s->c[5] = _mm512_fmadd_ps(y, q1, s->c[5]);
        s->c[6] = _mm512_fmadd_ps(y, q2, s->c[6]); s->c[7] = _mm512_fmadd_ps(y, q3, s->c[7]);
    }
}

static inline void pf(const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T1);
}

static void *run(void *arg) {
    const long t = (long)arg;
    acc_t s;
    memset(&s, 0, sizeof s);
    for (int q = (int)t; q < NSEQ; q += nthr)
        for (int b = 0; b < NBLK; b++) {
            const size_t off = ((size_t)q * NBLK + b) * BLK;
            const uint8_t *kb = K + off, *vb = V + off;
            const int next = b + 1 < NBLK;
            if (mode == 0) {
                rd(kb, BLK, &s);
                rd(vb, BLK, &s);
            } else if (mode == 1 || mode == 2 || mode == 9) {
                /* mode 9: the kernel's (2), plus one line per page two blocks ahead (the
                 * page walks done early) */
                const int pfn = mode != 1 && next;
                if (mode == 9 && b + 2 < NBLK)
                    for (size_t pg = 0; pg < BLK; pg += 4096) {
                        _mm_prefetch((const char *)kb + 2 * BLK + pg, _MM_HINT_T1);
                        _mm_prefetch((const char *)vb + 2 * BLK + pg, _MM_HINT_T1);
                    }
                for (int h = 0; h < H; h++) {
                    for (int j = 0; j < BS; j++) {
                        if (pfn) pf(kb + BLK + j * TOK + h * ROW, ROW);
                        rd(kb + j * TOK + h * ROW, ROW, &s);
                    }
                    for (int j = 0; j < BS; j++) {
                        if (pfn) pf(vb + BLK + j * TOK + h * ROW, ROW);
                        rd(vb + j * TOK + h * ROW, ROW, &s);
                    }
                }
            } else if (mode == 3 || mode == 4) {
                for (int j = 0; j < BS; j++)
                    for (int h = 0; h < H; h++) rd(kb + j * TOK + h * ROW, ROW, &s);
                if (mode == 4 && next) pf(kb + BLK, 256);
                for (int j = 0; j < BS; j++)
                    for (int h = 0; h < H; h++) rd(vb + j * TOK + h * ROW, ROW, &s);
                if (mode == 4 && next) pf(vb + BLK, 256);
            } else if (mode >= 6) {
                /* head-major; the next block touched sparsely, in address order, spread
                 * over the heads: mode 6 two lines per page, 7 every 4th line, 8 every 8th */
                const size_t step = mode == 6 ? 4096 : mode == 7 ? 256 : 512;
                const size_t per = mode == 6 ? 2 : 1;
                const size_t npos = BLK / step;   /* positions per pool block */
                size_t pos = 0;
                for (int h = 0; h < H; h++) {
                    const size_t e = (size_t)(h + 1) * npos / H;
                    for (; pos < e && next; pos++)
                        for (size_t l = 0; l < per; l++) {
                            _mm_prefetch((const char *)kb + BLK + pos * step + 64 * l, _MM_HINT_T1);
                            _mm_prefetch((const char *)vb + BLK + pos * step + 64 * l, _MM_HINT_T1);
                        }
                    for (int j = 0; j < BS; j++) rd(kb + j * TOK + h * ROW, ROW, &s);
                    for (int j = 0; j < BS; j++) rd(vb + j * TOK + h * ROW, ROW, &s);
                }
            } else {
                for (int jb = 0; jb < BS; jb += 4)
                    for (int h = 0; h < H; h++)
                        for (int j = jb; j < jb + 4; j++) rd(kb + j * TOK + h * ROW, ROW, &s);
                for (int jb = 0; jb < BS; jb += 4)
                    for (int h = 0; h < H; h++)
                        for (int j = jb; j < jb + 4; j++) rd(vb + j * TOK + h * ROW, ROW, &s);
            }
        }
    __m512 c = s.c[0];
    for (int i = 1; i < 8; i++) c = _mm512_add_ps(c, s.c[i]);
    sink[t] = _mm512_reduce_add_ps(c) + (float)_mm512_reduce_add_epi32(s.a);
    return NULL;
}

int main(int argc, char **argv) {
    const size_t n = (size_t)NSEQ * NBLK * BLK;
    K = aligned_alloc(2 << 20, n);
    V = aligned_alloc(2 << 20, n);
    if (!K || !V) return 1;
    if (argc > 2 && atoi(argv[2])) {
        const int rk = madvise(K, n, MADV_HUGEPAGE), rv = madvise(V, n, MADV_HUGEPAGE);
        printf("madvise(MADV_HUGEPAGE): %s\n", rk == 0 && rv == 0 ? "ok" : "refused");
    }
    memset(K, 1, n);
    memset(V, 2, n);
    nthr = argc > 1 ? atoi(argv[1]) : 2;
    if (nthr < 1 || nthr > 64) return 1;
    const char *names[] = {"sequential", "head-major", "head-major + prefetch",
                           "token-major", "token-major + prefetch", "4-token groups",
                           "hm + 2 lines per page", "hm + every 4th line", "hm + every 8th line", "hm + prefetch + pages 2 ahead"};
    for (work = 0; work < 2; work++)
        for (int r = 0; r < 3; r++)
            for (mode = 0; mode < 10; mode++) {
                double best = 1e9;
                for (int it = 0; it < 7; it++) {
                    pthread_t th[64];
                    const double t0 = now();
                    for (long i = 0; i < nthr; i++) pthread_create(&th[i], 0, run, (void *)i);
                    for (int i = 0; i < nthr; i++) pthread_join(th[i], 0);
                    const double dt = now() - t0;
                    if (dt < best) best = dt;
                }
                printf("%-5s round %d  %-24s %6.2f ms  %5.1f GB/s\n", work ? "work" : "light",
                       r, names[mode], best * 1e3, 2.0 * n / best / 1e9);
            }
    free(K);
    free(V);
    return 0;
}
