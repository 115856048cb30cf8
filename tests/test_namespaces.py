"""Processes in different PID namespaces sharing one /dev/shm (a Kubernetes pod's
containers, ``docker run --ipc=container:X``; docs/deployment.md).  A process's pid
means nothing across namespaces (the one inside is pid 1 or 2 there); the segment knows
who is alive by open-file-description locks on the segment file, which the kernel drops
when the holder dies, in whatever namespace.  So a peer in another PID namespace is alive
while it runs, and what it held is reclaimed once it is killed.  (The pending marks do the
same with their own OFD locks: test_pending.py::test_marks_hold_across_pid_namespaces.)"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

PEER = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import shmkv
    kv = shmkv.KVCache.attach(sys.argv[1])
    c = kv.config
    sid = kv.create_sequence()
    a = np.ones((c.num_layers, 3 * c.block_size, c.num_kv_heads, c.head_dim), np.float16)
    kv.append(sid, a, a)                       # 3 blocks
    print(sid, os.getpid(), flush=True)
    signal.pause()
""")


def _unshare_pid_ok() -> bool:
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _unshare_pid_ok(),
                    reason="needs unshare --pid (root, or user namespaces)")
def test_a_peer_in_another_pid_namespace_is_alive_until_killed_then_reclaimed(make_cache):
    cache = make_cache(dtype="float16")
    # --kill-child: SIGKILL to unshare kills the peer too (it is our only handle on it)
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable,
                          "-c", PEER, cache.name], cwd="/tmp", stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        line = p.stdout.readline().split()
        assert len(line) == 2, line
        sid, inner_pid = int(line[0]), int(line[1])
        assert inner_pid <= 2 and inner_pid != os.getpid()   # a pid of its own namespace
        assert cache.stats()["num_processes"] == 2
        # alive: a recovery pass takes nothing of it, and its sequence stays
        rec = cache.recover()
        assert rec["sequences"] == 0 and rec["blocks"] == 0
        assert cache.seq_len(sid) == 3 * cache.config.block_size
        assert cache.stats()["used_blocks"] == 3
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        # its death shows once the kernel has closed its files (a moment after SIGKILL)
        deadline, got = time.monotonic() + 30, {"sequences": 0}
        while got["sequences"] == 0 and time.monotonic() < deadline:
            got = cache.recover()
            if got["sequences"] == 0:
                time.sleep(0.05)
        assert got["sequences"] == 1 and got["blocks"] == 3, got
        assert cache.stats()["used_blocks"] == 0 and cache.stats()["num_processes"] == 1
        assert cache.check() == []
        assert sid not in cache.sequences()
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)

