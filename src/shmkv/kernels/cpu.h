/*
 * kernels/cpu.h -- run-time CPU feature tests and the per-function ISA target macros that
 * gcc and clang both honour.  Owns no data.
 *
 * __builtin_cpu_supports() covers avx2/fma/avx512*, but older clang (14 here) rejects the
 * "f16c" name, so F16C is read from CPUID leaf 1 (ECX bit 29) directly.  The callers test
 * it only together with avx2, whose check already includes the OS's AVX state (XGETBV).
 */
#ifndef SHMKV_KERNELS_CPU_H
#define SHMKV_KERNELS_CPU_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#define SHMKV_X86 1
static inline int shmkv_cpu_has_f16c(void) {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    return (c >> 29) & 1u;
}
#else
#define SHMKV_X86 0
static inline int shmkv_cpu_has_f16c(void) { return 0; }
#endif

#endif /* SHMKV_KERNELS_CPU_H */
