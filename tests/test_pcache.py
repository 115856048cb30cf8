"""The per-process block and slot caches: a sequence's life without the pool lock.

What they must never change: free_blocks/used_blocks and num_sequences stay exact,
check() stays clean, CacheFullError only when the pool is really full (blocks another
process keeps for itself count as free), and a process that dies -- also halfway
through a fast path -- loses nothing."""
import os
import threading

import numpy as np
import pytest
from workers import pcache_workers
from workers.recovery_workers import segment_bytes

import shmkv
from shmkv import _bench
from shmkv.inspect import snapshot, struct_layout

CAP_BLOCKS = struct_layout()["proc"]["cache_blocks"]
CAP_SEQS = struct_layout()["proc"]["cache_seqs"]


def _proc_cache(cache):
    """(cached block ids, cached sequence slots) of this process, from the snapshot."""
    me = cache._debug_info()["proc_slot"]
    for p in snapshot(cache.name)["processes"]:
        if p["slot"] == me:
            return p["cached_blocks"], p["cached_seq_slots"]
    raise AssertionError("this process is not in the process table")


def _field(cache, name, count=1):
    """A writable view of a field of this process's slot (to play a hostile peer)."""
    info = cache._debug_info()
    lay = struct_layout()["proc"]
    off, fmt = lay["fields"][name][:2]
    dt = {"I": np.uint32, "Q": np.uint64}[fmt]
    return np.ndarray((count,), dt, buffer=segment_bytes(cache),
                      offset=info["layout"]["off_procs"] + lay["size"] * info["proc_slot"] + off)


def test_a_life_leaves_blocks_in_the_cache_and_the_counts_exact(cache):
    bs = cache.config.block_size
    sid = cache.create_sequence()
    # the first create takes the slow path and fills the cache to half; the reserve is
    # then served from it
    cache.reserve(sid, 3 * bs)
    st = cache.stats()
    assert st["used_blocks"] == 3 and st["free_blocks"] == cache.config.num_blocks - 3
    assert st["num_sequences"] == 1
    nb, ns = _proc_cache(cache)
    assert nb == CAP_BLOCKS // 2 - 3 and ns == CAP_SEQS // 2
    cache.free(sid)
    st = cache.stats()
    assert st["used_blocks"] == 0 and st["free_blocks"] == cache.config.num_blocks
    assert st["num_sequences"] == 0 and st["peak_used_blocks"] == 3
    assert cache.check() == []
    for _ in range(200):                       # fast lives
        s = cache.create_sequence()
        cache.reserve(s, bs)
        assert cache.stats()["used_blocks"] == 1
        cache.free(s)
    st = cache.stats()
    assert st["allocations"] == 203 and st["frees"] == 203
    assert st["sequences_created"] == 201 and st["sequences_freed"] == 201
    assert cache.check() == []


def test_fast_and_slow_paths_hand_out_distinct_blocks(cache):
    """Many sequences alive at once, grown by one block at a time: never a block twice."""
    bs = cache.config.block_size
    sids = [cache.create_sequence() for _ in range(12)]
    for _ in range(4):
        for s in sids:
            cache.reserve(s, bs)
    tables = np.concatenate([cache.block_table(s) for s in sids])
    assert len(set(tables.tolist())) == len(tables) == 48
    assert cache.stats()["used_blocks"] == 48 and cache.check() == []
    for s in sids[::2]:
        cache.free(s)
    assert cache.check() == [] and cache.stats()["used_blocks"] == 24
    for s in sids[1::2]:
        cache.free(s)
    assert cache.check() == [] and cache.stats()["used_blocks"] == 0


def test_shared_blocks_take_the_slow_path_and_stay_correct(cache):
    bs = cache.config.block_size
    k = np.ones((cache.config.num_layers, 2 * bs, cache.config.num_kv_heads,
                 cache.config.head_dim), cache.config.numpy_dtype)
    a = cache.create_sequence()
    cache.append(a, k, k)
    b = cache.fork(a)
    cache.free(a)                              # shared with b: no block falls to 0
    assert cache.stats()["used_blocks"] == 2 and cache.check() == []
    kb, _ = cache.gather(b)
    assert (kb == 1).all()
    cache.free(b)
    assert cache.stats()["used_blocks"] == 0 and cache.check() == []


def test_blocks_in_another_process_cache_are_not_full(make_cache, spawn):
    """CacheFullError only when the pool is really exhausted: a peer's cached blocks and
    slots are drained back first."""
    cache = make_cache(num_blocks=24, max_seqs=8)
    ready, go = spawn.ctx.Event(), spawn.ctx.Event()
    p = spawn(pcache_workers.fill_cache_and_wait, cache.name, 5, ready, go)
    assert ready.wait(30)
    peer = [x for x in snapshot(cache.name)["processes"] if x["pid"] == p.pid][0]
    assert peer["cached_blocks"] > 0 and peer["cached_seq_slots"] > 0
    try:
        sids = [cache.create_sequence() for _ in range(8)]      # every slot
        for s in sids:
            cache.reserve(s, 3 * cache.config.block_size)       # every block
        assert cache.stats()["free_blocks"] == 0
        with pytest.raises(shmkv.CacheFullError):
            cache.reserve(sids[0], cache.config.block_size)
        with pytest.raises(shmkv.CacheFullError):
            cache.create_sequence()
        assert cache.check() == []
        for s in sids:
            cache.free(s)
    finally:
        go.set()
    p.join(30)
    assert p.exitcode == 0
    assert cache.check() == [] and cache.stats()["free_blocks"] == 24


def test_a_dead_process_cache_is_reclaimed(cache, spawn):
    ready = spawn.ctx.Event()
    p = spawn(pcache_workers.fill_cache_and_die, cache.name, ready)
    p.join(30)
    assert p.exitcode == 0 and ready.is_set()
    snap = snapshot(cache.name)
    dead = [x for x in snap["processes"] if x["pid"] == p.pid][0]
    assert not dead["alive"] and dead["cached_blocks"] > 0
    assert snap["free_blocks"] == cache.config.num_blocks   # cached blocks count as free
    r = cache.recover()
    assert r["processes"] == 1
    assert cache.check() == []
    st = cache.stats()
    assert st["free_blocks"] == cache.config.num_blocks and st["num_sequences"] == 0
    sids = [cache.create_sequence() for _ in range(cache.config.max_seqs)]
    for s in sids:                                           # everything is usable again
        cache.reserve(s, cache.config.block_size)
    assert cache.check() == []


@pytest.mark.parametrize("point", ["free_mid", "grow_before_tail", "grow_after_tail"])
def test_death_inside_a_fast_path(cache, spawn, point):
    """The worker dies holding its cache lock, halfway through a fast free or grow: the
    next check() takes the lock over, runs recovery, and the sequence is intact."""
    cfg = cache.config
    bs = cfg.block_size
    sid = cache.create_sequence()
    k = np.full((cfg.num_layers, 3 * bs, cfg.num_kv_heads, cfg.head_dim), 5, cfg.numpy_dtype)
    cache.append(sid, k, k)
    cache.detach(sid)
    p = spawn(pcache_workers.die_in_fast_path, cache.name, point, sid)
    p.join(30)
    assert p.exitcode == 86, "the crash point did not fire"
    before = cache.stats()["recoveries"]
    assert cache.check() == []                 # took the dead holder's lock: recovered
    assert cache.stats()["recoveries"] > before
    if point == "free_mid":
        # the free did not complete and the owner is dead: reclaimed, nothing leaked
        with pytest.raises(shmkv.SequenceNotFound):
            cache.seq_len(sid)
    else:
        assert cache.seq_len(sid) == 3 * bs   # the unpublished grow left no trace
        kk, _ = cache.gather(sid)
        assert (kk == 5).all()
        cache.free(sid)
    assert cache.stats()["used_blocks"] == 0 and cache.check() == []


def test_hostile_cache_entries_are_refused_and_repaired(cache):
    """Never trust the segment: garbage in our own cache gives SegmentError (no block
    handed out twice), and recover() drops what is not a free block."""
    bs = cache.config.block_size
    s = cache.create_sequence()
    cache.reserve(s, bs)                       # cache now half full
    held = int(cache.block_table(s)[0])
    blocks = _field(cache, "cache_blocks", CAP_BLOCKS)
    nblocks = _field(cache, "cache_nblocks")
    n = int(nblocks[0])
    assert n > 0
    saved = blocks.copy()
    blocks[n - 1] = held                       # a block that is in use
    t = cache.create_sequence()
    with pytest.raises(shmkv.SegmentError):
        cache.reserve(t, bs)
    assert cache.seq_len(t) == 0
    blocks[n - 1] = 10**9                      # not a block id
    with pytest.raises(shmkv.SegmentError):
        cache.reserve(t, bs)
    nblocks[0] = CAP_BLOCKS + 5                # a count past the capacity
    with pytest.raises(shmkv.SegmentError):
        cache.reserve(t, bs)
    assert any("cached" in line for line in cache.check())
    nblocks[0] = n
    blocks[:] = saved
    blocks[n - 1] = held
    cache.recover(full=True)                   # drops the bad entry, keeps the rest
    assert cache.check() == []
    cache.reserve(t, bs)
    assert int(cache.block_table(t)[0]) != held
    cache.free(s)
    cache.free(t)
    assert cache.check() == [] and cache.stats()["used_blocks"] == 0


def test_threads_share_one_process_cache(cache):
    """Two threads of one process run lives on the same process cache (its lock): no
    block or slot is handed out twice."""
    bs = cache.config.block_size
    errors = []

    def lives(n):
        try:
            for _ in range(n):
                s = cache.create_sequence()
                cache.reserve(s, 2 * bs)
                t = cache.block_table(s)
                assert len(set(t.tolist())) == 2
                cache.free(s)
        except Exception as e:                 # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=lives, args=(3000,)) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert cache.check() == [] and cache.stats()["used_blocks"] == 0


def test_close_returns_the_cache_to_the_pool(seg_name):
    cfg = shmkv.CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=32,
                            block_size=4, max_seqs=16)
    a = shmkv.KVCache.create(seg_name, cfg)
    try:
        s = a.create_sequence()
        a.reserve(s, 4)
        a.free(s)
        assert _proc_cache(a)[0] > 0
        snap_before = snapshot(seg_name)
        assert snap_before["free_blocks"] == 32
    finally:
        a.close()
    b = shmkv.KVCache.attach(seg_name)
    try:
        assert b.check() == []
        assert b.stats()["free_blocks"] == 32
    finally:
        b.close()


def test_bench_hook_both_paths(cache):
    assert _bench.bench_alloc_free(cache, 10_000) > 0
    assert _bench.bench_alloc_free(cache, 10_000, shared=True) > 0
    st = cache.stats()
    assert st["allocations"] == st["frees"] == 20_000
    assert st["used_blocks"] == 0 and cache.check() == []



def test_procs_command_shows_each_process_cache(cache, capsys):
    """`shmkv procs` (and its --json) shows the blocks and slots each process keeps."""
    import json

    from shmkv import cli

    s = cache.create_sequence()
    cache.reserve(s, cache.config.block_size)
    cache.free(s)
    nb, ns = _proc_cache(cache)
    assert nb > 0 and ns > 0
    assert cli.main(["procs", cache.name, "--json"]) == 0
    me = [p for p in json.loads(capsys.readouterr().out) if p["pid"] == os.getpid()]
    assert me and me[0]["cached_blocks"] == nb and me[0]["cached_seq_slots"] == ns
    assert cli.main(["procs", cache.name]) == 0
    out = capsys.readouterr().out
    assert "CACHE" in out and f"{nb}/{ns}" in out


@pytest.mark.parametrize("op", ["fork", "detach", "adopt", "set_priority"])
def test_sequence_ops_wait_for_the_sequence_lock(cache, op):
    """fork, detach, adopt and set_priority take the sequence's lock (a free on its
    owner's fast path takes no pool lock): while a live holder keeps it they wait, for
    lock_timeout at most, and change nothing."""
    info = cache._debug_info()
    seq = struct_layout()["seq"]
    sid = cache.create_sequence()
    cache.reserve(sid, 3)
    slot = sid % cache.config.max_seqs
    base = info["layout"]["off_seqs"] + seq["size"] * slot
    writer = np.ndarray((1,), np.uint64, buffer=segment_bytes(cache),
                        offset=base + seq["fields"]["writer"][0])
    writer[0] = info["proc_token"]                 # held, as by another call of ours
    before = cache.stats()
    cache.lock_timeout = 0.2
    call = {"fork": lambda: cache.fork(sid), "detach": lambda: cache.detach(sid),
            "adopt": lambda: cache.adopt(sid), "set_priority": lambda: cache.set_priority(sid, 7)}
    with pytest.raises(shmkv.LockTimeout):
        call[op]()
    after = cache.stats()
    assert after["num_sequences"] == before["num_sequences"] == 1
    assert cache.owner_pid(sid) == os.getpid()
    writer[0] = 0
    call[op]()                                     # free again: it goes through
    cache.free(sid)
    assert cache.check() == []
