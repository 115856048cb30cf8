/*
 * kernels/copy.h -- byte copies between a sequence's blocks and dense [layers][n][heads*dim]
 * buffers (append, write, gather).  Writes: block data only.
 */
#ifndef SHMKV_KERNELS_COPY_H
#define SHMKV_KERNELS_COPY_H

/* ---- byte copies between a sequence and dense [layers][n][heads*dim] buffers ------------ */
/* Caller holds the sequence lock; positions [pos, pos+n) lie inside the table.  Every
 * table entry used is validated before the first byte moves. */
static inline int shmkv_seq_check_span(const shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n) {
    if (n == 0) return SHMKV_OK;
    const shmkv_seq_t *q = &c->seqs[slot];
    uint32_t nb = q->nblocks;
    if (nb > c->cfg.max_blocks_per_seq) return SHMKV_ECORRUPT;
    uint64_t last = (pos + n - 1) / c->cfg.block_size;
    if (last >= nb) return SHMKV_ECORRUPT;
    const int32_t *t = shmkv_table(c, slot);
    for (uint64_t i = pos / c->cfg.block_size; i <= last; i++)
        if (!shmkv_block_ok(c, t[i])) return SHMKV_ECORRUPT;
    return SHMKV_OK;
}

/* Big copies (a prefill, a long gather: at least SHMKV_NT_MIN bytes per K or V array)
 * use streaming (non-temporal) stores.  Their data does not fit in the caches anyway,
 * and a normal store first reads every destination line in (read-for-ownership): a
 * third of the memory traffic.  Streaming stores skip that read, and with it the
 * 4K-aliasing stalls of a destination a few bytes past the source's page offset (numpy's
 * own arrays sit 16 bytes past a page, the pool's blocks on one): gather of 1k Llama
 * tokens into numpy arrays went from ~22 ms to ~9 ms, a 512-token prefill from ~7 to
 * ~3.5 ms.  They are weakly ordered: an sfence follows, before anything is published. */
#define SHMKV_NT_MIN (8ull << 20)
#if defined(__SSE2__)
#include <emmintrin.h>
#define SHMKV_HAVE_NT 1
static void shmkv__copy_nt(uint8_t *dst, const uint8_t *src, uint64_t n) {
    uint64_t head = (16u - ((uintptr_t)dst & 15u)) & 15u;   /* streaming stores: aligned */
    if (head > n) head = n;
    memcpy(dst, src, head);
    dst += head; src += head; n -= head;
    while (n >= 128) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)src);
        __m128i x1 = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i x3 = _mm_loadu_si128((const __m128i *)(src + 48));
        __m128i x4 = _mm_loadu_si128((const __m128i *)(src + 64));
        __m128i x5 = _mm_loadu_si128((const __m128i *)(src + 80));
        __m128i x6 = _mm_loadu_si128((const __m128i *)(src + 96));
        __m128i x7 = _mm_loadu_si128((const __m128i *)(src + 112));
        _mm_stream_si128((__m128i *)dst, x0);
        _mm_stream_si128((__m128i *)(dst + 16), x1);
        _mm_stream_si128((__m128i *)(dst + 32), x2);
        _mm_stream_si128((__m128i *)(dst + 48), x3);
        _mm_stream_si128((__m128i *)(dst + 64), x4);
        _mm_stream_si128((__m128i *)(dst + 80), x5);
        _mm_stream_si128((__m128i *)(dst + 96), x6);
        _mm_stream_si128((__m128i *)(dst + 112), x7);
        src += 128; dst += 128; n -= 128;
    }
    memcpy(dst, src, n);
}
static inline void shmkv__nt_fence(void) { _mm_sfence(); }
#else
#define SHMKV_HAVE_NT 0
static void shmkv__copy_nt(uint8_t *dst, const uint8_t *src, uint64_t n) { memcpy(dst, src, n); }
static inline void shmkv__nt_fence(void) {}
#endif

/* to_pool=1: buf -> pool (append); 0: pool -> buf (gather).  buf is [layers][n][tb]; the
 * pool's rows are tb bytes per slot, layers `stride` bytes apart (the K/V pools, or an
 * int8 pool's scale regions: tb = scale_bytes, stride = scale_stride). */
static void shmkv_seq_copy_rows(shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n,
                                uint8_t *pool, uint64_t stride, uint64_t tb, uint8_t *buf,
                                int to_pool) {
    const int32_t *t = shmkv_table(c, slot);
    const uint64_t bs = c->cfg.block_size;
    const int nt = SHMKV_HAVE_NT && n * tb * c->cfg.num_layers >= SHMKV_NT_MIN;
    for (uint32_t l = 0; l < c->cfg.num_layers; l++) {
        if (!to_pool && l == c->cfg.num_layers / 2) SHMKV_CRASH(GATHER_MID);
        uint8_t *layer = pool + (uint64_t)l * stride;
        uint8_t *b = buf + (uint64_t)l * n * tb;
        uint64_t p = pos, rem = n;
        while (rem) {
            uint64_t off = p % bs, cnt = bs - off, bi = p / bs;
            if (cnt > rem) cnt = rem;
            /* a run of consecutive block ids is one stretch of the layer: one copy (a
             * fresh sequence's blocks mostly are, the free stack being LIFO) */
            while (cnt < rem && t[bi + 1] == t[bi] + 1) {
                bi++;
                cnt += rem - cnt < bs ? rem - cnt : bs;
            }
            uint8_t *blk = layer + ((uint64_t)t[p / bs] * bs + off) * tb;
            uint8_t *d = to_pool ? blk : b;
            const uint8_t *sp = to_pool ? b : blk;
            if (nt) shmkv__copy_nt(d, sp, cnt * tb); else memcpy(d, sp, cnt * tb);
            b += cnt * tb;
            p += cnt;
            rem -= cnt;
        }
    }
    if (nt) shmkv__nt_fence();
}

/* The K or V pool's rows: see shmkv_seq_copy_rows. */
static inline void shmkv_seq_copy(shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n,
                           uint8_t *pool, uint8_t *buf, int to_pool) {
    shmkv_seq_copy_rows(c, slot, pos, n, pool, c->lay.layer_stride, c->lay.token_bytes, buf,
                        to_pool);
}

/* Slot ids of positions [pos, pos+n) (slot = block * block_size + offset). */
static inline void shmkv_seq_slots(const shmkv_ctx_t *c, uint32_t slot, uint64_t pos, uint64_t n,
                            int64_t *out) {
    const int32_t *t = shmkv_table(c, slot);
    const uint64_t bs = c->cfg.block_size;
    for (uint64_t i = 0; i < n; i++, pos++)
        out[i] = (int64_t)t[pos / bs] * (int64_t)bs + (int64_t)(pos % bs);
}

/* Scatter of n tokens of one layer into slots (vLLM reshape_and_cache): rows of tb bytes
 * into kbase/vbase (layer 0 of the pools, or of an int8 pool's scale regions), layers
 * `stride` apart.  All slots are validated before the first byte moves. */
static int shmkv_write_rows(shmkv_ctx_t *c, uint32_t layer, const int64_t *slots, uint64_t n,
                            uint8_t *kbase, uint8_t *vbase, uint64_t stride, uint64_t tb,
                            const uint8_t *k, const uint8_t *v, int64_t *bad) {
    if (layer >= c->cfg.num_layers) return SHMKV_ERANGE;
    const int64_t nslots = (int64_t)c->cfg.num_blocks * c->cfg.block_size;
    for (uint64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= nslots) { *bad = (int64_t)i; return SHMKV_ERANGE; }
    uint8_t *kl = kbase + (uint64_t)layer * stride;
    uint8_t *vl = vbase + (uint64_t)layer * stride;
    for (uint64_t i = 0; i < n; i++) {
        memcpy(kl + (uint64_t)slots[i] * tb, k + i * tb, tb);
        memcpy(vl + (uint64_t)slots[i] * tb, v + i * tb, tb);
    }
    return SHMKV_OK;
}

static inline int shmkv_write_slots(shmkv_ctx_t *c, uint32_t layer, const int64_t *slots, uint64_t n,
                             const uint8_t *k, const uint8_t *v, int64_t *bad) {
    return shmkv_write_rows(c, layer, slots, n, c->kpool, c->vpool, c->lay.layer_stride,
                            c->lay.token_bytes, k, v, bad);
}

#endif /* SHMKV_KERNELS_COPY_H */
