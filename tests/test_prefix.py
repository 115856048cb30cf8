"""The host-wide prefix cache: block hashes published in the shared index, cached free
blocks (LRU), eviction policies and StreamingLLM trim.

Every cache made here is checked at teardown (check() == [], free + used == num_blocks)
and no segment may be left in /dev/shm.
"""
import multiprocessing as mp
import os
import time

import numpy as np
import pytest
from workers import prefix_workers as pw

import shmkv
from shmkv.inspect import snapshot

HASHES = ["fast", "sha256"]
BS = 4                       # block size of every cache here (SMALL's)
SPAWN = mp.get_context("spawn")


# ---- fixtures and helpers ------------------------------------------------------------------
def _ours():
    tag = f"shmkv-test-t-{os.getpid()}-"
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(tag)}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leftover_segments():
    """Nothing this test made may stay in /dev/shm (torn down after make_cache)."""
    before = _ours()
    yield
    left = _ours() - before
    assert not left, f"segments left in /dev/shm: {sorted(left)}"


def consistent(c):
    assert c.check() == []
    st = c.stats()
    assert st["free_blocks"] + st["used_blocks"] == st["num_blocks"]
    assert 0 <= st["cached_blocks"] <= st["free_blocks"]


@pytest.fixture
def mk(make_cache):
    """make_cache with a consistency check of every cache at teardown."""
    made = []

    def make(**kw):
        c = make_cache(**kw)
        made.append(c)
        return c

    yield make
    for c in made:
        if not c.closed:
            consistent(c)


def ids(n, start):
    return np.arange(start, start + n, dtype=np.int32)


def kv(c, n, seed):
    return pw.kv_data(c.config, n, seed)


def prefill(c, prompt, seed, salt=None, chunk=None):
    """A new sequence holding `prompt` (appended with tokens=, in chunks); returns sid
    and the K/V written."""
    prompt = np.asarray(prompt, np.int32)
    k, v = kv(c, len(prompt), seed)
    sid = c.create_sequence(tokens=prompt, salt=salt)
    n0 = c.seq_len(sid)
    chunk = chunk or len(prompt)
    for a in range(n0, len(prompt), chunk):
        b = min(a + chunk, len(prompt))
        c.append(sid, k[:, a:b], v[:, a:b], tokens=prompt[a:b])
    return sid, k, v


def run(target, *args, timeout=60):
    """Run target(*args, q) in a spawned process; returns its report."""
    q = SPAWN.Queue()
    p = SPAWN.Process(target=target, args=(*args, q))
    p.start()
    try:
        rep = q.get(timeout=timeout)
    finally:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
            p.join(5)
    assert "error" not in rep, rep["error"]
    assert p.exitcode == 0
    return rep


# ---- cross-process hits ------------------------------------------------------------------
@pytest.mark.parametrize("how", ["free", "detach", "exit"])
@pytest.mark.parametrize("hash", HASHES)
def test_cross_process_hit(mk, hash, how):
    """A (spawned) prefills a prompt and frees it, detaches it, or dies holding it;
    B (spawned) and then the parent hit its full blocks and read exactly A's K/V."""
    c = mk(hash=hash)
    with shmkv.KVCache.attach(c.name) as other:
        assert other.config.hash == hash
    a_prompt = ids(23, 1000)                  # 5 full blocks + 3 tokens
    ra = run(pw.prefill, c.name, a_prompt, 7, how)
    assert ra["first_len"] == 0 and ra["roundtrip"] and ra["check"] == []
    st = c.stats()
    assert st["index_entries"] == 5
    if how == "exit":                        # A died holding 6 blocks: recovery caches them
        assert st["used_blocks"] == 6 and c.sequences() == [ra["sid"]]
        rec = c.recover()
        assert rec["sequences"] == 1 and rec["blocks"] == 6
        st = c.stats()
        assert st["index_entries"] == 5
    if how in ("free", "exit"):
        assert st["used_blocks"] == 0 and st["cached_blocks"] == 5
        assert c.sequences() == []
    else:
        assert st["used_blocks"] == 6 and st["cached_blocks"] == 0
        assert c.sequences() == [ra["sid"]]

    b_prompt = np.r_[a_prompt[:20], ids(9, 5000)].astype(np.int32)   # shares 5 blocks
    rb = run(pw.hit, c.name, b_prompt, a_prompt, 7)
    assert rb["check"] == []
    assert rb["match"] == 20 and rb["seq_len"] == 20
    assert rb["match_a"] == 20               # never the last token: 23-1 -> 5 blocks
    assert rb["match_other_salt"] == 0
    assert rb["data_ok"] and rb["ids_ok"] and rb["full_ok"]
    assert rb["match_counted"] == 0          # match_prefix takes nothing, counts nothing
    assert rb["diff"]["prefix_queries"] == len(b_prompt)
    assert rb["diff"]["prefix_hits"] == 20
    assert rb["diff"]["cached_blocks_reused"] == (0 if how == "detach" else 5)

    # the parent hits too, with A's own prompt; the shared blocks are A's physical blocks
    sid = c.create_sequence(tokens=a_prompt)
    assert c.seq_len(sid) == 20 == c.match_prefix(a_prompt)
    ak, av = pw.kv_data(c.config, len(a_prompt), 7)
    gk, gv = c.gather(sid)
    np.testing.assert_array_equal(gk, ak[:, :20])
    np.testing.assert_array_equal(gv, av[:, :20])
    if how == "detach":
        np.testing.assert_array_equal(c.block_table(sid), c.block_table(ra["sid"])[:5])
        c.free(ra["sid"])
    st = c.stats()
    assert st["prefix_queries"] == len(a_prompt) + len(b_prompt) + len(a_prompt)
    assert st["prefix_hits"] == 0 + 20 + 20
    c.free(sid)


def test_concurrent_prefills_of_one_prompt_publish_each_block_once(mk, procs):
    """Three processes prefill the same prompt at once: each hash is in the index once
    (a later publisher keeps a private copy), and the copies that lost go back to the
    never-cached free stack."""
    c = mk(num_blocks=64)
    prompt = ids(22, 300)                     # 5 full blocks + 2
    q = SPAWN.Queue()
    for _ in range(3):
        p = SPAWN.Process(target=pw.prefill, args=(c.name, prompt, 3, "free", q, 3))
        p.start()
        procs.append(p)
    reps = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for r in reps:
        assert "error" not in r, r["error"]
        assert r["roundtrip"] and r["first_len"] in (0, 4, 8, 12, 16, 20)
    st = c.stats()
    assert st["index_entries"] == 5 and st["cached_blocks"] == 5
    assert st["used_blocks"] == 0
    sid = c.create_sequence(tokens=prompt)
    assert c.seq_len(sid) == 20
    k, v = pw.kv_data(c.config, len(prompt), 3)
    gk, gv = c.gather(sid)
    np.testing.assert_array_equal(gk, k[:, :20])
    np.testing.assert_array_equal(gv, v[:, :20])
    c.free(sid)


def test_duplicate_publish_keeps_one_entry(mk):
    """Two sequences that both missed and then wrote the same prompt: one index entry per
    block, and only one copy stays cached after both are freed."""
    c = mk()
    p = ids(12, 40)
    s1 = c.create_sequence(tokens=p)
    s2 = c.create_sequence(tokens=p)
    k, v = kv(c, 12, 1)
    c.append(s1, k, v, tokens=p)
    c.append(s2, k, v, tokens=p)
    assert c.stats()["index_entries"] == 3
    t1 = c.block_table(s1)
    c.free(s2)
    st = c.stats()
    assert st["cached_blocks"] == 0 and st["used_blocks"] == 3   # s2's copies: plain free
    c.free(s1)
    st = c.stats()
    assert st["cached_blocks"] == 3 and st["used_blocks"] == 0
    s3 = c.create_sequence(tokens=np.r_[p, 1])
    np.testing.assert_array_equal(c.block_table(s3), t1)
    c.free(s3)


# ---- salts and hash algorithms -------------------------------------------------------------
@pytest.mark.parametrize("hash", HASHES)
def test_salt_isolates_tenants(mk, hash):
    c = mk(hash=hash)
    p = ids(17, 7)                            # 4 full blocks + 1
    sa, ka, _va = prefill(c, p, 1, salt="tenant-a")
    sn, kn, _vn = prefill(c, p, 2)            # no salt: a tenant of its own
    assert c.stats()["index_entries"] == 8
    assert c.match_prefix(p, salt="tenant-a") == 16
    assert c.match_prefix(p, salt=b"tenant-a") == 16     # str is its utf-8 bytes
    assert c.match_prefix(p) == 16
    assert c.match_prefix(p, salt="tenant-b") == 0
    assert c.match_prefix(p, salt="tenant-A") == 0
    # within a salt: the hit reads that tenant's data, not the other's
    for salt, k in (("tenant-a", ka), (None, kn)):
        s = c.create_sequence(tokens=p, salt=salt)
        assert c.seq_len(s) == 16
        np.testing.assert_array_equal(c.gather(s)[0], k[:, :16])
        c.free(s)
    s = c.create_sequence(tokens=p, salt="tenant-b")
    assert c.seq_len(s) == 0
    # the salt is inherited by forks: a fork's new blocks are findable under it only
    ch = c.fork(sa)
    extra = ids(4, 900)
    k4, v4 = kv(c, 4, 3)
    c.append(ch, k4[:, :3], v4[:, :3], tokens=extra[:3])   # fills block 4 (17+3 = 20)
    q = np.r_[p, extra[:3], 1]
    assert c.match_prefix(q, salt="tenant-a") == 20
    assert c.match_prefix(q) == 16
    for x in (s, sa, sn, ch):
        c.free(x)


@pytest.mark.parametrize("hash", HASHES)
def test_hash_chain_depends_on_every_earlier_token(mk, hash):
    """A block is found only if every earlier token matches too (chained hashes), and
    two segments with the same config hash differently (per-segment seed)."""
    c = mk(hash=hash)
    p = ids(21, 100)
    s, _k, _v = prefill(c, p, 1, chunk=5)
    assert c.match_prefix(p) == 20
    for pos, want in ((0, 0), (3, 0), (4, 4), (9, 8), (19, 16)):
        q = p.copy()
        q[pos] += 1
        assert c.match_prefix(q) == want, pos
    assert c.match_prefix(p[4:]) == 0          # same blocks at other positions
    other = mk(hash=hash)
    seeds = {snapshot(x.name, tables=False)["hash_seed"] for x in (c, other)}
    assert len(seeds) == 2
    assert other.match_prefix(p) == 0
    c.free(s)


# ---- partial blocks and the last token ---------------------------------------------------
@pytest.mark.parametrize("hash", HASHES)
def test_partial_blocks_and_last_token_never_shared(mk, hash):
    c = mk(hash=hash)
    p = ids(14, 500)                          # 3 full blocks + 2 tokens
    s, _k, _v = prefill(c, p, 1)
    assert c.stats()["index_entries"] == 3
    assert c.match_prefix(p) == 12
    assert c.match_prefix(np.r_[p, 1, 2, 3]) == 12     # block 3 partial: not shared
    s2 = c.create_sequence(tokens=np.r_[p, 77, 78])
    assert c.seq_len(s2) == 12
    # a prompt of exactly k full blocks shares k - 1 (the last token must be computed)
    k2, v2 = kv(c, 2, 2)
    c.append(s, k2, v2, tokens=[600, 601])              # block 3 now full and published
    p16 = np.r_[p, 600, 601]
    assert c.stats()["index_entries"] == 4
    assert c.match_prefix(p16) == 12
    s3 = c.create_sequence(tokens=p16)
    assert c.seq_len(s3) == 12
    assert c.match_prefix(np.r_[p16, 1]) == 16
    s4 = c.create_sequence(tokens=np.r_[p16, 1])
    assert c.seq_len(s4) == 16
    np.testing.assert_array_equal(c.token_ids(s4), p16)
    # tiny prompts share nothing
    for q in ([], [500], p[:4]):
        assert c.match_prefix(np.asarray(q, np.int32)) == 0
    s5 = c.create_sequence(tokens=p[:4])
    assert c.seq_len(s5) == 0
    for x in (s, s2, s3, s4, s5):
        c.free(x)
    # freed: the full blocks are cached, the partial ones are plain free
    st = c.stats()
    assert st["cached_blocks"] == 4 and st["used_blocks"] == 0


def test_bad_token_arguments_change_nothing(mk):
    c = mk()
    s = c.create_sequence(tokens=ids(5, 1))
    k, v = kv(c, 4, 1)
    before = c.stats()
    for bad, exc in (([1, 2, 3], ValueError), ([1, 2, 3, -1], ValueError),
                     ([1, 2, 3, 2**31], ValueError), (np.ones(4) * 1.5, TypeError),
                     (np.ones((2, 2), np.int32), ValueError)):
        with pytest.raises(exc):
            c.append(s, k, v, tokens=bad)
        with pytest.raises(exc):
            c.reserve(s, 4, tokens=bad)
    with pytest.raises(TypeError):
        c.create_sequence(tokens=[1, 2], salt=3)
    with pytest.raises(TypeError):
        c.match_prefix(ids(9, 1), salt=3.0)
    with pytest.raises(ValueError):
        c.create_sequence(tokens=ids(9, 1), priority=-1)
    after = c.stats()
    for key in ("used_blocks", "num_sequences", "appended_tokens", "index_entries",
                "prefix_queries"):
        assert after[key] == before[key], key
    assert c.seq_len(s) == 0
    c.free(s)


def test_append_without_tokens_stops_hashing(mk):
    c = mk()
    s = c.create_sequence(tokens=[1])
    k, v = kv(c, 16, 1)
    c.append(s, k[:, :4], v[:, :4], tokens=ids(4, 10))
    c.append(s, k[:, 4:12], v[:, 4:12])                     # untracked from here on
    c.append(s, k[:, 12:], v[:, 12:], tokens=ids(4, 30))
    assert c.stats()["index_entries"] == 1
    assert c.match_prefix(np.r_[ids(4, 10), 1]) == 4
    c.free(s)
    assert c.stats()["cached_blocks"] == 1


# ---- reserve + write + commit, forks -------------------------------------------------------
@pytest.mark.parametrize("hash", HASHES)
def test_reserve_findable_only_after_commit(mk, hash):
    c = mk(hash=hash)
    cfg = c.config
    p = ids(10, 200)
    k, v = kv(c, 16, 5)
    s = c.create_sequence(tokens=p)
    slots = c.reserve(s, 10, tokens=p)
    assert c.match_prefix(np.r_[p, 1]) == 0                 # hashed, not findable
    assert c.stats()["index_entries"] == 0
    for layer in range(cfg.num_layers):
        c.write(layer, slots, k[layer, :10], v[layer, :10])
        assert c.match_prefix(np.r_[p, 1]) == 0
    assert c.commit(s) == 2
    assert c.commit(s) == 0
    assert c.match_prefix(np.r_[p, 1]) == 8
    p16 = np.r_[p, ids(6, 300)]
    slots = c.reserve(s, 6, tokens=p16[10:])
    assert c.match_prefix(np.r_[p16, 1]) == 8
    for layer in range(cfg.num_layers):
        c.write(layer, slots, k[layer, 10:], v[layer, 10:])
    assert c.commit(s) == 2
    assert c.match_prefix(np.r_[p16, 1]) == 16
    s2 = c.create_sequence(tokens=np.r_[p16, 1])
    assert c.seq_len(s2) == 16
    gk, gv = c.gather(s2)
    np.testing.assert_array_equal(gk, k)
    np.testing.assert_array_equal(gv, v)
    # reserve without tokens: the sequence stops being hashed
    c.reserve(s, 4)
    assert c.commit(s) == 0
    assert c.stats()["index_entries"] == 4
    c.free(s)
    c.free(s2)


@pytest.mark.parametrize("hash", HASHES)
def test_fork_then_append_chains_stay_correct(mk, hash):
    """Parent and child diverge inside a shared partial block: each one's new blocks hash
    on its own tokens (the child's copy-on-write block included), and each prompt hits
    its own data."""
    c = mk(hash=hash)
    P = ids(10, 100)                          # 2 full blocks + 2 tokens
    par, kp, vp = prefill(c, P, 1)
    ch = c.fork(par)
    C, D = ids(6, 2000), ids(6, 3000)
    kc, vc = kv(c, 6, 2)
    kd, vd = kv(c, 6, 3)
    c.append(ch, kc, vc, tokens=C)
    c.append(par, kd, vd, tokens=D)
    assert c.stats()["cow_copies"] == 1
    PC, PD = np.r_[P, C], np.r_[P, D]
    np.testing.assert_array_equal(c.token_ids(ch), PC)
    np.testing.assert_array_equal(c.token_ids(par), PD)
    assert c.stats()["index_entries"] == 2 + 2 + 2
    assert c.match_prefix(np.r_[PC, 1]) == 16
    assert c.match_prefix(np.r_[PD, 1]) == 16
    # mixing the parent's block 2 with the child's block 3 is no prompt
    assert c.match_prefix(np.r_[P, D[:2], C[2:], 1]) == 12
    for prompt, k, v, src in ((PC, np.concatenate([kp, kc], 1), np.concatenate([vp, vc], 1), ch),
                              (PD, np.concatenate([kp, kd], 1), np.concatenate([vp, vd], 1), par)):
        s = c.create_sequence(tokens=np.r_[prompt, 1])
        assert c.seq_len(s) == 16
        np.testing.assert_array_equal(c.block_table(s), c.block_table(src))
        gk, gv = c.gather(s)
        np.testing.assert_array_equal(gk, k)
        np.testing.assert_array_equal(gv, v)
        c.free(s)
    c.free(par)
    c.free(ch)


def test_fork_does_not_publish_parents_uncommitted_blocks(mk):
    """reserve(tokens=) makes blocks findable only at commit.  A child forked before the
    parent's commit must not publish the parent's reserved-but-uncommitted (here: never
    written) blocks when the child appends: another process would get a hit on K/V
    nobody wrote."""
    c = mk()
    p = c.create_sequence(tokens=[1])
    k, v = kv(c, 1, 1)
    c.append(p, k, v, tokens=[1])
    c.reserve(p, 8, tokens=ids(8, 2))         # blocks 0-1 full; nothing written, no commit
    assert c.match_prefix(ids(20, 1)) == 0
    ch = c.fork(p)
    k4, v4 = kv(c, 4, 2)
    c.append(ch, k4, v4, tokens=ids(4, 50))
    try:
        assert c.match_prefix(ids(20, 1)) == 0, (
            "the parent's uncommitted blocks became findable through the child")
    finally:
        c.free(ch)
        c.free(p)


# ---- cached blocks: LRU order --------------------------------------------------------------
@pytest.mark.parametrize("recover", [False, True], ids=["plain", "recovered"])
def test_cached_blocks_lru_order(mk, recover):
    """Freed hashed blocks stay findable and count as free; new data takes never-cached
    free blocks first, then cached ones, least recently freed first; a hit takes a cached
    block back (and its next free makes it most recent).  A recovery pass (which rebuilds
    the free stack, LRU list and index) keeps all of that."""
    c = mk(num_blocks=32)
    A, B, C = ids(12, 1000), ids(12, 2000), ids(12, 3000)   # 3 full blocks each
    data = {}
    for name, p in (("A", A), ("B", B), ("C", C)):
        s, k, v = prefill(c, p, len(data))
        data[name] = (k, v)
        c.free(s)
    st = c.stats()
    assert st["cached_blocks"] == 9 and st["free_blocks"] == 32 and st["used_blocks"] == 0
    # a hit on A takes its cached blocks back; freeing it makes A the most recent
    s = c.create_sequence(tokens=np.r_[A, 1])
    st = c.stats()
    assert c.seq_len(s) == 12
    assert st["cached_blocks"] == 6 and st["used_blocks"] == 3 and st["free_blocks"] == 29
    assert st["cached_blocks_reused"] == 3
    np.testing.assert_array_equal(c.gather(s)[0], data["A"][0])
    c.free(s)                                 # LRU order now: B, C, A
    if recover:
        c.recover()
        st = c.stats()
        assert st["cached_blocks"] == 9 == st["index_entries"] and st["used_blocks"] == 0
    survivors = lambda: [n for n, p in (("A", A), ("B", B), ("C", C))
                         if c.match_prefix(np.r_[p, 1]) == 12]
    # 23 never-cached blocks go first: nothing cached is touched
    x = c.create_sequence()
    k, v = kv(c, 23 * BS, 9)
    c.append(x, k, v)
    st = c.stats()
    assert st["cached_blocks"] == 9 and st["cached_blocks_evicted"] == 0
    assert st["free_blocks"] == 9 and st["used_blocks"] == 23
    assert survivors() == ["A", "B", "C"]
    k, v = kv(c, 3 * BS, 10)
    expect = [["A", "C"], ["A"], []]
    for i in range(3):
        c.append(x, k, v)
        st = c.stats()
        assert st["cached_blocks_evicted"] == 3 * (i + 1)
        assert st["cached_blocks"] == 9 - 3 * (i + 1) == st["index_entries"]
        assert survivors() == expect[i]
    assert c.stats()["free_blocks"] == 0
    with pytest.raises(shmkv.CacheFullError):
        c.append(x, k[:, :1], v[:, :1])
    c.free(x)
    st = c.stats()
    assert st["free_blocks"] == 32 and st["cached_blocks"] == 0


def test_cached_eviction_takes_a_chain_tail_first(mk):
    """vLLM frees a request's blocks in reverse order so that, among blocks freed
    together, the tail of the chain is evicted first: what is left of the chain stays
    a usable (shorter) prefix.  Evicting the head first leaves the rest of the chain
    cached but unreachable (every lookup stops at block 0)."""
    c = mk(num_blocks=8)
    A = ids(12, 1000)                         # 3 full blocks
    s, _, _ = prefill(c, A, 1)
    c.free(s)
    x = c.create_sequence()
    k, v = kv(c, 6 * BS, 2)                   # 5 never-cached + 1 cached block
    c.append(x, k, v)
    assert c.stats()["cached_blocks_evicted"] == 1
    try:
        assert c.match_prefix(np.r_[A, 1]) == 8, (
            "evicting one block of a freed 3-block chain left "
            f"{c.match_prefix(np.r_[A, 1])} tokens findable (expected 8: the tail goes first)")
    finally:
        c.free(x)


# ---- eviction policies ---------------------------------------------------------------------
TICK = 0.03        # > CLOCK_MONOTONIC_COARSE resolution: distinct last-use stamps


def _policy_setup(c):
    """Four sequences whose first two victims differ under every policy.

    s0: 20 tokens, priority 3, used once          (last use 4th)
    s1:  8 tokens, priority 5 -> 0, used 3 times  (last use 1st)
    s2: 28 tokens, priority 4, used 3 times       (last use 2nd)
    s3: 12 tokens, priority 1, used twice         (last use 5th, latest)
    """
    lens, prios, seqs, prompts = {0: 20, 1: 8, 2: 28, 3: 12}, {0: 3, 1: 5, 2: 4, 3: 1}, {}, {}

    def make(i):
        p = ids(lens[i], 10000 * (i + 1))
        k, v = kv(c, lens[i], i)
        s = c.create_sequence(tokens=p, priority=prios[i])
        c.append(s, k, v, tokens=p)
        seqs[i], prompts[i] = s, p
        time.sleep(TICK)

    def use(i, times):
        for _ in range(times):
            c.gather(seqs[i])
        time.sleep(TICK)

    make(1)
    make(2)
    use(1, 2)
    use(2, 2)
    make(3)
    make(0)
    use(3, 1)
    c.set_priority(seqs[1], 0)
    snap = {d["sid"]: d for d in snapshot(c.name, tables=False)["sequences"]}
    stamps = [snap[seqs[i]]["last_access_ns"] for i in (1, 2, 0, 3)]
    assert stamps == sorted(stamps) and len(set(stamps)) == 4, "coarse clock too coarse"
    assert [snap[seqs[i]]["access_count"] for i in range(4)] == [1, 3, 3, 2]
    assert [snap[seqs[i]]["priority"] for i in range(4)] == [3, 0, 4, 1]
    return seqs, prompts, lens


ORDER = {"lru": [1, 2, 0, 3], "lfu": [0, 3, 1, 2], "longest": [2, 0, 3, 1],
         "priority": [1, 3, 0, 2]}


@pytest.mark.parametrize("excluded", [False, True])
@pytest.mark.parametrize("policy", sorted(ORDER))
def test_evict_policy_picks_victims(mk, policy, excluded):
    c = mk(num_blocks=32)
    seqs, prompts, lens = _policy_setup(c)                  # 17 blocks used
    order = ORDER[policy]
    keep = [seqs[order[0]]] if excluded else []
    victims = order[1:3] if excluded else order[:2]
    before = c.stats()
    assert before["free_blocks"] == 15
    # enough free already: nothing evicted
    assert c.evict(policy, 15) == []
    target = 15 + sum(lens[i] // BS for i in victims)
    got = c.evict(policy, target, exclude=keep)
    assert got == [seqs[i] for i in victims]
    st = c.stats()
    assert st["free_blocks"] == target
    for p in ORDER:
        want = before[f"evictions_{p}"] + (2 if p == policy else 0)
        assert st[f"evictions_{p}"] == want
    assert st["sequences_freed"] == before["sequences_freed"] + 2
    for i in range(4):
        if i in victims:
            with pytest.raises(shmkv.SequenceNotFound):
                c.seq_len(seqs[i])
            # an evicted sequence's full blocks stay cached: its prompt still hits
            assert c.match_prefix(np.r_[prompts[i], 1]) == lens[i]
        else:
            assert c.seq_len(seqs[i]) == lens[i]
            np.testing.assert_array_equal(c.gather(seqs[i])[0], kv(c, lens[i], i)[0])
    assert c.check() == []
    # a target that cannot be met evicts everything that is eligible
    rest = [seqs[i] for i in order if i not in victims and seqs[i] not in keep]
    assert sorted(c.evict(policy, 32, exclude=keep)) == sorted(rest)
    assert c.sequences() == keep
    for s in keep:
        c.free(s)


def test_evict_rejects_bad_arguments(mk):
    c = mk()
    with pytest.raises(ValueError):
        c.evict("fifo", 1)
    with pytest.raises(ValueError):
        c.evict("lru", c.config.num_blocks + 1)
    with pytest.raises(TypeError):
        c.evict("lru", 1.5)
    with pytest.raises(ValueError):
        c.set_priority(c.create_sequence(), -1)


# ---- StreamingLLM trim ---------------------------------------------------------------------
def test_trim_streaming_keeps_sink_and_window(mk):
    c = mk(num_blocks=32)
    n = 38                                    # 10 blocks, the last one half full
    p = ids(n, 700)
    s, k, v = prefill(c, p, 1)
    table = c.block_table(s)
    ch = c.fork(s)                            # shares all 10 blocks, keeps them
    free0 = c.stats()["free_blocks"]
    dropped = c.trim_streaming(s, 3, 10)      # sink -> block 0; window 28..37 -> blocks 7-9
    assert dropped == 6 * BS == c.trimmed(s)
    keep = np.r_[0:4, 28:38]
    assert c.seq_len(s) == len(keep) == n - dropped
    gk, gv = c.gather(s)
    np.testing.assert_array_equal(gk, k[:, keep])
    np.testing.assert_array_equal(gv, v[:, keep])
    np.testing.assert_array_equal(c.token_ids(s), p[keep])
    np.testing.assert_array_equal(c.block_table(s), np.r_[table[:1], table[7:]])
    st = c.stats()
    assert st["trimmed_blocks"] == 6
    assert st["free_blocks"] == free0          # the fork still holds the dropped blocks
    # the fork keeps every token
    assert c.seq_len(ch) == n and c.trimmed(ch) == 0
    np.testing.assert_array_equal(c.gather(ch)[0], k)
    c.free(ch)
    # now the dropped blocks are free (the 9 full ones of the fork's table were
    # published by s: the dropped 6 stay cached, findable)
    assert c.stats()["used_blocks"] == 4
    # appending after the trim lands at the renumbered positions
    k2, v2 = kv(c, 10, 2)
    c.append(s, k2, v2, tokens=ids(10, 5000))
    assert c.seq_len(s) == 24
    gk, _ = c.gather(s)
    np.testing.assert_array_equal(gk[:, :14], k[:, keep])
    np.testing.assert_array_equal(gk[:, 14:], k2)
    # a second trim accumulates; overlapping ends drop nothing
    assert c.trim_streaming(s, 4, 100) == 0
    d2 = c.trim_streaming(s, 0, 5)            # len 24: keep blocks holding 19..23 -> 4, 5
    assert d2 == 4 * BS and c.trimmed(s) == dropped + d2
    assert c.seq_len(s) == 8
    gk, _ = c.gather(s)
    np.testing.assert_array_equal(gk, np.concatenate([k[:, keep], k2], 1)[:, 16:])
    assert c.stats()["trimmed_blocks"] == 10
    assert c.check() == []
    c.free(s)
    assert c.stats()["used_blocks"] == 0


def test_trim_frees_blocks_and_stops_hashing(mk):
    c = mk(num_blocks=32)
    s = c.create_sequence()
    k, v = kv(c, 40, 3)
    c.append(s, k, v)                         # untracked: trimmed blocks go to the free stack
    used0 = c.stats()["used_blocks"]
    assert c.trim_streaming(s, 4, 8) == 7 * BS
    st = c.stats()
    assert st["used_blocks"] == used0 - 7 and st["cached_blocks"] == 0
    np.testing.assert_array_equal(c.gather(s)[0], k[:, np.r_[0:4, 32:40]])
    # a tokened sequence stops being published after a trim
    t = c.create_sequence(tokens=ids(16, 1))
    k2, v2 = kv(c, 16, 4)
    c.append(t, k2, v2, tokens=ids(16, 1))
    e0 = c.stats()["index_entries"]
    c.trim_streaming(t, 4, 4)
    k3, v3 = kv(c, 8, 5)
    c.append(t, k3, v3, tokens=ids(8, 99))
    assert c.stats()["index_entries"] == e0
    with pytest.raises(ValueError):
        c.trim_streaming(t, -1, 4)
    c.free(s)
    c.free(t)


# ---- many processes at once ------------------------------------------------------------------
@pytest.mark.parametrize("evict,reserve", [(True, False), (False, True)],
                         ids=["evict", "reserve"])
def test_concurrent_prefix_traffic_serves_only_correct_blocks(mk, procs, evict, reserve):
    """Three processes share a small pool: hits, appends, forks, trims, frees, and either
    evictions of each other's sequences or reserve+write+commit.  Every gather (hits
    included) must hold exactly the ids and positions the sequence was built from.
    (Both at once corrupt data: see the evict-vs-pending-write test below.)"""
    c = mk(num_blocks=96, max_seqs=32)
    q = SPAWN.Queue()
    for w in range(3):
        p = SPAWN.Process(target=pw.stress, args=(c.name, w, 2.0, 11, q, evict, reserve))
        p.start()
        procs.append(p)
    reps = [q.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for r in reps:
        assert "error" not in r, r["error"]
        assert r["check"] == []
    total = {k: sum(r[k] for r in reps) for k in reps[0] if k not in ("check", "details")}
    assert total["requests"] > 50 and total["hit_tokens"] > 0
    assert total["mismatches"] == 0 and total["bad_len"] == 0, (total, [r["details"] for r in reps])
    st = c.stats()
    assert st["used_blocks"] == 0 and c.sequences() == []


def test_evict_by_another_process_never_lets_a_pending_write_corrupt_others(mk):
    """Process A reserves slots (the decode step: reserve, then write every layer, then
    commit).  Process B evicts in that window and fills the pool with its own data.
    Whatever the core does (skip A's sequence while it has unwritten reserved tokens, or
    make A's write fail), A's write must never land in B's blocks."""
    c = mk(num_blocks=16)
    cfg = c.config
    a = c.create_sequence()
    k, v = kv(c, 8, 1)
    c.append(a, k, v)
    slots = c.reserve(a, 4)                   # reserved, not yet written
    rb = run(pw.evict_all_and_fill, c.name)
    try:
        wk, wv = kv(c, 4, 2)
        for layer in range(cfg.num_layers):
            c.write(layer, slots, wk[layer], wv[layer])
    except shmkv.ShmkvError:
        pass                                  # refusing the write is fine
    finally:
        bk, bv = pw.kv_data(cfg, rb["n"], 99)
        gk, gv = c.gather(rb["sid"])
        c.free(rb["sid"])
        if a not in rb["evicted"]:
            c.free(a)
    np.testing.assert_array_equal(gk, bk, err_msg=f"B's data was overwritten by A's write "
                                  f"(B evicted {rb['evicted']}, A was {a})")
    np.testing.assert_array_equal(gv, bv)
