/*
 * kernels/attention_plan.h -- how a call is cut into work items (rows per item, keys per
 * chunk) and the exact log-sum-exp merge of the chunks of split keys.
 * A part of attention.c (included once by it, as attention_isa.h is), not a header of its
 * own: it uses what attention.c defines above the include.
 */
/* Merges the partials of each split row group into out: the exact log-sum-exp merge. */
static void shmkv_att_merge(const shmkv_attn_args_t *a, const shmkv_item_t *items, uint32_t n,
                            const float *parts, uint32_t qv_stride) {
    const uint32_t G = a->hq / a->hkv, d = a->d;
    uint32_t i = 0;
    while (i < n) {
        if (items[i].part < 0) { i++; continue; }
        uint32_t e = i + 1;                     /* the chunks of one (seq, rows) */
        while (e < n && items[e].part >= 0 && items[e].seq == items[i].seq &&
               items[e].row0 == items[i].row0) e++;
        const shmkv_item_t *it = &items[i];
        for (uint32_t h = 0; h < a->hkv; h++)
            for (uint32_t r = 0; r < it->nrows; r++)
                for (uint32_t g = 0; g < G; g++) {
                    const uint32_t v = SHMKV_ATT_V(it, G, h, r, g);
                    float M = -INFINITY;
                    for (uint32_t c = i; c < e; c++) {
                        float mc = parts[((size_t)items[c].part * qv_stride + v) * (d + 2) + d];
                        if (mc > M) M = mc;
                    }
                    float *o = a->out + shmkv_att_qoff(a, it, h, r, g);
                    float L = 0;
                    for (uint32_t x = 0; x < d; x++) o[x] = 0;
                    for (uint32_t c = i; c < e; c++) {
                        const float *p = parts + ((size_t)items[c].part * qv_stride + v) * (d + 2);
                        if (p[d + 1] <= 0 || p[d] == -INFINITY) continue;
                        const float w = expf(p[d] - M);
                        L += p[d + 1] * w;
                        for (uint32_t x = 0; x < d; x++) o[x] += p[x] * w;
                    }
                    const float inv = L > 0 ? 1.0f / L : 0.0f;
                    for (uint32_t x = 0; x < d; x++) o[x] *= inv;
                }
        i = e;
    }
}

/* The work items' shape: *rt query rows per item (a row tile of one sequence, every head),
 * and the keys of a row tile split into chunks of *chunk tokens (UINT64_MAX: not split),
 * whose partial results are merged by log-sum-exp afterwards.
 * - Decode (one row per sequence): the keys are split while there are fewer than 4 items
 *   per thread (one long sequence: its chunks keep every thread busy).
 * - Prefill on the GEMM items or the tiles (rows of up to qvmax / G): an item's fixed cost
 *   (q packed per head, each step's K/V converted or packed for its rows) is paid again by
 *   every chunk, and the merge runs on one thread, so the keys are split only when one row
 *   tile alone would hold the threads back: its rows x keys more than 1.5 times an even
 *   share.  Before that, a sequence with fewer than two row tiles per thread gets its rows
 *   in equal tiles, a multiple of the threads in number (96 rows on 2 threads: 48 + 48,
 *   not 64 + 32), where that leaves each at least 128 query vectors per kv head.  With
 *   the decode rule, 128 rows into 1k bf16 took 1.9x the time this takes on 2 threads. */
static void shmkv_att_plan(const uint32_t *q_lens, const uint32_t *seq_lens, uint32_t nseq,
                           uint32_t G, uint32_t qvmax, int threads, uint32_t *rt_out,
                           uint64_t *chunk_out) {
    uint32_t rt = G >= qvmax ? 1 : qvmax / G, qmax = 0;
    uint64_t nbase = 0, longest = 0;
    for (uint32_t s = 0; s < nseq; s++) {
        nbase += (q_lens[s] + rt - 1) / rt;
        if (q_lens[s] > qmax) qmax = q_lens[s];
        if (seq_lens[s] > longest) longest = seq_lens[s];
    }
    uint64_t chunk = UINT64_MAX;
    const uint64_t T = threads > 1 ? (uint64_t)threads : 1;
    if (qmax > 1 && qvmax > QV_MAX) {
        if (T > 1 && nbase < 2 * T) {
            const uint64_t k = ((qmax + rt - 1) / rt + T - 1) / T * T;
            const uint32_t r2 = (uint32_t)((qmax + k - 1) / k);
            if (r2 < rt && (uint64_t)r2 * G >= 128) {
                rt = r2;
                nbase = 0;
                for (uint32_t s = 0; s < nseq; s++) nbase += (q_lens[s] + rt - 1) / rt;
            }
        }
        /* rows x keys of the largest row tile, and of all (keys: what the last row sees) */
        uint64_t wmax = 0, wsum = 0, wend = 0;
        for (uint32_t s = 0; s < nseq; s++)
            for (uint32_t r0 = 0; r0 < q_lens[s]; r0 += rt) {
                const uint64_t nr = q_lens[s] - r0 < rt ? q_lens[s] - r0 : rt;
                const uint64_t end = seq_lens[s] - q_lens[s] + r0 + nr;
                wsum += nr * end;
                if (nr * end > wmax) { wmax = nr * end; wend = end; }
            }
        if (T > 1 && wsum > 0 && 2 * wmax * T > 3 * wsum) {
            /* enough pieces that the largest tile's are at most an even share */
            const uint64_t pieces = (wmax * T + wsum - 1) / wsum;
            chunk = (wend + pieces - 1) / pieces;
        }
    } else if (T > 1 && nbase < 4 * T) {
        chunk = (longest * nbase + 4 * T - 1) / (4 * T);
    }
    if (chunk != UINT64_MAX) {          /* >= MIN_CHUNK tokens, a multiple of TILE */
        if (chunk < MIN_CHUNK) chunk = MIN_CHUNK;
        chunk = (chunk + TILE - 1) / TILE * TILE;
    }
    *rt_out = rt;
    *chunk_out = chunk;
}

/* Test hook: shmkv_att_plan for these sequences (wide: the GEMM items or the tiles are in
 * use).  Returns 0, or -1 on arguments the planner never gets. */
int shmkv_attn_plan(const uint32_t *q_lens, const uint32_t *seq_lens, uint32_t nseq,
                    uint32_t group, int wide, int threads, uint32_t *rt, uint64_t *chunk) {
    if (nseq == 0 || group == 0 || threads < 1) return -1;
    for (uint32_t s = 0; s < nseq; s++)
        if (q_lens[s] == 0 || q_lens[s] > seq_lens[s]) return -1;
    shmkv_att_plan(q_lens, seq_lens, nseq, group, wide ? 8 * QV_MAX : QV_MAX, threads, rt, chunk);
    return 0;
}
