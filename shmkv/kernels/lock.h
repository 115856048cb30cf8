/*
 * kernels/lock.h -- the pool lock (robust mutex, spin then futex sleep) and the sequence ids and
 * per-sequence locks.  Writes: the pool lock and the sequence slots' lock words.
 */
#ifndef SHMKV_KERNELS_LOCK_H
#define SHMKV_KERNELS_LOCK_H

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

/* Returns OK (locked), EAGAIN (busy; nothing held), or ECORRUPT (not recoverable).
 * Spins briefly (bounded, no sleep) before giving up. */
static int shmkv_pool_trylock(shmkv_ctx_t *c) {
    int rc = shmkv__pool_spin(c);
    if (rc == 0) return SHMKV_OK;
    if (rc == EBUSY) return SHMKV_EAGAIN;
    if (rc == EOWNERDEAD) return shmkv__owner_died(c);
    return SHMKV_ECORRUPT;
}

/* Blocks at most ctx->timeout_ns.  Call without the GIL. */
static int shmkv_pool_lock(shmkv_ctx_t *c) {
    int rc = shmkv__pool_spin(c);
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

#endif /* SHMKV_KERNELS_LOCK_H */
