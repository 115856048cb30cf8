"""Worker of test_attention.py, in its own module so that spawned processes import it."""
import time

import numpy as np

import shmkv


def writer(name, seed, n, ready, go, release):
    """Another process: one sequence, appended token by token while the parent reads."""
    cache = shmkv.KVCache.attach(name)
    try:
        sid = cache.create_sequence()
        k, v = tokens(cache.config, seed, n)
        cache.append(sid, k[:, :8], v[:, :8])
        ready.put(sid)
        go.wait(30)
        for t in range(8, n):
            cache.append(sid, k[:, t:t + 1], v[:, t:t + 1])
            time.sleep(0.0005)          # a decode loop's pace: the reader overlaps many appends
        ready.put("done")
        release.wait(60)                # keep the sequence until the parent is done
        cache.free(sid)
    finally:
        cache.close()


def tokens(cfg, seed, n):
    rng = np.random.default_rng(seed)
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    return (rng.standard_normal(shape).astype(cfg.numpy_dtype),
            rng.standard_normal(shape).astype(cfg.numpy_dtype))
