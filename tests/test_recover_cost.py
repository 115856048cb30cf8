"""What a recovery pass costs: nothing when nothing died, one recoverer at a time, and
O(what died) when something did -- with what died still reclaimed in full.

Nothing here is timed: the idle pass is shown not to read the pool (``blocks_visited``,
the recoveries counter) and not to take the pool lock (another process holds it, and the
pass still returns at once instead of raising LockTimeout); the pass of what died reads
the dead's table entries only, and check() is [] after it.
"""
import ctypes
import os
import select
import signal
import time

import numpy as np
import pytest
from workers.recovery_workers import segment_bytes, tokens

import shmkv
from shmkv.inspect import snapshot, struct_layout

ZERO = dict(sequences=0, blocks=0, processes=0, locks=0, tail_blocks=0, refcounts_fixed=0,
            corrupt_sequences=0, blocks_visited=0)


def _shared(cache, name):
    """A writable view of one field of the segment's shared state (to play a peer)."""
    off, fmt = struct_layout()["shared"]["fields"][name][:2]   # segment offsets
    dt = {"I": np.uint32, "Q": np.uint64}[fmt]
    return np.ndarray((1,), dt, buffer=segment_bytes(cache), offset=off)


def _seq_writer(cache, sid):
    lay = cache._debug_info()["layout"]
    seq = struct_layout()["seq"]
    slot = sid % cache.config.max_seqs
    return np.ndarray((1,), np.uint64, buffer=segment_bytes(cache),
                      offset=lay["off_seqs"] + seq["size"] * slot + seq["fields"]["writer"][0])


def _token(cache, pid):
    p = [x for x in snapshot(cache.name)["processes"] if x["pid"] == pid][0]
    return (p["gen"] << 32) | (p["slot"] + 1)


def _wait_readable(fd, seconds):
    r, _, _ = select.select([fd], [], [], seconds)
    return bool(r)


class Child:
    """An os.fork() child that runs ``work(cache)`` (its result: a line of ints sent back),
    then waits -- bounded -- to be killed or released.  Ended by its PID only."""

    def __init__(self, cache, work, linger=60.0):
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:                       # child
            code = 0
            try:
                os.close(r1)
                os.close(w2)
                out = work(cache)
                os.write(w1, (" ".join(map(str, out)) + "\n").encode())
                _wait_readable(r2, linger)      # released, killed, or the bound runs out
                if hasattr(work, "release"):
                    work.release()
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(w1)
        os.close(r2)
        self.r, self.w = r1, w2
        assert _wait_readable(self.r, 60), "the child did not report"
        line = os.read(self.r, 4096).decode().split()
        assert line, "the child failed"
        self.out = [int(x) for x in line]
        self.done = False

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)
        self.reap()

    def release(self):
        os.write(self.w, b"x")
        return self.reap()

    def reap(self):
        if not self.done:
            _, status = os.waitpid(self.pid, 0)
            self.done = True
            os.close(self.r)
            os.close(self.w)
            self.status = status
        return self.status

    def close(self):
        if not self.done:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.reap()


@pytest.fixture
def children():
    made = []
    try:
        yield made
    finally:
        for ch in made:
            ch.close()


pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _fill(cache, nseqs, ntok, value=1):
    sids = []
    for _ in range(nseqs):
        s = cache.create_sequence()
        cache.append(s, tokens(cache.config, ntok, value), tokens(cache.config, ntok, value))
        sids.append(s)
    return sids


def test_idle_pass_reads_no_block_and_counts_no_pass(make_cache):
    """Nothing died: recover() reads the process table only -- no block visited, no pass
    counted, nothing reclaimed -- however large the pool; recover(full=True) still walks
    all of it."""
    cache = make_cache(num_blocks=1 << 17, max_seqs=64, max_seq_len=256)
    _fill(cache, 8, 3 * cache.config.block_size)
    before = cache.stats()["recoveries"]
    for _ in range(3):
        r = cache.recover()
        assert {k: r[k] for k in ZERO} == ZERO
        assert r["full"] is False and r["busy"] is False and r["duration_s"] == 0
    assert cache.stats()["recoveries"] == before, "an idle recover() ran a pass"
    r = cache.recover(full=True)
    assert r["full"] is True and r["blocks_visited"] == cache.config.num_blocks
    assert cache.stats()["recoveries"] == before + 1
    assert cache.check() == []


def test_idle_pass_does_not_take_the_pool_lock(cache, children):
    """Another process holds the pool lock (a live one, stopped in its critical section):
    an idle recover() returns at once; the full pass waits and times out (so the lock
    really was held)."""
    base = np.frombuffer(segment_bytes(cache), np.uint8).ctypes.data
    lock = ctypes.c_void_p(base + struct_layout()["shared"]["fields"]["pool_lock"][0])
    libc = ctypes.CDLL(None, use_errno=True)

    def hold(_cache):
        assert libc.pthread_mutex_lock(lock) == 0
        return [1]
    hold.release = lambda: libc.pthread_mutex_unlock(lock)
    ch = Child(cache, hold)
    children.append(ch)
    cache.lock_timeout = 0.3
    try:
        r = cache.recover()
        assert {k: r[k] for k in ZERO} == ZERO and r["busy"] is False
        with pytest.raises(shmkv.LockTimeout):
            cache.recover(full=True)
    finally:
        assert os.WEXITSTATUS(ch.release()) == 0
    cache.lock_timeout = 10.0
    assert cache.check() == []


def _die_holding(nseqs, ntok, shared_sid=None, prompt=None):
    """A child's work: nseqs owned sequences of ntok tokens, a detached one, a fork of
    shared_sid, a published (findable) prompt; reports the owned sids, the detached one
    and the blocks its owned sequences hold."""
    def work(cache):
        cfg = cache.config
        owned = _fill(cache, nseqs, ntok, value=5)
        kept = _fill(cache, 1, ntok, value=6)[0]
        cache.detach(kept)
        if shared_sid is not None:
            owned.append(cache.fork(shared_sid))
            cache.append(owned[-1], tokens(cfg, 1, 7), tokens(cfg, 1, 7))   # a COW copy
        if prompt is not None:
            s = cache.create_sequence()
            cache.reserve(s, len(prompt), tokens=np.asarray(prompt, np.int32))
            cache.commit(s)
            owned.append(s)
        held = sum(len(cache.block_table(s)) for s in owned)
        return [held, kept, *owned]
    return work


def test_dead_process_reclaimed_in_its_blocks(make_cache, children):
    """A process SIGKILLed holding owned sequences (one a fork sharing our blocks, one
    with published blocks) and a detached one: the pass of what died frees exactly its
    owned sequences, reads only their table entries (not the pool), keeps the detached
    one and our sequences intact, and leaves every invariant true."""
    cache = make_cache(num_blocks=1 << 15, max_seqs=64, max_seq_len=1024)
    cfg, bs = cache.config, cache.config.block_size
    mine = _fill(cache, 4, 5 * bs + 1, value=1)
    prompt = list(range(100, 100 + 4 * bs))
    ch = Child(cache, _die_holding(6, 3 * bs + 2, shared_sid=mine[0], prompt=prompt))
    children.append(ch)
    held, kept, *owned = ch.out
    used_before = cache.stats()["used_blocks"]
    ch.kill()
    r = cache.recover()
    assert r["full"] is False and r["busy"] is False
    assert r["processes"] == 1 and r["sequences"] == len(owned)
    assert r["blocks_visited"] == held < cfg.num_blocks
    # the fork's shared blocks stay ours: everything else it held goes
    shared = len(cache.block_table(mine[0])) - 1          # all but the copied partial block
    assert r["blocks"] == held - shared
    assert cache.stats()["used_blocks"] == used_before - r["blocks"]
    assert cache.check() == []
    assert sorted(cache.sequences()) == sorted(mine + [kept])
    for s in mine:
        assert (cache.gather(s)[0] == 1).all()
    assert (cache.gather(kept)[0] == 6).all()
    for s in owned:
        with pytest.raises(shmkv.SequenceNotFound):
            cache.seq_len(s)
    # the published prompt's blocks stay findable (cached, on the LRU list)
    assert cache.match_prefix(np.asarray(prompt + [0], np.int32)) == len(prompt)
    assert cache.recover()["blocks_visited"] == 0       # and the next pass is idle again
    cache.free(kept)
    for s in mine:
        cache.free(s)
    assert cache.stats()["used_blocks"] == 0 and cache.check() == []


def test_a_live_recoverer_makes_the_pass_return_busy(cache, children):
    """One recoverer at a time: while another live process holds the recoverer word, a
    pass returns at once with busy (nothing reclaimed); once that holder is dead, the
    next pass takes the word over and reclaims everything."""
    bs = cache.config.block_size
    holder = Child(cache, lambda c: [c.create_sequence()])   # alive, attached
    children.append(holder)
    victim = Child(cache, _die_holding(2, bs + 1))
    children.append(victim)
    victim.kill()
    word, since = _shared(cache, "recoverer"), _shared(cache, "recoverer_since_ns")
    word[0] = _token(cache, holder.pid)
    since[0] = time.monotonic_ns()
    r = cache.recover()
    assert r["busy"] is True and r["processes"] == 0 and r["sequences"] == 0
    assert word[0] == _token(cache, holder.pid)
    holder.kill()                       # the recoverer died (its word stays behind)
    r = cache.recover()
    assert r["busy"] is False and r["processes"] == 2 and r["sequences"] == 2 + 1
    assert word[0] == 0
    assert cache.check() == [] and cache.stats()["used_blocks"] == 2   # the detached one's


def test_a_stale_live_recoverer_is_taken_over(cache, children):
    """A live holder of the recoverer word that has held it past our lock bound (stopped,
    or stuck) does not keep the dead's blocks from being reclaimed."""
    bs = cache.config.block_size
    holder = Child(cache, lambda c: [c.create_sequence()])   # alive, attached
    children.append(holder)
    victim = Child(cache, _die_holding(1, bs))
    children.append(victim)
    victim.kill()
    _shared(cache, "recoverer")[0] = _token(cache, holder.pid)
    _shared(cache, "recoverer_since_ns")[0] = 1              # held since the boot
    r = cache.recover()
    assert r["busy"] is False and r["processes"] == 1 and r["sequences"] == 1
    assert cache.check() == []


def test_a_sequence_a_live_process_held_is_reclaimed_by_a_later_idle_pass(cache, children):
    """The dead owner's sequence is locked by a live process during the pass: it is left,
    and marked pending -- the next pass, with nothing dead any more, still reclaims it."""
    bs = cache.config.block_size
    victim = Child(cache, _die_holding(1, 2 * bs))
    children.append(victim)
    _, kept, owned = victim.out
    victim.kill()
    writer = _seq_writer(cache, owned)
    writer[0] = cache._debug_info()["proc_token"]       # we hold its lock (a gather, say)
    r = cache.recover()
    assert r["processes"] == 1 and r["sequences"] == 0
    assert _shared(cache, "recover_pending")[0] == 1
    writer[0] = 0                                       # let go
    r = cache.recover()
    assert r["processes"] == 0 and r["sequences"] == 1 and r["full"] is False
    assert _shared(cache, "recover_pending")[0] == 0
    assert cache.sequences() == [kept]
    assert cache.check() == []


def test_a_death_inside_a_fast_path_gets_the_full_pass(cache, children):
    """A process that died holding its own cache lock (inside a fast path, where tables
    and refcounts change without the pool lock) may have left them half-changed: the
    pass of what died hands over to the full pass, which rebuilds."""
    bs = cache.config.block_size
    proc = struct_layout()["proc"]
    off_procs = cache._debug_info()["layout"]["off_procs"]

    def die_in_fast_path(c):
        out = _die_holding(2, bs + 1)(c)
        info = c._debug_info()
        lock = np.ndarray((1,), np.uint64, buffer=segment_bytes(c),
                          offset=off_procs + proc["size"] * info["proc_slot"]
                          + proc["fields"]["cache_lock"][0])
        lock[0] = info["proc_token"]                    # "inside" a fast path
        return out
    victim = Child(cache, die_in_fast_path)
    children.append(victim)
    victim.kill()
    r = cache.recover()
    assert r["full"] is True and r["blocks_visited"] == cache.config.num_blocks
    assert r["processes"] == 1 and r["sequences"] == 2
    assert cache.check() == []
    assert cache.stats()["used_blocks"] == 2                # the detached one's


def test_only_the_full_pass_repairs_what_no_death_explains(cache):
    """Garbage with nobody dead (a refcount written by hand) is the repair's: the idle
    pass leaves it, recover(full=True) -- what `shmkv recover` and `check --repair` run --
    rebuilds it."""
    s = cache.create_sequence()
    cache.reserve(s, cache.config.block_size)
    blk = int(cache.block_table(s)[0])
    lay = cache._debug_info()["layout"]
    meta = struct_layout()["block"]
    rc = np.ndarray((1,), np.uint32, buffer=segment_bytes(cache),
                    offset=lay["off_blocks"] + meta["size"] * blk + meta["fields"]["ref_cnt"][0])
    rc[0] = 7
    assert cache.check() != []
    assert cache.recover()["refcounts_fixed"] == 0
    assert cache.recover(full=True)["refcounts_fixed"] == 1
    assert cache.check() == []
    cache.free(s)
    assert cache.check() == [] and cache.stats()["used_blocks"] == 0
