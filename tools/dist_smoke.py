"""make dist-check's smoke program: what a new user does first, against an installed
artifact (run from outside the checkout, so the source tree cannot stand in for it).

A small segment; create / append / fork / gather / attention; a second process attaching
by name and reading what the first wrote; unlink; nothing left in /dev/shm. Also: the
compiled modules carry no debug info, and LICENSE is in the installed distribution.
Exits non-zero on any failure; prints one line per check.
"""
import multiprocessing as mp
import os
import subprocess
import sys
import uuid
from importlib import metadata

import numpy as np

import shmkv


def reader(name, sid, expect_len, q):
    with shmkv.KVCache.attach(name) as kv:
        k, v = kv.gather(sid)
        q.put((kv.seq_len(sid), float(k.sum()), kv.check()))


def main():
    here = os.path.abspath(shmkv.__file__)
    assert "site-packages" in here, f"imported from {here}, not an installed artifact"
    print(f"shmkv {shmkv.__version__} from {os.path.dirname(here)}")

    name = f"shmkv-smoke-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cfg = shmkv.CacheConfig(num_layers=4, num_kv_heads=2, head_dim=64, num_blocks=256,
                            block_size=16, dtype=np.float16, max_seqs=16)
    try:
        with shmkv.KVCache.create(name, cfg) as kv:
            sid = kv.create_sequence()
            k = np.random.default_rng(0).standard_normal((4, 40, 2, 64)).astype(np.float16)
            kv.append(sid, k, k)
            child = kv.fork(sid)
            kv.append(child, k[:, :3], k[:, :3])
            gk, gv = kv.gather(sid)
            assert gk.shape == (4, 40, 2, 64) and np.array_equal(gk, k)
            assert kv.seq_len(child) == 43 and kv.seq_len(sid) == 40
            out = kv.attention(0, np.ones((2, 4, 64), np.float32), [sid, child])
            assert out.shape == (2, 4, 64) and np.isfinite(out).all()
            print(f"create/append/fork/gather/attention: ok ({cfg.bytes_per_block} B/block)")

            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=reader, args=(name, sid, 40, q))
            p.start()
            try:
                n, total, problems = q.get(timeout=60)
            finally:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
            assert p.exitcode == 0, p.exitcode
            assert n == 40 and abs(total - float(k.sum(dtype=np.float32))) < 1e-2 * 40 * 512
            assert problems == []
            print(f"second process (pid {p.pid}) attached and read it: ok")
            kv.free(child)
            kv.free(sid)
            assert kv.check() == []
            kv.unlink()
    finally:
        try:
            import posix_ipc

            posix_ipc.unlink_shared_memory("/" + name)
        except Exception:
            pass
    assert not os.path.exists("/dev/shm/" + name), "the segment was left in /dev/shm"
    print("unlinked, nothing left in /dev/shm: ok")

    files = [str(f) for f in metadata.files("shmkv") or []]
    lic = [f for f in files if os.path.basename(f) == "LICENSE"]
    assert lic, "LICENSE is not in the installed distribution"
    text = metadata.distribution("shmkv").locate_file(lic[0]).read_text()
    assert "Apache License" in text and "Version 2.0" in text
    print(f"LICENSE installed ({lic[0]}): ok")

    sos = [os.path.join(os.path.dirname(here), f) for f in os.listdir(os.path.dirname(here))
           if f.endswith(".so")]
    debug = [s for s in sos if ".debug_info" in subprocess.run(
        ["readelf", "-S", "-W", s], capture_output=True, text=True).stdout]
    assert not debug, f"debug info in {debug}"
    size = sum(os.path.getsize(s) for s in sos)
    print(f"{len(sos)} extension modules, {size / 2**20:.2f} MiB, no debug info: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
