/*
 * benchmarks/micro/dot_throughput.c -- what one AVX512_BF16 dot product (vdpbf16ps, 32
 * products) costs against an FMA (vfmadd231ps, 16 products), and whether the two share
 * ports (RESULTS_attention_amx.md, fifth pass).  Built by `make micro`, or:
 *
 *   gcc -O2 -o /tmp/dot_throughput benchmarks/micro/dot_throughput.c && /tmp/dot_throughput
 *
 * Needs a CPU with AVX512_BF16.  Twelve independent accumulators per loop (enough to
 * cover either instruction's latency); ns per instruction, two rounds.
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define N 100000000L
#define TGT __attribute__((target("avx512f,avx512bf16"), noinline))

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define DP(a) a = _mm512_dpbf16_ps(a, bh, bh);
#define FM(a) a = _mm512_fmadd_ps(a, b, b);
#define SUM12 _mm512_reduce_add_ps(a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11)
#define ACCS(x) __m512 a0 = x, a1 = x, a2 = x, a3 = x, a4 = x, a5 = x, a6 = x, a7 = x,      \
                       a8 = x, a9 = x, a10 = x, a11 = x

TGT static float dp_only(float f) {
    const __m512 x = _mm512_set1_ps(f);
    ACCS(x);
    const __m512bh bh = (__m512bh)_mm512_castps_si512(x);
    for (long i = 0; i < N / 12; i++) {
        DP(a0) DP(a1) DP(a2) DP(a3) DP(a4) DP(a5) DP(a6) DP(a7) DP(a8) DP(a9) DP(a10) DP(a11)
        __asm__ volatile("" ::"v"(a0));
    }
    return SUM12;
}

TGT static float fma_only(float f) {
    const __m512 x = _mm512_set1_ps(f);
    ACCS(x);
    const __m512 b = x;
    for (long i = 0; i < N / 12; i++) {
        FM(a0) FM(a1) FM(a2) FM(a3) FM(a4) FM(a5) FM(a6) FM(a7) FM(a8) FM(a9) FM(a10) FM(a11)
        __asm__ volatile("" ::"v"(a0));
    }
    return SUM12;
}

TGT static float mixed(float f) {       /* half and half: do they share the FMA ports? */
    const __m512 x = _mm512_set1_ps(f);
    ACCS(x);
    const __m512 b = x;
    const __m512bh bh = (__m512bh)_mm512_castps_si512(x);
    for (long i = 0; i < N / 12; i++) {
        DP(a0) FM(a1) DP(a2) FM(a3) DP(a4) FM(a5) DP(a6) FM(a7) DP(a8) FM(a9) DP(a10) FM(a11)
        __asm__ volatile("" ::"v"(a0));
    }
    return SUM12;
}

int main(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bf16")) {
        puts("this CPU has no AVX512_BF16");
        return 0;
    }
    for (int r = 0; r < 2; r++) {
        const float x = 1e-3f;
        double t = now();
        float s = dp_only(x);
        const double a = now() - t;
        t = now();
        s += fma_only(x);
        const double b = now() - t;
        t = now();
        s += mixed(x);
        const double c = now() - t;
        printf("vdpbf16ps %.3f ns  vfmadd231ps %.3f ns  half/half %.3f ns per instruction  (%g)\n",
               a / N * 1e9, b / N * 1e9, c / N * 1e9, (double)s);
    }
    return 0;
}
