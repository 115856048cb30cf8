"""batch_block_tables: the list form (the contract's) against the int64-array form.

    python benchmarks/bbt_bench.py [--rounds 31] [--calls 2000]

256 sequences of 1..1024 tokens (as suite.py's bbt256, small config), the same sids passed
as a Python list of ints, a tuple of ints and a native int64 numpy array.  The forms are
interleaved round by round (each round times ``calls`` calls of every form), so the ratios
are against a baseline measured in the same run; medians of the rounds, per call.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

import numpy as np

import shmkv

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from timing import summarize  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    cfg = shmkv.CacheConfig(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=20000,
                            block_size=16, dtype="float16", max_seqs=1024)
    name = f"shmkv-bbt-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cache = shmkv.KVCache.create(name, cfg)
    try:
        lens = np.random.default_rng(1).integers(1, 1025, 256)
        sids = []
        for n in lens:
            s = cache.create_sequence()
            cache.reserve(s, int(n))
            sids.append(s)
        forms = {"list of ints": list(sids), "tuple of ints": tuple(sids),
                 "int64 array": np.array(sids, np.int64)}
        want = cache.batch_block_tables(forms["int64 array"])
        for f in forms.values():                    # every form gives the same answer
            got = cache.batch_block_tables(f)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert want[1].tolist() == lens.tolist()
        ts = {k: [] for k in forms}
        bbt = cache.batch_block_tables
        for r in range(args.rounds + 1):            # round 0 warms up
            for k, f in forms.items():
                t0 = time.perf_counter_ns()
                for _ in range(args.calls):
                    bbt(f)
                t = (time.perf_counter_ns() - t0) / args.calls
                if r:
                    ts[k].append(t)
        base = summarize(ts["int64 array"])["median_ns"]
        print(f"load {os.getloadavg()[0]:.2f}; medians of {args.rounds} rounds x "
              f"{args.calls} calls, 256 sids")
        print("| form | median | p10 - p90 | / int64 array |")
        print("|---|---|---|---|")
        for k in forms:
            s = summarize(ts[k])
            print(f"| {k} | {s['median_ns'] / 1e3:.2f} µs | {s['p10_ns'] / 1e3:.2f} - "
                  f"{s['p90_ns'] / 1e3:.2f} µs | {s['median_ns'] / base:.2f}x |")
    finally:
        cache.close()
        cache.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
