"""Workers for tests/test_prefix.py, run in spawned processes (importable: tests/ is on
sys.path).  Each reports through a multiprocessing queue and exits 0 only when every
check it made held; the parent asserts the exit code and the report."""
import os
import traceback

import numpy as np

import shmkv


def kv_data(cfg, n, seed):
    """Deterministic K and V for n tokens: the same (n, seed) gives the same bytes in every
    process, so a process that hits a prefix can compare against what another wrote."""
    rng = np.random.default_rng(seed)
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    k = rng.standard_normal(shape).astype(cfg.numpy_dtype)
    v = rng.standard_normal(shape).astype(cfg.numpy_dtype)
    return k, v


def prefill(name, prompt, seed, how, q, chunk=7, salt=None):
    """Process A: prefill `prompt` (token ids) in chunks of `chunk` with tokens=, then
    `free` it (its full blocks stay cached), `detach` it (it survives us) and close, or
    `exit`: die without freeing or closing (recovery reclaims it)."""
    try:
        c = shmkv.KVCache.attach(name)
        prompt = np.asarray(prompt, np.int32)
        k, v = kv_data(c.config, len(prompt), seed)
        sid = c.create_sequence(tokens=prompt, salt=salt)
        first_len = c.seq_len(sid)
        for a in range(first_len, len(prompt), chunk):
            b = min(a + chunk, len(prompt))
            c.append(sid, k[:, a:b], v[:, a:b], tokens=prompt[a:b])
        gk, gv = c.gather(sid)
        ok = bool(np.array_equal(gk, k) and np.array_equal(gv, v))
        if how == "free":
            c.free(sid)
        elif how == "detach":
            c.detach(sid)
        elif how == "exit":
            q.put(dict(sid=sid, first_len=first_len, roundtrip=ok, check=c.check()))
            q.close()
            q.join_thread()
            os._exit(0)
        else:
            raise ValueError(how)
        q.put(dict(sid=sid, first_len=first_len, roundtrip=ok, check=c.check()))
        c.close()
    except BaseException:
        q.put(dict(error=traceback.format_exc()))
        raise


def hit(name, prompt, a_prompt, a_seed, q, salt=None):
    """Process B: ask for `prompt`, whose leading blocks process A wrote (A's prompt and
    seed given, to rebuild A's data); report what was shared and whether the shared
    tokens' K/V and ids are exactly A's."""
    try:
        c = shmkv.KVCache.attach(name)
        prompt = np.asarray(prompt, np.int32)
        ak, av = kv_data(c.config, len(a_prompt), a_seed)
        before = c.stats()
        m = c.match_prefix(prompt, salt=salt)
        m_other_salt = c.match_prefix(prompt, salt="some-other-tenant")
        m_a = c.match_prefix(a_prompt, salt=salt)
        mid = c.stats()
        sid = c.create_sequence(tokens=prompt, salt=salt)
        after = c.stats()
        n = c.seq_len(sid)
        gk, gv = c.gather(sid)
        data_ok = bool(np.array_equal(gk, ak[:, :n]) and np.array_equal(gv, av[:, :n]))
        ids_ok = bool(np.array_equal(c.token_ids(sid), prompt[:n]))
        # finish the prompt: the suffix is ours, the shared part must not change
        rest = len(prompt) - n
        sk, sv = kv_data(c.config, rest, 12345)
        c.append(sid, sk, sv, tokens=prompt[n:])
        fk, fv = c.gather(sid)
        full_ok = bool(np.array_equal(fk[:, :n], ak[:, :n]) and np.array_equal(fk[:, n:], sk)
                       and np.array_equal(fv[:, n:], sv))
        c.free(sid)
        diff = {key: after[key] - before[key] for key in
                ("prefix_queries", "prefix_hits", "cached_blocks_reused")}
        q.put(dict(match=m, match_other_salt=m_other_salt, match_a=m_a, seq_len=n,
                   data_ok=data_ok, ids_ok=ids_ok, full_ok=full_ok, diff=diff,
                   match_counted=mid["prefix_queries"] - before["prefix_queries"],
                   check=c.check()))
        c.close()
    except BaseException:
        q.put(dict(error=traceback.format_exc()))
        raise
