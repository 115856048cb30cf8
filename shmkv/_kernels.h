/*
 * _kernels.h -- the C kernels over a mapped shmkv segment.
 *
 * Every kernel is `noexcept nogil` from Cython's point of view: it returns a status
 * (SHMKV_OK or SHMKV_E*) and never touches Python.  One translator in _core.pyx turns a
 * status into the exception of shared/API.md.
 *
 * Kernels whose name ends in `_locked` run with ctx->sh->pool_lock held by the caller.
 * Kernels are all-or-nothing: they check capacity and validate every index they will use
 * before they mutate anything.  Every index or length read from the segment is checked
 * against the trusted copy of the config in the ctx (validated once, at bind) before use.
 */
#ifndef SHMKV_KERNELS_H
#define SHMKV_KERNELS_H

#define _GNU_SOURCE 1
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
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
    X(TRIM_MID, "trim_mid")                 /* pool lock: trim journal half applied */

#define SHMKV_X_ENUM(id, name) SHMKV_CP_##id,
enum { SHMKV_CP_NONE = 0, SHMKV_CRASH_POINTS(SHMKV_X_ENUM) SHMKV_NCRASH };
#undef SHMKV_X_ENUM
#define SHMKV_X_NAME(id, name) name,
static const char *SHMKV_CRASH_NAMES[] = { "none", SHMKV_CRASH_POINTS(SHMKV_X_NAME) NULL };
#undef SHMKV_X_NAME
static int shmkv_crash_id = 0;
static long shmkv_crash_countdown = 0;
static inline void shmkv_crash(int id) {
    if (__builtin_expect(shmkv_crash_id == id, 0) && --shmkv_crash_countdown <= 0) _exit(86);
}
#define SHMKV_CRASH(id) shmkv_crash(SHMKV_CP_##id)

/* Planted bugs: the chaos harness must catch each of them (proof that it can fail).
 * Process-local; off unless plant_bug() is called. */
enum { SHMKV_PLANT_NONE = 0, SHMKV_PLANT_NO_RECOVERY = 1, SHMKV_PLANT_EARLY_PUBLISH = 2,
       SHMKV_PLANT_NO_COW = 3, SHMKV_PLANT_LEAK_ON_FREE = 4 };
static int shmkv_plant = 0;

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
    shmkv_config_t cfg;         /* trusted copies, validated at bind */
    shmkv_layout_t lay;
    int lock_fd;                /* fd whose OFD lock marks us alive; probes use it; -1 */
    uint32_t proc_slot;         /* our process slot, or SHMKV_NIL */
    uint64_t proc_token;        /* ((gen << 32) | (slot + 1)), or 0 when unregistered */
    int64_t timeout_ns;         /* bound on every wait */
    int readonly;
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
static void shmkv_counters_total(const shmkv_ctx_t *c, uint64_t *out) {
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
static int shmkv_ctx_bind(shmkv_ctx_t *c, uint8_t *base, uint64_t size, int readonly) {
    memset(c, 0, sizeof(*c));
    c->lock_fd = -1;
    c->proc_slot = SHMKV_NIL;
    c->timeout_ns = 10LL * 1000000000LL;
    if (size < SHMKV_PAGE) return SHMKV_ENOTREADY;
    shmkv_header_t h;
    memcpy(&h, base, sizeof h);
    uint32_t state = shmkv_atomic_load_u32_acquire(&((shmkv_shared_t *)(base + SHMKV_SHARED_OFFSET))->state);
    if (h.magic == 0 && state == 0) return SHMKV_ENOTREADY;   /* creator still sizing it */
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
    c->readonly = readonly;
    return SHMKV_OK;
}

/* ---- init: the creator builds a fresh segment -------------------------------------- */
/* Precondition: base maps layout->segment_size zeroed bytes nobody else trusts yet
 * (state is 0).  Stores READY last, with release ordering. */
static int shmkv_seg_init(uint8_t *base, const shmkv_config_t *cfg, uint64_t pid,
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

/* ---- the pool lock --------------------------------------------------------------------- */
static int shmkv_recover_locked(shmkv_ctx_t *c, shmkv_recovery_t *r);

/* EOWNERDEAD: the holder died inside a critical section.  The tables are the truth;
 * rebuild everything derived from them, then mark the mutex consistent. */
static int shmkv__owner_died(shmkv_ctx_t *c) {
    shmkv_count(c, SHMKV_C_OWNER_DEAD, 1);
    shmkv_recovery_t r;
    int st = shmkv_recover_locked(c, &r);
    pthread_mutex_consistent(&c->sh->pool_lock);
    if (st != SHMKV_OK) pthread_mutex_unlock(&c->sh->pool_lock);   /* callers see no lock */
    return st;
}

/* Critical sections under the pool lock last tens of nanoseconds, so a busy lock is
 * nearly always free again within a few hundred cycles: spinning on trylock that long
 * (reading the lock word, not writing it) beats a futex sleep and wake-up (two system
 * calls and a context switch each way), which made two processes slower than one. */
#define SHMKV_POOL_SPIN 128

static inline int shmkv__mutex_looks_free(pthread_mutex_t *m) {
    /* glibc: __data.__lock is the first int; 0 = unlocked.  A hint only: trylock decides. */
    return __atomic_load_n((int *)m, __ATOMIC_RELAXED) == 0;
}

/* Returns OK (locked), EAGAIN (busy; nothing held), or ECORRUPT (not recoverable).
 * Spins briefly (bounded, no sleep) before giving up. */
static int shmkv_pool_trylock(shmkv_ctx_t *c) {
    int rc = pthread_mutex_trylock(&c->sh->pool_lock);
    for (int i = 0; rc == EBUSY && i < SHMKV_POOL_SPIN; i++) {
        SHMKV_PAUSE();
        if (shmkv__mutex_looks_free(&c->sh->pool_lock))
            rc = pthread_mutex_trylock(&c->sh->pool_lock);
    }
    if (rc == 0) return SHMKV_OK;
    if (rc == EBUSY) return SHMKV_EAGAIN;
    if (rc == EOWNERDEAD) return shmkv__owner_died(c);
    return SHMKV_ECORRUPT;
}

/* Blocks at most ctx->timeout_ns.  Call without the GIL. */
static int shmkv_pool_lock(shmkv_ctx_t *c) {
    int rc = pthread_mutex_trylock(&c->sh->pool_lock);
    for (int i = 0; rc == EBUSY && i < SHMKV_POOL_SPIN; i++) {
        SHMKV_PAUSE();
        if (shmkv__mutex_looks_free(&c->sh->pool_lock))
            rc = pthread_mutex_trylock(&c->sh->pool_lock);
    }
    if (rc == EBUSY) {
        shmkv_count(c, SHMKV_C_LOCK_WAITS, 1);
        int64_t dl = shmkv_now_ns(CLOCK_REALTIME) + c->timeout_ns;
        struct timespec ts = { (time_t)(dl / 1000000000LL), (long)(dl % 1000000000LL) };
        rc = pthread_mutex_timedlock(&c->sh->pool_lock, &ts);
    }
    if (rc == 0) return SHMKV_OK;
    if (rc == EOWNERDEAD) return shmkv__owner_died(c);
    if (rc == ETIMEDOUT) return SHMKV_ETIMEDOUT;
    return SHMKV_ECORRUPT;
}

static inline void shmkv_pool_unlock(shmkv_ctx_t *c) { pthread_mutex_unlock(&c->sh->pool_lock); }

/* ---- sequence ids and the sequence lock ------------------------------------------------- */
/* sid = gen * max_seqs + slot, gen >= 1: unique among live sequences, stale ids detected. */
static inline int shmkv_sid_slot(const shmkv_ctx_t *c, int64_t sid, uint32_t *slot) {
    if (sid < (int64_t)c->cfg.max_seqs) return SHMKV_ENOSEQ;
    uint64_t s = (uint64_t)sid;
    uint32_t sl = (uint32_t)(s % c->cfg.max_seqs);
    uint64_t gen = s / c->cfg.max_seqs;
    shmkv_seq_t *q = &c->seqs[sl];
    if (gen != shmkv_atomic_load_u32(&q->gen)) return SHMKV_ENOSEQ;
    if (shmkv_atomic_load_u32(&q->state) != SHMKV_SEQ_LIVE) return SHMKV_ENOSEQ;
    *slot = sl;
    return SHMKV_OK;
}
static inline int64_t shmkv_slot_sid(const shmkv_ctx_t *c, uint32_t slot) {
    return (int64_t)c->seqs[slot].gen * c->cfg.max_seqs + slot;
}

/* One attempt.  OK: we hold it; EAGAIN: busy; ENOSEQ: no such sequence. */
static int shmkv_seq_trylock(shmkv_ctx_t *c, int64_t sid, uint32_t *slot) {
    uint32_t sl;
    int st = shmkv_sid_slot(c, sid, &sl);
    if (st != SHMKV_OK) return st;
    if (!shmkv_atomic_cas_u64(&c->seqs[sl].writer, 0, c->proc_token)) return SHMKV_EAGAIN;
    /* the slot may have been freed and retaken between the check and the CAS */
    if (shmkv_sid_slot(c, sid, &sl) != SHMKV_OK) {
        shmkv_atomic_store_u64_release(&c->seqs[sl].writer, 0);
        return SHMKV_ENOSEQ;
    }
    *slot = sl;
    return SHMKV_OK;
}

static inline void shmkv_seq_unlock(shmkv_ctx_t *c, uint32_t slot) {
    shmkv_atomic_store_u64_release(&c->seqs[slot].writer, 0);
}

/* Waits at most ctx->timeout_ns; spins briefly, then sleeps with backoff.  Every
 * millisecond or so it asks whether the holder is alive; a dead holder's lock is taken
 * over after a recovery pass (which also reclaims what the holder had in flight).
 * Call without the GIL.  Returns OK, ENOSEQ, ETIMEDOUT or a recovery error. */
static int shmkv_seq_lock(shmkv_ctx_t *c, int64_t sid, uint32_t *slot) {
    int st = shmkv_seq_trylock(c, sid, slot);
    if (st != SHMKV_EAGAIN) return st;
    shmkv_count(c, SHMKV_C_LOCK_WAITS, 1);
    int64_t t0 = shmkv_now_ns(CLOCK_MONOTONIC), last_probe = t0;
    long sleep_ns = 1000;
    for (unsigned spin = 0;; spin++) {
        if (spin < 200) SHMKV_PAUSE();
        else if (spin < 400) sched_yield();
        else {
            struct timespec ts = { 0, sleep_ns };
            nanosleep(&ts, NULL);
            if (sleep_ns < 1000000) sleep_ns *= 2;
        }
        st = shmkv_seq_trylock(c, sid, slot);
        if (st != SHMKV_EAGAIN) return st;
        int64_t now = shmkv_now_ns(CLOCK_MONOTONIC);
        if (now - last_probe > 1000000) {
            last_probe = now;
            uint32_t sl;
            if (shmkv_sid_slot(c, sid, &sl) != SHMKV_OK) return SHMKV_ENOSEQ;
            uint64_t holder = shmkv_atomic_load_u64(&c->seqs[sl].writer);
            if (holder != 0 && !shmkv_proc_alive(c, holder)) {
                st = shmkv_pool_lock(c);
                if (st != SHMKV_OK) return st;
                shmkv_recovery_t r;
                st = shmkv_recover_locked(c, &r);    /* clears the lock, frees in-flight */
                shmkv_pool_unlock(c);
                if (st != SHMKV_OK) return st;
                /* no `continue`: the bound holds even if the holder's lock survived */
            }
        }
        if (shmkv_now_ns(CLOCK_MONOTONIC) - t0 > c->timeout_ns) return SHMKV_ETIMEDOUT;
    }
}

/* ---- blocks --------------------------------------------------------------------------- */
static inline int shmkv_block_ok(const shmkv_ctx_t *c, int64_t b) {
    return b >= 0 && b < (int64_t)c->cfg.num_blocks;
}
static inline int32_t *shmkv_table(const shmkv_ctx_t *c, uint32_t slot) {
    return c->tables + (size_t)slot * c->cfg.max_blocks_per_seq;
}
static inline uint32_t shmkv_blocks_for(const shmkv_ctx_t *c, uint64_t tokens) {
    return (uint32_t)((tokens + c->cfg.block_size - 1) / c->cfg.block_size);
}

static void shmkv_lru_unlink_locked(shmkv_ctx_t *c, uint32_t b) {
    shmkv_block_t *m = &c->blocks[b];
    uint32_t p = m->lru_prev, n = m->lru_next;
    if (p < c->cfg.num_blocks) c->blocks[p].lru_next = n; else c->sh->lru_head = n;
    if (n < c->cfg.num_blocks) c->blocks[n].lru_prev = p; else c->sh->lru_tail = p;
    m->lru_prev = m->lru_next = SHMKV_NIL;
    c->sh->cached_count--;
}
static void shmkv_lru_push_tail_locked(shmkv_ctx_t *c, uint32_t b) {
    shmkv_block_t *m = &c->blocks[b];
    m->lru_next = SHMKV_NIL;
    m->lru_prev = c->sh->lru_tail;
    if (c->sh->lru_tail < c->cfg.num_blocks) c->blocks[c->sh->lru_tail].lru_next = b;
    else c->sh->lru_head = b;
    c->sh->lru_tail = b;
    c->sh->cached_count++;
}

static void shmkv_index_remove_locked(shmkv_ctx_t *c, uint32_t b);

/* Free blocks and LIVE sequences, derived without a lock: what the shared stacks hold
 * plus what every attached process keeps in its cache.  Exact when nobody is changing
 * them (check(), recovery), a consistent-enough gauge otherwise.  Clamped. */
static void shmkv_counts(const shmkv_ctx_t *c, uint64_t *free_blocks, uint64_t *cached,
                         uint64_t *live_seqs) {
    const uint32_t NB = c->cfg.num_blocks, NS = c->cfg.max_seqs;
    uint64_t ft = shmkv_atomic_load_u32_relaxed(&c->sh->free_top);
    uint64_t cc = shmkv_atomic_load_u32_relaxed(&c->sh->cached_count);
    uint64_t sf = shmkv_atomic_load_u32_relaxed(&c->sh->seq_free_top);
    uint64_t pb = 0, ps = 0;
    uint32_t left = shmkv_atomic_load_u32_relaxed(&c->sh->num_procs);   /* stop early */
    for (uint32_t s = 0; s < c->cfg.max_procs && left > 0; s++) {
        const shmkv_proc_t *p = &c->procs[s];
        if (shmkv_atomic_load_u32_relaxed(&p->state) != SHMKV_PROC_ACTIVE) continue;
        left--;
        uint32_t nb = shmkv_atomic_load_u32_relaxed(&p->cache_nblocks);
        uint32_t ns = shmkv_atomic_load_u32_relaxed(&p->cache_nseqs);
        pb += nb <= SHMKV_PCACHE_BLOCKS ? nb : 0;
        ps += ns <= SHMKV_PCACHE_SEQS ? ns : 0;
    }
    uint64_t fb = ft + cc + pb, fs = sf + ps;
    if (cc > NB) cc = NB;
    *free_blocks = fb < NB ? fb : NB;
    if (cached) *cached = cc;
    if (live_seqs) *live_seqs = fs < NS ? NS - fs : 0;
}

/* The high-water mark of used blocks, sampled whenever the shared pool is touched (a
 * block a process takes from its own cache is not a sample point, so it may read low by
 * at most what the caches hold). */
static inline void shmkv__note_peak(shmkv_ctx_t *c) {
    uint64_t fb;
    shmkv_counts(c, &fb, NULL, NULL);
    uint32_t used = c->cfg.num_blocks - (uint32_t)fb;
    if (used > c->sh->peak_used) c->sh->peak_used = used;
}

/* A free block taken for new data, by whichever path took it: no hash, one reference. */
static inline void shmkv__block_claim(shmkv_ctx_t *c, uint32_t b) {
    shmkv_block_t *m = &c->blocks[b];
    m->flags = 0;
    m->num_tokens = 0;
    shmkv_atomic_store_u32(&m->ref_cnt, 1);
}

/* Takes n blocks (each leaves with ref_cnt 1), never-cached ones first, then the least
 * recently used cached ones (their hashes leave the index).  All-or-nothing: EFULL
 * before any change when fewer than n are free. */
static int shmkv_blocks_alloc_locked(shmkv_ctx_t *c, uint32_t n, uint32_t *out) {
    shmkv_shared_t *sh = c->sh;
    uint32_t ft = sh->free_top, cc = sh->cached_count;
    if (ft > c->cfg.num_blocks || cc > c->cfg.num_blocks) return SHMKV_ECORRUPT;
    if ((uint64_t)n > (uint64_t)ft + cc) return SHMKV_EFULL;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t b;
        if (sh->free_top > 0) {
            b = c->free_stack[sh->free_top - 1];
            if (!shmkv_block_ok(c, b) || c->blocks[b].ref_cnt != 0) return SHMKV_ECORRUPT;
            sh->free_top--;
        } else {
            b = sh->lru_head;
            if (!shmkv_block_ok(c, b) || c->blocks[b].ref_cnt != 0) return SHMKV_ECORRUPT;
            shmkv_lru_unlink_locked(c, b);
            shmkv_index_remove_locked(c, b);
            shmkv_count(c, SHMKV_C_CACHED_EVICTED, 1);
        }
        if (i == n / 2) SHMKV_CRASH(ALLOC_MID);
        shmkv__block_claim(c, b);
        out[i] = b;
    }
    shmkv_count_hot(c, SHMKV_PC_ALLOCATIONS, n);
    shmkv__note_peak(c);
    return SHMKV_OK;
}

/* Drops one reference.  At zero a hashed block stays findable (CACHED, LRU tail); any
 * other block goes back on the free stack.  Precondition: shmkv_block_ok(b). */
static void shmkv_block_decref_locked(shmkv_ctx_t *c, uint32_t b) {
    shmkv_block_t *m = &c->blocks[b];
    uint32_t prev = shmkv_atomic_sub_u32(&m->ref_cnt, 1);
    SHMKV_ASSERT(prev > 0);
    if (prev != 1) return;
    shmkv_count_hot(c, SHMKV_PC_FREES, 1);
    if (m->flags & SHMKV_BLOCK_HASHED) {
        m->last_access = ++c->sh->lru_clock;
        shmkv_lru_push_tail_locked(c, b);
    } else {
        c->free_stack[c->sh->free_top++] = b;
    }
}

/* ---- the hash index (block hash -> block id), open addressing ------------------------- */
static inline int shmkv__hash_empty(const uint64_t *h) { return h[0] == 0 && h[1] == 0; }
static inline int shmkv__hash_tomb(const uint64_t *h) { return h[0] == 0 && h[1] == 1; }

/* Finds the block holding hash h (NIL if none).  Probing is bounded. */
static uint32_t shmkv_index_find_locked(shmkv_ctx_t *c, const uint64_t *h) {
    uint64_t mask = c->lay.index_capacity - 1;
    uint64_t i = h[0] & mask;
    for (uint32_t k = 0; k < SHMKV_INDEX_MAX_PROBE; k++, i = (i + 1) & mask) {
        shmkv_index_t *e = &c->index[i];
        if (shmkv__hash_empty(e->hash)) return SHMKV_NIL;
        if (e->hash[0] == h[0] && e->hash[1] == h[1]) {
            uint32_t b = e->block;
            if (!shmkv_block_ok(c, b)) return SHMKV_NIL;
            shmkv_block_t *m = &c->blocks[b];
            if (!(m->flags & SHMKV_BLOCK_HASHED) || m->hash[0] != h[0] || m->hash[1] != h[1])
                return SHMKV_NIL;
            return b;
        }
    }
    return SHMKV_NIL;
}

/* Inserts hash -> b.  Returns 1 if inserted, 0 if the hash is present already or the
 * probe bound was hit (the block then simply stays unhashed). */
static int shmkv_index_insert_locked(shmkv_ctx_t *c, const uint64_t *h, uint32_t b) {
    if (shmkv__hash_empty(h) || shmkv__hash_tomb(h)) return 0;   /* reserved keys */
    uint64_t mask = c->lay.index_capacity - 1;
    uint64_t i = h[0] & mask, slot = UINT64_MAX;
    for (uint32_t k = 0; k < SHMKV_INDEX_MAX_PROBE; k++, i = (i + 1) & mask) {
        shmkv_index_t *e = &c->index[i];
        if (shmkv__hash_empty(e->hash)) { if (slot == UINT64_MAX) slot = i; break; }
        if (shmkv__hash_tomb(e->hash)) { if (slot == UINT64_MAX) slot = i; continue; }
        if (e->hash[0] == h[0] && e->hash[1] == h[1]) return 0;
    }
    if (slot == UINT64_MAX) return 0;
    shmkv_index_t *e = &c->index[slot];
    if (shmkv__hash_tomb(e->hash)) c->sh->index_tombs--;
    e->block = b;
    e->hash[1] = h[1];
    e->hash[0] = h[0];
    c->sh->index_used++;
    shmkv_block_t *m = &c->blocks[b];
    m->hash[0] = h[0];
    m->hash[1] = h[1];
    m->flags |= SHMKV_BLOCK_HASHED;
    return 1;
}

static void shmkv_index_remove_locked(shmkv_ctx_t *c, uint32_t b) {
    shmkv_block_t *m = &c->blocks[b];
    if (!(m->flags & SHMKV_BLOCK_HASHED)) return;
    uint64_t mask = c->lay.index_capacity - 1;
    uint64_t i = m->hash[0] & mask;
    for (uint32_t k = 0; k < SHMKV_INDEX_MAX_PROBE; k++, i = (i + 1) & mask) {
        shmkv_index_t *e = &c->index[i];
        if (shmkv__hash_empty(e->hash)) break;
        if (e->block == b && e->hash[0] == m->hash[0] && e->hash[1] == m->hash[1]) {
            e->hash[0] = 0;
            e->hash[1] = 1;      /* tombstone */
            e->block = SHMKV_NIL;
            c->sh->index_used--;
            c->sh->index_tombs++;
            break;
        }
    }
    m->flags &= ~(uint32_t)SHMKV_BLOCK_HASHED;
}

/* ---- sequences ------------------------------------------------------------------------ */
/* Makes FREE slot `slot`, which the caller has taken off every free list, a LIVE empty
 * sequence owned by us; returns its id. */
static int64_t shmkv__seq_init(shmkv_ctx_t *c, uint32_t slot, uint32_t priority) {
    shmkv_seq_t *q = &c->seqs[slot];
    uint32_t gen = q->gen + 1;
    if (gen == 0 || (uint64_t)gen * c->cfg.max_seqs + slot > (uint64_t)INT64_MAX) gen = 1;
    shmkv_atomic_store_u32(&q->gen, gen);
    q->owner = c->proc_token;
    shmkv_atomic_store_u64(&q->writer, 0);
    q->len = 0;
    q->nblocks = 0;
    q->hashed = 0;
    q->priority = priority;
    q->created_ns = (uint64_t)shmkv_now_ns(CLOCK_REALTIME);
    q->last_access_ns = (uint64_t)shmkv_now_ns(CLOCK_REALTIME_COARSE);
    q->access_count = 0;
    q->flags = 0;
    q->hash_ready = 0;
    q->salt[0] = q->salt[1] = 0;
    q->trimmed = 0;
    q->trim_s = q->trim_d = q->trim_k = q->trim_chunk = q->trim_len = q->trim_trimmed = 0;
    shmkv_atomic_store_u32(&q->state, SHMKV_SEQ_LIVE);    /* publish */
    SHMKV_CRASH(CREATE_MID);
    shmkv_count_hot(c, SHMKV_PC_SEQS_CREATED, 1);
    return shmkv_slot_sid(c, slot);
}

/* Takes a slot off the shared free stack and makes it a LIVE empty sequence owned by us. */
static int shmkv_seq_create_locked(shmkv_ctx_t *c, uint32_t priority, int64_t *sid_out) {
    shmkv_shared_t *sh = c->sh;
    if (sh->seq_free_top > c->cfg.max_seqs) return SHMKV_ECORRUPT;
    if (sh->seq_free_top == 0) return SHMKV_ESEQFULL;
    uint32_t slot = c->seq_free[sh->seq_free_top - 1];
    if (slot >= c->cfg.max_seqs || c->seqs[slot].state != SHMKV_SEQ_FREE) return SHMKV_ECORRUPT;
    sh->seq_free_top--;
    *sid_out = shmkv__seq_init(c, slot, priority);
    return SHMKV_OK;
}

/* Validates a LIVE sequence's table against the config: nblocks fits, every entry a
 * valid block, len fits its blocks. */
static int shmkv_seq_valid(const shmkv_ctx_t *c, uint32_t slot) {
    const shmkv_seq_t *q = &c->seqs[slot];
    uint32_t nb = q->nblocks, len = shmkv_atomic_load_u32_relaxed(&q->len);
    if (nb > c->cfg.max_blocks_per_seq) return SHMKV_ECORRUPT;
    if ((uint64_t)len > (uint64_t)nb * c->cfg.block_size) return SHMKV_ECORRUPT;
    const int32_t *t = shmkv_table(c, slot);
    for (uint32_t i = 0; i < nb; i++) if (!shmkv_block_ok(c, t[i])) return SHMKV_ECORRUPT;
    return SHMKV_OK;
}

/* Frees a sequence.  Caller holds the pool lock AND the sequence lock; the kernel
 * releases the sequence lock itself (the slot may be retaken the moment it is free).
 * The state store comes first: a death after it leaves a FREE slot whose blocks
 * recovery recounts from the remaining tables. */
static int shmkv_seq_free_locked(shmkv_ctx_t *c, uint32_t slot) {
    shmkv_seq_t *q = &c->seqs[slot];
    int st = shmkv_seq_valid(c, slot);
    if (st != SHMKV_OK) return st;
    uint32_t nb = q->nblocks;
    const int32_t *t = shmkv_table(c, slot);
    shmkv_atomic_store_u32(&q->state, SHMKV_SEQ_FREE);
    if (__builtin_expect(shmkv_plant == SHMKV_PLANT_LEAK_ON_FREE, 0) && nb > 0) nb--;
    /* Tail first, as vLLM does: the chain's last block becomes the least recently used,
     * so eviction of cached blocks eats a chain from its end and the head (the part
     * other prompts share) stays findable. */
    for (uint32_t i = nb; i-- > 0;) {
        if (i == nb / 2) SHMKV_CRASH(FREE_MID);
        shmkv_block_decref_locked(c, (uint32_t)t[i]);
    }
    q->nblocks = 0;
    shmkv_atomic_store_u32_release(&q->len, 0);
    q->hashed = 0;
    q->owner = 0;
    c->seq_free[c->sh->seq_free_top++] = slot;
    shmkv_atomic_store_u64_release(&q->writer, 0);
    shmkv_count_hot(c, SHMKV_PC_SEQS_FREED, 1);
    return SHMKV_OK;
}

/* A child shares every block that holds the parent's published tokens (ref_cnt++).
 * Caller holds the pool lock and the parent's sequence lock (the parent's free may run
 * on its owner's fast path, which takes no pool lock). */
static int shmkv_seq_fork_locked(shmkv_ctx_t *c, int64_t parent, int64_t *child_out) {
    uint32_t ps;
    int st = shmkv_sid_slot(c, parent, &ps);
    if (st != SHMKV_OK) return st;
    if ((st = shmkv_seq_valid(c, ps)) != SHMKV_OK) return st;
    shmkv_seq_t *p = &c->seqs[ps];
    uint32_t len = shmkv_atomic_load_u32_acquire(&p->len);
    uint32_t nb = shmkv_blocks_for(c, len);
    if (nb > p->nblocks) return SHMKV_ECORRUPT;
    int64_t csid;
    if ((st = shmkv_seq_create_locked(c, p->priority, &csid)) != SHMKV_OK) return st;
    uint32_t cs = (uint32_t)(csid % c->cfg.max_seqs);
    shmkv_seq_t *q = &c->seqs[cs];
    const int32_t *pt = shmkv_table(c, ps);
    int32_t *ct = shmkv_table(c, cs);
    for (uint32_t i = 0; i < nb; i++) {
        if (i == nb / 2) SHMKV_CRASH(FORK_MID);
        ct[i] = pt[i];
        shmkv_atomic_add_u32(&c->blocks[pt[i]].ref_cnt, 1);
    }
    q->nblocks = nb;
    uint32_t full = len / c->cfg.block_size;
    uint32_t ready = shmkv_atomic_load_u32(&p->hash_ready);
    q->hashed = p->hashed < full ? p->hashed : full;
    q->hash_ready = q->hashed;
    q->flags = p->flags;
    /* Blocks the parent hashed but has not published (reserve without commit: their
     * data may be unwritten) must never be published through the child: the child
     * stops hashing instead.  Conservative, and only for forks taken mid-flow. */
    if ((ready < full ? ready : full) > q->hashed) q->flags |= SHMKV_SEQF_UNTRACKED;
    q->salt[0] = p->salt[0];
    q->salt[1] = p->salt[1];
    q->trimmed = p->trimmed;
    shmkv_atomic_store_u32_release(&q->len, len);
    shmkv_count(c, SHMKV_C_FORKS, 1);
    *child_out = csid;
    return SHMKV_OK;
}

/* ---- growing a sequence ------------------------------------------------------------------ */
/* What a writer must do before it can place n more tokens after position `len`. */
typedef struct {
    uint32_t len;          /* published length when planned */
    uint32_t new_blocks;   /* blocks to append to the table */
    int cow;               /* the partial last block is shared: copy it first */
    uint32_t cow_index;    /* table index of that block */
} shmkv_grow_plan_t;

/* Caller holds the sequence lock.  No pool lock needed: ref_cnt of our partial last
 * block can only rise (a fork) after we read it, and a fork shares only what is
 * already published, never the positions we are about to write. */
static int shmkv_seq_plan(shmkv_ctx_t *c, uint32_t slot, uint64_t n, shmkv_grow_plan_t *pl) {
    shmkv_seq_t *q = &c->seqs[slot];
    uint32_t nb = q->nblocks;
    uint32_t len = q->len;
    if (nb > c->cfg.max_blocks_per_seq || (uint64_t)len > (uint64_t)nb * c->cfg.block_size)
        return SHMKV_ECORRUPT;
    uint64_t need = ((uint64_t)len + n + c->cfg.block_size - 1) / c->cfg.block_size;
    if (need > c->cfg.max_blocks_per_seq) return SHMKV_ETOOLONG;
    pl->len = len;
    pl->new_blocks = need > nb ? (uint32_t)(need - nb) : 0;
    pl->cow = 0;
    pl->cow_index = 0;
    if (len % c->cfg.block_size != 0) {
        uint32_t bi = len / c->cfg.block_size;
        int32_t b = shmkv_table(c, slot)[bi];
        if (!shmkv_block_ok(c, b)) return SHMKV_ECORRUPT;
        if (shmkv_atomic_load_u32(&c->blocks[b].ref_cnt) > 1
                && __builtin_expect(shmkv_plant != SHMKV_PLANT_NO_COW, 1)) {
            pl->cow = 1;
            pl->cow_index = bi;
        }
    }
    return SHMKV_OK;
}

/* Allocates what the plan needs: new tail blocks go straight into the table (beyond the
 * published length nobody reads them, and a death leaves them owned by the sequence);
 * a copy-on-write target is recorded in our process's in-flight list.  All-or-nothing. */
static int shmkv_seq_grow_locked(shmkv_ctx_t *c, uint32_t slot, shmkv_grow_plan_t *pl,
                                 uint32_t *cow_target) {
    shmkv_seq_t *q = &c->seqs[slot];
    uint32_t total = pl->new_blocks + (pl->cow ? 1u : 0u);
    uint32_t fl = SHMKV_NIL;
    if (pl->cow) {
        if (c->proc_slot >= c->cfg.max_procs) return SHMKV_EINVAL;
        shmkv_proc_t *p = &c->procs[c->proc_slot];
        for (uint32_t i = 0; i < SHMKV_INFLIGHT_PER_PROC; i++)
            if (p->inflight[i] == SHMKV_NIL) { fl = i; break; }
        if (fl == SHMKV_NIL) return SHMKV_EAGAIN;    /* all in-flight records busy */
    }
    uint32_t got[64];
    uint32_t *buf = total <= 64 ? got : (uint32_t *)malloc(sizeof(uint32_t) * total);
    if (buf == NULL) return SHMKV_ESYS;
    int st = shmkv_blocks_alloc_locked(c, total, buf);
    if (st == SHMKV_OK) {
        int32_t *t = shmkv_table(c, slot);
        uint32_t nb = q->nblocks;
        for (uint32_t i = 0; i < pl->new_blocks; i++) t[nb + i] = (int32_t)buf[i];
        SHMKV_CRASH(GROW_BEFORE_TAIL);
        shmkv_atomic_store_u32(&q->nblocks, nb + pl->new_blocks);   /* publish the tail */
        SHMKV_CRASH(GROW_AFTER_TAIL);
        if (pl->cow) {
            *cow_target = buf[pl->new_blocks];
            c->procs[c->proc_slot].inflight[fl] = buf[pl->new_blocks];
        }
    }
    if (buf != got) free(buf);
    return st;
}

/* Copies the first `tokens` tokens of every layer's K and V from block src to dst.
 * No lock: src is held by our table (we hold the sequence lock), dst by our in-flight
 * record. */
static void shmkv_block_copy(shmkv_ctx_t *c, uint32_t src, uint32_t dst, uint32_t tokens) {
    uint64_t nbytes = (uint64_t)tokens * c->lay.token_bytes;
    memcpy(c->tokens + (uint64_t)dst * c->cfg.block_size,
           c->tokens + (uint64_t)src * c->cfg.block_size, (uint64_t)tokens * 4u);
    for (uint32_t l = 0; l < c->cfg.num_layers; l++) {
        uint64_t lo = (uint64_t)l * c->lay.layer_stride;
        memcpy(c->kpool + lo + (uint64_t)dst * c->lay.block_bytes,
               c->kpool + lo + (uint64_t)src * c->lay.block_bytes, nbytes);
        memcpy(c->vpool + lo + (uint64_t)dst * c->lay.block_bytes,
               c->vpool + lo + (uint64_t)src * c->lay.block_bytes, nbytes);
    }
}

/* Puts the filled copy-on-write target in place of the shared block: one table store
 * publishes it, then the in-flight record and the old reference are dropped. */
static int shmkv_seq_cow_commit_locked(shmkv_ctx_t *c, uint32_t slot, uint32_t index,
                                       uint32_t target) {
    int32_t *t = shmkv_table(c, slot);
    int32_t old = t[index];
    if (!shmkv_block_ok(c, old) || !shmkv_block_ok(c, target)) return SHMKV_ECORRUPT;
    __atomic_store_n(&t[index], (int32_t)target, __ATOMIC_SEQ_CST);
    SHMKV_CRASH(COW_COMMIT_MID);
    shmkv_proc_t *p = &c->procs[c->proc_slot];
    for (uint32_t i = 0; i < SHMKV_INFLIGHT_PER_PROC; i++)
        if (p->inflight[i] == target) { p->inflight[i] = SHMKV_NIL; break; }
    shmkv_block_decref_locked(c, (uint32_t)old);
    shmkv_count(c, SHMKV_C_COW_COPIES, 1);
    return SHMKV_OK;
}

/* Gives back a copy-on-write target that was never committed (the copy was abandoned). */
static void shmkv_inflight_release_locked(shmkv_ctx_t *c, uint32_t target) {
    shmkv_proc_t *p = &c->procs[c->proc_slot];
    for (uint32_t i = 0; i < SHMKV_INFLIGHT_PER_PROC; i++)
        if (p->inflight[i] == target) {
            p->inflight[i] = SHMKV_NIL;
            shmkv_block_decref_locked(c, target);
            break;
        }
}

/* ---- the per-process cache: a sequence's life without the pool lock ------------------ */
/* A process keeps a few free blocks and free sequence slots in its own process slot
 * (shmkv_proc_t.cache_*), so creating a sequence, growing it by a block and freeing it
 * touch only lines this process owns.  The shared stacks are visited in batches on the
 * slow paths, which bring the cache back to half full.  Recovery and check() take every
 * cache_lock (after the pool lock), so they see the caches and the tables at rest. */

static inline shmkv_proc_t *shmkv_me(const shmkv_ctx_t *c) {
    return c->proc_slot < c->cfg.max_procs ? &c->procs[c->proc_slot] : NULL;
}
static inline int shmkv_pcache_trylock(shmkv_ctx_t *c, shmkv_proc_t *p) {
    return shmkv_atomic_cas_u64(&p->cache_lock, 0, c->proc_token ? c->proc_token : 1);
}
static inline void shmkv_pcache_unlock(shmkv_proc_t *p) {
    shmkv_atomic_store_u64_release(&p->cache_lock, 0);
}

/* With the pool lock held: takes process slot p's cache_lock.  Only two kinds of
 * holder exist: p itself on a fast path (it never waits while holding it, so spin,
 * bounded by ctx->timeout_ns) and a pool_lock holder -- which, since we hold the pool
 * lock now, can only be one that died holding it (a dead recoverer), or p itself dead.
 * Such a lock is taken over and EDEADHOLDER returned (holding it): what the holder left
 * may be half-done, so a recovery pass must run before the cache is used -- see
 * shmkv_pcache_lock_recover_locked. */
static int shmkv_pcache_lock_locked(shmkv_ctx_t *c, shmkv_proc_t *p) {
    if (shmkv_pcache_trylock(c, p)) return SHMKV_OK;
    uint64_t me = c->proc_token ? c->proc_token : 1;
    uint32_t slot = (uint32_t)(p - c->procs);
    uint64_t owner = ((uint64_t)shmkv_atomic_load_u32(&p->gen) << 32) | (uint64_t)(slot + 1);
    int64_t t0 = shmkv_now_ns(CLOCK_MONOTONIC);
    for (unsigned spin = 1;; spin++) {
        uint64_t holder = shmkv_atomic_load_u64(&p->cache_lock);
        if (holder == 0) {
            if (shmkv_pcache_trylock(c, p)) return SHMKV_OK;
            continue;
        }
        /* not the owner (nor the owner's own thread when p is ours): a dead pool-lock
         * holder's leftover.  The owner: dead, or alive and about to let go. */
        int stale = (holder != owner) || ((spin & 255) == 0 && holder != me
                                          && !shmkv_proc_alive(c, holder));
        if (stale && shmkv_atomic_cas_u64(&p->cache_lock, holder, me))
            return SHMKV_EDEADHOLDER;
        if (spin < 256) SHMKV_PAUSE(); else sched_yield();
        if ((spin & 255) == 0 && shmkv_now_ns(CLOCK_MONOTONIC) - t0 > c->timeout_ns)
            return SHMKV_ETIMEDOUT;
    }
}

static int shmkv_recover_locked(shmkv_ctx_t *c, shmkv_recovery_t *r);

/* shmkv_pcache_lock_locked, and after a takeover from a dead holder a recovery pass
 * (which finishes or undoes what the holder left half-done) before the lock is taken
 * again.  OK or an error; never EDEADHOLDER. */
static int shmkv_pcache_lock_recover_locked(shmkv_ctx_t *c, shmkv_proc_t *p) {
    for (int tries = 0;; tries++) {
        int st = shmkv_pcache_lock_locked(c, p);
        if (st != SHMKV_EDEADHOLDER) return st;
        shmkv_pcache_unlock(p);
        if (tries == 3) return SHMKV_ETIMEDOUT;
        shmkv_recovery_t r;
        if ((st = shmkv_recover_locked(c, &r)) != SHMKV_OK) return st;
    }
}

/* Is cache entry b a block that may sit in a cache (free, unhashed)? */
static inline int shmkv__cacheable(const shmkv_ctx_t *c, uint32_t b) {
    return b < c->cfg.num_blocks && shmkv_atomic_load_u32(&c->blocks[b].ref_cnt) == 0
        && !(c->blocks[b].flags & SHMKV_BLOCK_HASHED);
}

/* create_sequence() from our cache.  OK, EAGAIN (cache busy or empty: take the slow
 * path) or ECORRUPT. */
static int shmkv_pcache_create(shmkv_ctx_t *c, uint32_t priority, int64_t *sid_out) {
    shmkv_proc_t *p = shmkv_me(c);
    if (p == NULL || !shmkv_pcache_trylock(c, p)) return SHMKV_EAGAIN;
    int st = SHMKV_EAGAIN;
    uint32_t n = p->cache_nseqs;
    if (n > SHMKV_PCACHE_SEQS) st = SHMKV_ECORRUPT;
    else if (n > 0) {
        uint32_t slot = p->cache_seqs[n - 1];
        if (slot >= c->cfg.max_seqs || shmkv_atomic_load_u32(&c->seqs[slot].state) != SHMKV_SEQ_FREE)
            st = SHMKV_ECORRUPT;
        else {
            p->cache_nseqs = n - 1;
            *sid_out = shmkv__seq_init(c, slot, priority);
            st = SHMKV_OK;
        }
    }
    shmkv_pcache_unlock(p);
    return st;
}

/* The new tail blocks of a grow plan (no copy-on-write) from our cache, straight into
 * the table beyond the published length, as shmkv_seq_grow_locked does.  Caller holds
 * the sequence lock.  OK, EAGAIN (too few cached, or busy: slow path) or ECORRUPT. */
static int shmkv_pcache_grow(shmkv_ctx_t *c, uint32_t slot, const shmkv_grow_plan_t *pl) {
    shmkv_proc_t *p = shmkv_me(c);
    uint32_t n = pl->new_blocks;
    if (p == NULL || pl->cow || n == 0) return SHMKV_EAGAIN;
    if (!shmkv_pcache_trylock(c, p)) return SHMKV_EAGAIN;
    int st = SHMKV_OK;
    uint32_t have = p->cache_nblocks;
    shmkv_seq_t *q = &c->seqs[slot];
    uint32_t nb = q->nblocks;
    if (have > SHMKV_PCACHE_BLOCKS || nb > c->cfg.max_blocks_per_seq
            || n > c->cfg.max_blocks_per_seq - nb) st = SHMKV_ECORRUPT;
    else if (n > have) st = SHMKV_EAGAIN;
    else {
        /* all-or-nothing: every entry checked (and for repeats) before anything moves */
        for (uint32_t i = 0; i < n && st == SHMKV_OK; i++) {
            uint32_t b = p->cache_blocks[have - 1 - i];
            if (!shmkv__cacheable(c, b)) st = SHMKV_ECORRUPT;
            for (uint32_t j = 0; j < i && st == SHMKV_OK; j++)
                if (p->cache_blocks[have - 1 - j] == b) st = SHMKV_ECORRUPT;
        }
    }
    if (st == SHMKV_OK) {
        int32_t *t = shmkv_table(c, slot);
        for (uint32_t i = 0; i < n; i++) {
            uint32_t b = p->cache_blocks[have - 1 - i];
            shmkv__block_claim(c, b);
            t[nb + i] = (int32_t)b;
        }
        p->cache_nblocks = have - n;
        SHMKV_CRASH(GROW_BEFORE_TAIL);
        shmkv_atomic_store_u32(&q->nblocks, nb + n);    /* publish the tail */
        SHMKV_CRASH(GROW_AFTER_TAIL);
        shmkv_count_hot(c, SHMKV_PC_ALLOCATIONS, n);
    }
    shmkv_pcache_unlock(p);
    return st;
}

/* free() into our cache, when every block of the sequence is exclusive (ref_cnt 1) and
 * unhashed and the cache has room: then nobody else can reach those blocks (a fork takes
 * the sequence lock we hold; a prefix hit needs a hash), so each falls to 0 with no
 * pool lock.  Caller holds the sequence lock; on OK the kernel releases it.  OK, EAGAIN
 * (slow path: shared or hashed blocks, cache full or busy) or ECORRUPT. */
static int shmkv_pcache_free(shmkv_ctx_t *c, uint32_t slot) {
    shmkv_proc_t *p = shmkv_me(c);
    if (p == NULL) return SHMKV_EAGAIN;
    shmkv_seq_t *q = &c->seqs[slot];
    int st = shmkv_seq_valid(c, slot);
    if (st != SHMKV_OK) return st;
    uint32_t nb = q->nblocks;
    if (nb > SHMKV_PCACHE_BLOCKS) return SHMKV_EAGAIN;
    if (!shmkv_pcache_trylock(c, p)) return SHMKV_EAGAIN;
    const int32_t *t = shmkv_table(c, slot);
    uint32_t have = p->cache_nblocks, ns = p->cache_nseqs;
    if (have > SHMKV_PCACHE_BLOCKS || ns > SHMKV_PCACHE_SEQS) st = SHMKV_ECORRUPT;
    else if (ns == SHMKV_PCACHE_SEQS || nb > SHMKV_PCACHE_BLOCKS - have) st = SHMKV_EAGAIN;
    for (uint32_t i = 0; i < nb && st == SHMKV_OK; i++) {
        shmkv_block_t *m = &c->blocks[t[i]];
        if (shmkv_atomic_load_u32(&m->ref_cnt) != 1 || (m->flags & SHMKV_BLOCK_HASHED))
            st = SHMKV_EAGAIN;
        for (uint32_t j = 0; j < i && st == SHMKV_OK; j++)
            if (t[j] == t[i]) st = SHMKV_ECORRUPT;    /* ref_cnt 1 but listed twice */
    }
    if (st != SHMKV_OK) { shmkv_pcache_unlock(p); return st; }
    if (__builtin_expect(shmkv_plant == SHMKV_PLANT_LEAK_ON_FREE, 0) && nb > 0) nb--;
    for (uint32_t i = nb; i-- > 0;) {               /* tail first, as the slow path */
        if (i == nb / 2) SHMKV_CRASH(FREE_MID);
        uint32_t b = (uint32_t)t[i];
        shmkv_atomic_store_u32(&c->blocks[b].ref_cnt, 0);
        p->cache_blocks[have++] = b;
        p->cache_nblocks = have;
    }
    shmkv_count_hot(c, SHMKV_PC_FREES, nb);
    shmkv_atomic_store_u32(&q->state, SHMKV_SEQ_FREE);
    q->nblocks = 0;
    shmkv_atomic_store_u32_release(&q->len, 0);
    q->hashed = 0;
    q->owner = 0;
    p->cache_seqs[ns] = slot;
    p->cache_nseqs = ns + 1;
    shmkv_atomic_store_u64_release(&q->writer, 0);
    shmkv_count_hot(c, SHMKV_PC_SEQS_FREED, 1);
    shmkv_pcache_unlock(p);
    return SHMKV_OK;
}

/* Moves cache entries of process p back to the shared stacks until at most keep_b
 * blocks and keep_s slots are left.  Caller holds the pool lock and p's cache_lock.
 * An entry that is not what a cache may hold is dropped (recovery recounts it). */
static void shmkv__pcache_spill_locked(shmkv_ctx_t *c, shmkv_proc_t *p, uint32_t keep_b,
                                       uint32_t keep_s) {
    uint32_t n = p->cache_nblocks;
    if (n > SHMKV_PCACHE_BLOCKS) n = 0;
    while (n > keep_b) {
        uint32_t b = p->cache_blocks[--n];
        if (shmkv__cacheable(c, b) && c->sh->free_top < c->cfg.num_blocks)
            c->free_stack[c->sh->free_top++] = b;
    }
    p->cache_nblocks = n;
    n = p->cache_nseqs;
    if (n > SHMKV_PCACHE_SEQS) n = 0;
    while (n > keep_s) {
        uint32_t s = p->cache_seqs[--n];
        if (s < c->cfg.max_seqs && c->seqs[s].state == SHMKV_SEQ_FREE
                && c->sh->seq_free_top < c->cfg.max_seqs)
            c->seq_free[c->sh->seq_free_top++] = s;
    }
    p->cache_nseqs = n;
}

/* Our cache back to half full (pool lock held): refilled from, or spilled to, the
 * shared stacks.  Refills take never-cached free blocks only (never the LRU list). */
static int shmkv_pcache_balance_locked(shmkv_ctx_t *c) {
    shmkv_proc_t *p = shmkv_me(c);
    if (p == NULL) return SHMKV_OK;
    int st = shmkv_pcache_lock_recover_locked(c, p);
    if (st != SHMKV_OK) return st;
    const uint32_t HB = SHMKV_PCACHE_BLOCKS / 2, HS = SHMKV_PCACHE_SEQS / 2;
    shmkv__pcache_spill_locked(c, p, HB, HS);
    shmkv_shared_t *sh = c->sh;
    if (sh->free_top > c->cfg.num_blocks || sh->seq_free_top > c->cfg.max_seqs)
        st = SHMKV_ECORRUPT;
    while (st == SHMKV_OK && p->cache_nblocks < HB && sh->free_top > 0) {
        uint32_t b = c->free_stack[sh->free_top - 1];
        if (!shmkv__cacheable(c, b)) { st = SHMKV_ECORRUPT; break; }
        sh->free_top--;
        p->cache_blocks[p->cache_nblocks++] = b;
    }
    while (st == SHMKV_OK && p->cache_nseqs < HS && sh->seq_free_top > 0) {
        uint32_t s = c->seq_free[sh->seq_free_top - 1];
        if (s >= c->cfg.max_seqs || c->seqs[s].state != SHMKV_SEQ_FREE) { st = SHMKV_ECORRUPT; break; }
        sh->seq_free_top--;
        p->cache_seqs[p->cache_nseqs++] = s;
    }
    shmkv_pcache_unlock(p);
    return st;
}

/* Every attached process's cache back to the shared stacks (pool lock held): before
 * CacheFullError, blocks or slots another process keeps for itself are not "full". */
static int shmkv_pcache_drain_all_locked(shmkv_ctx_t *c) {
    for (uint32_t s = 0; s < c->cfg.max_procs; s++) {
        shmkv_proc_t *p = &c->procs[s];
        if (shmkv_atomic_load_u32(&p->state) != SHMKV_PROC_ACTIVE) continue;
        if (shmkv_atomic_load_u32_relaxed(&p->cache_nblocks) == 0
                && shmkv_atomic_load_u32_relaxed(&p->cache_nseqs) == 0) continue;
        int st = shmkv_pcache_lock_recover_locked(c, p);
        if (st != SHMKV_OK) return st;
        if (p->state == SHMKV_PROC_ACTIVE) shmkv__pcache_spill_locked(c, p, 0, 0);
        shmkv_pcache_unlock(p);
    }
    return SHMKV_OK;
}

/* Takes every ACTIVE process's cache_lock (pool lock held), so no fast path runs while
 * the caller reads or rebuilds.  All or none: an error leaves none taken.  OK, or
 * EDEADHOLDER (all taken, some from a dead holder: a reader must run recovery first). */
static int shmkv_quiesce_locked(shmkv_ctx_t *c) {
    int dead = 0;
    for (uint32_t s = 0; s < c->cfg.max_procs; s++) {
        shmkv_proc_t *p = &c->procs[s];
        if (p->state != SHMKV_PROC_ACTIVE) continue;
        int st = shmkv_pcache_lock_locked(c, p);
        if (st == SHMKV_EDEADHOLDER) { dead = 1; st = SHMKV_OK; }
        if (st != SHMKV_OK) {
            while (s-- > 0)
                if (c->procs[s].state == SHMKV_PROC_ACTIVE) shmkv_pcache_unlock(&c->procs[s]);
            return st;
        }
    }
    return dead ? SHMKV_EDEADHOLDER : SHMKV_OK;
}
static void shmkv_unquiesce_locked(shmkv_ctx_t *c) {
    uint64_t me = c->proc_token ? c->proc_token : 1;
    for (uint32_t s = 0; s < c->cfg.max_procs; s++)
        if (shmkv_atomic_load_u64(&c->procs[s].cache_lock) == me)
            shmkv_pcache_unlock(&c->procs[s]);
}

/* ---- byte copies between a sequence and dense [layers][n][heads*dim] buffers ------------ */
/* Caller holds the sequence lock; positions [pos, pos+n) lie inside the table.  Every
 * table entry used is validated before the first byte moves. */
static int shmkv_seq_check_span(const shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n) {
    if (n == 0) return SHMKV_OK;
    const shmkv_seq_t *q = &c->seqs[slot];
    uint32_t nb = q->nblocks;
    if (nb > c->cfg.max_blocks_per_seq) return SHMKV_ECORRUPT;
    uint64_t last = (pos + n - 1) / c->cfg.block_size;
    if (last >= nb) return SHMKV_ECORRUPT;
    const int32_t *t = shmkv_table(c, slot);
    for (uint64_t i = pos / c->cfg.block_size; i <= last; i++)
        if (!shmkv_block_ok(c, t[i])) return SHMKV_ECORRUPT;
    return SHMKV_OK;
}

/* Big copies (a prefill, a long gather: at least SHMKV_NT_MIN bytes per K or V array)
 * use streaming (non-temporal) stores.  Their data does not fit in the caches anyway,
 * and a normal store first reads every destination line in (read-for-ownership): a
 * third of the memory traffic.  Streaming stores skip that read, and with it the
 * 4K-aliasing stalls of a destination a few bytes past the source's page offset (numpy's
 * own arrays sit 16 bytes past a page, the pool's blocks on one): gather of 1k Llama
 * tokens into numpy arrays went from ~22 ms to ~9 ms, a 512-token prefill from ~7 to
 * ~3.5 ms.  They are weakly ordered: an sfence follows, before anything is published. */
#define SHMKV_NT_MIN (8ull << 20)
#if defined(__SSE2__)
#include <emmintrin.h>
#define SHMKV_HAVE_NT 1
static void shmkv__copy_nt(uint8_t *dst, const uint8_t *src, uint64_t n) {
    uint64_t head = (16u - ((uintptr_t)dst & 15u)) & 15u;   /* streaming stores: aligned */
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    while (n >= 128) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)src);
        __m128i x1 = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i x3 = _mm_loadu_si128((const __m128i *)(src + 48));
        __m128i x4 = _mm_loadu_si128((const __m128i *)(src + 64));
        __m128i x5 = _mm_loadu_si128((const __m128i *)(src + 80));
        __m128i x6 = _mm_loadu_si128((const __m128i *)(src + 96));
        __m128i x7 = _mm_loadu_si128((const __m128i *)(src + 112));
        _mm_stream_si128((__m128i *)dst, x0);
        _mm_stream_si128((__m128i *)(dst + 16), x1);
        _mm_stream_si128((__m128i *)(dst + 32), x2);
        _mm_stream_si128((__m128i *)(dst + 48), x3);
        _mm_stream_si128((__m128i *)(dst + 64), x4);
        _mm_stream_si128((__m128i *)(dst + 80), x5);
        _mm_stream_si128((__m128i *)(dst + 96), x6);
        _mm_stream_si128((__m128i *)(dst + 112), x7);
        src += 128; dst += 128; n -= 128;
    }
    memcpy(dst, src, n);
}
static inline void shmkv__nt_fence(void) { _mm_sfence(); }
#else
#define SHMKV_HAVE_NT 0
static void shmkv__copy_nt(uint8_t *dst, const uint8_t *src, uint64_t n) { memcpy(dst, src, n); }
static inline void shmkv__nt_fence(void) {}
#endif

/* to_pool=1: buf -> pool (append); 0: pool -> buf (gather).  buf is [layers][n][token]. */
static void shmkv_seq_copy(shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n,
                           uint8_t *pool, uint8_t *buf, int to_pool) {
    const int32_t *t = shmkv_table(c, slot);
    const uint64_t tb = c->lay.token_bytes, bs = c->cfg.block_size;
    const int nt = SHMKV_HAVE_NT && n * tb * c->cfg.num_layers >= SHMKV_NT_MIN;
    for (uint32_t l = 0; l < c->cfg.num_layers; l++) {
        if (!to_pool && l == c->cfg.num_layers / 2) SHMKV_CRASH(GATHER_MID);
        uint8_t *layer = pool + (uint64_t)l * c->lay.layer_stride;
        uint8_t *b = buf + (uint64_t)l * n * tb;
        uint64_t p = pos, rem = n;
        while (rem) {
            uint64_t off = p % bs, cnt = bs - off, bi = p / bs;
            if (cnt > rem) cnt = rem;
            /* a run of consecutive block ids is one stretch of the layer: one copy (a
             * fresh sequence's blocks mostly are, the free stack being LIFO) */
            while (cnt < rem && t[bi + 1] == t[bi] + 1) {
                bi++;
                cnt += rem - cnt < bs ? rem - cnt : bs;
            }
            uint8_t *blk = layer + ((uint64_t)t[p / bs] * bs + off) * tb;
            uint8_t *d = to_pool ? blk : b;
            const uint8_t *sp = to_pool ? b : blk;
            if (nt) shmkv__copy_nt(d, sp, cnt * tb); else memcpy(d, sp, cnt * tb);
            b += cnt * tb;
            p += cnt;
            rem -= cnt;
        }
    }
    if (nt) shmkv__nt_fence();
}

/* Slot ids of positions [pos, pos+n) (slot = block * block_size + offset). */
static void shmkv_seq_slots(const shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n,
                            int64_t *out) {
    const int32_t *t = shmkv_table(c, slot);
    const uint64_t bs = c->cfg.block_size;
    for (uint64_t i = 0; i < n; i++, pos++)
        out[i] = (int64_t)t[pos / bs] * (int64_t)bs + (int64_t)(pos % bs);
}

/* Scatter of n tokens of one layer into slots (vLLM reshape_and_cache).  All slots are
 * validated before the first byte moves. */
static int shmkv_write_slots(shmkv_ctx_t *c, uint32_t layer, const int64_t *slots, uint64_t n,
                             const uint8_t *k, const uint8_t *v, int64_t *bad) {
    if (layer >= c->cfg.num_layers) return SHMKV_ERANGE;
    const int64_t nslots = (int64_t)c->cfg.num_blocks * c->cfg.block_size;
    for (uint64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= nslots) { *bad = (int64_t)i; return SHMKV_ERANGE; }
    const uint64_t tb = c->lay.token_bytes;
    uint8_t *kl = c->kpool + (uint64_t)layer * c->lay.layer_stride;
    uint8_t *vl = c->vpool + (uint64_t)layer * c->lay.layer_stride;
    for (uint64_t i = 0; i < n; i++) {
        memcpy(kl + (uint64_t)slots[i] * tb, k + i * tb, tb);
        memcpy(vl + (uint64_t)slots[i] * tb, v + i * tb, tb);
    }
    return SHMKV_OK;
}

/* ---- token ids, block hashes and the prefix cache ----------------------------------------- */
static inline uint64_t shmkv_fmix64(uint64_t k) {
    k ^= k >> 33; k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33; k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}
static inline uint64_t shmkv_rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

/* The fast (non-cryptographic) 128-bit block hash: two 64-bit lanes over the segment's
 * seed, the parent block's hash, the block's token ids and the extra keys (the salt
 * digest; only for the first block, the chain carries it on).  Never returns the
 * index's reserved keys {0,0} and {0,1}. */
static void shmkv_hash_fast(uint64_t seed, const uint64_t *parent, const int32_t *tok,
                            uint32_t n, const uint64_t *extra, uint64_t *out) {
    uint64_t a = seed ^ 0x243f6a8885a308d3ULL ^ parent[0];
    uint64_t b = ~seed ^ 0x13198a2e03707344ULL ^ parent[1];
    if (extra) { a ^= shmkv_fmix64(extra[0] + 0x9e3779b97f4a7c15ULL); b ^= shmkv_fmix64(extra[1]); }
    for (uint32_t i = 0; i < n; i++) {
        uint64_t t = (uint64_t)(uint32_t)tok[i];
        a = shmkv_rotl((a ^ t) * 0x9e3779b97f4a7c15ULL, 31);
        b = shmkv_rotl((b ^ (t + i)) * 0xc2b2ae3d27d4eb4fULL, 27) + a;
    }
    a ^= n; b ^= (uint64_t)n << 32;
    uint64_t h0 = shmkv_fmix64(a + b), h1 = shmkv_fmix64(b ^ shmkv_rotl(a, 17));
    if (h0 == 0 && h1 <= 1) h1 = 2;
    out[0] = h0;
    out[1] = h1;
}

static inline uint32_t shmkv_slot_of(const shmkv_ctx_t *c, const shmkv_seq_t *q) {
    return (uint32_t)(q - c->seqs);
}

/* Token ids of positions [pos, pos+n) between the sequence's blocks and ids[].
 * Caller holds the sequence lock and checked the span. */
static void shmkv_seq_tokens(shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n,
                             int32_t *ids, int to_pool) {
    const int32_t *t = shmkv_table(c, slot);
    const uint64_t bs = c->cfg.block_size;
    while (n) {
        uint64_t off = pos % bs, cnt = bs - off;
        if (cnt > n) cnt = n;
        int32_t *dst = c->tokens + (uint64_t)t[pos / bs] * bs + off;
        if (to_pool) memcpy(dst, ids, cnt * 4u); else memcpy(ids, dst, cnt * 4u);
        ids += cnt; pos += cnt; n -= cnt;
    }
}

/* The hash of block i of a sequence: parent = block i-1's hash (computed before, the
 * chain is filled in order), extra = the salt digest for block 0. */
static void shmkv_seq_block_hash_fast(shmkv_ctx_t *c, uint32_t slot, uint32_t i) {
    const int32_t *t = shmkv_table(c, slot);
    const shmkv_seq_t *q = &c->seqs[slot];
    uint64_t zero[2] = { 0, 0 };
    const uint64_t *parent = i ? c->blocks[t[i - 1]].hash : zero;
    uint32_t b = (uint32_t)t[i];
    shmkv_hash_fast(c->hdr->hash_seed, parent, c->tokens + (uint64_t)b * c->cfg.block_size,
                    c->cfg.block_size, i ? NULL : q->salt, c->blocks[b].hash);
    c->blocks[b].num_tokens = c->cfg.block_size;
}

/* Makes [hashed, hash_ready) findable: each block's hash goes into the index, unless
 * that hash is there already (another process published the same prefix first: ours
 * stays a private copy).  Caller holds the pool lock (and the sequence lock). */
static void shmkv_seq_publish_locked(shmkv_ctx_t *c, uint32_t slot) {
    shmkv_seq_t *q = &c->seqs[slot];
    const int32_t *t = shmkv_table(c, slot);
    uint32_t end = q->hash_ready < q->nblocks ? q->hash_ready : q->nblocks;
    for (uint32_t i = q->hashed; i < end; i++) {
        uint32_t b = (uint32_t)t[i];
        if (!shmkv_block_ok(c, b)) break;
        shmkv_block_t *m = &c->blocks[b];
        if (!(m->flags & SHMKV_BLOCK_HASHED)) {
            uint64_t h[2] = { m->hash[0], m->hash[1] };
            shmkv_index_insert_locked(c, h, b);
        }
        q->hashed = i + 1;
        if (i + 1 == end && i > q->hashed / 2) SHMKV_CRASH(PUBLISH_MID);
    }
}

/* How many leading hashes of hashes[n][2] are findable. */
static uint32_t shmkv_prefix_match_locked(shmkv_ctx_t *c, const uint64_t *hashes, uint32_t n) {
    uint32_t i = 0;
    for (; i < n; i++)
        if (shmkv_index_find_locked(c, hashes + 2 * i) == SHMKV_NIL) break;
    return i;
}

/* Gives an empty sequence (ours, fresh) the findable leading blocks of hashes[n][2]:
 * each hit gets a reference; a cached block (ref_cnt 0) leaves the LRU list in O(1).
 * Returns the number of blocks taken. */
static uint32_t shmkv_prefix_take_locked(shmkv_ctx_t *c, uint32_t slot, const uint64_t *hashes,
                                         uint32_t n) {
    shmkv_seq_t *q = &c->seqs[slot];
    int32_t *t = shmkv_table(c, slot);
    if (n > c->cfg.max_blocks_per_seq) n = c->cfg.max_blocks_per_seq;
    uint32_t i = 0;
    for (; i < n; i++) {
        uint32_t b = shmkv_index_find_locked(c, hashes + 2 * i);
        if (b == SHMKV_NIL) break;
        shmkv_block_t *m = &c->blocks[b];
        if (m->ref_cnt == 0) {                 /* CACHED: back into use */
            shmkv_lru_unlink_locked(c, b);
            shmkv_count(c, SHMKV_C_CACHED_REUSED, 1);
        }
        shmkv_atomic_add_u32(&m->ref_cnt, 1);
        t[i] = (int32_t)b;
        q->nblocks = i + 1;
    }
    q->hashed = q->hash_ready = i;
    shmkv_atomic_store_u32_release(&q->len, i * c->cfg.block_size);
    shmkv__note_peak(c);
    return i;
}

/* ---- StreamingLLM trim: drop the middle blocks, in place, under a redo journal ------------ */
static int shmkv__trim_valid(const shmkv_ctx_t *c, const shmkv_seq_t *q) {
    uint64_t s = q->trim_s, d = q->trim_d, k = q->trim_k;
    return d >= 1 && s + d + k == q->nblocks && q->nblocks <= c->cfg.max_blocks_per_seq
        && q->trim_chunk <= (k + d - 1) / d && q->trim_len <= (s + k) * c->cfg.block_size;
}

/* Applies (or, after a death, finishes) the journalled trim.  Chunk j moves at most
 * trim_d entries into place; its sources are the next chunk's destinations, untouched
 * until that chunk starts, so redoing chunk j is idempotent. */
static void shmkv__trim_apply(shmkv_ctx_t *c, uint32_t slot) {
    shmkv_seq_t *q = &c->seqs[slot];
    int32_t *t = shmkv_table(c, slot);
    uint32_t S = q->trim_s, D = q->trim_d, K = q->trim_k;
    uint32_t nch = (K + D - 1) / D;
    for (uint32_t j = q->trim_chunk; j < nch; j++) {
        __atomic_store_n(&q->trim_chunk, j, __ATOMIC_SEQ_CST);
        uint32_t lo = j * D, hi = lo + D < K ? lo + D : K;
        for (uint32_t i = lo; i < hi; i++) t[S + i] = t[S + D + i];
        if (j == 0) SHMKV_CRASH(TRIM_MID);
    }
    q->nblocks = S + K;
    shmkv_atomic_store_u32_release(&q->len, q->trim_len);
    if (q->hashed > S) q->hashed = S;
    if (q->hash_ready > S) q->hash_ready = S;
    q->flags |= SHMKV_SEQF_UNTRACKED;          /* positions renumbered: the chain ends */
    q->trimmed = q->trim_trimmed;              /* idempotent: redo sets the same value */
    __atomic_store_n(&q->trim_d, 0, __ATOMIC_SEQ_CST);   /* journal closed */
}

/* Keeps the first S blocks and the last K, drops the D between.  Caller holds the pool
 * lock and the sequence lock; nblocks covers exactly the published length.  dropped[]
 * (room for D) receives the dropped block ids for the caller to release. */
static int shmkv_seq_trim_locked(shmkv_ctx_t *c, uint32_t slot, uint32_t S, uint32_t D,
                                 uint32_t *dropped) {
    shmkv_seq_t *q = &c->seqs[slot];
    uint32_t nb = q->nblocks;
    if (D == 0 || (uint64_t)S + D > nb) return SHMKV_EINVAL;
    const int32_t *t = shmkv_table(c, slot);
    for (uint32_t i = 0; i < D; i++) dropped[i] = (uint32_t)t[S + i];
    q->trim_s = S;
    q->trim_k = nb - S - D;
    q->trim_len = q->len - D * c->cfg.block_size;
    q->trim_trimmed = q->trimmed + D * c->cfg.block_size;
    q->trim_chunk = 0;
    __atomic_store_n(&q->trim_d, D, __ATOMIC_SEQ_CST);       /* journal opened */
    shmkv__trim_apply(c, slot);
    for (uint32_t i = D; i-- > 0;) shmkv_block_decref_locked(c, dropped[i]);
    shmkv_count(c, SHMKV_C_TRIMMED_BLOCKS, D);
    return SHMKV_OK;
}

/* Marks a use of the sequence, for evict("lru") / evict("lfu").  Sequence-lock holder. */
static inline void shmkv_seq_touch(shmkv_ctx_t *c, uint32_t slot) {
    shmkv_seq_t *q = &c->seqs[slot];
    q->last_access_ns = (uint64_t)shmkv_now_ns(CLOCK_REALTIME_COARSE);
    q->access_count++;
}

/* ---- process registration ------------------------------------------------------------- */
/* Takes a free process slot: first the OFD liveness lock on its byte, then the fields,
 * then state ACTIVE -- so no prober ever sees an ACTIVE slot without its lock. */
static int shmkv_proc_register_locked(shmkv_ctx_t *c, uint64_t pid, uint64_t pid_start) {
    if (c->lock_fd < 0) return SHMKV_EINVAL;
    for (uint32_t s = 0; s < c->cfg.max_procs; s++) {
        shmkv_proc_t *p = &c->procs[s];
        if (p->state != SHMKV_PROC_FREE) continue;
        struct flock fl;
        memset(&fl, 0, sizeof fl);
        fl.l_type = F_WRLCK;
        fl.l_whence = SEEK_SET;
        fl.l_start = (off_t)(SHMKV_LOCK_BASE + s);
        fl.l_len = 1;
        if (fcntl(c->lock_fd, F_OFD_SETLK, &fl) != 0) continue;   /* a leaver still holds it */
        uint32_t gen = p->gen + 1;
        if (gen == 0) gen = 1;
        p->pid = pid;
        p->pid_start = pid_start;
        p->attach_time_ns = (uint64_t)shmkv_now_ns(CLOCK_REALTIME);
        for (uint32_t j = 0; j < SHMKV_INFLIGHT_PER_PROC; j++) p->inflight[j] = SHMKV_NIL;
        p->cache_nblocks = p->cache_nseqs = 0;   /* a released slot's cache went back */
        shmkv_atomic_store_u64(&p->cache_lock, 0);
        shmkv__fold_proc_counters(c, p);   /* a slot released by a crash mid-fold */
        shmkv_atomic_store_u32(&p->gen, gen);
        shmkv_atomic_store_u32(&p->state, SHMKV_PROC_ACTIVE);
        c->sh->num_procs++;
        c->proc_slot = s;
        c->proc_token = ((uint64_t)gen << 32) | (uint64_t)(s + 1);
        shmkv_count(c, SHMKV_C_PROCS_ATTACHED, 1);
        return SHMKV_OK;
    }
    return SHMKV_EPROCFULL;
}

/* Leaves the process table, freeing our own sequences (not detached ones) first.  A
 * sequence of ours that another process holds locked right now is left to a later
 * recovery (its owner is gone by then).  Nothing of other processes is touched. */
static void shmkv_proc_unregister_locked(shmkv_ctx_t *c) {
    if (c->proc_slot >= c->cfg.max_procs) return;
    for (uint32_t s = 0; s < c->cfg.max_seqs; s++) {
        shmkv_seq_t *q = &c->seqs[s];
        if (q->state != SHMKV_SEQ_LIVE || q->owner != c->proc_token) continue;
        if (!shmkv_atomic_cas_u64(&q->writer, 0, c->proc_token)) continue;
        if (shmkv_seq_free_locked(c, s) != SHMKV_OK) shmkv_seq_unlock(c, s);
    }
    shmkv_proc_t *p = &c->procs[c->proc_slot];
    for (uint32_t j = 0; j < SHMKV_INFLIGHT_PER_PROC; j++) {
        uint32_t b = p->inflight[j];
        p->inflight[j] = SHMKV_NIL;
        if (shmkv_block_ok(c, b)) shmkv_block_decref_locked(c, b);
    }
    if (shmkv_pcache_lock_recover_locked(c, p) == SHMKV_OK) {
        shmkv__pcache_spill_locked(c, p, 0, 0);
        shmkv_pcache_unlock(p);
    }   /* else: a recovery pass returns them (the slot is released below either way) */
    shmkv__fold_proc_counters(c, p);
    shmkv_atomic_store_u32(&p->state, SHMKV_PROC_FREE);
    if (c->sh->num_procs > 0) c->sh->num_procs--;
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_UNLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)(SHMKV_LOCK_BASE + c->proc_slot);
    fl.l_len = 1;
    fcntl(c->lock_fd, F_OFD_SETLK, &fl);
    c->proc_slot = SHMKV_NIL;
    c->proc_token = 0;
}

/* ---- recovery ----------------------------------------------------------------------------- */
/* Is any attached process dead?  O(max_procs) liveness probes, no writes: the cheap test
 * that decides whether a full recovery pass is worth running before CacheFullError. */
static int shmkv_any_dead_locked(shmkv_ctx_t *c) {
    for (uint32_t s = 0; s < c->cfg.max_procs; s++) {
        shmkv_proc_t *p = &c->procs[s];
        if (p->state == SHMKV_PROC_FREE) continue;
        uint64_t tok = ((uint64_t)p->gen << 32) | (uint64_t)(s + 1);
        if (p->state != SHMKV_PROC_ACTIVE || !shmkv_proc_alive(c, tok)) return 1;
    }
    return 0;
}

/* Rebuilds every piece of derived state from the truth (the LIVE sequences' tables and
 * the in-flight records of live processes):
 *   1. process slots whose holder is dead are released;
 *   2. sequence slots half-built by a dead holder of the pool lock are released; a
 *      sequence lock held by a dead process is cleared; sequences whose owner is dead
 *      (and not detached) are freed; unpublished tail blocks of idle sequences are
 *      trimmed; a sequence whose table is corrupt is dropped;
 *   3. every ref_cnt is recounted; the free stack, the LRU list of cached blocks, the
 *      hash index, the sequence free stack and the counts are rebuilt.
 * A sequence whose lock a live process holds is left alone (its holder is using it);
 * the next pass gets it.  Runs under the pool lock; O(num_blocks + table entries). */
static int shmkv_recover_locked(shmkv_ctx_t *c, shmkv_recovery_t *r) {
    int64_t t0 = shmkv_now_ns(CLOCK_MONOTONIC);
    memset(r, 0, sizeof *r);
    if (__builtin_expect(shmkv_plant == SHMKV_PLANT_NO_RECOVERY, 0)) return SHMKV_OK;
    shmkv_shared_t *sh = c->sh;
    const uint32_t NB = c->cfg.num_blocks, NS = c->cfg.max_seqs, NP = c->cfg.max_procs;
    /* references this pass drops on purpose (reclaimed sequences, trimmed tails, dead
     * in-flight records): a ref_cnt that differs from the recount by exactly these was
     * right; any other difference is a repaired inconsistency (refcounts_fixed) */
    uint32_t *gone = (uint32_t *)calloc(NB, sizeof(uint32_t));
    if (gone == NULL) return SHMKV_ESYS;
    /* no fast path may run while the tables and caches are read and rebuilt */
    int qst = shmkv_quiesce_locked(c);     /* (dead holders: this pass is the recovery) */
    if (qst != SHMKV_OK && qst != SHMKV_EDEADHOLDER) { free(gone); return qst; }

    uint32_t nprocs = 0;
    for (uint32_t s = 0; s < NP; s++) {
        shmkv_proc_t *p = &c->procs[s];
        if (p->state == SHMKV_PROC_FREE) continue;
        uint64_t tok = ((uint64_t)p->gen << 32) | (uint64_t)(s + 1);
        if (p->state != SHMKV_PROC_ACTIVE || !shmkv_proc_alive(c, tok)) {
            for (uint32_t j = 0; j < SHMKV_INFLIGHT_PER_PROC; j++) {
                if (p->inflight[j] < NB) gone[p->inflight[j]]++;
                p->inflight[j] = SHMKV_NIL;
            }
            p->cache_nblocks = p->cache_nseqs = 0;    /* its cache is rebuilt as free */
            shmkv_atomic_store_u64(&p->cache_lock, 0);
            shmkv__fold_proc_counters(c, p);
            shmkv_atomic_store_u32(&p->state, SHMKV_PROC_FREE);
            r->processes++;
        } else {
            nprocs++;
        }
    }
    sh->num_procs = nprocs;

    for (uint32_t s = 0; s < NS; s++) {
        shmkv_seq_t *q = &c->seqs[s];
        uint32_t st = shmkv_atomic_load_u32(&q->state);
        if (st == SHMKV_SEQ_FREE) continue;
        if (st != SHMKV_SEQ_LIVE) {            /* BUILDING: its builder died holding the lock */
            shmkv_atomic_store_u32(&q->state, SHMKV_SEQ_FREE);
            q->nblocks = 0; q->len = 0; q->owner = 0;
            shmkv_atomic_store_u64(&q->writer, 0);
            r->sequences++;
            continue;
        }
        if (q->trim_d != 0) {                   /* a trimmer died: finish its trim */
            if (shmkv__trim_valid(c, q)) shmkv__trim_apply(c, s);
            else { q->trim_d = 0; q->nblocks = c->cfg.max_blocks_per_seq + 1; } /* corrupt */
        }
        uint64_t w = shmkv_atomic_load_u64(&q->writer);
        if (w != 0 && !shmkv_proc_alive(c, w)) {
            if (shmkv_atomic_cas_u64(&q->writer, w, 0)) r->locks++;
        }
        /* Everything below changes the table: take the sequence lock (never wait: we
         * hold the pool lock, and the order is sequence lock first). */
        uint64_t me = c->proc_token ? c->proc_token : 1;
        if (!shmkv_atomic_cas_u64(&q->writer, 0, me)) continue;   /* a live holder is busy */
        if (shmkv_seq_valid(c, s) != SHMKV_OK) {
            shmkv_atomic_store_u32(&q->state, SHMKV_SEQ_FREE);
            q->nblocks = 0; q->len = 0; q->owner = 0;
            r->corrupt++;
            r->sequences++;
        } else if (q->owner != 0 && !shmkv_proc_alive(c, q->owner)) {
            const int32_t *t = shmkv_table(c, s);
            for (uint32_t i = 0; i < q->nblocks; i++) gone[t[i]]++;   /* validated above */
            shmkv_atomic_store_u32(&q->state, SHMKV_SEQ_FREE);
            q->nblocks = 0; q->len = 0; q->owner = 0;
            r->sequences++;
        } else {
            uint32_t want = shmkv_blocks_for(c, q->len);
            const int32_t *t = shmkv_table(c, s);
            for (uint32_t i = want; i < q->nblocks; i++) gone[t[i]]++;
            if (q->nblocks > want) { r->tails += q->nblocks - want; q->nblocks = want; }
            uint32_t full = q->len / c->cfg.block_size;
            if (q->hash_ready > full) q->hash_ready = full;
            if (q->hashed > q->hash_ready) q->hashed = q->hash_ready;
        }
        shmkv_atomic_store_u64_release(&q->writer, 0);
    }

    /* recount: tables of LIVE sequences + in-flight records of live processes */
    uint32_t *cnt = (uint32_t *)calloc(NB, sizeof(uint32_t));
    if (cnt == NULL) { free(gone); shmkv_unquiesce_locked(c); return SHMKV_ESYS; }
    uint32_t live = 0;
    for (uint32_t s = 0; s < NS; s++) {
        shmkv_seq_t *q = &c->seqs[s];
        if (q->state != SHMKV_SEQ_LIVE) continue;
        live++;
        const int32_t *t = shmkv_table(c, s);
        uint32_t nb = q->nblocks;
        if (nb > c->cfg.max_blocks_per_seq) nb = c->cfg.max_blocks_per_seq;  /* busy, unchecked */
        for (uint32_t i = 0; i < nb; i++)
            if (shmkv_block_ok(c, t[i])) cnt[t[i]]++;
    }
    for (uint32_t s = 0; s < NP; s++) {
        shmkv_proc_t *p = &c->procs[s];
        if (p->state != SHMKV_PROC_ACTIVE) continue;
        for (uint32_t j = 0; j < SHMKV_INFLIGHT_PER_PROC; j++) {
            uint32_t b = p->inflight[j];
            if (b == SHMKV_NIL) continue;
            if (b < NB) cnt[b]++; else p->inflight[j] = SHMKV_NIL;
        }
    }
    /* the LRU order of cached blocks survives: collect the old list first (bounded) */
    uint32_t *order = (uint32_t *)malloc(sizeof(uint32_t) * (size_t)NB + 1);
    uint8_t *seen = (uint8_t *)calloc(NB, 1);
    uint8_t *sseen = (uint8_t *)calloc(NS, 1);
    if (order == NULL || seen == NULL || sseen == NULL) {
        free(cnt); free(order); free(seen); free(gone); free(sseen);
        shmkv_unquiesce_locked(c);
        return SHMKV_ESYS;
    }
    uint32_t nord = 0;
    for (uint32_t b = sh->lru_head, k = 0; b < NB && k < NB; b = c->blocks[b].lru_next, k++) {
        if (seen[b]) break;
        seen[b] = 1;
        order[nord++] = b;
    }
    for (uint32_t b = 0; b < NB; b++) {
        shmkv_block_t *m = &c->blocks[b];
        uint32_t old = shmkv_atomic_load_u32(&m->ref_cnt);
        if (old != cnt[b]) {
            if ((uint64_t)old != (uint64_t)cnt[b] + gone[b]) r->refcounts_fixed++;
            if (cnt[b] == 0) r->blocks++;
            shmkv_atomic_store_u32(&m->ref_cnt, cnt[b]);
        }
        m->lru_prev = m->lru_next = SHMKV_NIL;
    }
    SHMKV_CRASH(RECOVER_MID);
    /* the caches of live processes stay theirs: each entry is checked (a free, unhashed
     * block or a FREE slot, listed once) and kept out of the shared stacks (seen = 3) */
    for (uint32_t s = 0; s < NP; s++) {
        shmkv_proc_t *p = &c->procs[s];
        if (p->state != SHMKV_PROC_ACTIVE) continue;
        uint32_t n = p->cache_nblocks <= SHMKV_PCACHE_BLOCKS ? p->cache_nblocks : 0, k = 0;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t b = p->cache_blocks[i];
            if (b < NB && cnt[b] == 0 && !(c->blocks[b].flags & SHMKV_BLOCK_HASHED)
                    && seen[b] != 3) {
                seen[b] = 3;
                p->cache_blocks[k++] = b;
            }
        }
        p->cache_nblocks = k;
        n = p->cache_nseqs <= SHMKV_PCACHE_SEQS ? p->cache_nseqs : 0;
        k = 0;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t q = p->cache_seqs[i];
            if (q < NS && c->seqs[q].state == SHMKV_SEQ_FREE && !sseen[q]) {
                sseen[q] = 1;
                p->cache_seqs[k++] = q;
            }
        }
        p->cache_nseqs = k;
    }
    /* index: rebuilt from the hashed blocks */
    memset(c->index, 0, c->lay.index_capacity * sizeof(shmkv_index_t));
    sh->index_used = sh->index_tombs = 0;
    for (uint32_t b = 0; b < NB; b++) {
        shmkv_block_t *m = &c->blocks[b];
        if (!(m->flags & SHMKV_BLOCK_HASHED)) continue;
        m->flags &= ~(uint32_t)SHMKV_BLOCK_HASHED;
        uint64_t h[2] = { m->hash[0], m->hash[1] };
        shmkv_index_insert_locked(c, h, b);
    }
    /* free stack and LRU list */
    sh->free_top = 0;
    sh->cached_count = 0;
    sh->lru_head = sh->lru_tail = SHMKV_NIL;
    for (uint32_t k = 0; k < nord; k++) {
        uint32_t b = order[k];
        if (cnt[b] == 0 && (c->blocks[b].flags & SHMKV_BLOCK_HASHED)) {
            shmkv_lru_push_tail_locked(c, b);
            seen[b] = 2;
        }
    }
    for (uint32_t b = 0; b < NB; b++) {
        if (cnt[b] != 0 || seen[b] == 2) continue;
        if (c->blocks[b].flags & SHMKV_BLOCK_HASHED) shmkv_lru_push_tail_locked(c, b);
    }
    for (uint32_t b = NB; b-- > 0;) {
        if (cnt[b] == 0 && !(c->blocks[b].flags & SHMKV_BLOCK_HASHED) && seen[b] != 3)
            c->free_stack[sh->free_top++] = b;
    }

    /* sequence free stack */
    sh->seq_free_top = 0;
    for (uint32_t s = NS; s-- > 0;)
        if (c->seqs[s].state == SHMKV_SEQ_FREE && !sseen[s]) c->seq_free[sh->seq_free_top++] = s;
    (void)live;
    free(cnt); free(order); free(seen); free(gone); free(sseen);
    shmkv_unquiesce_locked(c);

    r->duration_ns = (uint64_t)(shmkv_now_ns(CLOCK_MONOTONIC) - t0);
    sh->last_recovery_ns = r->duration_ns;
    if (r->duration_ns > sh->max_recovery_ns) sh->max_recovery_ns = r->duration_ns;
    shmkv_count(c, SHMKV_C_RECOVERIES, 1);
    shmkv_count(c, SHMKV_C_RECLAIMED_SEQS, r->sequences);
    shmkv_count(c, SHMKV_C_RECLAIMED_BLOCKS, r->blocks);
    return SHMKV_OK;
}

/* ---- kernel-only timing hooks (loops in C, no Python): how much is call overhead ---- */
/* ns per alloc+free of one block.  shared=0: the path reserve() and free() take -- our
 * process's cache under its cache_lock (the shared pool only when the cache is empty);
 * shared=1: the shared free stack under the pool lock, as a process without a cache. */
static double shmkv_bench_alloc_free(shmkv_ctx_t *c, uint64_t iters, int shared) {
    uint32_t b;
    shmkv_proc_t *p = shmkv_me(c);
    int64_t t0 = shmkv_now_ns(CLOCK_MONOTONIC);
    for (uint64_t i = 0; i < iters; i++) {
        if (!shared && p != NULL && shmkv_pcache_trylock(c, p)) {
            uint32_t n = p->cache_nblocks;
            if (n > 0 && n <= SHMKV_PCACHE_BLOCKS && shmkv__cacheable(c, p->cache_blocks[n - 1])) {
                b = p->cache_blocks[n - 1];
                p->cache_nblocks = n - 1;
                shmkv__block_claim(c, b);
                shmkv_count_hot(c, SHMKV_PC_ALLOCATIONS, 1);
                if (shmkv_atomic_load_u32(&c->blocks[b].ref_cnt) == 1) {   /* the free */
                    shmkv_atomic_store_u32(&c->blocks[b].ref_cnt, 0);
                    p->cache_blocks[p->cache_nblocks++] = b;
                    shmkv_count_hot(c, SHMKV_PC_FREES, 1);
                }
                shmkv_pcache_unlock(p);
                continue;
            }
            shmkv_pcache_unlock(p);
        }
        if (shmkv_pool_lock(c) != SHMKV_OK) return -1;
        if (!shared && p != NULL && shmkv_pcache_balance_locked(c) == SHMKV_OK
                && p->cache_nblocks > 0) {
            shmkv_pool_unlock(c);
            i--;                            /* refilled: this round again, on the fast path */
            continue;
        }
        if (shmkv_blocks_alloc_locked(c, 1, &b) != SHMKV_OK) { shmkv_pool_unlock(c); return -1; }
        shmkv_block_decref_locked(c, b);
        shmkv_pool_unlock(c);
    }
    return (double)(shmkv_now_ns(CLOCK_MONOTONIC) - t0) / (double)iters;
}

/* ns per memcpy of nbytes; src/dst walk a working set of `span` bytes (>= nbytes) so a
 * span larger than the caches measures cold copies. */
static double shmkv_bench_memcpy(uint8_t *dst, const uint8_t *src, uint64_t nbytes,
                                 uint64_t span, uint64_t iters, int streaming) {
    uint64_t off = 0;
    int64_t t0 = shmkv_now_ns(CLOCK_MONOTONIC);
    for (uint64_t i = 0; i < iters; i++) {
        if (streaming) { shmkv__copy_nt(dst + off, src + off, nbytes); shmkv__nt_fence(); }
        else memcpy(dst + off, src + off, nbytes);
        off += nbytes;
        if (off + nbytes > span) off = 0;
    }
    return (double)(shmkv_now_ns(CLOCK_MONOTONIC) - t0) / (double)iters;
}

#endif /* SHMKV_KERNELS_H */
