/*
 * kernels/lock.h -- the pool lock (robust mutex, spin then a sleep bounded on CLOCK_MONOTONIC) and
 * the sequence ids and
 * per-sequence locks.  Writes: the pool lock and the sequence slots' lock words.
 * A primitive: it takes and releases locks and reports a dead holder (EDEADHOLDER), but
 * never repairs -- the waits that recover are ops.h's, above every primitive.
 */
#ifndef SHMKV_KERNELS_LOCK_H
#define SHMKV_KERNELS_LOCK_H

/* ---- the pool lock --------------------------------------------------------------------- */
/* EOWNERDEAD (the holder died inside a critical section) comes back as EDEADHOLDER with
 * the lock held and still marked inconsistent; the coordinators of ops.h
 * (shmkv_pool_lock, shmkv_pool_trylock) run the recovery pass and mark it consistent. */

/* Critical sections under the pool lock last tens of nanoseconds, so a busy lock is
 * nearly always free again within a few hundred cycles: spinning on trylock that long
 * (reading the lock word, not writing it) beats a futex sleep and wake-up (two system
 * calls and a context switch each way), which made two processes slower than one. */
#define SHMKV_POOL_SPIN 128

static inline int shmkv__mutex_looks_free(pthread_mutex_t *m) {
    /* glibc: __data.__lock is the first int; 0 = unlocked.  A hint only: trylock decides. */
    return __atomic_load_n((int *)m, __ATOMIC_RELAXED) == 0;
}

/* pthread_mutex_trylock of the pool lock, retried while a bounded spin (no sleep) sees
 * it come free; the last trylock's result. */
static inline int shmkv__pool_spin(shmkv_ctx_t *c) {
    int rc = pthread_mutex_trylock(&c->sh->pool_lock);
    for (int i = 0; rc == EBUSY && i < SHMKV_POOL_SPIN; i++) {
        SHMKV_PAUSE();
        if (shmkv__mutex_looks_free(&c->sh->pool_lock))
            rc = pthread_mutex_trylock(&c->sh->pool_lock);
    }
    return rc;
}

/* Returns OK (locked), EAGAIN (busy; nothing held), EDEADHOLDER (locked; the last
 * holder died: recover, then mark consistent) or ECORRUPT.  Spins briefly (bounded, no
 * sleep) before giving up. */
static int shmkv__pool_trylock_raw(shmkv_ctx_t *c) {
    int rc = shmkv__pool_spin(c);
    if (rc == 0) return SHMKV_OK;
    if (rc == EBUSY) return SHMKV_EAGAIN;
    if (rc == EOWNERDEAD) return SHMKV_EDEADHOLDER;
    return SHMKV_ECORRUPT;
}

/* The wait after the spin, bounded on CLOCK_MONOTONIC: pthread_mutex_timedlock takes a
 * CLOCK_REALTIME deadline, which a clock step backwards (NTP, a VM resumed, `date -s`)
 * pushes out by the step -- an hour's step, an hour's wait.  glibc >= 2.30 has
 * pthread_mutex_clocklock, which takes the clock: the same futex sleep and wake-up as
 * timedlock (a waiter runs the moment the holder lets go), robust mutexes included (ours
 * is robust and not priority-inheriting, for which glibc < 2.35 refused CLOCK_MONOTONIC).
 * The manylinux_2_28 wheels are built against glibc 2.28, which lacks it: there the wait is
 * a trylock loop -- yield, then sleeps doubling from 1 us to 1 ms -- bounded on
 * CLOCK_MONOTONIC, which wakes up to a sleep's length late but never waits past the bound.
 * Returns pthread's code: 0, EOWNERDEAD, ETIMEDOUT or another error. */
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30)) \
    && !defined(SHMKV_NO_CLOCKLOCK)
#define SHMKV_POOL_WAIT "pthread_mutex_clocklock(CLOCK_MONOTONIC)"
static int shmkv__pool_wait(shmkv_ctx_t *c) {
    int64_t dl = shmkv_now_ns(CLOCK_MONOTONIC) + c->timeout_ns;
    struct timespec ts = { (time_t)(dl / 1000000000LL), (long)(dl % 1000000000LL) };
    return pthread_mutex_clocklock(&c->sh->pool_lock, CLOCK_MONOTONIC, &ts);
}
#else
#define SHMKV_POOL_WAIT "trylock loop on CLOCK_MONOTONIC"
static int shmkv__pool_wait(shmkv_ctx_t *c) {
    int64_t t0 = shmkv_now_ns(CLOCK_MONOTONIC);
    long sleep_ns = 1000;
    for (unsigned i = 0;; i++) {
        int rc = pthread_mutex_trylock(&c->sh->pool_lock);
        if (rc != EBUSY) return rc;
        if (shmkv_now_ns(CLOCK_MONOTONIC) - t0 > c->timeout_ns) return ETIMEDOUT;
        if (i < 64) { sched_yield(); continue; }
        struct timespec ts = { 0, sleep_ns };
        nanosleep(&ts, NULL);
        if (sleep_ns < 1000000) sleep_ns *= 2;
    }
}
#endif

/* Blocks at most ctx->timeout_ns (CLOCK_MONOTONIC).  OK, EDEADHOLDER (as above),
 * ETIMEDOUT or ECORRUPT.  Call without the GIL.
 * The backoff (ctx->backoff_ns > 0): a wait that runs out starts a pause of backoff_ns in
 * which this process only tries the lock (the bounded spin) and answers ETIMEDOUT at once
 * when it is still held.  A holder that is alive but stopped (SIGSTOP, a debugger, `docker
 * pause`) then costs a caller one bound per pause rather than one per call -- a serving
 * engine's step makes several calls -- while a lock that comes free is taken at once. */
static int shmkv__pool_lock_raw(shmkv_ctx_t *c) {
    int rc = shmkv__pool_spin(c);
    if (rc == EBUSY) {
        shmkv_count(c, SHMKV_C_LOCK_WAITS, 1);
        int64_t pause = __atomic_load_n(&c->backoff_ns, __ATOMIC_RELAXED);
        if (pause > 0 && shmkv_now_ns(CLOCK_MONOTONIC)
                         < __atomic_load_n(&c->backoff_until_ns, __ATOMIC_RELAXED)) {
            rc = ETIMEDOUT;
        } else {
            rc = shmkv__pool_wait(c);
            if (rc == ETIMEDOUT && pause > 0)
                __atomic_store_n(&c->backoff_until_ns,
                                 shmkv_now_ns(CLOCK_MONOTONIC) + pause, __ATOMIC_RELAXED);
        }
        if (rc == ETIMEDOUT)
            __atomic_add_fetch(&c->lock_timeouts, 1, __ATOMIC_RELAXED);
    }
    if (rc == 0) return SHMKV_OK;
    if (rc == EOWNERDEAD) return SHMKV_EDEADHOLDER;
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

/* Where a wait for a sequence lock stands, so that it can go on after the coordinator
 * (shmkv_seq_lock, ops.h) has run a recovery pass for a dead holder: the same bound, the
 * same backoff. */
typedef struct {
    int64_t t0;             /* CLOCK_MONOTONIC ns when the wait began: the bound's start */
    int64_t last_probe;     /* when the holder's liveness was last asked */
    long sleep_ns;          /* the next sleep, doubled up to 1 ms */
    unsigned spin;          /* attempts so far: spin, then yield, then sleep */
} shmkv_seq_wait_t;

static inline void shmkv__seq_wait_init(shmkv_seq_wait_t *w) {
    w->t0 = w->last_probe = shmkv_now_ns(CLOCK_MONOTONIC);
    w->sleep_ns = 1000;
    w->spin = 0;
}

/* Waits for a sequence lock, at most ctx->timeout_ns from w->t0; spins briefly, then
 * sleeps with backoff.  Every millisecond or so it asks whether the holder is alive.
 * Returns OK (held), ENOSEQ, ETIMEDOUT, or EDEADHOLDER: the holder is dead and nothing is
 * held -- a recovery pass (which clears its lock and frees what it had in flight) must
 * run, then a call with the same w goes on waiting.  Never recovers.  No GIL. */
static int shmkv__seq_lock_wait(shmkv_ctx_t *c, int64_t sid, uint32_t *slot,
                                shmkv_seq_wait_t *w) {
    for (;;) {
        unsigned spin = w->spin++;
        if (spin < 200) SHMKV_PAUSE();
        else if (spin < 400) sched_yield();
        else {
            struct timespec ts = { 0, w->sleep_ns };
            nanosleep(&ts, NULL);
            if (w->sleep_ns < 1000000) w->sleep_ns *= 2;
        }
        int st = shmkv_seq_trylock(c, sid, slot);
        if (st != SHMKV_EAGAIN) return st;
        int64_t now = shmkv_now_ns(CLOCK_MONOTONIC);
        if (now - w->last_probe > 1000000) {
            w->last_probe = now;
            uint32_t sl;
            if (shmkv_sid_slot(c, sid, &sl) != SHMKV_OK) return SHMKV_ENOSEQ;
            uint64_t holder = shmkv_atomic_load_u64(&c->seqs[sl].writer);
            if (holder != 0 && !shmkv_proc_alive(c, holder)) return SHMKV_EDEADHOLDER;
        }
        if (shmkv_now_ns(CLOCK_MONOTONIC) - w->t0 > c->timeout_ns) return SHMKV_ETIMEDOUT;
    }
}

#endif /* SHMKV_KERNELS_LOCK_H */
