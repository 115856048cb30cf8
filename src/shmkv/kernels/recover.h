/*
 * kernels/recover.h -- the recovery pass: dead processes' work reclaimed, every derived
 * structure rebuilt from the tables.  Writes: process table, journals, and whatever
 * recovery must put back.  A coordinator: it runs over the primitives below it (with
 * every process cache quiesced) and is called from ops.h, never from a primitive.
 */
#ifndef SHMKV_KERNELS_RECOVER_H
#define SHMKV_KERNELS_RECOVER_H

/* ---- recovery ----------------------------------------------------------------------------- */
/* Is any attached process dead?  O(max_procs) slot reads and one liveness probe (an OFD
 * lock query) per attached process, no writes.  Needs no lock (atomic loads; a slot
 * changing under it gives at worst a needless pass): the cheap test in front of every
 * recovery that is not a repair -- before CacheFullError, and the gate of a scheduled
 * pass (shmkv_recover_needed). */
static int shmkv_any_dead_locked(shmkv_ctx_t *c) {
    for (uint32_t s = 0; s < c->cfg.max_procs; s++) {
        shmkv_proc_t *p = &c->procs[s];
        uint32_t st = shmkv_atomic_load_u32(&p->state);
        if (st == SHMKV_PROC_FREE) continue;
        uint64_t tok = ((uint64_t)shmkv_atomic_load_u32(&p->gen) << 32) | (uint64_t)(s + 1);
        if (st != SHMKV_PROC_ACTIVE || !shmkv_proc_alive(c, tok)) return 1;
    }
    return 0;
}

/* What a pass left for a later one (shmkv_shared_t.recover_pending): nothing; a dead
 * owner's sequence a live process held locked (the pass of what died takes it); what
 * only the full pass puts back (a leaver's cache it could not lock, a corrupt table). */
enum { SHMKV_PENDING_NONE = 0, SHMKV_PENDING_DEAD = 1, SHMKV_PENDING_FULL = 2 };
static inline void shmkv_recover_later_locked(shmkv_ctx_t *c, uint32_t what) {
    if (shmkv_atomic_load_u32(&c->sh->recover_pending) < what)
        shmkv_atomic_store_u32(&c->sh->recover_pending, what);
}

/* Has a recovery pass anything to do?  A dead process, or work an earlier pass or a
 * leaver had to leave (recover_pending).  No lock, no writes, never O(pool): what a
 * scheduled pass checks before it takes any lock. */
static int shmkv_recover_needed(shmkv_ctx_t *c) {
    return shmkv_atomic_load_u32(&c->sh->recover_pending) != 0 || shmkv_any_dead_locked(c);
}

/* The end of a recovery pass (either kind, the pool lock still held): its duration in
 * `r` and in the segment's figures (last, max), the counters.  SHMKV_OK. */
static int shmkv__recovery_done(shmkv_ctx_t *c, shmkv_recovery_t *r, int64_t t0) {
    shmkv_shared_t *sh = c->sh;
    r->duration_ns = (uint64_t)(shmkv_now_ns(CLOCK_MONOTONIC) - t0);
    sh->last_recovery_ns = r->duration_ns;
    if (r->duration_ns > sh->max_recovery_ns) sh->max_recovery_ns = r->duration_ns;
    shmkv_count(c, SHMKV_C_RECOVERIES, 1);
    shmkv_count(c, SHMKV_C_RECLAIMED_SEQS, r->sequences);
    shmkv_count(c, SHMKV_C_RECLAIMED_BLOCKS, r->blocks);
    return SHMKV_OK;
}

/* THE FULL PASS.  Rebuilds every piece of derived state from the truth (the LIVE sequences' tables and
 * the in-flight records of live processes):
 *   1. process slots whose holder is dead are released;
 *   2. sequence slots half-built by a dead holder of the pool lock are released; a
 *      sequence lock held by a dead process is cleared; sequences whose owner is dead
 *      (and not detached) are freed; unpublished tail blocks of idle sequences are
 *      trimmed; a sequence whose table is corrupt is dropped;
 *   3. every ref_cnt is recounted; the free stack, the LRU list of cached blocks, the
 *      hash index, the sequence free stack and the counts are rebuilt.
 * A sequence whose lock a live process holds is left alone (its holder is using it);
 * the next pass gets it (recover_pending says so).  Runs under the pool lock;
 * O(num_blocks + table entries).  The repair: it trusts no refcount and no list, so it
 * is what runs after a death inside a critical section (the pool lock EOWNERDEAD, a
 * process cache lock taken over) and what recover(full=True) and attach run;
 * shmkv_recover_dead_locked below is the pass of what died. */
static int shmkv_recover_locked(shmkv_ctx_t *c, shmkv_recovery_t *r) {
    int64_t t0 = shmkv_now_ns(CLOCK_MONOTONIC);
    memset(r, 0, sizeof *r);
    if (__builtin_expect(shmkv_dbg->plant == SHMKV_PLANT_NO_RECOVERY, 0)) return SHMKV_OK;
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

    uint32_t nprocs = 0, left = SHMKV_PENDING_NONE;
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
        if (!shmkv_atomic_cas_u64(&q->writer, 0, me)) {           /* a live holder is busy */
            if (q->owner != 0 && !shmkv_proc_alive(c, q->owner))
                left = SHMKV_PENDING_DEAD;          /* the next pass's */
            continue;
        }
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
        if (!shmkv_index_insert_locked(c, h, b))   /* no room in its probe window: the */
            shmkv_event_removed_locked(c, b, h);   /* hash is gone, tell the routers */
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
    shmkv_atomic_store_u32(&sh->recover_pending, left);
    shmkv_unquiesce_locked(c);

    r->full = 1;
    r->blocks_visited = NB;
    return shmkv__recovery_done(c, r, t0);
}

/* ---- the pass of what died ------------------------------------------------------------------ */
/* Is the holder behind `tok` dead?  From the process table and dead[] (one liveness
 * probe per slot, made once by the caller): no system call per sequence.  A token whose
 * slot was released or retaken since is dead; 0 is nobody (not dead). */
static inline int shmkv__tok_dead(const shmkv_ctx_t *c, const uint8_t *dead, uint64_t tok) {
    if (tok == 0 || tok == c->proc_token) return 0;
    uint32_t s = shmkv_token_slot(tok);
    if (s >= c->cfg.max_procs) return 1;
    const shmkv_proc_t *p = &c->procs[s];
    if (shmkv_atomic_load_u32(&p->state) != SHMKV_PROC_ACTIVE) return 1;
    if (shmkv_atomic_load_u32(&p->gen) != shmkv_token_gen(tok)) return 1;
    return dead[s];
}

/* One reference dropped by the pass of what died, never trusting the segment: a
 * refcount already 0, or a free stack with no room, is ECORRUPT (before any change), and
 * the caller hands the segment to the full pass. */
static int shmkv__reclaim_decref_locked(shmkv_ctx_t *c, uint32_t b, uint64_t *freed) {
    shmkv_block_t *m = &c->blocks[b];
    uint32_t rc = shmkv_atomic_load_u32(&m->ref_cnt);
    if (rc == 0) return SHMKV_ECORRUPT;
    if (rc == 1) {
        if (!(m->flags & SHMKV_BLOCK_HASHED) && c->sh->free_top >= c->cfg.num_blocks)
            return SHMKV_ECORRUPT;
        if ((m->flags & SHMKV_BLOCK_HASHED) && c->sh->cached_count >= c->cfg.num_blocks)
            return SHMKV_ECORRUPT;
        (*freed)++;
    }
    shmkv_block_decref_locked(c, b);
    return SHMKV_OK;
}

/* THE PASS OF WHAT DIED: reclaims what dead processes left in O(max_procs + max_seqs +
 * their table entries), with no pool-sized allocation or walk, and no pass at all when
 * nothing is dead and nothing was left pending (the pool is not touched).  Precondition:
 * the pool lock, taken normally (a dead holder of the pool lock is the full pass's:
 * shmkv_pool_lock runs it before returning).
 *
 * Why the refcounts can be trusted here: every change to a table, a refcount or a shared
 * list happens under the pool lock, or under the changer's own cache lock (the fast
 * paths of pcache.h).  The pool lock is ours and came back clean; quiescing takes every
 * cache lock.  So unless a cache lock was held by a dead process, no death is inside a
 * change, and what a dead process leaves is whole: its sequences (each table entry one
 * reference), the sequences it held locked (len published or not: a tail past len is
 * unpublished), its in-flight records (one reference each) and its cache.  Reclaiming
 * them is their decrefs, exactly what free() and truncate() do.
 *
 * Falls back to the full pass (shmkv_recover_locked), reported with full = 1, when that
 * argument does not hold or the segment contradicts itself:
 *   - a process cache lock held by a dead process (it died inside a fast path);
 *   - a sequence slot neither FREE nor LIVE, or one with an open trim journal (only a
 *     dead pool-lock holder leaves those; the EOWNERDEAD path normally ran first);
 *   - a process slot neither FREE nor ACTIVE;
 *   - a dead process's (or dead-held) sequence whose table does not validate, a block
 *     whose refcount is already 0, a free stack with no room.
 * A sequence whose lock a live process holds is left for the next pass (recover_pending).
 */
static int shmkv_recover_dead_locked(shmkv_ctx_t *c, shmkv_recovery_t *r) {
    int64_t t0 = shmkv_now_ns(CLOCK_MONOTONIC);
    memset(r, 0, sizeof *r);
    if (__builtin_expect(shmkv_dbg->plant == SHMKV_PLANT_NO_RECOVERY, 0)) return SHMKV_OK;
    shmkv_shared_t *sh = c->sh;
    const uint32_t NB = c->cfg.num_blocks, NS = c->cfg.max_seqs, NP = c->cfg.max_procs;
    int qst = shmkv_quiesce_locked(c);
    if (qst == SHMKV_EDEADHOLDER) {       /* a death inside a fast path: repair it all */
        shmkv_unquiesce_locked(c);
        return shmkv_recover_locked(c, r);
    }
    if (qst != SHMKV_OK) return qst;

    uint8_t dead[SHMKV_MAX_PROCS];        /* NP <= SHMKV_MAX_PROCS (validated at bind) */
    uint32_t ndead = 0, pending = shmkv_atomic_load_u32(&sh->recover_pending);
    int full = pending > SHMKV_PENDING_DEAD;  /* left for the full pass (or garbage) */
    for (uint32_t s = 0; s < NP && !full; s++) {
        shmkv_proc_t *p = &c->procs[s];
        dead[s] = 0;
        if (p->state == SHMKV_PROC_FREE) continue;
        if (p->state != SHMKV_PROC_ACTIVE) { full = 1; break; }
        uint64_t tok = ((uint64_t)p->gen << 32) | (uint64_t)(s + 1);
        if (!shmkv_proc_alive(c, tok)) { dead[s] = 1; ndead++; }
    }
    if (!full && ndead == 0 && pending == SHMKV_PENDING_NONE) {
        shmkv_unquiesce_locked(c);        /* nothing died: no pass */
        return SHMKV_OK;
    }

    /* 1. read only: may this pass run?  (the fallbacks above, before any change) */
    for (uint32_t s = 0; s < NS && !full; s++) {
        shmkv_seq_t *q = &c->seqs[s];
        uint32_t st = shmkv_atomic_load_u32(&q->state);
        if (st == SHMKV_SEQ_FREE) continue;
        if (st != SHMKV_SEQ_LIVE || q->trim_d != 0) { full = 1; break; }
        if (!shmkv__tok_dead(c, dead, shmkv_atomic_load_u64(&q->writer))
                && !shmkv__tok_dead(c, dead, q->owner)) continue;
        if (shmkv_seq_valid(c, s) != SHMKV_OK) full = 1;   /* the table is stable: the
                                     pool lock and every cache lock are ours */
    }
    if (full) {
        shmkv_unquiesce_locked(c);
        return shmkv_recover_locked(c, r);
    }

    /* 2. the sequences: a dead owner's are freed, a dead holder's lock is released and
     * its unpublished tail dropped */
    uint64_t me = c->proc_token ? c->proc_token : 1, freed = 0;
    uint32_t left = SHMKV_PENDING_NONE;
    int st = SHMKV_OK;
    for (uint32_t s = 0; s < NS && st == SHMKV_OK; s++) {
        shmkv_seq_t *q = &c->seqs[s];
        if (shmkv_atomic_load_u32(&q->state) != SHMKV_SEQ_LIVE) continue;
        uint64_t w = shmkv_atomic_load_u64(&q->writer);
        int wd = shmkv__tok_dead(c, dead, w), od = shmkv__tok_dead(c, dead, q->owner);
        if (!wd && !od) continue;
        if (wd && shmkv_atomic_cas_u64(&q->writer, w, 0)) r->locks++;
        if (!shmkv_atomic_cas_u64(&q->writer, 0, me)) {
            if (od) left = SHMKV_PENDING_DEAD;   /* a live holder is busy: the next pass */
            continue;
        }
        if (shmkv_seq_valid(c, s) != SHMKV_OK) st = SHMKV_ECORRUPT;   /* cannot be (step
                                     1 checked it, nothing changed it): the full pass */
        int32_t *t = shmkv_table(c, s);
        uint32_t nb = q->nblocks;
        if (st == SHMKV_OK && od && sh->seq_free_top >= NS) st = SHMKV_ECORRUPT;
        if (st != SHMKV_OK) {
            shmkv_atomic_store_u64_release(&q->writer, 0);
            break;
        }
        if (od) {
            shmkv_atomic_store_u32(&q->state, SHMKV_SEQ_FREE);   /* as free(): first */
            for (uint32_t i = nb; i-- > 0 && st == SHMKV_OK;) {     /* tail first */
                r->blocks_visited++;
                st = shmkv__reclaim_decref_locked(c, (uint32_t)t[i], &freed);
            }
            if (st != SHMKV_OK) {         /* FREE already: the full pass recounts it */
                shmkv_atomic_store_u64_release(&q->writer, 0);
                break;
            }
            q->nblocks = 0;
            shmkv_atomic_store_u32_release(&q->len, 0);
            q->hashed = q->hash_ready = 0;
            q->owner = 0;
            c->seq_free[sh->seq_free_top++] = s;
            r->sequences++;
        } else {
            uint32_t len = shmkv_atomic_load_u32(&q->len);
            uint32_t want = shmkv_blocks_for(c, len);       /* <= nb: validated */
            for (uint32_t i = nb; i-- > want && st == SHMKV_OK;) {
                r->blocks_visited++;
                st = shmkv__reclaim_decref_locked(c, (uint32_t)t[i], &freed);
                if (st == SHMKV_OK) { shmkv_atomic_store_u32(&q->nblocks, i); r->tails++; }
            }
            if (st != SHMKV_OK) {
                shmkv_atomic_store_u64_release(&q->writer, 0);
                break;
            }
            uint32_t whole = len / c->cfg.block_size;
            if (q->hash_ready > whole) q->hash_ready = whole;
            if (q->hashed > q->hash_ready) q->hashed = q->hash_ready;
        }
        shmkv_atomic_store_u64_release(&q->writer, 0);
    }
    SHMKV_CRASH(RECOVER_MID);

    /* 3. the dead processes' slots: in-flight references dropped, cache spilled back,
     * counters folded, the slot released */
    for (uint32_t s = 0; s < NP && st == SHMKV_OK; s++) {
        if (!dead[s]) continue;
        shmkv_proc_t *p = &c->procs[s];
        for (uint32_t j = 0; j < SHMKV_INFLIGHT_PER_PROC && st == SHMKV_OK; j++) {
            uint32_t b = p->inflight[j];
            if (b == SHMKV_NIL) continue;
            if (b >= NB) { st = SHMKV_ECORRUPT; break; }
            r->blocks_visited++;
            st = shmkv__reclaim_decref_locked(c, b, &freed);
            if (st == SHMKV_OK) p->inflight[j] = SHMKV_NIL;
        }
        if (st != SHMKV_OK) break;
        /* every entry must be what a cache holds, or the full pass recounts it */
        uint32_t nb = p->cache_nblocks, ns = p->cache_nseqs;
        if (nb > SHMKV_PCACHE_BLOCKS || ns > SHMKV_PCACHE_SEQS
                || (uint64_t)sh->free_top + nb > NB || (uint64_t)sh->seq_free_top + ns > NS) {
            st = SHMKV_ECORRUPT;
            break;
        }
        for (uint32_t i = 0; i < nb && st == SHMKV_OK; i++)
            if (!shmkv__cacheable(c, p->cache_blocks[i])) st = SHMKV_ECORRUPT;
        for (uint32_t i = 0; i < ns && st == SHMKV_OK; i++)
            if (p->cache_seqs[i] >= NS || c->seqs[p->cache_seqs[i]].state != SHMKV_SEQ_FREE)
                st = SHMKV_ECORRUPT;
        if (st != SHMKV_OK) break;
        shmkv__pcache_spill_locked(c, p, 0, 0);      /* its cache_lock is ours (quiesce) */
        shmkv__fold_proc_counters(c, p);
        shmkv_atomic_store_u64(&p->cache_lock, 0);
        shmkv_atomic_store_u32(&p->state, SHMKV_PROC_FREE);
        r->processes++;
    }
    if (st != SHMKV_OK) {
        /* the segment contradicts itself: what this pass did is consistent with the
         * tables (each step is one free()/truncate()), so the full pass takes over */
        shmkv_recovery_t part = *r;
        shmkv_unquiesce_locked(c);
        st = shmkv_recover_locked(c, r);
        r->processes += part.processes;
        r->sequences += part.sequences;
        r->locks += part.locks;
        r->tails += part.tails;
        r->blocks += freed;
        r->blocks_visited += part.blocks_visited;
        return st;
    }
    uint32_t nprocs = 0;
    for (uint32_t s = 0; s < NP; s++) nprocs += c->procs[s].state == SHMKV_PROC_ACTIVE;
    sh->num_procs = nprocs;
    r->blocks = freed;
    shmkv_atomic_store_u32(&sh->recover_pending, left);
    shmkv__note_peak(c);
    shmkv_unquiesce_locked(c);

    return shmkv__recovery_done(c, r, t0);
}

#endif /* SHMKV_KERNELS_RECOVER_H */
