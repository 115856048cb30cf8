/*
 * kernels/ops.h -- the coordinators: the waits for a lock that repair what a dead holder
 * left (the pool lock, a sequence lock, a process cache's lock), the process caches'
 * slow paths under the pool lock (balance, drain before CacheFull), and a process's
 * registration and leaving.  Writes: through the primitives below, and the process table.
 *
 * Above every primitive (layers.txt): a primitive reports a dead holder (EDEADHOLDER)
 * and the code here acts on it with a recovery pass (recover.h), so no primitive calls
 * upward.  What the Cython modules call to take a lock is here.
 */
#ifndef SHMKV_KERNELS_OPS_H
#define SHMKV_KERNELS_OPS_H

/* ---- the pool lock, recovering from a dead holder ---------------------------------------- */
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

/* Returns OK (locked), EAGAIN (busy; nothing held), or ECORRUPT (not recoverable).
 * Spins briefly (bounded, no sleep) before giving up. */
static inline int shmkv_pool_trylock(shmkv_ctx_t *c) {
    int st = shmkv__pool_trylock_raw(c);
    return st == SHMKV_EDEADHOLDER ? shmkv__owner_died(c) : st;
}

/* Blocks at most ctx->timeout_ns.  Call without the GIL. */
static int shmkv_pool_lock(shmkv_ctx_t *c) {
    int st = shmkv__pool_lock_raw(c);
    return st == SHMKV_EDEADHOLDER ? shmkv__owner_died(c) : st;
}

/* ---- a scheduled recovery pass: recover() ------------------------------------------------- */
/* The pass a process runs on its own schedule (the vLLM connector's housekeeping, a
 * caller's recover()): cheap when nothing died, one recoverer at a time, and the pass of
 * what died when something did.
 *   1. The gate, with no lock: shmkv_recover_needed (the process table only).  Nothing
 *      dead and nothing pending: return at once, all zeros -- the pool lock is not
 *      taken and the pool not walked.
 *   2. One recoverer: the recoverer word, CAS 0 -> our token.  Held by another live
 *      process since less than our lock bound: return at once with busy = 1 (it is
 *      reclaiming what we would).  A dead or stale holder's word is taken over.
 *   3. The pool lock (bounded wait); a dead holder of it means the full pass (as every
 *      locker does), else shmkv_recover_dead_locked.
 * Call without the GIL.  OK, ETIMEDOUT (the pool lock), or a recovery error. */
static inline int shmkv_recover_scheduled(shmkv_ctx_t *c, shmkv_recovery_t *r) {
    memset(r, 0, sizeof *r);
    if (!shmkv_recover_needed(c)) return SHMKV_OK;
    shmkv_shared_t *sh = c->sh;
    uint64_t me = c->proc_token ? c->proc_token : 1;
    int64_t now = shmkv_now_ns(CLOCK_MONOTONIC);
    uint64_t cur = shmkv_atomic_load_u64(&sh->recoverer);
    if (cur != 0 && cur != me && shmkv_proc_alive(c, cur)) {
        int64_t age = now - (int64_t)shmkv_atomic_load_u64_relaxed(&sh->recoverer_since_ns);
        if (age >= 0 && age < c->timeout_ns + 1000000000LL) {   /* (a time ahead of ours:
                                                             garbage, taken over) */
            r->busy = 1;
            return SHMKV_OK;
        }
    }
    if (!shmkv_atomic_cas_u64(&sh->recoverer, cur, me)) { r->busy = 1; return SHMKV_OK; }
    __atomic_store_n(&sh->recoverer_since_ns, (uint64_t)now, __ATOMIC_RELAXED);
    int st = shmkv__pool_lock_raw(c);
    if (st == SHMKV_EDEADHOLDER) {         /* as shmkv__owner_died, keeping the report */
        shmkv_count(c, SHMKV_C_OWNER_DEAD, 1);
        st = shmkv_recover_locked(c, r);
        pthread_mutex_consistent(&sh->pool_lock);
        shmkv_pool_unlock(c);
    } else if (st == SHMKV_OK) {
        st = shmkv_recover_dead_locked(c, r);
        shmkv_pool_unlock(c);
    }
    shmkv_atomic_cas_u64(&sh->recoverer, me, 0);    /* unless taken over meanwhile */
    return st;
}

/* ---- a sequence lock, taking over a dead holder's ---------------------------------------- */
/* Waits at most ctx->timeout_ns (shmkv__seq_lock_wait); a dead holder's lock is taken
 * over after a recovery pass (which also reclaims what the holder had in flight), and
 * the wait goes on within the same bound.  Call without the GIL.  Returns OK, ENOSEQ,
 * ETIMEDOUT or a recovery error. */
static inline int shmkv_seq_lock(shmkv_ctx_t *c, int64_t sid, uint32_t *slot) {
    int st = shmkv_seq_trylock(c, sid, slot);
    if (st != SHMKV_EAGAIN) return st;
    shmkv_count(c, SHMKV_C_LOCK_WAITS, 1);
    shmkv_seq_wait_t w;
    shmkv__seq_wait_init(&w);
    while ((st = shmkv__seq_lock_wait(c, sid, slot, &w)) == SHMKV_EDEADHOLDER) {
        st = shmkv_pool_lock(c);
        if (st != SHMKV_OK) return st;
        shmkv_recovery_t r;
        st = shmkv_recover_dead_locked(c, &r);   /* clears the lock, frees in-flight */
        shmkv_pool_unlock(c);
        if (st != SHMKV_OK) return st;
        /* the bound holds even if the holder's lock survived */
        if (shmkv_now_ns(CLOCK_MONOTONIC) - w.t0 > c->timeout_ns) return SHMKV_ETIMEDOUT;
    }
    return st;
}

/* ---- the process caches' slow paths (pool lock held) ------------------------------------- */
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

/* Our cache back to half full (pool lock held): refilled from, or spilled to, the
 * shared stacks.  Refills take never-cached free blocks only (never the LRU list). */
static inline int shmkv_pcache_balance_locked(shmkv_ctx_t *c) {
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

/* Is p's cache lock held by p itself, alive, past a short spin?  Its owner holds it on a
 * fast path for nanoseconds -- or stopped there (SIGSTOP, a debugger, `docker pause`).
 * A lock held by anyone else (a dead pool-lock holder's leftover) is not "busy": the
 * locking path takes it over. */
static int shmkv__pcache_owner_busy(shmkv_ctx_t *c, shmkv_proc_t *p) {
    uint32_t slot = (uint32_t)(p - c->procs);
    uint64_t owner = ((uint64_t)shmkv_atomic_load_u32(&p->gen) << 32) | (uint64_t)(slot + 1);
    for (int i = 0; i < 4096; i++) {
        if (shmkv_atomic_load_u64(&p->cache_lock) != owner) return 0;
        SHMKV_PAUSE();
    }
    return owner != c->proc_token && shmkv_proc_alive(c, owner);
}

/* Every attached process's cache back to the shared stacks (pool lock held): before
 * CacheFullError, blocks or slots another process keeps for itself are not "full".  A
 * cache its owner is busy with (above) is left alone rather than waited for: the wait
 * would hold the pool lock -- every other process -- behind a stopped one, for the few
 * blocks a cache keeps. */
static inline int shmkv_pcache_drain_all_locked(shmkv_ctx_t *c) {
    for (uint32_t s = 0; s < c->cfg.max_procs; s++) {
        shmkv_proc_t *p = &c->procs[s];
        if (shmkv_atomic_load_u32(&p->state) != SHMKV_PROC_ACTIVE) continue;
        if (shmkv_atomic_load_u32_relaxed(&p->cache_nblocks) == 0
                && shmkv_atomic_load_u32_relaxed(&p->cache_nseqs) == 0) continue;
        if (shmkv__pcache_owner_busy(c, p)) continue;
        int st = shmkv_pcache_lock_recover_locked(c, p);
        if (st != SHMKV_OK) return st;
        if (p->state == SHMKV_PROC_ACTIVE) shmkv__pcache_spill_locked(c, p, 0, 0);
        shmkv_pcache_unlock(p);
    }
    return SHMKV_OK;
}

/* ---- process registration ---------------------------------------------------------------- */
/* Takes a free process slot: first the OFD liveness lock on its byte, then the fields,
 * then state ACTIVE -- so no prober ever sees an ACTIVE slot without its lock. */
static inline int shmkv_proc_register_locked(shmkv_ctx_t *c, uint64_t pid, uint64_t pid_start) {
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
static inline void shmkv_proc_unregister_locked(shmkv_ctx_t *c) {
    if (c->proc_slot >= c->cfg.max_procs) return;
    for (uint32_t s = 0; s < c->cfg.max_seqs; s++) {
        shmkv_seq_t *q = &c->seqs[s];
        if (q->state != SHMKV_SEQ_LIVE || q->owner != c->proc_token) continue;
        if (!shmkv_atomic_cas_u64(&q->writer, 0, c->proc_token)) {
            shmkv_recover_later_locked(c, SHMKV_PENDING_DEAD);   /* a later pass's */
            continue;
        }
        if (shmkv_seq_free_locked(c, s) != SHMKV_OK) {
            shmkv_seq_unlock(c, s);
            shmkv_recover_later_locked(c, SHMKV_PENDING_FULL);   /* a corrupt table */
        }
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
    } else {   /* the full pass returns them (the slot is released below either way) */
        shmkv_recover_later_locked(c, SHMKV_PENDING_FULL);
    }
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

#endif /* SHMKV_KERNELS_OPS_H */
