"""The remote tier: shmkv's Redis Cluster tier against an LMCache-style peer.

    python benchmarks/tier_bench.py            # full: benchmarks/RESULTS_tier.md
    python benchmarks/tier_bench.py --quick    # smaller, into benchmarks/out/

Starts its own 3-master Redis Cluster on free loopback ports (Debian's redis-server) and
stops it at the end.  Every figure is measured in the same run as its baseline:

- **remote prefix load**: host B's ``create_sequence(tokens=)`` of a prompt whose n full
  blocks (Llama-3-8B layout: 32 layers, 8 kv heads, head_dim 128, float16, block 16: 2 MiB
  a block) host A wrote through; B's local copies are evicted between repetitions, so
  every repetition reads the tier: GETs, whole-value checks, appends into B's pool.
  Against (1) an LMCache-style peer: redis-py's cluster client, one value per 256-token
  chunk (K and V of the chunk's tokens), GET chunk by chunk, landed in B's pool with
  ``append`` (the same last step); (2) "client choice": the same tier values fetched
  with a redis-py cluster pipeline instead of shmkv's lean transport, same checks and
  appends; (3) the server's own speed: ``redis-benchmark --cluster`` GETs of a value of
  the same size (one connection, and four).
- **write-through on the decode loop**: the vLLM decode flow on the 8B layout, 4
  sequences (reserve with token ids, write 32 layers, commit, attention over 32 layers
  for 32 q heads); each sequence fills a block every 16 steps, which the tier writes
  through.  Step time with the tier set against unset, interleaved in rounds.
- **first token on host B** (needs transformers): the transformers integration's model
  (benchmarks/transformers_bench.py); host A computes a prompt and writes it through;
  host B's ``ShmkvCache(kv, prompt_ids=...)`` + ``generate(max_new_tokens=1)`` with a
  tier hit against recomputing a prompt nobody has.

Medians; the machine is shared, so the load average is printed beside every section.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from timing import summarize  # noqa: E402

import shmkv  # noqa: E402
from shmkv.tier.cluster import LocalCluster, free_ports  # noqa: E402

LLAMA8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")
SEED = 0x7155
CHUNK = 256                      # LMCache's chunk size in tokens


def load() -> str:
    return "%.2f" % os.getloadavg()[0]


def gbps(nbytes: int, ns: float) -> float:
    return nbytes / ns if ns > 0 else float("nan")


def med(xs):
    return float(np.median(xs))


def make_cache(tag, num_blocks, max_seqs=16, **kw):
    cfg = shmkv.CacheConfig(**{**LLAMA8B, **kw}, num_blocks=num_blocks, max_seqs=max_seqs)
    return shmkv.KVCache.create(f"shmkv-bench-tier-{tag}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                                cfg, hash_seed=SEED)


def drop_local(cache):
    """Evicts every cached block of a cache with no live sequence (so the next request
    misses locally): one sequence reserves the whole pool, then is freed."""
    s = cache.create_sequence()
    free = cache.stats()["free_blocks"]
    if free:
        cache.reserve(s, free * cache.config.block_size)
    cache.free(s)


# ---- remote prefix load ------------------------------------------------------------------
def lmcache_peer_load(rc, b, key_prefix, toks, n_tokens):
    """LMCache-style: one value per 256-token chunk, GET each, land it in b's pool."""
    cfg = b.config
    shape_tok = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    s = b.create_sequence()
    got = 0
    for c0 in range(0, n_tokens, CHUNK):
        n = min(CHUNK, n_tokens - c0)
        raw = rc.get(key_prefix + b"%d" % c0)
        kv = np.frombuffer(raw, cfg.numpy_dtype).reshape(2, cfg.num_layers, n, *shape_tok[1:])
        b.append(s, kv[0], kv[1], tokens=toks[c0:c0 + n])
        got += len(raw)
    return s, got


def redispy_pipeline_load(rc, b, lay, toks, hashes):
    """Client choice: the tier's own values through a redis-py cluster pipeline."""
    bs = lay.block_size
    s = b.create_sequence()
    pipe = rc.pipeline()
    for h in hashes:
        pipe.get(lay.key(int(h[0]), int(h[1])))
    vals = pipe.execute()
    for i, val in enumerate(vals):
        t = toks[i * bs:(i + 1) * bs]
        h = hashes[i]
        if val is None or lay.check(val, int(h[0]), int(h[1]), t) is not None:
            break
        _, k, v = lay.views(val)
        b.append(s, k, v, tokens=t)
    return s


def redis_benchmark(port, size, clients, n):
    exe = shutil.which("redis-benchmark")
    if not exe:
        return float("nan")
    r = subprocess.run([exe, "--cluster", "-p", str(port), "-t", "set,get", "-d", str(size),
                        "-n", str(n), "-c", str(clients), "--csv"], capture_output=True,
                       timeout=300)
    for line in r.stdout.decode().splitlines():
        if line.startswith('"GET"'):
            return float(line.split(",")[1].strip('"')) * size / 1e9
    return float("nan")


def load_section(cluster, sizes, reps):
    from redis.cluster import RedisCluster

    from shmkv.tier.codec import Layout

    nmax = max(sizes)
    a = make_cache("a", nmax + 8)
    b = make_cache("b", nmax + 8)
    rc = RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    rows = []
    try:
        a.set_tier(shmkv.RedisTier(cluster.url, timeout=5.0))
        tb = shmkv.RedisTier(cluster.url, timeout=5.0)
        b.set_tier(tb)
        lay = Layout(b._tier_layout(), b.config.numpy_dtype)
        bpb = b.config.bytes_per_block
        bs = b.config.block_size
        rng = np.random.default_rng(0)
        # host A computes one prompt per size and repetition, writes it through
        prompts = {}
        for n in sizes:
            for r in range(reps):
                toks = rng.integers(0, 32000, n * bs + 1)
                s = a.create_sequence(tokens=toks)
                k = rng.standard_normal((32, n * bs, 8, 128)).astype(np.float16)
                a.append(s, k, k, tokens=toks[:n * bs])
                a.flush_tier(60)
                # the LMCache-style peer stores the same tokens its own way
                kvs = np.stack([k, k])
                for c0 in range(0, n * bs, CHUNK):
                    m = min(CHUNK, n * bs - c0)
                    rc.set(b"lmc:%d:%d:%d" % (n, r, c0),
                           np.ascontiguousarray(kvs[:, :, c0:c0 + m]).tobytes())
                a.free(s)
                drop_local(a)
                prompts[n, r] = toks
        # warm-up, untimed: connections, topology, buffers (the first prompt, both ways)
        n0 = sizes[0]
        for _ in range(2):
            drop_local(b)
            b.free(b.create_sequence(tokens=prompts[n0, 0]))
            drop_local(b)
            b.free(lmcache_peer_load(rc, b, b"lmc:%d:0:" % n0, prompts[n0, 0], n0 * bs)[0])
        for n in sizes:
            t_tier, t_peer, t_py = [], [], []
            for r in range(reps):                      # interleaved: tier, peer, redis-py
                toks = prompts[n, r]
                drop_local(b)
                hits0 = b.stats()["tier_hits"]
                t0 = time.perf_counter_ns()
                s = b.create_sequence(tokens=toks)
                t_tier.append(time.perf_counter_ns() - t0)
                assert b.seq_len(s) == n * bs, (b.seq_len(s), n)
                assert b.stats()["tier_hits"] - hits0 == n
                b.free(s)
                drop_local(b)
                t0 = time.perf_counter_ns()
                s, _ = lmcache_peer_load(rc, b, b"lmc:%d:%d:" % (n, r), toks, n * bs)
                t_peer.append(time.perf_counter_ns() - t0)
                b.free(s)
                drop_local(b)
                b.set_tier(None)
                hashes = b._tier_hashes(toks)
                t0 = time.perf_counter_ns()
                s = redispy_pipeline_load(rc, b, lay, toks, hashes)
                t_py.append(time.perf_counter_ns() - t0)
                assert b.seq_len(s) == n * bs
                b.free(s)
                drop_local(b)
                b.set_tier(tb)
            rows.append(dict(blocks=n, bytes=n * bpb, tier=summarize(t_tier),
                             peer=summarize(t_peer), redispy=summarize(t_py)))
        vsize = lay.size
        rb1 = redis_benchmark(cluster.ports[0], vsize, 1, 200 if reps > 3 else 60)
        rb4 = redis_benchmark(cluster.ports[0], vsize, 4, 200 if reps > 3 else 60)
        return rows, dict(value_bytes=vsize, redis_benchmark_c1=rb1, redis_benchmark_c4=rb4,
                          tier_stats=tb.stats())
    finally:
        rc.close()
        for c in (a, b):
            c.close()
            c.unlink()


# ---- write-through cost on the decode loop ----------------------------------------------
def decode_section(cluster, rounds, steps, ctx=512, batch=4):
    a = make_cache("dec", batch * (ctx + rounds * steps * 2) // 16 + 64)
    tier = shmkv.RedisTier(cluster.url, timeout=5.0)
    rng = np.random.default_rng(1)
    cfg = a.config
    res = {"off": [], "on": []}
    try:
        sids, next_tok = [], []
        for _ in range(batch):
            toks = rng.integers(0, 32000, ctx)
            s = a.create_sequence()
            k = rng.standard_normal((32, ctx, 8, 128)).astype(np.float16)
            a.append(s, k, k, tokens=toks)
            sids.append(s)
            next_tok.append(int(toks[-1]))
        kl = rng.standard_normal((1, 8, 128)).astype(np.float16)
        q = rng.standard_normal((batch, 32, 128)).astype(np.float32)

        def step():
            slots = []
            for s in sids:
                slots.append(a.reserve(s, 1, tokens=[int(rng.integers(0, 32000))])[0])
            sl = np.asarray(slots, np.int64)
            kk = np.repeat(kl, batch, 0)
            for layer in range(cfg.num_layers):
                a.write(layer, sl, kk, kk)
                a.attention(layer, q, sids)
            for s in sids:
                a.commit(s)

        for _ in range(steps):            # warm
            step()
        for r in range(rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                a.set_tier(tier if mode == "on" else None)
                ts = []
                for _ in range(steps):
                    t0 = time.perf_counter_ns()
                    step()
                    ts.append(time.perf_counter_ns() - t0)
                if mode == "on":
                    a.flush_tier(60)      # (outside the timed steps)
                res[mode] += ts
        a.set_tier(None)
        written = tier.stats().get("written", 0)
    finally:
        a.close()
        a.unlink()
    return dict(off=summarize(res["off"]), on=summarize(res["on"]),
                mean_off=float(np.mean(res["off"])), mean_on=float(np.mean(res["on"])),
                steps=len(res["on"]), written=written, batch=batch, ctx=ctx)


# ---- first token on host B ---------------------------------------------------------------
def ttft_section(cluster, lengths, reps):
    try:
        import torch
        from transformers_bench import make_model
    except ImportError as e:
        return {"skipped": str(e)}
    from shmkv.integrations.transformers import ShmkvCache, config_for

    torch.set_num_threads(1)
    shmkv.set_num_threads(1)
    model = make_model("shmkv")
    out = []
    for length in lengths:
        cfg = config_for(model.config, num_blocks=(length // 16 + 8) * (2 * reps + 4),
                         block_size=16, max_seqs=16)
        a, b = (shmkv.KVCache.create(f"shmkv-bench-ttft-{tag}-{uuid.uuid4().hex[:6]}", cfg,
                                     hash_seed=SEED) for tag in "ab")
        a.set_tier(shmkv.RedisTier(cluster.url, timeout=5.0))
        b.set_tier(shmkv.RedisTier(cluster.url, timeout=5.0))
        g = torch.Generator().manual_seed(length)
        hit_t, cold_t, hit_tokens = [], [], 0

        def first_token(kv, ids):
            with torch.inference_mode():
                t0 = time.perf_counter_ns()
                past = ShmkvCache(kv, prompt_ids=ids)
                hit = past.get_seq_length()
                model.generate(ids, past_key_values=past, max_new_tokens=1, do_sample=False)
                t = time.perf_counter_ns() - t0
            past.close()
            return t, hit

        try:
            warm = torch.randint(0, model.config.vocab_size, (1, 32), generator=g)
            first_token(b, warm)
            for _ in range(reps):
                ids = torch.randint(0, model.config.vocab_size, (1, length), generator=g)
                first_token(a, ids)                 # host A computes it, writes through
                a.flush_tier(60)
                t, hit = first_token(b, ids)        # host B: a tier hit
                hit_t.append(t)
                hit_tokens = hit
                cold = torch.randint(0, model.config.vocab_size, (1, length), generator=g)
                cold_t.append(first_token(b, cold)[0])   # host B: nobody has it
        finally:
            for c in (a, b):
                c.close()
                c.unlink()
        out.append(dict(length=length, hit=summarize(hit_t), cold=summarize(cold_t),
                        hit_tokens=hit_tokens))
    return {"rows": out}


# ---- report ------------------------------------------------------------------------------
def render(meta, load_rows, extra, dec, ttft):
    L = ["## Remote tier (Redis Cluster, `shmkv.RedisTier`)", ""]
    L.append(f"{meta['machine']}; Redis {meta['redis']} (3 masters on loopback, started by "
             f"the benchmark); redis-py {meta['redispy']}, hiredis {meta['hiredis']}; load "
             f"average {meta['load_start']} at the start, {meta['load_end']} at the end. "
             "Medians. Targets: remote prefix load >= 2x the LMCache-style peer and >= 50% "
             "of redis-benchmark for values of that size; write-through < 5% on the decode "
             "step.")
    L += ["", "### Remote prefix load (Llama-3-8B layout, 2 MiB a block)", "",
          f"Load average {extra['load']} at the start of this section. *shmkv tier*: host "
          "B's `create_sequence(tokens=)` reading n blocks from the tier (pipelined GETs by "
          "node, values received straight into page-aligned buffers, every value checked "
          "whole, appended into the pool). *LMCache-style*: redis-py's cluster client, one "
          "value per 256-token chunk, GET per chunk, appended into the same pool. *redis-py "
          "pipeline*: shmkv's own values and checks, fetched through a redis-py cluster "
          "pipeline instead (the client choice).", "",
          "| blocks | MiB | shmkv tier | LMCache-style (redis-py) | ratio | redis-py pipeline, same values | target >= 2x |",
          "|---|---|---|---|---|---|---|"]
    for r in load_rows:
        t, p, y = (r[k]["median_ns"] for k in ("tier", "peer", "redispy"))
        ratio = p / t
        L.append(f"| {r['blocks']} | {r['bytes'] / 2**20:.0f} | {gbps(r['bytes'], t):.2f} GB/s "
                 f"({t / 1e6:.1f} ms) | {gbps(r['bytes'], p):.2f} GB/s ({p / 1e6:.1f} ms) | "
                 f"{ratio:.2f}x | {gbps(r['bytes'], y):.2f} GB/s | "
                 f"{'PASS' if ratio >= 2 else 'FAIL'} |")
    best = max(extra["redis_benchmark_c1"], extra["redis_benchmark_c4"])
    big = max(load_rows, key=lambda r: r["blocks"])
    tier_big = gbps(big["bytes"], big["tier"]["median_ns"])
    L += ["", f"`redis-benchmark --cluster -t set,get -d {extra['value_bytes']}` (GET, "
          f"the server's own speed for values of this size): "
          f"{extra['redis_benchmark_c1']:.2f} GB/s with 1 connection, "
          f"{extra['redis_benchmark_c4']:.2f} GB/s with 4. The tier at {big['blocks']} blocks: "
          f"{tier_big:.2f} GB/s = {100 * tier_big / best:.0f}% of the better "
          f"(target >= 50%: {'PASS' if tier_big >= best / 2 else 'FAIL'}).", ""]
    L += ["### Write-through on the decode loop", "",
          f"Load average {dec['load']} at the start. {dec['batch']} sequences of "
          f"{dec['ctx']}+ tokens, Llama-3-8B layout; one step = reserve 1 token each (with "
          "its id), write 32 layers, attention over 32 layers (32 q heads), commit each "
          "(a block fills every 16 steps per sequence: the tier writes 2 MiB through on a "
          f"background thread). {dec['steps']} steps each way, interleaved in rounds; "
          f"{dec['written']} blocks written through.", "",
          "| | median step | mean step |", "|---|---|---|",
          f"| tier unset | {dec['off']['median_ns'] / 1e3:.0f} µs | {dec['mean_off'] / 1e3:.0f} µs |",
          f"| tier set (write-through) | {dec['on']['median_ns'] / 1e3:.0f} µs | "
          f"{dec['mean_on'] / 1e3:.0f} µs |"]
    cost_med = dec["on"]["median_ns"] / dec["off"]["median_ns"] - 1
    cost_mean = dec["mean_on"] / dec["mean_off"] - 1
    L += ["", f"Cost: {100 * cost_med:+.1f}% on the median step, {100 * cost_mean:+.1f}% on "
          f"the mean (target < 5%: {'PASS' if max(cost_med, cost_mean) < 0.05 else 'FAIL'}).",
          ""]
    L += ["### First token on host B (transformers integration)", ""]
    if "skipped" in ttft:
        L.append(f"Skipped: {ttft['skipped']}.")
    else:
        L += [f"Load average {ttft['load']} at the start. The model of "
              "benchmarks/transformers_bench.py (Llama architecture from a config: 4 layers, "
              "2 kv heads, head_dim 64, float32; 64 KiB a block). Host A computes the prompt "
              "and writes it through (flushed); host B's first request for it: "
              "`ShmkvCache(kv, prompt_ids=ids)` (the tier hit lands in B's pool) + "
              "`generate(max_new_tokens=1)`. Recompute: B's first token of a prompt nobody "
              "has (one tier miss included).", "",
              "| prompt | B with a tier hit | hit tokens | B recomputing | ratio |",
              "|---|---|---|---|---|"]
        for r in ttft["rows"]:
            h, c = r["hit"]["median_ns"], r["cold"]["median_ns"]
            L.append(f"| {r['length']} | {h / 1e6:.1f} ms | {r['hit_tokens']} | "
                     f"{c / 1e6:.1f} ms | {h / c:.3f}x |")
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=["load", "decode", "ttft"], default=None)
    args = ap.parse_args()
    import redis

    try:
        import hiredis
        hv = hiredis.__version__
    except ImportError:
        hv = "not installed"
    rv = subprocess.run(["redis-server", "--version"], capture_output=True).stdout.decode()
    meta = dict(machine=f"{os.cpu_count()} CPUs, {platform.machine()}",
                redis=rv.split("v=")[1].split()[0] if "v=" in rv else "?",
                redispy=redis.__version__, hiredis=hv, load_start=load())
    sizes = [1, 4, 16] if args.quick else [1, 4, 16, 64]
    reps = 3 if args.quick else 5
    cluster = LocalCluster(free_ports(3)).start()
    try:
        lrows, extra, dec, ttft = [], {"redis_benchmark_c1": float("nan"),
                                       "redis_benchmark_c4": float("nan"),
                                       "value_bytes": 0, "load": load()}, None, {}
        if args.only in (None, "load"):
            ld = load()
            lrows, extra = load_section(cluster, sizes, reps)
            extra["load"] = ld
            cluster.flushall()
        if args.only in (None, "decode"):
            ld = load()
            dec = decode_section(cluster, rounds=4 if args.quick else 8,
                                 steps=32 if args.quick else 64)
            dec["load"] = ld
            cluster.flushall()
        if args.only in (None, "ttft"):
            ld = load()
            ttft = ttft_section(cluster, [1024] if args.quick else [1024, 2048],
                                3 if args.quick else 5)
            ttft["load"] = ld
    finally:
        cluster.stop()
    meta["load_end"] = load()
    doc = dict(meta=meta, load=lrows, extra=extra, decode=dec, ttft=ttft)
    if args.only is None:
        text = render(meta, lrows, extra, dec, ttft)
        path = args.out or os.path.join(HERE, "out" if args.quick else "",
                                        "RESULTS_tier.md")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        print(text)
    print(json.dumps(doc, default=str)[:20000], file=sys.stderr)


if __name__ == "__main__":
    main()
