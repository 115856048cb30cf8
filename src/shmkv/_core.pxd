# shmkv._core's declarations, shared by every module of the package that touches the
# segment: the kernel signatures (kernels/kernels.h; every kernel returns a status, none
# raises), the classes of the handle (_Mapping, _Attachment, Segment: the base of the
# method chain that KVCache ends), the C API of _core, and the inline helpers of the hot
# paths (compiled into each module that cimports them: no call between modules there).
cimport numpy as cnp
from libc.stdint cimport uint8_t, int8_t, uint32_t, uint64_t, int32_t, int64_t
from shmkv._layout cimport *

cdef extern from "kernels/kernels.h" nogil:
    ctypedef struct shmkv_ctx_t:
        uint8_t *base
        uint64_t size
        shmkv_header_t *hdr
        shmkv_shared_t *sh
        shmkv_block_t *blocks
        uint32_t *free_stack
        shmkv_proc_t *procs
        shmkv_seq_t *seqs
        uint32_t *seq_free
        int32_t *tables
        int32_t *tokens
        shmkv_index_t *index
        uint8_t *kpool
        uint8_t *vpool
        float *kscale
        float *vscale
        float *hscale
        shmkv_config_t cfg
        shmkv_layout_t lay
        int lock_fd
        uint32_t proc_slot
        uint64_t proc_token
        int64_t timeout_ns
        int64_t backoff_ns
        int64_t backoff_until_ns
        uint64_t lock_timeouts
        int readonly
        uint8_t *events

    ctypedef struct shmkv_recovery_t:
        uint64_t processes, sequences, blocks, locks, tails, refcounts_fixed, corrupt
        uint64_t duration_ns, blocks_visited
        uint32_t full, busy

    ctypedef struct shmkv_grow_plan_t:
        uint32_t len, new_blocks, cow_index
        int cow

    int SHMKV_NCRASH
    int SHMKV_PLANT_EARLY_PUBLISH
    const char *SHMKV_CRASH_NAMES[]
    ctypedef struct shmkv_dbg_t:
        int crash_id
        long crash_countdown
        int crash_stop
        int plant
    shmkv_dbg_t *shmkv_dbg          # this module's pointer: bind it with bind_debug_state()
    shmkv_dbg_t shmkv_dbg_local     # this module's own copy (the one _core's pointer keeps)
    void shmkv_crash(int id)
    int SHMKV_CP_COW_AFTER_COPY, SHMKV_CP_APPEND_BEFORE_PUBLISH, SHMKV_CP_APPEND_AFTER_PUBLISH
    const int SHMKV_PC_GLOBAL[]
    void shmkv_counters_total(const shmkv_ctx_t *c, uint64_t *out)
    void shmkv_counts(const shmkv_ctx_t *c, uint64_t *free_blocks, uint64_t *cached,
                      uint64_t *live_seqs)
    int shmkv_pcache_create(shmkv_ctx_t *c, uint32_t priority, int64_t *sid_out)
    int shmkv_pcache_grow(shmkv_ctx_t *c, uint32_t slot, const shmkv_grow_plan_t *pl)
    int shmkv_pcache_free(shmkv_ctx_t *c, uint32_t slot)
    int shmkv_pcache_truncate(shmkv_ctx_t *c, uint32_t slot, uint32_t n)
    int shmkv_pcache_balance_locked(shmkv_ctx_t *c)
    int shmkv_pcache_drain_all_locked(shmkv_ctx_t *c)
    int shmkv_quiesce_locked(shmkv_ctx_t *c)
    void shmkv_unquiesce_locked(shmkv_ctx_t *c)
    int64_t shmkv_now_ns(int clk)
    void shmkv_count(shmkv_ctx_t *c, int which, uint64_t v)
    void shmkv_count_proc(shmkv_ctx_t *c, int which, uint64_t v)
    int shmkv_ctx_bind(shmkv_ctx_t *c, uint8_t *base, uint64_t size, int readonly)
    int shmkv_seg_init(uint8_t *base, const shmkv_config_t *cfg, uint64_t pid,
                       uint64_t now_ns, uint64_t seed)
    int shmkv_ofd_probe(int fd, uint32_t slot)
    int shmkv_proc_alive(shmkv_ctx_t *c, uint64_t token)
    int shmkv_pool_trylock(shmkv_ctx_t *c)
    int shmkv_pool_lock(shmkv_ctx_t *c)
    void shmkv_pool_unlock(shmkv_ctx_t *c)
    int shmkv_sid_slot(const shmkv_ctx_t *c, int64_t sid, uint32_t *slot)
    int64_t shmkv_slot_sid(const shmkv_ctx_t *c, uint32_t slot)
    int shmkv_seq_trylock(shmkv_ctx_t *c, int64_t sid, uint32_t *slot)
    int shmkv_seq_lock(shmkv_ctx_t *c, int64_t sid, uint32_t *slot)
    void shmkv_seq_unlock(shmkv_ctx_t *c, uint32_t slot)
    int shmkv_block_ok(const shmkv_ctx_t *c, int64_t b)
    int32_t *shmkv_table(const shmkv_ctx_t *c, uint32_t slot)
    uint32_t shmkv_blocks_for(const shmkv_ctx_t *c, uint64_t tokens)
    int shmkv_batch_sizes_locked(const shmkv_ctx_t *c, const int64_t *sids, size_t n,
                                 uint32_t *slots, int32_t *lens, uint32_t *w_out,
                                 int64_t *bad)
    int shmkv_batch_copy_locked(const shmkv_ctx_t *c, const int64_t *sids, size_t n,
                                const uint32_t *slots, const int32_t *lens, uint32_t w,
                                int32_t *out, int64_t *bad)
    int shmkv_blocks_alloc_locked(shmkv_ctx_t *c, uint32_t n, uint32_t *out)
    void shmkv_block_decref_locked(shmkv_ctx_t *c, uint32_t b)
    int shmkv_seq_create_locked(shmkv_ctx_t *c, uint32_t priority, int64_t *sid_out)
    int shmkv_seq_valid(const shmkv_ctx_t *c, uint32_t slot)
    int shmkv_seq_free_locked(shmkv_ctx_t *c, uint32_t slot)
    int shmkv_seq_truncate_locked(shmkv_ctx_t *c, uint32_t slot, uint32_t n)
    int shmkv_seq_fork_locked(shmkv_ctx_t *c, int64_t parent, int64_t *child_out)
    int shmkv_seq_plan(shmkv_ctx_t *c, uint32_t slot, uint64_t n, shmkv_grow_plan_t *pl)
    int shmkv_seq_grow_locked(shmkv_ctx_t *c, uint32_t slot, shmkv_grow_plan_t *pl,
                              uint32_t *cow_target)
    void shmkv_block_copy(shmkv_ctx_t *c, uint32_t src, uint32_t dst, uint32_t tokens)
    int shmkv_seq_cow_commit_locked(shmkv_ctx_t *c, uint32_t slot, uint32_t index,
                                    uint32_t target)
    void shmkv_inflight_release_locked(shmkv_ctx_t *c, uint32_t target)
    int shmkv_seq_check_span(const shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n)
    void shmkv_seq_copy(shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n,
                        uint8_t *pool, uint8_t *buf, int to_pool)
    void shmkv_seq_copy_rows(shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n,
                             uint8_t *pool, uint64_t stride, uint64_t tb, uint8_t *buf,
                             int to_pool)
    int shmkv_write_rows(shmkv_ctx_t *c, uint32_t layer, const int64_t *slots, uint64_t n,
                         uint8_t *kbase, uint8_t *vbase, uint64_t stride, uint64_t tb,
                         const uint8_t *k, const uint8_t *v, int64_t *bad)
    int shmkv_q_isa                 # quant.h's path (this module's copy): -1 unset, 0 C, 1 AVX2, 2 AVX-512
    int shmkv_quant_isa()
    int shmkv_quant_cpu_isa()
    int shmkv_quant_i8(const void *x, int f16, uint64_t rows, uint32_t d, int8_t *q, float *s)
    void shmkv_dequant_i8(const int8_t *q, const float *s, uint64_t rows, uint32_t d, float *x)
    int shmkv_quant_e4m3(const void *x, int f16, uint32_t layers, uint64_t n, uint32_t heads,
                         uint32_t d, const float *hs, uint8_t *q)
    void shmkv_dequant_e4m3(const uint8_t *q, uint32_t layers, uint64_t n, uint32_t heads,
                            uint32_t d, const float *hs, float *x)
    void shmkv_seq_slots(const shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n,
                         int64_t *out)
    int shmkv_write_slots(shmkv_ctx_t *c, uint32_t layer, const int64_t *slots, uint64_t n,
                          const uint8_t *k, const uint8_t *v, int64_t *bad)
    void shmkv_hash_fast(uint64_t seed, const uint64_t *parent, const int32_t *tok,
                         uint32_t n, const uint64_t *extra, uint64_t *out)
    void shmkv_seq_tokens(shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n,
                          int32_t *ids, int to_pool)
    void shmkv_seq_block_hash_fast(shmkv_ctx_t *c, uint32_t slot, uint32_t i)
    void shmkv_seq_publish_locked(shmkv_ctx_t *c, uint32_t slot)
    uint32_t shmkv_prefix_match_locked(shmkv_ctx_t *c, const uint64_t *hashes, uint32_t n)
    uint32_t shmkv_prefix_take_locked(shmkv_ctx_t *c, uint32_t slot, const uint64_t *hashes,
                                      uint32_t n)
    int shmkv_seq_trim_locked(shmkv_ctx_t *c, uint32_t slot, uint32_t S, uint32_t D,
                              uint32_t *dropped)
    void shmkv_seq_touch(shmkv_ctx_t *c, uint32_t slot)
    int shmkv_proc_register_locked(shmkv_ctx_t *c, uint64_t pid, uint64_t pid_start)
    void shmkv_proc_unregister_locked(shmkv_ctx_t *c)
    int shmkv_recover_locked(shmkv_ctx_t *c, shmkv_recovery_t *r)
    int shmkv_any_dead_locked(shmkv_ctx_t *c)
    int shmkv_recover_needed(shmkv_ctx_t *c)
    int shmkv_recover_dead_locked(shmkv_ctx_t *c, shmkv_recovery_t *r)
    int shmkv_recover_scheduled(shmkv_ctx_t *c, shmkv_recovery_t *r)
    uint32_t shmkv_index_find_locked(shmkv_ctx_t *c, const uint64_t *h)
    int shmkv_index_insert_locked(shmkv_ctx_t *c, const uint64_t *h, uint32_t b)
    # KV events (kernels/events.h)
    uint64_t shmkv_event_head(const shmkv_ctx_t *c)
    int shmkv_event_read(const shmkv_ctx_t *c, uint64_t seq, uint8_t *out)
    uint64_t shmkv_events_check_locked(const shmkv_ctx_t *c, uint64_t *first_bad)
    uint64_t shmkv_prefix_reset_locked(shmkv_ctx_t *c)


# ---- the handle: the mapping, this process's attachment, the Segment base class -------
cdef class _Mapping:
    """Owns one mmap'ed address range; numpy views of it keep it alive."""
    cdef uint8_t *base
    cdef uint64_t size
    cdef bint writable
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    @staticmethod
    cdef _Mapping map(int fd, uint64_t size, bint writable, bint populate)


cdef class _Attachment:
    """One per (segment, process): the ctx, the mapping, the process slot; handles share it."""
    cdef shmkv_ctx_t ctx
    cdef _Mapping mapping
    cdef object key
    cdef object name
    cdef int fd
    cdef int refs
    cdef object pid

    cdef int register(self) except -1
    cdef int release(self) except -1
    cdef void after_fork_child(self)


cdef class Segment:
    """The base of the handle's method chain (see DEVELOP.md): its lifetime."""
    cdef _Attachment _att
    cdef shmkv_ctx_t *ctx
    cdef readonly object name
    cdef readonly object config
    cdef object _dtype
    cdef cnp.dtype _descr
    cdef bint _closed
    cdef int64_t _tokw           # heads * dim elements of one token (one layer)
    cdef object __weakref__

    cdef _bind(self, _Attachment att)
    cdef int _reopen(self) except -1


# ---- the C API of _core for sibling extension modules (the method chain, _attention) ---
# Defined in _core.pyx; Cython exports them through the module's capsule table.
cdef shmkv_ctx_t *segment_ctx(object seg) except NULL
cdef int raise_status(int st, str what) except -1
cdef object cfg_object(const shmkv_config_t *c)
cdef int64_t sid_arg(object sid) except? -2
cdef int lock_seqs(shmkv_ctx_t *c, const int64_t *sids, Py_ssize_t n,
                   uint32_t *slots, uint32_t *lens) except -1
cdef void unlock_seqs(shmkv_ctx_t *c, const uint32_t *slots, Py_ssize_t n) noexcept
cdef shmkv_dbg_t *debug_state() noexcept


# ---- inline helpers: each module that cimports them gets its own copy ----------------
cdef inline void bind_debug_state() noexcept:
    """Points this module's copy of the kernels at _core's crash-point and planted-bug
    switches.  Every module that calls kernels runs it once, at import."""
    global shmkv_dbg
    shmkv_dbg = debug_state()


cdef inline shmkv_ctx_t *ctx_of(Segment seg) except NULL:
    """The context of an open handle (registering this process on first use after
    os.fork()); ValueError on a closed one."""
    if seg._closed or seg.ctx.proc_token == 0:
        seg._reopen()
    return seg.ctx


cdef inline int pool_lock(shmkv_ctx_t *c) except -1:
    """Takes the pool lock: one try with the GIL, then a bounded wait without it."""
    cdef int st = shmkv_pool_trylock(c)
    if st == SHMKV_EAGAIN:
        with nogil:
            st = shmkv_pool_lock(c)
    if st != SHMKV_OK:
        raise_status(st, "pool lock")
    return 0


cdef inline int seq_lock(shmkv_ctx_t *c, int64_t sid, uint32_t *slot) except -1:
    """Takes a sequence's lock, the same way."""
    cdef int st = shmkv_seq_trylock(c, sid, slot)
    if st == SHMKV_EAGAIN:
        with nogil:
            st = shmkv_seq_lock(c, sid, slot)
    if st != SHMKV_OK:
        raise_status(st, f"sequence {sid}")
    return 0


cdef inline int64_t as_sid(object sid) except? -2:
    """A sequence id argument as int64: a plain int inline, everything else (and every
    error: TypeError, SequenceNotFound) through sid_arg."""
    if type(sid) is int:
        try:
            return <int64_t>sid
        except OverflowError:
            pass
    return sid_arg(sid)


cdef inline int64_t valid_len(shmkv_ctx_t *c, uint32_t slot, int64_t s) except -1:
    """A locked sequence's length, checked against its table before anything is sized
    from it (never trust the segment)."""
    cdef uint32_t nb = c.seqs[slot].nblocks, ln = c.seqs[slot].len
    if nb > c.cfg.max_blocks_per_seq or <uint64_t>ln > <uint64_t>nb * c.cfg.block_size:
        raise_status(SHMKV_ECORRUPT, f"sequence {s}: length {ln} does not fit its {nb} blocks")
    return ln
