# cython: language_level=3
"""shmkv._checksum: the remote tier's value checksum (kernels/checksum.h), on its own.

The tier (shmkv/tier/codec.py) seals and verifies every value with it; it lives apart from
the cache's modules so that the tier needs nothing of the prefix cache to compute it.  Its
results never change: values in Redis written by older builds still verify.
"""
from libc.stdint cimport uint8_t, uint64_t


cdef extern from "kernels/checksum.h" nogil:
    uint64_t shmkv_tier_checksum(const uint8_t *p, size_t n, uint64_t seed)


def tier_checksum(const uint8_t[::1] data, uint64_t seed=0):
    """The remote tier's value checksum (64-bit; see kernels/checksum.h) of a contiguous
    buffer; the GIL is released for large ones."""
    cdef size_t n = data.shape[0]
    cdef const uint8_t *p = &data[0] if n else NULL
    cdef uint64_t h
    if n >= 65536:
        with nogil:
            h = shmkv_tier_checksum(p, n, seed)
    else:
        h = shmkv_tier_checksum(p, n, seed)
    return h
