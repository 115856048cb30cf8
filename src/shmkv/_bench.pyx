# cython: language_level=3, binding=False
"""shmkv._bench: the benchmark and test hooks, kept out of the shipped modules (numpy's
_multiarray_tests pattern).  Kernel-only timings, no Python in the timed loop: a block
alloc+free (bench_alloc_free), a memcpy (bench_memcpy), a decode append's rows
(bench_append_rows) -- kernels/bench.h over the pool's kernels --, and what the attention
benchmarks compare the kernel with, on the kernel's own pool: the read floor (bench_read)
and the FMA peak (bench_fma) -- kernels/bench_floor.h, through the runner shmkv._attention
exports.  Not API: the benchmarks, tools and tests use it.
"""
import operator

import numpy as np

cimport cython
cimport numpy as cnp
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset

from shmkv._core cimport *
from shmkv._attention cimport run_timed, shmkv_task_fn

from . import _attention
from .errors import CacheFullError

cnp.import_array()
bind_debug_state()      # it compiles the kernels too: their switches are _core's

cdef extern from "kernels/bench.h" nogil:
    double shmkv_bench_alloc_free(shmkv_ctx_t *c, uint64_t iters, int shared)
    double shmkv_bench_memcpy(uint8_t *dst, const uint8_t *src, uint64_t nbytes,
                              uint64_t span, uint64_t iters, int streaming)
    double shmkv_bench_rows(shmkv_ctx_t *c, const uint8_t *k, const uint8_t *v,
                            const int64_t *slots, uint64_t n, uint64_t iters)

cdef extern from "kernels/bench_floor.h" nogil:
    ctypedef double (*shmkv_runner_fn)(shmkv_task_fn fn, void *job, int threads, int *used,
                                       void (*setup)(void *job, int t) noexcept nogil) noexcept nogil
    double shmkv_bench_fma(shmkv_runner_fn run, int isa, uint64_t n, int threads, double *sink)
    double shmkv_bench_read(shmkv_runner_fn run, int isa, const uint8_t *buf, uint64_t n,
                            int threads, uint64_t *sink)


# --------------------------------------------------------------------------------------
# the pool's kernels, bare (kernels/bench.h)
# --------------------------------------------------------------------------------------
cdef extern from *:
    """
    /* a compiler barrier: the buffer behind p counts as read, its writes must happen */
    static inline void shmkv__keep(void *p) { __asm__ __volatile__("" :: "r"(p) : "memory"); }
    """
    void _keep "shmkv__keep"(void *p) nogil


def bench_alloc_free(Segment cache, uint64_t iters=1000000, bint shared=False):
    """Kernel-only ns per block alloc+free, no Python in the loop.  By default through
    the path reserve()/free() take (this process's own block cache); shared=True: the
    shared free stack under the pool lock."""
    cdef shmkv_ctx_t *c = ctx_of(cache)
    cdef double r
    cdef int sh = shared
    with nogil:
        r = shmkv_bench_alloc_free(c, iters, sh)
    if r < 0:
        raise CacheFullError("bench_alloc_free: no free block")
    return r


def bench_memcpy(uint64_t nbytes, uint64_t iters=1000, uint64_t span=0, bint streaming=False):
    """ns per plain memcpy of nbytes (the physical floor), src/dst walking `span` bytes
    (default nbytes: hot; larger than the last-level cache: cold).  streaming=True: the
    copy with streaming (non-temporal) stores that big appends and gathers use."""
    if span < nbytes:
        span = nbytes
    cdef uint8_t *src = <uint8_t *>malloc(span + 64)
    cdef uint8_t *dst = <uint8_t *>malloc(span + 64)
    cdef double r
    if src == NULL or dst == NULL:
        free(src); free(dst)
        raise MemoryError()
    memset(src, 1, span)
    memset(dst, 2, span)
    _keep(dst)      # or the compiler drops the memset and the timed loop pays the faults
    with nogil:
        r = shmkv_bench_memcpy(dst, src, nbytes, span, iters, streaming)
    free(src); free(dst)
    return r


def bench_append_rows(Segment cache, k, v, slots, uint64_t iters=1000):
    """ns per write of one token into every layer's K and V pool at the rows where the
    paged layout puts ``slots[i % len(slots)]``: the layout-matched floor of a decode
    append (the same 2 * num_layers rows in one strided C copy, no lock, no table).
    k, v: [num_layers, 1, heads, dim] of the pool's dtype; slots: slot ids the caller owns
    (e.g. from reserve), written over."""
    cdef shmkv_ctx_t *c = ctx_of(cache)
    shape = (c.cfg.num_layers, 1, c.cfg.num_kv_heads, c.cfg.head_dim)
    ka, va = np.ascontiguousarray(k), np.ascontiguousarray(v)
    if ka.dtype != cache.config.numpy_dtype or va.dtype != ka.dtype:
        raise TypeError(f"k, v: expected dtype {cache.config.numpy_dtype}, got {ka.dtype}, "
                        f"{va.dtype}")
    if ka.shape != shape or va.shape != shape:
        raise ValueError(f"k, v: expected shape {shape}, got {ka.shape}, {va.shape}")
    cdef cnp.ndarray sl = np.ascontiguousarray(slots, dtype=np.int64)
    cdef int64_t nslots = <int64_t>c.cfg.num_blocks * c.cfg.block_size
    if sl.ndim != 1 or sl.shape[0] == 0 or sl.min() < 0 or sl.max() >= nslots:
        raise ValueError(f"slots: expected a non-empty 1-d array of slot ids in [0, {nslots})")
    if iters == 0:
        raise ValueError("iters: expected >= 1, got 0")
    cdef cnp.ndarray kt = ka, vt = va
    cdef const uint8_t *kp = <const uint8_t *>cnp.PyArray_DATA(kt)
    cdef const uint8_t *vp = <const uint8_t *>cnp.PyArray_DATA(vt)
    cdef const int64_t *sp = <const int64_t *>cnp.PyArray_DATA(sl)
    cdef uint64_t n = <uint64_t>sl.shape[0]
    cdef double r
    with nogil:
        r = shmkv_bench_rows(c, kp, vp, sp, n, iters)
    return r


# --------------------------------------------------------------------------------------
# the attention kernel's bounds (kernels/bench_floor.h), on the kernel's pool
# --------------------------------------------------------------------------------------
def bench_fma(threads=None, rounds=20_000_000):
    """The dot-product bound's rate: float32 multiply-adds per second (lanes counted) on
    ``threads`` threads of the attention kernel's pool (default: all), each running
    ``rounds`` rounds of independent FMA chains from registers (16 of 16 lanes for
    avx512/amx, 12 of 8 for avx2, 16 scalar: the width of the path in use,
    shmkv._attention.isa())."""
    tp = 0 if threads is None else operator.index(threads)
    rp = operator.index(rounds)
    if tp < 0 or tp > 1024:
        raise ValueError(f"threads: expected 0 <= threads <= 1024, got {tp}")
    if rp < 1 or rp > 10 ** 12:
        raise ValueError(f"rounds: expected 1 <= rounds <= 10**12, got {rp}")
    cdef int t = tp
    cdef int isa = _attention.ISA_NAMES.index(_attention.isa())
    cdef uint64_t n = rp
    cdef double sink = 0, rate
    with nogil:
        rate = shmkv_bench_fma(run_timed, isa, n, t, &sink)
    if rate < 0:
        raise MemoryError("bench_fma: no scratch for the pool")
    return rate


@cython.boundscheck(False)
def bench_read(buf, threads=None):
    """The read floor: seconds to read every byte of ``buf`` (a C-contiguous ndarray, e.g. a
    pool view, any dtype) once, on ``threads`` threads of the attention kernel's pool
    (default: all), with the widest loads this CPU has."""
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise TypeError("buf: expected a C-contiguous numpy.ndarray")
    cdef const uint8_t[::1] mv = buf.reshape(-1).view(np.uint8)
    cdef uint64_t sink = 0
    cdef int t = 0 if threads is None else operator.index(threads)
    cdef int isa = _attention.ISA_NAMES.index(_attention.cpu_isa())
    cdef double s
    if mv.shape[0] == 0:
        return 0.0
    with nogil:
        s = shmkv_bench_read(run_timed, isa, &mv[0], <uint64_t>mv.shape[0], t, &sink)
    return s
