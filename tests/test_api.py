"""Every call of the API contract (docs/reference/index.md), used the way the contract says."""
import dataclasses
import mmap
import os

import numpy as np
import posix_ipc
import pytest
from support import SMALL
from workers.mp_workers import assert_consistent, assert_same, read_via_views, tokens

import shmkv
from shmkv.inspect import snapshot

DTYPES = ["float16", "float32", "int8"]


def shm_path(name):
    return "/dev/shm/" + name.lstrip("/")


# ========================================================================================
# CacheConfig
# ========================================================================================
INT_FIELDS = ["num_layers", "num_kv_heads", "head_dim", "num_blocks", "block_size",
              "max_seqs", "max_procs"]


def test_config_defaults_and_fields():
    cfg = shmkv.CacheConfig(num_layers=32, num_kv_heads=8, head_dim=128, num_blocks=4096)
    assert (cfg.block_size, cfg.dtype, cfg.max_seqs) == (16, "float16", 1024)
    assert cfg.max_seq_len == 4096 * 16            # None: one sequence may take the pool
    assert cfg.max_blocks_per_seq == 4096
    assert cfg.numpy_dtype == np.float16


@pytest.mark.parametrize("dtype,itemsize", [("float16", 2), ("float32", 4), ("int8", 1)])
def test_config_bytes_per_token_and_block(dtype, itemsize):
    cfg = shmkv.CacheConfig(num_layers=3, num_kv_heads=5, head_dim=7, num_blocks=10,
                            block_size=6, dtype=dtype)
    scales = 2 * 3 * 5 * 4 if dtype == "int8" else 0   # int8: a float32 per token and head
    assert cfg.bytes_per_token == 2 * 3 * 5 * 7 * itemsize + scales
    assert cfg.bytes_per_block == cfg.bytes_per_token * 6
    assert cfg.numpy_dtype == np.dtype(dtype)
    # a Llama-3-8B-ish shape
    big = shmkv.CacheConfig(num_layers=32, num_kv_heads=8, head_dim=128, num_blocks=4096,
                            dtype=dtype)
    assert big.bytes_per_token == 2 * 32 * 8 * (128 * itemsize + (4 if dtype == "int8" else 0))
    assert big.bytes_per_block == big.bytes_per_token * 16


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("bad", [0, -1, 1.0, 2.5, True, "4", None, 1 << 40])
def test_config_rejects_bad_int_fields(field, bad):
    kw = dict(SMALL)
    kw[field] = bad
    with pytest.raises(ValueError) as ei:
        shmkv.CacheConfig(**kw)
    assert field in str(ei.value)


@pytest.mark.parametrize("field,bad", [
    ("dtype", "float64"), ("dtype", "fp16"), ("dtype", np.float64), ("dtype", None),
    ("hash", "md5"), ("hash", None),
    ("max_seq_len", 0), ("max_seq_len", -4), ("max_seq_len", 64 * 4 + 1),
    ("max_seq_len", 8.0), ("max_seq_len", True),
])
def test_config_rejects_bad_other_fields(field, bad):
    kw = dict(SMALL)
    kw[field] = bad
    with pytest.raises(ValueError) as ei:
        shmkv.CacheConfig(**kw)
    assert field in str(ei.value)


def test_config_rejects_a_segment_too_large():
    with pytest.raises(ValueError):
        shmkv.CacheConfig(num_layers=4096, num_kv_heads=4096, head_dim=65536,
                          num_blocks=0x7FFFFFFE, block_size=65536)


def test_config_accepts_numpy_ints_and_rounds_max_seq_len():
    cfg = shmkv.CacheConfig(num_layers=np.int64(2), num_kv_heads=np.int32(2),
                            head_dim=np.uint16(8), num_blocks=64, block_size=4,
                            max_seq_len=10)
    assert type(cfg.num_layers) is int and cfg.num_layers == 2
    assert cfg.max_seq_len == 12 and cfg.max_blocks_per_seq == 3
    assert cfg == shmkv.CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8,
                                    num_blocks=64, block_size=4, max_seq_len=12)


def test_config_is_frozen_and_hashable():
    cfg = shmkv.CacheConfig(**SMALL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_blocks = 5
    with pytest.raises(AttributeError):
        cfg.dtype = "float32"
    assert cfg.num_blocks == SMALL["num_blocks"]
    assert hash(cfg) == hash(shmkv.CacheConfig(**SMALL))
    assert cfg != shmkv.CacheConfig(**{**SMALL, "num_blocks": 65})


@pytest.mark.parametrize("extra", [
    {}, {"dtype": "float32"}, {"dtype": "int8"}, {"max_seq_len": 20},
    {"hash": "sha256", "max_procs": 7, "block_size": 16, "num_blocks": 9, "max_seqs": 3},
])
def test_config_round_trips_through_the_segment(seg_name, extra):
    cfg = shmkv.CacheConfig(**{**SMALL, **extra})
    with shmkv.KVCache.create(seg_name, cfg) as c:
        assert c.config == cfg
        with shmkv.KVCache.attach(seg_name) as other:
            assert other.config == cfg
            assert isinstance(other.config, shmkv.CacheConfig)
    # and from a fresh process view after every handle closed
    with shmkv.KVCache.attach(seg_name) as other:
        assert other.config == cfg


# ========================================================================================
# segment lifetime
# ========================================================================================
def test_create_attach_close_unlink(seg_name):
    cfg = shmkv.CacheConfig(**SMALL)
    c = shmkv.KVCache.create(seg_name, cfg)
    try:
        assert os.path.exists(shm_path(seg_name))
        assert c.name.lstrip("/") == seg_name
        assert not c.closed
        a = shmkv.KVCache.attach(seg_name)
        assert a.name.lstrip("/") == seg_name and a.config == cfg
        sid = a.create_sequence()
        assert c.sequences() == [sid]                 # one pool, seen by both handles
        a.close()
        assert a.closed
        assert c.sequences() == [sid]                 # c still holds the process attached
        c.free(sid)
    finally:
        c.close()
    assert c.closed
    assert os.path.exists(shm_path(seg_name))         # close() leaves the segment
    again = shmkv.KVCache.attach(seg_name)
    again.unlink()
    assert not os.path.exists(shm_path(seg_name))
    again.close()
    with pytest.raises(FileNotFoundError):
        shmkv.KVCache.attach(seg_name)


def test_create_existing_name_is_file_exists(seg_name):
    cfg = shmkv.CacheConfig(**SMALL)
    with shmkv.KVCache.create(seg_name, cfg) as c:
        sid = c.create_sequence()
        with pytest.raises(FileExistsError):
            shmkv.KVCache.create(seg_name, cfg)
        with pytest.raises(FileExistsError):
            shmkv.KVCache.create("/" + seg_name, cfg)
        assert c.sequences() == [sid]             # the failed create touched nothing
        assert_consistent(c)
        c.free(sid)


def test_create_over_a_foreign_segment_is_file_exists(seg_name):
    junk = b"not shmkv" * 500
    _raw_segment(seg_name, junk)
    with pytest.raises(FileExistsError):
        shmkv.KVCache.create(seg_name, shmkv.CacheConfig(**SMALL))
    shm = posix_ipc.SharedMemory("/" + seg_name)   # ... and left it as it was
    try:
        assert shm.size == len(junk)
        with mmap.mmap(shm.fd, len(junk)) as m:
            assert m[:] == junk
    finally:
        shm.close_fd()


def test_attach_absent_is_file_not_found(seg_name):
    with pytest.raises(FileNotFoundError):
        shmkv.KVCache.attach(seg_name)
    with pytest.raises(FileNotFoundError):
        shmkv.KVCache.attach("/" + seg_name)
    assert not os.path.exists(shm_path(seg_name))     # attach creates nothing


def test_leading_slash_is_accepted_and_ignored(seg_name):
    cfg = shmkv.CacheConfig(**SMALL)
    with shmkv.KVCache.create("/" + seg_name, cfg) as c:
        assert os.path.exists(shm_path(seg_name))
        sid = c.create_sequence()
        with shmkv.KVCache.attach(seg_name) as a, shmkv.KVCache.attach("/" + seg_name) as b:
            assert a.sequences() == b.sequences() == [sid]
        c.free(sid)


@pytest.mark.parametrize("bad", ["", "/", "a/b", "//x", "nul\0byte", "x" * 300])
def test_bad_names_are_value_errors(bad):
    cfg = shmkv.CacheConfig(**SMALL)
    with pytest.raises(ValueError):
        shmkv.KVCache.create(bad, cfg)
    with pytest.raises(ValueError):
        shmkv.KVCache.attach(bad)


def test_non_str_name_and_config_are_type_errors(seg_name):
    with pytest.raises(TypeError):
        shmkv.KVCache.create(b"bytes-name", shmkv.CacheConfig(**SMALL))
    with pytest.raises(TypeError):
        shmkv.KVCache.create(seg_name, dict(SMALL))
    assert not os.path.exists(shm_path(seg_name))


def _mode(name):
    return os.stat(shm_path(name)).st_mode & 0o777


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077, 0o777])
def test_mode_is_0600_whatever_the_umask(seg_name, umask):
    old = os.umask(umask)
    try:
        c = shmkv.KVCache.create(seg_name, shmkv.CacheConfig(**SMALL))
    finally:
        os.umask(old)
    try:
        assert _mode(seg_name) == 0o600
    finally:
        c.close()


@pytest.mark.parametrize("umask", [0o000, 0o077, 0o777])
@pytest.mark.parametrize("mode", [0o644, 0o660, 0o666, 0o400, 0o640])
def test_mode_argument_is_exact(seg_name, umask, mode):
    old = os.umask(umask)
    try:
        c = shmkv.KVCache.create(seg_name, shmkv.CacheConfig(**SMALL), mode=mode)
    finally:
        os.umask(old)
    try:
        assert _mode(seg_name) == mode
        if mode & 0o200:
            sid = c.create_sequence()      # the creator can use it whatever the mode
            c.free(sid)
    finally:
        c.close()


@pytest.mark.parametrize("mode", [-1, 0o1000, 0o4755])
def test_mode_out_of_range(seg_name, mode):
    with pytest.raises(ValueError):
        shmkv.KVCache.create(seg_name, shmkv.CacheConfig(**SMALL), mode=mode)
    assert not os.path.exists(shm_path(seg_name))


def test_close_is_idempotent_and_closed_handle_refuses(cache):
    sid = cache.create_sequence()
    cache.close()
    cache.close()
    assert cache.closed
    for call in (lambda: cache.create_sequence(), lambda: cache.seq_len(sid),
                 lambda: cache.stats(), lambda: cache.check(), lambda: cache.gather(sid),
                 lambda: cache.key_cache(0), lambda: cache.sequences()):
        with pytest.raises(ValueError):
            call()


def test_context_manager_closes(seg_name):
    cfg = shmkv.CacheConfig(**SMALL)
    with shmkv.KVCache.create(seg_name, cfg) as c:
        assert isinstance(c, shmkv.KVCache) and not c.closed
    assert c.closed
    with shmkv.KVCache.attach(seg_name) as a:
        assert not a.closed
        assert a.config == cfg
    assert a.closed
    with pytest.raises(RuntimeError), shmkv.KVCache.attach(seg_name) as b:
        raise RuntimeError("body fails")
    assert b.closed
    assert os.path.exists(shm_path(seg_name))


def test_unlink_while_attached_keeps_working(seg_name):
    cfg = shmkv.CacheConfig(**SMALL)
    c = shmkv.KVCache.create(seg_name, cfg)
    other = shmkv.KVCache.attach(seg_name)
    try:
        k, v = tokens(cfg, 9, 1)
        sid = c.create_sequence()
        c.append(sid, k[:, :5], v[:, :5])
        c.unlink()
        assert not os.path.exists(shm_path(seg_name))
        with pytest.raises(FileNotFoundError):
            shmkv.KVCache.attach(seg_name)
        c.append(sid, k[:, 5:], v[:, 5:])               # still the same shared pool
        gk, gv = other.gather(sid)
        assert_same(gk, k)
        assert_same(gv, v)
        c.unlink()                                      # again: nothing to do
        # a new segment may now take the name; the old handles' unlink leaves it alone
        with shmkv.KVCache.create(seg_name, cfg) as fresh:
            assert fresh.sequences() == []
            other.unlink()
            assert os.path.exists(shm_path(seg_name))
            fresh.unlink()
        other.free(sid)
        assert_consistent(other)
    finally:
        other.close()
        c.close()


def test_open_creates_then_attaches(seg_name):
    cfg = shmkv.CacheConfig(**SMALL)
    with shmkv.KVCache.open(seg_name, cfg) as a:
        sid = a.create_sequence()
        with shmkv.KVCache.open(seg_name, cfg) as b:
            assert b.sequences() == [sid]
        with pytest.raises(shmkv.SegmentError):
            shmkv.KVCache.open(seg_name, shmkv.CacheConfig(**{**SMALL, "num_blocks": 65}))
        a.free(sid)


# ---- not a shmkv segment -----------------------------------------------------------------
def _raw_segment(name, data):
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=len(data))
    try:
        with mmap.mmap(shm.fd, len(data)) as m:
            m[:] = data
    finally:
        shm.close_fd()


def _patch(name, offset, data):
    shm = posix_ipc.SharedMemory("/" + name)
    try:
        with mmap.mmap(shm.fd, shm.size) as m:
            m[offset:offset + len(data)] = data
    finally:
        shm.close_fd()


def _truncate(name, size):
    shm = posix_ipc.SharedMemory("/" + name)
    try:
        os.ftruncate(shm.fd, size)
    finally:
        shm.close_fd()


def _make_real(name, **kw):
    with shmkv.KVCache.create(name, shmkv.CacheConfig(**{**SMALL, **kw})) as c:
        sid = c.create_sequence()
        k, v = tokens(c.config, 5, 0)
        c.append(sid, k, v)
        c.detach(sid)
        return os.stat(shm_path(name)).st_size


@pytest.mark.parametrize("size", [4096, 65536])
def test_attach_garbage_segment_is_segment_error(seg_name, size):
    junk = (b"this is not a shmkv segment " * (size // 28 + 1))[:size]
    _raw_segment(seg_name, junk)
    with pytest.raises(shmkv.SegmentError):
        shmkv.KVCache.attach(seg_name, timeout=0.5)
    with pytest.raises(shmkv.SegmentError):
        shmkv.KVCache.open(seg_name, shmkv.CacheConfig(**SMALL), timeout=0.5)
    with pytest.raises(shmkv.SegmentError):
        snapshot(seg_name)
    # left alone: attach never "repairs" a foreign segment
    shm = posix_ipc.SharedMemory("/" + seg_name)
    try:
        with mmap.mmap(shm.fd, size) as m:
            assert m[:] == junk
    finally:
        shm.close_fd()


@pytest.mark.parametrize("size", [0, 100])
def test_attach_tiny_segment_is_segment_error(seg_name, size):
    _raw_segment(seg_name, b"\x00" * max(size, 1))
    _truncate(seg_name, size)
    with pytest.raises(shmkv.SegmentError):
        shmkv.KVCache.attach(seg_name, timeout=0.3)


@pytest.mark.parametrize("frac", [0.5, 0.99])
def test_attach_truncated_segment_is_segment_error(seg_name, frac):
    size = _make_real(seg_name)
    _truncate(seg_name, int(size * frac) // 4096 * 4096)
    with pytest.raises(shmkv.SegmentError):
        shmkv.KVCache.attach(seg_name, timeout=0.5)


def test_attach_grown_segment_is_segment_error(seg_name):
    size = _make_real(seg_name)
    _truncate(seg_name, size + 4096)
    with pytest.raises(shmkv.SegmentError):
        shmkv.KVCache.attach(seg_name, timeout=0.5)


@pytest.mark.parametrize("offset,data,what", [
    (0, b"__SHMKV9", "magic"),
    (8, (shmkv._core.LAYOUT_VERSION + 1).to_bytes(4, "little"), "version"),
    (8, (0xFFFFFFFF).to_bytes(4, "little"), "version"),
    (12, (1).to_bytes(4, "little"), "header size"),
    (16, b"\x01\x02\x03\x04\x05\x06\x07\x08", "abi fingerprint"),
    (24, (1 << 40).to_bytes(8, "little"), "segment size"),
    (40, (3).to_bytes(4, "little"), "config (checksum)"),
    (512, (0xDEADBEEF).to_bytes(4, "little"), "segment state"),
])
def test_attach_patched_header_is_segment_error(seg_name, offset, data, what):
    _make_real(seg_name)
    snap = snapshot(seg_name)
    assert snap["layout_version"] == shmkv._core.LAYOUT_VERSION
    _patch(seg_name, offset, data)
    with pytest.raises(shmkv.SegmentError):
        shmkv.KVCache.attach(seg_name, timeout=0.5)


def test_attach_waits_for_a_segment_still_being_built(seg_name):
    """A segment whose creator never finished building it (state INIT): attach waits for
    `timeout` seconds, then SegmentError."""
    import time

    _make_real(seg_name)
    _patch(seg_name, 512, (0x494E4954).to_bytes(4, "little"))       # SHMKV_STATE_INIT
    t0 = time.monotonic()
    with pytest.raises(shmkv.SegmentError):
        shmkv.KVCache.attach(seg_name, timeout=0.4)
    took = time.monotonic() - t0
    assert 0.3 <= took < 5, took


def test_patched_then_restored_header_attaches_again(seg_name):
    _make_real(seg_name)
    shm = posix_ipc.SharedMemory("/" + seg_name)
    with mmap.mmap(shm.fd, 4096) as m:
        orig = bytes(m[8:12])
    shm.close_fd()
    _patch(seg_name, 8, b"\x63\x00\x00\x00")
    with pytest.raises(shmkv.SegmentError) as ei:
        shmkv.KVCache.attach(seg_name, timeout=0.5)
    assert "version" in str(ei.value).lower()
    _patch(seg_name, 8, orig)
    with shmkv.KVCache.attach(seg_name) as c:   # the test's patching was the only fault
        (sid,) = c.sequences()
        assert c.seq_len(sid) == 5
        c.free(sid)
        assert_consistent(c)


# ========================================================================================
# sequences
# ========================================================================================
@pytest.mark.parametrize("dtype", DTYPES)
def test_append_gather_round_trip(make_cache, dtype):
    cache = make_cache(dtype=dtype)
    cfg = cache.config
    k, v = tokens(cfg, 23, 7)
    sid = cache.create_sequence()
    assert isinstance(sid, int)
    assert cache.seq_len(sid) == 0
    for a, b in [(0, 1), (1, 4), (4, 5), (5, 13), (13, 23)]:    # across block boundaries
        cache.append(sid, k[:, a:b], v[:, a:b])
        assert cache.seq_len(sid) == b
        assert_consistent(cache)
    gk, gv = cache.gather(sid)
    assert_same(gk, k)
    assert_same(gv, v)
    assert gk.flags.c_contiguous and gv.flags.c_contiguous and gk.flags.writeable
    assert not np.shares_memory(gk, cache.key_cache(0))          # a new array, not a view
    gk[...] = 0                                                   # ... so this changes nothing
    assert_same(cache.gather(sid)[0], k)
    vk, vv = read_via_views(cache, sid)
    assert_same(vk, k)
    assert_same(vv, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_ranges(make_cache, dtype):
    cache = make_cache(dtype=dtype)
    k, v = tokens(cache.config, 10, 3)
    sid = cache.create_sequence()
    cache.append(sid, k, v)
    for a, b in [(0, 10), (0, 0), (10, 10), (3, 7), (4, 8), (9, 10), (0, 1), (5, 5)]:
        gk, gv = cache.gather(sid, a, b)
        assert_same(gk, k[:, a:b], f"[{a},{b})")
        assert_same(gv, v[:, a:b], f"[{a},{b})")
    assert_same(cache.gather(sid, 6)[0], k[:, 6:])
    assert_same(cache.gather(sid, stop=4)[1], v[:, :4])
    assert_same(cache.gather(sid, np.int64(2), np.int32(5))[0], k[:, 2:5])
    empty = cache.create_sequence()
    gk, gv = cache.gather(empty)
    assert gk.shape == (2, 0, 2, 8) and gk.dtype == cache.config.compute_dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_out(make_cache, dtype):
    cache = make_cache(dtype=dtype)
    cfg = cache.config
    k, v = tokens(cfg, 11, 4)
    sid = cache.create_sequence()
    cache.append(sid, k, v)
    ko = np.zeros((2, 11, 2, 8), cfg.compute_dtype)
    vo = np.zeros_like(ko)
    res = cache.gather(sid, out=(ko, vo))
    assert res[0] is ko and res[1] is vo
    assert_same(ko, k)
    assert_same(vo, v)
    ko2 = np.zeros((2, 4, 2, 8), cfg.compute_dtype)
    vo2 = np.zeros_like(ko2)
    res = cache.gather(sid, 5, 9, out=(ko2, vo2))
    assert res[0] is ko2 and res[1] is vo2
    assert_same(ko2, k[:, 5:9])
    assert_same(vo2, v[:, 5:9])
    # slices of a bigger buffer are fine while C-contiguous
    buf = np.zeros((2, 2, 3, 2, 8), cfg.compute_dtype)
    cache.gather(sid, 0, 3, out=(buf[0], buf[1]))
    assert_same(buf[0], k[:, :3])
    assert_same(buf[1], v[:, :3])


def test_sequence_ids_unique_and_listed(cache):
    sids = [cache.create_sequence() for _ in range(10)]
    assert len(set(sids)) == 10
    assert sorted(cache.sequences()) == sorted(sids)
    assert all(isinstance(s, int) for s in cache.sequences())
    for s in sids[::2]:
        cache.free(s)
    assert sorted(cache.sequences()) == sorted(sids[1::2])
    more = [cache.create_sequence() for _ in range(5)]   # slots are reused ...
    live = sids[1::2] + more
    assert len(set(live)) == len(live)                   # ... ids stay unique among live
    for s in sids[::2]:                                  # old ids stay dead
        if s not in more:
            with pytest.raises(shmkv.SequenceNotFound):
                cache.seq_len(s)
    for s in live:
        cache.free(s)
    assert cache.sequences() == []
    assert_consistent(cache)


def test_freed_id_is_not_reused_immediately(cache):
    a = cache.create_sequence()
    cache.free(a)
    b = cache.create_sequence()
    assert b != a
    with pytest.raises(shmkv.SequenceNotFound):
        cache.seq_len(a)


def test_block_table_and_free_return_blocks(cache):
    cfg = cache.config
    bs = cfg.block_size
    st0 = cache.stats()
    assert st0["free_blocks"] == cfg.num_blocks and st0["used_blocks"] == 0
    sid = cache.create_sequence()
    t = cache.block_table(sid)
    assert t.dtype == np.int32 and t.shape == (0,)
    k, v = tokens(cfg, 3 * bs + 1, 0)
    cache.append(sid, k, v)
    t = cache.block_table(sid)
    assert t.dtype == np.int32 and t.shape == (4,)
    assert len(set(t.tolist())) == 4 and all(0 <= b < cfg.num_blocks for b in t)
    st = cache.stats()
    assert st["used_blocks"] == 4 and st["free_blocks"] == cfg.num_blocks - 4
    assert st["allocations"] - st0["allocations"] == 4
    # the table is what the pool views hold: token i lives in block t[i // bs]
    kc = cache.key_cache(1)
    for i in range(3 * bs + 1):
        assert_same(kc[t[i // bs], i % bs], k[1, i])
    cache.free(sid)
    st = cache.stats()
    assert st["free_blocks"] == cfg.num_blocks and st["used_blocks"] == 0
    assert st["frees"] - st0["frees"] == 4
    with pytest.raises(shmkv.SequenceNotFound):
        cache.block_table(sid)
    assert_consistent(cache)


def test_append_accepts_non_contiguous_inputs(cache):
    cfg = cache.config
    k, v = tokens(cfg, 6, 2)
    kf = np.asfortranarray(k)
    big_v = np.zeros((2, 12, 2, 8), cfg.numpy_dtype)
    big_v[:, ::2] = v
    sid = cache.create_sequence()
    cache.append(sid, kf, big_v[:, ::2])
    gk, gv = cache.gather(sid)
    assert_same(gk, k)
    assert_same(gv, v)


# ========================================================================================
# decode-loop flow
# ========================================================================================
@pytest.mark.parametrize("dtype", DTYPES)
def test_reserve_write_gather(make_cache, dtype):
    cache = make_cache(dtype=dtype)
    cfg = cache.config
    bs = cfg.block_size
    k, v = tokens(cfg, 13, 9)
    sid = cache.create_sequence()
    cache.append(sid, k[:, :3], v[:, :3])
    n0 = 3
    for n in (1, 4, 5):                     # within a block, to a boundary, across blocks
        slots = cache.reserve(sid, n)
        assert slots.dtype == np.int64 and slots.shape == (n,)
        assert cache.seq_len(sid) == n0 + n        # the new length is visible at once
        table = cache.block_table(sid)
        assert len(table) == -(-(n0 + n) // bs)
        for i, s in enumerate(slots):
            pos = n0 + i
            assert s == table[pos // bs] * bs + pos % bs
        for layer in range(cfg.num_layers):
            cache.write(layer, slots, k[layer, n0:n0 + n], v[layer, n0:n0 + n])
        n0 += n
        assert_consistent(cache)
    gk, gv = cache.gather(sid)
    assert_same(gk, k)
    assert_same(gv, v)
    # write accepts any integer slot array (converted)
    slots = cache.reserve(sid, 2)
    for layer in range(cfg.num_layers):
        cache.write(layer, slots.astype(np.int32), k[layer, :2], v[layer, :2])
    assert_same(cache.gather(sid, 13, 15)[0], k[:, :2])


def test_write_one_layer_only_touches_that_layer(cache):
    cfg = cache.config
    k, v = tokens(cfg, 4, 1)
    sid = cache.create_sequence()
    cache.append(sid, k, v)
    slots = cache.reserve(sid, 1)
    zero = np.zeros((1, 2, 8), cfg.numpy_dtype)
    for layer in range(cfg.num_layers):
        cache.write(layer, slots, zero, zero)
    k2, v2 = tokens(cfg, 1, 2)
    cache.write(1, slots, k2[1], v2[1])
    gk, gv = cache.gather(sid, 4, 5)
    assert_same(gk[1], k2[1])
    assert_same(gv[1], v2[1])
    assert not gk[0].any() and not gv[0].any()
    assert_same(cache.gather(sid, 0, 4)[0], k)       # the earlier tokens are untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_key_value_cache_views(make_cache, dtype):
    cache = make_cache(dtype=dtype)
    cfg = cache.config
    shape = (cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    for layer in range(cfg.num_layers):
        kc, vc = cache.key_cache(layer), cache.value_cache(layer)
        assert kc.shape == shape and vc.shape == shape
        assert kc.dtype == cfg.numpy_dtype and vc.dtype == cfg.numpy_dtype
        assert kc.flags.writeable and vc.flags.writeable
        assert not np.shares_memory(kc, vc)
        assert np.shares_memory(kc, cache.key_cache(layer))    # zero-copy: same memory
    assert not np.shares_memory(cache.key_cache(0), cache.key_cache(1))
    assert not np.shares_memory(cache.value_cache(0), cache.key_cache(1))
    # writes through the view are what gather reads
    k, v = tokens(cfg, 6, 5)
    sid = cache.create_sequence()
    slots = cache.reserve(sid, 6)
    for layer in range(cfg.num_layers):
        kc, vc = cache.key_cache(layer), cache.value_cache(layer)
        for i, s in enumerate(slots):
            kc[s // cfg.block_size, s % cfg.block_size] = k[layer, i]
            vc[s // cfg.block_size, s % cfg.block_size] = v[layer, i]
            if cfg.dtype == "int8":     # codes == values: scale 1 (beside them, zero-copy)
                cache.key_scales(layer)[s // cfg.block_size, s % cfg.block_size] = 1.0
                cache.value_scales(layer)[s // cfg.block_size, s % cfg.block_size] = 1.0
    gk, gv = cache.gather(sid)
    assert_same(gk, k)
    assert_same(gv, v)
    # and appends are what the views show, in every other handle too
    sid2 = cache.create_sequence()
    cache.append(sid2, v, k)
    with shmkv.KVCache.attach(cache.name) as other:
        ok, ov = read_via_views(other, sid2)
        assert_same(ok, v)
        assert_same(ov, k)


def test_views_survive_close_without_crashing(seg_name):
    cfg = shmkv.CacheConfig(**SMALL)
    c = shmkv.KVCache.create(seg_name, cfg)
    sid = c.create_sequence()
    k, v = tokens(cfg, 4, 0)
    c.append(sid, k, v)
    b = c.block_table(sid)[0]
    kc = c.key_cache(1)
    c.close()
    # the mapping lives as long as a view does; reading it must not crash
    assert_same(kc[b, :4], k[1])


def test_batch_block_tables(cache):
    cfg = cache.config
    bs = cfg.block_size
    lens = [0, 1, bs, bs + 1, 3 * bs, 2 * bs + 3]
    sids = []
    for i, n in enumerate(lens):
        s = cache.create_sequence()
        if n:
            k, v = tokens(cfg, n, i)
            cache.append(s, k, v)
        sids.append(s)
    tables, got_lens = cache.batch_block_tables(sids)
    W = max(-(-n // bs) for n in lens)
    assert tables.dtype == np.int32 and got_lens.dtype == np.int32
    assert tables.shape == (len(sids), W) and got_lens.shape == (len(sids),)
    assert got_lens.tolist() == lens
    for row, s, n in zip(tables, sids, lens):
        nb = -(-n // bs)
        assert row[:nb].tolist() == cache.block_table(s).tolist()
        assert (row[nb:] == -1).all()
    # a sub-batch is as wide as its own longest table
    t2, l2 = cache.batch_block_tables(sids[:3])
    assert t2.shape == (3, 1) and l2.tolist() == lens[:3]
    assert t2[0].tolist() == [-1]
    t3, l3 = cache.batch_block_tables([sids[0], sids[0]])
    assert t3.shape == (2, 0) and l3.tolist() == [0, 0]
    t4, l4 = cache.batch_block_tables(np.array(sids[::-1], np.int64))
    assert_same(t4, tables[::-1].copy())
    assert l4.tolist() == lens[::-1]
    t5, l5 = cache.batch_block_tables([])
    assert t5.shape[0] == 0 and l5.shape == (0,)
    t6, _ = cache.batch_block_tables(tuple(sids))
    assert_same(t6, tables)


def test_batch_block_tables_array_kinds_and_large_batches(make_cache):
    """The int64 fast path, every array that must take the checked path, and a batch
    larger than the on-stack slot buffer (512)."""
    cache = make_cache(max_seqs=600, num_blocks=2000)
    bs = cache.config.block_size
    sids = []
    for i in range(520):
        s = cache.create_sequence()
        cache.reserve(s, 1 + i % (3 * bs))
        sids.append(s)
    ref_t, ref_l = cache.batch_block_tables(sids)            # list of ints: read in place
    assert ref_t.shape == (520, 3) and ref_l.tolist() == [1 + i % (3 * bs) for i in range(520)]
    for i, s in enumerate(sids[:20]):
        nb = -(-ref_l[i] // bs)
        assert ref_t[i, :nb].tolist() == cache.block_table(s).tolist()
    # items that are not plain ints send a list to the checked path: same answer
    mixed = list(sids)
    mixed[3], mixed[517] = np.int64(mixed[3]), np.uint32(mixed[517])
    for form in (mixed, tuple(sids)):
        t, lens = cache.batch_block_tables(form)
        assert_same(t, ref_t)
        assert_same(lens, ref_l)
    # ids past the in-place read (multi-digit, past int64, negative) past the stack buffer
    for bad in (2 ** 40, 2 ** 63, 2 ** 70, -1, -2 ** 40):
        with pytest.raises(shmkv.SequenceNotFound, match=str(bad)):
            cache.batch_block_tables(sids[:515] + [bad] + sids[515:])
    a = np.array(sids, np.int64)
    for arr in (a, a.astype(">i8"), np.repeat(a, 2)[::2], a.astype(np.uint64), a.astype("<i8")):
        t, lens = cache.batch_block_tables(arr)
        assert_same(t, ref_t)
        assert_same(lens, ref_l)
    # a freed id anywhere in a large batch: SequenceNotFound naming it, nothing changed
    cache.free(sids[515])
    free_before = cache.stats()["free_blocks"]
    with pytest.raises(shmkv.SequenceNotFound, match=str(sids[515])):
        cache.batch_block_tables(a)
    assert cache.stats()["free_blocks"] == free_before
    assert cache.batch_block_tables(np.delete(a, 515))[1].tolist() == np.delete(ref_l, 515).tolist()


def test_batch_block_tables_corrupt_table_entry(cache):
    """A block id out of range in a sequence's table is reported, never copied out."""
    cfg = cache.config
    s = cache.create_sequence()
    cache.reserve(s, 2 * cfg.block_size)
    lay = shmkv._core.layout_of(cfg)
    slot = s % cfg.max_seqs
    off = lay["off_tables"] + 4 * slot * (cfg.max_seq_len // cfg.block_size)
    shm = posix_ipc.SharedMemory(cache.name)
    try:
        m = mmap.mmap(shm.fd, lay["segment_size"])
    finally:
        shm.close_fd()
    try:
        view = np.frombuffer(m, np.int32, 2, off)
        assert view.tolist() == cache.block_table(s).tolist()   # the right place
        good = int(view[1])
        view[1] = cfg.num_blocks
        with pytest.raises(shmkv.SegmentError, match="corrupt"):
            cache.batch_block_tables([s])
        view[1] = good
        assert cache.batch_block_tables([s])[0][0].tolist() == cache.block_table(s).tolist()
        del view
    finally:
        m.close()


# ========================================================================================
# observability
# ========================================================================================
API_STATS = {"num_blocks", "free_blocks", "used_blocks", "num_sequences",
             "peak_used_blocks", "allocations", "frees", "forks", "cow_copies"}
BUILT_STATS = API_STATS | {
    "cached_blocks", "max_seqs", "num_processes", "index_entries", "last_recovery_s",
    "max_recovery_s", "sequences_created", "sequences_freed", "appended_tokens",
    "gathered_tokens", "recoveries", "reclaimed_sequences", "reclaimed_blocks",
    "lock_owner_dead", "lock_waits", "prefix_queries", "prefix_hits",
    "cached_blocks_reused", "cached_blocks_evicted", "evictions_lru", "evictions_lfu",
    "evictions_longest", "evictions_priority", "trimmed_blocks", "processes_attached"}


def test_stats_keys_and_counters(cache):
    cfg = cache.config
    st = cache.stats()
    assert isinstance(st, dict)
    assert BUILT_STATS <= set(st), BUILT_STATS - set(st)
    assert st["num_blocks"] == cfg.num_blocks and st["max_seqs"] == cfg.max_seqs
    assert st["num_sequences"] == 0 and st["used_blocks"] == 0
    assert st["num_processes"] == 1
    base = st
    k, v = tokens(cfg, 10, 0)
    a = cache.create_sequence()
    cache.append(a, k, v)                    # 3 blocks, 2 tokens in the last
    b = cache.fork(a)
    cache.append(b, k[:, :1], v[:, :1])      # copy-on-write of the partial block
    cache.gather(a, 2, 7)
    st = cache.stats()
    d = {key: st[key] - base[key] for key in
         ("allocations", "frees", "forks", "cow_copies", "sequences_created",
          "sequences_freed", "appended_tokens", "gathered_tokens")}
    assert d == dict(allocations=4, frees=0, forks=1, cow_copies=1, sequences_created=2,
                     sequences_freed=0, appended_tokens=11, gathered_tokens=5)
    assert st["num_sequences"] == 2
    assert st["used_blocks"] == 4 and st["peak_used_blocks"] == 4
    cache.free(a)
    st = cache.stats()
    assert st["used_blocks"] == 3 and st["peak_used_blocks"] == 4
    assert st["frees"] - base["frees"] == 1 and st["sequences_freed"] == 1
    cache.free(b)
    st = cache.stats()
    assert st["used_blocks"] == 0 and st["peak_used_blocks"] == 4
    assert st["frees"] - base["frees"] == 4 and st["num_sequences"] == 0
    assert_consistent(cache)


def test_free_plus_used_is_num_blocks_at_every_step(cache):
    cfg = cache.config
    rng = np.random.default_rng(0)
    live = []
    for step in range(60):
        r = rng.random()
        if r < 0.3 or not live:
            live.append(cache.create_sequence())
        elif r < 0.55:
            k, v = tokens(cfg, int(rng.integers(1, 9)), step)
            try:
                cache.append(live[int(rng.integers(len(live)))], k, v)
            except shmkv.CacheFullError:
                pass
        elif r < 0.7:
            try:
                live.append(cache.fork(live[int(rng.integers(len(live)))]))
            except shmkv.CacheFullError:
                pass
        elif r < 0.85:
            try:
                cache.reserve(live[int(rng.integers(len(live)))], int(rng.integers(1, 6)))
            except shmkv.CacheFullError:
                pass
        else:
            cache.free(live.pop(int(rng.integers(len(live)))))
        assert_consistent(cache)
        st = cache.stats()
        used = set()
        for s in live:
            used.update(cache.block_table(s).tolist())
        assert st["used_blocks"] == len(used)        # a block is used iff referenced
        assert st["num_sequences"] == len(live)
    for s in live:
        cache.free(s)
    assert cache.stats()["free_blocks"] == cfg.num_blocks
    assert_consistent(cache)


def test_check_is_empty_list_on_a_fresh_and_a_busy_segment(cache):
    assert cache.check() == []
    k, v = tokens(cache.config, 9, 0)
    a = cache.create_sequence()
    cache.append(a, k, v)
    cache.fork(a)
    assert cache.check() == []
    assert isinstance(cache.check(), list)


# ========================================================================================
# ownership and recovery
# ========================================================================================
def test_detach_adopt_owner_pid(cache):
    sid = cache.create_sequence()
    assert cache.owner_pid(sid) == os.getpid()
    cache.detach(sid)
    assert cache.owner_pid(sid) is None
    cache.detach(sid)                                 # idempotent
    assert cache.owner_pid(sid) is None
    cache.adopt(sid)
    assert cache.owner_pid(sid) == os.getpid()
    child = cache.fork(sid)
    assert cache.owner_pid(child) == os.getpid()      # a fork is owned by the forker
    cache.free(sid)
    for call in (cache.detach, cache.adopt, cache.owner_pid):
        with pytest.raises(shmkv.SequenceNotFound):
            call(sid)


def test_last_close_reclaims_owned_but_not_detached(seg_name):
    cfg = shmkv.CacheConfig(**SMALL)
    k, v = tokens(cfg, 9, 3)
    c = shmkv.KVCache.create(seg_name, cfg)
    extra = shmkv.KVCache.attach(seg_name)             # a second handle, same process
    owned = c.create_sequence()
    c.append(owned, k, v)
    kept = c.create_sequence()
    c.append(kept, k, v)
    c.detach(kept)
    forked = c.fork(kept)                              # owned, shares blocks with kept
    c.append(forked, k[:, :2], v[:, :2])
    c.close()
    assert sorted(extra.sequences()) == sorted([owned, kept, forked])   # still attached
    extra.close()                                      # the process's last handle
    with shmkv.KVCache.attach(seg_name) as a:
        assert a.sequences() == [kept]
        gk, gv = a.gather(kept)
        assert_same(gk, k)
        assert_same(gv, v)
        assert a.owner_pid(kept) is None
        st = a.stats()
        assert st["used_blocks"] == 3 and st["num_sequences"] == 1
        assert_consistent(a)
        a.adopt(kept)
    with shmkv.KVCache.attach(seg_name) as a:           # adopted, then closed: reclaimed
        assert a.sequences() == []
        assert a.stats()["free_blocks"] == cfg.num_blocks
        assert_consistent(a)


def test_recover_with_nothing_dead(cache):
    sid = cache.create_sequence()
    k, v = tokens(cache.config, 5, 0)
    cache.append(sid, k, v)
    r = cache.recover()
    assert isinstance(r, dict)
    assert {"sequences", "blocks"} <= set(r)
    assert r["sequences"] == 0 and r["blocks"] == 0
    assert cache.sequences() == [sid]
    assert_same(cache.gather(sid)[0], k)
    assert_consistent(cache)


def test_lock_timeout_setting(cache):
    assert cache.lock_timeout > 0
    cache.lock_timeout = 2.5
    assert cache.lock_timeout == pytest.approx(2.5)
    for bad in (0, -1.0):
        with pytest.raises(ValueError):
            cache.lock_timeout = bad
    assert cache.lock_timeout == pytest.approx(2.5)


def test_attach_close_cycles_do_not_leak_process_slots(seg_name):
    cfg = shmkv.CacheConfig(**{**SMALL, "max_procs": 2})
    shmkv.KVCache.create(seg_name, cfg).close()
    for i in range(30):
        with shmkv.KVCache.attach(seg_name, prefault=bool(i % 2), recover=bool(i % 3)) as c:
            assert c.stats()["num_processes"] == 1
            sid = c.create_sequence()
            c.detach(sid)
    with shmkv.KVCache.attach(seg_name) as c:
        assert len(c.sequences()) == 30
        for s in c.sequences():
            c.free(s)
        assert_consistent(c)


@pytest.mark.parametrize("shape", [
    dict(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, num_blocks=40),
    dict(num_layers=3, num_kv_heads=1, head_dim=5, block_size=3, num_blocks=30),
    dict(num_layers=1, num_kv_heads=4, head_dim=32, block_size=16, num_blocks=8,
         dtype="float32"),
    dict(num_layers=4, num_kv_heads=3, head_dim=7, block_size=5, num_blocks=20,
         dtype="int8", max_seq_len=23),
])
def test_odd_shapes_round_trip(make_cache, shape):
    cache = make_cache(**shape)
    cfg = cache.config
    bs = cfg.block_size
    n = min(cfg.max_seq_len, 2 * bs + 1, cfg.num_blocks * bs // 2)
    k, v = tokens(cfg, n, 1)
    a = cache.create_sequence()
    cache.append(a, k[:, :1], v[:, :1])
    cache.append(a, k[:, 1:], v[:, 1:])
    b = cache.fork(a)
    k2, v2 = tokens(cfg, 2, 2)
    cache.append(b, k2, v2)
    slots = cache.reserve(a, 1)
    for layer in range(cfg.num_layers):
        cache.write(layer, slots, v2[layer, :1], k2[layer, :1])
    assert_same(cache.gather(a)[0], np.concatenate([k, v2[:, :1]], 1))
    assert_same(cache.gather(a)[1], np.concatenate([v, k2[:, :1]], 1))
    assert_same(cache.gather(b)[0], np.concatenate([k, k2], 1))
    assert_same(cache.gather(b, n - 1, n + 1)[1], np.concatenate([v[:, -1:], v2[:, :1]], 1))
    # b copied the shared partial block (if any); a was then its only holder
    assert cache.stats()["cow_copies"] == (1 if n % bs else 0)
    assert_consistent(cache)
