/*
 * kernels/seq.h -- sequences: create, free, fork, block tables, growing a sequence.
 * Writes: seq slots, their block tables, block refcounts (through alloc.h).
 */
#ifndef SHMKV_KERNELS_SEQ_H
#define SHMKV_KERNELS_SEQ_H

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
    if (__builtin_expect(shmkv_dbg->plant == SHMKV_PLANT_LEAK_ON_FREE, 0) && nb > 0) nb--;
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
    if (c->sh->seq_free_top < c->cfg.max_seqs)   /* (read from the segment: never past
                                                     the stack; recovery recounts it) */
        c->seq_free[c->sh->seq_free_top++] = slot;
    shmkv_atomic_store_u64_release(&q->writer, 0);
    shmkv_count_hot(c, SHMKV_PC_SEQS_FREED, 1);
    return SHMKV_OK;
}

/* A child shares every block that holds the parent's published tokens (ref_cnt++).
 * Caller holds the pool lock and the parent's sequence lock (the parent's free may run
 * on its owner's fast path, which takes no pool lock). */
static inline int shmkv_seq_fork_locked(shmkv_ctx_t *c, int64_t parent, int64_t *child_out) {
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

/* ---- truncate: keep the first n tokens, in place -------------------------------------------- */
/* The checks of a truncate, before anything changes: a valid table, no trim journal open
 * (a dead trimmer's is finished by recovery first), n <= len.  *keep = the blocks that
 * hold [0, n).  Caller holds the sequence lock. */
static int shmkv__truncate_check(const shmkv_ctx_t *c, uint32_t slot, uint32_t n,
                                 uint32_t *keep) {
    const shmkv_seq_t *q = &c->seqs[slot];
    int st = shmkv_seq_valid(c, slot);
    if (st != SHMKV_OK) return st;
    if (q->trim_d != 0) return SHMKV_ECORRUPT;
    if (n > q->len) return SHMKV_EINVAL;
    *keep = shmkv_blocks_for(c, n);
    return SHMKV_OK;
}

/* Must the next write into the kept partial block copy it first?  Yes when somebody
 * else holds it (ref_cnt > 1: a fork or a prefix hit that may have it whole) or can find
 * it (hashed): the bytes past n in it are part of a block others read.  Caller holds the
 * sequence lock and the pool lock or its own cache_lock (recovery, which rebuilds the
 * hashed flags, is then excluded).  Only truncate makes a block partial in one table
 * while it is whole elsewhere, so this is the one place that has to ask. */
static int shmkv__truncate_cow_tail(const shmkv_ctx_t *c, uint32_t slot, uint32_t n) {
    if (n % c->cfg.block_size == 0) return 0;
    uint32_t b = (uint32_t)shmkv_table(c, slot)[n / c->cfg.block_size];  /* validated */
    return shmkv_atomic_load_u32(&c->blocks[b].ref_cnt) > 1
        || (c->blocks[b].flags & SHMKV_BLOCK_HASHED);
}

/* Publishes a truncate to n tokens (keep = blocks_for(n)): marks that make the sequence
 * more careful first, then the length (store-release: THE publish; a death before it
 * leaves the old sequence, after it the new one, with [keep, nblocks) an unpublished
 * tail that recovery trims), then nblocks, then marks that relax it.  The dropped
 * entries stay in the table past nblocks for the caller to release.  Hashing state
 * follows n: the whole kept blocks keep their hashes (published or computed), the
 * partial one is no longer hashed by this sequence (it is rehashed when refilled; if it
 * is in the index it stays there, whole, for others: see SHMKV_SEQF_COW_TAIL).  A
 * sequence whose token ids were not all known becomes tracked again when every kept
 * token lies in blocks it hashed and trim_streaming never renumbered it.  Caller holds
 * the sequence lock and the pool lock or its own cache_lock. */
static void shmkv__truncate_publish(shmkv_ctx_t *c, uint32_t slot, uint32_t n,
                                    uint32_t keep, int cow_tail) {
    shmkv_seq_t *q = &c->seqs[slot];
    uint32_t full = n / c->cfg.block_size;
    if (cow_tail) q->flags |= SHMKV_SEQF_COW_TAIL;
    if (q->hash_ready > full) q->hash_ready = full;
    if (q->hashed > q->hash_ready) q->hashed = q->hash_ready;
    shmkv_atomic_store_u32_release(&q->len, n);              /* publish */
    shmkv_atomic_store_u32(&q->nblocks, keep);
    if (!cow_tail) q->flags &= ~(uint32_t)SHMKV_SEQF_COW_TAIL;
    if ((q->flags & SHMKV_SEQF_UNTRACKED) && q->trimmed == 0
            && (uint64_t)n <= (uint64_t)q->hash_ready * c->cfg.block_size)
        q->flags &= ~(uint32_t)SHMKV_SEQF_UNTRACKED;
}

/* Truncates a sequence to its first n tokens, releasing the blocks past them: a shared
 * block is only decref'd, one reaching 0 goes to the free stack or, hashed, stays
 * findable on the LRU list (as free() leaves them; no KV event: nothing leaves the
 * index).  Caller holds the sequence lock and the pool lock.  All-or-nothing: every
 * check comes before the first store -- including the two a corrupt segment could
 * turn into damage: a refcount of 0 under a table entry, a free stack with no room. */
static inline int shmkv_seq_truncate_locked(shmkv_ctx_t *c, uint32_t slot, uint32_t n) {
    uint32_t keep;
    int st = shmkv__truncate_check(c, slot, n, &keep);
    if (st != SHMKV_OK) return st;
    uint32_t nb = c->seqs[slot].nblocks;
    const int32_t *t = shmkv_table(c, slot);
    if ((uint64_t)c->sh->free_top + (nb - keep) > c->cfg.num_blocks) return SHMKV_ECORRUPT;
    for (uint32_t i = keep; i < nb; i++)
        if (shmkv_atomic_load_u32(&c->blocks[t[i]].ref_cnt) == 0) return SHMKV_ECORRUPT;
    shmkv__truncate_publish(c, slot, n, keep, shmkv__truncate_cow_tail(c, slot, n));
    for (uint32_t i = nb; i-- > keep;) {          /* tail first, as free() */
        if (i == keep + (nb - keep) / 2) SHMKV_CRASH(TRUNCATE_MID);
        shmkv_block_decref_locked(c, (uint32_t)t[i]);
    }
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
static inline int shmkv_seq_plan(shmkv_ctx_t *c, uint32_t slot, uint64_t n, shmkv_grow_plan_t *pl) {
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
        /* shared, or kept partially by truncate from a block others hold or find whole */
        if ((shmkv_atomic_load_u32(&c->blocks[b].ref_cnt) > 1
                || (q->flags & SHMKV_SEQF_COW_TAIL))
                && __builtin_expect(shmkv_dbg->plant != SHMKV_PLANT_NO_COW, 1)) {
            pl->cow = 1;
            pl->cow_index = bi;
        }
    }
    return SHMKV_OK;
}

/* Allocates what the plan needs: new tail blocks go straight into the table (beyond the
 * published length nobody reads them, and a death leaves them owned by the sequence);
 * a copy-on-write target is recorded in our process's in-flight list.  All-or-nothing. */
static inline int shmkv_seq_grow_locked(shmkv_ctx_t *c, uint32_t slot, shmkv_grow_plan_t *pl,
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

/* Copies the first `tokens` tokens of every layer's K and V (and their scales) from block
 * src to dst.
 * No lock: src is held by our table (we hold the sequence lock), dst by our in-flight
 * record. */
static inline void shmkv_block_copy(shmkv_ctx_t *c, uint32_t src, uint32_t dst, uint32_t tokens) {
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
    shmkv_scales_block_copy(c, src, dst, tokens);   /* int8 pools: a block carries its scales */
}

/* Puts the filled copy-on-write target in place of the shared block: one table store
 * publishes it, then the in-flight record and the old reference are dropped. */
static inline int shmkv_seq_cow_commit_locked(shmkv_ctx_t *c, uint32_t slot, uint32_t index,
                                       uint32_t target) {
    int32_t *t = shmkv_table(c, slot);
    int32_t old = t[index];
    if (!shmkv_block_ok(c, old) || !shmkv_block_ok(c, target)) return SHMKV_ECORRUPT;
    __atomic_store_n(&t[index], (int32_t)target, __ATOMIC_SEQ_CST);
    SHMKV_CRASH(COW_COMMIT_MID);
    c->seqs[slot].flags &= ~(uint32_t)SHMKV_SEQF_COW_TAIL;   /* the tail is ours now */
    shmkv_proc_t *p = &c->procs[c->proc_slot];
    for (uint32_t i = 0; i < SHMKV_INFLIGHT_PER_PROC; i++)
        if (p->inflight[i] == target) { p->inflight[i] = SHMKV_NIL; break; }
    shmkv_block_decref_locked(c, (uint32_t)old);
    shmkv_count(c, SHMKV_C_COW_COPIES, 1);
    return SHMKV_OK;
}

/* Gives back a copy-on-write target that was never committed (the copy was abandoned). */
static inline void shmkv_inflight_release_locked(shmkv_ctx_t *c, uint32_t target) {
    shmkv_proc_t *p = &c->procs[c->proc_slot];
    for (uint32_t i = 0; i < SHMKV_INFLIGHT_PER_PROC; i++)
        if (p->inflight[i] == target) {
            p->inflight[i] = SHMKV_NIL;
            shmkv_block_decref_locked(c, target);
            break;
        }
}

/* ---- batch block tables: the locked part of Segment.batch_block_tables ---------------- */

/* Pass 1: slot and length of every sid, and W, the longest table.  On failure *bad is
 * the sid at fault (ENOSEQ: not live; ECORRUPT: a length the table cannot hold). */
static inline int shmkv_batch_sizes_locked(const shmkv_ctx_t *c, const int64_t *sids, size_t n,
                                    uint32_t *slots, int32_t *lens, uint32_t *w_out,
                                    int64_t *bad) {
    uint32_t w = 0, sl;
    for (size_t i = 0; i < n; i++) {
        if (shmkv_sid_slot(c, sids[i], &sl) != SHMKV_OK) { *bad = sids[i]; return SHMKV_ENOSEQ; }
        uint32_t len = shmkv_atomic_load_u32_acquire(&c->seqs[sl].len);
        uint32_t nb = shmkv_blocks_for(c, len);
        if (nb > shmkv_atomic_load_u32_acquire(&c->seqs[sl].nblocks)) {
            /* a truncate on its owner's fast path (no pool lock) stores len, then
             * nblocks: a new nblocks read after an old len means the new len is there */
            len = shmkv_atomic_load_u32_acquire(&c->seqs[sl].len);
            nb = shmkv_blocks_for(c, len);
        }
        if (len > INT32_MAX || nb > c->seqs[sl].nblocks || nb > c->cfg.max_blocks_per_seq) {
            *bad = sids[i];
            return SHMKV_ECORRUPT;
        }
        slots[i] = sl;
        lens[i] = (int32_t)len;
        if (nb > w) w = nb;
    }
    *w_out = w;
    return SHMKV_OK;
}

/* Copies n block ids from a table in the segment; nonzero if any copied id is not below
 * `limit` (the check is on the values stored, so a concurrent writer cannot slip one by). */
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
static inline int shmkv__copy_ids(int32_t *dst, const int32_t *src, uint32_t n, uint32_t limit) {
    uint32_t j = 0, bad = 0;
#if defined(__SSE2__)
    const __m128i flip = _mm_set1_epi32(INT32_MIN);       /* unsigned compare via signed */
    const __m128i lim = _mm_set1_epi32((int32_t)(limit ^ 0x80000000u));
    __m128i ok = _mm_set1_epi32(-1);
    for (; j + 4 <= n; j += 4) {
        __m128i v = _mm_loadu_si128((const __m128i *)(src + j));
        _mm_storeu_si128((__m128i *)(dst + j), v);
        ok = _mm_and_si128(ok, _mm_cmpgt_epi32(lim, _mm_xor_si128(v, flip)));
    }
    bad = _mm_movemask_epi8(ok) != 0xFFFF;
#endif
    for (; j < n; j++) {
        uint32_t v = (uint32_t)src[j];
        dst[j] = (int32_t)v;
        bad |= v >= limit;
    }
    return bad != 0;
}

/* Pass 2: copy each table into out[n][w], padded with -1, and check every block id.  A
 * free on its owner's fast path takes no pool lock: an id still live after the copy was
 * live, its blocks unreused, while we copied, so the ids are checked again last. */
static inline int shmkv_batch_copy_locked(const shmkv_ctx_t *c, const int64_t *sids, size_t n,
                                   const uint32_t *slots, const int32_t *lens, uint32_t w,
                                   int32_t *out, int64_t *bad) {
    uint32_t sl, nblocks = c->cfg.num_blocks;
    for (size_t i = 0; i < n; i++) {
        uint32_t nb = shmkv_blocks_for(c, (uint32_t)lens[i]);
        int32_t *dst = out + i * (size_t)w;
        int bad_ids = shmkv__copy_ids(dst, shmkv_table(c, slots[i]), nb, nblocks);
        for (uint32_t j = nb; j < w; j++) dst[j] = -1;
        if (bad_ids) { *bad = sids[i]; return SHMKV_ECORRUPT; }
    }
    for (size_t i = 0; i < n; i++)
        if (shmkv_sid_slot(c, sids[i], &sl) != SHMKV_OK) { *bad = sids[i]; return SHMKV_ENOSEQ; }
    return SHMKV_OK;
}

#endif /* SHMKV_KERNELS_SEQ_H */
