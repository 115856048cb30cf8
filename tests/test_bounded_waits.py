"""Bounded waits: a holder of the pool lock or of a process cache's lock that is alive but
stopped (Ctrl-Z, a debugger, ``docker pause``) makes another process's operation wait
``lock_timeout`` at most, then raise LockTimeout (the API contract) -- and the bound runs on
CLOCK_MONOTONIC, so a step of the wall clock does not stretch it.  (The pending table's
lock: tests/test_pending.py.)"""
import functools
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from support.stopped_helpers import SEGMENT_HOLDER, end, start_stopped
from workers.recovery_workers import tokens

import shmkv
from shmkv.inspect import snapshot


def _stopped_holder(procs, name, point, sid=0, warm=False):
    return start_stopped(SEGMENT_HOLDER, name, point, str(sid), str(int(warm)), procs=procs)


@pytest.fixture
def holders():
    """Holder processes, each killed by PID (then resumed) and reaped at teardown."""
    started = []
    try:
        yield started
    finally:
        for p in started:
            end(p)


def _raises(fn, hang_s=5.0):
    """The exception fn() raised, called in a thread; a call still running after
    ``hang_s`` fails the test (a hang detector, not a timing assertion)."""
    got = []

    def run():
        try:
            fn()
            got.append(None)
        except BaseException as e:     # noqa: BLE001 -- handed to the test
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(hang_s)
    assert not t.is_alive(), f"the call blocked for over {hang_s} s behind a stopped holder"
    return got[0]


def _detached_sequence(cache):
    sid = cache.create_sequence()
    cache.append(sid, tokens(cache.config, 3, 1), tokens(cache.config, 3, 1))
    cache.detach(sid)
    return sid


def test_a_stopped_pool_lock_holder_makes_others_time_out(cache, holders):
    sid = _detached_sequence(cache)
    holder = _stopped_holder(holders, cache.name, "alloc_mid", sid)   # inside the pool lock
    cache.lock_timeout = 0.2
    waits = snapshot(cache.name)["counters"]["lock_waits"]    # takes no lock
    full_recover = functools.partial(cache.recover, full=True)
    for op in (cache.check, cache.stats, full_recover):     # each takes the pool lock
        e = _raises(op)
        assert isinstance(e, shmkv.LockTimeout), (op, e)
    assert snapshot(cache.name)["counters"]["lock_waits"] >= waits + 3
    # the scheduled pass (the connector's once a second) reads only the process table
    # when nobody died: a stopped holder is alive, so it returns at once, no lock taken
    assert _raises(cache.recover) is None
    r = cache.recover()
    assert not r["full"] and not r["busy"] and r["blocks_visited"] == 0, r
    # the holder dies where it stopped: the next locker recovers, nothing is lost
    holder.kill()
    holder.wait(timeout=30)
    cache.lock_timeout = 10.0
    assert cache.check() == []
    assert cache.seq_len(sid) == 3


def _timed(fn):
    """(the exception fn() raised, or None; seconds it took)."""
    t0 = time.monotonic()
    e = _raises(fn, hang_s=30.0)
    return e, time.monotonic() - t0


def test_after_a_wait_ran_out_the_backoff_waits_no_more_while_the_lock_is_held(cache,
                                                                                holders):
    """lock_backoff: the first call behind a stopped holder waits its bound; the calls of
    the pause after it do not wait again (a serving engine makes several calls a step);
    the pause ends and one call waits again; a lock that comes free is taken at once,
    pause or not.  (The bound is long here, so that "waited" and "did not" are far apart
    on a loaded machine: a hang detector, not a timer.)"""
    sid = _detached_sequence(cache)
    holder = _stopped_holder(holders, cache.name, "alloc_mid", sid)
    cache.lock_timeout = 2.0
    assert cache.lock_backoff == 0.0
    cache.lock_backoff = 30.0
    before = cache.lock_timeouts
    e, first = _timed(cache.stats)
    assert isinstance(e, shmkv.LockTimeout) and first >= 2.0, (e, first)
    ids = list(range(1, 2 * cache.config.block_size + 2))     # two whole blocks to look up
    for op in (cache.stats, cache.check, functools.partial(cache.match_prefix, ids)):
        e, took = _timed(op)
        assert isinstance(e, shmkv.LockTimeout), (op, e)
        assert took < 1.0, f"{op} waited {took:.2f} s again inside the backoff's pause"
    assert cache.lock_timeouts == before + 4
    # a pause ended (set anew: none running) -> the next call waits its bound again
    cache.lock_backoff = 30.0
    e, took = _timed(cache.stats)
    assert isinstance(e, shmkv.LockTimeout) and took >= 2.0, (e, took)
    # the holder dies where it stopped: inside the pause, the free lock is taken (and the
    # dead holder's half-done allocation recovered)
    holder.kill()
    holder.wait(timeout=30)
    assert cache.check() == []
    assert cache.seq_len(sid) == 3
    for bad in (-1.0, float("nan"), 3601.0):
        with pytest.raises(ValueError, match="lock_backoff"):
            cache.lock_backoff = bad


def test_without_a_backoff_every_call_waits_its_bound(cache, holders):
    """The default (lock_backoff 0): each call behind a stopped holder waits lock_timeout
    -- what the backoff test sees shortened is the wait, not the holder."""
    _stopped_holder(holders, cache.name, "alloc_mid", _detached_sequence(cache))
    cache.lock_timeout = 0.5
    for _ in range(2):
        e, took = _timed(cache.stats)
        assert isinstance(e, shmkv.LockTimeout) and took >= 0.5, (e, took)


def test_a_stopped_process_cache_holder_makes_others_time_out(cache, holders):
    """A process stopped on its cache's fast path (its cache_lock held, not the pool
    lock): a pass that takes every process cache's lock (check, the full recovery pass)
    waits lock_timeout for it, then raises LockTimeout and lets the pool lock go."""
    _stopped_holder(holders, cache.name, "grow_before_tail", warm=True)
    cache.lock_timeout = 0.2
    assert isinstance(_raises(cache.check), shmkv.LockTimeout)
    assert isinstance(_raises(functools.partial(cache.recover, full=True)), shmkv.LockTimeout)
    # the scheduled pass: nobody died, so it takes no lock and returns at once
    assert _raises(cache.recover) is None
    # the pool lock was let go: what needs only it goes through
    sid = cache.create_sequence()
    cache.append(sid, tokens(cache.config, 2, 1), tokens(cache.config, 2, 1))
    cache.free(sid)


def test_a_full_pool_does_not_wait_for_a_cache_its_stopped_owner_holds(cache, holders):
    """Before CacheFullError the allocator drains the other processes' caches, under the
    pool lock.  A process stopped on its cache's fast path (that cache's lock held) is
    left alone, not waited for: the call answers CacheFull at once instead of holding the
    pool lock -- every other process -- lock_timeout long, then LockTimeout; the stopped
    process's cache comes back once it is gone."""
    _stopped_holder(holders, cache.name, "grow_before_tail", warm=True)
    cache.lock_timeout = 5.0
    cfg = cache.config
    free = cache.stats()["free_blocks"]          # the stopped process's cache counts too
    sid = cache.create_sequence()
    e, took = _timed(functools.partial(cache.reserve, sid, free * cfg.block_size))
    assert isinstance(e, shmkv.CacheFullError), e
    assert took < 2.5, f"the allocator waited {took:.1f} s for the stopped process's cache"
    assert cache.seq_len(sid) == 0                  # all or nothing
    cache.free(sid)
    holders[0].kill()
    holders[0].wait(timeout=30)
    cache.lock_timeout = 10.0
    assert cache.check() == []
    sid = cache.create_sequence()                   # the dead process's cache is back
    cache.reserve(sid, cache.stats()["free_blocks"] * cfg.block_size)
    cache.free(sid)


# ------------------------------------------------- the bound is on CLOCK_MONOTONIC
# An LD_PRELOAD shim that reads CLOCK_REALTIME an hour ahead of the kernel's: for a
# deadline computed on CLOCK_REALTIME exactly what a step of the wall clock an hour back,
# just after it was computed, does.  CLOCK_MONOTONIC is left alone.
_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <time.h>
int clock_gettime(clockid_t clk, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(clk, ts);
    if (rc == 0 && clk == CLOCK_REALTIME) ts->tv_sec += 3600;
    return rc;
}
"""

_WAITER = textwrap.dedent("""
    import sys, time, shmkv
    cache = shmkv.KVCache.attach(sys.argv[1])   # before the holder stops: attaching locks
    cache.lock_timeout = 0.2
    print("attached", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    try:
        cache.check()
        print("no error")
    except Exception as e:
        print(type(e).__name__, round(time.monotonic() - t0, 1), flush=True)
""")


def test_a_wall_clock_step_does_not_stretch_the_pool_locks_bound(cache, holders, tmp_path):
    shim = tmp_path / "shim.so"
    src = tmp_path / "shim.c"
    src.write_text(_SHIM)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(shim), str(src), "-ldl"],
                   check=True, capture_output=True, timeout=120)
    # after what is preloaded already (make sanitize: the ASan runtime, which must come
    # first; its clock_gettime interceptor then calls the shim's)
    pre = ":".join(filter(None, [os.environ.get("LD_PRELOAD"), str(shim)]))
    waiter = subprocess.Popen([sys.executable, "-c", _WAITER, cache.name], cwd="/tmp",
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "LD_PRELOAD": pre})
    holders.append(waiter)
    assert waiter.stdout.readline().strip() == "attached"
    _stopped_holder(holders, cache.name, "alloc_mid", _detached_sequence(cache))
    try:
        out, _ = waiter.communicate("go\n", timeout=20)     # a hang detector
    except subprocess.TimeoutExpired:
        pytest.fail("the wait for the pool lock ran past its 0.2 s bound by the clock's "
                    "step: its deadline was on CLOCK_REALTIME")
    assert out.split()[0] == "LockTimeout", out
