"""Big appends and gathers (>= 8 MiB per K or V array) copy with streaming stores: the
bytes must be exactly those of the ordinary path, whatever the alignment of the caller's
arrays and of the token range."""
import numpy as np
import pytest

# 4 layers x 8 heads x 128 dims fp16: 8 KiB per token per array, 8 MiB = 1024 tokens
BIG = dict(num_layers=4, num_kv_heads=8, head_dim=128, num_blocks=160, block_size=16,
           max_seqs=8)
STREAM_TOKENS = 1024


def _at_offset(shape, dtype, offset):
    """A C-contiguous array whose data starts `offset` bytes past a 64-byte boundary."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + 128, np.uint8)
    start = (64 - raw.ctypes.data % 64) % 64 + offset
    return raw[start:start + n].view(dtype).reshape(shape)


@pytest.fixture
def big(make_cache):
    return make_cache(**BIG)


@pytest.mark.parametrize("offset", [0, 2, 16, 46])
def test_streaming_append_and_gather_are_exact(big, offset):
    cfg = big.config
    rng = np.random.default_rng(offset)
    n = STREAM_TOKENS + 37                      # whole blocks and a partial one
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    k = _at_offset(shape, np.float16, offset)
    v = _at_offset(shape, np.float16, offset)
    k[...] = rng.standard_normal(shape).astype(np.float16)
    v[...] = rng.standard_normal(shape).astype(np.float16)
    sid = big.create_sequence()
    big.append(sid, k[:, :5], v[:, :5])          # start the big copy mid-block
    big.append(sid, k[:, 5:], v[:, 5:])
    ko = _at_offset(shape, np.float16, offset)
    vo = _at_offset(shape, np.float16, offset)
    big.gather(sid, out=(ko, vo))
    assert ko.tobytes() == k.tobytes() and vo.tobytes() == v.tobytes()
    kf, vf = big.gather(sid)                     # fresh arrays
    assert kf.tobytes() == k.tobytes() and vf.tobytes() == v.tobytes()
    # a sub-range starting and ending inside blocks, just over the streaming size
    a, b = 3, 3 + STREAM_TOKENS + 5
    kr, vr = big.gather(sid, a, b)
    assert kr.tobytes() == np.ascontiguousarray(k[:, a:b]).tobytes()
    assert vr.tobytes() == np.ascontiguousarray(v[:, a:b]).tobytes()
    # the ordinary path agrees on a small range
    ks, _ = big.gather(sid, 100, 140)
    assert ks.tobytes() == np.ascontiguousarray(k[:, 100:140]).tobytes()
    big.free(sid)
    assert big.check() == []


def test_streaming_copy_of_a_fork_stays_copy_on_write(big):
    cfg = big.config
    n = STREAM_TOKENS + 3
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    k = np.full(shape, 1, np.float16)
    a = big.create_sequence()
    big.append(a, k, k)
    b = big.fork(a)
    k2 = np.full(shape, 2, np.float16)
    big.append(b, k2, k2)                        # b's partial last block is copied first
    ka, _ = big.gather(a)
    kb, _ = big.gather(b)
    assert (ka == 1).all() and ka.shape[1] == n
    assert (kb[:, :n] == 1).all() and (kb[:, n:] == 2).all()
    big.free(a)
    big.free(b)
    assert big.check() == [] and big.stats()["used_blocks"] == 0
