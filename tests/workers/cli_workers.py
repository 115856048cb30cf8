"""Worker functions for tests/test_cli.py (spawned processes; importable from tests/).

Every worker bounds its own lifetime, so a test that forgets one cannot hang the suite.
"""
import os
import time

import numpy as np

import shmkv


def _kv(cfg, n, seed):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim))
    k = k.astype(cfg.numpy_dtype)
    return k, -k


def churn(name, seconds, seed, started=None, stop=None):
    """Append, fork (so COW copies happen), gather and free in a loop for `seconds` (or
    until `stop` is set), then close cleanly.  Keeps a few sequences alive all the time so
    the CLI sees them."""
    cache = shmkv.KVCache.attach(name)
    cfg = cache.config
    rng = np.random.default_rng(seed)
    live = []
    if started is not None:
        started.set()
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            if len(live) < 4:
                sid = cache.create_sequence()
                k, v = _kv(cfg, int(rng.integers(1, 2 * cfg.block_size)), seed)
                cache.append(sid, k, v)
                live.append(sid)
            op = rng.integers(0, 4)
            sid = live[int(rng.integers(0, len(live)))]
            try:
                if op == 0:
                    k, v = _kv(cfg, int(rng.integers(1, cfg.block_size + 1)), seed)
                    cache.append(sid, k, v)
                elif op == 1 and len(live) < 6:
                    child = cache.fork(sid)
                    k, v = _kv(cfg, 1, seed)
                    cache.append(child, k, v)          # copy-on-write of the last block
                    live.append(child)
                elif op == 2:
                    cache.gather(sid)
                else:
                    cache.free(sid)
                    live.remove(sid)
            except shmkv.CacheFullError:
                for s in live:
                    cache.free(s)
                live.clear()
            time.sleep(0.002)        # leave the CPU to the CLI under test (2 cores)
    finally:
        cache.close()


def hold(name, n_seqs, n_tokens, queue, seconds=60.0):
    """Build `n_seqs` sequences of `n_tokens` tokens (every other one a fork of the
    previous one, so blocks are shared), report (pid, sids) on `queue`, then sleep until
    killed (at most `seconds`)."""
    cache = shmkv.KVCache.attach(name)
    cfg = cache.config
    sids = []
    for i in range(n_seqs):
        if i % 2 and sids:
            sid = cache.fork(sids[-1])
            k, v = _kv(cfg, 1, i)
        else:
            sid = cache.create_sequence()
            k, v = _kv(cfg, n_tokens, i)
        cache.append(sid, k, v)
        sids.append(sid)
    queue.put((os.getpid(), sids))
    time.sleep(seconds)
    cache.close()


def leak_on_free(name, queue, seconds=60.0):
    """Free a sequence with the planted `leak_on_free` bug: the segment keeps a block that
    no table references, which `check` must report.  Then wait to be SIGKILLed: a clean
    close() would run recovery, which rebuilds the refcounts and hides the leak."""
    import shmkv._core as core

    cache = shmkv.KVCache.attach(name)
    cfg = cache.config
    sid = cache.create_sequence()
    k, v = _kv(cfg, 3 * cfg.block_size, 0)
    cache.append(sid, k, v)
    core.plant_bug("leak_on_free")
    cache.free(sid)
    core.plant_bug(None)
    queue.put(os.getpid())
    time.sleep(seconds)
    cache.close()
