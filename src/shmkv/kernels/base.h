/*
 * kernels/base.h -- the process-local ctx, crash points and counters, bind and init of a segment,
 * process liveness.  Writes: the whole header and every region at init (seg_init); after
 * that nothing in shared memory.
 */
#ifndef SHMKV_KERNELS_BASE_H
#define SHMKV_KERNELS_BASE_H

#define _GNU_SOURCE 1
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#include "_layout.h"

#ifdef SHMKV_DEBUG
#include <assert.h>
#define SHMKV_ASSERT(x) assert(x)
#else
#define SHMKV_ASSERT(x) ((void)0)
#endif

#if defined(__x86_64__) || defined(__i386__)
#define SHMKV_PAUSE() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define SHMKV_PAUSE() __asm__ __volatile__("yield")
#else
#define SHMKV_PAUSE() ((void)0)
#endif

/* ---- crash points: the chaos harness makes a process _exit() at a named line -------- */
/* Process-local (never shared).  Off unless set_crash_point() armed one; the check is one
 * predictable branch.  Points sit inside every critical section and between the steps
 * of every multi-step operation. */
#define SHMKV_CRASH_POINTS(X) \
    X(ALLOC_MID, "alloc_mid")               /* pool lock: some blocks popped */          \
    X(GROW_BEFORE_TAIL, "grow_before_tail") /* pool lock: table written, nblocks not */   \
    X(GROW_AFTER_TAIL, "grow_after_tail")   /* pool lock: tail published */              \
    X(COW_AFTER_COPY, "cow_after_copy")     /* seq lock: copy made, not committed */     \
    X(COW_COMMIT_MID, "cow_commit_mid")     /* pool lock: table swapped, old ref held */ \
    X(APPEND_BEFORE_PUBLISH, "append_before_publish") /* data written, len not */        \
    X(APPEND_AFTER_PUBLISH, "append_after_publish")   /* len published, seq lock held */ \
    X(FREE_MID, "free_mid")                 /* pool lock: state FREE, half decref'd */  \
    X(FORK_MID, "fork_mid")                 /* pool lock: child half built */            \
    X(CREATE_MID, "create_mid")             /* pool lock: slot taken, not counted */     \
    X(GATHER_MID, "gather_mid")             /* seq lock: half the layers copied */       \
    X(RECOVER_MID, "recover_mid")           /* pool lock: refcounts recounted, lists not */ \
    X(PUBLISH_MID, "publish_mid")           /* pool lock: some block hashes indexed */   \
    X(TRIM_MID, "trim_mid")                 /* pool lock: trim journal half applied */ \
    X(EVENT_MID, "event_mid")               /* pool lock: event record half written */ \
    X(RESET_MID, "reset_mid")               /* pool lock: prefix index half cleared */ \
    X(TRUNCATE_MID, "truncate_mid")         /* len/nblocks lowered, tail half released */

#define SHMKV_X_ENUM(id, name) SHMKV_CP_##id,
enum { SHMKV_CP_NONE = 0, SHMKV_CRASH_POINTS(SHMKV_X_ENUM) SHMKV_NCRASH };
#undef SHMKV_X_ENUM
#define SHMKV_X_NAME(id, name) name,
static const char *const SHMKV_CRASH_NAMES[] = { "none", SHMKV_CRASH_POINTS(SHMKV_X_NAME) NULL };
#undef SHMKV_X_NAME
/* Planted bugs: the chaos harness must catch each of them (proof that it can fail).
 * Process-local; off unless plant_bug() is called. */
enum { SHMKV_PLANT_NONE = 0, SHMKV_PLANT_NO_RECOVERY = 1, SHMKV_PLANT_EARLY_PUBLISH = 2,
       SHMKV_PLANT_NO_COW = 3, SHMKV_PLANT_LEAK_ON_FREE = 4,
       SHMKV_PLANT_TORN_EVENT = 5 /* an event's seq published before its record */ };

/* The switches of both (process-local, never shared).  The kernels are static, so every
 * extension module that compiles them has its own copy of every static variable: the
 * kernels therefore read the switches through one pointer, which each such module binds
 * at import to _core's instance (shmkv._core.debug_state(), see DEVELOP.md).  Until it
 * is bound a module reads its own all-off copy. */
typedef struct {
    int crash_id;               /* SHMKV_CP_* armed, 0 = none */
    long crash_countdown;       /* passes left before _exit(86) */
    int crash_stop;             /* 1: raise(SIGSTOP) there instead (a stopped holder) */
    int plant;                  /* SHMKV_PLANT_* */
} shmkv_dbg_t;
static shmkv_dbg_t shmkv_dbg_local;
static shmkv_dbg_t *shmkv_dbg = &shmkv_dbg_local;
static inline void shmkv_crash(int id) {
    if (__builtin_expect(shmkv_dbg->crash_id == id, 0) && --shmkv_dbg->crash_countdown <= 0) {
        if (!shmkv_dbg->crash_stop) _exit(86);
        shmkv_dbg->crash_id = 0;        /* stopped once; after SIGCONT it goes on */
        raise(SIGSTOP);
    }
}
#define SHMKV_CRASH(id) shmkv_crash(SHMKV_CP_##id)

/* ---- the process-local view of a segment (never in shared memory) ---------------- */
typedef struct {
    uint8_t *base;
    uint64_t size;              /* mapped bytes (== fstat at attach) */
    shmkv_header_t *hdr;
    shmkv_shared_t *sh;
    shmkv_block_t *blocks;
    uint32_t *free_stack;
    shmkv_proc_t *procs;
    shmkv_seq_t *seqs;
    uint32_t *seq_free;
    int32_t *tables;
    int32_t *tokens;            /* [num_blocks][block_size] token ids */
    shmkv_index_t *index;
    uint8_t *kpool;
    uint8_t *vpool;
    float *kscale, *vscale;     /* int8 pools: per-token scale regions (layer 0), or NULL */
    float *hscale;              /* float8 pools: [2][layers][heads] per-head scales, or NULL */
    shmkv_config_t cfg;         /* trusted copies, validated at bind */
    shmkv_layout_t lay;
    int lock_fd;                /* fd whose OFD lock marks us alive; probes use it; -1 */
    uint32_t proc_slot;         /* our process slot, or SHMKV_NIL */
    uint64_t proc_token;        /* ((gen << 32) | (slot + 1)), or 0 when unregistered */
    int64_t timeout_ns;         /* bound on every wait */
    int64_t backoff_ns;         /* after a pool-lock wait ran out: so long without another
                                   wait (only tries); 0 = off.  Process-local, like all
                                   of this struct (touched atomically: threads share it) */
    int64_t backoff_until_ns;   /* CLOCK_MONOTONIC end of the current pause, 0 = none */
    uint64_t lock_timeouts;     /* pool-lock waits that ran out, or were refused in a pause */
    int readonly;
    uint8_t *events;            /* the KV event ring (off_events), NULL when it is off */
} shmkv_ctx_t;

/* A recovery report. */
typedef struct {
    uint64_t processes;         /* dead process slots released */
    uint64_t sequences;         /* sequences freed (owner dead, or half-built) */
    uint64_t blocks;            /* blocks whose ref_cnt fell to 0 by the rebuild */
    uint64_t locks;             /* sequence locks taken from dead holders */
    uint64_t tails;             /* unpublished tail blocks trimmed from sequences */
    uint64_t refcounts_fixed;   /* blocks whose ref_cnt was rewritten */
    uint64_t corrupt;           /* sequences dropped because their table was corrupt */
    uint64_t duration_ns;
    uint64_t blocks_visited;    /* block entries the pass read: 0 when no pass ran; the
                                   dead's table entries and in-flight records (the pass
                                   of what died); num_blocks (a full pass walks the pool) */
    uint32_t full;              /* 1: the full pass ran (every derived structure rebuilt) */
    uint32_t busy;              /* 1: another process was recovering; nothing was done */
} shmkv_recovery_t;

static inline int64_t shmkv_now_ns(clockid_t clk) {
    struct timespec ts;
    clock_gettime(clk, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void shmkv_count(shmkv_ctx_t *c, int which, uint64_t v) {
    shmkv_atomic_add_u64_relaxed(&c->sh->counters[which], v);
}

/* A hot-path counter of our own process slot (see shmkv_proc_t.counters). */
static inline void shmkv_count_proc(shmkv_ctx_t *c, int which, uint64_t v) {
    if (c->proc_slot < c->cfg.max_procs)
        shmkv_atomic_add_u64_relaxed(&c->procs[c->proc_slot].counters[which], v);
}

/* The global counter each per-process counter adds to. */
static const int SHMKV_PC_GLOBAL[SHMKV_PC_NUSED] = {
    SHMKV_C_APPENDED_TOKENS, SHMKV_C_GATHERED_TOKENS, SHMKV_C_ALLOCATIONS, SHMKV_C_FREES,
    SHMKV_C_SEQS_CREATED, SHMKV_C_SEQS_FREED };

/* Counts on our process slot when we have one (no shared line), else globally. */
static inline void shmkv_count_hot(shmkv_ctx_t *c, int pc, uint64_t v) {
    if (c->proc_slot < c->cfg.max_procs)
        shmkv_atomic_add_u64_relaxed(&c->procs[c->proc_slot].counters[pc], v);
    else
        shmkv_count(c, SHMKV_PC_GLOBAL[pc], v);
}

/* Every counter of the segment: the global ones plus what each attached process has
 * counted on its own slot.  out has SHMKV_NCOUNTERS entries.  No lock (statistics). */
static inline void shmkv_counters_total(const shmkv_ctx_t *c, uint64_t *out) {
    for (int i = 0; i < SHMKV_NCOUNTERS; i++)
        out[i] = shmkv_atomic_load_u64_relaxed(&c->sh->counters[i]);
    for (uint32_t s = 0; s < c->cfg.max_procs; s++) {
        const shmkv_proc_t *p = &c->procs[s];
        if (shmkv_atomic_load_u32_relaxed(&p->state) != SHMKV_PROC_ACTIVE) continue;
        for (int i = 0; i < SHMKV_PC_NUSED; i++)
            out[SHMKV_PC_GLOBAL[i]] += shmkv_atomic_load_u64_relaxed(&p->counters[i]);
    }
}

/* Moves a process slot's counters into the global ones (pool_lock; slot released). */
static void shmkv__fold_proc_counters(shmkv_ctx_t *c, shmkv_proc_t *p) {
    for (int i = 0; i < SHMKV_PC_NUSED; i++)
        shmkv_count(c, SHMKV_PC_GLOBAL[i],
                    __atomic_exchange_n(&p->counters[i], 0, __ATOMIC_RELAXED));
}

/* ---- bind: validate a mapped segment and fill the ctx ------------------------------- */
/* Precondition: base maps `size` bytes.  Checks, in order: size, magic, version and ABI,
 * readiness, checksum, the layout recomputed from the config, the real size.  Reads the
 * header into a local copy first, so a writer racing with us cannot change what we
 * validated. */
static inline int shmkv_ctx_bind(shmkv_ctx_t *c, uint8_t *base, uint64_t size, int readonly) {
    memset(c, 0, sizeof(*c));
    c->lock_fd = -1;
    c->proc_slot = SHMKV_NIL;
    c->timeout_ns = 10LL * 1000000000LL;
    if (size < SHMKV_PAGE) return SHMKV_ENOTREADY;
    shmkv_header_t h;
    memcpy(&h, base, sizeof h);
    uint32_t state = shmkv_atomic_load_u32_acquire(&((shmkv_shared_t *)(base + SHMKV_SHARED_OFFSET))->state);
    /* the creator still sizing it (state 0), or building it: seg_init stores INIT first
     * and the header (magic included) later, so a zero magic under INIT is not "bad" */
    if (h.magic == 0 && (state == 0 || state == SHMKV_STATE_INIT)) return SHMKV_ENOTREADY;
    if (h.magic != SHMKV_MAGIC) return SHMKV_EBADMAGIC;
    if (h.layout_version != SHMKV_LAYOUT_VERSION || h.header_size != SHMKV_HEADER_SIZE)
        return SHMKV_EVERSION;
    if (h.abi_fingerprint != shmkv_abi_fingerprint()) return SHMKV_EVERSION;
    if (state == SHMKV_STATE_INIT) return SHMKV_ENOTREADY;
    if (state != SHMKV_STATE_READY) return SHMKV_ECORRUPT;
    /* re-read after READY was observed (acquire): the creator wrote the header before */
    memcpy(&h, base, sizeof h);
    if (shmkv_header_checksum(&h) != h.checksum) return SHMKV_ECORRUPT;
    shmkv_layout_t lay;
    if (shmkv_layout_compute(&h.config, &lay) != SHMKV_OK) return SHMKV_ECORRUPT;
    if (memcmp(&lay, &h.layout, sizeof lay) != 0) return SHMKV_ECORRUPT;
    if (h.segment_size != lay.segment_size || h.segment_size != size) return SHMKV_ECORRUPT;
    c->base = base;
    c->size = size;
    c->hdr = (shmkv_header_t *)base;
    c->sh = (shmkv_shared_t *)(base + SHMKV_SHARED_OFFSET);
    c->cfg = h.config;
    c->lay = lay;
    c->blocks = (shmkv_block_t *)(base + lay.off_blocks);
    c->free_stack = (uint32_t *)(base + lay.off_free);
    c->procs = (shmkv_proc_t *)(base + lay.off_procs);
    c->seqs = (shmkv_seq_t *)(base + lay.off_seqs);
    c->seq_free = (uint32_t *)(base + lay.off_seq_free);
    c->tables = (int32_t *)(base + lay.off_tables);
    c->tokens = (int32_t *)(base + lay.off_tokens);
    c->index = (shmkv_index_t *)(base + lay.off_index);
    c->kpool = base + lay.off_kpool;
    c->vpool = base + lay.off_vpool;
    c->kscale = lay.off_kscale ? (float *)(base + lay.off_kscale) : NULL;
    c->vscale = lay.off_vscale ? (float *)(base + lay.off_vscale) : NULL;
    c->hscale = lay.off_hscale ? (float *)(base + lay.off_hscale) : NULL;
    c->readonly = readonly;
    c->events = lay.off_events ? base + lay.off_events : NULL;
    return SHMKV_OK;
}

/* ---- init: the creator builds a fresh segment -------------------------------------- */
/* Precondition: base maps layout->segment_size zeroed bytes nobody else trusts yet
 * (state is 0).  Stores READY last, with release ordering. */
static inline int shmkv_seg_init(uint8_t *base, const shmkv_config_t *cfg, uint64_t pid,
                          uint64_t now_ns, uint64_t seed) {
    shmkv_layout_t lay;
    int st = shmkv_layout_compute(cfg, &lay);
    if (st != SHMKV_OK) return st;
    shmkv_shared_t *sh = (shmkv_shared_t *)(base + SHMKV_SHARED_OFFSET);
    shmkv_atomic_store_u32(&sh->state, SHMKV_STATE_INIT);

    pthread_mutexattr_t a;
    if (pthread_mutexattr_init(&a) != 0) return SHMKV_ESYS;
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    int rc = pthread_mutex_init(&sh->pool_lock, &a);
    pthread_mutexattr_destroy(&a);
    if (rc != 0) { errno = rc; return SHMKV_ESYS; }

    shmkv_block_t *blocks = (shmkv_block_t *)(base + lay.off_blocks);
    uint32_t *fs = (uint32_t *)(base + lay.off_free);
    for (uint32_t i = 0; i < cfg->num_blocks; i++) {
        blocks[i].lru_prev = blocks[i].lru_next = SHMKV_NIL;
        fs[i] = cfg->num_blocks - 1 - i;            /* pops hand out 0, 1, 2, ... */
    }
    sh->free_top = cfg->num_blocks;
    sh->lru_head = sh->lru_tail = SHMKV_NIL;
    shmkv_proc_t *procs = (shmkv_proc_t *)(base + lay.off_procs);
    for (uint32_t i = 0; i < cfg->max_procs; i++)
        for (uint32_t j = 0; j < SHMKV_INFLIGHT_PER_PROC; j++) procs[i].inflight[j] = SHMKV_NIL;
    uint32_t *sf = (uint32_t *)(base + lay.off_seq_free);
    for (uint32_t i = 0; i < cfg->max_seqs; i++) sf[i] = cfg->max_seqs - 1 - i;
    sh->seq_free_top = cfg->max_seqs;
    memset(base + lay.off_tables, 0xff, (size_t)cfg->max_seqs * cfg->max_blocks_per_seq * 4u);
    if (lay.off_hscale) {                       /* float8 pools: per-head scales 1.0 */
        float *hs = (float *)(base + lay.off_hscale);
        for (uint64_t i = 0; i < 2ull * cfg->num_layers * cfg->num_kv_heads; i++) hs[i] = 1.0f;
    }

    shmkv_header_t *h = (shmkv_header_t *)base;
    memset(h, 0, sizeof *h);
    h->magic = SHMKV_MAGIC;
    h->layout_version = SHMKV_LAYOUT_VERSION;
    h->header_size = SHMKV_HEADER_SIZE;
    h->abi_fingerprint = shmkv_abi_fingerprint();
    h->segment_size = lay.segment_size;
    h->config = *cfg;
    h->layout = lay;
    h->creator_pid = pid;
    h->create_time_ns = now_ns;
    h->hash_seed = seed;
    h->checksum = shmkv_header_checksum(h);
    shmkv_atomic_store_u32(&sh->state, SHMKV_STATE_READY);   /* publish: seq_cst >= release */
    return SHMKV_OK;
}

/* ---- process liveness ---------------------------------------------------------------- */
/* 1 if some open file description holds the liveness lock of proc slot `slot`, else 0.
 * Our own OFD never conflicts with itself, so callers treat their own slot separately. */
static int shmkv_ofd_probe(int fd, uint32_t slot) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_RDLCK;              /* conflicts with the holder's write lock */
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)(SHMKV_LOCK_BASE + slot);
    fl.l_len = 1;
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return 1;   /* cannot tell: assume alive */
    return fl.l_type != F_UNLCK;
}

static inline uint32_t shmkv_token_slot(uint64_t token) { return (uint32_t)(token & 0xffffffffu) - 1u; }
static inline uint32_t shmkv_token_gen(uint64_t token) { return (uint32_t)(token >> 32); }

/* Is the process behind `token` still attached and alive?  A token whose slot was
 * released or retaken (gen moved on) is dead. */
static int shmkv_proc_alive(shmkv_ctx_t *c, uint64_t token) {
    if (token == 0) return 0;
    if (token == c->proc_token) return 1;
    uint32_t slot = shmkv_token_slot(token);
    if (slot >= c->cfg.max_procs) return 0;
    shmkv_proc_t *p = &c->procs[slot];
    if (shmkv_atomic_load_u32(&p->state) != SHMKV_PROC_ACTIVE) return 0;
    if (shmkv_atomic_load_u32(&p->gen) != shmkv_token_gen(token)) return 0;
    if (c->lock_fd < 0) return 1;
    return shmkv_ofd_probe(c->lock_fd, slot);
}

#endif /* SHMKV_KERNELS_BASE_H */
