# cython: language_level=3, binding=False
# binding=False: the methods of the cdef classes are method descriptors, which check
# self; Cython 3's cyfunctions do not (KVCache.unlink("name") crashed the interpreter).
"""shmkv._sequences: the life of a sequence and its tables.

SequenceOps (above _prefix.PrefixOps in the method chain): create_sequence (from this
process's cache of free slots, or under pool_lock, taking a prefix-cache hit), fork,
free, truncate, sequences, seq_len, block_table, batch_block_tables, and ownership
(detach, adopt, owner_pid).

Writes (through the kernels unless said): sequence slots (state, gen, owner, priority,
salt, table, nblocks; len, flags and hashing state on truncate), block ref_cnt, the
free stacks and this process's caches (under pool_lock, or on the process-cache fast
paths under its own cache_lock); seq.salt of a slot just created (directly: nobody else
can reach it yet); seq.owner (directly, under the sequence lock and pool_lock).  No K/V data: that is _kvdata's.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t, INT64_MAX
from libc.stdlib cimport malloc, free
from cpython.object cimport PyObject

from shmkv._core cimport *
from shmkv._prefix cimport PrefixOps, as_ids, salt_digest

from .errors import CacheFullError, SequenceNotFound

cnp.import_array()
bind_debug_state()


cdef extern from *:
    """
    #if PY_VERSION_HEX < 0x030B0000
    #include "longintrepr.h"        /* PyLongObject's digits (in Python.h from 3.11 on) */
    #endif
    /* A plain int's value when it fits int64 (1), else 0: the one- and zero-digit ints
     * (every sequence id short of 2^30) read inline, the others through the C API. */
    static inline int shmkv_plain_int64(PyObject *o, int64_t *out) {
    #if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
            *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)o);
            return 1;
        }
    #else
        const Py_ssize_t n = Py_SIZE(o);
        if (n >= -1 && n <= 1) {
            *out = (int64_t)n * (int64_t)((PyLongObject *)o)->ob_digit[0];
            return 1;
        }
    #endif
        int ovf = 0;
        const long long v = PyLong_AsLongLongAndOverflow(o, &ovf);
        if (ovf) return 0;
        *out = (int64_t)v;
        return 1;
    }
    """
    PyObject **PySequence_Fast_ITEMS(object o)
    bint PyLong_CheckExact(PyObject *o)
    bint shmkv_plain_int64(PyObject *o, int64_t *out)


cdef bint _plain_int_ids(object sids, int64_t *out, Py_ssize_t n):
    """The n items of a list or tuple (``type(sids)`` checked by the caller) into out when
    every one is a plain int that fits int64; False otherwise (the general path then checks
    them item by item).  Borrowed item pointers, no Python code runs: the list cannot
    change under the loop."""
    cdef PyObject **items = PySequence_Fast_ITEMS(sids)
    cdef Py_ssize_t i
    for i in range(n):
        if not PyLong_CheckExact(items[i]) or not shmkv_plain_int64(items[i], &out[i]):
            return False
    return True


cdef class SequenceOps(PrefixOps):
    def create_sequence(self, tokens=None, salt=None, *, int priority=0):
        """Create a sequence owned by this process.

        Parameters
        ----------
        tokens : array-like of int, optional
            The prompt's token ids.  The sequence starts out sharing the longest run of
            full blocks of ``tokens`` that any process has published (never the last
            token: it must be computed); ``seq_len(sid)`` says how many tokens are
            already there.  Append the rest with ``append(..., tokens=...)``.
        salt : str or bytes, optional
            Cache salt (tenant isolation): only sequences with the same salt share.
        priority : int
            For ``evict("priority")``: lower priorities are evicted first.

        Returns
        -------
        int
            Its id, unique among the live sequences of the segment.

        Raises
        ------
        CacheFullError
            Every sequence slot is taken.
        """
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t sid = -1
        cdef int st
        cdef uint32_t slot, nfull = 0, hits = 0
        cdef shmkv_recovery_t r
        cdef cnp.ndarray ids = None, hashes = None
        cdef uint64_t sd[2]
        if priority < 0:
            raise ValueError(f"priority: expected >= 0, got {priority}")
        salt_digest(salt, sd)
        if tokens is not None:
            ids = as_ids(tokens, -1)
            if ids.shape[0] > 1:
                nfull = min((ids.shape[0] - 1) // c.cfg.block_size, c.cfg.max_blocks_per_seq)
            if nfull:
                hashes = self._chain(ids, nfull, sd)
        if ids is None:
            st = shmkv_pcache_create(c, <uint32_t>priority, &sid)   # no shared line
            if st == SHMKV_OK:
                slot = <uint32_t>(sid % c.cfg.max_seqs)
                c.seqs[slot].salt[0] = sd[0]
                c.seqs[slot].salt[1] = sd[1]
                return sid
            if st != SHMKV_EAGAIN:
                raise_status(st, "create_sequence")
        pool_lock(c)
        st = shmkv_seq_create_locked(c, <uint32_t>priority, &sid)
        if st == SHMKV_ESEQFULL and shmkv_pcache_drain_all_locked(c) == SHMKV_OK:
            st = shmkv_seq_create_locked(c, <uint32_t>priority, &sid)
        if (st == SHMKV_ESEQFULL and shmkv_recover_needed(c)
                and shmkv_recover_dead_locked(c, &r) == SHMKV_OK and r.sequences):
            st = shmkv_seq_create_locked(c, <uint32_t>priority, &sid)
        if st == SHMKV_OK:
            shmkv_pcache_balance_locked(c)
            slot = <uint32_t>(sid % c.cfg.max_seqs)
            c.seqs[slot].salt[0] = sd[0]
            c.seqs[slot].salt[1] = sd[1]
            if ids is not None:
                if nfull:
                    hits = shmkv_prefix_take_locked(
                        c, slot, <const uint64_t *>cnp.PyArray_DATA(hashes), nfull)
                shmkv_count(c, SHMKV_C_PREFIX_QUERIES, ids.shape[0])
                shmkv_count(c, SHMKV_C_PREFIX_HITS, hits * c.cfg.block_size)
        shmkv_pool_unlock(c)
        if st != SHMKV_OK:
            if st == SHMKV_ESEQFULL:
                raise CacheFullError(
                    f"create_sequence: all {c.cfg.max_seqs} sequence slots are taken")
            raise_status(st, "create_sequence")
        if self._tier is not None and self._tier.read and hits < nfull:
            # the remote tier's consecutive blocks, loaded into this sequence and
            # published (shmkv/tier/): never raises but for an interrupt, which frees sid
            try:
                self._tier.extend(self, sid, ids, salt, hashes, hits)
            except BaseException:
                self.free(sid)
                raise
        return sid

    def fork(self, sid):
        """A new sequence sharing every block of `sid` copy-on-write.

        The child is owned by this process.  Appends to either sequence never change
        what the other gathers: a shared partial last block is copied before it is
        written.
        """
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t s = as_sid(sid), child = -1
        cdef int st
        cdef uint32_t slot
        cdef shmkv_recovery_t r
        # the parent's lock: its free may run on its owner's fast path (no pool lock)
        seq_lock(c, s, &slot)
        try:
            pool_lock(c)
        except BaseException:
            shmkv_seq_unlock(c, slot)
            raise
        st = shmkv_seq_fork_locked(c, s, &child)
        if st == SHMKV_ESEQFULL and shmkv_pcache_drain_all_locked(c) == SHMKV_OK:
            st = shmkv_seq_fork_locked(c, s, &child)
        if (st == SHMKV_ESEQFULL and shmkv_recover_needed(c)
                and shmkv_recover_dead_locked(c, &r) == SHMKV_OK and r.sequences):
            st = shmkv_seq_fork_locked(c, s, &child)
        shmkv_pool_unlock(c)
        shmkv_seq_unlock(c, slot)
        if st != SHMKV_OK:
            if st == SHMKV_ESEQFULL:
                raise CacheFullError(
                    f"fork({s}): all {c.cfg.max_seqs} sequence slots are taken")
            raise_status(st, f"fork({s})")
        return child

    def seq_len(self, sid):
        """Tokens in the sequence."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef uint32_t slot
        cdef int64_t s = as_sid(sid)
        cdef int st = shmkv_sid_slot(c, s, &slot)
        cdef uint32_t n = 0
        if st == SHMKV_OK:
            n = shmkv_atomic_load_u32_acquire(&c.seqs[slot].len)
            st = shmkv_sid_slot(c, s, &slot)      # freed meanwhile? (no lock taken)
        if st != SHMKV_OK:
            raise_status(st, f"sequence {s}")
        return n

    def block_table(self, sid):
        """int32 ndarray of the physical block ids of a sequence, in logical order."""
        return self.batch_block_tables(np.array([as_sid(sid)], np.int64))[0][0]

    def batch_block_tables(self, sids):
        """Block tables of a batch, padded with -1.

        Returns
        -------
        tables : int32 ndarray [batch, W], W the longest table of the batch
        lens : int32 ndarray [batch], each sequence's length in tokens
        """
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef cnp.ndarray sa = None
        cdef int64_t ids_small[512]
        cdef int64_t *ids = NULL                    # a list/tuple's ids, read in place
        cdef const int64_t *sp
        cdef size_t B = 0
        if (cnp.PyArray_CheckExact(sids) and cnp.PyArray_TYPE(<cnp.ndarray>sids) == cnp.NPY_INT64
                and cnp.PyArray_NDIM(<cnp.ndarray>sids) == 1
                and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>sids)
                and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>sids)):
            sa = <cnp.ndarray>sids                  # fast path: a native int64 vector
        elif isinstance(sids, np.ndarray):
            if sids.ndim != 1:
                raise ValueError(f"sids: expected a 1-d array, got shape {sids.shape}")
            if sids.dtype.kind not in "iu" or sids.dtype.itemsize > 8:
                raise TypeError(f"sids: expected integer ids, got dtype {sids.dtype}")
            if sids.dtype.kind == "u" and sids.size and sids.max() > INT64_MAX:
                raise SequenceNotFound(
                    f"sequence {sids.max()}: unknown or freed sequence")
            sa = np.ascontiguousarray(sids, dtype=np.int64)
        elif type(sids) is list or type(sids) is tuple:
            # the contract's form: plain ints straight into a stack buffer (no array, no
            # references taken); anything else falls through to the general path
            B = <size_t>len(sids)
            ids = &ids_small[0]
            if B > 512:
                ids = <int64_t *>malloc(sizeof(int64_t) * B)
            if ids == NULL:
                raise MemoryError()
            if not _plain_int_ids(sids, ids, <Py_ssize_t>B):
                if ids != &ids_small[0]:
                    free(ids)
                ids = NULL
        if sa is None and ids == NULL:
            # every id checked as any other call checks one (no float/str/bool coercion)
            items = list(sids)
            if items and all(isinstance(x, (list, tuple, np.ndarray)) for x in items):
                raise ValueError(f"sids: expected a 1-d sequence of ids, got shape "
                                 f"{np.shape(items)}")
            sa = np.array([as_sid(x) for x in items], dtype=np.int64)
        if ids != NULL:
            sp = ids
        else:
            B = <size_t>sa.shape[0]
            sp = <const int64_t *>cnp.PyArray_DATA(sa)
        cdef cnp.npy_intp dims[2]
        dims[0] = <cnp.npy_intp>B
        cdef cnp.ndarray lens
        cdef uint32_t slots_small[512]
        cdef uint32_t *slots = slots_small
        cdef uint32_t W = 0
        cdef int st = SHMKV_OK
        cdef int64_t bad = 0
        cdef cnp.ndarray tables = None
        try:
            lens = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT32, 0)
            if B > 512:
                slots = <uint32_t *>malloc(sizeof(uint32_t) * B)
                if slots == NULL:
                    raise MemoryError()
            pool_lock(c)
            try:
                st = shmkv_batch_sizes_locked(c, sp, B, slots,
                                              <int32_t *>cnp.PyArray_DATA(lens), &W, &bad)
                if st == SHMKV_OK:
                    dims[1] = W
                    tables = cnp.PyArray_EMPTY(2, dims, cnp.NPY_INT32, 0)
                    st = shmkv_batch_copy_locked(c, sp, B, slots,
                                                 <const int32_t *>cnp.PyArray_DATA(lens), W,
                                                 <int32_t *>cnp.PyArray_DATA(tables), &bad)
            finally:
                shmkv_pool_unlock(c)
        finally:
            if slots != slots_small and slots != NULL:
                free(slots)
            if ids != NULL and ids != &ids_small[0]:
                free(ids)
        if st == SHMKV_ENOSEQ:
            raise SequenceNotFound(f"sequence {bad}: unknown or freed sequence")
        if st != SHMKV_OK:
            raise_status(st, f"sequence {bad}")
        return tables, lens

    def free(self, sid):
        """Drop a sequence; blocks whose refcount reaches 0 return to the pool."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t s = as_sid(sid)
        cdef uint32_t slot
        cdef int st
        seq_lock(c, s, &slot)
        st = shmkv_pcache_free(c, slot)            # exclusive blocks: into our cache
        if st == SHMKV_OK:
            return
        if st != SHMKV_EAGAIN:
            shmkv_seq_unlock(c, slot)
            raise_status(st, f"free({s})")
        try:
            pool_lock(c)
        except BaseException:
            shmkv_seq_unlock(c, slot)
            raise
        st = shmkv_seq_free_locked(c, slot)        # releases the sequence lock on OK
        if st == SHMKV_OK:
            shmkv_pcache_balance_locked(c)
        shmkv_pool_unlock(c)
        if st != SHMKV_OK:
            shmkv_seq_unlock(c, slot)
            raise_status(st, f"free({s})")

    def truncate(self, sid, n):
        """Keep the first ``n`` tokens of a sequence, in place (same id).

        The blocks past them are released as ``free`` releases blocks: a shared one
        (a fork's, a prefix hit's) is only decref'd, one whose refcount reaches 0
        returns to the pool or, if its hash is published, stays findable in the prefix
        cache.  The hashes of blocks kept whole stay valid (and published); a partial
        last block is no longer hashed by this sequence, and if other sequences hold it
        or can find it whole, the next append or reserve copies it first (copy-on-write,
        as after ``fork``).  The token ids recorded past ``n`` are dropped.
        All-or-nothing; the process-cache fast path when every released block is
        exclusive and unhashed, the pool lock otherwise.

        Parameters
        ----------
        sid : int
        n : int
            Tokens to keep, ``0 <= n <= seq_len(sid)``.

        Raises
        ------
        SequenceNotFound
            ``sid`` is not a live sequence.
        ValueError
            ``n`` is out of range (nothing changes).
        TypeError
            ``n`` is not an int.
        """
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t s = as_sid(sid)
        cdef uint32_t slot
        cdef int64_t ln
        cdef int st
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"truncate({s}): n: expected int, got {type(n).__name__}")
        seq_lock(c, s, &slot)
        try:
            ln = valid_len(c, slot, s)
            if n < 0 or n > ln:
                raise ValueError(
                    f"truncate({s}): n: expected 0 <= n <= seq_len {ln}, got {n}")
            st = shmkv_pcache_truncate(c, slot, <uint32_t>n)    # exclusive tail: our cache
            if st == SHMKV_EAGAIN:
                pool_lock(c)
                st = shmkv_seq_truncate_locked(c, slot, <uint32_t>n)
                if st == SHMKV_OK:
                    shmkv_pcache_balance_locked(c)
                shmkv_pool_unlock(c)
            if st != SHMKV_OK:
                raise_status(st, f"truncate({s}, {n})")
        finally:
            shmkv_seq_unlock(c, slot)

    def sequences(self):
        """Ids of the live sequences, in slot order."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef uint32_t i
        res = []
        pool_lock(c)
        try:
            for i in range(c.cfg.max_seqs):
                if c.seqs[i].state == SHMKV_SEQ_LIVE:
                    res.append(shmkv_slot_sid(c, i))
        finally:
            shmkv_pool_unlock(c)
        return res

    # ---- ownership ----------------------------------------------------------------------
    cdef int _set_owner(self, object sid, uint64_t owner) except -1:
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t s = as_sid(sid)
        cdef uint32_t slot
        seq_lock(c, s, &slot)       # (a free and re-create of the slot cannot slip in)
        try:
            pool_lock(c)
        except BaseException:
            shmkv_seq_unlock(c, slot)
            raise
        c.seqs[slot].owner = owner if owner != 1 else c.proc_token
        shmkv_pool_unlock(c)
        shmkv_seq_unlock(c, slot)
        return 0

    def detach(self, sid):
        """Make a sequence owned by no process: it survives its creator, and recovery
        never frees it, until some process adopts it."""
        self._set_owner(sid, 0)

    def adopt(self, sid):
        """This process becomes the owner of the sequence."""
        self._set_owner(sid, 1)

    def owner_pid(self, sid):
        """PID of the owning process, or None for a detached sequence."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef uint32_t slot
        cdef int64_t s = as_sid(sid)
        cdef uint64_t tok
        pool_lock(c)
        st = shmkv_sid_slot(c, s, &slot)
        tok = c.seqs[slot].owner if st == SHMKV_OK else 0
        pid = None
        if tok != 0 and (tok & 0xffffffff) - 1 < c.cfg.max_procs:
            pid = c.procs[(tok & 0xffffffff) - 1].pid
        if st == SHMKV_OK:
            st = shmkv_sid_slot(c, s, &slot)      # freed meanwhile (no pool lock)?
        shmkv_pool_unlock(c)
        if st != SHMKV_OK:
            raise_status(st, f"sequence {s}")
        return pid

