"""Pending marks (shmkv.pending): a prefix being computed is seen by other processes, a dead
owner's marks are no marks (in any PID namespace), of many claims of one prefix exactly
one wins, an engine's requests share its marks, a corrupted table cannot make a reader
fail, the marks go with the segment when it is unlinked; a stopped holder of the table's
lock delays nobody past the bound, and a file that is not a table turns only the marks
off, with one warning."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from support import unique_name
from support.stopped_helpers import end, start_stopped

import shmkv
from shmkv.pending import (
    MAX_TTL,
    VERSION,
    EngineMarks,
    PendingMarks,
    PendingTableError,
    pending_path,
    prefix_keys,
    unlink_pending,
)

_SIZE = 64 + 4096 * 32          # the table's bytes: header, 4096 records of 32 bytes
_MAGIC = 0x53484B5650454E44


@pytest.fixture
def seg():
    name = unique_name("pend")
    try:
        yield name
    finally:
        path = pending_path(name)
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        unlink_pending(name)


_OTHER = """
import sys, time, numpy as np
from shmkv.pending import PendingMarks, prefix_keys
p = PendingMarks(sys.argv[1])
eta = time.monotonic() + float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
p.claim(prefix_keys(np.arange(int(sys.argv[2])), 16, "s"), float(sys.argv[3]), eta=eta)
print("ready", eta, flush=True)
time.sleep(600)
"""


def _other(name, tokens, ttl=30.0, eta_in=None):
    """Another process that marks ``tokens``' blocks pending and stays alive; with
    ``eta_in``, its marks say it publishes them that many seconds from now (the
    process's ``eta`` attribute: that time)."""
    assert tokens == list(range(len(tokens)))
    argv = [sys.executable, "-c", _OTHER, name, str(len(tokens)), str(ttl)]
    if eta_in is not None:
        argv.append(str(eta_in))
    proc = subprocess.Popen(argv, cwd="/tmp", stdout=subprocess.PIPE, text=True)
    ready, eta = proc.stdout.readline().split()
    assert ready == "ready"
    proc.eta = float(eta)
    return proc


def test_keys_chain_the_salt_and_every_token_before():
    t = np.arange(64, dtype=np.int32)
    k = prefix_keys(t, 16, "a")
    assert len(k) == 4 and k.dtype == np.uint64 and (k != 0).all()
    assert (prefix_keys(t[:40], 16, "a") == k[:2]).all()        # whole blocks only
    assert (prefix_keys(t, 16, "b") != k).all()                 # salted
    t2 = t.copy()
    t2[3] = 99
    assert (prefix_keys(t2, 16, "a") != k).all()                # a change carries forward


def test_another_process_sees_the_marks_and_cannot_take_them(seg):
    toks = list(range(100))
    keys = prefix_keys(np.asarray(toks), 16, "s")
    proc = _other(seg, toks)
    try:
        me = PendingMarks(seg)
        assert me.held(keys) == len(keys)
        assert me.held(keys[2:]) == len(keys) - 2
        assert me.claim(keys, 30.0) == len(keys)                 # held: nothing changes
        assert me.release(keys) == 0                             # not mine to drop
        assert me.held(keys) == len(keys)
        longer = prefix_keys(np.arange(200), 16, "s")            # shares the first 6
        assert me.held(longer) == len(keys)
        assert me.claim(longer[len(keys):], 30.0) == 0           # the rest is free: mine
        assert me.held(longer) == len(keys)                      # my own marks hold nothing
        me.close()
    finally:
        proc.kill()
        proc.wait()


def test_an_owners_estimate_of_when_it_publishes_is_read_by_the_others(seg):
    """The eta an owner writes with its claim is what another process reads for the first
    key it waits on; its own marks, unmarked keys and an unbelievable eta read 0."""
    keys = prefix_keys(np.arange(64), 16, "s")
    proc = _other(seg, list(range(64)), eta_in=7.5)
    me = PendingMarks(seg)
    try:
        assert abs(me.eta(keys) - proc.eta) < 1e-5
        assert abs(me.eta(keys[2:]) - proc.eta) < 1e-5
        assert me.eta(prefix_keys(np.arange(64), 16, "other salt")) == 0.0   # not marked
        assert me.eta([]) == 0.0
        mine = prefix_keys(np.arange(200, 264), 16, "s")
        assert me.claim(mine, 30.0, eta=time.monotonic() + 5) == 0
        assert me.eta(mine) == 0.0                               # my own: nothing to wait for
        # a refresh without an estimate keeps the last one; a new estimate replaces it
        before = [r["eta"] for r in me._recs if int(r["key"]) == int(mine[0])][0]
        assert me.claim(mine, 30.0) == 0
        assert [r["eta"] for r in me._recs if int(r["key"]) == int(mine[0])][0] == before
        assert me.claim(mine, 30.0, eta=time.monotonic() + 9) == 0
        assert [r["eta"] for r in me._recs if int(r["key"]) == int(mine[0])][0] > before
        # a hostile writer's eta (years away) is no estimate
        me._recs["eta"][me._recs["owner"] != me.token] = 2**63 - 1
        assert me.held(keys) == 4 and me.eta(keys) == 0.0
        for bad in (-1.0, float("nan"), float("inf"), 2.0**40):
            with pytest.raises(ValueError, match="eta"):
                me.claim(mine, 30.0, eta=bad)
    finally:
        proc.kill()
        proc.wait()
        me.close()
    # an owner that gave no estimate: 0
    proc = _other(seg, list(range(64)))
    me = PendingMarks(seg)
    try:
        assert me.held(keys) == 4 and me.eta(keys) == 0.0
    finally:
        proc.kill()
        proc.wait()
        me.close()


def test_a_dead_owners_marks_are_no_marks(seg):
    toks = list(range(64))
    keys = prefix_keys(np.asarray(toks), 16, "s")
    proc = _other(seg, toks)
    me = PendingMarks(seg)
    try:
        assert me.held(keys) == 4
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert me.held(keys) == 0
        assert me.claim(keys, 30.0) == 0                         # reused at once
        assert [m[1] for m in me.marks()] == [me.token] * 4
    finally:
        me.close()


def test_marks_expire(seg):
    keys = prefix_keys(np.arange(32), 16, "s")
    proc = _other(seg, list(range(32)), ttl=0.5)
    me = PendingMarks(seg)
    try:
        assert me.held(keys) == 2
        time.sleep(0.7)
        assert me.held(keys) == 0
    finally:
        proc.kill()
        proc.wait()
        me.close()


def test_release_drops_only_my_marks(seg):
    keys = prefix_keys(np.arange(64), 16, "s")
    me = PendingMarks(seg)
    assert me.claim(keys, 30.0) == 0
    assert len(me.marks()) == 4
    assert me.release(keys[:2]) == 2
    assert len(me.marks()) == 2
    with pytest.raises(ValueError, match="ttl"):
        me.claim(keys, MAX_TTL + 1)
    with pytest.raises(ValueError, match="ttl"):
        me.claim(keys, 0)
    me.close()


def test_garbage_in_the_table_is_no_mark_and_no_crash(seg):
    me = PendingMarks(seg)
    keys = prefix_keys(np.arange(160), 16, "s")
    rng = np.random.default_rng(7)
    with open(pending_path(seg), "r+b") as f:          # a hostile writer: every record
        f.seek(64)
        f.write(rng.integers(0, 256, 4096 * 32, dtype=np.uint8).tobytes())
    assert me.held(keys) == 0
    assert me.claim(keys, 5.0) == 0
    # owners nobody holds (a token not locked, out of range, negative) are no marks
    recs = me._recs
    recs["expires"][:] = time.monotonic() + 60
    for forged in (me.token % (2**40 - 1) + 1, 2**40, 2**62, -1, 0):
        recs["owner"][:] = forged
        assert me.held(keys) == 0
    me.close()


def test_not_a_table_is_refused(seg):
    with open(pending_path(seg), "wb") as f:
        f.write(b"x" * 100)
    with pytest.raises(ValueError, match="not a pending-marks table"):
        PendingMarks(seg)


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="plain name"):
        pending_path("a/b")
    with pytest.raises(ValueError, match="plain name"):
        pending_path("/")


def test_unlink_removes_the_marks_with_the_segment(seg):
    cfg = shmkv.CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=16,
                            block_size=16, max_seqs=4)
    c = shmkv.KVCache.create(seg, cfg)
    PendingMarks(seg).close()
    assert os.path.exists(pending_path(seg))
    c.unlink()
    c.close()
    assert not os.path.exists(pending_path(seg))
    # and `shmkv rm` too
    c = shmkv.KVCache.create(seg, cfg)
    c.close()
    PendingMarks(seg).close()
    r = subprocess.run([sys.executable, "-m", "shmkv", "rm", seg], cwd="/tmp",
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(pending_path(seg))
    assert not os.path.exists("/dev/shm/" + seg)


# ---------------------------------------------------------------- a stopped lock holder
_HOLDER = """
import fcntl, os, signal, sys
from shmkv.pending import PendingMarks
p = PendingMarks(sys.argv[1])
fcntl.flock(p._fd, fcntl.LOCK_EX)       # the table's lock, as inside claim()
print("armed", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)    # Ctrl-Z, a debugger, docker pause
"""


def _returns(fn, hang_s=5.0):
    """fn()'s result, called in a thread: a call that has not returned after ``hang_s``
    (a hang detector, not a timing assertion) fails the test."""
    got = []
    t = threading.Thread(target=lambda: got.append(fn()), daemon=True)
    t.start()
    t.join(hang_s)
    assert not t.is_alive(), f"the call blocked for over {hang_s} s behind a stopped holder"
    return got[0]


@pytest.fixture
def stopped_holder(seg):
    """A process that holds the table's lock and is stopped; killed by its pid after."""
    procs = []
    try:
        yield start_stopped(_HOLDER, seg, procs=procs)
    finally:
        for p in procs:
            end(p)


def test_a_stopped_lock_holder_delays_no_operation_past_the_bound(seg, stopped_holder):
    """Every operation waits at most its bound for the lock, then answers "no marks" (a
    miss: the caller computes) and counts it.  (Before, flock waited without a bound: one
    stopped process froze every instance's scheduler.)"""
    keys = prefix_keys(np.arange(64), 16, "s")
    me = PendingMarks(seg, timeout=0.05)        # the table exists: opening takes no lock
    try:
        assert _returns(lambda: me.held(keys)) == 0
        assert _returns(lambda: me.claim(keys, 30.0)) == 0      # not marked: computes
        assert _returns(lambda: me.release(keys)) == 0
        assert _returns(me.marks) == []
        assert me.timeouts == 4
        assert _returns(lambda: me.held([])) == 0               # nothing to ask: no wait
        assert me.timeouts == 4
    finally:
        me.close()
    # resumed, the holder lets go (killed: the kernel drops its flock): marks work again
    stopped_holder.kill()
    os.kill(stopped_holder.pid, signal.SIGCONT)
    stopped_holder.wait()
    me = PendingMarks(seg, timeout=0.05)
    try:
        assert me.claim(keys, 30.0) == 0 and len(me.marks()) == 4 and me.timeouts == 0
    finally:
        me.close()


def test_the_engines_marks_count_lock_timeouts_and_stay_on(seg, stopped_holder, caplog):
    log = logging.getLogger("test.shmkv.pending")
    em = EngineMarks(seg, log, timeout=0.02)
    try:
        with caplog.at_level(logging.WARNING, logger=log.name):
            assert _returns(lambda: em.held(prefix_keys(np.arange(32), 16, "s"))) == 0
            assert _returns(lambda: em.claim(prefix_keys(np.arange(32), 16, "s"), 5.0)) == 0
        assert em.on and em.lock_timeouts == 2
        assert caplog.records == []             # a busy lock is a miss, not a failure
    finally:
        em.close()


def test_bounds_are_checked(seg):
    with pytest.raises(ValueError, match="timeout"):
        PendingMarks(seg, timeout=-1)
    with pytest.raises(ValueError, match="timeout"):
        PendingMarks(seg, open_timeout=61)


# ---------------------------------------------------------------- files that are not tables
def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)


def _header(magic=_MAGIC, slots=4096, version=VERSION):
    return (magic.to_bytes(8, "little") + slots.to_bytes(4, "little")
            + version.to_bytes(4, "little")).ljust(64, b"\0")


_BAD = {
    "garbage": lambda p, o: _write(p, np.random.default_rng(3).integers(
        1, 256, _SIZE, dtype=np.uint8).tobytes()),
    "short": lambda p, o: _write(p, _header()[:40]),            # cut before the header's end
    "short_table": lambda p, o: _write(p, _header() + bytes(4096)),
    "long": lambda p, o: _write(p, _header() + bytes(_SIZE)),
    "other_version": lambda p, o: _write(p, _header(version=VERSION + 1).ljust(_SIZE, b"\0")),
    "other_slots": lambda p, o: _write(p, _header(slots=1024).ljust(_SIZE, b"\0")),
    "symlink": lambda p, o: (_write(o, _header().ljust(_SIZE, b"\0")), os.symlink(o, p)),
    "dangling_symlink": lambda p, o: os.symlink(o, p),
    "directory": lambda p, o: os.mkdir(p),
    "fifo": lambda p, o: os.mkfifo(p),
}
_REASON = {"garbage": "garbage", "short": "size", "short_table": "size", "long": "size",
           "other_version": "version", "other_slots": "version", "symlink": "symlink",
           "dangling_symlink": "symlink", "directory": "not_regular", "fifo": "not_regular"}


@pytest.fixture
def other_file(tmp_path):
    return str(tmp_path / "elsewhere")


@pytest.mark.parametrize("kind", sorted(_BAD))
def test_a_file_that_is_not_a_table_raises_naming_the_cause(seg, other_file, kind):
    path = pending_path(seg)
    _BAD[kind](path, other_file)
    before = open(other_file, "rb").read() if os.path.exists(other_file) else None
    with pytest.raises(PendingTableError) as ei:
        PendingMarks(seg)
    e = ei.value
    assert e.reason == _REASON[kind] and e.path == path
    assert path in str(e) and e.fix in str(e)
    assert ("rm " + path in e.fix) or kind in ("other_version", "other_slots")
    assert isinstance(e, shmkv.ShmkvError) and isinstance(e, ValueError)
    assert os.path.lexists(path)                # nothing of someone else's is removed...
    if before is not None:                      # ...nor written through a link
        assert open(other_file, "rb").read() == before
    if kind == "dangling_symlink":
        assert not os.path.exists(other_file)   # not created through the link either


@pytest.mark.parametrize("kind", sorted(_BAD))
def test_the_engine_turns_only_the_marks_off_with_one_warning(seg, other_file, kind,
                                                               caplog):
    """What the vLLM connector's scheduler opens: a bad table is one warning naming the
    file, the cause and the fix; every operation then answers "no marks" (never raises),
    with no further warning."""
    _BAD[kind](pending_path(seg), other_file)
    log = logging.getLogger("test.shmkv.pending")
    keys = prefix_keys(np.arange(64), 16, "s")
    with caplog.at_level(logging.WARNING, logger=log.name):
        em = EngineMarks(seg, log)
        for _ in range(3):                      # steps
            assert em.held(keys) == 0 and em.claim(keys, 5.0) == 0 and em.release(keys) == 0
        em.close()
    assert not em.on and em.off_reason
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    msg = caplog.records[0].getMessage()
    assert "pending marks are OFF" in msg and pending_path(seg) in msg and "fix:" in msg
    assert "stays on" in msg


def test_a_failing_operation_turns_the_marks_off_once(seg, caplog):
    """An operation that fails in a step (here the table's descriptor is gone) turns the
    marks off with one warning; the step gets "no marks", the next steps too."""
    log = logging.getLogger("test.shmkv.pending")
    keys = prefix_keys(np.arange(64), 16, "s")
    em = EngineMarks(seg, log)
    assert em.on and em.claim(keys, 5.0) == 0
    fd = em.marks._fd
    os.close(fd)
    em.marks._fd = 2**30                        # flock: EBADF
    try:
        with caplog.at_level(logging.WARNING, logger=log.name):
            for _ in range(3):
                assert em.held(keys) == 0 and em.claim(keys, 5.0) == 0
                assert em.release(keys) == 0
    finally:
        em.close()
    assert not em.on
    assert len(caplog.records) == 1
    assert "OSError" in caplog.records[0].getMessage()


@pytest.mark.parametrize("size", [0, _SIZE])
def test_a_table_whose_creator_died_before_its_header_is_finished(seg, size):
    """The header is written last: a file of size 0 (its creator died right after making
    it) or of the full size without a header (died before writing it) is laid out by the
    next process, not refused."""
    _write(pending_path(seg), bytes(size))
    keys = prefix_keys(np.arange(32), 16, "s")
    me = PendingMarks(seg)
    try:
        assert me.claim(keys, 5.0) == 0 and len(me.marks()) == 2
        with open(pending_path(seg), "rb") as f:
            assert f.read(64) == _header()
    finally:
        me.close()


@pytest.mark.parametrize("version", [0, 1])
def test_a_table_of_an_earlier_format_is_refused_naming_it(seg, version):
    """Formats 0 and 1 recorded an owner by pid and start time (meaningless across PID
    namespaces); format 2 by an OFD-locked token.  A table of an earlier format, from an
    older shmkv still running, is refused (the engine then turns only its marks off)."""
    _write(pending_path(seg), _header(version=version).ljust(_SIZE, b"\0"))
    with pytest.raises(PendingTableError) as ei:
        PendingMarks(seg)
    assert ei.value.reason == "version" and f"format version {version}" in str(ei.value)


def test_the_creator_makes_a_private_regular_file(seg):
    PendingMarks(seg).close()
    st = os.lstat(pending_path(seg))
    assert st.st_size == _SIZE and (st.st_mode & 0o777) == 0o600
    assert os.path.isfile(pending_path(seg)) and not os.path.islink(pending_path(seg))


# ---------------------------------------------------------------- a full /dev/shm
_FULL = r"""
import os, sys
from shmkv.pending import PendingMarks, PendingTableError, pending_path
try:
    PendingMarks(sys.argv[1]).close()
    print("opened")
except PendingTableError as e:
    print("refused", e.reason, os.path.exists(pending_path(sys.argv[1])))
    print(e)
"""


def test_a_full_dev_shm_is_an_error_at_open_not_a_sigbus_later(seg):
    """The table's memory is reserved (posix_fallocate) before it is mapped: on a full
    tmpfs opening raises, names the cause and removes the file it made.  (Only truncated,
    the first store to an unbacked page was a SIGBUS that killed the engine.)  Run in a
    mount namespace of its own, with a 64 KiB tmpfs on /dev/shm that vanishes with it."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small tmpfs in a namespace of its own")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount not permitted here: {probe.stderr.strip()}")
    r = subprocess.run(
        ["unshare", "--mount", "sh", "-c",
         'mount -t tmpfs -o size=64k tmpfs /dev/shm && exec "$0" -c "$1" "$2"',
         sys.executable, _FULL, seg],
        cwd="/tmp", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    out = r.stdout.splitlines()
    assert out[0] == "refused no_space False", r.stdout
    assert "ENOSPC" in out[1] and "/dev/shm" in out[1]


# ---------------------------------------------------------------- claims and owners
# a lock bound far above any wait here: a claim that ran past its bound answers 0 too (a
# miss: its caller computes, by design), which is not a decision; none may happen
_CLAIMER = """
import sys, numpy as np
from shmkv.pending import PendingMarks, prefix_keys
p = PendingMarks(sys.argv[1], timeout=30.0)
won = [int(p.claim(prefix_keys(np.arange(64) + 1000 * r, 16, "s"), 600.0) == 0)
       for r in range(int(sys.argv[2]))]
print("".join(map(str, won)), p.timeouts, flush=True)
sys.stdin.read()                        # alive (its marks with it) until told to go
"""


def test_of_many_claims_of_one_prefix_exactly_one_wins(seg):
    """Four processes claim the same 200 new prefixes as fast as they can, interleaved by
    the scheduler: a claim decides and marks under one lock, so each prefix has exactly
    one winner (0: it computes) and three losers (they wait), whatever the order.  (With
    the default 50 ms lock bound, a claim that could not get the lock on a loaded host
    answers 0 as well -- a bounded wait, counted in ``timeouts`` -- so the claimers here
    wait as long as it takes.)"""
    rounds = 200
    procs = [subprocess.Popen([sys.executable, "-c", _CLAIMER, seg, str(rounds)], cwd="/tmp",
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    try:
        lines = [p.stdout.readline().split() for p in procs]
        assert [int(t) for _, t in lines] == [0] * 4, lines     # every claim decided
        won = [w for w, _ in lines]
        assert all(len(w) == rounds for w in won), won
        per_round = [sum(int(w[r]) for w in won) for r in range(rounds)]
        assert per_round == [1] * rounds, per_round
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)


def test_an_engines_requests_share_its_marks(seg):
    """EngineMarks counts the requests that claimed a key: the first of two local
    requests on one prefix to finish leaves the marks of the other; a second claim never
    shortens a mark's deadline."""
    log = logging.getLogger("test.shmkv.pending")
    keys = prefix_keys(np.arange(64), 16, "s")
    em = EngineMarks(seg, log)
    other = PendingMarks(seg)
    try:
        assert em.claim(keys, 100.0, holder="r1") == 0
        assert em.claim(keys[:2], 1.0, holder="r2") == 0     # its own: refreshed, kept long
        assert em.claimed("r1") == 4 and em.claimed("r2") == 2
        assert min(m[2] for m in other.marks()) > 50
        assert em.release(holder="r2") == 0                  # r1 still computes them
        assert other.held(keys) == 4
        assert em.release(holder="r1") == 4
        assert other.held(keys) == 0 and other.marks() == []
        assert em.release(holder="r1") == 0                  # twice: nothing left
    finally:
        other.close()
        em.close()


_FORKED = """
import os, sys, numpy as np
from shmkv.pending import PendingMarks, prefix_keys
p = PendingMarks(sys.argv[1])
keys = prefix_keys(np.arange(64), 16, "s")
assert p.claim(keys, 60.0) == 0
pid = os.fork()
if pid == 0:                            # the child is another owner
    code = 0 if (p.held(keys) == 4 and p.claim(keys, 60.0) == 4) else 1
    more = prefix_keys(np.arange(64) + 7, 16, "s")
    code = code or (0 if p.claim(more, 60.0) == 0 else 2)
    os._exit(code)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), p.held(prefix_keys(np.arange(64) + 7, 16, "s")))
"""


def test_a_forked_child_is_another_owner(seg):
    """A child forked with the marks open takes an owner of its own on first use: it sees
    the parent's marks as another's, and its own marks die with it (the parent then sees
    none of them)."""
    r = subprocess.run([sys.executable, "-c", _FORKED, seg], cwd="/tmp",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "0"], (r.stdout, r.stderr)


def _unshare_pid_ok() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "true"],
                          capture_output=True).returncode == 0


_IN_NS = """
import os, sys, numpy as np
from shmkv.pending import PendingMarks, prefix_keys
p = PendingMarks(sys.argv[1])
print(os.getpid(), p.claim(prefix_keys(np.arange(64), 16, "s"), 600.0), flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(not _unshare_pid_ok(), reason="needs unshare --pid (root, or user "
                    "namespaces)")
def test_marks_hold_across_pid_namespaces(seg):
    """An engine in another PID namespace (a pod's other container) marks a prefix: its
    marks are alive here while it runs (its pid, 1 or 2 in its namespace, is some other
    process here or none) and no marks once it is killed."""
    keys = prefix_keys(np.arange(64), 16, "s")
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable,
                          "-c", _IN_NS, seg], cwd="/tmp", stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    me = PendingMarks(seg)
    try:
        inner_pid, claimed = map(int, p.stdout.readline().split())
        assert inner_pid <= 2 and claimed == 0
        assert me.held(keys) == 4 and me.claim(keys, 5.0) == 4
        os.kill(p.pid, signal.SIGKILL)          # --kill-child: the peer dies with it
        p.wait(timeout=30)
        deadline = time.monotonic() + 30        # its files close a moment after
        while me.held(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert me.held(keys) == 0 and me.claim(keys, 5.0) == 0
    finally:
        me.close()
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
