"""shmkv._vcopy (the vLLM connector's block copy) without vLLM or torch: the transposed K
of a load and of a save against numpy's own transpose, on every transpose ISA this CPU
has (16x16 AVX-512 tiles, 8x8 AVX2 tiles, the portable loop), with head dims and block
sizes that leave partial tiles, on 64-byte aligned buffers (streamed stores) and not; the
tests in tests/vllm/ check the layout against vLLM."""
import numpy as np
import pytest

from shmkv._vcopy import _force_transpose_isa, copy_blocks, transpose_isa


@pytest.fixture(params=["portable", "avx2", "avx512"])
def isa(request):
    got = _force_transpose_isa(request.param)
    try:
        yield got
    finally:
        _force_transpose_isa(None)


def _arr(rng, shape, off):
    """A float32 array of random values starting `off` bytes past a 64-byte line: 0 takes
    the streamed (non-temporal) stores, 16 the plain ones."""
    n = int(np.prod(shape))
    raw = np.empty(n * 4 + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + off
    a = raw[start:start + n * 4].view(np.float32).reshape(shape)
    a[...] = rng.standard_normal(shape)
    return a


def _vllm_ref(t, kp, vp, shm, vblk, sub, bs, k_t):
    """What a load must leave in t: numpy indexing, one piece at a time."""
    out = t.copy()
    H, VB, D = t.shape[1], t.shape[2], t.shape[3] // 2
    for s, b, o in zip(shm, vblk, sub):
        for h in range(H):
            kk, vv = _halves(out, b, h)
            if k_t:
                kk.reshape(D, VB)[:, o * bs:(o + 1) * bs] = kp[s, :, h, :].T
            else:
                kk.reshape(VB, D)[o * bs:(o + 1) * bs] = kp[s, :, h, :]
            vv[o * bs:(o + 1) * bs] = vp[s, :, h, :]
    return out


def _halves(t, b, h):
    """The (block, head) tile of vLLM's [nb, H, VB, 2D] tensor is VB*2D elements: K first
    (flat: K^T [D, VB] or K [VB, D]), then V [VB, D] (views)."""
    VB, D = t.shape[2], t.shape[3] // 2
    flat = t[b, h].reshape(-1)
    return flat[:VB * D], flat[VB * D:].reshape(VB, D)


@pytest.mark.parametrize("off", [0, 16], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("D,bs,VB", [(64, 16, 128), (128, 128, 128), (40, 8, 24),
                                     (72, 24, 48), (16, 16, 16)])
def test_transposed_k_load_and_save_equal_numpy(isa, D, bs, VB, off):
    rng = np.random.default_rng(D * 1000 + bs)
    H, nb, pool = 3, 5, 12
    t = _arr(rng, (nb, H, VB, 2 * D), off)
    kp = _arr(rng, (pool, bs, H, D), off)
    vp = _arr(rng, (pool, bs, H, D), off)
    r = VB // bs
    m = min(nb * r, 7)
    pieces = rng.permutation(nb * r)[:m]
    shm = rng.permutation(pool)[:m].astype(np.int64)
    vblk, sub = (pieces // r).astype(np.int64), (pieces % r).astype(np.int64)
    want = _vllm_ref(t, kp, vp, shm, vblk, sub, bs, True)
    got = _arr(rng, t.shape, off)
    got[...] = t
    copy_blocks(got.ctypes.data, nb, kp.ctypes.data, vp.ctypes.data, pool, H, D, VB, bs, 4,
                shm, vblk, sub, True, True)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # save back from the loaded tensor into fresh pools: the same K/V as the source pools
    k2, v2 = _arr(rng, kp.shape, off), _arr(rng, vp.shape, off)
    copy_blocks(got.ctypes.data, nb, k2.ctypes.data, v2.ctypes.data, pool, H, D, VB, bs, 4,
                shm, vblk, sub, True, False)
    assert np.array_equal(k2[shm].view(np.uint32), kp[shm].view(np.uint32))
    assert np.array_equal(v2[shm], vp[shm])
    # and a save from a tensor nobody loaded: against numpy's transpose of that tensor
    k3, v3 = _arr(rng, kp.shape, off), _arr(rng, vp.shape, off)
    copy_blocks(t.ctypes.data, nb, k3.ctypes.data, v3.ctypes.data, pool, H, D, VB, bs, 4,
                shm, vblk, sub, True, False)
    for s, b, o in zip(shm, vblk, sub):
        for h in range(H):
            kk, vv = _halves(t, b, h)
            assert np.array_equal(k3[s, :, h, :], kk.reshape(D, VB)[:, o * bs:(o + 1) * bs].T)
            assert np.array_equal(v3[s, :, h, :], vv[o * bs:(o + 1) * bs])


def test_transpose_isa_names():
    assert transpose_isa() in ("portable", "avx2", "avx512")
    with pytest.raises(ValueError, match="expected one of"):
        _force_transpose_isa("sse9")
    assert _force_transpose_isa("portable") == "portable"
    _force_transpose_isa(None)
