"""Worker functions for tests/test_recovery.py (spawned processes import this module)."""
import os
import time

import numpy as np

import shmkv
import shmkv._core as _core
from shmkv.inspect import snapshot


def segment_bytes(cache):
    """A writable byte view of the whole segment (the mapping behind the pool views): the
    tests play a crashed or hostile peer through it."""
    base = cache.key_cache(0)
    while getattr(base, "base", None) is not None:
        base = base.base
    return memoryview(base)


def tokens(cfg, n, value):
    a = np.full((cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim), value, cfg.numpy_dtype)
    return a


def open_segment(name, cfg, barrier, out_q):
    barrier.wait(timeout=30)
    cache = shmkv.KVCache.open(name, cfg)
    try:
        created = cache._debug_info()["creator_pid"] == os.getpid()
        out_q.put((os.getpid(), created, cache.config == cfg))
    finally:
        cache.close()


def die_at(name, point, sid, n):
    """Arm a crash point, then append n tokens to sid (dies inside the operation)."""
    cache = shmkv.KVCache.attach(name)
    _core.set_crash_point(point)
    cache.append(sid, tokens(cache.config, n, 7), tokens(cache.config, n, 7))
    os._exit(0)          # not reached when the crash point fires


def own_and_exit(name, q, detach_one):
    cache = shmkv.KVCache.attach(name)
    a = cache.create_sequence()
    b = cache.create_sequence()
    cache.append(a, tokens(cache.config, 5, 1), tokens(cache.config, 5, 1))
    cache.append(b, tokens(cache.config, 5, 2), tokens(cache.config, 5, 2))
    if detach_one:
        cache.detach(b)
    q.put((a, b))
    q.close()
    q.join_thread()      # the message is out before we go
    os._exit(0)          # no close(): like a crash after the work


def attach_with_recovery(name, timeout, out_q):
    """Attaches (recovery on) with a short timeout; reports the exception's type name
    (or None), whether this process stayed in the process table after it, and whether
    an attach without recovery then works."""
    me = os.getpid()
    t0 = time.monotonic()
    try:
        shmkv.KVCache.attach(name, timeout=timeout).close()
        err = None
    except Exception as e:                          # reported, checked by the test
        err = type(e).__name__
    took = time.monotonic() - t0
    listed = any(p["pid"] == me for p in snapshot(name)["processes"])
    with shmkv.KVCache.attach(name, recover=False) as c:
        plain = c.stats()["num_processes"]
    out_q.put((err, listed, plain, took))
