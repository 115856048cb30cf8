"""Host-wide prefix cache benchmark.

Part 1, serving: 4 worker processes (spawn) serve requests that share 8 system prompts
(512-1024 tokens) followed by a unique user suffix (64-256 tokens) and a short decode.
Each request: create_sequence(tokens=prompt) (takes whatever prefix is cached), append
the rest of the prompt with tokens= (the prefill work actually done), decode token by
token, free.  Compared at the same total size:
  shared   one segment, the shared index: every worker hits what any worker published
  private  four segments of a quarter of the blocks each, one per worker
Measured: hit rate (tokens), prefill tokens saved, peak used blocks, blocks holding
reusable KV at the end, cached blocks evicted, wall time.

Part 2, cost of a hit per block: create_sequence(tokens=...) that hits N blocks, /N,
against the lookup alone (match_prefix), for hash="fast" and hash="sha256"; hits on
blocks another sequence holds (live) and on cached (freed) blocks.  Medians, p10/p90.

    python benchmarks/prefix_bench.py [--quick]

Progress on stderr; JSON to benchmarks/out/prefix.json; Markdown to
benchmarks/RESULTS_prefix.md.  Every segment is unlinked on the way out.
"""
import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
import uuid

import numpy as np

import shmkv

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_JSON = os.path.join(HERE, "out", "prefix.json")
OUT_MD = os.path.join(HERE, "RESULTS_prefix.md")

WORKERS = 4
N_SYSTEM = 8
VOCAB = 32000
# a small model shape: 8 layers, 4 KV heads of 64, fp16 -> 8 KiB per token, 128 KiB a block
SHAPE = {"num_layers": 8, "num_kv_heads": 4, "head_dim": 64, "block_size": 16, "dtype": "float16"}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def unlink(name):
    import posix_ipc
    try:
        posix_ipc.unlink_shared_memory("/" + name.lstrip("/"))
    except posix_ipc.ExistentialError:
        pass


def system_prompts(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(512, 1025))).astype(np.int32)
            for _ in range(N_SYSTEM)]


# ---- part 1: serving ---------------------------------------------------------------------
def worker(seg_name, wid, n_requests, decode, seed, q):
    """Serve n_requests requests on segment seg_name; report per-request numbers."""
    try:
        c = shmkv.KVCache.attach(seg_name)
        cfg = c.config
        sysp = system_prompts(seed)
        rng = np.random.default_rng(seed * 1000 + wid + 1)
        maxlen = 1024 + 256 + decode
        shape = (cfg.num_layers, maxlen, cfg.num_kv_heads, cfg.head_dim)
        k = rng.standard_normal(shape).astype(cfg.numpy_dtype)
        v = -k
        prompt_tok = hit_tok = 0
        t_lookup = 0.0
        per = []
        t0 = time.perf_counter()
        for _ in range(n_requests):
            si = int(rng.integers(N_SYSTEM))
            user = rng.integers(0, VOCAB, int(rng.integers(64, 257))).astype(np.int32)
            prompt = np.concatenate([sysp[si], user])
            a = time.perf_counter()
            sid = c.create_sequence(tokens=prompt)
            t_lookup += time.perf_counter() - a
            n0 = c.seq_len(sid)
            for s in range(n0, len(prompt), 512):          # chunked prefill
                e = min(s + 512, len(prompt))
                c.append(sid, k[:, s:e], v[:, s:e], tokens=prompt[s:e])
            pos = len(prompt)
            for _ in range(decode):                          # decode: one token a step
                c.append(sid, k[:, pos:pos + 1], v[:, pos:pos + 1],
                         tokens=rng.integers(0, VOCAB, 1).astype(np.int32))
                pos += 1
            c.free(sid)
            prompt_tok += len(prompt)
            hit_tok += n0
            per.append((si, len(prompt), n0))
        wall = time.perf_counter() - t0
        q.put({"wid": wid, "prompt_tokens": prompt_tok, "hit_tokens": hit_tok, "wall_s": wall,
                   "lookup_s": t_lookup, "requests": per})
        c.close()
    except BaseException:
        import traceback
        q.put({"wid": wid, "error": traceback.format_exc()})
        raise


def serve(mode, total_blocks, n_requests, decode, seed):
    """mode 'shared' (one segment) or 'private' (WORKERS segments of total/WORKERS)."""
    ctx = mp.get_context("spawn")
    nseg = 1 if mode == "shared" else WORKERS
    cfg = shmkv.CacheConfig(**SHAPE, num_blocks=total_blocks // nseg, max_seqs=64)
    names = [f"shmkv-bench-prefix-{os.getpid()}-{uuid.uuid4().hex[:8]}" for _ in range(nseg)]
    segs, procs = [], []
    try:
        for n in names:
            segs.append(shmkv.KVCache.create(n, cfg))
        q = ctx.Queue()
        t0 = time.perf_counter()
        for w in range(WORKERS):
            p = ctx.Process(target=worker, args=(names[w % nseg], w, n_requests, decode, seed, q))
            p.start()
            procs.append(p)
        reps = [q.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
        wall = time.perf_counter() - t0
        for r in reps:
            if "error" in r:
                raise RuntimeError(f"worker {r['wid']} failed:\n{r['error']}")
        for p in procs:
            if p.exitcode != 0:
                raise RuntimeError(f"worker pid {p.pid} exit code {p.exitcode}")
        stats = [s.stats() for s in segs]
        for s in segs:
            bad = s.check()
            if bad:
                raise RuntimeError(f"check() after the run: {bad}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for s in segs:
            s.close()
        for n in names:
            unlink(n)
    prompt = sum(r["prompt_tokens"] for r in reps)
    hit = sum(r["hit_tokens"] for r in reps)
    # the most any cache could share: the full blocks of each request's system prompt
    bs = SHAPE["block_size"]
    shareable = sum(min(len(system_prompts(seed)[si]) // bs * bs, (n - 1) // bs * bs)
                    for r in reps for si, n, _ in r["requests"])
    res = {
        "mode": mode, "segments": nseg, "total_blocks": total_blocks,
        "blocks_per_segment": cfg.num_blocks,
        "workers": WORKERS, "requests": WORKERS * n_requests, "decode_tokens": decode,
        "prompt_tokens": prompt, "hit_tokens": hit, "hit_rate": hit / prompt,
        "shareable_tokens": shareable, "hit_of_shareable": hit / shareable if shareable else 0.0,
        "prefill_tokens_computed": prompt - hit, "prefill_saved": hit / prompt,
        "prefix_queries": sum(s["prefix_queries"] for s in stats),
        "prefix_hits": sum(s["prefix_hits"] for s in stats),
        "peak_used_blocks": sum(s["peak_used_blocks"] for s in stats),
        "cached_blocks_end": sum(s["cached_blocks"] for s in stats),
        "cached_blocks_reused": sum(s["cached_blocks_reused"] for s in stats),
        "cached_blocks_evicted": sum(s["cached_blocks_evicted"] for s in stats),
        "index_entries_end": sum(s["index_entries"] for s in stats),
        "appended_tokens": sum(s["appended_tokens"] for s in stats),
        "bytes_per_block": cfg.bytes_per_block,
        "wall_s": wall, "worker_wall_s": max(r["wall_s"] for r in reps),
        "lookup_s": sum(r["lookup_s"] for r in reps)}
    assert res["prefix_hits"] == hit, (res["prefix_hits"], hit)
    return res


# ---- part 2: cost of a hit per block -------------------------------------------------------
def pct(xs):
    a = np.asarray(xs, float)
    return {"p10": float(np.percentile(a, 10)), "p50": float(np.percentile(a, 50)),
                "p90": float(np.percentile(a, 90))}


def hit_cost(hash_name, nblocks_list, reps):
    bs = SHAPE["block_size"]
    cfg = shmkv.CacheConfig(**SHAPE, num_blocks=2 * max(nblocks_list) + 64, max_seqs=16,
                            hash=hash_name)
    name = f"shmkv-bench-prefix-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    c = shmkv.KVCache.create(name, cfg)
    out = []
    try:
        rng = np.random.default_rng(1)
        for nb in nblocks_list:
            prompt = rng.integers(0, VOCAB, nb * bs + 1).astype(np.int32)
            k = np.zeros((cfg.num_layers, nb * bs, cfg.num_kv_heads, cfg.head_dim),
                         cfg.numpy_dtype)
            holder = c.create_sequence(tokens=prompt)
            c.append(holder, k, k, tokens=prompt[:nb * bs])
            assert c.match_prefix(prompt) == nb * bs
            row = {"hash": hash_name, "blocks": nb}
            pc = time.perf_counter_ns
            for label in ("live", "cached"):
                if label == "cached":
                    c.free(holder)                 # every block now CACHED (refcount 0)
                    assert c.stats()["cached_blocks"] == nb
                t_m, t_c = [], []
                for _ in range(reps):
                    a = pc()
                    m = c.match_prefix(prompt)
                    b = pc()
                    sid = c.create_sequence(tokens=prompt)
                    e = pc()
                    assert m == nb * bs and c.seq_len(sid) == nb * bs
                    c.free(sid)
                    t_m.append((b - a) / nb)
                    t_c.append((e - b) / nb)
                row[f"match_{label}"] = pct(t_m)
                row[f"create_{label}"] = pct(t_c)
            assert c.stats()["used_blocks"] == 0 and c.check() == []
            t_e = []
            for _ in range(reps):                  # fixed cost: a sequence, no tokens
                a = pc()
                sid = c.create_sequence()
                t_e.append(pc() - a)
                c.free(sid)
            row["create_empty_ns"] = pct(t_e)
            out.append(row)
            log(f"  hit cost {hash_name:6s} {nb:4d} blocks: match {row['match_cached']['p50']:.0f}"
                f" ns/block, create (cached) {row['create_cached']['p50']:.0f} ns/block")
            # drop these blocks from the index: the next size starts from a clean pool
            filler = c.create_sequence()
            z = np.zeros((cfg.num_layers, cfg.num_blocks * bs, cfg.num_kv_heads,
                          cfg.head_dim), cfg.numpy_dtype)
            c.append(filler, z, z)
            c.free(filler)
    finally:
        c.close()
        unlink(name)
    return out


# ---- report ------------------------------------------------------------------------------
def fmt_p(d, scale=1.0):
    return f"{d['p50'] / scale:,.0f} ({d['p10'] / scale:,.0f}-{d['p90'] / scale:,.0f})"


def markdown(res):
    L = []
    m = res["meta"]
    L.append("# Prefix cache: one shared index vs four private caches\n")
    L.append(f"Measured {m['date']} on {m['machine']} ({m['cpus']} CPUs), Python {m['python']}, "
             f"`python benchmarks/prefix_bench.py{' --quick' if m['quick'] else ''}` "
             f"({m['total_s']:.0f} s; 1-minute load average {m['loadavg_start']:.1f} at the "
             f"start, {m['loadavg_end']:.1f} at the end"
             f"{': other jobs shared the CPUs' if m['loadavg_start'] > 1 else ''}).\n")
    L.append(f"Model shape: {SHAPE['num_layers']} layers, {SHAPE['num_kv_heads']} KV heads x "
             f"{SHAPE['head_dim']}, fp16, block_size {SHAPE['block_size']} "
             f"({res['serve'][0]['bytes_per_block'] // 1024} KiB a block). "
             f"{WORKERS} spawned workers, each serving {m['requests_per_worker']} requests "
             f"one after another: one of {N_SYSTEM} system prompts (512-1024 tokens) + a unique "
             f"user suffix (64-256 tokens), chunked prefill of what was not hit, "
             f"{m['decode']} decode tokens, free. *shared*: one segment of all the blocks; "
             f"*private*: {WORKERS} segments of a quarter each, every worker on its own.\n")
    L.append("| capacity (blocks) | setup | hit rate (tokens) | of shareable | prefill tokens "
             "computed | prefill saved | peak used blocks | reusable blocks at end | "
             "cached evicted | create_sequence(tokens=) us/request | wall s |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in res["serve"]:
        L.append(f"| {r['total_blocks']} "
                 f"| {r['mode']} ({r['segments']} x {r['blocks_per_segment']}) "
                 f"| {100 * r['hit_rate']:.1f}% ({r['hit_tokens']:,} / {r['prompt_tokens']:,}) "
                 f"| {100 * r['hit_of_shareable']:.1f}% "
                 f"| {r['prefill_tokens_computed']:,} | {100 * r['prefill_saved']:.1f}% "
                 f"| {r['peak_used_blocks']:,} | {r['cached_blocks_end']:,} "
                 f"| {r['cached_blocks_evicted']:,} | {1e6 * r['lookup_s'] / r['requests']:.1f} "
                 f"| {r['wall_s']:.2f} |")
    L.append("")
    L.append("*hit rate*: prompt tokens create_sequence(tokens=) found cached (= prefill "
             "tokens saved: not recomputed, not appended). *of shareable*: hits / the system-"
             "prompt tokens in whole blocks over all requests (the most any cache could hit). "
             "*peak used blocks*: peak of blocks with refcount > 0 (sum over segments). "
             "*reusable blocks at end*: cached blocks still findable after the run (sum). "
             "*cached evicted*: cached blocks reused for new data.\n")
    ratios = {}
    for cap in sorted({r["total_blocks"] for r in res["serve"]}):
        s = next(r for r in res["serve"] if r["total_blocks"] == cap and r["mode"] == "shared")
        p = next(r for r in res["serve"] if r["total_blocks"] == cap and r["mode"] == "private")
        ratios[cap] = (s["prefill_tokens_computed"] / max(1, p["prefill_tokens_computed"]),
                       s["peak_used_blocks"] / max(1, p["peak_used_blocks"]))
        L.append(f"- {cap} blocks: shared computes {ratios[cap][0]:.2f}x the prefill tokens of "
                 f"private, peak used blocks {ratios[cap][1]:.2f}x.")
    L.append("")
    L.append("## Cost of a hit, per block (ns)\n")
    L.append(f"create_sequence(tokens=prompt) that hits N blocks, divided by N, against "
             f"match_prefix(prompt) (hash the chain + look up, take nothing), "
             f"{m['hit_reps']} repetitions each; median (p10-p90). *live*: the blocks are "
             f"held by another sequence; *cached*: they are free, on the LRU list (a hit "
             f"takes them back). Last column: create_sequence() with no tokens (ns per call, "
             f"not per block).\n")
    L.append("| hash | N blocks | match_prefix live | create_sequence hit live | "
             "match_prefix cached | create_sequence hit cached | create_sequence() ns/call |")
    L.append("|---|---|---|---|---|---|---|")
    for r in res["hit_cost"]:
        L.append(f"| {r['hash']} | {r['blocks']} | {fmt_p(r['match_live'])} "
                 f"| {fmt_p(r['create_live'])} | {fmt_p(r['match_cached'])} "
                 f"| {fmt_p(r['create_cached'])} | {fmt_p(r['create_empty_ns'])} |")
    L.append("")
    for h in ("fast", "sha256"):
        r = max((x for x in res["hit_cost"] if x["hash"] == h), key=lambda x: x["blocks"])
        L.append(f"- {h}, {r['blocks']} blocks: taking the hit adds "
                 f"{round(r['create_live']['p50'] - r['match_live']['p50']):+d} ns/block (live) "
                 f"and {round(r['create_cached']['p50'] - r['match_cached']['p50']):+d} ns/block "
                 f"(cached) "
                 f"to match_prefix (hashing the chain + the index probes).")
    f = {x["blocks"]: x for x in res["hit_cost"] if x["hash"] == "fast"}
    sh = {x["blocks"]: x for x in res["hit_cost"] if x["hash"] == "sha256"}
    nb = max(set(f) & set(sh))
    L.append(f"- sha256 / fast lookup at {nb} blocks: "
             f"{sh[nb]['match_cached']['p50'] / f[nb]['match_cached']['p50']:.1f}x (the same "
             f"probes; the difference is the hash function).")
    L.append("")
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests and repetitions")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the Markdown from benchmarks/out/prefix.json")
    args = ap.parse_args()
    if args.render:
        with open(OUT_JSON) as f:
            md = markdown(json.load(f))
        with open(OUT_MD, "w") as f:
            f.write(md)
        print(md)
        return
    req = 25 if args.quick else 100
    decode = 16 if args.quick else 32
    reps = 200 if args.quick else 1000
    caps = [1024, 2048]
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "shmkv": shmkv.__version__, "quick": args.quick, "seed": args.seed,
            "requests_per_worker": req, "decode": decode, "hit_reps": reps, "shape": SHAPE,
            "loadavg_start": os.getloadavg()[0]}
    res = {"meta": meta, "serve": [], "hit_cost": []}
    t0 = time.perf_counter()
    for cap in caps:
        for mode in ("shared", "private"):
            log(f"serve: {mode}, {cap} blocks, {WORKERS} x {req} requests ...")
            r = serve(mode, cap, req, decode, args.seed)
            log(f"  hit rate {100 * r['hit_rate']:.1f}%, peak used {r['peak_used_blocks']}, "
                f"evicted {r['cached_blocks_evicted']}, {r['wall_s']:.1f} s")
            res["serve"].append(r)
    for h in ("fast", "sha256"):
        log(f"hit cost: {h} ...")
        res["hit_cost"] += hit_cost(h, [16, 128] if args.quick else [16, 128, 512], reps)
    res["meta"]["total_s"] = time.perf_counter() - t0
    res["meta"]["loadavg_end"] = os.getloadavg()[0]
    os.makedirs(os.path.dirname(OUT_JSON), exist_ok=True)
    with open(OUT_JSON, "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(OUT_MD, "w") as f:
        f.write(md)
    print(md)
    log(f"done in {res['meta']['total_s']:.1f} s: {OUT_JSON}, {OUT_MD}")


if __name__ == "__main__":
    main()
