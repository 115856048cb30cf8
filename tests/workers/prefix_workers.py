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
            q.put({"sid": sid, "first_len": first_len, "roundtrip": ok, "check": c.check()})
            q.close()
            q.join_thread()
            os._exit(0)
        else:
            raise ValueError(how)
        q.put({"sid": sid, "first_len": first_len, "roundtrip": ok, "check": c.check()})
        c.close()
    except BaseException:
        q.put({"error": traceback.format_exc()})
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
        q.put({"match": m, "match_other_salt": m_other_salt, "match_a": m_a, "seq_len": n,
               "data_ok": data_ok, "ids_ok": ids_ok, "full_ok": full_ok, "diff": diff,
               "match_counted": mid["prefix_queries"] - before["prefix_queries"],
               "check": c.check()})
        c.close()
    except BaseException:
        q.put({"error": traceback.format_exc()})
        raise


def tagged_kv(cfg, token_ids, positions):
    """K/V that say which token and position they hold: K = id % 2000, V = position %
    2000 (exact in float16), broadcast over layers, heads and dims."""
    shape = (cfg.num_layers, len(token_ids), cfg.num_kv_heads, cfg.head_dim)
    k = np.empty(shape, cfg.numpy_dtype)
    v = np.empty(shape, cfg.numpy_dtype)
    k[...] = (np.asarray(token_ids) % 2000)[None, :, None, None]
    v[...] = (np.asarray(positions) % 2000)[None, :, None, None]
    return k, v


def stress(name, wid, seconds, seed, q, use_evict=True, use_reserve=True):
    """Random prefix-cache traffic on a small shared pool: create_sequence(tokens=) on a
    few shared system prompts, append / reserve+write+commit, fork, trim, free, and
    evict (which may take other workers' sequences).  Every gather is checked against
    the ids and positions the sequence must hold, so a hit on a wrong or rewritten block
    shows up as a mismatch.  use_evict / use_reserve switch those operations off."""
    import time
    try:
        c = shmkv.KVCache.attach(name)
        cfg = c.config
        rng = np.random.default_rng(seed * 100 + wid)
        sysp = [np.arange(1000 * (i + 1), 1000 * (i + 1) + n, dtype=np.int32)
                for i, n in enumerate((13, 21, 30, 36))]
        live = {}                     # sid -> (ids, positions) it must hold
        n = {"requests": 0, "hit_tokens": 0, "mismatches": 0, "bad_len": 0, "full": 0,
             "lost": 0, "evicted": 0, "trims": 0, "forks": 0}

        details = []

        def verify(sid, op):
            ids, pos = live[sid]
            gk, gv = c.gather(sid)
            ek, ev = tagged_kv(cfg, ids, pos)
            got_ids = c.token_ids(sid)
            if not (np.array_equal(gk, ek) and np.array_equal(gv, ev)
                    and np.array_equal(got_ids, ids)):
                n["mismatches"] += 1
                bad = np.nonzero((gk != ek).any(axis=(0, 2, 3)) | (gv != ev).any(axis=(0, 2, 3))
                                 | (got_ids != ids))[0]
                if len(details) < 5:
                    details.append({"op": op, "sid": sid, "len": len(ids), "bad": bad.tolist(),
                                    "ids": ids[bad].tolist(), "got_ids": got_ids[bad].tolist(),
                                    "k": gk[0, bad, 0, 0].tolist(), "pos": pos[bad].tolist(),
                                    "v": gv[0, bad, 0, 0].tolist(),
                                    "table": c.block_table(sid).tolist()})

        def grow(sid, new_ids):
            ids, pos = live[sid]
            start = len(ids)
            p = np.arange(pos[-1] + 1 if len(pos) else 0,
                          (pos[-1] + 1 if len(pos) else 0) + len(new_ids))
            k, v = tagged_kv(cfg, new_ids, p)
            if rng.random() < 0.5 or not use_reserve:
                c.append(sid, k, v, tokens=new_ids)
            else:
                slots = c.reserve(sid, len(new_ids), tokens=new_ids)
                live[sid] = (np.r_[ids, new_ids].astype(np.int32), np.r_[pos, p])
                for layer in range(cfg.num_layers):
                    c.write(layer, slots, k[layer], v[layer])
                c.commit(sid)
                return
            if c.seq_len(sid) != start + len(new_ids):
                # seq_len reads without a lock: a sequence another worker's evict() frees
                # at that instant can read as length 0 instead of raising.  Tell that
                # race apart from a wrong length by asking again under the sequence lock.
                c.token_ids(sid, 0, 0)            # raises SequenceNotFound if it is gone
                n["bad_len"] += 1
                if len(details) < 5:
                    details.append({"op": "seq_len", "sid": sid, "len": c.seq_len(sid),
                                    "want": start + len(new_ids)})
            live[sid] = (np.r_[ids, new_ids].astype(np.int32), np.r_[pos, p])

        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            try:
                r = rng.random()
                if r < 0.55 or not live:
                    prompt = np.r_[sysp[rng.integers(len(sysp))],
                                   rng.integers(0, 900, rng.integers(1, 10))].astype(np.int32)
                    sid = c.create_sequence(tokens=prompt)
                    h = c.seq_len(sid)
                    live[sid] = (prompt[:h], np.arange(h))
                    n["requests"] += 1
                    n["hit_tokens"] += h
                    verify(sid, 'hit')
                    grow(sid, prompt[h:])
                    verify(sid, 'prefill')
                elif r < 0.65:
                    sid = list(live)[rng.integers(len(live))]
                    ch = c.fork(sid)
                    live[ch] = live[sid]
                    n["forks"] += 1
                    grow(ch, rng.integers(0, 900, rng.integers(1, 6)).astype(np.int32))
                    verify(ch, 'fork-child')
                    verify(sid, 'fork-parent')
                elif r < 0.72:
                    sid = list(live)[rng.integers(len(live))]
                    ids, pos = live[sid]
                    L = len(ids)
                    d = c.trim_streaming(sid, 4, 6)
                    if d:
                        bs = cfg.block_size
                        first_kept = (L - 6) // bs
                        keep = np.r_[0:min(4, L), first_kept * bs:L]
                        live[sid] = (ids[keep], pos[keep])
                        n["trims"] += 1
                    verify(sid, 'trim')
                elif r < 0.76 and use_evict:
                    target = int(rng.integers(cfg.num_blocks // 2, cfg.num_blocks))
                    n["evicted"] += len(c.evict(["lru", "lfu", "longest", "priority"][
                        rng.integers(4)], target, exclude=list(live)))
                else:
                    sid = list(live)[rng.integers(len(live))]
                    del live[sid]
                    c.free(sid)
                while len(live) > 3:
                    sid = next(iter(live))
                    del live[sid]
                    c.free(sid)
            except shmkv.CacheFullError:
                n["full"] += 1
                for sid in list(live):
                    try:
                        c.free(sid)
                    except shmkv.SequenceNotFound:
                        pass
                live.clear()
            except shmkv.SequenceNotFound:
                n["lost"] += 1                    # evicted by another worker
                for sid in list(live):
                    try:
                        c.seq_len(sid)
                    except shmkv.SequenceNotFound:
                        del live[sid]
        for sid in list(live):
            try:
                c.free(sid)
            except shmkv.SequenceNotFound:
                pass
        n["check"] = c.check()
        n["details"] = details
        q.put(n)
        c.close()
    except BaseException:
        q.put({"error": traceback.format_exc()})
        raise


def evict_all_and_fill(name, q):
    """Evict every sequence it may (other processes' included), then fill the pool with a
    sequence of its own (detached, for the parent to read)."""
    try:
        c = shmkv.KVCache.attach(name)
        cfg = c.config
        evicted = c.evict("lru", cfg.num_blocks)
        n = c.stats()["free_blocks"] * cfg.block_size
        k, v = kv_data(cfg, n, 99)
        sid = c.create_sequence()
        c.append(sid, k, v)
        c.detach(sid)
        q.put({"evicted": evicted, "sid": sid, "n": n})
        c.close()
    except BaseException:
        q.put({"error": traceback.format_exc()})
        raise
