"""The remote tier: a Redis Cluster this module starts and stops itself (on
free loopback ports, from Debian's redis-server), two segments standing for two hosts."""
import json
import os
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from support import unique_name, unlink_segment

import shmkv

# Outside `make test` (which installs both) a missing redis-py or redis-server skips this
# module; under CI (CI=true) it is a failure, never a silent skip.
if os.environ.get("CI"):
    import redis  # noqa: F401
else:
    redis = pytest.importorskip("redis")
from shmkv.tier.cluster import free_ports, redis_available  # noqa: E402

if os.environ.get("CI") and not redis_available():
    raise RuntimeError("CI: redis-server is missing (make redis installs it)")
pytestmark = pytest.mark.skipif(not redis_available(),
                                reason="redis-server missing (make redis installs it)")

CFG = dict(num_layers=4, num_kv_heads=2, head_dim=32, num_blocks=96, block_size=8,
           max_seqs=16)
SEED = 0x5EED


@pytest.fixture
def hosts(cluster):
    """make(**cfg) -> a KVCache on its own segment (a 'host'), tier not set; every
    segment closed and unlinked at teardown, the cluster emptied before."""
    cluster.flushall()
    made = []

    def make(seed=SEED, **kw):
        name = unique_name("tier")
        made.append(name)
        c = shmkv.KVCache.create(name, shmkv.CacheConfig(**{**CFG, **kw}), hash_seed=seed)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for x in reversed(made):
            if isinstance(x, str):
                unlink_segment(x)
            else:
                x.close()


def tier(cluster, **kw):
    kw.setdefault("timeout", 0.5)
    kw.setdefault("backoff", (0.2, 0.5))
    return shmkv.RedisTier(cluster.url, cluster=True, **kw)


def kv(cfg, n, seed=0):
    rng = np.random.default_rng(seed)
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    return (rng.standard_normal(shape).astype(np.float16),
            rng.standard_normal(shape).astype(np.float16))


def prefill(cache, toks, seed=0, salt=None):
    """A host computes a prompt: takes its hit, appends the rest with the token ids."""
    s = cache.create_sequence(tokens=toks, salt=salt)
    done = cache.seq_len(s)
    k, v = kv(cache.config, len(toks), seed)
    cache.append(s, k[:, done:], v[:, done:], tokens=toks[done:])
    return s, k, v


def tstats(cache):
    return {k: v for k, v in cache.stats().items() if k.startswith("tier_")}


def test_prefix_from_a_is_a_hit_on_b_with_equal_kv(hosts, cluster):
    a, b = hosts(), hosts()
    a.set_tier(tier(cluster))
    b.set_tier(tier(cluster))
    toks = np.arange(1000, 1000 + 61)                      # 7 full blocks + 5 tokens
    sa, k, v = prefill(a, toks)
    assert a.flush_tier(10) == 7
    st = tstats(a)
    assert st["tier_bytes_out"] > 7 * a.config.bytes_per_block
    assert b.match_prefix(toks) == 56                       # loaded and published on B
    sb = b.create_sequence(tokens=toks)
    assert b.seq_len(sb) == 56
    kb, vb = b.gather(sb)
    assert np.array_equal(kb, k[:, :56]) and np.array_equal(vb, v[:, :56])
    assert np.array_equal(b.token_ids(sb), toks[:56])
    st = tstats(b)
    assert st["tier_hits"] == 7 and st["tier_errors"] == 0
    assert st["tier_bytes_in"] >= 7 * b.config.bytes_per_block
    # the reserve/write/commit flow writes through too; a salt keeps tenants apart
    s2 = a.create_sequence(tokens=toks, salt="tenant")
    slots = a.reserve(s2, 32, tokens=toks[:32])
    for layer in range(a.config.num_layers):
        a.write(layer, slots, k[layer, :32], v[layer, :32])
    assert a.commit(s2) == 4
    assert a.flush_tier(10) == 11
    assert b.match_prefix(toks, salt="tenant") == 32        # its 4 committed blocks
    assert b.match_prefix(toks, salt="other") == 0
    for c in (a, b):
        c.free(sa if c is a else sb)
        assert c.check() == []


def test_create_sequence_loads_straight_into_the_new_sequence(hosts, cluster):
    a, b = hosts(), hosts()
    a.set_tier(tier(cluster))
    toks = np.arange(40)
    _, k, v = prefill(a, toks, seed=3)
    a.flush_tier(10)
    s0 = b.create_sequence(tokens=toks[:17])   # B computed the first 2 blocks itself
    b.append(s0, k[:, :17], v[:, :17], tokens=toks[:17])
    b.set_tier(tier(cluster))
    sb = b.create_sequence(tokens=toks)
    assert b.seq_len(sb) == 32
    kb, _ = b.gather(sb)
    assert np.array_equal(kb, k[:, :32])
    assert tstats(b)["tier_hits"] == 2         # blocks 2, 3 came from the tier
    # a third process of host B attaching the segment gets them locally
    c = shmkv.KVCache.attach(b.name)
    try:
        assert c.match_prefix(toks) == 32
    finally:
        c.close()


def test_other_layouts_do_not_share(hosts, cluster):
    a = hosts()
    b = hosts(seed=SEED + 1)                   # another seed: other hashes, other keys
    c = hosts(dtype="float32")                 # another dtype: another fingerprint
    for x in (a, b, c):
        x.set_tier(tier(cluster))
    toks = np.arange(33)
    prefill(a, toks)
    a.flush_tier(10)
    assert b.match_prefix(toks) == 0 and c.match_prefix(toks) == 0
    assert tstats(b)["tier_misses"] == 1 and tstats(b)["tier_hits"] == 0


def _put(cluster, key, value):
    rc = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    try:
        rc.set(key, value)
    finally:
        rc.close()


def _get(cluster, key):
    rc = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    try:
        return rc.get(key)
    finally:
        rc.close()


@pytest.mark.parametrize("damage", ["bitflip", "truncate", "foreign", "header", "tokens",
                                    "garbage"])
def test_corrupt_truncated_foreign_values_are_misses(hosts, cluster, damage):
    a, b = hosts(), hosts()
    ta, tb = tier(cluster), tier(cluster)
    a.set_tier(ta)
    b.set_tier(tb)
    toks = np.arange(500, 525)                           # 3 full blocks
    prefill(a, toks)
    assert a.flush_tier(10) == 3
    from shmkv.tier.codec import Layout

    lay = Layout(b._tier_layout(), b.config.numpy_dtype)
    keys = [k for k in _keys(cluster) if k.startswith(lay.prefix)]
    assert len(keys) == 3
    # the second block's key: the one whose value carries block index 1's token ids
    second = [k for k in keys if np.array_equal(
        np.frombuffer(_get(cluster, k), np.int32, 8, 64), toks[8:16])][0]
    val = bytearray(_get(cluster, second))
    if damage == "bitflip":
        val[len(val) // 2] ^= 0x10
    elif damage == "truncate":
        val = val[:len(val) - 100]
    elif damage == "foreign":
        val[16] ^= 1                                     # another layout's fingerprint
    elif damage == "header":
        val[40] ^= 1                                     # another block hash
    elif damage == "tokens":
        val[64] ^= 1                                     # token ids that do not match
    else:
        val = bytearray(os.urandom(len(val)))
    _put(cluster, second, bytes(val))
    sb = b.create_sequence(tokens=toks)
    assert b.seq_len(sb) == 8                            # block 0 only: a miss at block 1
    st = tstats(b)
    assert st["tier_hits"] == 1 and st["tier_misses"] == 1 and st["tier_errors"] == 0
    assert sum(tb.stats().get(w, 0) for w in
               ("size", "magic", "foreign", "hash", "tokens", "checksum")) == 1
    kb, _ = b.gather(sb)
    ka, _ = kv(a.config, 25)
    assert np.array_equal(kb, ka[:, :8])
    b.free(sb)
    assert b.check() == []


def _keys(cluster):
    out = []
    for p in cluster.ports:
        r = redis.Redis(host="127.0.0.1", port=p)
        try:
            out += r.keys("shmkv:*")
        finally:
            r.close()
    return out


def test_pool_full_on_b_while_loading_leaks_nothing(hosts, cluster):
    a = hosts(num_blocks=96)
    b = hosts(num_blocks=12, max_seqs=4)
    tb = tier(cluster)
    a.set_tier(tier(cluster))
    b.set_tier(tb)
    toks = np.arange(20 * 8 + 1)                         # 20 full blocks
    prefill(a, toks)
    assert a.flush_tier(10) == 20
    hold = b.create_sequence()
    k, v = kv(b.config, 5 * 8)
    b.append(hold, k, v)                                 # 5 of B's 12 blocks in use
    free0 = b.stats()["free_blocks"]
    sb = b.create_sequence(tokens=toks)                  # no exception: what fits
    got = b.seq_len(sb)
    assert 0 < got <= free0 * 8 and got % 8 == 0
    assert tb.stats()["pool_full"] >= 1
    assert b.check() == []
    assert b.match_prefix(toks) == got                   # match_prefix frees its temp
    assert b.check() == []
    b.free(sb)
    b.free(hold)
    assert b.stats()["used_blocks"] == 0 and b.check() == []


def test_a_master_killed_mid_transfer(hosts, cluster):
    a, b = hosts(num_blocks=400, max_seqs=8), hosts(num_blocks=400, max_seqs=8)
    a.set_tier(tier(cluster))
    b.set_tier(tier(cluster))
    toks = np.arange(10_000, 10_000 + 40 * 8 + 1)        # 40 blocks: all three masters
    killer = threading.Timer(0.002, cluster.kill, args=(1,))
    try:
        killer.start()
        sa, k, v = prefill(a, toks, seed=7)              # write-through under way
        a.flush_tier(10)                                 # returns; nothing raised
        for _ in range(3):                               # B while a master is gone
            sb = b.create_sequence(tokens=toks)
            n = b.seq_len(sb)
            if n:
                kb, vb = b.gather(sb)
                assert np.array_equal(kb, k[:, :n]) and np.array_equal(vb, v[:, :n])
            b.free(sb)
            assert b.match_prefix(toks) % 8 == 0
        assert a.check() == [] and b.check() == []
    finally:
        killer.join()
        cluster.restart(1)
    # back: a new prompt from A is a hit on B (the breaker retries within its back-off)
    toks2 = np.arange(50_000, 50_000 + 10 * 8 + 1)
    deadline = time.monotonic() + 20
    hit = 0
    while time.monotonic() < deadline and hit < 80:
        s2, k2, _ = prefill(a, toks2, seed=8)
        a.flush_tier(10)
        a.free(s2)
        a_fresh = toks2 + 0
        hit = b.match_prefix(a_fresh)
        if hit < 80:
            # what A wrote before its breaker closed again was dropped: write anew
            toks2 = toks2 + 1000
            time.sleep(0.2)
    assert hit == 80
    assert tstats(a)["tier_errors"] + tstats(b)["tier_errors"] >= 1
    sb = b.create_sequence(tokens=toks2)
    kb, _ = b.gather(sb)
    assert np.array_equal(kb, k2[:, :80])
    b.free(sb)
    a.free(sa)
    assert a.check() == [] and b.check() == []


def test_a_tier_that_is_down_never_raises(hosts):
    a = hosts()
    port = free_ports(1)[0]
    t = shmkv.RedisTier(f"redis://127.0.0.1:{port}", timeout=0.2, connect_timeout=0.1)
    a.set_tier(t)
    toks = np.arange(41)
    t0 = time.monotonic()
    s, _, _ = prefill(a, toks)
    assert a.match_prefix(toks) == 40
    assert a.flush_tier(5) == 0
    s2 = a.create_sequence(tokens=np.arange(900, 941))
    assert a.seq_len(s2) == 0
    assert time.monotonic() - t0 < 5
    assert tstats(a)["tier_errors"] >= 1
    a.free(s)
    a.free(s2)
    a.set_tier(None)
    assert a.check() == []


def test_set_tier_none_and_flush(hosts, cluster):
    a, b = hosts(), hosts()
    assert a.flush_tier() == 0                           # no tier: nothing to wait for
    t = tier(cluster)
    a.set_tier(t)
    b.set_tier(t)                                        # one tier object, two handles
    prefill(a, np.arange(17))
    assert a.flush_tier(10) == 2
    a.set_tier(None)
    assert a.flush_tier() == 0
    prefill(a, np.arange(100, 117))                      # not written through
    assert b.match_prefix(np.arange(100, 117)) == 0
    assert b.match_prefix(np.arange(17)) == 16
    out0 = tstats(a)["tier_bytes_out"]
    a.set_tier(t)
    prefill(a, np.arange(200, 217))
    a.close()                                            # close flushes and turns it off
    b.set_tier(None)
    assert out0 > 0


def test_read_only_and_write_only_handles(hosts, cluster):
    """set_tier(read=False): commits write through, lookups stay local (the vLLM worker's
    handle); set_tier(write=False): hits extend from the tier, nothing is written."""
    a, b = hosts(), hosts()
    t = tier(cluster)
    with pytest.raises(ValueError, match="both False"):
        a.set_tier(t, read=False, write=False)
    a.set_tier(t, read=False)
    toks = np.arange(500, 533)                           # 4 full blocks + 1
    prefill(a, toks)
    assert a.flush_tier(10) == 4                         # written through
    b.set_tier(t, read=False)
    assert b.match_prefix(toks) == 0                     # in the tier, but B only writes
    sb = b.create_sequence(tokens=toks)
    assert b.seq_len(sb) == 0
    b.free(sb)
    assert tstats(b)["tier_hits"] == tstats(b)["tier_misses"] == 0
    b.set_tier(t, write=False)
    assert b.match_prefix(toks) == 32                    # now it reads
    assert tstats(b)["tier_hits"] == 4
    own = np.arange(900, 917)
    prefill(b, own)
    assert b.flush_tier(10) == 0                         # and writes nothing
    assert tstats(b)["tier_bytes_out"] == 0
    assert len(_keys(cluster)) == 4
    a.set_tier(None)
    b.set_tier(None)


def test_counters_in_info_and_metrics(hosts, cluster):
    a, b = hosts(), hosts()
    a.set_tier(tier(cluster))
    b.set_tier(tier(cluster))
    prefill(a, np.arange(33))
    a.flush_tier(10)
    b.match_prefix(np.arange(33))
    exe = os.path.join(os.path.dirname(sys.executable), "shmkv")
    info = json.loads(subprocess.run([exe, "info", b.name, "--json"], capture_output=True,
                                     check=True, timeout=60).stdout)
    assert info["counters"]["tier_hits"] == 4
    text = subprocess.run([exe, "metrics", b.name], capture_output=True, check=True,
                          timeout=60).stdout.decode()
    assert f'shmkv_tier_hits_total{{segment="{b.name.lstrip("/")}"}} 4' in text
    assert "shmkv_tier_bytes_out_total" in text and "shmkv_tier_errors_total" in text


def test_import_shmkv_does_not_import_redis():
    code = ("import sys, shmkv; assert 'redis' not in sys.modules, 'redis imported'; "
            "T = shmkv.RedisTier; assert 'redis' not in sys.modules, 'redis imported'; "
            "print(T.__name__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd="/",
                       timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.strip() == b"RedisTier"


def test_hash_seed(seg_name):
    cfg = shmkv.CacheConfig(**CFG)
    with pytest.raises(ValueError, match="hash_seed"):
        shmkv.KVCache.create(seg_name, cfg, hash_seed=-1)
    c = shmkv.KVCache.create(seg_name, cfg, hash_seed=SEED)
    try:
        assert c._tier_layout()["hash_seed"] == SEED
    finally:
        c.close()
        c.unlink()
    name = unique_name("seed")
    os.environ["SHMKV_HASH_SEED"] = "0x1234"
    try:
        c = shmkv.KVCache.create(name, cfg)
        assert c._tier_layout()["hash_seed"] == 0x1234
        c.close()
    finally:
        del os.environ["SHMKV_HASH_SEED"]
        unlink_segment(name)


def test_the_tier_port_is_all_the_tier_does_to_the_cache(seg_name):
    """set_tier hands the tier one TierPort (pin, count, hashes, layout); it holds the cache
    weakly, and the tier's sources reach nothing private of a cache but through it."""
    import ast
    import gc

    import shmkv.tier
    from shmkv._prefix import TierPort

    c = shmkv.KVCache.create(seg_name, shmkv.CacheConfig(**CFG), hash_seed=SEED)
    try:
        port = TierPort(c)
        assert port.layout() == c._tier_layout() and port.layout()["hash_seed"] == SEED
        toks = np.arange(3 * CFG["block_size"] + 1, dtype=np.int32)
        assert (port.hashes(toks, "s") == c._tier_hashes(toks, "s")).all()
        sid, n = port.pin(np.ascontiguousarray(port.hashes(toks, "s")))
        assert sid >= 0 and n == 0                      # nothing published: nothing taken
        c.free(sid)
        before = c.stats()["tier_hits"]
        port.count(hits=2, bytes_in=10)
        assert c.stats()["tier_hits"] == before + 2 and c.stats()["tier_bytes_in"] >= 10
    finally:
        c.close()
        c.unlink()
    del c
    gc.collect()
    with pytest.raises(ValueError, match="gone"):
        port.layout()
    root = os.path.dirname(shmkv.tier.__file__)
    private = []
    for f in sorted(os.listdir(root)):
        if not f.endswith(".py"):
            continue
        with open(os.path.join(root, f), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_tier_")
                    or isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in ("cache", "target", "kv")
                    and node.attr.startswith("_")):
                private.append(f"{f}:{node.lineno}: .{node.attr}")
    assert not private, private


def test_checksum_and_codec_reject_everything_but_the_value():
    from shmkv._checksum import tier_checksum
    from shmkv.tier.codec import Layout

    assert tier_checksum(b"") != tier_checksum(b"\0")
    data = bytearray(os.urandom(100_003))
    h = tier_checksum(data)
    for i in (0, 31, 32, 50_000, 100_002):
        data[i] ^= 4
        assert tier_checksum(data) != h
        data[i] ^= 4
    assert tier_checksum(data) == h
    info = dict(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype=1,
                itemsize=2, hash_algo=1, hash_seed=9)
    lay = Layout(info, np.float16)
    buf = bytearray(lay.size)
    toks, k, v = lay.views(buf)
    toks[:] = [7, 8]
    k[:] = 1
    v[:] = 2
    lay.seal(buf, 5, 6)
    assert lay.check(buf, 5, 6, np.array([7, 8], np.int32)) is None
    assert lay.check(buf, 5, 7, None) == "hash"
    assert lay.check(buf, 5, 6, np.array([7, 9], np.int32)) == "tokens"
    assert lay.check(buf[:-1], 5, 6, None) == "size"
    other = Layout({**info, "hash_seed": 10}, np.float16)
    assert other.check(buf, 5, 6, None) == "foreign"
    assert lay.key(5, 6) != other.key(5, 6)
    struct.pack_into("<I", buf, 8, 2)
    assert lay.check(buf, 5, 6, None) == "magic"


def test_maxmemory_reached_is_counted_then_recovers(hosts, cluster):
    a, b = hosts(), hosts()
    a.set_tier(tier(cluster))
    b.set_tier(tier(cluster))
    rs = [redis.Redis(host="127.0.0.1", port=p) for p in cluster.ports]
    try:
        for r in rs:
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", "1")            # every write refused: -OOM
        prefill(a, np.arange(3000, 3033))
        a.flush_tier(10)                               # no exception; counted
        assert tstats(a)["tier_errors"] >= 1
        assert b.match_prefix(np.arange(3000, 3033)) == 0
    finally:
        for r in rs:
            r.config_set("maxmemory", "0")
            r.close()
    time.sleep(0.6)                                    # past the breaker's back-off
    deadline = time.monotonic() + 10
    base = 4000
    while time.monotonic() < deadline:
        toks = np.arange(base, base + 33)
        prefill(a, toks)
        a.flush_tier(10)
        if b.match_prefix(toks) == 32:
            break
        base += 100
        time.sleep(0.2)
    assert b.match_prefix(toks) == 32
    assert a.check() == [] and b.check() == []


def test_slots_moved_under_a_reader_then_hits_again(hosts, cluster):
    a, b = hosts(), hosts()
    a.set_tier(tier(cluster))
    b_tier = tier(cluster)
    b.set_tier(b_tier)
    warm = np.arange(7000, 7017)
    prefill(a, warm)
    a.flush_tier(10)
    assert b.match_prefix(warm) == 16            # B's reader knows the topology now
    toks = np.arange(8000, 8000 + 12 * 8 + 1)
    _, k, _ = prefill(a, toks, seed=5)
    a.flush_tier(10)
    ids = [subprocess.run(["redis-cli", "-p", str(p), "cluster", "myid"], capture_output=True,
                          text=True, timeout=10).stdout.strip() for p in cluster.ports[:2]]
    # every slot of master 0 moves to master 1 (its keys with them): B's map is stale
    subprocess.run(["redis-cli", "--cluster", "reshard", f"127.0.0.1:{cluster.ports[0]}",
                    "--cluster-from", ids[0], "--cluster-to", ids[1], "--cluster-slots",
                    "5461", "--cluster-yes"], check=True, capture_output=True, timeout=120)
    cluster.wait_ok()
    errors = tstats(b)["tier_errors"]
    retried = b_tier.stats().get("retried", 0)
    # MOVED: B's map is read anew and the window asked again, at once -- no miss, no
    # back-off (before, the lookup ended there and the breaker kept B local-only)
    assert b.match_prefix(toks) == 96
    assert b_tier.stats().get("retried", 0) == retried + 1
    assert tstats(b)["tier_errors"] == errors
    sb = b.create_sequence(tokens=toks)
    kb, _ = b.gather(sb)
    assert np.array_equal(kb, k[:, :96])
    b.free(sb)
    assert b.check() == []


def test_a_corrupt_value_while_the_next_window_is_in_flight(hosts, cluster):
    a, b = hosts(), hosts()
    a.set_tier(tier(cluster))
    b.set_tier(tier(cluster))
    toks = np.arange(20_000, 20_000 + 20 * 8 + 1)          # 20 blocks: windows 4, 8, 8
    _, k, _ = prefill(a, toks, seed=9)
    assert a.flush_tier(10) == 20
    from shmkv.tier.codec import Layout

    lay = Layout(b._tier_layout(), b.config.numpy_dtype)
    h = b._tier_hashes(toks)
    key = lay.key(int(h[6, 0]), int(h[6, 1]))             # block 6: in the second window
    val = bytearray(_get(cluster, key))
    val[-1] ^= 0xFF
    _put(cluster, key, bytes(val))
    sb = b.create_sequence(tokens=toks)
    assert b.seq_len(sb) == 48
    kb, _ = b.gather(sb)
    assert np.array_equal(kb, k[:, :48])
    st = tstats(b)
    assert st["tier_hits"] == 6 and st["tier_misses"] == 1 and st["tier_errors"] == 0
    # the replies asked ahead were drained: the connection answers the next request right
    toks2 = np.arange(30_000, 30_000 + 9 * 8 + 1)
    prefill(a, toks2, seed=10)
    a.flush_tier(10)
    assert b.match_prefix(toks2) == 72
    b.free(sb)
    assert b.check() == []


def _tables(cache, k_scale, v_scale):
    for layer in range(cache.config.num_layers):
        cache.set_kv_scales(layer, np.asarray(k_scale) * (layer + 1), v_scale)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3"])
def test_quantized_blocks_land_on_b_with_the_codes_and_scales_a_has(hosts, cluster, dtype):
    """An int8 value carries every layer's K and V scale rows, a float8 pool's scale
    table is in the layout: host B lands exactly A's codes and scales."""
    a, b = hosts(dtype=dtype), hosts(dtype=dtype)
    a.set_tier(tier(cluster))
    tb = tier(cluster)
    b.set_tier(tb)
    if dtype == "float8_e4m3":           # after set_tier: the keys follow the table
        for c in (a, b):
            _tables(c, [0.37, 2.5], [1.5, 0.011])
    toks = np.arange(3000, 3025)                            # 3 full blocks + 1 token
    sa, k, v = prefill(a, toks)
    assert a.flush_tier(10) == 3
    bs = a.config.block_size
    assert tstats(a)["tier_bytes_out"] == 3 * (64 + 4 * bs + a.config.bytes_per_block)
    assert b.match_prefix(toks) == 24
    sb = b.create_sequence(tokens=toks)
    assert b.seq_len(sb) == 24 and tstats(b)["tier_hits"] == 3
    ra, rb = a.gather(sa, 0, 24, raw=True), b.gather(sb, raw=True)
    for x, y in zip(ra, rb):
        assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8))
    ta, tbl = a.block_table(sa)[:3], b.block_table(sb)
    for layer in range(a.config.num_layers):
        assert np.array_equal(a.key_cache(layer)[ta].view(np.uint8),
                              b.key_cache(layer)[tbl].view(np.uint8))
        if dtype == "int8":
            for f in ("key_scales", "value_scales"):
                assert np.array_equal(getattr(a, f)(layer)[ta].view(np.uint32),
                                      getattr(b, f)(layer)[tbl].view(np.uint32))
    assert np.array_equal(a.gather(sa, 0, 24)[0], b.gather(sb)[0])
    assert tstats(b)["tier_misses"] == 0 and tb.stats().get("nonfinite", 0) == 0
    for c, s in ((a, sa), (b, sb)):
        c.free(s)
        assert c.check() == []


def test_float8_hosts_with_other_scale_tables_do_not_share(hosts, cluster):
    a, b = hosts(dtype="float8_e4m3"), hosts(dtype="float8_e4m3")
    _tables(a, 0.5, 2.0)
    _tables(b, 0.5, 2.0)
    b.set_kv_scales(1, [0.5, 0.25], 2.0)                    # one head of one layer differs
    a.set_tier(tier(cluster))
    b.set_tier(tier(cluster))
    toks = np.arange(77, 77 + 17)
    prefill(a, toks)
    assert a.flush_tier(10) == 2
    assert b.match_prefix(toks) == 0
    st = tstats(b)
    assert st["tier_hits"] == 0 and st["tier_misses"] == 1
    b.set_kv_scales(1, 1.0, 2.0)                            # now the same table: a hit
    assert b.match_prefix(toks) == 16 and tstats(b)["tier_hits"] == 2
    assert b.check() == []


@pytest.mark.parametrize("damage", ["scale_byte", "nan_scale"])
def test_a_bad_scale_in_an_int8_value_is_a_miss(hosts, cluster, damage):
    """A flipped scale byte fails the checksum; a NaN scale under a valid checksum (a
    hostile writer) is refused by append: both a counted miss, nothing lands."""
    from shmkv._prefix import TierPort
    from shmkv.tier.codec import HEADER, Layout

    a, b = hosts(dtype="int8"), hosts(dtype="int8")
    a.set_tier(tier(cluster))
    tb = tier(cluster)
    b.set_tier(tb)
    toks = np.arange(900, 917)                              # 2 full blocks
    prefill(a, toks)
    assert a.flush_tier(10) == 2
    lay = Layout.of(b, TierPort(b))
    assert lay.sc_bytes and lay.size == HEADER + 4 * lay.block_size + b.config.bytes_per_block
    h = b._tier_hashes(toks)
    key = lay.key(int(h[1, 0]), int(h[1, 1]))               # the second block
    val = bytearray(_get(cluster, key))
    assert len(val) == lay.size
    off = HEADER + lay.tok_bytes + 2 * lay.kv_bytes         # the K scales
    if damage == "scale_byte":
        val[off + lay.sc_bytes + 5] ^= 0x01                 # a V scale's low bit
        why = "checksum"
    else:
        lay.scale_views(val)[0][1, 2, 0] = np.nan
        lay.seal(val, int(h[1, 0]), int(h[1, 1]))
        assert lay.check(val, int(h[1, 0]), int(h[1, 1]), toks[8:16]) is None
        why = "nonfinite"
    _put(cluster, key, bytes(val))
    sb = b.create_sequence(tokens=toks)
    assert b.seq_len(sb) == 8                               # block 0 only
    st = tstats(b)
    assert st["tier_hits"] == 1 and st["tier_misses"] == 1 and st["tier_errors"] == 0
    assert tb.stats().get(why) == 1
    assert np.isfinite(b.gather(sb)[1]).all()
    b.free(sb)
    assert b.check() == []


# ------------------------------------------------- failover, and a lookup's deadline
@pytest.fixture
def replicated():
    """A cluster of 3 masters with a replica each (for one test: it loses a master)."""
    from shmkv.tier.cluster import LocalCluster

    c = LocalCluster(free_ports(3), replicas=1)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def test_after_a_failover_idle_hosts_write_and_read_at_once(hosts, replicated):
    """A master is SIGKILLed while both hosts are idle, their connections still open to
    it; once its replica took over, host A's next new prompt is stored whole on the first
    try and host B reads it whole on its first lookup.  (Before: A's first write after
    the failover met the dead connection and the shared breaker dropped it -- 0 of its
    blocks stored -- and B's first lookup failed the same way.)"""
    a, b = hosts(num_blocks=400, max_seqs=8), hosts(num_blocks=400, max_seqs=8)
    ta, tb = tier(replicated), tier(replicated)
    a.set_tier(ta)
    b.set_tier(tb)
    warm = np.arange(3000, 3000 + 24 * 8 + 1)           # 24 blocks: every master
    sa, _, _ = prefill(a, warm)
    a.flush_tier(10)
    a.free(sa)
    assert b.match_prefix(warm) == 24 * 8                # B has a socket to each master
    replicated.kill(0)
    replicated.wait_failover(0)
    toks = np.arange(60_000, 60_000 + 40 * 8 + 1)
    written = ta.stats().get("written", 0)
    sa, k, v = prefill(a, toks, seed=3)
    a.flush_tier(20)
    a.free(sa)
    assert ta.stats().get("written", 0) - written == 40, ta.stats()
    assert ta.stats().get("dropped", 0) == 0, ta.stats()
    sb = b.create_sequence(tokens=toks)
    assert b.seq_len(sb) == 40 * 8, tb.stats()
    kb, vb = b.gather(sb)
    assert np.array_equal(kb, k[:, :320]) and np.array_equal(vb, v[:, :320])
    b.free(sb)
    assert ta.stats().get("retried", 0) + tb.stats().get("retried", 0) >= 1
    assert a.check() == [] and b.check() == []


def test_a_lookup_over_a_slow_link_ends_at_its_deadline(hosts, cluster):
    """B reaches the tier through a link that adds 0.3 s each way (a delaying proxy in
    front of one Redis server): a lookup of 64 blocks takes 5 round trips (windows of 4,
    8, 16, 16, 16), 3 s; with a deadline of 0.5 s it stops after the first window, its 4
    blocks landed (the rest is the caller's to compute) and counted."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tools"))
    from delay_proxy import DelayProxy

    a, b = hosts(num_blocks=200), hosts(num_blocks=200)
    # one plain server of the test's own (a cluster node would answer MOVED for keys of
    # the other nodes, past the proxy)
    srv_port = free_ports(1)[0]
    proc = subprocess.Popen(["redis-server", "--port", str(srv_port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"], cwd="/tmp",
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_port(srv_port, proc)
        a.set_tier(shmkv.RedisTier(f"redis://127.0.0.1:{srv_port}", cluster=False))
        toks = np.arange(90_000, 90_000 + 64 * 8 + 1)
        sa, k, _ = prefill(a, toks, seed=4)
        assert a.flush_tier(20) == 64
        a.free(sa)
        with DelayProxy(("127.0.0.1", srv_port), delay=0.3) as proxy:
            slow = shmkv.RedisTier(f"redis://127.0.0.1:{proxy.port}", cluster=False,
                                   timeout=5.0, deadline=0.5)
            b.set_tier(slow)
            t0 = time.monotonic()
            sb = b.create_sequence(tokens=toks)
            took = time.monotonic() - t0
            assert b.seq_len(sb) == 4 * 8, slow.stats()
            assert slow.stats().get("deadline") == 1, slow.stats()
            assert took < 2.0, f"the lookup took {took:.1f} s past its 0.5 s deadline"
            kb, _ = b.gather(sb)
            assert np.array_equal(kb, k[:, :32])
            b.free(sb)
            # the same link, a deadline past every window: all 64 blocks come
            b.set_tier(shmkv.RedisTier(f"redis://127.0.0.1:{proxy.port}", cluster=False,
                                       timeout=5.0, deadline=30.0))
            assert b.match_prefix(toks) == 64 * 8
        assert b.check() == []
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _wait_port(port, proc, timeout=10.0):
    import socket

    t0 = time.monotonic()
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() - t0 < timeout, "redis-server"
        time.sleep(0.05)


@pytest.mark.parametrize("kw, match", [
    ({"deadline": 0}, "deadline: expected > 0"),
    ({"deadline": -1.0}, "deadline: expected > 0"),
    ({"timeout": 0}, "expected > 0"),
    ({"connect_timeout": -0.1}, "expected > 0"),
    ({"max_window": 0}, "expected >= 1"),
])
def test_bad_tier_arguments_are_value_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        shmkv.RedisTier("redis://127.0.0.1:7000", **kw)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:7000", "redis://", "redis://127.0.0.1:7000,", "redis://h1:1,:2",
    "redis://h1:1,h2:99999", "redis://h1:1,h2:port",
])
def test_malformed_seed_urls_are_value_errors_naming_the_url(url):
    with pytest.raises(ValueError, match="expected redis://host:port"):
        shmkv.RedisTier(url)
