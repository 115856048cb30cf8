"""fuzz/make_corpus.py -- the seed corpus of the C segment fuzzer (segment_fuzz.c): real,
small segments after real workloads, copied byte for byte out of /dev/shm.  Owns the
seeds' recipe: float16, int8 and float8 pools; sequences, forks sharing blocks, prefix
hits, detached sequences, the event ring; and segments a process died in at each crash
point (so recovery has work to do: dead owners, half-done operations).

    python fuzz/make_corpus.py OUTDIR
"""
import os
import sys

import numpy as np

import shmkv
from shmkv import _core

BASE = dict(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=24, block_size=4,
            max_seqs=8, max_seq_len=32, max_procs=4, event_capacity=16)


def _kv(cfg, n, rng):
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    return (rng.standard_normal(shape).astype(cfg.compute_dtype),
            rng.standard_normal(shape).astype(cfg.compute_dtype))


def _workload(cache, rng):
    """Sequences of several lengths, prefix-hashed tokens, a fork, a detached one,
    a freed one (events stored and removed)."""
    cfg = cache.config
    toks = list(range(100, 100 + 4 * cfg.block_size))
    a = cache.create_sequence(tokens=toks)
    cache.append(a, *_kv(cfg, len(toks), rng))
    b = cache.fork(a)
    cache.append(b, *_kv(cfg, 3, rng))
    c = cache.create_sequence()
    cache.append(c, *_kv(cfg, 5, rng))
    cache.detach(c)
    d = cache.create_sequence(tokens=toks[:8])
    cache.append(d, *_kv(cfg, 8, rng))
    cache.free(d)
    return a


def _dump(name, out, tag):
    with open(os.path.join("/dev/shm", name), "rb") as f:
        data = f.read()
    with open(os.path.join(out, f"{tag}.seg"), "wb") as f:
        f.write(data)
    return len(data)


def _die_in(name, point, rng_seed):
    """A child attaches, arms the crash point, runs operations until it dies there."""
    pid = os.fork()
    if pid == 0:
        try:
            cache = shmkv.KVCache.attach(name)
            _core.set_crash_point(point)
            rng = np.random.default_rng(rng_seed)
            for _ in range(4):
                _workload(cache, rng)
                cache.reset_prefix_cache()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def main(out):
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(22)
    sizes = []
    for dtype in ("float16", "int8", "float8_e4m3"):
        name = f"shmkv-corpus-{os.getpid()}-{dtype}"
        cfg = shmkv.CacheConfig(**BASE, dtype=dtype)
        with shmkv.KVCache.create(name, cfg) as cache:
            try:
                sizes.append(_dump(name, out, f"{dtype}-empty"))
                _workload(cache, rng)
                sizes.append(_dump(name, out, f"{dtype}-used"))
                if dtype == "float16":
                    for i, point in enumerate(_core.CRASH_POINTS):
                        _die_in(name, point, i)
                        sizes.append(_dump(name, out, f"{dtype}-died-{point}"))
            finally:
                cache.unlink()
    print(f"{len(sizes)} seeds in {out} ({min(sizes)}-{max(sizes)} bytes)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build/fuzz/seeds")
