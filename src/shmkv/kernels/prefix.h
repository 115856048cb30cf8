/*
 * kernels/prefix.h -- token ids, block hashes, the prefix cache and StreamingLLM trim (redo journal).
 * Writes: block hashes/token ids, index slots, the trim journal, seq block tables; a
 * "stored" KV event for each hash it makes findable (events.h).
 */
#ifndef SHMKV_KERNELS_PREFIX_H
#define SHMKV_KERNELS_PREFIX_H

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

/* Token ids of positions [pos, pos+n) between the sequence's blocks and ids[].
 * Caller holds the sequence lock and checked the span. */
static inline void shmkv_seq_tokens(shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n,
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
static inline void shmkv_seq_block_hash_fast(shmkv_ctx_t *c, uint32_t slot, uint32_t i) {
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
static inline void shmkv_seq_publish_locked(shmkv_ctx_t *c, uint32_t slot) {
    shmkv_seq_t *q = &c->seqs[slot];
    const int32_t *t = shmkv_table(c, slot);
    uint32_t end = q->hash_ready < q->nblocks ? q->hash_ready : q->nblocks;
    for (uint32_t i = q->hashed; i < end; i++) {
        uint32_t b = (uint32_t)t[i];
        if (!shmkv_block_ok(c, b)) break;
        shmkv_block_t *m = &c->blocks[b];
        if (!(m->flags & SHMKV_BLOCK_HASHED)) {
            uint64_t h[2] = { m->hash[0], m->hash[1] };
            if (shmkv_index_insert_locked(c, h, b)) {   /* findable: the "stored" event */
                const uint64_t *parent = NULL;
                if (i > 0 && shmkv_block_ok(c, t[i - 1])) parent = c->blocks[t[i - 1]].hash;
                shmkv_event_stored_locked(c, b, h, parent);
            }
        }
        q->hashed = i + 1;
        if (i + 1 == end && i > q->hashed / 2) SHMKV_CRASH(PUBLISH_MID);
    }
}

/* How many leading hashes of hashes[n][2] are findable. */
static inline uint32_t shmkv_prefix_match_locked(shmkv_ctx_t *c, const uint64_t *hashes, uint32_t n) {
    uint32_t i = 0;
    for (; i < n; i++)
        if (shmkv_index_find_locked(c, hashes + 2 * i) == SHMKV_NIL) break;
    return i;
}

/* Gives an empty sequence (ours, fresh) the findable leading blocks of hashes[n][2]:
 * each hit gets a reference; a cached block (ref_cnt 0) leaves the LRU list in O(1).
 * Returns the number of blocks taken. */
static inline uint32_t shmkv_prefix_take_locked(shmkv_ctx_t *c, uint32_t slot, const uint64_t *hashes,
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
static inline int shmkv_seq_trim_locked(shmkv_ctx_t *c, uint32_t slot, uint32_t S, uint32_t D,
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

#endif /* SHMKV_KERNELS_PREFIX_H */
