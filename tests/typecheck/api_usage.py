"""A user's script over every public call of the API contract (docs/reference/index.md)
and the README's extensions.

Two jobs: `mypy --strict` checks it against the package's stubs (`make lint`), and
tests/test_structure.py runs it against a real segment, so every call it types is also a
call that works.  Usage: python api_usage.py SEGMENT_NAME (the caller unlinks it).
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np
import numpy.typing as npt

import shmkv
from shmkv import _bench
from shmkv.inspect import snapshot


def _kv(cfg: shmkv.CacheConfig, n: int, seed: int) -> npt.NDArray[np.float32]:
    rng = np.random.default_rng(seed)
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    return rng.standard_normal(shape).astype(np.float32)


def sequences(cache: shmkv.KVCache) -> None:
    """Sequences: create, fork (copy-on-write), append, gather (three forms), truncate,
    free."""
    cfg = cache.config
    k, v = _kv(cfg, 6, 1), _kv(cfg, 6, 2)
    sid: int = cache.create_sequence()
    cache.append(sid, k, v)
    child: int = cache.fork(sid)
    cache.append(child, k[:, :1], v[:, :1])          # copy-on-write of the partial block
    kg, vg = cache.gather(sid)
    assert np.array_equal(kg, k) and np.array_equal(vg, v)
    k2, _ = cache.gather(child, 2, 5)
    assert np.array_equal(k2, k[:, 2:5])
    out = cache.gather_buffers(cache.seq_len(sid))
    ko, vo = cache.gather(sid, out=out)
    assert ko is out[0] and vo is out[1] and np.array_equal(vo, v)
    assert cache.seq_len(child) == 7
    table: npt.NDArray[np.int32] = cache.block_table(sid)
    assert table.dtype == np.int32 and len(table) == -(-6 // cfg.block_size)
    assert sorted(cache.sequences()) == sorted([sid, child])
    cache.truncate(child, 3)                         # in place: the same id, 3 tokens
    assert cache.seq_len(child) == 3
    assert np.array_equal(cache.gather(child)[0], k[:, :3])
    cache.truncate(child, np.int64(0))
    cache.free(child)
    cache.free(sid)
    assert cache.sequences() == []


def decode_loop(cache: shmkv.KVCache) -> None:
    """reserve -> write every layer -> the zero-copy pools -> batch_block_tables."""
    cfg = cache.config
    a, b = cache.create_sequence(), cache.create_sequence()
    for _ in range(3):
        slots: npt.NDArray[np.int64] = cache.reserve(a, 1)
        for layer in range(cfg.num_layers):
            kl = np.full((1, cfg.num_kv_heads, cfg.head_dim), layer, np.float32)
            cache.write(layer, slots, kl, -kl)
        blk, off = divmod(int(slots[0]), cfg.block_size)
        kc: npt.NDArray[Any] = cache.key_cache(cfg.num_layers - 1)
        vc: npt.NDArray[Any] = cache.value_cache(cfg.num_layers - 1)
        assert kc[blk, off, 0, 0] == cfg.num_layers - 1 == -vc[blk, off, 0, 0]
    cache.reserve(b, cfg.block_size + 1)
    tables, lens = cache.batch_block_tables([a, b])
    assert tables.shape == (2, 2) and list(lens) == [3, cfg.block_size + 1]
    assert tables[0, 1] == -1
    cache.free(a)
    cache.free(b)


def observability_and_ownership(cache: shmkv.KVCache) -> None:
    st = cache.stats()
    assert st["free_blocks"] + st["used_blocks"] == st["num_blocks"]
    for key in ("num_sequences", "peak_used_blocks", "allocations", "frees", "forks",
                "cow_copies"):
        assert key in st
    assert cache.check() == []
    snap: dict[str, Any] = snapshot(cache.name)          # read-only, takes no lock
    assert snap["used_blocks"] == st["used_blocks"] and snap["config"] == cache.config
    ns: float = _bench.bench_alloc_free(cache, 1000)
    assert ns > 0
    sid = cache.create_sequence()
    cache.detach(sid)
    assert cache.owner_pid(sid) is None
    cache.adopt(sid)
    assert cache.owner_pid(sid) is not None
    rec = cache.recover()
    assert rec["sequences"] == 0 and rec["blocks"] == 0
    cache.free(sid)
    cache.lock_timeout = 5.0
    assert cache.lock_timeout == 5.0


def prefix_cache(cache: shmkv.KVCache) -> None:
    """The README's extensions: prefix sharing, token ids, eviction, StreamingLLM trim."""
    cfg = cache.config
    bs = cfg.block_size
    prompt = np.arange(3 * bs + 1, dtype=np.int64)
    first = cache.create_sequence(tokens=prompt, salt="tenant-a", priority=1)
    n = len(prompt)
    cache.append(first, _kv(cfg, n, 3), _kv(cfg, n, 4), tokens=prompt)
    assert cache.match_prefix(prompt, salt="tenant-a") == 3 * bs
    assert cache.match_prefix(prompt, salt=b"tenant-b") == 0
    second = cache.create_sequence(prompt, "tenant-a")
    assert cache.seq_len(second) == 3 * bs
    assert list(cache.token_ids(second)) == list(prompt[:3 * bs])
    assert list(cache.token_ids(first, 1, 3)) == [1, 2]
    cache.reserve(second, 1, tokens=[int(prompt[-1])])
    assert cache.commit(second) == 0
    cache.set_priority(second, 0)
    dropped = cache.trim_streaming(first, bs, bs)
    assert dropped == bs and cache.trimmed(first) == bs
    evicted = cache.evict("priority", cfg.num_blocks, exclude=[first])
    assert evicted == [second]
    cache.free(first)


def remote_tier(cache: shmkv.KVCache) -> None:
    """The remote tier's API (the API contract, "KV events and the remote tier"), against a
    port nothing listens on: a tier that is down never raises, it is counted."""
    bs = cache.config.block_size
    tier = shmkv.RedisTier("redis://127.0.0.1:9", cluster=True, timeout=0.2,
                           connect_timeout=0.1)
    cache.set_tier(tier)
    prompt = np.arange(100, 100 + 2 * bs + 1, dtype=np.int64)
    sid = cache.create_sequence(tokens=prompt)
    assert cache.match_prefix(prompt) == cache.seq_len(sid)
    written: int = cache.flush_tier(timeout=1.0)
    assert written == 0
    cache.set_tier(tier, read=False)         # write-through only: lookups stay local
    cache.set_tier(tier, write=False)        # hits only
    cache.set_tier(None)
    stats = cache.stats()
    assert stats["tier_errors"] >= 1 and stats["tier_hits"] == 0
    assert {"tier_misses", "tier_bytes_in", "tier_bytes_out"} <= set(stats)

def kv_events(cache: shmkv.KVCache) -> None:
    """KV events: cache.events(since) -> (events, next_seq, lost); reset_prefix_cache."""
    cfg = cache.config
    assert cfg.event_capacity == 64
    bs = cfg.block_size
    start = cache.events().next_seq
    prompt = np.arange(500, 500 + 2 * bs, dtype=np.int64)
    sid = cache.create_sequence()
    cache.append(sid, _kv(cfg, 2 * bs, 7), _kv(cfg, 2 * bs, 8), tokens=prompt)
    events, next_seq, lost = cache.events(since=start)
    assert lost == 0 and next_seq == start + 2
    batch = cache.events(start, max_events=1)
    ev = batch.events[0]
    seq: int = ev.seq
    kind: str = ev.kind
    hashes: list[int] = ev.block_hashes
    parent: int | None = ev.parent_block_hash
    tokens: list[int] = ev.token_ids
    assert (seq, kind, parent, batch.next_seq, batch.lost) == (start, "stored", None,
                                                                 start + 1, 0)
    assert len(hashes) == 1 and tokens == list(range(500, 500 + bs)) and ev.block_size == bs
    assert events[1].parent_block_hash == hashes[0]
    dropped: int = cache.reset_prefix_cache()
    assert dropped >= 2 and cache.events(next_seq).events[0].kind == "cleared"
    cache.free(sid)


def attention(cache: shmkv.KVCache) -> None:
    cfg = cache.config
    shmkv.set_num_threads(2)
    assert shmkv.get_num_threads() == 2
    sid = cache.create_sequence()
    cache.append(sid, _kv(cfg, 5, 5), _kv(cfg, 5, 6))
    hq = 2 * cfg.num_kv_heads
    q = np.ones((1, hq, cfg.head_dim), np.float32)
    out: npt.NDArray[np.float32] = cache.attention(0, q, [sid])
    assert out.shape == q.shape and out.dtype == np.float32
    qp = np.ones((3, hq, cfg.head_dim), np.float32)
    buf = np.empty_like(qp)
    res = cache.attention(0, qp, [sid], q_lens=[3], scale=0.5, out=buf)
    assert res is buf
    fast: npt.NDArray[np.float32] = cache.attention(0, q, [sid], precision="bf16")
    assert fast.shape == q.shape
    shmkv.set_num_threads(0)
    cache.free(sid)


def errors(cache: shmkv.KVCache) -> None:
    try:
        cache.seq_len(10**6)
    except shmkv.SequenceNotFound as e:
        assert isinstance(e, (shmkv.ShmkvError, KeyError))
    else:
        raise AssertionError("SequenceNotFound expected")
    try:
        shmkv.KVCache.attach(cache.name + "-absent")
    except FileNotFoundError:
        pass
    else:
        raise AssertionError("FileNotFoundError expected")
    for exc in (shmkv.CacheFullError, shmkv.SegmentError, shmkv.LockTimeout):
        assert issubclass(exc, shmkv.ShmkvError)


def quantized(name: str) -> None:
    """int8 and float8_e4m3 pools: float in, float32 out, raw codes + scales."""
    for dtype in ("int8", "float8_e4m3"):
        cfg = shmkv.CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=16,
                                block_size=4, dtype=dtype, max_seqs=4)
        assert cfg.quantized and cfg.compute_dtype == np.float32
        with shmkv.KVCache.create(f"{name}-{dtype}", cfg) as cache:
            try:
                if dtype == "float8_e4m3":
                    cache.set_kv_scales(0, 0.5, [1.0, 2.0])
                    ks, vs = cache.kv_scales(0)
                    assert ks.shape == (2,) and vs.shape == (2,)
                sid = cache.create_sequence()
                cache.append(sid, _kv(cfg, 3, 1), _kv(cfg, 3, 2))
                k, v = cache.gather(sid)
                assert k.dtype == np.float32
                qk, qv, sk, sv = cache.gather(sid, raw=True)
                assert qk.dtype == cfg.numpy_dtype and sk.dtype == np.float32
                scales: npt.NDArray[np.float32] = cache.key_scales(1)
                assert scales.dtype == cache.value_scales(0).dtype
                out = cache.attention(1, np.ones((1, 4, 8), np.float32), [sid])
                assert out.shape == (1, 4, 8)
            finally:
                cache.unlink()


def main(name: str) -> None:
    cfg = shmkv.CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=64,
                            block_size=4, dtype="float32", max_seqs=16, event_capacity=64)
    assert cfg.bytes_per_token == 2 * 2 * 2 * 8 * 4
    assert cfg.bytes_per_block == cfg.bytes_per_token * cfg.block_size
    cache = shmkv.KVCache.create(name, cfg)
    try:
        try:
            shmkv.KVCache.create(name, cfg)
        except FileExistsError:
            pass
        else:
            raise AssertionError("FileExistsError expected")
        with shmkv.KVCache.attach(name) as other:
            assert other.config == cfg and other.name == cache.name
        assert other.closed
        again = shmkv.KVCache.open(name, cfg)
        again.close()
        sequences(cache)
        decode_loop(cache)
        observability_and_ownership(cache)
        prefix_cache(cache)
        remote_tier(cache)
        kv_events(cache)
        attention(cache)
        errors(cache)
        quantized(name)
        assert cache.check() == []
    finally:
        cache.unlink()
        cache.close()
        cache.close()                                   # idempotent


if __name__ == "__main__":
    main(sys.argv[1])
