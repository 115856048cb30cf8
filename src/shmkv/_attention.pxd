# shmkv._attention's C API for shmkv._bench: the kernel pool's timed runner.
from libc.stdint cimport uint32_t


cdef extern from "kernels/attention.h" nogil:
    ctypedef void (*shmkv_task_fn)(void *ctx, uint32_t item, int tid) noexcept nogil

cdef double run_timed(shmkv_task_fn fn, void *job, int threads, int *used,
                      void (*setup)(void *job, int t) noexcept nogil) noexcept nogil
