"""Helpers shared by the core tests, and the worker functions that spawned processes run.

Everything here is importable by a ``spawn`` child (tests/ is on sys.path through pytest's
``pythonpath``, and a spawn child inherits the parent's sys.path).  A worker reports by
writing JSON to the ``out`` path it is given; on any exception it writes the traceback
there and exits with status 1, so the parent can show what went wrong.
"""
import json
import os
import random
import traceback

import numpy as np

import shmkv

# stats() entries that legitimately change on a call that raised: recovery runs before a
# CacheFullError, and taking a contended lock is counted.
VOLATILE_STATS = ("recoveries", "last_recovery_s", "max_recovery_s", "lock_waits")


# ----------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------
def tokens(cfg, n, seed):
    """Deterministic K and V for n tokens, every layer: [num_layers, n, heads, dim]."""
    rng = np.random.default_rng(seed)
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    dt = cfg.numpy_dtype
    if cfg.quantized:     # float32 the quantizer stores exactly: the tests compare equal
        return exact_quantized(cfg, rng, shape), exact_quantized(cfg, rng, shape)
    if dt.kind == "f":
        k = (rng.standard_normal(shape) * 10).astype(dt)
        v = (rng.standard_normal(shape) * 10).astype(dt)
    else:
        info = np.iinfo(dt)
        k = rng.integers(info.min, info.max, shape, endpoint=True).astype(dt)
        v = rng.integers(info.min, info.max, shape, endpoint=True).astype(dt)
    return k, v


def exact_quantized(cfg, rng, shape):
    """float32 values a quantized pool stores without loss: int8 -- integers in
    [-127, 127] with +-127 in every (token, head) row (scale exactly 1); float8_e4m3 --
    e4m3fn numbers (the default per-head scale is 1)."""
    if cfg.dtype == "int8":
        x = rng.integers(-127, 127, shape, endpoint=True).astype(np.float32)
        x[..., 0] = np.where(rng.random(shape[:-1]) < 0.5, -127.0, 127.0)
        return x
    import ml_dtypes
    codes = rng.integers(0, 256, shape).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E          # no NaN codes
    return codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def empty_kv(cfg):
    shape = (cfg.num_layers, 0, cfg.num_kv_heads, cfg.head_dim)
    return np.empty(shape, cfg.compute_dtype), np.empty(shape, cfg.compute_dtype)


def assert_same(a, b, what=""):
    """Exact equality, dtype and shape included (bitwise for floats)."""
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert a.tobytes() == b.tobytes(), f"{what}: contents differ"


def read_via_views(cache, sid):
    """K, V of a sequence read through the zero-copy pool views and the block table:
    an independent read path that changes no counter."""
    cfg = cache.config
    n = cache.seq_len(sid)
    table = cache.block_table(sid)
    ks, vs = [], []
    for layer in range(cfg.num_layers):
        kc, vc = cache.key_cache(layer), cache.value_cache(layer)
        kq = kc[table].reshape(-1, cfg.num_kv_heads, cfg.head_dim)[:n]
        vq = vc[table].reshape(-1, cfg.num_kv_heads, cfg.head_dim)[:n]
        if cfg.quantized:           # codes times the scale views: x = q * s
            ksc, vsc = cache.key_scales(layer), cache.value_scales(layer)
            if cfg.dtype == "int8":
                ksc = ksc[table].reshape(-1, cfg.num_kv_heads)[:n]
                vsc = vsc[table].reshape(-1, cfg.num_kv_heads)[:n]
            kq = kq.astype(np.float32) * ksc[..., None]
            vq = vq.astype(np.float32) * vsc[..., None]
        ks.append(kq)
        vs.append(vq)
    return np.stack(ks), np.stack(vs)


# ----------------------------------------------------------------------------------------
# state of a segment
# ----------------------------------------------------------------------------------------
def footprint(cache):
    """Everything a call that raised must leave exactly as it was: the stats (but the
    volatile ones), every live sequence's length, block table and contents."""
    st = cache.stats()
    for key in VOLATILE_STATS:
        st.pop(key, None)
    seqs = {}
    for sid in sorted(cache.sequences()):
        k, v = read_via_views(cache, sid)
        seqs[sid] = (cache.seq_len(sid), cache.block_table(sid).tolist(),
                     k.tobytes(), v.tobytes())
    return dict(stats=st, seqs=seqs)


def assert_consistent(cache):
    """check() == [] and free + used == num_blocks."""
    problems = cache.check()
    assert problems == [], problems
    st = cache.stats()
    assert st["free_blocks"] + st["used_blocks"] == st["num_blocks"], st
    assert st["free_blocks"] >= 0 and st["used_blocks"] >= 0, st


# ----------------------------------------------------------------------------------------
# worker plumbing
# ----------------------------------------------------------------------------------------
def _report(out, fn, *args):
    try:
        result = fn(*args)
    except BaseException:
        with open(out, "w") as f:
            json.dump({"error": traceback.format_exc()}, f)
        raise
    with open(out, "w") as f:
        json.dump({"result": result}, f)


def read_report(out):
    with open(out) as f:
        d = json.load(f)
    assert "error" not in d, "worker failed:\n" + d["error"]
    return d["result"]


# ----------------------------------------------------------------------------------------
# workers
# ----------------------------------------------------------------------------------------
def build_detached(name, n, seed, chunk, out):
    """Create a sequence of n tokens (appended in chunks), detach it so it outlives this
    process, report its id."""
    def body():
        with shmkv.KVCache.attach(name) as cache:
            k, v = tokens(cache.config, n, seed)
            sid = cache.create_sequence()
            for a in range(0, n, chunk):
                cache.append(sid, k[:, a:a + chunk], v[:, a:a + chunk])
            cache.detach(sid)
            assert cache.owner_pid(sid) is None
            return sid
    _report(out, body)


def read_verify(name, sid, n, seed, out):
    """Gather a sequence made by another process and compare it with the expected data."""
    def body():
        with shmkv.KVCache.attach(name) as cache:
            k, v = tokens(cache.config, n, seed)
            assert cache.seq_len(sid) == n
            gk, gv = cache.gather(sid)
            assert_same(gk, k, "k")
            assert_same(gv, v, "v")
            vk, vv = read_via_views(cache, sid)
            assert_same(vk, k, "k via key_cache")
            assert_same(vv, v, "v via value_cache")
            return cache.block_table(sid).tolist()
    _report(out, body)


def write_through_views(name, layer, slots, seed, out):
    """Write K/V of one layer into the given slots through key_cache/value_cache."""
    def body():
        with shmkv.KVCache.attach(name) as cache:
            cfg = cache.config
            rng = np.random.default_rng(seed)
            n = len(slots)
            shape = (n, cfg.num_kv_heads, cfg.head_dim)
            k = rng.standard_normal(shape).astype(cfg.numpy_dtype)
            v = rng.standard_normal(shape).astype(cfg.numpy_dtype)
            kc, vc = cache.key_cache(layer), cache.value_cache(layer)
            for i, s in enumerate(slots):
                kc[s // cfg.block_size, s % cfg.block_size] = k[i]
                vc[s // cfg.block_size, s % cfg.block_size] = v[i]
            return True
    _report(out, body)


def read_views(name, layer, slots, out):
    """Read K/V of one layer at the given slots through the zero-copy views."""
    def body():
        with shmkv.KVCache.attach(name) as cache:
            cfg = cache.config
            kc, vc = cache.key_cache(layer), cache.value_cache(layer)
            k = [kc[s // cfg.block_size, s % cfg.block_size].tobytes().hex() for s in slots]
            v = [vc[s // cfg.block_size, s % cfg.block_size].tobytes().hex() for s in slots]
            return [k, v]
    _report(out, body)


def die_holding(name, n, seed, out):
    """Create a sequence (owned, not detached), report it, and die without closing."""
    try:
        cache = shmkv.KVCache.attach(name)
        k, v = tokens(cache.config, n, seed)
        sid = cache.create_sequence()
        cache.append(sid, k, v)
        kept = cache.create_sequence()
        cache.append(kept, k, v)
        cache.detach(kept)
        with open(out, "w") as f:
            json.dump({"result": [sid, kept, cache.block_table(sid).tolist()]}, f)
    except BaseException:
        with open(out, "w") as f:
            json.dump({"error": traceback.format_exc()}, f)
        os._exit(1)
    os._exit(0)                    # no close(), no atexit: like a crash


def race_for_blocks(name, wid, chunk_blocks, barrier, out):
    """Append chunks of `chunk_blocks` whole blocks to one sequence until the pool says
    CacheFullError.  Every call must either fully succeed or have no effect."""
    def body():
        with shmkv.KVCache.attach(name) as cache:
            cfg = cache.config
            ntok = chunk_blocks * cfg.block_size
            sid = cache.create_sequence()
            cache.detach(sid)           # the parent checks and frees it
            barrier.wait(timeout=60)
            ok = fails = 0
            while True:
                before_len = cache.seq_len(sid)
                before_table = cache.block_table(sid).tolist()
                k, v = tokens(cfg, ntok, wid * 1000 + ok)
                try:
                    cache.append(sid, k, v)
                except shmkv.CacheFullError:
                    fails += 1
                    assert cache.seq_len(sid) == before_len
                    assert cache.block_table(sid).tolist() == before_table
                    # nobody frees in this test: the pool only shrinks; stop after a few
                    if fails >= 3:
                        break
                    continue
                assert cache.seq_len(sid) == before_len + ntok
                table = cache.block_table(sid).tolist()
                assert table[:len(before_table)] == before_table
                assert len(table) == len(before_table) + chunk_blocks
                ok += 1
            return dict(sid=sid, ok=ok, chunk_blocks=chunk_blocks, wid=wid)
    _report(out, body)


def churn(name, wid, prompt_sid, prompt_n, prompt_seed, steps, seed, out, max_own=5):
    """Random create/fork/append/reserve+write/gather/free on this worker's own sequences
    (and forks of a shared detached prompt), every gather checked against a model.  Frees
    everything at the end."""
    def body():
        rng = random.Random(seed)
        with shmkv.KVCache.attach(name) as cache:
            cfg = cache.config
            pk, pv = tokens(cfg, prompt_n, prompt_seed)
            model = {}                  # sid -> (k, v)
            counts = dict(full=0, ops=0, cow_forks=0, appended=0)
            tag = [0]

            def fresh(n):
                tag[0] += 1
                return tokens(cfg, n, seed * 100003 + tag[0])

            def check_seq(sid):
                k, v = model[sid]
                gk, gv = cache.gather(sid)
                assert_same(gk, k, f"worker {wid} sid {sid} k")
                assert_same(gv, v, f"worker {wid} sid {sid} v")

            for step in range(steps):
                op = rng.choice(["create", "fork_prompt", "fork", "append", "append",
                                 "reserve", "gather", "free", "free", "check"])
                counts["ops"] += 1
                sids = sorted(model)
                if len(sids) >= max_own and op in ("create", "fork_prompt", "fork"):
                    op = "free"                 # leave slots for the other workers
                try:
                    if op == "create" or (op in ("append", "reserve", "fork", "gather",
                                                 "free") and not sids):
                        sid = cache.create_sequence()
                        model[sid] = empty_kv(cfg)
                    elif op == "fork_prompt":
                        sid = cache.fork(prompt_sid)
                        model[sid] = (pk.copy(), pv.copy())
                        counts["cow_forks"] += 1
                    elif op == "fork":
                        src = rng.choice(sids)
                        sid = cache.fork(src)
                        model[sid] = tuple(a.copy() for a in model[src])
                    elif op == "append":
                        sid = rng.choice(sids)
                        n = rng.randint(1, 7)
                        k, v = fresh(n)
                        before = cache.seq_len(sid)
                        try:
                            cache.append(sid, k, v)
                        except shmkv.CacheFullError:
                            counts["full"] += 1
                            assert cache.seq_len(sid) == before
                            check_seq(sid)
                        else:
                            counts["appended"] += 1
                            mk, mv = model[sid]
                            model[sid] = (np.concatenate([mk, k], 1),
                                          np.concatenate([mv, v], 1))
                    elif op == "reserve":
                        sid = rng.choice(sids)
                        n = rng.randint(1, 5)
                        k, v = fresh(n)
                        before = cache.seq_len(sid)
                        try:
                            slots = cache.reserve(sid, n)
                        except shmkv.CacheFullError:
                            counts["full"] += 1
                            assert cache.seq_len(sid) == before
                            check_seq(sid)
                        else:
                            for layer in range(cfg.num_layers):
                                cache.write(layer, slots, k[layer], v[layer])
                            mk, mv = model[sid]
                            model[sid] = (np.concatenate([mk, k], 1),
                                          np.concatenate([mv, v], 1))
                    elif op == "gather":
                        check_seq(rng.choice(sids))
                    elif op == "free":
                        sid = rng.choice(sids)
                        check_seq(sid)
                        cache.free(sid)
                        del model[sid]
                    elif op == "check":
                        problems = cache.check()
                        assert problems == [], f"worker {wid} step {step}: {problems}"
                except shmkv.CacheFullError:
                    # sequence slots or pool exhausted on create/fork: no new sequence
                    counts["full"] += 1
            for sid in sorted(model):
                check_seq(sid)
                cache.free(sid)
            # the shared prompt was never changed by any fork's appends
            gk, gv = cache.gather(prompt_sid)
            assert_same(gk, pk, "prompt k")
            assert_same(gv, pv, "prompt v")
            return counts
    _report(out, body)


def race_for_slots(name, wid, barrier, out):
    """Create sequences until the slots run out; every create either returns a new id or
    raises CacheFullError."""
    def body():
        with shmkv.KVCache.attach(name) as cache:
            barrier.wait(timeout=60)
            mine, fails = [], 0
            while fails < 3:
                try:
                    sid = cache.create_sequence()
                except shmkv.CacheFullError:
                    fails += 1
                    continue
                cache.detach(sid)
                mine.append(sid)
            return mine
    _report(out, body)


def publish_writer(name, shared_sid, done, seconds, chunk, out):
    """Round after round: a new sequence, published through `shared_sid`, grown by
    appends of `chunk` tokens until the pool is nearly full, then freed.  Token i of round
    r holds the value r * 10000 + i + 1 in every element (float32, exact)."""
    import time

    def body():
        with shmkv.KVCache.attach(name) as cache:
            cfg = cache.config
            assert cfg.dtype == "float32"
            shape = (cfg.num_layers, chunk, cfg.num_kv_heads, cfg.head_dim)
            pos = np.broadcast_to(np.arange(chunk, dtype=np.float32)[None, :, None, None],
                                  shape)
            cap = (cfg.num_blocks * cfg.block_size) // chunk - 1
            rounds = appends = 0
            end = time.monotonic() + seconds
            try:
                while time.monotonic() < end:
                    rounds += 1
                    sid = cache.create_sequence()
                    shared_sid.value = sid
                    for c in range(cap):
                        k = pos + np.float32(rounds * 10000 + c * chunk + 1)
                        cache.append(sid, k, k)
                        appends += 1
                    shared_sid.value = -1
                    cache.free(sid)
            finally:
                done.set()
            return dict(rounds=rounds, appends=appends)
    _report(out, body)


def build_owned(name, n, seed, out):
    """Create a sequence and leave without detaching it: close() reclaims it at once."""
    def body():
        cache = shmkv.KVCache.attach(name)
        k, v = tokens(cache.config, n, seed)
        sid = cache.create_sequence()
        cache.append(sid, k, v)
        child = cache.fork(sid)
        cache.append(child, k[:, :1], v[:, :1])
        cache.close()
        return [sid, child]
    _report(out, body)


def adopt_and_die(name, sid, out):
    """Adopt a detached sequence, then die without closing."""
    try:
        cache = shmkv.KVCache.attach(name)
        cache.adopt(sid)
        assert cache.owner_pid(sid) == os.getpid()
        with open(out, "w") as f:
            json.dump({"result": os.getpid()}, f)
    except BaseException:
        with open(out, "w") as f:
            json.dump({"error": traceback.format_exc()}, f)
        os._exit(1)
    os._exit(0)


def chunk_data(cfg, sid, c, chunk=3):
    """The c-th chunk appended to sequence sid by `appender`."""
    return tokens(cfg, chunk, sid * 1000 + c)


def appender(name, shared_sid, done, seconds, cap, out):
    """Round after round: a new sequence (published in shared_sid) grown by `cap` appends
    of 3 tokens (chunk_data), then freed."""
    import time

    def body():
        with shmkv.KVCache.attach(name) as cache:
            cfg = cache.config
            rounds = 0
            end = time.monotonic() + seconds
            try:
                while time.monotonic() < end:
                    rounds += 1
                    sid = cache.create_sequence()
                    shared_sid.value = sid
                    for c in range(cap):
                        cache.append(sid, *chunk_data(cfg, sid, c))
                    k, v = cache.gather(sid)
                    want = [chunk_data(cfg, sid, c) for c in range(cap)]
                    assert_same(k, np.concatenate([w[0] for w in want], 1), "appender k")
                    assert_same(v, np.concatenate([w[1] for w in want], 1), "appender v")
                    shared_sid.value = -1
                    cache.free(sid)
            finally:
                done.set()
            return rounds
    _report(out, body)


def forker(name, shared_sid, done, out):
    """Fork the sequence `appender` is growing, again and again: a fork sees a whole
    number of appends (never half of one), exactly the appender's data, and its own
    appends never show in the parent."""
    def body():
        with shmkv.KVCache.attach(name) as cache:
            cfg = cache.config
            memo = {}
            forks = own = 0
            while not done.is_set():
                sid = shared_sid.value
                if sid < 0:
                    continue
                try:
                    child = cache.fork(sid)
                except (shmkv.SequenceNotFound, shmkv.CacheFullError):
                    continue
                forks += 1
                n = cache.seq_len(child)
                assert n % 3 == 0, f"fork saw {n} tokens: part of an append"
                for c in range(n // 3):
                    if (sid, c) not in memo:
                        memo[(sid, c)] = chunk_data(cfg, sid, c)
                parts = [memo[(sid, c)] for c in range(n // 3)]
                wk = np.concatenate([empty_kv(cfg)[0]] + [p[0] for p in parts], 1)
                wv = np.concatenate([empty_kv(cfg)[1]] + [p[1] for p in parts], 1)
                gk, gv = cache.gather(child)
                assert_same(gk, wk, f"fork of {sid} at {n}: k")
                assert_same(gv, wv, f"fork of {sid} at {n}: v")
                mine = tokens(cfg, 2, forks)
                try:
                    cache.append(child, *mine)
                except shmkv.CacheFullError:
                    pass
                else:
                    own += 1
                    gk, gv = cache.gather(child)
                    assert_same(gk, np.concatenate([wk, mine[0]], 1), "child k")
                    assert_same(gv, np.concatenate([wv, mine[1]], 1), "child v")
                    try:                   # the parent still has its own data there
                        pk, _ = cache.gather(sid, n, min(n + 2, cache.seq_len(sid)))
                        if pk.shape[1]:
                            c0 = memo.get((sid, n // 3)) or chunk_data(cfg, sid, n // 3)
                            assert_same(pk, c0[0][:, :pk.shape[1]], "parent after fork")
                    except shmkv.SequenceNotFound:
                        pass
                cache.free(child)
            return dict(forks=forks, own=own)
    _report(out, body)
