"""The attention kernel's threads: on torch's OpenMP team once torch is loaded, on its own pool
otherwise, in a fork() child, and with SHMKV_ATTN_POOL=own -- the same results on every one.

Each case runs in a fresh interpreter (whether a libgomp is loaded is a property of the
process): the script prints one JSON line that the test checks."""
import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import shmkv
    from shmkv import _attention
    res = {"torch_before": "torch" in sys.modules, "pool_before": _attention.pool()}
    name = sys.argv[1]
    cfg = shmkv.CacheConfig(num_layers=1, num_kv_heads=3, head_dim=64, block_size=16,
                            num_blocks=700, max_seqs=8, dtype="float32")
    kv = shmkv.KVCache.create(name, cfg)
    try:
        rng = np.random.default_rng(5)
        sids = []
        for n in (3000, 2500, 4000, 100):          # split-KV chunks and whole items
            s = kv.create_sequence()
            kv.append(s, rng.standard_normal((1, n, 3, 64), dtype=np.float32),
                      rng.standard_normal((1, n, 3, 64), dtype=np.float32))
            sids.append(s)
        q = rng.standard_normal((4, 9, 64), dtype=np.float32)
        one = [sids[2]]
        q1 = q[:1].copy()
        shmkv.set_num_threads(2)
        want, want1 = kv.attention(0, q, sids), kv.attention(0, q1, one)
        import torch                                # loads torch's libgomp
        torch.set_num_threads(2)
        x = torch.randn(64, 256)
        for _ in range(3):
            x @ x.T                                 # torch's team exists and spins
        res["pool_torch"] = _attention.pool()
        got, got1 = kv.attention(0, q, sids), kv.attention(0, q1, one)
        res["equal_torch"] = bool(np.array_equal(got, want) and np.array_equal(got1, want1))
        shmkv.set_num_threads(3)                    # more threads than torch's team
        res["equal_three"] = bool(np.abs(kv.attention(0, q1, one) - want1).max() < 1e-6)
        shmkv.set_num_threads(2)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                child = {"pool_child": _attention.pool()}
                child["equal_child"] = bool(
                    np.array_equal(kv.attention(0, q, sids), want)
                    and np.array_equal(kv.attention(0, q1, one), want1))
                os.write(w, json.dumps(child).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        res.update(json.loads(os.read(r, 4096)))
        os.close(r)
        _, status = os.waitpid(pid, 0)
        res["child_exit"] = os.waitstatus_to_exitcode(status)
        res["equal_after_fork"] = bool(np.array_equal(kv.attention(0, q, sids), want))
    finally:
        kv.close()
        kv.unlink()
    print(json.dumps(res))
""")


def _run(env_pool=None):
    env = dict(os.environ)
    env.pop("SHMKV_ATTN_POOL", None)
    if env_pool:
        env["SHMKV_ATTN_POOL"] = env_pool
    name = f"shmkv-test-pool-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    p = subprocess.run([sys.executable, "-c", SCRIPT, name], env=env, capture_output=True,
                       text=True, timeout=300, cwd=os.path.dirname(__file__))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("isa_env", [None, "scalar"])
def test_kernel_runs_on_torchs_openmp_team_once_torch_is_loaded(isa_env, monkeypatch):
    if isa_env:
        monkeypatch.setenv("SHMKV_ATTN_ISA", isa_env)
    r = _run()
    assert r["torch_before"] is False               # import shmkv never imports torch
    assert r["pool_before"] == "own"
    assert r["pool_torch"] == "openmp"
    assert r["equal_torch"] and r["equal_three"]
    assert r["pool_child"] == "own"                 # a fork() child never uses the team
    assert r["equal_child"] and r["child_exit"] == 0
    assert r["equal_after_fork"]


def test_own_pool_forced_by_environment():
    r = _run("own")
    assert r["pool_before"] == "own" and r["pool_torch"] == "own"
    assert r["equal_torch"] and r["equal_three"] and r["equal_child"] and r["equal_after_fork"]
