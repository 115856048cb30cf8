"""Prefill error and time per path (RESULTS_attention_amx.md, seventh pass): every pool
dtype, a float32 q or one exactly bf16 (a bf16 model's), K scaled by each "spread" (the
scores' standard deviation), the AVX-512 FMA item against the AMX tiles (where the CPU has
them) and, with --base, another build's tiles; all interleaved in one process.

Errors are against float64 over every 37th row and every head, relative to
max(1, |reference|) as in the tests (bound 2e-5).  Times are medians of --rounds calls.
Spread 16 is where denormal weights used to cost 2.5-4x (RESULTS_attention_amx.md).

    .venv/bin/python benchmarks/prefill_precision.py [--dtypes ...] [--spreads 1,8,16]
                                                     [--base OTHER/_attention*.so]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import uuid

import numpy as np

import shmkv
from shmkv import _attention

L, R, HKV, HQ, D = 4096, 512, 8, 32, 128      # 512 rows into 4k, one Llama-3-8B layer


def reference_rows(k, v, q, rows):
    """float64 attention of the given rows (causal: row r sees L - R + r + 1 keys)."""
    g, out = HQ // HKV, {}
    for r in rows:
        n = L - R + r + 1
        o = np.empty((HQ, D))
        for h in range(HQ):
            s = k[:n, h // g] @ q[r, h].astype(np.float64) / math.sqrt(D)
            p = np.exp(s - s.max())
            o[h] = (p / p.sum()) @ v[:n, h // g]
        out[r] = o
    return out


def run(dtype, spread, qkind, paths, rounds):
    cfg = shmkv.CacheConfig(num_layers=1, num_kv_heads=HKV, head_dim=D, num_blocks=L // 16 + 8,
                            block_size=16, dtype=dtype, max_seqs=4)
    cache = shmkv.KVCache.create(f"bench-pp-{uuid.uuid4().hex[:8]}", cfg)
    try:
        rng = np.random.default_rng(1)
        sid = cache.create_sequence()
        cache.append(sid, (rng.standard_normal((1, L, HKV, D)) * spread).astype(cfg.compute_dtype),
                     rng.standard_normal((1, L, HKV, D)).astype(cfg.compute_dtype))
        q = rng.standard_normal((R, HQ, D)).astype(np.float32)
        if qkind == "bf16":
            q = (q.view(np.uint32) & 0xFFFF0000).view(np.float32)
        k, v = (x[0].astype(np.float64) for x in cache.gather(sid))
        out = np.empty_like(q)
        times = {name: [] for name in paths}
        got = {}
        for r in range(rounds + 1):                 # round 0 warms up and keeps the outputs
            for name, (mod, isa) in paths.items():
                mod._force_isa(isa)
                t0 = time.perf_counter_ns()
                mod.attention(cache, 0, q, [sid], q_lens=[R], out=out)
                t = time.perf_counter_ns() - t0
                if r:
                    times[name].append(t / 1e6)
                else:
                    got[name] = out.copy()
        for mod, _ in paths.values():
            mod._force_isa(None)
        rows = list(range(0, R, 37)) + [R - 1]
        ref = reference_rows(k, v, q, rows)
        scale = max(1.0, max(np.abs(o).max() for o in ref.values()))
        err = {name: max(np.abs(o[r] - ref[r]).max() for r in rows) / scale
               for name, o in got.items()}
        return {name: (err[name], float(np.median(times[name]))) for name in paths}
    finally:
        cache.close()
        cache.unlink()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,float16,bfloat16,int8,float8_e4m3")
    ap.add_argument("--spreads", default="1,8,16")
    ap.add_argument("--q", default="float32,bf16", help="q kinds: float32, bf16 (exactly bf16)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--base", metavar="SO", help="another build's _attention*.so: its tiles too")
    args = ap.parse_args(argv)
    cpu = _attention.isa()
    paths = {"FMA item (avx512)": (_attention, "avx512")} if cpu in ("avx512", "amx") else {}
    if cpu == "amx":
        paths["tiles"] = (_attention, "amx")
    if not paths:
        print(f"this CPU's kernel ISA is {cpu}: no AVX-512 FMA item or tiles to compare")
        return 0
    mods = [_attention]
    if args.base:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from attention_bench import load_base
        base = load_base(args.base)
        paths["tiles @base" if cpu == "amx" else "FMA @base"] = (base, "amx" if cpu == "amx" else "avx512")
        mods.append(base)
    for m in mods:
        m.set_num_threads(args.threads)
    print(f"kernel ISA {cpu}, {args.threads} threads, load {os.getloadavg()[0]:.2f}; "
          f"512 rows into 4k, 8 kv heads x 4, d 128; error / median time per path")
    print("| pool | q | spread | " + " | ".join(paths) + " |")
    print("|---|---|---|" + "---|" * len(paths))
    for dt in args.dtypes.split(","):
        for qk in args.q.split(","):
            for sp in (float(x) for x in args.spreads.split(",")):
                res = run(dt, sp, qk, paths, args.rounds)
                cells = " | ".join(f"{e:.1e}, {t:.1f} ms" for e, t in res.values())
                print(f"| {dt} | {qk} | {sp:g} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
