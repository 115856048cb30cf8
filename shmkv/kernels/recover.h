/*
 * kernels/recover.h -- the recovery pass: dead processes' work reclaimed, every derived
 * structure rebuilt from the tables.  Writes: process table, journals, and whatever
 * recovery must put back.  A coordinator: it runs over the primitives below it (with
 * every process cache quiesced) and is called from ops.h, never from a primitive.
 */
#ifndef SHMKV_KERNELS_RECOVER_H
#define SHMKV_KERNELS_RECOVER_H

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
    shmkv_unquiesce_locked(c);

    r->duration_ns = (uint64_t)(shmkv_now_ns(CLOCK_MONOTONIC) - t0);
    sh->last_recovery_ns = r->duration_ns;
    if (r->duration_ns > sh->max_recovery_ns) sh->max_recovery_ns = r->duration_ns;
    shmkv_count(c, SHMKV_C_RECOVERIES, 1);
    shmkv_count(c, SHMKV_C_RECLAIMED_SEQS, r->sequences);
    shmkv_count(c, SHMKV_C_RECLAIMED_BLOCKS, r->blocks);
    return SHMKV_OK;
}

#endif /* SHMKV_KERNELS_RECOVER_H */
