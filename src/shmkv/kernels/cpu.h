/*
 * kernels/cpu.h -- the CPU's features, probed once, and the one ladder of instruction-set
 * levels every kernel dispatches on (the attention kernel, the quantizers, the vLLM
 * copy's transpose); numpy's pattern: one feature table, read at first use.
 *
 * Levels (SHMKV_ISA_*), each including the one below:
 *   scalar  portable C
 *   avx2    AVX2 + FMA + F16C (with the OS's AVX state)
 *   avx512  + AVX-512 F, BW, VL (with the OS's zmm/opmask state)
 *   amx     + AMX-TILE, AMX-BF16, AVX512_BF16, and the kernel's permission to use the
 *           tiles (ARCH_REQ_XCOMP_PERM, asked once per process)
 * plus two features beside the ladder (the opt-in bf16 attention mode): AVX512_BF16 and
 * AVX512_VNNI (shmkv_cpu_dots()).
 *
 * The override: SHMKV_ISA=scalar|avx2|avx512|amx caps the level every kernel uses (never
 * above what the CPU has); SHMKV_ATTN_ISA, its older name, is read when SHMKV_ISA is not
 * set.  Read once, at the first probe; the per-kernel test hooks (_attention._force_isa,
 * _quant._force_quant_isa, _vcopy._force_transpose_isa) still pin a level after it.
 *
 * Probed once per extension module (each compiles this header: its statics are the
 * module's own), never per call: CPUID traps to the hypervisor in a VM (13 us a call
 * measured on this project's machines).  __builtin_cpu_supports() covers avx2/fma/
 * avx512*, but older clang (14) rejects the "f16c" name, so F16C, FMA and the AMX and
 * dot features are read from CPUID directly.  Owns no shared data.
 */
#ifndef SHMKV_KERNELS_CPU_H
#define SHMKV_KERNELS_CPU_H

#include <stdlib.h>
#include <string.h>

enum { SHMKV_ISA_SCALAR = 0, SHMKV_ISA_AVX2 = 1, SHMKV_ISA_AVX512 = 2,
       SHMKV_ISA_AMX = 3 };     /* AVX-512 + prefill items on AMX-BF16 tiles */
enum { SHMKV_DOT_BF16 = 1, SHMKV_DOT_VNNI = 2 };    /* shmkv_cpu_dots() bits */

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SHMKV_X86 1

/* The AMX tiles: the CPU has AMX-BF16, AMX-TILE and AVX512_BF16, and the kernel let this
 * process use them (ARCH_REQ_XCOMP_PERM 0x1023, XFEATURE_XTILEDATA 18: per process, kept by
 * fork). */
static inline int shmkv_cpu_probe_amx(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int amx = (d >> 22 & 1) && (d >> 24 & 1);           /* AMX-BF16, AMX-TILE */
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
    const int bf16 = a >> 5 & 1;                               /* AVX512_BF16 */
    return amx && bf16 && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

/* The best level this CPU runs. */
static inline int shmkv_cpu_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return SHMKV_ISA_SCALAR;
    const int f16c_fma = (c >> 29 & 1) && (c >> 12 & 1);
    __builtin_cpu_init();
    if (!f16c_fma || !__builtin_cpu_supports("avx2")) return SHMKV_ISA_SCALAR;
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl")))
        return SHMKV_ISA_AVX2;
    return shmkv_cpu_probe_amx() ? SHMKV_ISA_AMX : SHMKV_ISA_AVX512;
}

static inline int shmkv_cpu_probe_dots(void) {
    unsigned a, b, c, d;
    int r = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (c >> 11 & 1)) r |= SHMKV_DOT_VNNI;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1)) r |= SHMKV_DOT_BF16;
    return r;
}
#else
#define SHMKV_X86 0
static inline int shmkv_cpu_probe(void) { return SHMKV_ISA_SCALAR; }
static inline int shmkv_cpu_probe_dots(void) { return 0; }
#endif

/* A level's name -> SHMKV_ISA_*, or -1. */
static inline int shmkv_isa_of_name(const char *s) {
    return !strcmp(s, "scalar") ? SHMKV_ISA_SCALAR : !strcmp(s, "avx2") ? SHMKV_ISA_AVX2
         : !strcmp(s, "avx512") ? SHMKV_ISA_AVX512 : !strcmp(s, "amx") ? SHMKV_ISA_AMX : -1;
}

/* The override, -1 when none: SHMKV_ISA, else its older name SHMKV_ATTN_ISA. */
static inline int shmkv_cpu_isa_env(void) {
    const char *f = getenv("SHMKV_ISA");
    if (f == NULL || *f == 0) f = getenv("SHMKV_ATTN_ISA");
    return f != NULL && *f != 0 ? shmkv_isa_of_name(f) : -1;
}

/* The feature table, filled at the first call (relaxed atomics: two threads racing both
 * probe and store the same values). */
static int shmkv_cpu_table[3] = { -1, -1, -1 };     /* CPU level, dots, level in use */

static inline void shmkv_cpu_fill(void) {
    if (__atomic_load_n(&shmkv_cpu_table[2], __ATOMIC_ACQUIRE) >= 0) return;
    const int cpu = shmkv_cpu_probe(), dots = shmkv_cpu_probe_dots(), env = shmkv_cpu_isa_env();
    __atomic_store_n(&shmkv_cpu_table[0], cpu, __ATOMIC_RELAXED);
    __atomic_store_n(&shmkv_cpu_table[1], dots, __ATOMIC_RELAXED);
    __atomic_store_n(&shmkv_cpu_table[2], env >= 0 && env < cpu ? env : cpu, __ATOMIC_RELEASE);
}

/* The best level the CPU runs (the override ignored). */
static inline int shmkv_cpu_best(void) {
    shmkv_cpu_fill();
    return __atomic_load_n(&shmkv_cpu_table[0], __ATOMIC_RELAXED);
}

/* The level the kernels use by default: the CPU's, capped by the override. */
static inline int shmkv_cpu_isa(void) {
    shmkv_cpu_fill();
    return __atomic_load_n(&shmkv_cpu_table[2], __ATOMIC_RELAXED);
}

/* SHMKV_DOT_* bits the CPU has. */
static inline int shmkv_cpu_dots(void) {
    shmkv_cpu_fill();
    return __atomic_load_n(&shmkv_cpu_table[1], __ATOMIC_RELAXED);
}

#endif /* SHMKV_KERNELS_CPU_H */
