"""Bounded waits: a holder of the pool lock or of a process cache's lock that is alive but
stopped (Ctrl-Z, a debugger, ``docker pause``) makes another process's operation wait
``lock_timeout`` at most, then raise LockTimeout (shared/API.md) -- and the bound runs on
CLOCK_MONOTONIC, so a step of the wall clock does not stretch it.  (The pending table's
lock: tests/test_pending.py.)"""
import functools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from recovery_workers import tokens

import shmkv
import shmkv._core as _core

# a process that attaches, arms a crash point in "stop" mode and runs into it: stopped
# right there, holding what the operation holds at that point
_HOLDER = textwrap.dedent("""
    import sys, numpy as np, shmkv, shmkv._core as _core
    name, point, sid, warm = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cache = shmkv.KVCache.attach(name)
    bs = cache.config.block_size
    shape = (cache.config.num_layers, 2 * bs, cache.config.num_kv_heads,
             cache.config.head_dim)
    x = np.ones(shape, dtype=cache.config.dtype)
    if warm:                    # its own sequence, grown once: the process cache is filled
        sid = cache.create_sequence()
        cache.append(sid, x, x)
    print("armed", flush=True)
    _core.set_crash_point(point, stop=True)
    cache.append(sid, x, x)     # stops inside; after SIGCONT it would go on
    print("went on", flush=True)
""")


def _state(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2:].split()[0]


def _stopped_holder(procs, name, point, sid=0, warm=False):
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, name, point, str(sid),
                          str(int(warm))], cwd="/tmp", stdout=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout.readline().strip() == "armed"
    t0 = time.monotonic()
    while _state(p.pid) not in (b"T", b"t"):
        assert p.poll() is None, f"the holder exited ({p.returncode}) instead of stopping"
        assert time.monotonic() - t0 < 60, "the holder did not reach its stop point"
        time.sleep(0.01)
    return p


@pytest.fixture
def holders():
    """Holder processes, each killed by PID (then resumed) and reaped at teardown."""
    started = []
    try:
        yield started
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()                        # SIGKILL ends a stopped process too
                os.kill(p.pid, signal.SIGCONT)
            p.wait(timeout=30)


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
    waits = _core.snapshot(cache.name)["counters"]["lock_waits"]    # takes no lock
    full_recover = functools.partial(cache.recover, full=True)
    for op in (cache.check, cache.stats, full_recover):     # each takes the pool lock
        e = _raises(op)
        assert isinstance(e, shmkv.LockTimeout), (op, e)
    assert _core.snapshot(cache.name)["counters"]["lock_waits"] >= waits + 3
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
