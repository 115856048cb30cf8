/*
 * kernels/bench.h -- kernel-only timing hooks (loops in C, no Python) for benchmarks.
 * Writes: nothing beyond what the timed kernels write.
 */
#ifndef SHMKV_KERNELS_BENCH_H
#define SHMKV_KERNELS_BENCH_H

/* ---- kernel-only timing hooks (loops in C, no Python): how much is call overhead ---- */
/* ns per alloc+free of one block.  shared=0: the path reserve() and free() take -- our
 * process's cache under its cache_lock (the shared pool only when the cache is empty);
 * shared=1: the shared free stack under the pool lock, as a process without a cache. */
static double shmkv_bench_alloc_free(shmkv_ctx_t *c, uint64_t iters, int shared) {
    uint32_t b;
    shmkv_proc_t *p = shmkv_me(c);
    int64_t t0 = shmkv_now_ns(CLOCK_MONOTONIC);
    for (uint64_t i = 0; i < iters; i++) {
        if (!shared && p != NULL && shmkv_pcache_trylock(c, p)) {
            uint32_t n = p->cache_nblocks;
            if (n > 0 && n <= SHMKV_PCACHE_BLOCKS && shmkv__cacheable(c, p->cache_blocks[n - 1])) {
                b = p->cache_blocks[n - 1];
                p->cache_nblocks = n - 1;
                shmkv__block_claim(c, b);
                shmkv_count_hot(c, SHMKV_PC_ALLOCATIONS, 1);
                if (shmkv_atomic_load_u32(&c->blocks[b].ref_cnt) == 1) {   /* the free */
                    shmkv_atomic_store_u32(&c->blocks[b].ref_cnt, 0);
                    p->cache_blocks[p->cache_nblocks++] = b;
                    shmkv_count_hot(c, SHMKV_PC_FREES, 1);
                }
                shmkv_pcache_unlock(p);
                continue;
            }
            shmkv_pcache_unlock(p);
        }
        if (shmkv_pool_lock(c) != SHMKV_OK) return -1;
        if (!shared && p != NULL && shmkv_pcache_balance_locked(c) == SHMKV_OK
                && p->cache_nblocks > 0) {
            shmkv_pool_unlock(c);
            i--;                            /* refilled: this round again, on the fast path */
            continue;
        }
        if (shmkv_blocks_alloc_locked(c, 1, &b) != SHMKV_OK) { shmkv_pool_unlock(c); return -1; }
        shmkv_block_decref_locked(c, b);
        shmkv_pool_unlock(c);
    }
    return (double)(shmkv_now_ns(CLOCK_MONOTONIC) - t0) / (double)iters;
}

/* ns per memcpy of nbytes; src/dst walk a working set of `span` bytes (>= nbytes) so a
 * span larger than the caches measures cold copies. */
static double shmkv_bench_memcpy(uint8_t *dst, const uint8_t *src, uint64_t nbytes,
                                 uint64_t span, uint64_t iters, int streaming) {
    uint64_t off = 0;
    int64_t t0 = shmkv_now_ns(CLOCK_MONOTONIC);
    for (uint64_t i = 0; i < iters; i++) {
        if (streaming) { shmkv__copy_nt(dst + off, src + off, nbytes); shmkv__nt_fence(); }
        else memcpy(dst + off, src + off, nbytes);
        off += nbytes;
        if (off + nbytes > span) off = 0;
    }
    return (double)(shmkv_now_ns(CLOCK_MONOTONIC) - t0) / (double)iters;
}

/* ns per decode step's write of one token into every layer's K and V pool (2 * num_layers
 * rows of token_bytes, each where the paged layout puts slot slots[i % n]) from a contiguous
 * [num_layers][token] source: the layout-matched floor of append(sid, k[:, :1], v[:, :1]),
 * without its locks, table and bookkeeping.  Slots must be valid (the caller checks). */
static double shmkv_bench_rows(shmkv_ctx_t *c, const uint8_t *k, const uint8_t *v,
                               const int64_t *slots, uint64_t n, uint64_t iters) {
    const uint64_t tb = c->lay.token_bytes, ls = c->lay.layer_stride;
    const uint32_t L = c->cfg.num_layers;
    int64_t t0 = shmkv_now_ns(CLOCK_MONOTONIC);
    for (uint64_t i = 0; i < iters; i++) {
        const uint64_t off = (uint64_t)slots[i % n] * tb;
        for (uint32_t l = 0; l < L; l++) {
            memcpy(c->kpool + l * ls + off, k + l * tb, tb);
            memcpy(c->vpool + l * ls + off, v + l * tb, tb);
        }
    }
    return (double)(shmkv_now_ns(CLOCK_MONOTONIC) - t0) / (double)iters;
}

#endif /* SHMKV_KERNELS_BENCH_H */
