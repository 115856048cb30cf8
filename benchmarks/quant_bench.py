"""Quantized pools: decode attention speed and capacity, int8 / float8_e4m3 vs
float16, measured in the same run.

    python benchmarks/quant_bench.py            # 4k and 32k contexts -> benchmarks/out/quant_speed.json
    python benchmarks/quant_bench.py --quick    # small
    python benchmarks/quant_bench.py --append   # the write side only (quantizer per ISA)

One layer of Llama-3-8B (32 q heads over 8 kv heads, head_dim 128, block 16); decode: one
query row per sequence.  The three pools hold the same K/V (random normals; speed does not
depend on the values).  Calls of the three dtypes are interleaved round by round (A B C A B
C ...) so that load from the other users of the machine falls on all of them alike; the
table gives medians and the ratio to float16, and each pool's read floor (every byte of
its K and V pools, and an int8 pool's scales, read once by ``_bench.bench_read`` on
the kernel's threads), timed in the same rounds.  ``os.getloadavg()`` is printed before and
after.  Tokens per GiB: a whole Llama-3-8B (32 layers) at each dtype, from
``CacheConfig.bytes_per_token`` (the int8 pool's per-token scales included).

Writes (``bench_append``): ``append`` of 1 token (a decode step) and of 512 tokens (a
prefill chunk) to a whole Llama-3-8B (32 layers, float16 input) on each pool, the pools'
pages touched first (a fresh segment's page faults are not the quantizer's), the three pools
interleaved call by call, medians; once per quantizer path (``_quant._force_quant_isa``:
scalar, avx2, avx512 where the CPU has them), float16 measured in the same rounds as the
baseline of each ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

import numpy as np

import shmkv
from shmkv import _attention, _bench, _quant

HERE = os.path.dirname(os.path.abspath(__file__))
HQ, HKV, D, BS = 32, 8, 128, 16
DTYPES = ("float16", "int8", "float8_e4m3")


def make(dtype, batch, length, seed=0):
    blocks = batch * -(-length // BS)
    cfg = shmkv.CacheConfig(num_layers=1, num_kv_heads=HKV, head_dim=D, num_blocks=blocks,
                            block_size=BS, dtype=dtype, max_seqs=max(4, batch))
    name = f"shmkv-qbench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cache = shmkv.KVCache.create(name, cfg)
    rng = np.random.default_rng(seed)
    sids = []
    for _ in range(batch):
        sid = cache.create_sequence()
        for o in range(0, length, 4096):
            n = min(4096, length - o)
            k = rng.standard_normal((1, n, HKV, D), np.float32)
            v = rng.standard_normal((1, n, HKV, D), np.float32)
            if dtype == "float16":
                k, v = k.astype(np.float16), v.astype(np.float16)
            cache.append(sid, k, v)
        sids.append(sid)
    return cache, sids


def bench_case(batch, length, rounds, threads):
    if threads:
        _attention.set_num_threads(threads)
    caches = {dt: make(dt, batch, length) for dt in DTYPES}
    q = np.random.default_rng(1).standard_normal((batch, HQ, D)).astype(np.float32)
    out = np.empty_like(q)
    samples = {dt: [] for dt in DTYPES}
    floor = {dt: [] for dt in DTYPES}
    try:
        for dt in DTYPES:                                   # warm: page in, threads up
            c, s = caches[dt]
            for _ in range(3):
                c.attention(0, q, s, out=out)
        for _ in range(rounds):
            for dt in DTYPES:
                c, s = caches[dt]
                t0 = time.perf_counter_ns()
                c.attention(0, q, s, out=out)
                samples[dt].append(time.perf_counter_ns() - t0)
                # the read floor: every byte of the pools (and int8 scales) read once
                f = _bench.bench_read(c.key_cache(0)) + _bench.bench_read(c.value_cache(0))
                if dt == "int8":
                    f += _bench.bench_read(c.key_scales(0)) + _bench.bench_read(
                        c.value_scales(0))
                floor[dt].append(f * 1e9)
        kv_bytes = {dt: 2 * batch * length * HKV * D * (2 if dt == "float16" else 1)
                    + (2 * batch * length * HKV * 4 if dt == "int8" else 0) for dt in DTYPES}
    finally:
        for c, _ in caches.values():
            c.close()
            c.unlink()
    res = {}
    for dt in DTYPES:
        xs = sorted(samples[dt])
        fl = sorted(floor[dt])
        res[dt] = dict(median_ms=xs[len(xs) // 2] / 1e6, p10_ms=xs[len(xs) // 10] / 1e6,
                       p90_ms=xs[9 * len(xs) // 10] / 1e6, bytes=kv_bytes[dt],
                       floor_ms=fl[len(fl) // 2] / 1e6)
    base = res["float16"]["median_ms"]
    for dt in DTYPES:
        res[dt]["vs_fp16"] = res[dt]["median_ms"] / base
    return res


def _append_pool(dtype, blocks):
    cfg = shmkv.CacheConfig(num_layers=32, num_kv_heads=HKV, head_dim=D, num_blocks=blocks,
                            block_size=BS, dtype=dtype, max_seqs=4)
    cache = shmkv.KVCache.create(f"shmkv-qbench-a-{os.getpid()}-{uuid.uuid4().hex[:8]}", cfg)
    z = np.zeros((32, blocks * BS, HKV, D), np.float16)
    sid = cache.create_sequence()
    cache.append(sid, z, z)                                 # every page of the pools touched
    cache.free(sid)
    return cache


def bench_append(isas, rounds_1=3000, rounds_512=15):
    """{isa: {tokens: {dtype: median us, ...}}} for 1- and 512-token appends."""
    rng = np.random.default_rng(2)
    blocks = 2 * 512 // BS + 8
    caches = {dt: _append_pool(dt, blocks) for dt in DTYPES}
    res = {}
    try:
        for isa in isas:
            _quant._force_quant_isa(isa)
            res[isa] = {}
            for n, rounds in ((1, rounds_1), (512, rounds_512)):
                k = rng.standard_normal((32, n, HKV, D)).astype(np.float16)
                v = rng.standard_normal((32, n, HKV, D)).astype(np.float16)
                samples = {dt: [] for dt in DTYPES}
                sids = {dt: c.create_sequence() for dt, c in caches.items()}
                for _ in range(rounds):
                    for dt, c in caches.items():
                        if c.seq_len(sids[dt]) + n > 512:
                            c.free(sids[dt])
                            sids[dt] = c.create_sequence()
                        t0 = time.perf_counter_ns()
                        c.append(sids[dt], k, v)
                        samples[dt].append(time.perf_counter_ns() - t0)
                for dt, c in caches.items():
                    c.free(sids[dt])
                med = {dt: sorted(x)[len(x) // 2] / 1e3 for dt, x in samples.items()}
                res[isa][n] = {dt: dict(median_us=med[dt], vs_fp16=med[dt] / med["float16"])
                               for dt in DTYPES}
    finally:
        _quant._force_quant_isa(None)
        for c in caches.values():
            c.close()
            c.unlink()
    return res


def quant_isas():
    """The quantizer paths this CPU runs, portable first."""
    out = []
    for isa in ("scalar", "avx2", "avx512"):
        try:
            _quant._force_quant_isa(isa)
            out.append(isa)
        except ValueError:
            pass
    _quant._force_quant_isa(None)
    return out


def tokens_per_gib():
    out = {}
    for dt in DTYPES:
        cfg = shmkv.CacheConfig(num_layers=32, num_kv_heads=8, head_dim=128, num_blocks=16,
                                dtype=dt)
        out[dt] = dict(bytes_per_token=cfg.bytes_per_token,
                       tokens_per_gib=(1 << 30) // cfg.bytes_per_token)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: all)")
    ap.add_argument("--append", action="store_true", help="the appends only")
    ap.add_argument("--cases", default="", help="decode cases BxL,... (e.g. 8x4096,1x32768)")
    ap.add_argument("--json", default=os.path.join(HERE, "out", "quant_speed.json"))
    a = ap.parse_args(argv)
    if a.append:
        return main_append(a)
    cases = [(8, 512, 30), (1, 4096, 30)] if a.quick else [(8, 4096, 41), (1, 32768, 41),
                                                          (4, 32768, 21)]
    if a.cases:
        cases = [(int(b), int(n), 41) for b, n in (c.split("x") for c in a.cases.split(","))]
    threads = a.threads or _attention.get_num_threads()     # (reads SHMKV_ATTN_ISA first)
    meta = dict(load_before=os.getloadavg(), isa=_attention.isa(), threads=threads,
                cpus=os.cpu_count())
    print(f"load {meta['load_before']}, isa {meta['isa']}, threads {meta['threads']}")
    results = []
    for batch, length, rounds in cases:
        r = bench_case(batch, length, a.rounds or rounds, a.threads)
        results.append(dict(batch=batch, length=length, **{dt: r[dt] for dt in DTYPES}))
        print(f"{batch} x {length}: " + ", ".join(
            f"{dt} {r[dt]['median_ms']:.2f} ms ({r[dt]['vs_fp16']:.2f}x, floor "
            f"{r[dt]['floor_ms']:.2f})" for dt in DTYPES))
    meta["load_after"] = os.getloadavg()
    cap = tokens_per_gib()
    print("tokens per GiB (Llama-3-8B, 32 layers):",
          ", ".join(f"{dt} {cap[dt]['tokens_per_gib']}" for dt in DTYPES))
    print(f"load {meta['load_after']}")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(dict(meta=meta, results=results, capacity=cap), f, indent=1)
    return 0


def main_append(a):
    meta = dict(load_before=os.getloadavg(), cpus=os.cpu_count(),
                quant_isa=_quant._force_quant_isa(None))
    print(f"load {meta['load_before']}, quantizer isa (best) {meta['quant_isa']}")
    res = bench_append(quant_isas(), *((300, 5) if a.quick else ()))
    for isa, by_n in res.items():
        for n, r in by_n.items():
            print(f"quantizer {isa}, append {n} token(s), 32 layers: " + ", ".join(
                f"{dt} {r[dt]['median_us']:.1f} us ({r[dt]['vs_fp16']:.2f}x)" for dt in DTYPES))
    meta["load_after"] = os.getloadavg()
    print(f"load {meta['load_after']}")
    path = a.json.replace("quant_speed.json", "quant_append.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, results=res), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
