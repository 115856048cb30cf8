# cython: language_level=3, binding=False
# binding=False: the methods of the cdef classes are method descriptors, which check
# self; Cython 3's cyfunctions do not (KVCache.unlink("name") crashed the interpreter).
"""shmkv._kvdata: the K/V bytes of sequences, in and out -- the decode loop's calls.

DataOps (the last link of the method chain; KVCache subclasses it): append, reserve,
write, gather, the zero-copy pool views key_cache / value_cache, and growing a sequence
(new tail blocks, copy-on-write of a shared partial block) for append and reserve.

Quantized pools (int8, float8_e4m3): the codecs, scale views and the
quantized gather are the link below (_quant.QuantOps); append and write call its
quantizer before any lock is taken.

Writes: K/V pool bytes (and an int8 pool's scale rows beside them) of blocks in a sequence's table beyond its published length, or of
slots the caller reserved (write, the pool views); seq.len (the publish: store-release,
under the sequence lock), seq.flags and token ids (sequence lock); table entries, ref_cnt
and in-flight records of a grow / COW (through the kernels, under pool_lock or on this
process's cache fast path).
"""
import time

import numpy as np

cimport numpy as cnp
from libc.stdint cimport uint8_t, int8_t, uint32_t, uint64_t, int32_t, int64_t

from shmkv._core cimport *
from shmkv._quant cimport QuantOps, _aligned_empty
from shmkv._prefix cimport as_ids, token_range

from .errors import CacheFullError

cnp.import_array()
bind_debug_state()


cdef class DataOps(QuantOps):
    cdef cnp.ndarray _array(self, object a, str what, int ndim):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{what}: expected numpy.ndarray, got {type(a).__name__}")
        cdef cnp.ndarray arr = <cnp.ndarray>a
        if <void *>cnp.PyArray_DESCR(arr) != <void *>self._descr:
            if arr.dtype != self._dtype or not arr.dtype.isnative:
                raise TypeError(f"{what}: expected dtype {self._dtype}, got {arr.dtype}")
        if cnp.PyArray_NDIM(arr) != ndim:
            raise ValueError(f"{what}: expected a {ndim}-d array, got shape {(<object>arr).shape}")
        if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
            arr = np.ascontiguousarray(arr)
        return arr

    cdef int _check_tokens(self, cnp.ndarray k, cnp.ndarray v) except -1:
        """k, v: [num_layers, n, heads, dim], n >= 1."""
        cdef shmkv_config_t *cf = &self.ctx.cfg
        cdef cnp.npy_intp *s = cnp.PyArray_DIMS(k)
        if (s[0] != cf.num_layers or s[2] != cf.num_kv_heads or s[3] != cf.head_dim
                or s[1] < 1):
            raise ValueError(
                f"k: expected shape ({cf.num_layers}, n >= 1, {cf.num_kv_heads}, "
                f"{cf.head_dim}), got {(<object>k).shape}")
        if (<object>k).shape != (<object>v).shape:
            raise ValueError(f"v: expected shape {(<object>k).shape} (as k), got {(<object>v).shape}")
        return 0

    # ---- growing a sequence: shared by append and reserve ------------------------------
    cdef int _lock_and_grow(self, shmkv_ctx_t *c, int64_t s, uint64_t n, uint32_t *slot,
                            shmkv_grow_plan_t *pl) except -1:
        """Takes the sequence lock and makes room for n more tokens.  Returns holding
        the lock; on an error the lock is released and nothing was published."""
        cdef int st
        seq_lock(c, s, slot)
        try:
            st = shmkv_seq_plan(c, slot[0], n, pl)
            if st != SHMKV_OK:
                self._plan_error(st, s, n)
            if pl.new_blocks or pl.cow:
                self._grow(c, slot[0], n, pl, s)
            st = shmkv_seq_check_span(c, slot[0], pl.len, n)
            if st != SHMKV_OK:
                raise_status(st, f"sequence {s}")
        except BaseException:
            shmkv_seq_unlock(c, slot[0])
            raise
        return 0

    cdef int _grow(self, shmkv_ctx_t *c, uint32_t slot, uint64_t n,
                   shmkv_grow_plan_t *pl, int64_t sid) except -1:
        """Caller holds the sequence lock.  Makes room for n tokens after pl.len: new
        blocks into the table, and a private copy of a shared partial last block.  On
        return the table holds every block the n tokens go to; nothing is published."""
        cdef int st
        cdef uint32_t target = SHMKV_NIL, src
        cdef shmkv_recovery_t r
        cdef int tries = 0
        cdef uint64_t free_now = 0
        if not pl.cow:
            st = shmkv_pcache_grow(c, slot, pl)       # from this process's own cache
            if st == SHMKV_OK:
                return 0
            if st != SHMKV_EAGAIN:
                raise_status(st, f"sequence {sid}")
        while True:
            pool_lock(c)
            st = shmkv_seq_grow_locked(c, slot, pl, &target)
            if st == SHMKV_EFULL and shmkv_pcache_drain_all_locked(c) == SHMKV_OK:
                # blocks other processes keep in their caches are free, not "full"
                st = shmkv_seq_grow_locked(c, slot, pl, &target)
            if st == SHMKV_EFULL:
                # recovery before raising CacheFullError: dead processes' blocks return
                # (a pass only when someone is dead, and only over what died: a
                # saturated pool stays cheap)
                if (shmkv_recover_needed(c)
                        and shmkv_recover_dead_locked(c, &r) == SHMKV_OK
                        and (r.blocks or r.sequences)):
                    st = shmkv_seq_plan(c, slot, n, pl)
                    if st == SHMKV_OK:
                        st = shmkv_seq_grow_locked(c, slot, pl, &target)
            if st == SHMKV_EFULL:
                shmkv_counts(c, &free_now, NULL, NULL)
            elif st == SHMKV_OK:
                shmkv_pcache_balance_locked(c)     # refill our cache while we are here
            shmkv_pool_unlock(c)
            if st == SHMKV_EAGAIN and tries < 10000:     # in-flight records all busy
                tries += 1
                time.sleep(0.0005)
                continue
            break
        if st == SHMKV_EFULL:
            raise CacheFullError(
                f"sequence {sid}: the block pool is exhausted: {n} more tokens need "
                f"{pl.new_blocks + pl.cow} blocks, {free_now} free")
        if st != SHMKV_OK:
            raise_status(st, f"sequence {sid}")
        if not pl.cow:
            return 0
        src = <uint32_t>shmkv_table(c, slot)[pl.cow_index]
        try:
            with nogil:
                shmkv_block_copy(c, src, target, pl.len % c.cfg.block_size)
            shmkv_crash(SHMKV_CP_COW_AFTER_COPY)
            pool_lock(c)
            st = shmkv_seq_cow_commit_locked(c, slot, pl.cow_index, target)
            shmkv_pool_unlock(c)
            if st != SHMKV_OK:
                raise_status(st, f"sequence {sid}")
            target = SHMKV_NIL
        finally:
            if target != SHMKV_NIL:             # interrupted: give the copy back
                if shmkv_pool_lock(c) == SHMKV_OK:
                    shmkv_inflight_release_locked(c, target)
                    shmkv_pool_unlock(c)
        return 0

    # ---- the decode loop -----------------------------------------------------------------
    def append(self, sid, k, v, tokens=None):
        """Append n tokens to a sequence, every layer at once.

        Parameters
        ----------
        sid : int
        k, v : ndarray
            ``[num_layers, n, num_kv_heads, head_dim]`` of the cache's dtype, n >= 1.
        tokens : array-like of n ints, optional
            The token ids of these n tokens.  Every block they fill is hashed and, when
            the call returns, findable by every process (prefix cache).  A sequence
            appended to without tokens stops being hashed.

        Notes
        -----
        The tokens become visible to gather (in every process) all together, when the
        call returns.  Raises CacheFullError with no effect when the pool is short.
        """
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t s = as_sid(sid)
        cdef bint quant = shmkv_dtype_quantized(c.cfg.dtype)
        cdef cnp.ndarray ka, va, ksc = None, vsc = None
        if quant:
            ka = self._farray(k, "k", 4)
            va = self._farray(v, "v", 4)
        else:
            ka = self._array(k, "k", 4)
            va = self._array(v, "v", 4)
        self._check_tokens(ka, va)
        cdef uint64_t n = <uint64_t>cnp.PyArray_DIMS(ka)[1]
        if quant:          # into scratch, before any lock: bad input changes nothing
            ka, ksc = self._quantize(ka, c.cfg.num_layers, n, 0, 0, "k")
            va, vsc = self._quantize(va, c.cfg.num_layers, n, 0, 1, "v")
        cdef uint32_t slot
        cdef shmkv_grow_plan_t pl
        cdef uint8_t *kb = <uint8_t *>cnp.PyArray_DATA(ka)
        cdef uint8_t *vb = <uint8_t *>cnp.PyArray_DATA(va)
        cdef uint8_t *ksb = NULL if ksc is None else <uint8_t *>cnp.PyArray_DATA(ksc)
        cdef uint8_t *vsb = NULL if vsc is None else <uint8_t *>cnp.PyArray_DATA(vsc)
        cdef cnp.ndarray ids = None if tokens is None else as_ids(tokens, n)
        cdef uint32_t before
        self._lock_and_grow(c, s, n, &slot, &pl)
        try:
            if ids is None:
                c.seqs[slot].flags |= SHMKV_SEQF_UNTRACKED
            else:
                shmkv_seq_tokens(c, slot, pl.len, n, <int32_t *>cnp.PyArray_DATA(ids), 1)
            if shmkv_dbg.plant == SHMKV_PLANT_EARLY_PUBLISH:     # planted bug, see plant_bug()
                shmkv_atomic_store_u32_release(&c.seqs[slot].len, <uint32_t>(pl.len + n))
            with nogil:
                shmkv_seq_copy(c, slot, pl.len, n, c.kpool, kb, 1)
                shmkv_seq_copy(c, slot, pl.len, n, c.vpool, vb, 1)
                if ksb != NULL:         # an int8 pool's scales, beside their codes
                    shmkv_seq_copy_rows(c, slot, pl.len, n, <uint8_t *>c.kscale,
                                        c.lay.scale_stride, c.lay.scale_bytes, ksb, 1)
                    shmkv_seq_copy_rows(c, slot, pl.len, n, <uint8_t *>c.vscale,
                                        c.lay.scale_stride, c.lay.scale_bytes, vsb, 1)
            if quant:                   # the scratch, for this handle's next call
                self._scratch_back(0, ka)
                self._scratch_back(1, va)
            if ids is not None:
                self._hash_blocks(c, slot, pl.len + n)
            shmkv_crash(SHMKV_CP_APPEND_BEFORE_PUBLISH)
            shmkv_atomic_store_u32_release(&c.seqs[slot].len, <uint32_t>(pl.len + n))
            shmkv_crash(SHMKV_CP_APPEND_AFTER_PUBLISH)
            shmkv_seq_touch(c, slot)
            shmkv_count_proc(c, SHMKV_PC_APPENDED, n)
            if c.seqs[slot].hash_ready > c.seqs[slot].hashed:
                before = c.seqs[slot].hashed
                pool_lock(c)
                shmkv_seq_publish_locked(c, slot)
                shmkv_pool_unlock(c)
                if self._tier is not None:          # write-through: a queue put, no I/O
                    self._tier_published(c, slot, before)
        finally:
            shmkv_seq_unlock(c, slot)

    cdef int _plan_error(self, int st, int64_t s, uint64_t n) except -1:
        if st == SHMKV_ETOOLONG:
            raise CacheFullError(
                f"sequence {s}: {n} more tokens would exceed max_seq_len "
                f"({self.ctx.cfg.max_blocks_per_seq * self.ctx.cfg.block_size} tokens)")
        raise_status(st, f"sequence {s}")

    def reserve(self, sid, n, tokens=None):
        """Grow a sequence by n tokens and return their slot ids.

        With ``tokens`` (n token ids) the blocks these tokens fill are hashed; they
        become findable by other processes at ``commit(sid)``, which the caller calls
        once write() has written every layer.

        Returns
        -------
        ndarray of int64, shape [n]
            ``slot = block_id * block_size + offset`` of each new token, for
            :meth:`write`.  The new length is visible at once; the data is whatever the
            caller writes into the slots.
        """
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t s = as_sid(sid)
        if type(n) is not int and (isinstance(n, bool) or not isinstance(n, (int, np.integer))):
            raise TypeError(f"n: expected int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"n: expected n >= 1, got {n}")
        if n > <int64_t>c.cfg.max_blocks_per_seq * c.cfg.block_size:
            raise CacheFullError(
                f"sequence {s}: {n} more tokens would exceed max_seq_len "
                f"({c.cfg.max_blocks_per_seq * c.cfg.block_size} tokens)")
        cdef uint64_t nn = <uint64_t>n
        cdef uint32_t slot
        cdef shmkv_grow_plan_t pl
        cdef cnp.npy_intp dims[1]
        dims[0] = <cnp.npy_intp>nn
        cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT64, 0)
        cdef cnp.ndarray ids = None if tokens is None else as_ids(tokens, nn)
        self._lock_and_grow(c, s, nn, &slot, &pl)
        try:
            shmkv_seq_slots(c, slot, pl.len, nn, <int64_t *>cnp.PyArray_DATA(out))
            if ids is None:
                c.seqs[slot].flags |= SHMKV_SEQF_UNTRACKED
            else:
                shmkv_seq_tokens(c, slot, pl.len, nn, <int32_t *>cnp.PyArray_DATA(ids), 1)
                self._hash_blocks(c, slot, pl.len + nn)
            shmkv_atomic_store_u32_release(&c.seqs[slot].len, <uint32_t>(pl.len + nn))
            shmkv_seq_touch(c, slot)
            shmkv_count_proc(c, SHMKV_PC_APPENDED, nn)
        finally:
            shmkv_seq_unlock(c, slot)
        return out

    def write(self, layer, slots, k, v):
        """Scatter tokens of one layer into slots (vLLM's reshape_and_cache).

        Parameters
        ----------
        layer : int
        slots : ndarray of int64, shape [n]   (from :meth:`reserve`)
        k, v : ndarray [n, num_kv_heads, head_dim] of the cache's dtype
        """
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t lyr = self._layer(layer)
        cdef bint quant = shmkv_dtype_quantized(c.cfg.dtype)
        if not isinstance(slots, np.ndarray):
            raise TypeError(f"slots: expected numpy.ndarray of int64, got {type(slots).__name__}")
        if slots.dtype.kind not in "iu":
            raise TypeError(f"slots: expected an integer dtype, got {slots.dtype}")
        if slots.ndim != 1:
            raise ValueError(f"slots: expected a 1-d array, got shape {slots.shape}")
        cdef cnp.ndarray sa = np.ascontiguousarray(slots, dtype=np.int64)
        cdef cnp.ndarray ka, va, ksc = None, vsc = None
        if quant:
            ka = self._farray(k, "k", 3)
            va = self._farray(v, "v", 3)
        else:
            ka = self._array(k, "k", 3)
            va = self._array(v, "v", 3)
        cdef uint64_t n = <uint64_t>cnp.PyArray_DIMS(sa)[0]
        cdef shmkv_config_t *cf = &c.cfg
        if n < 1:
            raise ValueError("slots: expected n >= 1 slots, got 0")
        kshape, vshape = (<object>ka).shape, (<object>va).shape
        if kshape != (n, cf.num_kv_heads, cf.head_dim):
            raise ValueError(
                f"k: expected shape ({n}, {cf.num_kv_heads}, {cf.head_dim}), got {kshape}")
        if vshape != kshape:
            raise ValueError(f"v: expected shape {kshape} (as k), got {vshape}")
        if quant:          # into scratch first: bad input changes nothing
            ka, ksc = self._quantize(ka, 1, n, <uint32_t>lyr, 0, "k")
            va, vsc = self._quantize(va, 1, n, <uint32_t>lyr, 1, "v")
        cdef int64_t bad = -1
        cdef int st
        cdef const int64_t *sp = <const int64_t *>cnp.PyArray_DATA(sa)
        cdef const uint8_t *kb = <const uint8_t *>cnp.PyArray_DATA(ka)
        cdef const uint8_t *vb = <const uint8_t *>cnp.PyArray_DATA(va)
        cdef const uint8_t *ksb = NULL if ksc is None else <const uint8_t *>cnp.PyArray_DATA(ksc)
        cdef const uint8_t *vsb = NULL if vsc is None else <const uint8_t *>cnp.PyArray_DATA(vsc)
        with nogil:
            st = shmkv_write_slots(c, <uint32_t>lyr, sp, n, kb, vb, &bad)
            if st == SHMKV_OK and ksb != NULL:      # int8: the scale rows of the same slots
                st = shmkv_write_rows(c, <uint32_t>lyr, sp, n, <uint8_t *>c.kscale,
                                      <uint8_t *>c.vscale, c.lay.scale_stride,
                                      c.lay.scale_bytes, ksb, vsb, &bad)
        if quant:
            self._scratch_back(0, ka)
            self._scratch_back(1, va)
        if st == SHMKV_ERANGE:
            raise IndexError(
                f"slots[{bad}]: expected 0 <= slot < {cf.num_blocks * cf.block_size}, "
                f"got {sa[bad]}")
        if st != SHMKV_OK:
            raise_status(st, "write")

    # ---- zero-copy pools ----------------------------------------------------------------
    cdef object _pool_view(self, object layer, bint is_k):
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t lyr = self._layer(layer)
        off = (c.lay.off_kpool if is_k else c.lay.off_vpool) + lyr * c.lay.layer_stride
        count = <int64_t>c.cfg.num_blocks * c.cfg.block_size * self._tokw
        arr = np.frombuffer(self._att.mapping, dtype=self._dtype, count=count, offset=off)
        return arr.reshape(c.cfg.num_blocks, c.cfg.block_size, c.cfg.num_kv_heads,
                           c.cfg.head_dim)

    def key_cache(self, layer):
        """Zero-copy view [num_blocks, block_size, num_kv_heads, head_dim] of one layer's
        K pool; writes through it land in shared memory."""
        return self._pool_view(layer, True)

    def value_cache(self, layer):
        """Zero-copy view of one layer's V pool (see key_cache)."""
        return self._pool_view(layer, False)

    def gather(self, sid, start=None, stop=None, *, out=None, raw=False):
        """Read tokens [start, stop) of a sequence, every layer.

        Returns
        -------
        (k, v) : ndarrays [num_layers, stop - start, num_kv_heads, head_dim]
            New C-contiguous arrays, or the two arrays of ``out`` (which must be
            C-contiguous, writable, of that shape and the cache's compute dtype:
            float32 for a quantized pool, whose codes are dequantized).
        (k, v, k_scales, v_scales) : with ``raw=True`` (quantized pools only)
            The stored codes (int8, or ml_dtypes.float8_e4m3fn) and their float32
            scales: ``[num_layers, n, num_kv_heads]`` for int8, the per-head tables
            ``[num_layers, num_kv_heads]`` for float8_e4m3.  ``x = code * scale``.
        """
        if raw or shmkv_dtype_quantized(ctx_of(self).cfg.dtype):
            return self._gather_quant(sid, start, stop, out, raw)
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t s = as_sid(sid)
        cdef uint32_t slot
        cdef int64_t a, b
        cdef int st
        cdef cnp.ndarray ko, vo
        cdef uint8_t *kb
        cdef uint8_t *vb
        seq_lock(c, s, &slot)
        try:
            token_range(start, stop, valid_len(c, slot, s), s, &a, &b)
            shape = (c.cfg.num_layers, b - a, c.cfg.num_kv_heads, c.cfg.head_dim)
            if out is None:
                ko = _aligned_empty(shape, self._dtype)
                vo = _aligned_empty(shape, self._dtype)
            else:
                ko, vo = self._check_out(out, shape)
            st = shmkv_seq_check_span(c, slot, a, b - a)
            if st != SHMKV_OK:
                raise_status(st, f"sequence {s}")
            kb = <uint8_t *>cnp.PyArray_DATA(ko)
            vb = <uint8_t *>cnp.PyArray_DATA(vo)
            with nogil:
                shmkv_seq_copy(c, slot, a, b - a, c.kpool, kb, 0)
                shmkv_seq_copy(c, slot, a, b - a, c.vpool, vb, 0)
            shmkv_seq_touch(c, slot)
            shmkv_count_proc(c, SHMKV_PC_GATHERED, b - a)
        finally:
            shmkv_seq_unlock(c, slot)
        if out is not None:
            return out
        return ko, vo


def empty_gather_buffers(cache, Py_ssize_t n_tokens):
    """A (k_out, v_out) pair for ``gather(..., out=)`` of n_tokens tokens, page-aligned
    like the pools (the fastest destination: see _aligned_empty)."""
    cfg = cache.config
    shape = (cfg.num_layers, n_tokens, cfg.num_kv_heads, cfg.head_dim)
    return _aligned_empty(shape, cfg.compute_dtype), _aligned_empty(shape, cfg.compute_dtype)


