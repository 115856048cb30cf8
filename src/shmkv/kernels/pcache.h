/*
 * kernels/pcache.h -- the per-process block and slot caches (a sequence's life without the pool lock).
 * Writes: this process's cache entries, and the pool's free stacks when a cache is
 * spilled (under the pool lock); quiesce state.  A primitive: a cache lock taken over
 * from a dead holder is reported (EDEADHOLDER), never repaired here -- the cache's
 * slow paths that recover (balance, drain before CacheFull) are ops.h's.
 */
#ifndef SHMKV_KERNELS_PCACHE_H
#define SHMKV_KERNELS_PCACHE_H

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
 * shmkv_pcache_lock_recover_locked (ops.h). */
static int shmkv_pcache_lock_locked(shmkv_ctx_t *c, shmkv_proc_t *p) {
    if (shmkv_pcache_trylock(c, p)) return SHMKV_OK;
    uint64_t me = c->proc_token ? c->proc_token : 1;
    uint32_t slot = (uint32_t)(p - c->procs);
    uint64_t owner = ((uint64_t)shmkv_atomic_load_u32(&p->gen) << 32) | (uint64_t)(slot + 1);
    int64_t t0 = shmkv_now_ns(CLOCK_MONOTONIC);
    long sleep_ns = 1000;
    for (unsigned spin = 1;; spin++) {
        uint64_t holder = shmkv_atomic_load_u64(&p->cache_lock);
        if (holder == 0) {
            if (shmkv_pcache_trylock(c, p)) return SHMKV_OK;
            continue;
        }
        /* not the owner (nor the owner's own thread when p is ours): a dead pool-lock
         * holder's leftover.  The owner: dead, or alive and about to let go. */
        int probe = (spin & 255) == 0 || spin >= 1024;      /* sleeping: every round */
        int stale = (holder != owner) || (probe && holder != me
                                          && !shmkv_proc_alive(c, holder));
        if (stale && shmkv_atomic_cas_u64(&p->cache_lock, holder, me))
            return SHMKV_EDEADHOLDER;
        /* spin, yield, then sleep (1 us doubling to 1 ms): an owner that is alive but not
         * running (stopped: Ctrl-Z, a debugger, `docker pause`) is waited for without
         * burning a core, and never past the bound (CLOCK_MONOTONIC) */
        if (spin < 256) SHMKV_PAUSE();
        else if (spin < 1024) sched_yield();
        else {
            struct timespec ts = { 0, sleep_ns };
            nanosleep(&ts, NULL);
            if (sleep_ns < 1000000) sleep_ns *= 2;
        }
        if (probe && shmkv_now_ns(CLOCK_MONOTONIC) - t0 > c->timeout_ns)
            return SHMKV_ETIMEDOUT;
    }
}

/* Is cache entry b a block that may sit in a cache (free, unhashed)? */
static inline int shmkv__cacheable(const shmkv_ctx_t *c, uint32_t b) {
    return b < c->cfg.num_blocks && shmkv_atomic_load_u32(&c->blocks[b].ref_cnt) == 0
        && !(c->blocks[b].flags & SHMKV_BLOCK_HASHED);
}

/* create_sequence() from our cache.  OK, EAGAIN (cache busy or empty: take the slow
 * path) or ECORRUPT. */
static inline int shmkv_pcache_create(shmkv_ctx_t *c, uint32_t priority, int64_t *sid_out) {
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
static inline int shmkv_pcache_grow(shmkv_ctx_t *c, uint32_t slot, const shmkv_grow_plan_t *pl) {
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
static inline int shmkv_pcache_free(shmkv_ctx_t *c, uint32_t slot) {
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
    if (__builtin_expect(shmkv_dbg->plant == SHMKV_PLANT_LEAK_ON_FREE, 0) && nb > 0) nb--;
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

/* truncate() into our cache: when every block past the kept ones is exclusive (ref_cnt
 * 1), unhashed and listed once, and the cache has room -- free()'s fast path, for a
 * table's tail (the same reasons make it safe without the pool lock).  No block dropped
 * (a cut inside the last block) takes this path too: only our cache_lock, which keeps
 * recovery and check() out while the table and the hashing state change.  Caller holds
 * the sequence lock.  OK, EAGAIN (slow path) or an error; nothing changed unless OK. */
static inline int shmkv_pcache_truncate(shmkv_ctx_t *c, uint32_t slot, uint32_t n) {
    shmkv_proc_t *p = shmkv_me(c);
    if (p == NULL) return SHMKV_EAGAIN;
    uint32_t keep;
    int st = shmkv__truncate_check(c, slot, n, &keep);
    if (st != SHMKV_OK) return st;
    uint32_t nb = c->seqs[slot].nblocks;
    if (nb - keep > SHMKV_PCACHE_BLOCKS) return SHMKV_EAGAIN;
    if (!shmkv_pcache_trylock(c, p)) return SHMKV_EAGAIN;
    const int32_t *t = shmkv_table(c, slot);
    uint32_t have = p->cache_nblocks;
    if (have > SHMKV_PCACHE_BLOCKS) st = SHMKV_ECORRUPT;
    else if (nb - keep > SHMKV_PCACHE_BLOCKS - have) st = SHMKV_EAGAIN;
    for (uint32_t i = keep; i < nb && st == SHMKV_OK; i++) {
        shmkv_block_t *m = &c->blocks[t[i]];
        if (shmkv_atomic_load_u32(&m->ref_cnt) != 1 || (m->flags & SHMKV_BLOCK_HASHED))
            st = SHMKV_EAGAIN;
        for (uint32_t j = 0; j < nb && st == SHMKV_OK; j++)
            if (j != i && t[j] == t[i]) st = SHMKV_ECORRUPT;  /* ref_cnt 1, listed twice */
    }
    if (st != SHMKV_OK) { shmkv_pcache_unlock(p); return st; }
    shmkv__truncate_publish(c, slot, n, keep, shmkv__truncate_cow_tail(c, slot, n));
    for (uint32_t i = nb; i-- > keep;) {          /* tail first, as the slow path */
        if (i == keep + (nb - keep) / 2) SHMKV_CRASH(TRUNCATE_MID);
        uint32_t b = (uint32_t)t[i];
        shmkv_atomic_store_u32(&c->blocks[b].ref_cnt, 0);
        p->cache_blocks[have++] = b;
        p->cache_nblocks = have;
    }
    shmkv_count_hot(c, SHMKV_PC_FREES, nb - keep);
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

#endif /* SHMKV_KERNELS_PCACHE_H */
