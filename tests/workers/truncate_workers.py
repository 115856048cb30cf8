"""Worker functions for tests/test_truncate.py (spawned processes import this module)."""
import os

import numpy as np

import shmkv
import shmkv._core as _core
from workers.mp_workers import tokens


def truncate_and_append(name, sid, n, seed, extra):
    """Another process truncates a sequence it did not create, then appends `extra`
    tokens of seed `seed` (token ids 1000...) to it."""
    cache = shmkv.KVCache.attach(name)
    try:
        cache.truncate(sid, n)
        if extra:
            k, v = tokens(cache.config, extra, seed)
            cache.append(sid, k, v, tokens=np.arange(1000, 1000 + extra))
    finally:
        cache.close()


def die_in_truncate(name, sid, n):
    """Arm truncate_mid, truncate sid to n: the process dies with the length published
    and the tail half released (exit 86); 0 means the point never fired."""
    cache = shmkv.KVCache.attach(name)
    _core.set_crash_point("truncate_mid")
    cache.truncate(sid, n)
    os._exit(0)
