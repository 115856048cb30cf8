"""Worker functions for tests/test_structure.py (spawned processes import this module)."""
import os

import numpy as np

import shmkv
import shmkv._core as _core


def _kv(cfg, n):
    return np.ones((cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim), cfg.numpy_dtype)


def die_in(name, point, op, disarm):
    """Set up for `op`, arm `point` through shmkv._core, run `op` (a method that the
    split put in another extension module): exit 86 if the point fired there."""
    cache = shmkv.KVCache.attach(name)
    cfg = cache.config
    bs = cfg.block_size
    sid = cache.create_sequence()
    if op in ("fork", "free", "gather", "trim", "truncate"):
        cache.append(sid, _kv(cfg, 4 * bs), _kv(cfg, 4 * bs))
    if op == "commit":
        cache.reserve(sid, 3 * bs, tokens=np.arange(3 * bs))
    if op == "reset":                                      # a cached block to drop
        cache.append(sid, _kv(cfg, bs), _kv(cfg, bs), tokens=np.arange(bs))
        cache.free(sid)
    _core.set_crash_point(point)
    if disarm:
        _core.set_crash_point(None)
    if op == "create":
        cache.create_sequence(tokens=[1, 2, 3])           # _sequences, the locked path
    elif op == "fork":
        cache.fork(sid)                                    # _sequences
    elif op == "free":
        cache.free(sid)                                    # _sequences
    elif op == "append":
        cache.append(sid, _kv(cfg, 1), _kv(cfg, 1))        # _kvdata's own crash point
    elif op == "gather":
        cache.gather(sid)                                  # _kvdata
    elif op == "trim":
        cache.trim_streaming(sid, bs, bs)                  # _prefix
    elif op == "commit":
        cache.commit(sid)                                  # _prefix
    elif op == "truncate":
        cache.truncate(sid, bs + 1)                        # _sequences
    elif op == "recover":
        cache.recover(full=True)                           # _inspect
    elif op == "reset":
        cache.reset_prefix_cache()                         # _events
    os._exit(0)                                            # the point did not fire
