"""The benchmark floors' C hooks write what they claim, where they claim, and refuse bad input."""
import numpy as np
import pytest

from shmkv import _bench


def test_append_rows_floor_writes_the_rows_append_would(make_cache):
    cache = make_cache(num_layers=3, num_kv_heads=2, head_dim=8, num_blocks=8, block_size=4,
                       max_seqs=4, dtype="float16")
    cfg = cache.config
    sid = cache.create_sequence()
    slots = cache.reserve(sid, 6)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, 1, 2, 8)).astype(np.float16)
    v = rng.standard_normal((3, 1, 2, 8)).astype(np.float16)
    assert _bench.bench_append_rows(cache, k, v, slots[4:5], 3) > 0
    kk, vv = cache.gather(sid, 4, 5)
    np.testing.assert_array_equal(kk, k)
    np.testing.assert_array_equal(vv, v)
    kk, vv = cache.gather(sid, 0, 4)                  # the other slots are untouched
    assert not kk.any() and not vv.any()
    n = cfg.num_blocks * cfg.block_size
    for bad in ([], [-1], [n]):
        with pytest.raises(ValueError, match="slots"):
            _bench.bench_append_rows(cache, k, v, np.array(bad, np.int64), 1)
    with pytest.raises(ValueError, match="shape"):
        _bench.bench_append_rows(cache, k[:2], v[:2], slots, 1)
    with pytest.raises(TypeError, match="dtype"):
        _bench.bench_append_rows(cache, k.astype(np.float32), v, slots, 1)
    cache.free(sid)
    assert cache.check() == []
