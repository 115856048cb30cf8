"""Pending marks (shmkv.pending): a prefix being computed is seen by other processes, a dead
owner's marks are no marks, a corrupted table cannot make a reader fail, and the marks go
with the segment when it is unlinked."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import unique_name

import shmkv
from shmkv.pending import MAX_TTL, PendingMarks, pending_path, prefix_keys, unlink_pending


@pytest.fixture
def seg():
    name = unique_name("pend")
    try:
        yield name
    finally:
        unlink_pending(name)


_OTHER = """
import sys, time, numpy as np
from shmkv.pending import PendingMarks, prefix_keys
p = PendingMarks(sys.argv[1])
p.claim(prefix_keys(np.arange(int(sys.argv[2])), 16, "s"), float(sys.argv[3]))
print("ready", flush=True)
time.sleep(600)
"""


def _other(name, tokens, ttl=30.0):
    """Another process that marks ``tokens``' blocks pending and stays alive."""
    assert tokens == list(range(len(tokens)))
    proc = subprocess.Popen([sys.executable, "-c", _OTHER, name, str(len(tokens)), str(ttl)],
                            cwd="/tmp", stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
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
        assert [m[1] for m in me.marks()] == [os.getpid()] * 4
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
    # our own pid with a forged start time is not us, nor alive
    recs = me._recs
    recs["pid"][:] = os.getpid()
    recs["start"][:] = 1
    recs["expires"][:] = time.monotonic() + 60
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
