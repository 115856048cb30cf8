"""Quantized pools: int8 with a float32 scale per token and kv head, float8
e4m3fn with a float32 scale per layer and kv head.  Round-trip bounds, the codec against
ml_dtypes, every write path, attention within the quantization's error of the float64
reference on the unquantized data (every ISA), copy-on-write and prefix hits carrying the
scales, bad input changing nothing, hostile scales never crashing."""
import math

import ml_dtypes
import numpy as np
import pytest
from workers.mp_workers import exact_quantized

import shmkv
from shmkv import _quant

QDTYPES = ["int8", "float8_e4m3"]
E4M3 = ml_dtypes.float8_e4m3fn


QISAS = ["scalar", "avx2", "avx512"]


def cpu_quant_isas():
    """The quantizer paths this CPU runs (the portable one always)."""
    try:
        best = _quant._force_quant_isa(None)
    finally:
        _quant._force_quant_isa(None)
    return QISAS[:QISAS.index(best) + 1]


@pytest.fixture(params=QISAS)
def qisa(request):
    """The quantizers' three paths (portable C, AVX2 + F16C, AVX-512), forced in turn."""
    try:
        _quant._force_quant_isa(request.param)
    except ValueError:
        pytest.skip(f"this CPU does not run the {request.param} quantizer")
    try:
        yield request.param
    finally:
        _quant._force_quant_isa(None)


def kv(cfg, n, rng, spread=True):
    """K/V with very different magnitudes per (token, head) row, like real activations
    (outlier channels, heads of different scale)."""
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    mag = np.exp(rng.uniform(-3, 3, shape[:-1] + (1,))) if spread else 1.0
    k = (rng.standard_normal(shape) * mag).astype(np.float32)
    v = (rng.standard_normal(shape) * mag).astype(np.float32)
    return k, v


def footprint(cache, sids):
    """Everything a failed call must leave as it was."""
    st = cache.stats()
    data = [tuple(x.tobytes() for x in cache.gather(s, raw=True)) for s in sids
            if cache.seq_len(s)]
    return ([cache.seq_len(s) for s in sids], st["free_blocks"], st["allocations"], data,
            [cache.key_cache(layer).tobytes() for layer in range(cache.config.num_layers)])


# ---- configuration ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", QDTYPES)
def test_config_round_trip_and_sizes(make_cache, dtype):
    cache = make_cache(dtype=dtype)
    cfg = cache.config
    assert cfg.quantized and cfg.compute_dtype == np.float32 and cfg.itemsize == 1
    assert cfg.numpy_dtype == (np.int8 if dtype == "int8" else E4M3)
    per_head = cfg.head_dim + (4 if dtype == "int8" else 0)
    assert cfg.bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * per_head
    with shmkv.KVCache.attach(cache.name) as other:
        assert other.config == cfg
    lay = shmkv._core.layout_of(cfg)
    if dtype == "int8":
        assert lay["scale_bytes"] == 4 * cfg.num_kv_heads and lay["off_kscale"] > lay["off_vpool"]
        assert lay["off_hscale"] == 0
    else:
        assert lay["off_kscale"] == 0 and lay["off_hscale"] > lay["off_vpool"]
    assert not shmkv.CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4,
                                 num_blocks=4).quantized


# ---- round trips --------------------------------------------------------------------------
def test_int8_round_trip_bound(make_cache, qisa):
    """|x - deq(q(x))| <= s / 2 per element, s = max|x| / 127 of its (token, head) row;
    gather == codes * scales; the raw view and the scale view hold the same."""
    cache = make_cache(dtype="int8", head_dim=64)
    cfg = cache.config
    rng = np.random.default_rng(0)
    k, v = kv(cfg, 37, rng)
    k[0, 3, 1] = 0.0                                  # a row of zeros: scale 0, exact
    sid = cache.create_sequence()
    cache.append(sid, k[:, :20], v[:, :20])
    cache.append(sid, k[:, 20:], v[:, 20:])
    gk, gv = cache.gather(sid)
    assert gk.dtype == np.float32
    for x, g in ((k, gk), (v, gv)):
        s = np.abs(x).max(-1, keepdims=True) / 127
        assert (np.abs(x - g) <= s / 2 * (1 + 1e-5) + 1e-30).all()
    assert (gk[0, 3, 1] == 0).all()
    qk, qv, sk, sv = cache.gather(sid, raw=True)
    assert qk.dtype == np.int8 and sk.dtype == np.float32 and sk.shape == k.shape[:-1]
    assert np.array_equal(qk.astype(np.float32) * sk[..., None], gk)
    assert np.abs(qk).max() == 127
    table = cache.block_table(sid)
    bs = cfg.block_size
    for layer in range(cfg.num_layers):
        codes = cache.key_cache(layer)[table].reshape(-1, cfg.num_kv_heads, cfg.head_dim)[:37]
        scales = cache.key_scales(layer)[table].reshape(-1, cfg.num_kv_heads)[:37]
        assert np.array_equal(codes, qk[layer]) and np.array_equal(scales, sk[layer])
        assert np.shares_memory(cache.key_scales(layer), cache.key_scales(layer))
    assert cache.value_scales(0).shape == (cfg.num_blocks, bs, cfg.num_kv_heads)
    assert cache.check() == []


def test_e4m3_codec_matches_ml_dtypes(make_cache, qisa):
    """Codes equal ml_dtypes' float8_e4m3fn cast (round to nearest even) over the whole
    range, subnormals and ties included; beyond +-448 they saturate."""
    cache = make_cache(dtype="float8_e4m3", num_layers=1, num_kv_heads=1, head_dim=16,
                       num_blocks=2048, block_size=16)
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    vals = codes.view(E4M3).astype(np.float32)
    mids = (vals[:-1].astype(np.float64) + vals[1:]) / 2      # ties (within a sign)
    rng = np.random.default_rng(3)
    x = np.concatenate([vals, mids.astype(np.float32), rng.uniform(-448, 448, 4000),
                        rng.standard_normal(4000) * 1e-2, [447.9, -447.99, 1e-9, -0.0]])
    x = x[np.abs(x) < 448].astype(np.float32)
    x = np.concatenate([x, np.zeros((-len(x)) % 16, np.float32)])
    sid = cache.create_sequence()
    n = len(x) // 16
    cache.append(sid, x.reshape(1, n, 1, 16), x.reshape(1, n, 1, 16))
    qk = cache.gather(sid, raw=True)[0].reshape(-1)
    want = x.astype(E4M3)
    assert np.array_equal(qk.view(np.uint8), want.view(np.uint8))
    # saturation
    s2 = cache.create_sequence()
    big = np.array([448, 449, 464, 500, 1e6, 3e38, -449, -1e9] * 2, np.float32)
    cache.append(s2, big.reshape(1, 1, 1, 16), big.reshape(1, 1, 1, 16))
    assert np.array_equal(cache.gather(s2)[0].reshape(-1), np.clip(big, -448, 448))


def test_e4m3_round_trip_bound_with_scales(make_cache, qisa):
    """relative error <= 2^-4 where |x / s| >= 2^-6, absolute <= s 2^-10 below; the per-
    (layer, head) scales of set_kv_scales divide on the way in, multiply on the way out."""
    cache = make_cache(dtype="float8_e4m3", head_dim=32)
    cfg = cache.config
    assert [a.tolist() for a in cache.kv_scales(0)] == [[1.0, 1.0], [1.0, 1.0]]
    ks = np.array([0.5, 4.0])
    cache.set_kv_scales(0, ks, 0.25)
    cache.set_kv_scales(1, 2.0, [1.0, 8.0])
    scales = np.array([[[0.5, 4.0], [0.25, 0.25]], [[2.0, 2.0], [1.0, 8.0]]])  # [L][k/v][h]
    assert np.array_equal(cache.key_scales(0), [0.5, 4.0])
    with shmkv.KVCache.attach(cache.name) as other:        # in the segment: every process
        assert np.array_equal(other.kv_scales(1)[1], [1.0, 8.0])
    rng = np.random.default_rng(1)
    k, v = kv(cfg, 40, rng)
    sid = cache.create_sequence()
    cache.append(sid, k, v)
    gk, gv = cache.gather(sid)
    for i, (x, g) in enumerate(((k, gk), (v, gv))):
        s = scales[:, i][:, None, :, None]                   # [L, 1, heads, 1]
        y = np.clip(x / s, -448, 448) * s
        normal = np.abs(x / s) >= 2.0 ** -6
        err = np.abs(g - y)
        assert (err[normal] <= np.abs(y[normal]) * 2.0 ** -4 + 1e-30).all()
        assert (err[~normal] <= (s * 2.0 ** -10 * np.ones_like(x))[~normal] * 1.0001).all()
    _, _, rks, rvs = cache.gather(sid, raw=True)
    assert np.array_equal(rks, scales[:, 0]) and np.array_equal(rvs, scales[:, 1])


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("src", ["float32", "float16", "bfloat16"])
def test_write_paths_agree(make_cache, qisa, dtype, src):
    """append, reserve + write (one layer at a time) and float16/bfloat16 input give the
    same codes and scales as float32 append of the same values."""
    cache = make_cache(dtype=dtype)
    cfg = cache.config
    rng = np.random.default_rng(2)
    k, v = kv(cfg, 9, rng)
    dt = np.dtype(ml_dtypes.bfloat16) if src == "bfloat16" else np.dtype(src)
    k, v = k.astype(dt), v.astype(dt)
    a = cache.create_sequence()
    cache.append(a, k, v)
    b = cache.create_sequence()
    slots = cache.reserve(b, 9)
    for layer in range(cfg.num_layers):
        cache.write(layer, slots, k[layer], v[layer])
    c = cache.create_sequence()
    cache.append(c, k.astype(np.float32), v.astype(np.float32))
    ra, rb, rc = (cache.gather(s, raw=True) for s in (a, b, c))
    for x, y, z in zip(ra, rb, rc):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
        assert np.array_equal(x.view(np.uint8), z.view(np.uint8))
    assert cache.check() == []


@pytest.mark.parametrize("dtype", QDTYPES)
def test_gather_out_and_buffers(make_cache, dtype):
    cache = make_cache(dtype=dtype)
    cfg = cache.config
    k, v = exact_quantized(cfg, np.random.default_rng(4), (2, 7, 2, 8)), None
    v = -k
    sid = cache.create_sequence()
    cache.append(sid, k, v)
    ko, vo = cache.gather_buffers(5)
    assert ko.dtype == np.float32
    res = cache.gather(sid, 1, 6, out=(ko, vo))
    assert res[0] is ko and np.array_equal(ko, k[:, 1:6]) and np.array_equal(vo, v[:, 1:6])
    with pytest.raises(TypeError, match="float32"):
        cache.gather(sid, out=(np.empty(k.shape, cfg.numpy_dtype),) * 2)
    with pytest.raises(TypeError):
        cache.gather(sid, out=(ko, vo), raw=True)


# ---- sharing carries the scales ------------------------------------------------------------
@pytest.mark.parametrize("dtype", QDTYPES)
def test_cow_fork_keeps_the_parents_scales(make_cache, dtype):
    cache = make_cache(dtype=dtype, block_size=4)
    cfg = cache.config
    rng = np.random.default_rng(5)
    k, v = kv(cfg, 6, rng)                      # a shared partial block (2 of 4 tokens)
    parent = cache.create_sequence()
    cache.append(parent, k, v)
    before = cache.gather(parent, raw=True)
    child = cache.fork(parent)
    k2, v2 = kv(cfg, 3, rng)
    if dtype == "int8":
        k2 *= 100.0                             # very different scales in the same block
    cache.append(child, k2, v2)
    assert cache.stats()["cow_copies"] >= 1
    after = cache.gather(parent, raw=True)
    for x, y in zip(before, after):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))
    ck = cache.gather(child, raw=True)
    for x, y in zip(before, ck):
        if x.ndim == 4 or dtype == "int8":
            assert np.array_equal(x[:, :6].view(np.uint8), y[:, :6].view(np.uint8))
    gk = cache.gather(child)[0]
    assert np.allclose(gk[:, 6:], k2, rtol=0.07, atol=np.abs(k2).max() * 0.01)
    # and the parent appends after the fork: the child is untouched
    cache.append(parent, *kv(cfg, 2, rng))
    assert np.array_equal(cache.gather(child)[0], gk)
    assert cache.check() == []


@pytest.mark.parametrize("dtype", QDTYPES)
def test_prefix_hit_on_quantized_blocks_returns_equal_data(make_cache, dtype):
    cache = make_cache(dtype=dtype, block_size=4)
    cfg = cache.config
    rng = np.random.default_rng(6)
    k, v = kv(cfg, 10, rng)
    ids = list(range(100, 110))
    a = cache.create_sequence()
    cache.append(a, k, v, tokens=ids)
    b = cache.create_sequence(tokens=ids)       # hits the 2 full blocks
    hit = cache.seq_len(b)
    assert hit == 8
    ga, gb = cache.gather(a, 0, hit), cache.gather(b)
    assert np.array_equal(ga[0], gb[0]) and np.array_equal(ga[1], gb[1])
    cache.free(a)                               # the blocks (and their scales) stay cached
    c = cache.create_sequence(tokens=ids)
    assert np.array_equal(cache.gather(c)[0], ga[0])
    assert cache.check() == []


# ---- attention ---------------------------------------------------------------------------
def reference(q, k, v, scale):
    """float64 softmax(q k^T scale) v; q [hq, d], k/v [n, hkv, d]."""
    hq = q.shape[0]
    g = hq // k.shape[1]
    out = np.empty(q.shape)
    for h in range(hq):
        s = k[:, h // g].astype(np.float64) @ q[h].astype(np.float64) * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v[:, h // g].astype(np.float64)
    return out


@pytest.mark.parametrize("dtype,tol", [("int8", 0.03), ("float8_e4m3", 0.1)])
def test_attention_within_quantization_error_of_the_true_reference(make_cache, isa, dtype,
                                                                    tol):
    """Against the float64 reference on the *unquantized* K/V: the error is the
    quantization's (relative to the output's scale); against gather's dequantized K/V
    it is fp32 rounding only (the kernel dequantizes in registers exactly as gather)."""
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=64, num_blocks=256,
                       block_size=16, dtype=dtype)
    cfg = cache.config
    rng = np.random.default_rng(7)
    lengths = [1, 15, 64, 700]
    sids, data = [], []
    for n in lengths:
        s = cache.create_sequence()
        k, v = kv(cfg, n, rng, spread=False)
        cache.append(s, k, v)
        sids.append(s)
        data.append((k[0], v[0]))
    q = rng.standard_normal((len(sids), 8, 64)).astype(np.float32) * 2
    out = cache.attention(0, q, sids)
    for i, (s, (k, v)) in enumerate(zip(sids, data)):
        want = reference(q[i], k, v, 1 / math.sqrt(64))
        err = np.abs(out[i] - want).max()
        assert err <= tol * np.abs(want).max() + 1e-6, (lengths[i], err)
        gk, gv = cache.gather(s)
        exact = reference(q[i], gk[0], gv[0], 1 / math.sqrt(64))
        assert np.abs(out[i] - exact).max() <= 2e-5 * max(1.0, np.abs(exact).max())


@pytest.mark.parametrize("dtype", QDTYPES)
def test_attention_prefill_and_gqa(make_cache, isa, dtype):
    cache = make_cache(num_layers=2, num_kv_heads=2, head_dim=32, num_blocks=128,
                       block_size=16, dtype=dtype)
    cfg = cache.config
    rng = np.random.default_rng(8)
    s = cache.create_sequence()
    k, v = kv(cfg, 90, rng)
    cache.append(s, k, v)
    q = rng.standard_normal((30, 8, 32)).astype(np.float16)
    out = cache.attention(1, q, [s], q_lens=[30])
    gk, gv = cache.gather(s)
    for r in range(30):
        pos = 90 - 30 + r
        want = reference(q[r], gk[1, :pos + 1], gv[1, :pos + 1], 1 / math.sqrt(32))
        assert np.abs(out[r] - want).max() <= 2e-5 * max(1.0, np.abs(want).max())


# ---- bad input changes nothing -------------------------------------------------------------
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_raises_before_anything_is_written(make_cache, qisa, dtype, bad):
    cache = make_cache(dtype=dtype)
    cfg = cache.config
    rng = np.random.default_rng(9)
    sid = cache.create_sequence()
    cache.append(sid, *kv(cfg, 3, rng))
    child = cache.fork(sid)                      # the next append would copy-on-write
    before = footprint(cache, [sid, child])
    k, v = kv(cfg, 5, rng)
    k[1, 4, 1, 7] = bad
    with pytest.raises(ValueError, match="finite"):
        cache.append(child, k, v)
    with pytest.raises(ValueError, match="finite"):
        cache.append(sid, v, k)
    v16 = v.astype(np.float16)
    v16[0, 0, 0, 0] = bad
    with pytest.raises(ValueError, match="finite"):
        cache.append(sid, np.zeros_like(k), v16)
    slots = cache.reserve(sid, 2)
    before = footprint(cache, [sid, child])
    with pytest.raises(ValueError, match="finite"):
        cache.write(1, slots, k[1, :2], v[1, :2] * bad)
    assert footprint(cache, [sid, child]) == before
    assert cache.check() == []


@pytest.mark.parametrize("dtype", QDTYPES)
def test_wrong_dtypes_and_shapes(make_cache, dtype):
    cache = make_cache(dtype=dtype)
    cfg = cache.config
    sid = cache.create_sequence()
    cache.append(sid, *kv(cfg, 2, np.random.default_rng(10)))
    before = footprint(cache, [sid])
    shape = (cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim)
    for wrong in (np.int8, np.uint8, np.int32, np.float64, cfg.numpy_dtype):
        a = np.zeros(shape, wrong)
        with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
            cache.append(sid, a, a)
        with pytest.raises(TypeError):
            cache.write(0, np.array([0]), a[0], a[0])
    with pytest.raises(ValueError):
        cache.append(sid, np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.float32))
    a = np.zeros(shape, np.float32)
    with pytest.raises(ValueError):
        cache.append(sid, a, a[:, :, :1])
    with pytest.raises(IndexError):
        cache.write(0, np.array([cfg.num_blocks * cfg.block_size]), a[0], a[0])
    assert footprint(cache, [sid]) == before
    assert cache.check() == []


def test_quant_paths_agree(make_cache):
    """Every quantizer path this CPU runs gives the portable one's codes and scales,
    float16 input included, for both dtypes."""
    rng = np.random.default_rng(12)
    paths = cpu_quant_isas()
    for dtype in QDTYPES:
        cache = make_cache(dtype=dtype, head_dim=64)
        k, v = kv(cache.config, 11, rng)
        k[0, :, 0, :5] = [1e-9, -3e-3, 7e-3, 500.0, -6e4]     # subnormal, saturating codes
        got = {}
        try:
            for path in paths:
                assert _quant._force_quant_isa(path) == path
                for x in (k, k.astype(np.float16)):
                    sid = cache.create_sequence()
                    cache.append(sid, x, v)
                    got[path, x.dtype.name] = [a.view(np.uint8).tobytes()
                                               for a in cache.gather(sid, raw=True)]
        finally:
            _quant._force_quant_isa(None)
        for (path, src), raw in got.items():
            assert raw == got["scalar", src], (dtype, path, src)


def test_scale_calls_on_the_wrong_pool(make_cache):
    f16 = make_cache()
    with pytest.raises(TypeError):
        f16.key_scales(0)
    with pytest.raises(TypeError):
        f16.set_kv_scales(0, 1.0, 1.0)
    sid = f16.create_sequence()
    f16.append(sid, *[x.astype(np.float16) for x in kv(f16.config, 1, np.random.default_rng(0))])
    with pytest.raises(TypeError):
        f16.gather(sid, raw=True)
    i8 = make_cache(dtype="int8")
    with pytest.raises(TypeError, match="per token"):
        i8.set_kv_scales(0, 1.0, 1.0)
    fp8 = make_cache(dtype="float8_e4m3")
    for bad in (0.0, -1.0, np.nan, np.inf, 1e39, [1.0], [[1.0, 1.0]]):
        with pytest.raises(ValueError):
            fp8.set_kv_scales(0, bad, 1.0)
        with pytest.raises(ValueError):
            fp8.set_kv_scales(1, 1.0, bad)
    with pytest.raises(IndexError):
        fp8.set_kv_scales(2, 1.0, 1.0)
    assert [a.tolist() for a in fp8.kv_scales(1)] == [[1.0, 1.0], [1.0, 1.0]]


# ---- a hostile segment ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", QDTYPES)
def test_nan_inf_huge_scales_never_crash(make_cache, isa, dtype):
    cache = make_cache(dtype=dtype, head_dim=16)
    cfg = cache.config
    rng = np.random.default_rng(11)
    sid = cache.create_sequence()
    cache.append(sid, *kv(cfg, 13, rng))
    for layer in range(cfg.num_layers):
        ks, vs = cache.key_scales(layer), cache.value_scales(layer)
        flat_k, flat_v = ks.reshape(-1), vs.reshape(-1)
        vals = np.array([np.nan, np.inf, -np.inf, 3.4e38, -1.0, 1e-45, 0.0], np.float32)
        flat_k[rng.integers(0, flat_k.size, 5)] = rng.choice(vals, 5)
        flat_v[rng.integers(0, flat_v.size, 5)] = rng.choice(vals, 5)
        cache.key_cache(layer)[...] = rng.integers(0, 256, cache.key_cache(layer).shape,
                                                   dtype=np.uint8).view(cfg.numpy_dtype)
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    for layer in range(cfg.num_layers):
        out = cache.attention(layer, q, [sid])
        assert out.shape == q.shape                  # NaN allowed; a crash is not
        cache.attention(layer, np.repeat(q, 13, 0), [sid], q_lens=[13])
    cache.gather(sid)
    cache.gather(sid, raw=True)
    cache.append(sid, *kv(cfg, 2, rng))              # new writes are fine
    assert cache.check() == []


def _requantized(cache, kq, vq, ks, vs):
    """Appends code * scale (float32, as the remote tier lands a value) to a new
    sequence; returns its gather(raw=True)."""
    sid = cache.create_sequence()
    with np.errstate(over="ignore", invalid="ignore"):
        if cache.config.dtype == "int8":
            k, v = kq.astype(np.float32) * ks[..., None], vq.astype(np.float32) * vs[..., None]
        else:
            k = kq.astype(np.float32) * ks[:, None, :, None]
            v = vq.astype(np.float32) * vs[:, None, :, None]
    cache.append(sid, k, v)
    return sid, cache.gather(sid, raw=True)


def _same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_int8_dequantized_values_requantize_to_the_same_codes_and_scales(make_cache, qisa):
    """What the remote tier relies on to land an int8 block by append: code * scale
    quantizes back to exactly the codes and scales (the max element is +-127, and for
    every float32 amax, fl(fl(127 * s) / 127) == s with s = fl(amax / 127)): spread
    rows, all-zero rows, -0.0, tiny rows (denormal scales) and huge ones.  (Below
    amax ~ 9e-44 the scale rounds to 0: the codes there are whatever 127/amax = inf made
    of them, the values all 0, and they land as codes 0, scale 0: the same values.)
    Values a host never writes (NaN, inf, overflowing scales) are refused whole."""
    m = np.arange(1 << 23, dtype=np.uint32)
    for e in (1, 100, 127, 200, 254):                  # every mantissa, a few exponents
        amax = ((np.uint32(e) << 23) | m).view(np.float32)
        s = amax / np.float32(127)
        with np.errstate(over="ignore"):
            top = np.float32(127) * s
        # (amax within a few ulps of FLT_MAX: 127 * s is inf, append refuses it: a miss)
        assert np.array_equal((top / np.float32(127))[np.isfinite(top)],
                              s[np.isfinite(top)])
        assert np.isfinite(top).all() or e == 254
    cache = make_cache(dtype="int8", head_dim=32, block_size=8)
    rng = np.random.default_rng(11)
    k, v = kv(cache.config, 24, rng)
    for i, mag in enumerate([0.0, 1e-38, 1e-40, 1e-42, 1e36, 2.6e36, 1e-30]):
        k[i % 2, i, i % 2] *= mag / max(float(np.abs(k[i % 2, i, i % 2]).max()), 1e-30)
        v[i % 2, 23 - i, 1] = mag * rng.standard_normal(32)
    k[1, 20, 0] = -0.0
    v[0, 21, 0, :] = 0
    v[0, 21, 0, 5] = 3.0
    sid = cache.create_sequence()
    cache.append(sid, k, v)
    raw = cache.gather(sid, raw=True)
    assert (raw[2] == 0).any() and (raw[3] == 0).any() and (raw[2] < 1.2e-38).any()
    s2, back = _requantized(cache, *raw)
    for a, b in zip(raw, back):
        assert _same_bits(a, b)
    # scales a value could carry but no host writes: NaN / inf / overflowing ones are
    # refused whole (the tier counts a miss); others land as finite data
    for bad in (np.nan, np.inf, -np.inf, 3.0e38):
        ks = raw[2].copy()
        ks[0, 3, 1] = bad
        with pytest.raises(ValueError):
            _requantized(cache, raw[0], raw[1], ks, raw[3])
    for odd in (1e-45, 1e-40, -1.0):
        ks = raw[2].copy()
        ks[0, 3, 1] = odd
        s3, back = _requantized(cache, raw[0], raw[1], ks, raw[3])
        assert np.isfinite(cache.gather(s3)[0]).all()
    assert cache.check() == []


def test_e4m3_dequantized_codes_requantize_to_the_same_codes(make_cache, qisa):
    """Every finite e4m3 code times its head's scale quantizes back to that code, for
    scale tables of very different magnitudes; a NaN code is refused whole."""
    cache = make_cache(dtype="float8_e4m3", num_layers=2, num_kv_heads=2, head_dim=16,
                       block_size=8, num_blocks=32)
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]                       # 254 finite codes
    n = 16                                                       # 2 * 16 * 2 * 16 slots
    flat = np.resize(codes, 2 * n * 2 * 16)
    kq = flat.reshape(2, n, 2, 16).view(E4M3)
    vq = np.roll(flat, 77).reshape(2, n, 2, 16).view(E4M3)
    for layer, (ksc, vsc) in enumerate([([1.0, 0.37], [3.1, 1e-3]), ([57.0, 2.0 ** -7],
                                                                      [0.0123, 250.0])]):
        cache.set_kv_scales(layer, ksc, vsc)
    tables = [np.array([cache.kv_scales(i)[j] for i in range(2)]) for j in (0, 1)]
    sid, back = _requantized(cache, kq, vq, *tables)
    assert _same_bits(back[0], kq) and _same_bits(back[1], vq)
    bad = kq.copy()
    bad.view(np.uint8)[1, 3, 0, 2] = 0x7F
    with pytest.raises(ValueError):
        _requantized(cache, bad, vq, *tables)
    assert cache.check() == []


def test_int8_tiny_rows_keep_their_values(make_cache, qisa):
    """A row whose largest |x| is below ~3.7e-37, where 127 / amax overflows float32: the
    codes come from the inverse in double, so values keep their signs and stay within the
    row's max (the AVX2 path used to turn them all into -127); a scale that rounds to 0
    (amax < ~1.8e-43) stores codes 0, and the row reads back as 0."""
    cache = make_cache(dtype="int8", head_dim=16, block_size=4)
    cfg = cache.config
    base = np.linspace(-1, 1, 16, dtype=np.float32)          # no exact 0, |x| >= 1/15
    k = np.zeros((cfg.num_layers, 3, cfg.num_kv_heads, 16), np.float32)
    for t, mag in enumerate((1e-38, 1e-41, 1e-44)):
        k[:, t] = base * np.float32(mag)
    sid = cache.create_sequence()
    cache.append(sid, k, -k)
    gk, gv = cache.gather(sid)
    qk, qv, sk, sv = cache.gather(sid, raw=True)
    for t in (0, 1):
        assert (np.sign(gk[:, t]) == np.sign(k[:, t])).all()
        assert (np.sign(gv[:, t]) == -np.sign(k[:, t])).all()
        amax = np.abs(k[:, t]).max(-1, keepdims=True)
        assert (np.abs(gk[:, t] - k[:, t]) <= amax).all()
    s = np.abs(k[:, 0]).max(-1, keepdims=True) / 127
    assert (np.abs(gk[:, 0] - k[:, 0]) <= s / 2 * (1 + 1e-5)).all()
    assert (qk[:, 2] == 0).all() and (sk[:, 2] == 0).all() and (gk[:, 2] == 0).all()
    assert cache.check() == []


def test_force_quant_isa_switches_the_dispatch():
    """The hook sets the switch the quantizers' dispatch reads (it used to assign a Cython
    local, so "scalar" left the AVX2 path in use and the portable one never ran here); a
    path above the CPU's best is refused, an unknown name too."""
    try:
        runs = cpu_quant_isas()
        for path in QISAS:
            if path in runs:
                assert _quant._force_quant_isa(path) == path
            else:
                with pytest.raises(ValueError):
                    _quant._force_quant_isa(path)
        assert _quant._force_quant_isa("scalar") == "scalar"
        with pytest.raises(ValueError):
            _quant._force_quant_isa("avx1024")
        assert _quant._force_quant_isa(None) == runs[-1]
    finally:
        _quant._force_quant_isa(None)


def _ref_i8(x):
    """An independent int8 quantizer (numpy, float32 arithmetic like the kernel's; the
    inverse in float64 where 127 / amax overflows float32): codes and scales."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(-1)
    s = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(all="ignore"):                 # inf inverses of tiny rows, replaced below
        inv32 = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
        q = np.rint(x * inv32[..., None])
    tiny = (amax > 0) & ~np.isfinite(inv32)
    inv64 = np.where(tiny & (s > 0), 127.0 / np.where(tiny, amax, 1).astype(np.float64), 0.0)
    q = np.where(tiny[..., None], np.rint(x.astype(np.float64) * inv64[..., None]), q)
    return np.clip(q, -127, 127).astype(np.int8), s


def _ref_e4m3(x, scale):
    """An independent e4m3fn quantizer: x / scale (times the float32 inverse, as the
    kernel does), saturated to +-448, rounded to nearest even by ml_dtypes."""
    with np.errstate(over="ignore"):                # saturates to 448 below, as the kernel
        y = x.astype(np.float32) * np.float32(np.float32(1) / np.float32(scale))
    return np.clip(y, -448, 448).astype(E4M3).view(np.uint8)


def _row_classes(shape, f16, rng):
    """K with one row class per (token, head): normal with outliers, zero, tiny (scale
    near or below float32's smallest normal, float32 input only), huge, saturating."""
    layers, n, heads, d = shape
    base = np.linspace(-1, 1, d, dtype=np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    mags = [1.0, 0.0, 6e4, 3e-3] + ([] if f16 else [1e-38, 1e-41, 1e-44, 3e38])
    for t in range(n):
        for h in range(heads):
            m = mags[(t * heads + h) % len(mags)]
            if m != 1.0:
                x[:, t, h] = base * np.float32(m)
    x[0, 0, 0, : min(d, 4)] = [1e-9, -3e-3, 500.0, -6e4][: min(d, 4)]
    return x.astype(np.float16) if f16 else x


@pytest.mark.parametrize("head_dim", [8, 12, 7, 40, 64, 130])
@pytest.mark.parametrize("dtype", QDTYPES)
def test_portable_and_vector_quantizers_agree_with_a_reference(make_cache, dtype, head_dim):
    """Every quantizer path (portable, AVX2, AVX-512), forced in turn, on every row class
    (normal, zero, tiny, huge, saturating; NaN/inf refused), float32 and float16 input,
    head_dims that are and are not multiples of the vector widths (the vector paths' whole
    32-element blocks, single vectors and partial last vectors): the same codes and scales
    as each other, bit for bit, and as an independent numpy (int8) / ml_dtypes (e4m3)
    computation.  A row with a NaN or inf raises before anything is written on every path
    (the portable path used to cast the NaN to int8 first: undefined behaviour that make
    sanitize reports)."""
    cache = make_cache(dtype=dtype, head_dim=head_dim, num_kv_heads=2, block_size=4,
                       num_blocks=128)
    cfg = cache.config
    if dtype == "float8_e4m3":
        cache.set_kv_scales(1, 0.25, 3.0)
    rng = np.random.default_rng(head_dim)
    paths = QISAS
    try:
        for f16 in (False, True):
            k = _row_classes((cfg.num_layers, 16, cfg.num_kv_heads, head_dim), f16, rng)
            v = -k[:, ::-1].copy()
            got = {}
            for path in paths:
                try:
                    assert _quant._force_quant_isa(path) == path
                except ValueError:
                    continue                        # not on this CPU
                sid = cache.create_sequence()
                cache.append(sid, k, v)
                got[path] = raw = cache.gather(sid, raw=True)
                for x, codes, kind in ((k, raw[0], "k"), (v, raw[1], "v")):
                    if dtype == "int8":
                        q, s = _ref_i8(x)
                        assert (codes == q).all(), (path, f16, kind)
                        sc = raw[2] if kind == "k" else raw[3]
                        assert _same_bits(sc, s), (path, f16, kind)
                    else:
                        for layer in range(cfg.num_layers):
                            ks, vs = cache.key_scales(layer), cache.value_scales(layer)
                            for h in range(cfg.num_kv_heads):
                                sc = (ks if kind == "k" else vs)[h]
                                want = _ref_e4m3(x[layer, :, h], sc)
                                assert (codes[layer, :, h].view(np.uint8) == want).all(), \
                                    (path, f16, kind, layer, h)
                for bad, pos in ((np.nan, head_dim - 1), (np.inf, 0), (-np.inf, head_dim // 2)):
                    for which in (0, 1):            # in k, then in v
                        kb, vb = k.copy(), v.copy()
                        (kb, vb)[which][1, 5, 1, pos] = bad
                        sid2 = cache.create_sequence()
                        with pytest.raises(ValueError):
                            cache.append(sid2, kb, vb)
                        assert cache.seq_len(sid2) == 0
                        cache.free(sid2)
            assert list(got) == cpu_quant_isas()
            for path, raw in got.items():
                for a, b in zip(got["scalar"], raw):
                    assert a.view(np.uint8).tobytes() == b.view(np.uint8).tobytes(), path
    finally:
        _quant._force_quant_isa(None)
    assert cache.check() == []


@pytest.mark.parametrize("head_dim", [128, 13])
@pytest.mark.parametrize("dtype", QDTYPES)
def test_quantizers_agree_on_random_rows_and_ties(make_cache, dtype, head_dim):
    """Many random rows (magnitudes over 2^-30..2^30 per row, float16 subnormals in the
    float16 input) and rows of exact rounding ties (int8: k + 1/2 under a scale of 1;
    e4m3: midpoints between neighbouring codes): every quantizer path the CPU runs gives
    the portable path's codes and scales, bit for bit."""
    cache = make_cache(dtype=dtype, head_dim=head_dim, num_kv_heads=2, num_layers=1,
                       block_size=16, num_blocks=64)
    rng = np.random.default_rng(7 + head_dim)
    n = 300
    shape = (1, n, 2, head_dim)
    mag = np.exp2(rng.uniform(-30, 30, shape[:-1] + (1,)))
    k = (rng.standard_normal(shape) * mag).astype(np.float32)
    if dtype == "int8":                              # ties: 127 sets the scale to 1
        ties = np.arange(head_dim, dtype=np.float32) % 127 - 63 + np.float32(0.5)
        ties[0] = 127.0
    else:                                            # between e4m3 neighbours, scale 1
        grid = np.arange(0, 0x7f, dtype=np.uint8).view(E4M3).astype(np.float32)
        mids = (grid[:-1] + grid[1:]) / 2
        ties = np.resize(mids, head_dim) * np.where(np.arange(head_dim) % 2, -1, 1)
    k[0, :8, 0] = ties
    v = k[:, ::-1].copy()
    k16 = (rng.standard_normal(shape) * np.exp2(rng.uniform(-20, 10, shape[:-1] + (1,))))
    k16 = k16.astype(np.float16)                    # subnormal float16s in the small rows
    assert (np.abs(k16) < np.float16(6.1e-5)).any()
    got = {}
    try:
        for path in cpu_quant_isas():
            assert _quant._force_quant_isa(path) == path
            for src, (a, b) in (("f32", (k, v)), ("f16", (k16, k16[:, ::-1].copy()))):
                sid = cache.create_sequence()
                cache.append(sid, a, b)
                got[path, src] = [x.view(np.uint8).tobytes() for x in cache.gather(sid, raw=True)]
                cache.free(sid)
    finally:
        _quant._force_quant_isa(None)
    for (path, src), raw in got.items():
        assert raw == got["scalar", src], (path, src)
    if dtype == "int8":                              # and the ties rounded to even
        sid = cache.create_sequence()
        cache.append(sid, k[:, :8], v[:, :8])
        q, _, s, _ = cache.gather(sid, raw=True)
        assert (s[0, :, 0] == 1).all()
        assert (q[0, :, 0] == np.clip(np.rint(ties), -127, 127)).all()
    assert cache.check() == []


@pytest.mark.parametrize("dtype", QDTYPES)
def test_scratch_kept_between_calls_never_mixes_data(make_cache, dtype):
    """The quantization scratch a handle keeps between calls (shmkv._quant.SCRATCH_KEEP):
    appends of growing and shrinking sizes, write() in between, and threads appending
    through the same handle at once (the GIL is released while quantizing and copying)
    each store their own codes: gather matches a fresh handle-free computation."""
    import threading

    cache = make_cache(dtype=dtype, num_blocks=512, max_seqs=16)
    cfg = cache.config
    rng = np.random.default_rng(3)
    want = {}

    def expect(sid, k, v):
        want.setdefault(sid, []).append((k, v))

    for n in (5, 40, 1, 17):
        sid = cache.create_sequence()
        k, v = kv(cfg, n, rng)
        cache.append(sid, k, v)
        expect(sid, k, v)
        slots = cache.reserve(sid, 3)
        kw, vw = kv(cfg, 3, rng)
        for layer in range(cfg.num_layers):
            cache.write(layer, slots, kw[layer], vw[layer])
        expect(sid, kw, vw)
    errors = []

    def worker(seed):
        try:
            r = np.random.default_rng(seed)
            sid = cache.create_sequence()
            for _ in range(20):
                k, v = kv(cfg, int(r.integers(1, 9)), r)
                cache.append(sid, k, v)
                expect(sid, k, v)
        except BaseException as e:          # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(100 + i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ref = make_cache(dtype=dtype, num_blocks=512, max_seqs=16)
    for sid, parts in want.items():
        rsid = ref.create_sequence()
        for k, v in parts:
            ref.append(rsid, k, v)
        got = cache.gather(sid, raw=True)
        exp = ref.gather(rsid, raw=True)
        for a, b in zip(got, exp):
            assert a.view(np.uint8).tobytes() == b.view(np.uint8).tobytes()
    assert cache.check() == []
