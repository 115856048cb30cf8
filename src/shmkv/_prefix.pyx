# cython: language_level=3, binding=False
# binding=False: the methods of the cdef classes are method descriptors, which check
# self; Cython 3's cyfunctions do not (KVCache.unlink("name") crashed the interpreter).
"""shmkv._prefix: the prefix cache and what works on a sequence's token ids.

PrefixOps (above _inspect.InspectOps in the method chain): match_prefix, commit,
set_priority, evict, trim_streaming, trimmed, token_ids; and for the sequence methods
above it, the block-hash chain of a prompt (_chain) and the hashing of filled blocks
(_hash_blocks), with the argument helpers as_ids / salt_digest (_prefix.pxd).

Writes (through the kernels unless said): block hashes and num_tokens of blocks a
sequence filled (seq.hash_ready, under the sequence lock), the hash index and the LRU
list (shmkv_seq_publish_locked, under pool_lock), seq.priority (sequence lock), whole
sequences freed by evict (pool_lock, each sequence try-locked), a table compacted by
trim_streaming (sequence lock, then pool_lock, under its trim journal).

The remote tier's hooks (shmkv/tier/ holds the tier itself): set_tier / flush_tier, the
tier counters (relaxed atomic adds), the write-through hook that hands the hashes of
blocks just published to the tier's queue (_tier_published: no copy, no network on the
caller's thread), the pin its writer reads them through (_tier_pin: a sequence taking
blocks by hash, as a prefix hit does).  The tier reaches those through one TierPort
set_tier hands it (pin, count, hashes, layout) and the cache's public API: it calls
nothing private of the cache.  The value checksum is shmkv._checksum's, not this module's.
"""
import hashlib
import weakref

import numpy as np

cimport numpy as cnp
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy

from shmkv._core cimport *
from shmkv._inspect cimport InspectOps

cnp.import_array()
bind_debug_state()

_TIER_COUNTERS = (SHMKV_C_TIER_HITS, SHMKV_C_TIER_MISSES, SHMKV_C_TIER_ERRORS,
                  SHMKV_C_TIER_BYTES_IN, SHMKV_C_TIER_BYTES_OUT)


_POLICIES = {"lru": SHMKV_C_EVICT_LRU, "lfu": SHMKV_C_EVICT_LRU + 1,
             "longest": SHMKV_C_EVICT_LRU + 2, "priority": SHMKV_C_EVICT_LRU + 3}


cdef cnp.ndarray as_ids(object tokens, int64_t n):
    """Token ids as a contiguous int32 array (of length n when n >= 0)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-d sequence of ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"tokens: expected integer token ids, got dtype {arr.dtype}")
    if n >= 0 and arr.shape[0] != n:
        raise ValueError(f"tokens: expected {n} ids (one per token added), got {arr.shape[0]}")
    if arr.size and (arr.min() < 0 or arr.max() > 0x7fffffff):
        raise ValueError(f"tokens: expected ids in [0, 2**31), got [{arr.min()}, {arr.max()}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


cdef int salt_digest(object salt, uint64_t *out) except -1:
    out[0] = out[1] = 0
    if salt is None:
        return 0
    if isinstance(salt, str):
        salt = salt.encode()
    if not isinstance(salt, bytes):
        raise TypeError(f"salt: expected str or bytes, got {type(salt).__name__}")
    d = hashlib.blake2b(salt, digest_size=16, person=b"shmkv-salt").digest()
    out[0] = int.from_bytes(d[:8], "little")
    out[1] = int.from_bytes(d[8:], "little") | 2      # never the index's reserved keys
    return 0


cdef bytes _pack2(object h):
    return int(h[0]).to_bytes(8, "little") + int(h[1]).to_bytes(8, "little")


cdef tuple _sha_block(uint64_t seed, bytes parent, const uint64_t *extra, bytes toks):
    """The sha256 block hash: sha256(seed | parent hash | salt digest (block 0) | ids),
    truncated to 128 bits."""
    m = hashlib.sha256(seed.to_bytes(8, "little"))
    m.update(parent)
    if extra != NULL:
        m.update(_pack2((extra[0], extra[1])))
    m.update(toks)
    d = m.digest()
    h0 = int.from_bytes(d[:8], "little")
    h1 = int.from_bytes(d[8:16], "little")
    if h0 == 0 and h1 <= 1:
        h1 = 2
    return (h0, h1)


cdef int token_range(object start, object stop, int64_t L, int64_t s, int64_t *a,
                     int64_t *b) except -1:
    """[start, stop) of a sequence of length L, None meaning its ends."""
    a[0] = 0 if start is None else _token_index(start, "start")
    b[0] = L if stop is None else _token_index(stop, "stop")
    if not (0 <= a[0] <= b[0] <= L):
        raise IndexError(
            f"token range: expected 0 <= start <= stop <= {L} (sequence {s} length), "
            f"got [{a[0]}, {b[0]})")
    return 0


cdef int64_t _token_index(object x, str what) except? -1:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{what}: expected int, got {type(x).__name__}")
    if x < 0 or x > 0xffffffff:
        raise IndexError(f"{what}: expected a token index >= 0, got {x}")
    return <int64_t>x


cdef int64_t _count_arg(object x, str what) except -1:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{what}: expected int, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{what}: expected >= 0, got {x}")
    return <int64_t>min(x, 1 << 40)



cdef class TierPort:
    """The cache's face to a remote tier (shmkv/tier/), given by ``set_tier``: what a tier
    may do to the cache beyond its public API -- ``pin`` published blocks by hash for a
    write-through read, ``count`` into the segment's tier counters, the block ``hashes``
    of tokens, the ``layout`` its fingerprint is made of -- and nothing else.  Holds the
    cache weakly (a tier never keeps a closed handle alive): ValueError once it is gone."""
    cdef object _ref

    def __init__(self, cache):
        self._ref = weakref.ref(cache)

    cdef object _cache(self):
        c = self._ref()
        if c is None:
            raise ValueError("the cache behind this tier port is gone")
        return c

    def pin(self, hashes):
        """(sid, blocks taken): a new sequence of this process holding the leading
        findable run of ``hashes`` ([n, 2] uint64); (-1, 0) with no free slot."""
        return self._cache()._tier_pin(hashes)

    def count(self, hits=0, misses=0, errors=0, bytes_in=0, bytes_out=0):
        """Adds to the segment's tier counters."""
        self._cache()._tier_count(hits, misses, errors, bytes_in, bytes_out)

    def hashes(self, tokens, salt=None):
        """The block-hash chain ([nfull, 2] uint64) create_sequence(tokens, salt) looks up."""
        return self._cache()._tier_hashes(tokens, salt)

    def layout(self):
        """The model dims, dtype, block size, block-hash function and seed of the segment."""
        return self._cache()._tier_layout()

cdef class PrefixOps(InspectOps):
    def match_prefix(self, tokens, salt=None):
        """Tokens that ``create_sequence(tokens, salt)`` would share right now (full
        blocks only, never the last token), without taking them."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef cnp.ndarray ids = as_ids(tokens, -1)
        cdef uint64_t sd[2]
        cdef uint32_t nfull = 0, hits = 0
        salt_digest(salt, sd)
        if ids.shape[0] > 1:
            nfull = min((ids.shape[0] - 1) // c.cfg.block_size, c.cfg.max_blocks_per_seq)
        if nfull == 0:
            return 0
        hashes = self._chain(ids, nfull, sd)
        pool_lock(c)
        hits = shmkv_prefix_match_locked(c, <const uint64_t *>cnp.PyArray_DATA(hashes), nfull)
        shmkv_pool_unlock(c)
        if self._tier is not None and self._tier.read and hits < nfull:
            # the tier's consecutive blocks are loaded and published here (never raises)
            hits = self._tier.extend(self, None, ids, salt, hashes, hits)
        return hits * c.cfg.block_size

    cdef cnp.ndarray _chain(self, cnp.ndarray ids, uint32_t nfull, uint64_t *salt):
        """Block hashes [nfull, 2] of the first nfull full blocks of ids (int32)."""
        cdef shmkv_ctx_t *c = self.ctx
        cdef cnp.npy_intp dims[2]
        dims[0] = nfull
        dims[1] = 2
        cdef cnp.ndarray out = cnp.PyArray_EMPTY(2, dims, cnp.NPY_UINT64, 0)
        cdef uint64_t *h = <uint64_t *>cnp.PyArray_DATA(out)
        cdef const int32_t *tp = <const int32_t *>cnp.PyArray_DATA(ids)
        cdef uint64_t zero[2]
        cdef uint32_t i, bs = c.cfg.block_size
        zero[0] = zero[1] = 0
        if c.cfg.hash_algo == SHMKV_HASH_XXH:
            for i in range(nfull):
                shmkv_hash_fast(c.hdr.hash_seed, h + 2 * (i - 1) if i else zero,
                                tp + i * bs, bs, salt if i == 0 else NULL, h + 2 * i)
        else:
            parent = bytes(16)
            for i in range(nfull):
                d = _sha_block(c.hdr.hash_seed, parent, salt if i == 0 else NULL,
                               (<object>ids)[i * bs:(i + 1) * bs].tobytes())
                h[2 * i], h[2 * i + 1] = d
                parent = _pack2(d)
        return out

    cdef int _hash_blocks(self, shmkv_ctx_t *c, uint32_t slot, uint64_t upto) except -1:
        """Computes the hash of every block that [0, upto) fills completely and that has
        none yet (in order: each hash chains on the previous).  Sequence-lock holder."""
        cdef shmkv_seq_t *q = &c.seqs[slot]
        cdef uint32_t i, full = <uint32_t>(upto // c.cfg.block_size)
        cdef const int32_t *t
        cdef uint32_t b, bs = c.cfg.block_size
        if q.flags & SHMKV_SEQF_UNTRACKED:
            return 0
        t = shmkv_table(c, slot)
        for i in range(q.hash_ready, full):
            if c.cfg.hash_algo == SHMKV_HASH_XXH:
                shmkv_seq_block_hash_fast(c, slot, i)
            else:
                b = <uint32_t>t[i]
                parent = bytes(16) if i == 0 else _pack2(
                    (c.blocks[t[i - 1]].hash[0], c.blocks[t[i - 1]].hash[1]))
                toks = (<char *>(c.tokens + <uint64_t>b * bs))[:bs * 4]
                d = _sha_block(c.hdr.hash_seed, parent, q.salt if i == 0 else NULL, toks)
                c.blocks[b].hash[0], c.blocks[b].hash[1] = d
                c.blocks[b].num_tokens = bs
            q.hash_ready = i + 1
        return 0

    def commit(self, sid):
        """Publish the full blocks that reserve(..., tokens=...) filled: call after
        write() has written every layer.  Returns how many blocks became findable."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t s = as_sid(sid)
        cdef uint32_t slot, before
        seq_lock(c, s, &slot)
        try:
            before = c.seqs[slot].hashed
            if c.seqs[slot].hash_ready > before:
                pool_lock(c)
                shmkv_seq_publish_locked(c, slot)
                shmkv_pool_unlock(c)
                if self._tier is not None:
                    self._tier_published(c, slot, before)
            return c.seqs[slot].hashed - before
        finally:
            shmkv_seq_unlock(c, slot)

    def set_priority(self, sid, int priority):
        """Set a sequence's priority for evict("priority") (lower is evicted first)."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t s = as_sid(sid)
        cdef uint32_t slot
        if priority < 0:
            raise ValueError(f"priority: expected >= 0, got {priority}")
        seq_lock(c, s, &slot)       # (a free and re-create of the slot cannot slip in)
        c.seqs[slot].priority = <uint32_t>priority
        shmkv_seq_unlock(c, slot)

    def evict(self, policy, blocks_needed, *, exclude=()):
        """Free whole sequences until ``blocks_needed`` blocks are free.

        Parameters
        ----------
        policy : {"lru", "lfu", "longest", "priority"}
            Which go first: least recently used, least frequently used, the longest,
            or the lowest priority (ties: least recently used).
        blocks_needed : int
            Target for ``stats()["free_blocks"]`` (cached blocks count as free).
        exclude : iterable of int
            Sequence ids never to evict (the batch being scheduled).

        Returns
        -------
        list of int
            The evicted sequence ids, in eviction order (empty if enough was free).
            A candidate being used at this moment is skipped; if the target cannot be
            met, every candidate is evicted.

        Notes
        -----
        Only sequences this process owns, detached ones and those of dead processes
        are candidates: another live process may be between reserve() and write() on
        its own sequences, and freeing those under it would let its write land in
        blocks that now hold someone else's data.
        """
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef uint32_t s
        cdef shmkv_seq_t *q
        cdef uint64_t me = c.proc_token
        cdef uint64_t nfree
        if policy not in _POLICIES:
            raise ValueError(f"policy: expected one of {tuple(_POLICIES)}, got {policy!r}")
        if isinstance(blocks_needed, bool) or not isinstance(blocks_needed, (int, np.integer)):
            raise TypeError(f"blocks_needed: expected int, got {type(blocks_needed).__name__}")
        if not 0 <= blocks_needed <= c.cfg.num_blocks:
            raise ValueError(f"blocks_needed: expected 0 <= n <= {c.cfg.num_blocks}, "
                             f"got {blocks_needed}")
        keep = {as_sid(x) for x in exclude}
        counter = _POLICIES[policy]
        evicted = []
        pool_lock(c)
        try:
            shmkv_counts(c, &nfree, NULL, NULL)
            if nfree >= blocks_needed:
                return evicted
            cands = []
            for s in range(c.cfg.max_seqs):
                q = &c.seqs[s]
                if q.state != SHMKV_SEQ_LIVE or q.trim_d != 0:
                    continue
                if q.owner != 0 and q.owner != me and shmkv_proc_alive(c, q.owner):
                    continue                      # another live process's sequence
                sid = shmkv_slot_sid(c, s)
                if sid in keep:
                    continue
                if policy == "lru":
                    key = (q.last_access_ns,)
                elif policy == "lfu":
                    key = (q.access_count, q.last_access_ns)
                elif policy == "longest":
                    key = (-<int64_t>q.len, q.last_access_ns)
                else:
                    key = (q.priority, q.last_access_ns)
                cands.append((key, s))
            cands.sort()
            for key, s in cands:
                shmkv_counts(c, &nfree, NULL, NULL)
                if nfree >= blocks_needed:
                    break
                q = &c.seqs[s]
                if not shmkv_atomic_cas_u64(&q.writer, 0, me):
                    continue                      # in use right now: not a victim
                sid = shmkv_slot_sid(c, s)
                if q.state != SHMKV_SEQ_LIVE or shmkv_seq_free_locked(c, s) != SHMKV_OK:
                    shmkv_seq_unlock(c, s)
                    continue
                shmkv_count(c, counter, 1)
                evicted.append(sid)
        finally:
            shmkv_pool_unlock(c)
        return evicted

    def trim_streaming(self, sid, sink_tokens, window_tokens):
        """StreamingLLM: keep the attention-sink prefix and the recent window, drop the
        whole blocks in between.

        Keeps the first ``sink_tokens`` tokens (rounded up to whole blocks) and at least
        the last ``window_tokens`` (the blocks that hold them); frees the middle blocks.
        Positions are renumbered: afterwards token i of the sequence is its i-th kept
        token, ``seq_len`` is the kept count and ``trimmed(sid)`` the tokens dropped so
        far (add it to recover original positions).  The sequence stops being hashed
        for the prefix cache (its chain no longer describes a prompt).

        Returns
        -------
        int
            Tokens dropped by this call (0 if the two ends overlap).
        """
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t s = as_sid(sid)
        cdef int64_t sink = _count_arg(sink_tokens, "sink_tokens")
        cdef int64_t win = _count_arg(window_tokens, "window_tokens")
        cdef uint32_t slot, S, D, nb, ln, first_kept, bs = c.cfg.block_size
        cdef uint32_t *dropped = NULL
        cdef int st = SHMKV_OK
        cdef shmkv_seq_t *q
        seq_lock(c, s, &slot)
        try:
            q = &c.seqs[slot]
            ln = q.len
            nb = shmkv_blocks_for(c, ln)
            S = <uint32_t>min((sink + bs - 1) // bs, nb)
            first_kept = <uint32_t>((ln - win) // bs) if win < ln else 0
            if first_kept <= S:
                return 0
            D = first_kept - S
            dropped = <uint32_t *>malloc(sizeof(uint32_t) * (D + 1))
            if dropped == NULL:
                raise MemoryError()
            pool_lock(c)
            if q.nblocks > nb:                  # an unpublished tail a dead writer left
                st = SHMKV_ECORRUPT if shmkv_seq_valid(c, slot) != SHMKV_OK else SHMKV_OK
                while st == SHMKV_OK and q.nblocks > nb:
                    q.nblocks -= 1
                    shmkv_block_decref_locked(c, <uint32_t>shmkv_table(c, slot)[q.nblocks])
            if st == SHMKV_OK:
                st = shmkv_seq_valid(c, slot)
            if st == SHMKV_OK:
                st = shmkv_seq_trim_locked(c, slot, S, D, dropped)
            shmkv_pool_unlock(c)
            if st != SHMKV_OK:
                raise_status(st, f"trim_streaming({s})")
            return D * bs
        finally:
            free(dropped)
            shmkv_seq_unlock(c, slot)

    def trimmed(self, sid):
        """Tokens trim_streaming dropped from this sequence so far."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef uint32_t slot = 0
        cdef int64_t s = as_sid(sid)
        st = shmkv_sid_slot(c, s, &slot)
        if st != SHMKV_OK:
            raise_status(st, f"sequence {s}")
        return c.seqs[slot].trimmed

    def token_ids(self, sid, start=None, stop=None):
        """The token ids recorded for tokens [start, stop) (int32; meaningful where they
        were given with tokens=, or shared from the prefix cache)."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t s = as_sid(sid)
        cdef uint32_t slot
        cdef int64_t a, b
        cdef cnp.ndarray out
        cdef cnp.npy_intp dims[1]
        seq_lock(c, s, &slot)
        try:
            token_range(start, stop, valid_len(c, slot, s), s, &a, &b)
            dims[0] = b - a
            out = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT32, 0)
            if shmkv_seq_check_span(c, slot, a, b - a) != SHMKV_OK:
                raise_status(SHMKV_ECORRUPT, f"sequence {s}")
            shmkv_seq_tokens(c, slot, a, b - a, <int32_t *>cnp.PyArray_DATA(out), 0)
            return out
        finally:
            shmkv_seq_unlock(c, slot)


    # ---- the remote tier (shmkv/tier/) ---------------------------------------------------
    def set_tier(self, tier, *, read=True, write=True):
        """Write published blocks through to ``tier`` and extend prefix hits from it
        (``shmkv.RedisTier``); ``None`` turns it off (queued writes are flushed first,
        for at most the tier's ``close_timeout``).  Per handle, per process.  Quantized
        pools too: an int8 block's values carry its scale rows, a float8 pool's scale
        table is part of the layout (hosts whose tables differ do not share blocks).

        ``read=False``: this handle's ``create_sequence`` / ``match_prefix`` stay local
        (no network on its calls; another handle or process does the tier reads);
        ``write=False``: what this handle publishes is not written through."""
        if tier is not None and not (read or write):
            raise ValueError("set_tier: read and write are both False (use set_tier(None))")
        old = self._tier
        binding = (None if tier is None
                   else tier._bind(self, TierPort(self), bool(read), bool(write)))
        self._tier = binding
        if old is not None:
            old.close()

    def _has_tier(self):
        return self._tier is not None

    def flush_tier(self, timeout=10.0):
        """Wait up to ``timeout`` seconds until the writes queued so far are stored.
        Returns the number of blocks written since the tier was set (0 without one)."""
        if self._tier is None:
            return 0
        return self._tier.flush(timeout)

    cdef int _tier_published(self, shmkv_ctx_t *c, uint32_t slot, uint32_t before) except -1:
        """Hands the hashes of blocks [before, hashed) of a locked sequence, just
        published, to the tier's writer (which reads them later through a pin)."""
        cdef shmkv_seq_t *q = &c.seqs[slot]
        cdef uint32_t i, b, after = q.hashed
        cdef const int32_t *t = shmkv_table(c, slot)
        cdef cnp.npy_intp dims[2]
        if not self._tier.write or after <= before or after > q.nblocks:
            return 0
        dims[0] = after - before
        dims[1] = 2
        cdef cnp.ndarray out = cnp.PyArray_EMPTY(2, dims, cnp.NPY_UINT64, 0)
        cdef uint64_t *h = <uint64_t *>cnp.PyArray_DATA(out)
        for i in range(before, after):
            b = <uint32_t>t[i]
            if not shmkv_block_ok(c, b):
                return 0
            h[2 * (i - before)] = c.blocks[b].hash[0]
            h[2 * (i - before) + 1] = c.blocks[b].hash[1]
        self._tier.enqueue(out)
        return 0

    def _tier_pin(self, cnp.ndarray hashes):
        """A new sequence (owned by this process, never hashed further) holding the
        leading run of ``hashes`` ([n, 2] uint64) that is findable, one block per hash:
        the tier's writer reads published blocks through it, so none can be reused
        under the read.  Returns (sid, blocks taken), or (-1, 0) with no free slot."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t sid = -1
        cdef uint32_t slot, hits = 0
        cdef int st
        if (hashes.ndim != 2 or hashes.shape[1] != 2 or hashes.dtype != np.uint64
                or not hashes.flags.c_contiguous):
            raise ValueError("hashes: expected a C-contiguous uint64 array [n, 2]")
        cdef uint32_t n = <uint32_t>min(hashes.shape[0], c.cfg.max_blocks_per_seq)
        pool_lock(c)
        st = shmkv_seq_create_locked(c, 0, &sid)
        if st == SHMKV_ESEQFULL and shmkv_pcache_drain_all_locked(c) == SHMKV_OK:
            st = shmkv_seq_create_locked(c, 0, &sid)    # slots the process caches keep
        if st == SHMKV_OK:
            slot = <uint32_t>(sid % c.cfg.max_seqs)
            c.seqs[slot].flags |= SHMKV_SEQF_UNTRACKED
            if n:
                hits = shmkv_prefix_take_locked(
                    c, slot, <const uint64_t *>cnp.PyArray_DATA(hashes), n)
            shmkv_pcache_balance_locked(c)
        shmkv_pool_unlock(c)
        if st != SHMKV_OK:
            return -1, 0
        return sid, hits

    def _tier_count(self, hits=0, misses=0, errors=0, bytes_in=0, bytes_out=0):
        """Adds to the segment's tier counters (stats(), shmkv info, shmkv metrics)."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        for which, v in zip(_TIER_COUNTERS, (hits, misses, errors, bytes_in, bytes_out)):
            if v:
                shmkv_count(c, which, <uint64_t>v)

    def _tier_hashes(self, tokens, salt=None):
        """The block-hash chain ([nfull, 2] uint64) that create_sequence(tokens, salt)
        looks up: the tier's keys (benchmarks, tests)."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef cnp.ndarray ids = as_ids(tokens, -1)
        cdef uint64_t sd[2]
        cdef uint32_t nfull = 0
        salt_digest(salt, sd)
        if ids.shape[0] > 1:
            nfull = min((ids.shape[0] - 1) // c.cfg.block_size, c.cfg.max_blocks_per_seq)
        return self._chain(ids, nfull, sd)

    def _tier_layout(self):
        """What the tier's layout fingerprint is made of: the model dims, dtype, block
        size, block-hash function and seed of this segment."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        return dict(num_layers=c.cfg.num_layers, num_kv_heads=c.cfg.num_kv_heads,
                    head_dim=c.cfg.head_dim, block_size=c.cfg.block_size,
                    dtype=c.cfg.dtype, itemsize=c.cfg.itemsize, hash_algo=c.cfg.hash_algo,
                    hash_seed=c.hdr.hash_seed)
