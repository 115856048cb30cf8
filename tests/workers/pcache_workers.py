"""Worker functions for tests/test_pcache.py (spawned processes import this module)."""
import os

import numpy as np

import shmkv
import shmkv._core as _core


def _kv(cfg, n, value):
    a = np.full((cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim), value, cfg.numpy_dtype)
    return a, a.copy()


def fill_cache_and_wait(name, n_lives, ready, go):
    """Runs n_lives sequence lives (leaving blocks and slots in this process's own
    cache), reports, then stays attached until told to go."""
    cache = shmkv.KVCache.attach(name)
    try:
        bs = cache.config.block_size
        for _ in range(n_lives):
            sid = cache.create_sequence()
            cache.reserve(sid, bs)
            cache.free(sid)
        ready.set()
        go.wait(timeout=60)
    finally:
        cache.close()


def fill_cache_and_die(name, ready):
    """Leaves blocks and slots in this process's cache, then dies without closing."""
    cache = shmkv.KVCache.attach(name)
    bs = cache.config.block_size
    sids = [cache.create_sequence() for _ in range(3)]
    for s in sids:
        cache.reserve(s, 2 * bs)
    for s in sids:
        cache.free(s)
    ready.set()
    os._exit(0)


def die_in_fast_path(name, point, sid):
    """Arms a crash point, then works on sid through the fast paths: a free (free_mid)
    of the exclusive sequence sid, or a grow by one block from a warm cache
    (grow_before_tail / grow_after_tail)."""
    cache = shmkv.KVCache.attach(name)
    cfg = cache.config
    bs = cfg.block_size
    warm = cache.create_sequence()        # warm the cache: a life leaves blocks in it
    cache.reserve(warm, 2 * bs)
    cache.free(warm)
    if point == "free_mid":
        cache.adopt(sid)
        _core.set_crash_point(point)
        cache.free(sid)
    else:
        k, v = _kv(cfg, bs, 7)
        _core.set_crash_point(point)
        cache.append(sid, k, v)
    os._exit(0)          # not reached when the crash point fires
