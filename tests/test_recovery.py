"""Recovery from deaths inside operations, ownership at exit, racing creators, os.fork."""
import multiprocessing as mp
import os

import numpy as np
import pytest
from support import SMALL, unique_name, unlink_segment
from workers import recovery_workers
from workers.recovery_workers import segment_bytes, tokens

import shmkv
import shmkv._core as _core
from shmkv.inspect import snapshot, struct_layout

ctx = mp.get_context("spawn")


def test_racing_open_one_creator(procs):
    name = unique_name("race")
    cfg = shmkv.CacheConfig(**SMALL)
    try:
        barrier, q = ctx.Barrier(4), ctx.Queue()
        for _ in range(4):
            p = ctx.Process(target=recovery_workers.open_segment,
                            args=(name, cfg, barrier, q))
            p.start()
            procs.append(p)
        got = [q.get(timeout=60) for _ in range(4)]
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        assert sum(created for _, created, _ in got) == 1
        assert all(same for _, _, same in got)
    finally:
        unlink_segment(name)


def test_create_race_loser_gets_file_exists(seg_name):
    cfg = shmkv.CacheConfig(**SMALL)
    with shmkv.KVCache.create(seg_name, cfg):
        with pytest.raises(FileExistsError):
            shmkv.KVCache.create(seg_name, cfg)
        other = shmkv.CacheConfig(**{**SMALL, "num_blocks": 8})
        with pytest.raises(shmkv.SegmentError):
            shmkv.KVCache.open(seg_name, other)


@pytest.mark.parametrize("point", ["alloc_mid", "grow_before_tail", "grow_after_tail"])
def test_death_holding_the_pool_lock(cache, procs, point):
    """The worker dies inside the pool lock's critical section: the next locker gets
    EOWNERDEAD, rebuilds, and the sequence keeps exactly its published tokens."""
    cfg = cache.config
    sid = cache.create_sequence()
    cache.append(sid, tokens(cfg, 3, 1), tokens(cfg, 3, 1))
    cache.detach(sid)
    p = ctx.Process(target=recovery_workers.die_at,
                    args=(cache.name, point, sid, 2 * cfg.block_size))
    p.start()
    procs.append(p)
    p.join(timeout=30)
    assert p.exitcode == 86, "the crash point did not fire"
    before = snapshot(cache.name)["counters"]["lock_owner_dead"]   # takes no lock
    assert cache.check() == []                 # took the lock: EOWNERDEAD -> rebuilt
    st = cache.stats()
    assert st["lock_owner_dead"] == before + 1
    assert cache.seq_len(sid) == 3
    k, _ = cache.gather(sid)
    assert (k == 1).all()
    cache.append(sid, tokens(cfg, 2, 3), tokens(cfg, 2, 3))   # the sequence lock is free again
    assert cache.seq_len(sid) == 5
    cache.free(sid)
    assert cache.check() == [] and cache.stats()["used_blocks"] == 0


@pytest.mark.parametrize("point,published", [("append_before_publish", False),
                                             ("append_after_publish", True),
                                             ("cow_after_copy", False),
                                             ("cow_commit_mid", False)])
def test_death_holding_a_sequence_lock(cache, procs, point, published):
    """The worker dies while it holds the sequence lock: a waiter takes the lock over
    (no LockTimeout), and the sequence is in its old or its new state, never between."""
    cfg = cache.config
    sid = cache.create_sequence()
    cache.append(sid, tokens(cfg, 3, 1), tokens(cfg, 3, 1))   # partial last block
    cache.detach(sid)
    keep = cache.fork(sid) if point.startswith("cow") else None   # makes the append COW
    p = ctx.Process(target=recovery_workers.die_at,
                    args=(cache.name, point, sid, 2))
    p.start()
    procs.append(p)
    p.join(timeout=30)
    assert p.exitcode == 86
    cache.lock_timeout = 5.0
    cache.append(sid, tokens(cfg, 1, 9), tokens(cfg, 1, 9))     # waits for the dead holder
    k, _ = cache.gather(sid)
    if published:
        assert k.shape[1] == 6 and (k[:, :3] == 1).all() and (k[:, 3:5] == 7).all()
    else:
        assert k.shape[1] == 4 and (k[:, :3] == 1).all()
    assert (k[:, -1] == 9).all()
    if keep is not None:
        kk, _ = cache.gather(keep)
        assert kk.shape[1] == 3 and (kk == 1).all()
        cache.free(keep)
    cache.recover()
    assert cache.check() == []
    cache.free(sid)
    assert cache.stats()["used_blocks"] == 0 and cache.check() == []


@pytest.mark.parametrize("detach_one", [False, True])
def test_dead_owner_sequences_are_reclaimed_detached_survive(cache, procs, detach_one):
    q = ctx.Queue()
    p = ctx.Process(target=recovery_workers.own_and_exit,
                    args=(cache.name, q, detach_one))
    p.start()
    procs.append(p)
    a, b = q.get(timeout=30)
    p.join(timeout=30)
    assert p.exitcode == 0
    rec = cache.recover()
    assert rec["processes"] == 1
    assert rec["sequences"] == (1 if detach_one else 2)
    with pytest.raises(shmkv.SequenceNotFound):
        cache.seq_len(a)
    if detach_one:
        assert cache.seq_len(b) == 5
        cache.adopt(b)
        assert cache.owner_pid(b) == os.getpid()
        cache.free(b)
    assert cache.stats()["used_blocks"] == 0 and cache.check() == []


def test_close_frees_own_sequences_but_not_detached(make_cache):
    cache = make_cache()
    other = shmkv.KVCache.attach(cache.name)      # same process: one registration
    a = other.create_sequence()
    b = other.create_sequence()
    other.append(b, tokens(cache.config, 2, 1), tokens(cache.config, 2, 1))
    other.detach(b)
    other.close()                                 # the process still has `cache` open
    assert set(cache.sequences()) == {a, b}
    cache.free(a)
    cache.free(b)
    assert cache.check() == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_os_fork_child_registers_itself(cache):
    """A child made by os.fork() must not pass for its parent: it takes its own process
    slot, and its sequences die with it while the parent's survive."""
    cfg = cache.config
    mine = cache.create_sequence()
    cache.append(mine, tokens(cfg, 2, 1), tokens(cfg, 2, 1))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                       # child
        try:
            s = cache.create_sequence()
            cache.append(s, tokens(cfg, 2, 5), tokens(cfg, 2, 5))
            os.write(w, str(cache._debug_info()["proc_slot"]).encode())
        finally:
            os._exit(0)
    os.close(w)
    child_slot = int(os.read(r, 100))
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert child_slot != cache._debug_info()["proc_slot"]
    rec = cache.recover()
    assert rec["sequences"] == 1
    assert cache.sequences() == [mine]
    assert (cache.gather(mine)[0] == 1).all()
    cache.free(mine)
    assert cache.check() == [] and cache.stats()["used_blocks"] == 0


def test_lock_timeout_when_a_live_holder_keeps_a_sequence(cache):
    """Bounded waits: a sequence lock held by a live process is waited on for
    lock_timeout, then LockTimeout -- never forever."""
    import time
    sid = cache.create_sequence()
    slot = sid % cache.config.max_seqs
    # hold the sequence lock as this process would, from outside the API
    info = cache._debug_info()
    lay = info["layout"]
    seq = struct_layout()["seq"]
    writer = np.ndarray((1,), np.uint64, buffer=segment_bytes(cache),
                        offset=lay["off_seqs"] + seq["size"] * slot + seq["fields"]["writer"][0])
    writer[0] = info["proc_token"]                       # the sequence lock word
    cache.lock_timeout = 0.3
    t0 = time.monotonic()
    with pytest.raises(shmkv.LockTimeout):
        cache.append(sid, tokens(cache.config, 1, 1), tokens(cache.config, 1, 1))
    assert 0.25 < time.monotonic() - t0 < 5
    writer[0] = 0
    cache.free(sid)
    assert cache.check() == []


def test_attach_fails_when_its_recovery_pass_fails(cache, procs):
    """A live process stuck inside a fast path (its cache_lock held: planted here in this
    process's own slot, which stays alive) keeps the recovery pass of a later attach from
    quiescing.  That attach used to succeed anyway, with the derived state not rebuilt;
    now it raises LockTimeout within its timeout, and leaves nothing behind (the process
    is not in the table); an attach with recover=False still works."""
    import struct

    me = [p for p in snapshot(cache.name)["processes"] if p["pid"] == os.getpid()][0]
    proc = struct_layout()["proc"]
    off = (_core.layout_of(cache.config)["off_procs"] + proc["size"] * me["slot"]
           + proc["fields"]["cache_lock"][0])
    path = os.path.join("/dev/shm", cache.name.lstrip("/"))
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(struct.pack("<Q", (me["gen"] << 32) | (me["slot"] + 1)))
    try:
        q = ctx.Queue()
        p = ctx.Process(target=recovery_workers.attach_with_recovery,
                        args=(cache.name, 0.5, q))
        p.start()
        procs.append(p)
        err, listed, plain, took = q.get(timeout=120)
        p.join(timeout=30)
        assert p.exitcode == 0
    finally:
        with open(path, "r+b") as f:
            f.seek(off)
            f.write(struct.pack("<Q", 0))
    assert err == "LockTimeout"
    assert took < 8, f"the recovery's lock wait is bounded by attach's timeout ({took:.1f} s)"
    assert not listed, "a failed attach left its process in the table"
    assert plain == 2                               # this process and the recover=False one
    assert cache.stats()["num_processes"] == 1
    assert cache.check() == []
