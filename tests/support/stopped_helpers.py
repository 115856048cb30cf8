"""Processes stopped on purpose (SIGSTOP: what Ctrl-Z, a debugger or ``docker pause`` do to
a process that holds a lock), for the tests of bounded waits: wait until one is stopped,
and end it by its pid."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# a process that stops inside the segment's pool lock: a crash point in "stop" mode in
# the critical section of its create_sequence (argv: the segment's name)
POOL_LOCK_HOLDER = """import sys, shmkv, shmkv._core as _core
kv = shmkv.KVCache.attach(sys.argv[1])
_core.set_crash_point("create_mid", stop=True)
print("armed", flush=True)
kv.create_sequence(tokens=list(range(1, 2 * kv.config.block_size + 2)))
"""
# a process that attaches, arms a crash point in "stop" mode and runs into it in an append:
# stopped right there, holding what the append holds at that point (argv: the segment's
# name, the point, the sequence to append to, 1: its own sequence, grown once first, so
# that its process cache is filled and the append takes the fast path)
SEGMENT_HOLDER = """import sys, numpy as np, shmkv, shmkv._core as _core
name, point, sid, warm = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cache = shmkv.KVCache.attach(name)
bs = cache.config.block_size
shape = (cache.config.num_layers, 2 * bs, cache.config.num_kv_heads, cache.config.head_dim)
x = np.ones(shape, dtype=cache.config.numpy_dtype)
if warm:
    sid = cache.create_sequence()
    cache.append(sid, x, x)
print("armed", flush=True)
_core.set_crash_point(point, stop=True)
cache.append(sid, x, x)     # stops inside; after SIGCONT it would go on
print("went on", flush=True)
"""
# a process that takes a file's flock and stops holding it (argv: the file)
FLOCK_HOLDER = """import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("armed", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def proc_state(pid: int) -> bytes:
    """The state letter of /proc/PID/stat (b"T": stopped)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rindex(b")") + 2:].split()[0]


def wait_stopped(p: subprocess.Popen, timeout: float = 60.0) -> subprocess.Popen:
    """Returns ``p`` once it is stopped; fails the test if it exits or takes too long."""
    t0 = time.monotonic()
    while proc_state(p.pid) not in (b"T", b"t"):
        assert p.poll() is None, f"the holder exited ({p.returncode}) instead of stopping"
        assert time.monotonic() - t0 < timeout, "the holder did not reach its stop point"
        time.sleep(0.01)
    return p


def end(p: subprocess.Popen) -> None:
    """Kills ``p`` (by its pid: SIGKILL ends a stopped process too) and reaps it."""
    if p.poll() is None:
        p.kill()
        try:
            os.kill(p.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    p.wait(timeout=30)


def start_stopped(code: str, *args: str, procs: list | None = None) -> subprocess.Popen:
    """Runs ``code`` (python -c, ``args`` after it), which prints "armed" and then stops
    holding a lock; returns it once stopped (appended to ``procs`` first, for the caller
    to :func:`end`; without ``procs`` it is ended here if it does not stop)."""
    p = subprocess.Popen([sys.executable, "-c", code, *args], cwd="/tmp",
                         stdout=subprocess.PIPE, text=True)
    if procs is not None:
        procs.append(p)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "armed"
        return wait_stopped(p)
    except BaseException:
        if procs is None:
            end(p)
        raise
