# Mirror of _layout.h: only what Cython touches.  The header is the law; this must match.
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t

cdef extern from "_layout.h" nogil:
    uint64_t SHMKV_MAGIC
    uint32_t SHMKV_LAYOUT_VERSION
    uint32_t SHMKV_PAGE
    uint32_t SHMKV_NIL
    uint32_t SHMKV_INFLIGHT_PER_PROC
    uint64_t SHMKV_LOCK_BASE
    uint32_t SHMKV_SHARED_OFFSET

    enum:
        SHMKV_OK, SHMKV_EFULL, SHMKV_ESEQFULL, SHMKV_ENOSEQ, SHMKV_ECORRUPT,
        SHMKV_ETIMEDOUT, SHMKV_ERANGE, SHMKV_ETOOLONG, SHMKV_EPROCFULL, SHMKV_EAGAIN,
        SHMKV_EINVAL, SHMKV_ESYS, SHMKV_ENOTREADY, SHMKV_EVERSION, SHMKV_EBADMAGIC,
        SHMKV_ENOTOWNER
        SHMKV_EDEADHOLDER
    enum:
        SHMKV_STATE_INIT, SHMKV_STATE_READY
    enum:
        SHMKV_SEQ_FREE, SHMKV_SEQ_BUILDING, SHMKV_SEQ_LIVE
    enum:
        SHMKV_PROC_FREE, SHMKV_PROC_ACTIVE
    enum:
        SHMKV_BLOCK_HASHED
    enum:
        SHMKV_SEQF_UNTRACKED, SHMKV_SEQF_COW_TAIL
    enum:
        SHMKV_HASH_XXH, SHMKV_HASH_SHA256
    enum:
        SHMKV_F16, SHMKV_F32, SHMKV_BF16, SHMKV_I8, SHMKV_E4M3
    enum:
        SHMKV_NCOUNTERS
        SHMKV_C_GATHERED_TOKENS
        SHMKV_C_APPENDED_TOKENS
        SHMKV_C_PREFIX_QUERIES
        SHMKV_C_PREFIX_HITS
        SHMKV_C_EVICT_LRU
        SHMKV_C_TRIMMED_BLOCKS
        SHMKV_C_TIER_HITS, SHMKV_C_TIER_MISSES, SHMKV_C_TIER_ERRORS
        SHMKV_C_TIER_BYTES_IN, SHMKV_C_TIER_BYTES_OUT

    ctypedef struct shmkv_config_t:
        uint32_t num_layers, num_kv_heads, head_dim, block_size
        uint32_t num_blocks, max_seqs, max_blocks_per_seq, max_procs
        uint32_t dtype, itemsize, hash_algo, _reserved
        uint32_t event_capacity, _reserved_ev

    ctypedef struct shmkv_layout_t:
        uint64_t token_bytes, block_bytes, layer_stride, index_capacity
        uint64_t off_blocks, off_free, off_procs, off_seqs, off_seq_free, off_tables
        uint64_t off_tokens, off_index, off_kpool, off_vpool, segment_size
        uint64_t off_events, event_record_bytes
        uint64_t scale_bytes, scale_stride, off_kscale, off_vscale, off_hscale

    ctypedef struct shmkv_header_t:
        uint64_t magic
        uint32_t layout_version, header_size
        uint64_t abi_fingerprint, segment_size
        shmkv_config_t config
        shmkv_layout_t layout
        uint64_t creator_pid, create_time_ns, hash_seed, checksum

    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct shmkv_shared_t:
        uint32_t state, recover_pending
        uint64_t recoverer, recoverer_since_ns
        pthread_mutex_t pool_lock
        uint32_t free_top, cached_count, lru_head, lru_tail, seq_free_top
        uint32_t _unused0, num_procs, peak_used, index_used, index_tombs
        uint64_t lru_clock, last_recovery_ns, max_recovery_ns
        uint64_t counters[32]

    ctypedef struct shmkv_block_t:
        uint32_t ref_cnt, flags, lru_prev, lru_next
        uint64_t hash[2]
        uint64_t last_access
        uint32_t num_tokens

    ctypedef struct shmkv_proc_t:
        uint32_t state, gen
        uint64_t pid, pid_start, attach_time_ns
        uint32_t inflight[8]
        uint64_t counters[8]
        uint64_t cache_lock
        uint32_t cache_nblocks, cache_nseqs
        uint32_t cache_blocks[20]
        uint32_t cache_seqs[8]
    enum:
        SHMKV_PC_APPENDED, SHMKV_PC_GATHERED, SHMKV_PC_ALLOCATIONS, SHMKV_PC_FREES
        SHMKV_PC_SEQS_CREATED, SHMKV_PC_SEQS_FREED, SHMKV_PC_NUSED, SHMKV_PROC_COUNTERS
    uint32_t SHMKV_PCACHE_BLOCKS, SHMKV_PCACHE_SEQS

    ctypedef struct shmkv_seq_t:
        uint32_t state, gen
        uint64_t owner, writer
        uint32_t len, nblocks, hashed, priority
        uint64_t last_access_ns, access_count, created_ns
        uint32_t flags, hash_ready
        uint64_t salt[2]
        uint32_t trimmed, trim_s, trim_d, trim_k, trim_chunk, trim_len, trim_trimmed

    ctypedef struct shmkv_index_t:
        uint64_t hash[2]
        uint32_t block

    const char *SHMKV_COUNTER_NAMES[]

    # KV events (kernels/events.h)
    uint32_t SHMKV_MAX_EVENTS, SHMKV_EVENT_MAX_TOKENS
    enum:
        SHMKV_EV_STORED, SHMKV_EV_REMOVED, SHMKV_EV_CLEARED
    enum:
        SHMKV_EVF_PARENT
    ctypedef struct shmkv_event_ring_t:
        uint64_t head
    ctypedef struct shmkv_event_t:
        uint64_t stamp
        uint32_t kind, num_tokens
        uint64_t hash[2]
        uint64_t parent[2]
        uint64_t time_ns
        uint32_t block, flags

    uint64_t shmkv_abi_fingerprint()
    uint64_t shmkv_header_checksum(const shmkv_header_t *h)
    uint32_t shmkv_atomic_load_u32(const uint32_t *p)
    uint32_t shmkv_atomic_load_u32_relaxed(const uint32_t *p)
    uint32_t shmkv_atomic_load_u32_acquire(const uint32_t *p)
    uint64_t shmkv_atomic_load_u64(const uint64_t *p)
    uint64_t shmkv_atomic_load_u64_relaxed(const uint64_t *p)
    void shmkv_atomic_store_u32_release(uint32_t *p, uint32_t v)
    uint64_t shmkv_atomic_add_u64_relaxed(uint64_t *p, uint64_t v)
    int shmkv_atomic_cas_u64(uint64_t *p, uint64_t expect, uint64_t desired)
    int shmkv_dtype_quantized(uint32_t dtype)
    int shmkv_layout_compute(const shmkv_config_t *c, shmkv_layout_t *out)
