/*
 * kernels/events.h -- the KV event ring: what the prefix index did, in vLLM's terms
 * ("stored", "removed", "cleared"), for KV-aware routers.  Layout and the seqlock
 * protocol: _layout.h, "KV events".
 *
 * Writes: the event ring (head and records), under pool_lock; shmkv_prefix_reset_locked
 * also clears the hash index, the LRU list and block hash flags (the one index change
 * that exists only to be announced as "cleared").  Readers take no lock.
 *
 * Where events are written (every writer holds pool_lock):
 *   stored   shmkv_seq_publish_locked (prefix.h): a block's hash entered the index;
 *   removed  shmkv_blocks_alloc_locked (alloc.h): a CACHED block is reused for new data,
 *            its hash leaves the index; recovery (recover.h): a hash the rebuilt index
 *            could not take back (probe bound);
 *   cleared  shmkv_prefix_reset_locked (here): the whole index is dropped.
 * A removal is announced before it happens and a store after: a process killed between
 * the two leaves the events describing a subset of what the index holds, never a block
 * it does not.
 */
#ifndef SHMKV_KERNELS_EVENTS_H
#define SHMKV_KERNELS_EVENTS_H

static inline shmkv_event_ring_t *shmkv__ev_ring(const shmkv_ctx_t *c) {
    return (shmkv_event_ring_t *)c->events;
}
/* The record of seq (capacity + 1 slots).  Precondition: the ring is on. */
static inline shmkv_event_t *shmkv__ev_slot(const shmkv_ctx_t *c, uint64_t seq) {
    uint64_t nslots = (uint64_t)c->cfg.event_capacity + 1;
    return (shmkv_event_t *)(c->events + sizeof(shmkv_event_ring_t)
                             + (seq % nslots) * c->lay.event_record_bytes);
}

/* Appends one event.  Caller holds pool_lock (the only writers' lock: seq numbers are
 * dense and in pool_lock order).  hash/parent may be NULL; tokens has ntok ids
 * (ntok <= block_size, checked against the record size at layout time).  No-op when the
 * ring is off. */
static void shmkv_event_emit_locked(shmkv_ctx_t *c, uint32_t kind, const uint64_t *hash,
                                    const uint64_t *parent, uint32_t block,
                                    const int32_t *tokens, uint32_t ntok) {
    if (c->events == NULL) return;
    shmkv_event_ring_t *r = shmkv__ev_ring(c);
    uint64_t seq = r->head;                     /* ours alone: pool_lock */
    shmkv_event_t *e = shmkv__ev_slot(c, seq);
    /* the planted bug the chaos harness must catch: seq visible before the record */
    int torn = __builtin_expect(shmkv_dbg->plant == SHMKV_PLANT_TORN_EVENT, 0);
    if (torn) {
        __atomic_store_n(&e->stamp, seq + 1, __ATOMIC_RELEASE);
        __atomic_store_n(&r->head, seq + 1, __ATOMIC_RELEASE);
    } else {
        /* seqlock write: invalidate, then (release fence: the stamp's 0 is ordered
         * before every byte below) fill, then the stamp (release), then head (release) */
        __atomic_store_n(&e->stamp, 0, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_RELEASE);
    }
    if (ntok > c->cfg.block_size) ntok = c->cfg.block_size;
    e->kind = kind;
    e->num_tokens = ntok;
    e->hash[0] = hash ? hash[0] : 0;
    e->hash[1] = hash ? hash[1] : 0;
    e->parent[0] = parent ? parent[0] : 0;
    e->parent[1] = parent ? parent[1] : 0;
    e->flags = parent ? SHMKV_EVF_PARENT : 0;
    e->block = block;
    e->time_ns = (uint64_t)shmkv_now_ns(CLOCK_REALTIME);
    SHMKV_CRASH(EVENT_MID);                     /* header written, token ids not */
    if (ntok) memcpy((uint8_t *)e + sizeof(shmkv_event_t), tokens, (size_t)ntok * 4u);
    if (torn) return;
    __atomic_store_n(&e->stamp, seq + 1, __ATOMIC_RELEASE);
    __atomic_store_n(&r->head, seq + 1, __ATOMIC_RELEASE);
}

/* "stored": block b (hash h, token ids in the token table) entered the index; parent is
 * the previous block's hash in its sequence, NULL for a first block. */
static inline void shmkv_event_stored_locked(shmkv_ctx_t *c, uint32_t b, const uint64_t *h,
                                             const uint64_t *parent) {
    shmkv_event_emit_locked(c, SHMKV_EV_STORED, h, parent, b,
                            c->tokens + (uint64_t)b * c->cfg.block_size, c->cfg.block_size);
}
/* "removed": block b's hash h is about to leave the index. */
static inline void shmkv_event_removed_locked(shmkv_ctx_t *c, uint32_t b, const uint64_t *h) {
    shmkv_event_emit_locked(c, SHMKV_EV_REMOVED, h, NULL, b, NULL, 0);
}

/* Lock-free read of event `seq` into out (event_record_bytes).  Returns 1 if out holds
 * that event whole, 0 if it is not (or no longer) in the ring: overwritten, being
 * written, never written.  The caller checked seq < head it loaded (acquire).  Every
 * field of out is untrusted beyond its stamp (check kind and num_tokens). */
static inline int shmkv_event_read(const shmkv_ctx_t *c, uint64_t seq, uint8_t *out) {
    const shmkv_event_t *e = shmkv__ev_slot(c, seq);
    uint64_t s1 = __atomic_load_n(&e->stamp, __ATOMIC_ACQUIRE);
    if (s1 != seq + 1) return 0;
    memcpy(out, (const void *)e, c->lay.event_record_bytes);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);    /* the copy happens before the re-check */
    uint64_t s2 = __atomic_load_n(&e->stamp, __ATOMIC_RELAXED);
    return s2 == seq + 1;
}

/* The next seq (= events written so far); 0 when the ring is off. */
static inline uint64_t shmkv_event_head(const shmkv_ctx_t *c) {
    if (c->events == NULL) return 0;
    return __atomic_load_n(&shmkv__ev_ring(c)->head, __ATOMIC_ACQUIRE);
}

/* The invariant check() and the chaos audit rely on, with pool_lock held (no writer is
 * between its two stores): every event of the window [head - capacity, head) carries its
 * own stamp and a known kind; a stored event carries block_size ids.  Returns the number
 * of bad events; *first_bad gets the first. */
static inline uint64_t shmkv_events_check_locked(const shmkv_ctx_t *c, uint64_t *first_bad) {
    if (c->events == NULL) return 0;
    uint64_t head = shmkv_event_head(c), cap = c->cfg.event_capacity;
    uint64_t lo = head > cap ? head - cap : 0, bad = 0;
    for (uint64_t s = lo; s < head; s++) {
        const shmkv_event_t *e = shmkv__ev_slot(c, s);
        int ok = e->stamp == s + 1 && e->kind >= SHMKV_EV_STORED && e->kind <= SHMKV_EV_CLEARED
            && e->num_tokens == (e->kind == SHMKV_EV_STORED ? c->cfg.block_size : 0);
        if (!ok && bad++ == 0 && first_bad) *first_bad = s;
    }
    return bad;
}

/* Drops every hash from the prefix index (vLLM's reset_prefix_cache): CACHED blocks go
 * back on the free stack, blocks in use stay with their sequences but are no longer
 * findable; one "cleared" event, written first.  Caller holds pool_lock.  A death at
 * any line leaves flags, lists and index that recovery rebuilds (it derives them all
 * from the blocks' hash flags and the tables).  Returns the number of hashes dropped. */
static inline uint64_t shmkv_prefix_reset_locked(shmkv_ctx_t *c) {
    shmkv_shared_t *sh = c->sh;
    const uint32_t NB = c->cfg.num_blocks;
    shmkv_event_emit_locked(c, SHMKV_EV_CLEARED, NULL, NULL, SHMKV_NIL, NULL, 0);
    /* the LRU list's blocks become free blocks (walk bounded; a corrupt list stops) */
    uint32_t b = sh->lru_head;
    for (uint32_t k = 0; b < NB && k < NB && sh->free_top < NB; k++) {
        shmkv_block_t *m = &c->blocks[b];
        uint32_t next = m->lru_next;
        m->lru_prev = m->lru_next = SHMKV_NIL;
        m->flags &= ~(uint32_t)SHMKV_BLOCK_HASHED;
        c->free_stack[sh->free_top++] = b;
        if (k == 0) SHMKV_CRASH(RESET_MID);
        b = next;
    }
    sh->lru_head = sh->lru_tail = SHMKV_NIL;
    sh->cached_count = 0;
    uint64_t dropped = sh->index_used;
    memset(c->index, 0, c->lay.index_capacity * sizeof(shmkv_index_t));
    sh->index_used = sh->index_tombs = 0;
    for (uint32_t i = 0; i < NB; i++)
        c->blocks[i].flags &= ~(uint32_t)SHMKV_BLOCK_HASHED;
    return dropped;
}

#endif /* SHMKV_KERNELS_EVENTS_H */
