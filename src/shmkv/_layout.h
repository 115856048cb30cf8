/*
 * _layout.h -- THE shmkv segment layout.  C owns it; _layout.pxd mirrors what Cython
 * touches; Python reads every size and offset from _core, never from constants of its own.
 *
 * One POSIX shared-memory segment holds the whole paged KV cache:
 *
 *   offset 0       +------------------------------------------------------------+
 *                  | shmkv_header_t     IMMUTABLE once state == READY            |
 *                  |   magic, layout version, ABI fingerprint, segment size,    |
 *                  |   config, region layout, creator pid/time, hash seed,      |
 *                  |   FNV-1a checksum of all of the above                      |
 *   512            | shmkv_shared_t     MUTABLE                                  |
 *                  |   state (INIT -> READY, stored last by the creator)        |
 *                  |   pool_lock: robust process-shared pthread mutex           |
 *                  |   free-list top, LRU list ends, sequence free-stack top,   |
 *                  |   counters                                                 |
 *   off_blocks     +------------------------------------------------------------+
 *                  | shmkv_block_t   blocks[num_blocks]   ref_cnt, hash, LRU    |
 *   off_free       | uint32_t        free_stack[num_blocks]                     |
 *   off_procs      | shmkv_proc_t    procs[max_procs]     attached processes    |
 *   off_seqs       | shmkv_seq_t     seqs[max_seqs]       sequence slots        |
 *   off_seq_free   | uint32_t        seq_free[max_seqs]   free sequence slots   |
 *   off_tables     | int32_t         tables[max_seqs][max_blocks_per_seq]       |
 *   off_tokens     | int32_t         tokens[num_blocks][block_size] token ids   |
 *   off_index      | shmkv_index_t   index[index_capacity] block hash -> block  |
 *   off_events     | shmkv_event_ring_t, then event records [event_capacity + 1] |
 *                  |   (KV events, see "KV events" below; absent when capacity 0) |
 *   off_kpool      +--------------------- page aligned -------------------------+
 *                  | K, layer 0   [num_blocks][block_size][num_kv_heads][head_dim]|
 *                  | K, layer 1 ...        (each layer page aligned)            |
 *   off_vpool      | V, layer 0 ...                                             |
 *                  +------------------------------------------------------------+
 *   -- quantized pools only (dtype int8 / float8_e4m3); 0 otherwise: ---------
 *   off_kscale     | float32 K scales, layer 0 [num_blocks][block_size][heads]   |
 *                  |   (int8 only: one per token and kv head; page aligned      |
 *                  |   per layer, scale_stride apart)                           |
 *   off_vscale     | float32 V scales, same shape                               |
 *   off_hscale     | float32 [2][num_layers][num_kv_heads] per-head scales      |
 *                  |   (float8_e4m3 only: [0] K, [1] V; default 1.0)            |
 *                  +------------------------------------------------------------+
 *
 * Block states (a block is "used" iff ref_cnt > 0):
 *
 *      FREE --alloc--> USED --last decref--> FREE            (no hash)
 *                       |  ^
 *           last decref |  | prefix hit (O(1) unlink from the LRU list)
 *                       v  |
 *                      CACHED: ref_cnt 0, hash in the index, on the LRU list;
 *                              evicted (hash dropped) only when no FREE block is left
 *
 * Truth and derived data.  The sequence slots and their block tables are the truth.
 * Every ref_cnt, the free stack, the LRU list, the index, the sequence free stack and the
 * counts are derived from them (plus the in-flight records and the block/slot caches of
 * live processes), so recovery can rebuild them after a process died at any instruction.
 *
 * Locking.
 *   pool_lock  robust mutex; protects the free stack, LRU list, index, the sequence free
 *              stack, sequence state/owner/nblocks/table entries and ref_cnt changes.  Held
 *              for metadata only (O(blocks touched)), never across a byte copy.
 *   seq.writer per-sequence lock word (CAS 0 -> holder's proc token).  Held by whoever
 *              changes or reads a sequence's blocks: append, reserve, gather, free, trim,
 *              truncate.
 *              The byte copies run under it, outside pool_lock, without the GIL.
 *              A holder that died is detected through the process table and cleared.
 *   proc.cache_lock  per-process lock word over that process's cache of free blocks and
 *              free sequence slots (and, on its fast paths, the table entries and refs it
 *              moves).  The owner takes it for a sequence's create, a grow served from
 *              its cache, and the free of a sequence whose blocks are all exclusive and
 *              unhashed -- no pool_lock, no shared line.  A pool_lock holder may take any
 *              process's cache_lock (recovery and check() take them all: the fast paths
 *              are then quiet, so the tables they change are stable).
 *   Order: seq.writer, pool_lock, cache_lock.  Nobody waits for seq.writer holding
 *   pool_lock, nor for anything while holding a cache_lock.
 *
 * Liveness.  A process registers in procs[] and holds an OFD byte-range write lock on
 * byte SHMKV_LOCK_BASE + slot of the segment file; the kernel drops it when the process
 * dies.  PIDs are recorded for display only.
 */
#ifndef SHMKV_LAYOUT_H
#define SHMKV_LAYOUT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>

#define SHMKV_MAGIC            0x31564b4d48535f5fULL   /* "__SHMKV1" little-endian */
#define SHMKV_LAYOUT_VERSION   3u     /* 3: the KV event ring; quantized pools' scales */
#define SHMKV_HEADER_SIZE      512u     /* shmkv_header_t is padded to this */
#define SHMKV_SHARED_OFFSET    512u
#define SHMKV_PAGE             4096u
#define SHMKV_LINE             64u
#define SHMKV_NIL              0xffffffffu
#define SHMKV_INFLIGHT_PER_PROC 8u      /* blocks a process may hold outside any table */
#define SHMKV_LOCK_BASE        (1ULL << 40)   /* OFD liveness lock of proc slot i: this + i */

/* Limits checked on create and on attach (a header outside them is corrupt). */
#define SHMKV_MAX_LAYERS       4096u
#define SHMKV_MAX_HEADS        4096u
#define SHMKV_MAX_HEAD_DIM     65536u
#define SHMKV_MAX_BLOCK_SIZE   65536u
#define SHMKV_MAX_NUM_BLOCKS   0x7ffffffeu  /* block ids are int32; -1 pads tables */
#define SHMKV_MAX_SEQS         (1u << 24)
#define SHMKV_MAX_PROCS        4096u
#define SHMKV_MAX_EVENTS       (1u << 24)   /* event_capacity */
#define SHMKV_EVENT_MAX_TOKENS 1024u        /* block_size limit while events are on */

/* ---- status codes: every kernel returns one ------------------------------------- */
enum {
    SHMKV_OK = 0,
    SHMKV_EFULL = 1,        /* pool exhausted */
    SHMKV_ESEQFULL = 2,     /* sequence slots exhausted */
    SHMKV_ENOSEQ = 3,       /* unknown or freed sequence id */
    SHMKV_ECORRUPT = 4,     /* the segment contradicts itself */
    SHMKV_ETIMEDOUT = 5,    /* a bounded wait ran out */
    SHMKV_ERANGE = 6,       /* token range / slot / layer out of bounds */
    SHMKV_ETOOLONG = 7,     /* sequence would exceed max_blocks_per_seq */
    SHMKV_EPROCFULL = 8,    /* process table full */
    SHMKV_EAGAIN = 9,       /* lock busy (try variants only) */
    SHMKV_EINVAL = 10,      /* bad argument */
    SHMKV_ESYS = 11,        /* a system call failed; errno is set */
    SHMKV_ENOTREADY = 12,   /* segment still being initialised */
    SHMKV_EVERSION = 13,    /* incompatible layout version / ABI */
    SHMKV_EBADMAGIC = 14,   /* not a shmkv segment */
    SHMKV_ENOTOWNER = 15,   /* adopt/detach of a sequence owned by a live other process */
    SHMKV_EDEADHOLDER = 16, /* (internal) a lock's holder is dead: what it guarded may be
                               half-changed, a recovery pass must run (kernels/ops.h runs
                               it).  Pool and cache locks: taken over, held; a sequence
                               lock's wait: nothing held */
};

/* ---- dtypes ------------------------------------------------------------------------ */
/* SHMKV_I8: symmetric int8 with a float32 scale per token and kv head (K and V apart);
 * SHMKV_E4M3: float8 e4m3fn with a float32 scale per layer and kv head (K and V apart).
 * Both are "quantized": the pools hold 1-byte codes, the scales live in the quant region. */
enum { SHMKV_F16 = 1, SHMKV_F32 = 2, SHMKV_BF16 = 3, SHMKV_I8 = 4, SHMKV_E4M3 = 5 };
static inline int shmkv_dtype_quantized(uint32_t dtype) {
    return dtype == SHMKV_I8 || dtype == SHMKV_E4M3;
}

/* ---- states ------------------------------------------------------------------------ */
enum { SHMKV_STATE_INIT = 0x494e4954u, SHMKV_STATE_READY = 0x52454459u };
enum { SHMKV_SEQ_FREE = 0, SHMKV_SEQ_BUILDING = 1, SHMKV_SEQ_LIVE = 2 };
enum { SHMKV_PROC_FREE = 0, SHMKV_PROC_ACTIVE = 1 };
enum { SHMKV_BLOCK_HASHED = 1u };          /* shmkv_block_t.flags */
enum { SHMKV_HASH_XXH = 1, SHMKV_HASH_SHA256 = 2 };

/* ---- counters (shmkv_shared_t.counters[]) ------------------------------------------ */
#define SHMKV_COUNTERS(X) \
    X(ALLOCATIONS, "allocations")            /* blocks taken from the pool */         \
    X(FREES, "frees")                        /* blocks returned to the pool */        \
    X(FORKS, "forks")                                                                 \
    X(COW_COPIES, "cow_copies")              /* partial blocks copied before a write */\
    X(SEQS_CREATED, "sequences_created")                                              \
    X(SEQS_FREED, "sequences_freed")                                                  \
    X(APPENDED_TOKENS, "appended_tokens")    /* by append and reserve */              \
    X(GATHERED_TOKENS, "gathered_tokens")                                             \
    X(RECOVERIES, "recoveries")              /* recovery passes run */               \
    X(RECLAIMED_SEQS, "reclaimed_sequences")                                          \
    X(RECLAIMED_BLOCKS, "reclaimed_blocks")                                           \
    X(OWNER_DEAD, "lock_owner_dead")         /* pool_lock came back EOWNERDEAD */      \
    X(LOCK_WAITS, "lock_waits")              /* a lock was busy and we waited */       \
    X(PREFIX_QUERIES, "prefix_queries")      /* tokens asked for */                   \
    X(PREFIX_HITS, "prefix_hits")            /* tokens found */                       \
    X(CACHED_REUSED, "cached_blocks_reused") /* CACHED block taken by a hit */         \
    X(CACHED_EVICTED, "cached_blocks_evicted") /* CACHED block reused for new data */  \
    X(EVICT_LRU, "evictions_lru")                                                     \
    X(EVICT_LFU, "evictions_lfu")                                                     \
    X(EVICT_LONGEST, "evictions_longest")                                             \
    X(EVICT_PRIORITY, "evictions_priority")                                           \
    X(TRIMMED_BLOCKS, "trimmed_blocks")                                               \
    X(PROCS_ATTACHED, "processes_attached")                                           \
    X(TIER_HITS, "tier_hits")                /* blocks loaded from the remote tier */  \
    X(TIER_MISSES, "tier_misses")            /* asked, absent/corrupt/foreign there */ \
    X(TIER_ERRORS, "tier_errors")            /* tier calls that failed (net, server) */\
    X(TIER_BYTES_IN, "tier_bytes_in")        /* value bytes read from the tier */      \
    X(TIER_BYTES_OUT, "tier_bytes_out")      /* value bytes stored in the tier */

#define SHMKV_X_ENUM(id, name) SHMKV_C_##id,
enum { SHMKV_COUNTERS(SHMKV_X_ENUM) SHMKV_NCOUNTERS };
#undef SHMKV_X_ENUM
#define SHMKV_X_NAME(id, name) name,
static const char *const SHMKV_COUNTER_NAMES[] = { SHMKV_COUNTERS(SHMKV_X_NAME) NULL };
#undef SHMKV_X_NAME
#define SHMKV_COUNTER_SLOTS 32       /* room to add counters without moving fields */

/* ---- the configuration, as stored -------------------------------------------------- */
typedef struct {
    uint32_t num_layers;
    uint32_t num_kv_heads;
    uint32_t head_dim;
    uint32_t block_size;          /* tokens per block */
    uint32_t num_blocks;          /* physical blocks, shared by all layers */
    uint32_t max_seqs;            /* sequence slots */
    uint32_t max_blocks_per_seq;  /* width of one block table */
    uint32_t max_procs;           /* process-table slots */
    uint32_t dtype;               /* SHMKV_F16 ... */
    uint32_t itemsize;            /* bytes per element of dtype */
    uint32_t hash_algo;           /* SHMKV_HASH_*; fixed per segment */
    uint32_t _reserved;
    /* --- KV events (layout 3) --- */
    uint32_t event_capacity;      /* events the ring keeps, 0..SHMKV_MAX_EVENTS; 0 = off */
    uint32_t _reserved_ev;        /* 0 */
} shmkv_config_t;

/* ---- region layout, derived from the config by shmkv_layout_compute() ---------------- */
typedef struct {
    uint64_t token_bytes;      /* one token, one layer, K only: heads*dim*itemsize */
    uint64_t block_bytes;      /* one block, one layer, K only: block_size*token_bytes */
    uint64_t layer_stride;     /* distance between layers in a pool (page rounded) */
    uint64_t index_capacity;   /* entries of the hash index (power of two) */
    uint64_t off_blocks, off_free, off_procs, off_seqs, off_seq_free, off_tables;
    uint64_t off_tokens, off_index, off_kpool, off_vpool;
    uint64_t segment_size;     /* total bytes; a multiple of SHMKV_PAGE */
    /* --- KV events (layout 3) --- */
    uint64_t off_events;       /* the event ring (shmkv_event_ring_t + records); 0 if off */
    uint64_t event_record_bytes; /* one record: shmkv_event_t + block_size token ids,
                                    line rounded; 0 if off */
    /* --- quantized pools; every field 0 for float pools --------------------------- */
    uint64_t scale_bytes;      /* int8: one token, one layer, K only: heads*4 bytes of
                                  float32 scales; 0 otherwise */
    uint64_t scale_stride;     /* int8: distance between layers in a scale region (page
                                  rounded num_blocks*block_size*scale_bytes) */
    uint64_t off_kscale;       /* int8: K scales [layers][num_blocks][block_size][heads] */
    uint64_t off_vscale;       /* int8: V scales, same shape */
    uint64_t off_hscale;       /* float8_e4m3: per-head scales [2][layers][heads] float32;
                                  MUTABLE: written by set_kv_scales under pool_lock (and
                                  1.0 by the creator), read relaxed by every data path.
                                  Untrusted like all data: NaN/inf give NaN, never a
                                  crash */
} shmkv_layout_t;

/* ---- header: immutable after READY ------------------------------------------------- */
typedef struct {
    uint64_t magic;            /* SHMKV_MAGIC */
    uint32_t layout_version;   /* SHMKV_LAYOUT_VERSION */
    uint32_t header_size;      /* SHMKV_HEADER_SIZE */
    uint64_t abi_fingerprint;  /* shmkv_abi_fingerprint() of the creator's build */
    uint64_t segment_size;     /* bytes; must equal fstat() and layout.segment_size */
    shmkv_config_t config;
    shmkv_layout_t layout;
    uint64_t creator_pid;
    uint64_t create_time_ns;   /* CLOCK_REALTIME */
    uint64_t hash_seed;        /* random at create; seeds block hashes for every process */
    uint64_t checksum;         /* FNV-1a 64 of every byte before this field */
} shmkv_header_t;

/* ---- mutable shared state ----------------------------------------------------------- */
typedef struct {
    uint32_t state;            /* INIT while the creator builds; READY (release) last */
    /* --- the recovery gate (kernels/recover.h, ops.h): read without the pool lock --- */
    uint32_t recover_pending;  /* 1: a pass had to leave work for a later one (a dead
                                  owner's sequence a live process held locked, a
                                  leaver's sequence someone held): the next scheduled
                                  pass runs although no process is dead.  Written under
                                  pool_lock; read anywhere */
    uint64_t recoverer;        /* proc token of the process running a scheduled pass
                                  (recover() without full), 0 = none: one at a time.
                                  CAS; a dead or stale holder's is taken over */
    uint64_t recoverer_since_ns; /* CLOCK_MONOTONIC when the recoverer took it (a hint:
                                  a holder older than the taker's lock bound is stale) */
    uint32_t _pad0[10];
    pthread_mutex_t pool_lock; /* robust, process-shared; see the file comment */
    uint8_t  _pad1[SHMKV_LINE - (sizeof(pthread_mutex_t) % SHMKV_LINE)];
    /* --- protected by pool_lock; readers without the lock load them relaxed --- */
    uint32_t free_top;         /* entries in free_stack, 0..num_blocks */
    uint32_t cached_count;     /* blocks on the LRU list, 0..num_blocks */
    uint32_t lru_head;         /* least recently used CACHED block, or NIL */
    uint32_t lru_tail;         /* most recently used CACHED block, or NIL */
    uint32_t seq_free_top;     /* entries in seq_free, 0..max_seqs */
    uint32_t _unused0;         /* (was num_seqs: now derived, see shmkv_counts) */
    uint32_t num_procs;        /* ACTIVE process slots */
    uint32_t peak_used;        /* high-water mark of used blocks */
    uint32_t index_used;       /* occupied index entries (tombstones excluded) */
    uint32_t index_tombs;      /* tombstones in the index */
    uint64_t lru_clock;        /* ticks on every release of a hashed block */
    uint64_t last_recovery_ns; /* duration of the last recovery pass */
    uint64_t max_recovery_ns;  /* longest recovery pass so far */
    uint8_t  _pad2[8];
    /* --- statistics: atomic, relaxed (ordering of stats against data is not needed) --- */
    uint64_t counters[SHMKV_COUNTER_SLOTS];
} shmkv_shared_t;

/* ---- one physical block's metadata (48 bytes) -------------------------------------- */
typedef struct {
    uint32_t ref_cnt;          /* table entries + in-flight records referring to it;
                                  atomic; changed under pool_lock */
    uint32_t flags;            /* SHMKV_BLOCK_HASHED: hash[] is valid and in the index */
    uint32_t lru_prev;         /* CACHED blocks only: LRU neighbours, or NIL */
    uint32_t lru_next;
    uint64_t hash[2];          /* 128-bit block hash (the prefix cache) */
    uint64_t last_access;      /* lru_clock when last released */
    uint32_t num_tokens;       /* tokens the hash covers (== block_size when hashed) */
    uint32_t _pad;
} shmkv_block_t;

/* ---- one attached process (256 bytes: four cache lines, none shared with another) ---- */
/* Hot-path statistics of one process (see shmkv_proc_t.counters); each is added to the
 * global counter SHMKV_PC_GLOBAL[i] names. */
enum { SHMKV_PC_APPENDED = 0, SHMKV_PC_GATHERED = 1, SHMKV_PC_ALLOCATIONS = 2,
       SHMKV_PC_FREES = 3, SHMKV_PC_SEQS_CREATED = 4, SHMKV_PC_SEQS_FREED = 5,
       SHMKV_PC_NUSED = 6, SHMKV_PROC_COUNTERS = 8 };  /* 6, 7: room to grow */
#define SHMKV_PCACHE_BLOCKS 20u   /* free blocks a process keeps for itself */
#define SHMKV_PCACHE_SEQS    8u   /* free sequence slots a process keeps for itself */
typedef struct {
    /* line 0: identity (peers read it to probe liveness) and in-flight records */
    uint32_t state;            /* FREE / ACTIVE; written under pool_lock */
    uint32_t gen;              /* bumped each time the slot is taken: tokens never repeat */
    uint64_t pid;              /* for display; liveness is the OFD lock, not the pid */
    uint64_t pid_start;        /* /proc/<pid>/stat start time in clock ticks, display */
    uint64_t attach_time_ns;   /* CLOCK_REALTIME */
    uint32_t inflight[SHMKV_INFLIGHT_PER_PROC];
                               /* blocks this process holds outside every table (a
                                  copy-on-write target being filled); NIL = empty.
                                  Written under pool_lock; each counts one ref. */
    /* line 1 */
    uint64_t counters[SHMKV_PROC_COUNTERS];
                               /* hot-path statistics of this process, kept here so
                                  processes do not bounce one shared line per call;
                                  relaxed atomics by the owner.  stats() adds them to
                                  the global counters; when the slot is released they
                                  are folded in (pool_lock). */
    /* lines 2-3: the process's own cache of free blocks and sequence slots, so that a
     * sequence's life (create, grow by a block, free) touches no shared line and takes
     * no pool lock.  Everything here is protected by cache_lock. */
    uint64_t cache_lock;       /* 0 or the holder's proc token (CAS).  Taken by the owner
                                  on its fast paths (never waiting for anything while
                                  holding it), and by a pool_lock holder (recovery,
                                  check, a drain before CacheFullError).
                                  Order: seq.writer, pool_lock, cache_lock. */
    uint32_t cache_nblocks;    /* entries of cache_blocks, 0..SHMKV_PCACHE_BLOCKS */
    uint32_t cache_nseqs;      /* entries of cache_seqs, 0..SHMKV_PCACHE_SEQS */
    uint32_t cache_blocks[SHMKV_PCACHE_BLOCKS];
                               /* free blocks: ref_cnt 0, not hashed, on no list */
    uint32_t cache_seqs[SHMKV_PCACHE_SEQS];
                               /* FREE sequence slots on no free stack */
} shmkv_proc_t;

/* ---- one sequence slot (128 bytes) -------------------------------------------------- */
enum { SHMKV_SEQF_UNTRACKED = 1u,  /* token ids not all known: no more block hashing */
       SHMKV_SEQF_COW_TAIL = 2u    /* truncate kept part of a block that others hold or can
                                      find whole (shared, or hashed): the next write into
                                      the partial last block copies it first, as a shared
                                      one (set before truncate publishes len, cleared by
                                      the copy-on-write commit; an extra copy is its only
                                      cost when stale) */ };
typedef struct {
    uint32_t state;            /* FREE / BUILDING / LIVE; written under pool_lock */
    uint32_t gen;              /* bumped on every allocation of the slot; part of the id */
    uint64_t owner;            /* proc token of the owner; 0 = detached */
    uint64_t writer;           /* sequence lock: 0 or the holder's proc token (CAS) */
    uint32_t len;              /* published tokens; stored (release) by the writer */
    uint32_t nblocks;          /* valid table entries; under pool_lock */
    uint32_t hashed;           /* leading blocks whose hash is published in the index
                                  (pool_lock); <= hash_ready */
    uint32_t priority;         /* for evict("priority"): lower goes first */
    uint64_t last_access_ns;   /* CLOCK_REALTIME_COARSE of the last use, evict("lru") */
    uint64_t access_count;     /* uses, evict("lfu"); by the sequence-lock holder */
    uint64_t created_ns;       /* CLOCK_REALTIME */
    uint32_t flags;            /* SHMKV_SEQF_*; by the sequence-lock holder */
    uint32_t hash_ready;       /* leading full blocks whose hash is computed into their
                                  block meta (not yet findable); by the lock holder */
    uint64_t salt[2];          /* digest of the cache salt, hashed into block 0; {0,0} none */
    uint32_t trimmed;          /* tokens dropped by trim_streaming so far */
    /* journal of an in-progress trim (pool_lock held throughout; recovery redoes it):
     * drop trim_d blocks after the first trim_s, moving the trim_k after them left in
     * chunks of at most trim_d entries; trim_chunk = chunk in progress; trim_trimmed =
     * the value `trimmed` takes when the trim completes; active iff trim_d != 0 */
    uint32_t trim_s, trim_d, trim_k, trim_chunk, trim_len, trim_trimmed;
    uint8_t  _pad[12];
} shmkv_seq_t;

/* ---- one hash-index entry (24 bytes): open addressing, linear probing --------------- */
typedef struct {
    uint64_t hash[2];          /* key; {0,0} = empty, {0,1} = tombstone */
    uint32_t block;            /* the block that holds this hash's data */
    uint32_t _pad;
} shmkv_index_t;
#define SHMKV_INDEX_MAX_PROBE 64u   /* bounded probing: an insert past this is skipped */


/* ---- KV events: a ring of what the prefix index did (vLLM's KV events) --------------- *
 * Written under pool_lock by every process (kernels/events.h), in pool_lock order, so the
 * order of the ring is the order of the index changes.  Read lock-free (seqlock style):
 *
 *   writer (pool_lock held)                   reader (no lock)
 *     seq = ring.head                           h = load_acquire(ring.head)
 *     slot = seq % (capacity + 1)               for seq in [max(since, h - capacity), h):
 *     slot.stamp = 0          (relaxed)            s1 = load_acquire(slot.stamp)
 *     fence(release)                               copy the record
 *     fill the record                              fence(acquire)
 *     slot.stamp = seq + 1    (release)            s2 = load(slot.stamp)
 *     ring.head = seq + 1     (release)            s1 == s2 == seq + 1 ? the event : lost
 *
 * capacity + 1 slots: the slot being written (head's) never holds one of the `capacity`
 * events a reader may ask for, so a writer killed at any instruction destroys no visible
 * event, and its half-written slot is invisible (stamp 0, or seq + 1 with head not moved
 * on: only seqs < head are read).  The next writer rewrites the same seq.  Nothing here
 * is derived state: recovery leaves the ring alone; check() verifies every event in the
 * window carries its own stamp (no writer is between the two stores while we hold the
 * pool lock). */
enum { SHMKV_EV_STORED = 1, SHMKV_EV_REMOVED = 2, SHMKV_EV_CLEARED = 3 };
enum { SHMKV_EVF_PARENT = 1u };           /* shmkv_event_t.flags: parent[] is valid */
typedef struct {
    uint64_t head;             /* seq of the next event = events written so far; written
                                  (release) by the pool_lock holder after the slot's stamp;
                                  readers load it acquire.  Any value is safe to read. */
    uint64_t _pad[7];
} shmkv_event_ring_t;           /* one cache line at off_events; the records follow */
typedef struct {
    uint64_t stamp;            /* seq + 1 of the event this slot holds; 0 while being
                                  written (or never written).  Release-stored last. */
    uint32_t kind;             /* SHMKV_EV_* */
    uint32_t num_tokens;       /* token ids after this struct: block_size (stored), 0 */
    uint64_t hash[2];          /* the block's 128-bit hash (stored / removed) */
    uint64_t parent[2];        /* the parent block's hash, valid iff SHMKV_EVF_PARENT */
    uint64_t time_ns;          /* CLOCK_REALTIME when written */
    uint32_t block;            /* physical block id (for inspection) */
    uint32_t flags;            /* SHMKV_EVF_* */
    /* int32_t token_ids[num_tokens] follow, in the record (event_record_bytes) */
} shmkv_event_t;

/* ---- ABI checks --------------------------------------------------------------------- */
_Static_assert(sizeof(shmkv_header_t) <= SHMKV_HEADER_SIZE, "header outgrew its page slot");
_Static_assert(sizeof(shmkv_shared_t) + SHMKV_SHARED_OFFSET <= SHMKV_PAGE,
               "shared state must fit in page 0");
_Static_assert(sizeof(shmkv_block_t) == 48, "block meta size");
_Static_assert(sizeof(shmkv_seq_t) == 128, "sequence slot size");
_Static_assert(sizeof(shmkv_proc_t) == 256, "process slot size");
_Static_assert(offsetof(shmkv_proc_t, counters) == 64, "proc counters on line 1");
_Static_assert(offsetof(shmkv_proc_t, cache_lock) == 128, "proc cache on lines 2-3");
_Static_assert(sizeof(shmkv_index_t) == 24, "index entry size");
_Static_assert(sizeof(shmkv_layout_t) == 22 * 8,
               "layout: 15 fields + the event ring's 2 + the quant region's 5");
_Static_assert(offsetof(shmkv_shared_t, pool_lock) % SHMKV_LINE == 0, "lock on its own line");
_Static_assert(offsetof(shmkv_shared_t, pool_lock) == SHMKV_LINE, "state and the gate: one line");
_Static_assert(SHMKV_NCOUNTERS <= SHMKV_COUNTER_SLOTS, "too many counters");
_Static_assert(sizeof(shmkv_event_ring_t) == SHMKV_LINE, "event ring head: one line");
_Static_assert(sizeof(shmkv_event_t) == 64, "event record header size");

/* The fingerprint covers every size and offset a peer build must agree on. */
static inline uint64_t shmkv_mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdULL;
}
static inline uint64_t shmkv_abi_fingerprint(void) {
    uint64_t h = SHMKV_LAYOUT_VERSION;
    h = shmkv_mix(h, sizeof(shmkv_header_t));
    h = shmkv_mix(h, sizeof(shmkv_shared_t));
    h = shmkv_mix(h, offsetof(shmkv_shared_t, pool_lock));
    h = shmkv_mix(h, sizeof(pthread_mutex_t));
    h = shmkv_mix(h, offsetof(shmkv_shared_t, counters));
    h = shmkv_mix(h, sizeof(shmkv_block_t));
    h = shmkv_mix(h, sizeof(shmkv_proc_t));
    h = shmkv_mix(h, sizeof(shmkv_seq_t));
    h = shmkv_mix(h, offsetof(shmkv_seq_t, writer));
    h = shmkv_mix(h, offsetof(shmkv_seq_t, len));
    h = shmkv_mix(h, offsetof(shmkv_seq_t, trim_s));
    h = shmkv_mix(h, offsetof(shmkv_seq_t, trim_trimmed));
    h = shmkv_mix(h, sizeof(shmkv_layout_t));
    h = shmkv_mix(h, sizeof(shmkv_index_t));
    h = shmkv_mix(h, SHMKV_INFLIGHT_PER_PROC);
    h = shmkv_mix(h, offsetof(shmkv_proc_t, counters));
    h = shmkv_mix(h, offsetof(shmkv_proc_t, cache_seqs));
    h = shmkv_mix(h, SHMKV_PCACHE_BLOCKS);
    h = shmkv_mix(h, SHMKV_NCOUNTERS);
    h = shmkv_mix(h, sizeof(shmkv_event_t));
    h = shmkv_mix(h, offsetof(shmkv_event_t, time_ns));
    h = shmkv_mix(h, offsetof(shmkv_config_t, event_capacity));
    h = shmkv_mix(h, offsetof(shmkv_layout_t, scale_bytes));     /* quantized pools */
    h = shmkv_mix(h, offsetof(shmkv_layout_t, off_hscale));
    /* the sequence flags a peer must honour: a build without truncate would write into a
     * block SHMKV_SEQF_COW_TAIL says others still read (same layout, other meaning) */
    h = shmkv_mix(h, SHMKV_SEQF_COW_TAIL);
    /* the recovery gate: a peer build that neither sets recover_pending nor honours the
     * recoverer word would leave a scheduled pass blind to what it left (same layout) */
    h = shmkv_mix(h, offsetof(shmkv_shared_t, recoverer));
    return h;
}

static inline uint64_t shmkv_fnv1a(const void *p, size_t n) {
    const uint8_t *b = (const uint8_t *)p;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 0x100000001b3ULL; }
    return h;
}
static inline uint64_t shmkv_header_checksum(const shmkv_header_t *h) {
    return shmkv_fnv1a(h, offsetof(shmkv_header_t, checksum));
}

/* ---- atomics: read-modify-write returns the previous value -------------------------- */
static inline uint32_t shmkv_atomic_load_u32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
/* relaxed: statistics and hints only, never used to decide ownership */
static inline uint32_t shmkv_atomic_load_u32_relaxed(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
/* acquire: pairs with the release store that published a sequence length */
static inline uint32_t shmkv_atomic_load_u32_acquire(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline uint64_t shmkv_atomic_load_u64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
static inline uint64_t shmkv_atomic_load_u64_relaxed(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void shmkv_atomic_store_u32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
/* release: every byte written before a publish is visible to whoever acquires it */
static inline void shmkv_atomic_store_u32_release(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline void shmkv_atomic_store_u64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_SEQ_CST); }
/* release: unlocking a sequence publishes everything written under it */
static inline void shmkv_atomic_store_u64_release(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline uint32_t shmkv_atomic_add_u32(uint32_t *p, uint32_t v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline uint32_t shmkv_atomic_sub_u32(uint32_t *p, uint32_t v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); }
/* relaxed: counters are statistics */
static inline uint64_t shmkv_atomic_add_u64_relaxed(uint64_t *p, uint64_t v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline int shmkv_atomic_cas_u64(uint64_t *p, uint64_t expect, uint64_t desired) {
    return __atomic_compare_exchange_n(p, &expect, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

/* ---- layout computation: the one place offsets come from ---------------------------- */
static inline uint64_t shmkv_round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

static inline uint32_t shmkv_dtype_itemsize(uint32_t dtype) {
    switch (dtype) {
    case SHMKV_F16: case SHMKV_BF16: return 2;
    case SHMKV_F32: return 4;
    case SHMKV_I8: case SHMKV_E4M3: return 1;
    default: return 0;
    }
}

/* Validates cfg and fills *out.  Returns SHMKV_EINVAL for a config outside the limits
 * (including one whose segment would not fit in 2^47 bytes). */
static inline int shmkv_layout_compute(const shmkv_config_t *c, shmkv_layout_t *out) {
    memset(out, 0, sizeof(*out));
    if (c->num_layers < 1 || c->num_layers > SHMKV_MAX_LAYERS) return SHMKV_EINVAL;
    if (c->num_kv_heads < 1 || c->num_kv_heads > SHMKV_MAX_HEADS) return SHMKV_EINVAL;
    if (c->head_dim < 1 || c->head_dim > SHMKV_MAX_HEAD_DIM) return SHMKV_EINVAL;
    if (c->block_size < 1 || c->block_size > SHMKV_MAX_BLOCK_SIZE) return SHMKV_EINVAL;
    if (c->num_blocks < 1 || c->num_blocks > SHMKV_MAX_NUM_BLOCKS) return SHMKV_EINVAL;
    if (c->max_seqs < 1 || c->max_seqs > SHMKV_MAX_SEQS) return SHMKV_EINVAL;
    if (c->max_blocks_per_seq < 1 || c->max_blocks_per_seq > c->num_blocks) return SHMKV_EINVAL;
    if (c->max_procs < 1 || c->max_procs > SHMKV_MAX_PROCS) return SHMKV_EINVAL;
    if (shmkv_dtype_itemsize(c->dtype) == 0 || c->itemsize != shmkv_dtype_itemsize(c->dtype))
        return SHMKV_EINVAL;
    if (c->hash_algo != SHMKV_HASH_XXH && c->hash_algo != SHMKV_HASH_SHA256) return SHMKV_EINVAL;
    if (c->_reserved != 0) return SHMKV_EINVAL;
    if (c->event_capacity > SHMKV_MAX_EVENTS || c->_reserved_ev != 0) return SHMKV_EINVAL;
    if (c->event_capacity != 0 && c->block_size > SHMKV_EVENT_MAX_TOKENS) return SHMKV_EINVAL;
    const uint64_t LIMIT = 1ULL << 47;
    uint64_t tb = (uint64_t)c->num_kv_heads * c->head_dim * c->itemsize;      /* < 2^37 */
    uint64_t bb = tb * c->block_size;                                           /* < 2^53 */
    if (bb > LIMIT) return SHMKV_EINVAL;
    uint64_t lb = bb * c->num_blocks;
    if (c->num_blocks != 0 && lb / c->num_blocks != bb) return SHMKV_EINVAL;
    if (lb > LIMIT) return SHMKV_EINVAL;
    uint64_t ls = shmkv_round_up(lb, SHMKV_PAGE);
    uint64_t pool = ls * c->num_layers;
    if (pool / c->num_layers != ls || pool > LIMIT) return SHMKV_EINVAL;
    uint64_t tables = (uint64_t)c->max_seqs * c->max_blocks_per_seq * 4u;
    if (tables > LIMIT) return SHMKV_EINVAL;
    uint64_t tokens = (uint64_t)c->num_blocks * c->block_size * 4u;
    if (tokens > LIMIT) return SHMKV_EINVAL;
    uint64_t cap = 16;
    while (cap < 2ull * c->num_blocks) cap <<= 1;

    uint64_t o = SHMKV_PAGE;
    out->token_bytes = tb;
    out->block_bytes = bb;
    out->layer_stride = ls;
    out->index_capacity = cap;
    out->off_blocks = o;   o = shmkv_round_up(o + (uint64_t)c->num_blocks * sizeof(shmkv_block_t), SHMKV_LINE);
    out->off_free = o;     o = shmkv_round_up(o + (uint64_t)c->num_blocks * 4u, SHMKV_LINE);
    out->off_procs = o;    o = shmkv_round_up(o + (uint64_t)c->max_procs * sizeof(shmkv_proc_t), SHMKV_LINE);
    out->off_seqs = o;     o = shmkv_round_up(o + (uint64_t)c->max_seqs * sizeof(shmkv_seq_t), SHMKV_LINE);
    out->off_seq_free = o; o = shmkv_round_up(o + (uint64_t)c->max_seqs * 4u, SHMKV_LINE);
    out->off_tables = o;   o = shmkv_round_up(o + tables, SHMKV_LINE);
    out->off_tokens = o;   o = shmkv_round_up(o + tokens, SHMKV_LINE);
    out->off_index = o;    o = shmkv_round_up(o + cap * sizeof(shmkv_index_t), SHMKV_PAGE);
    if (c->event_capacity != 0) {   /* the event ring: head line + capacity + 1 records */
        out->event_record_bytes = shmkv_round_up(sizeof(shmkv_event_t) + 4ull * c->block_size,
                                                 SHMKV_LINE);
        out->off_events = o;
        o = shmkv_round_up(o + sizeof(shmkv_event_ring_t)
                           + ((uint64_t)c->event_capacity + 1) * out->event_record_bytes,
                           SHMKV_PAGE);
    }
    out->off_kpool = o;    o += pool;
    out->off_vpool = o;    o += pool;
    /* quant region: after the pools, so float segments keep their offsets */
    if (c->dtype == SHMKV_I8) {
        uint64_t sb = (uint64_t)c->num_kv_heads * 4u;                           /* < 2^15 */
        uint64_t sl = sb * c->block_size * c->num_blocks;                       /* < 2^62 */
        if (sl > LIMIT) return SHMKV_EINVAL;
        out->scale_bytes = sb;
        out->scale_stride = shmkv_round_up(sl, SHMKV_PAGE);
        uint64_t sp = out->scale_stride * c->num_layers;
        if (sp > LIMIT) return SHMKV_EINVAL;
        out->off_kscale = o;   o += sp;
        out->off_vscale = o;   o += sp;
    } else if (c->dtype == SHMKV_E4M3) {
        out->off_hscale = o;
        o = shmkv_round_up(o + 2ull * c->num_layers * c->num_kv_heads * 4u, SHMKV_PAGE);
    }
    if (o > 3 * LIMIT) return SHMKV_EINVAL;
    out->segment_size = o;
    return SHMKV_OK;
}

#endif /* SHMKV_LAYOUT_H */
