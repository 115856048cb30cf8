/*
 * benchmarks/micro/amx_mix.c -- what a few AMX tile products cost the vector and scalar code
 * around them (RESULTS_attention_amx.md, sixth pass).  Built by `make micro`, or:
 *
 *   gcc -O2 -o /tmp/amx_mix benchmarks/micro/amx_mix.c && /tmp/amx_mix
 *
 * Needs AMX-BF16 and a kernel that grants the tiles (arch_prctl ARCH_REQ_XCOMP_PERM).
 * Two loops, with something inserted every k rounds, and without (k = 0):
 *   - FMAs: a round is 1024 vfmadd231ps on 16 independent register chains (the FMA
 *     peak, as _attention.bench_fma measures it); inserted: one tile product (two tile
 *     loads from L1 and a tdpbf16ps);
 *   - adds: a round is 1024 dependent scalar adds of a register (one per cycle: the
 *     core's clock); inserted: a tile product, or 64 dependent 512-bit FMAs, or 64
 *     dependent 256-bit FMAs.
 * A tile product every 64 rounds is one per ~33,000 cycles of FMAs (65,000 of adds): if a
 * loop slows by more than that product's own few cycles, the tiles cost the whole core
 * something (a lower clock while they are in use), not just their ports.  Three rounds.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define TGT __attribute__((target("avx512f,fma,amx-tile,amx-bf16"), noinline))

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} cfg_t;

static uint8_t A[1024] __attribute__((aligned(64))), B[1024] __attribute__((aligned(64)));
static float C[256] __attribute__((aligned(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define TILE_PRODUCT()                                                                 \
    do {                                                                               \
        _tile_loadd(1, A, 64);                                                         \
        _tile_loadd(2, B, 64);                                                         \
        _tile_dpbf16ps(0, 1, 2);                                                       \
    } while (0)

TGT static float fmas(long n, int every) {
    __m512 a[16];
    _Pragma("GCC unroll 16") for (int k = 0; k < 16; k++) a[k] = _mm512_set1_ps(1e-3f * (k + 1));
    const __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(1e-7f);
    for (long i = 0; i < n; i++) {
        for (int r = 0; r < 64; r++)
            _Pragma("GCC unroll 16") for (int k = 0; k < 16; k++) a[k] = _mm512_fmadd_ps(a[k], b, c);
        if (every && i % every == 0) TILE_PRODUCT();
    }
    __m512 t = a[0];
    _Pragma("GCC unroll 16") for (int k = 1; k < 16; k++) t = _mm512_add_ps(t, a[k]);
    _tile_stored(0, C, 64);
    return _mm512_reduce_add_ps(t) + C[0];
}

/* what the adds loop inserts every `every` rounds */
enum { INS_TILE, INS_ZMM, INS_YMM };
static const char *ins_name[] = {"a tile product", "64 zmm FMAs", "64 ymm FMAs"};

TGT static uint64_t adds(long n, int every, int ins) {
    uint64_t x = 1, y = (uint64_t)n | 1;
    __m512 a = _mm512_set1_ps(1.0f);
    __m256 b = _mm256_set1_ps(1.0f);
    const __m512 c = _mm512_set1_ps(0.999f);
    const __m256 d = _mm256_set1_ps(0.999f);
    for (long i = 0; i < n; i++) {
        /* register operands: this core's renamer folds chains of add-immediates */
        for (int r = 0; r < 1024; r += 8)
            __asm__ volatile("add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                             "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0"
                             : "+r"(x) : "r"(y));
        if (!every || i % every) continue;
        if (ins == INS_TILE) TILE_PRODUCT();
        else if (ins == INS_ZMM)
            for (int k = 0; k < 64; k++) { a = _mm512_fmadd_ps(a, c, c); __asm__ volatile("" : "+v"(a)); }
        else
            for (int k = 0; k < 64; k++) { b = _mm256_fmadd_ps(b, d, d); __asm__ volatile("" : "+v"(b)); }
    }
    _tile_stored(0, C, 64);
    return x + (uint64_t)(C[0] + _mm512_reduce_add_ps(a) + b[0]);
}

TGT static void configure(void) {
    cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 3; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    __asm__ volatile("" : : "m"(c) : "memory");   /* see shmkv_amx_config */
    _tile_loadconfig(&c);
    _tile_zero(0);
}

TGT static void release(void) { _tile_release(); }

int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) {
        puts("no AMX tiles for this process");
        return 1;
    }
    configure();
    const int every[] = {0, 1, 4, 16, 64, 256};
    const long n = 200000;
    for (int rep = 0; rep < 3; rep++) {
        puts("FMA peak with a tile product every k rounds (of 1024 FMAs):");
        for (int m = 0; m < 6; m++) {
            double t0 = now();
            volatile float s = fmas(n, every[m]);
            double t = now() - t0;
            (void)s;
            printf("  k = %3d: %6.1f G lane-FMAs/s\n", every[m], n * 1024.0 * 16 / t / 1e9);
        }
        for (int ins = INS_TILE; ins <= INS_YMM; ins++) {
            printf("clock (dependent adds) with %s every k rounds (of 1024 adds):\n", ins_name[ins]);
            for (int m = 0; m < 6; m++) {
                double t0 = now();
                volatile uint64_t u = adds(n, every[m], ins);
                double t = now() - t0;
                (void)u;
                printf("  k = %3d: %5.2f G adds/s\n", every[m], n * 1024.0 / t / 1e9);
            }
        }
        puts("");
    }
    release();
    return 0;
}
