"""One "host" of tools/netlab.py (tests/test_hosts.py, ``make demo-hosts``): run on a host
of the lab (its own network and /dev/shm), it makes a segment there with the tier set and answers one JSON command
per line on stdin with one JSON line on stdout, so that one process lives through a
fault (idle connections included):

- ``{"op": "prefill", "seed": S, "blocks": N}``: computes a prompt of N blocks (K/V and
  token ids from the seed) and writes it through to the tier; -> what was written
- ``{"op": "lookup", "seed": S, "blocks": N}``: asks for that prompt (the local hit, then
  the tier); -> tokens found, seconds, whether the K/V equal the seed's
- ``{"op": "tier", ...}``: a new RedisTier with these keyword arguments
- ``{"op": "stats"}``: the tier's and the segment's counters

argv: segment name, tier URL.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

import shmkv

CFG = dict(num_layers=4, num_kv_heads=2, head_dim=32, num_blocks=700, block_size=8,
           max_seqs=16, dtype="float16")
SEED = 0x5EED


def prompt(seed: int, blocks: int):
    rng = np.random.default_rng(seed)
    n = blocks * CFG["block_size"]
    toks = rng.integers(1, 50_000, n + 1).astype(np.int64)
    shape = (CFG["num_layers"], n, CFG["num_kv_heads"], CFG["head_dim"])
    return (toks, rng.standard_normal(shape).astype(np.float16),
            rng.standard_normal(shape).astype(np.float16))


def main() -> int:
    name, url = sys.argv[1], sys.argv[2]
    cache = shmkv.KVCache.create(name, shmkv.CacheConfig(**CFG), hash_seed=SEED)
    tier = shmkv.RedisTier(url, timeout=0.5, connect_timeout=0.3, backoff=(0.2, 1.0))
    cache.set_tier(tier)
    try:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "prefill":
                toks, k, v = prompt(cmd["seed"], cmd["blocks"])
                before = tier.stats().get("written", 0)
                s = cache.create_sequence(tokens=toks)
                done = cache.seq_len(s)
                cache.append(s, k[:, done:], v[:, done:], tokens=toks[done:-1])
                cache.flush_tier(30)
                cache.free(s)
                out = {"written": tier.stats().get("written", 0) - before}
            elif op == "lookup":
                toks, k, v = prompt(cmd["seed"], cmd["blocks"])
                t0 = time.monotonic()
                s = cache.create_sequence(tokens=toks)
                dt = time.monotonic() - t0
                n = cache.seq_len(s)
                kb, vb = cache.gather(s)
                cache.free(s)
                out = {"tokens": n, "seconds": dt,
                       "equal": bool(np.array_equal(kb, k[:, :n])
                                     and np.array_equal(vb, v[:, :n]))}
            elif op == "tier":
                tier = shmkv.RedisTier(url, **cmd)
                cache.set_tier(tier)
                out = {}
            elif op == "stats":
                out = {"tier": tier.stats(),
                       "segment": {k: v for k, v in cache.stats().items()
                                   if k.startswith("tier_")}}
            else:
                out = {"error": f"unknown op {op!r}"}
            print(json.dumps(out), flush=True)
    finally:
        cache.set_tier(None)
        cache.unlink()
        cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
