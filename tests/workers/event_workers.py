"""Workers for tests/test_events.py, run in spawned processes (importable: tests/ is on
sys.path).  Each exits 0 only when everything it did succeeded."""
import os

import numpy as np

import shmkv


def publish(name, prompt, free=True):
    """Attach, prefill `prompt` with its token ids (its full blocks are published: one
    "stored" event each), free it (the blocks stay cached) and close."""
    c = shmkv.KVCache.attach(name)
    prompt = np.asarray(prompt, np.int32)
    cfg = c.config
    kv = np.zeros((cfg.num_layers, len(prompt), cfg.num_kv_heads, cfg.head_dim),
                  cfg.numpy_dtype)
    sid = c.create_sequence()
    c.append(sid, kv, kv, tokens=prompt)
    if free:
        c.free(sid)
    else:
        c.detach(sid)
    c.close()


def fill_pool(name, n_tokens):
    """Attach and append n_tokens without ids: new blocks, taken from the free list and
    then from the least recently used cached blocks (one "removed" event each)."""
    c = shmkv.KVCache.attach(name)
    cfg = c.config
    kv = np.zeros((cfg.num_layers, n_tokens, cfg.num_kv_heads, cfg.head_dim),
                  cfg.numpy_dtype)
    sid = c.create_sequence()
    c.append(sid, kv, kv)
    c.detach(sid)
    c.close()


def reset(name):
    c = shmkv.KVCache.attach(name)
    c.reset_prefix_cache()
    c.close()


def die_mid_event(name, prompt, countdown):
    """Publish `prompt` with the crash point inside the event write armed: the process
    _exit(86)s the countdown-th time it is half-way through writing an event record,
    holding the pool lock."""
    from shmkv import _core

    c = shmkv.KVCache.attach(name)
    prompt = np.asarray(prompt, np.int32)
    cfg = c.config
    kv = np.zeros((cfg.num_layers, len(prompt), cfg.num_kv_heads, cfg.head_dim),
                  cfg.numpy_dtype)
    sid = c.create_sequence()
    _core.set_crash_point("event_mid", countdown)
    c.append(sid, kv, kv, tokens=prompt)
    os._exit(0)          # not reached when the crash point fires


def die_mid_reset(name):
    from shmkv import _core

    c = shmkv.KVCache.attach(name)
    _core.set_crash_point("reset_mid", 1)
    c.reset_prefix_cache()
    os._exit(0)
