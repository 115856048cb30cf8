import numpy as np

import shmkv


def test_append_gather_roundtrip(cache):
    cfg = cache.config
    sid = cache.create_sequence()
    k = np.random.default_rng(0).standard_normal(
        (cfg.num_layers, 7, cfg.num_kv_heads, cfg.head_dim)).astype(np.float16)
    cache.append(sid, k, -k)
    gk, gv = cache.gather(sid)
    np.testing.assert_array_equal(gk, k)
    np.testing.assert_array_equal(gv, -k)
    cache.free(sid)
    assert cache.check() == []
    assert cache.stats()["free_blocks"] == cfg.num_blocks


def test_attach_roundtrips_config(cache):
    with shmkv.KVCache.attach(cache.name) as other:
        assert other.config == cache.config
