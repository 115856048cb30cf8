/*
 * fuzz/segment_fuzz.c -- libFuzzer harness over the C code that reads an untrusted
 * segment: bind (attach's validation), the readers that trust nothing
 * (counts, sequence validation, each valid sequence's token ids, rows and slots, batch
 * block tables, prefix-index lookups, the event ring and its reader), the recovery pass,
 * then the readers again, an allocation and a process registration on what recovery
 * left.  Owns nothing but its own buffers.
 *
 * The input is a whole segment image (the seed corpus: real segments after real
 * workloads, fuzz/make_corpus.py).  It is copied into a malloc'd buffer whose padding on
 * both sides is poisoned (ASan reports any byte read or written outside the segment);
 * when the raw image does not bind, its header is repaired (magic, version, ABI, READY,
 * checksum) and bound again, so mutations of the config and layout reach the validation
 * of the layout and everything behind it.  The process table is probed through a memfd
 * holding no lock (every process looks dead: recovery reclaims) or, when the input's last
 * byte is odd, without one (every ACTIVE process looks alive: recovery's quiesce waits;
 * lock waits are 1 ms here).  A fuzzed pool_lock mutex is reinitialised first: its
 * bytes are glibc's, not shmkv's.
 *
 * Build and run: make fuzz-c DURATION=60 (clang -fsanitize=fuzzer,address,undefined).
 */
#define _GNU_SOURCE 1
#include <sanitizer/asan_interface.h>
#include <stdio.h>
#include <sys/mman.h>

#include "kernels/kernels.h"

#define PAD 4096u                       /* poisoned bytes either side of the segment */

static int lock_memfd = -1;

static void readers(shmkv_ctx_t *c) {
    uint64_t fb, cached, live;
    shmkv_counts(c, &fb, &cached, &live);
    if (fb > c->cfg.num_blocks || cached > c->cfg.num_blocks) __builtin_trap();

    /* every sequence slot through the validation the data paths use; the live ones
     * through the batch block-table copy */
    uint32_t NS = c->cfg.max_seqs, W = c->cfg.max_blocks_per_seq, n = 0;
    int64_t *sids = malloc(sizeof(int64_t) * NS);
    uint32_t *slots = malloc(sizeof(uint32_t) * NS);
    int32_t *lens = malloc(sizeof(int32_t) * NS);
    for (uint32_t s = 0; s < NS; s++) {
        (void)shmkv_seq_valid(c, s);
        if (c->seqs[s].state == SHMKV_SEQ_LIVE) sids[n++] = shmkv_slot_sid(c, s);
    }
    /* each valid live sequence's span, then its token ids, K rows and slot ids (what
     * gather, token_ids and the block tables read) */
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s = (uint32_t)(sids[i] % NS);
        uint64_t len = c->seqs[s].len;
        if (len == 0 || len > (uint64_t)W * c->cfg.block_size) continue;
        if (shmkv_seq_check_span(c, s, 0, len) != SHMKV_OK) continue;
        int32_t *ids = malloc(4 * len);
        int64_t *sl = malloc(8 * len);
        uint8_t *rows = malloc((size_t)c->cfg.num_layers * len * c->lay.token_bytes);
        shmkv_seq_tokens(c, s, 0, len, ids, 0);
        shmkv_seq_slots(c, s, 0, len, sl);
        shmkv_seq_copy(c, s, 0, len, c->kpool, rows, 0);
        free(ids); free(sl); free(rows);
    }
    /* the prefix index: every hashed block's hash looked up, the chain matched */
    uint32_t NB = c->cfg.num_blocks, nh = 0;
    uint64_t *hs = malloc(16 * (size_t)NB);
    for (uint32_t b = 0; b < NB; b++) {
        if (!(c->blocks[b].flags & SHMKV_BLOCK_HASHED)) continue;
        hs[2 * nh] = c->blocks[b].hash[0];
        hs[2 * nh + 1] = c->blocks[b].hash[1];
        uint32_t f = shmkv_index_find_locked(c, hs + 2 * nh);
        if (f != SHMKV_NIL && f >= NB) __builtin_trap();     /* a found block is a block */
        nh++;
    }
    (void)shmkv_prefix_match_locked(c, hs, nh);
    free(hs);

    uint32_t w = 0;
    int64_t bad = 0;
    if (n && shmkv_batch_sizes_locked(c, sids, n, slots, lens, &w, &bad) == SHMKV_OK) {
        if (w > W) __builtin_trap();
        int32_t *out = malloc(sizeof(int32_t) * (size_t)n * (w ? w : 1));
        (void)shmkv_batch_copy_locked(c, sids, n, slots, lens, w, out, &bad);
        free(out);
    }
    free(sids); free(slots); free(lens);

    /* the event ring: the check, and a reader over the window (what _events.pyx does:
     * a record is trusted only for its stamp, kind and num_tokens are checked) */
    uint64_t first_bad = 0;
    (void)shmkv_events_check_locked(c, &first_bad);
    if (c->events) {
        uint64_t head = shmkv_event_head(c), cap = c->cfg.event_capacity;
        uint64_t lo = head > cap ? head - cap : 0;
        uint8_t *rec = malloc(c->lay.event_record_bytes);
        for (uint64_t s = lo; s < head; s++) {
            if (!shmkv_event_read(c, s, rec)) continue;
            const shmkv_event_t *e = (const shmkv_event_t *)rec;
            if (e->num_tokens > c->cfg.block_size) continue;
            const int32_t *tok = (const int32_t *)(rec + sizeof(shmkv_event_t));
            volatile int64_t sum = 0;
            for (uint32_t i = 0; i < e->num_tokens; i++) sum += tok[i];
        }
        free(rec);
    }
}

static void repair_header(uint8_t *base, size_t size) {
    shmkv_header_t *h = (shmkv_header_t *)base;
    h->magic = SHMKV_MAGIC;
    h->layout_version = SHMKV_LAYOUT_VERSION;
    h->header_size = SHMKV_HEADER_SIZE;
    h->abi_fingerprint = shmkv_abi_fingerprint();
    h->segment_size = size;
    h->checksum = shmkv_header_checksum(h);
    ((shmkv_shared_t *)(base + SHMKV_SHARED_OFFSET))->state = SHMKV_STATE_READY;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < SHMKV_PAGE || size > (64u << 20)) return 0;
    if (lock_memfd < 0) {
        lock_memfd = memfd_create("shmkv-fuzz-locks", MFD_CLOEXEC);
        if (lock_memfd < 0 || ftruncate(lock_memfd, SHMKV_PAGE) != 0) abort();
    }
    /* page-aligned like a mapping; aligned_alloc wants a multiple of the alignment */
    const size_t total = (size + 2 * PAD + SHMKV_PAGE - 1) / SHMKV_PAGE * SHMKV_PAGE;
    uint8_t *raw = aligned_alloc(SHMKV_PAGE, total);
    if (raw == NULL) return 0;
    uint8_t *base = raw + PAD;
    memcpy(base, data, size);
    ASAN_POISON_MEMORY_REGION(raw, PAD);
    ASAN_POISON_MEMORY_REGION(base + size, total - PAD - size);

    shmkv_ctx_t c;
    int st = shmkv_ctx_bind(&c, base, size, 0);
    if (st != SHMKV_OK) {
        repair_header(base, size);
        st = shmkv_ctx_bind(&c, base, size, 0);
    }
    if (st == SHMKV_OK) {
        c.timeout_ns = 1000000;                         /* 1 ms lock waits */
        c.lock_fd = (data[size - 1] & 1) ? -1 : lock_memfd;
        /* the robust mutex is glibc's bytes: a fresh one (its state is not shmkv's) */
        pthread_mutexattr_t a;
        pthread_mutexattr_init(&a);
        pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
        pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
        pthread_mutex_init(&c.sh->pool_lock, &a);
        pthread_mutexattr_destroy(&a);

        readers(&c);
        shmkv_recovery_t r;
        st = shmkv_recover_locked(&c, &r);
        readers(&c);
        if (st == SHMKV_OK) {                   /* what recovery left must serve allocations */
            uint32_t got[4];
            if (shmkv_blocks_alloc_locked(&c, 4, got) == SHMKV_OK)
                for (int i = 0; i < 4; i++) shmkv_block_decref_locked(&c, got[i]);
        }
        if (st == SHMKV_OK && c.lock_fd >= 0) {
            if (shmkv_proc_register_locked(&c, (uint64_t)getpid(), 1) == SHMKV_OK)
                shmkv_proc_unregister_locked(&c);
        }
    }
    ASAN_UNPOISON_MEMORY_REGION(raw, total);
    free(raw);
    return 0;
}
