# shmkv._prefix: the prefix-cache link of the method chain, and the helpers the sequence
# methods above it share (a prompt's block-hash chain, hashing filled blocks, argument
# checks of token ids, token ranges and salts).
cimport numpy as cnp
from libc.stdint cimport uint32_t, uint64_t, int64_t

from shmkv._core cimport shmkv_ctx_t
from shmkv._inspect cimport InspectOps


cdef class PrefixOps(InspectOps):
    cdef object _tier            # the remote tier this handle writes through to, or None
    cdef int _tier_published(self, shmkv_ctx_t *c, uint32_t slot, uint32_t before) except -1
    cdef cnp.ndarray _chain(self, cnp.ndarray ids, uint32_t nfull, uint64_t *salt)
    cdef int _hash_blocks(self, shmkv_ctx_t *c, uint32_t slot, uint64_t upto) except -1


cdef cnp.ndarray as_ids(object tokens, int64_t n)
cdef int salt_digest(object salt, uint64_t *out) except -1
cdef int token_range(object start, object stop, int64_t L, int64_t s, int64_t *a,
                     int64_t *b) except -1
