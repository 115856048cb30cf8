/*
 * kernels/alloc.h -- blocks (block_ok, block tables, claim/alloc/decref), the LRU of cached
 * blocks and the block-hash index.  Writes: free stack, block refcounts, LRU links,
 * index slots, pool counters, a "removed" KV event per cached block reused.  Every
 * function here runs under the pool lock.
 */
#ifndef SHMKV_KERNELS_ALLOC_H
#define SHMKV_KERNELS_ALLOC_H

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
            if (c->blocks[b].flags & SHMKV_BLOCK_HASHED)   /* announced before it goes */
                shmkv_event_removed_locked(c, b, c->blocks[b].hash);
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
    } else if (c->sh->free_top < c->cfg.num_blocks) {
        c->free_stack[c->sh->free_top++] = b;
    }   /* else a free stack already full: the segment contradicts itself (free_top is
         * read from it); the block is not pushed past the stack, and the next full
         * recovery pass, which recounts every reference, frees it */
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

#endif /* SHMKV_KERNELS_ALLOC_H */
