/*
 * kernels/attention.h -- paged attention over block tables (decode and chunked prefill).
 *
 * Owns: nothing in the segment.  It READS one layer's K and V pools and the block tables of
 * the sequences it is given; it writes only the caller's output array.  The caller (the
 * Cython wrapper, shmkv/_attention.pyx) holds every sequence's lock for the whole call, so
 * the tables and lengths are stable against well-behaved peers; a corrupt or hostile
 * segment is still survived: every block id is read once from the table, checked against
 * num_blocks, and only the checked local is used.
 *
 * Math: out[row, h] = softmax(q[row, h] . K[kv(h)]^T * scale) . V[kv(h)], fp32 accumulation,
 * online softmax over tiles of 16 tokens, causal for prefill rows, an exact log-sum-exp
 * merge where one row's keys were split over threads.  GQA: q head h reads kv head
 * h / (hq / hkv); the q heads of one group (and, in prefill, up to 32 query vectors) are the
 * rows of one small GEMM over each K/V tile, so each K/V element is loaded and converted once
 * per group.
 *
 * Threads: sized to the affinity mask, resizable, one call at a time (a process-wide call
 * mutex).  The items run on the team of an OpenMP runtime already in the process (torch's
 * libgomp, found at run time, never linked) so the kernel shares the cores with torch's
 * threads instead of fighting them; otherwise on a pool of the library's own (pthreads).
 * Safe across fork(): the child forgets the parent's threads, never uses OpenMP, and starts
 * its own pool on first use.
 */
#ifndef SHMKV_ATTENTION_H
#define SHMKV_ATTENTION_H

#include <stdint.h>

#include "cpu.h"          /* the ISA levels (SHMKV_ISA_*), probed once */

enum { SHMKV_ATT_F32 = 0, SHMKV_ATT_F16 = 1, SHMKV_ATT_BF16 = 2,
       SHMKV_ATT_I8 = 3,        /* int8 codes, a float32 scale per slot and kv head */
       SHMKV_ATT_E4M3 = 4 };    /* float8 e4m3fn codes, a float32 scale per kv head */
enum { SHMKV_PREC_FP32 = 0,    /* the default: q, K, V, weights as given; fp32 products */
       SHMKV_PREC_BF16 = 1 };   /* opt-in: q (times the scale) and the softmax weights rounded
                                   to bf16 once; the CPU's bf16 / int8 dot instructions */
enum { SHMKV_ATT_OK = 0, SHMKV_ATT_ECORRUPT = 1, SHMKV_ATT_ENOMEM = 2, SHMKV_ATT_EARG = 3 };

typedef struct {
    const uint8_t *kpool;           /* this layer's K pool [num_blocks][block_size][hkv][d] */
    const uint8_t *vpool;           /* this layer's V pool, same shape */
    int kv_dtype;                   /* SHMKV_ATT_F32 / F16 / BF16 / I8 / E4M3 */
    /* quantized pools: the scales are applied to the score (K: q . s k =
     * s (q . k)) and to the probability (V: sum p s v), never per element; shared memory,
     * read as data (NaN/inf give NaN outputs, never an out-of-bounds read) */
    const float *kscale, *vscale;   /* I8: this layer's [num_blocks * block_size][hkv] */
    const float *khead, *vhead;     /* E4M3: this layer's [hkv] */
    uint32_t num_blocks, block_size, hkv, hq, d;
    uint32_t nseq;
    const int32_t *const *tables;   /* [nseq] each sequence's table (shared memory: checked) */
    const uint32_t *seq_lens;       /* [nseq] tokens; 1 <= q_lens[i] <= seq_lens[i] */
    const uint32_t *q_lens;         /* [nseq] query rows of each sequence */
    const uint64_t *q_start;        /* [nseq] first row of each sequence in q / out */
    const void *q;                  /* [rows][hq][d] */
    int q_dtype;                    /* SHMKV_ATT_F32 / F16 / BF16 */
    float *out;                     /* [rows][hq][d] float32 */
    float scale;
    int precision;                  /* SHMKV_PREC_FP32 / BF16 */
} shmkv_attn_args_t;

/* The whole call.  Returns SHMKV_ATT_OK, ECORRUPT (a block id out of range; *bad_seq is the
 * index of the sequence), ENOMEM or EARG.  Call without the GIL. */
int shmkv_attention(const shmkv_attn_args_t *a, int *bad_seq);

int shmkv_attn_set_threads(int n);     /* n >= 1; 0 = the affinity mask's count */
int shmkv_attn_get_threads(void);
int shmkv_attn_cpu_isa(void);          /* the best path this CPU runs */
int shmkv_attn_isa(void);              /* the path in use */
/* -1 = back to the default (cpu.h: the CPU's, capped by SHMKV_ISA); returns 0, or -1 if
 * the CPU does not run it */
int shmkv_attn_force_isa(int isa);
/* 1: prefill rows on the row item only (the path before the GEMM item; for tests and
 * benchmarks), 0: the GEMM item where it applies (the default) */
int shmkv_attn_force_rows(int on);
/* The dot-product instructions the opt-in bf16 mode uses on this CPU, under the ISA in use:
 * bit 1 AVX512_BF16 (bfloat16 pools), bit 2 AVX512_VNNI (int8 pools); 0 = the FMA paths. */
int shmkv_attn_dot_isa(void);
/* 0: the opt-in mode on the FMA paths even where the CPU has the dot instructions (tests,
 * benchmarks); 1: the default, the instructions where the CPU has them */
int shmkv_attn_force_dots(int on);
/* Test hook: the work items the kernel would make for these sequences (wide: the GEMM
 * items or the tiles in use): rows per item, keys per chunk (UINT64_MAX: not split). */
int shmkv_attn_plan(const uint32_t *q_lens, const uint32_t *seq_lens, uint32_t nseq,
                    uint32_t group, int wide, int threads, uint32_t *rt, uint64_t *chunk);
/* The pool the items run on: "openmp" when the process has a libgomp loaded (torch's: its
 * team runs them, see attention.c), else "own" (also in a fork() child and with
 * SHMKV_ATTN_POOL=own). */
const char *shmkv_attn_pool(void);

/* The compiler that built the kernel and whether it optimised ("gcc 12.2.0, optimised"). */
const char *shmkv_attn_build(void);

/* One task of the pool: item `item` of a job, on thread `tid`. */
typedef void (*shmkv_task_fn)(void *ctx, uint32_t item, int tid);
/* For the benchmarks' floors (shmkv._bench, kernels/bench_floor.h): setup(job, t), then
 * tasks 0..t-1 of fn on t threads of the pool (threads 0: all, at most 256), one call at a
 * time like the kernel's.  Returns the seconds the tasks took, or -1 (the pool did not
 * start); *used: t.  Not a Python name: shmkv._attention exports it to shmkv._bench. */
double shmkv_attn_run_timed(shmkv_task_fn fn, void *job, int threads, int *used,
                            void (*setup)(void *job, int t));

#endif
