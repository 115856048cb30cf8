"""precision="bf16", the opt-in reduced-precision attention, and the default
left bit for bit as it was.

The opt-in's contract: q times the scale rounded to bf16 once (int8 pools on AVX512_VNNI:
quantized to int8 per query vector instead), the softmax weights rounded to bf16 once,
float32 accumulation.  Two bounds, both checked on every path the tests can force (each ISA,
and on AVX-512 with the CPU's dot instructions on and off):
- against the exact attention of the rounded q (float64): the weights' rounding alone,
  |out - ref(q_hat)| <= 2^-8 max|v| (+ float32 accumulation);
- against the exact attention of q itself: |out - ref(q)| <= max|v| (2^-8 + 2 max_j |ds_j|),
  where ds_j bounds the score error the rounding of q makes:
  2^-9 scale sum_x |q_x k_jx|, plus max|q scale| / 254 sum_x |k_jx| for int8 codes.
"""
import json
import math
import os
import zlib

import numpy as np
import pytest
from support import ISAS
from support.attn_golden import CASES, RECORDED_ISAS, THREADS, digest, pool_input, run_case

from shmkv import _attention

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "attention_default.json")


# ---- the default mode: bit for bit what it was ----------------------------------------------
@pytest.mark.parametrize("isa_name", [i for i in RECORDED_ISAS if i in ISAS])
def test_default_mode_is_bit_for_bit_what_it_was(isa_name):
    """Every case's output hashes as the kernel before the opt-in gave it (the digests were
    recorded from that source, commit f0959ef, built as the wheel is), on each path this
    CPU runs."""
    with open(GOLDEN) as f:
        rec = json.load(f)
    if _attention._build() != rec["build"]:
        # the sanitizer (clang) and -O0 builds order and contract float operations
        # otherwise; `make test` runs the production build, where this check applies
        pytest.skip(f"digests recorded for a {rec['build']!r} build, this is "
                    f"{_attention._build()!r}")
    want = rec["digests"][isa_name]
    before = _attention.isa()
    _attention._force_isa(isa_name)
    try:
        got = {f"{c[0]}/{t}": digest(run_case(c, t)) for c in CASES for t in THREADS}
        got_explicit = {f"{c[0]}/{t}": digest(run_case(c, t, precision="fp32"))
                        for c in CASES[:3] for t in THREADS}
    finally:
        _attention._force_isa(before)
    key = f"build {rec['build']!r}, isa {isa_name!r}"
    assert {k: v for k, v in got.items() if v != want[k]} == {}, key
    assert all(got[k] == v for k, v in got_explicit.items()), key


def test_digest_inputs_do_not_depend_on_ml_dtypes():
    """The cases' bfloat16 inputs are rounded by the test itself: from float32 exactly as
    every correct float32 -> bfloat16 cast (round to nearest even), and from float64 through
    float32 (two roundings) whatever ml_dtypes' own float64 cast does."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(7)
    x = rng.standard_normal(1 << 18) * np.exp(rng.uniform(-30, 30, 1 << 18))
    x32 = x.astype(np.float32)
    assert np.array_equal(pool_input(x32, bf16).view(np.uint16), x32.astype(bf16).view(np.uint16))
    assert np.array_equal(pool_input(x, bf16).view(np.uint16),
                          pool_input(x32, bf16).view(np.uint16))
    # ties go to even: 1 + 2**-8 is halfway between two bfloat16 neighbours of 1
    ties = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8], np.float32)
    assert pool_input(ties, bf16).astype(np.float32).tolist() == [1.0, 1 + 2.0 ** -6]


def test_the_digest_check_can_fail(make_cache):
    """The digest sees a one-ulp change of one output element."""
    out = run_case(CASES[0], 1)
    bumped = out.copy()
    bumped.reshape(-1)[7] = np.nextafter(bumped.reshape(-1)[7], np.float32(np.inf))
    assert digest(out) != digest(bumped)


# ---- the opt-in's bounds ------------------------------------------------------------------------
def _bf16(x):
    """float32 -> bf16 -> float32, round to nearest even (the kernel's rounding)."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def _int8_codes(qs):
    """The VNNI path's q: int8 codes per vector (max|q| / 127), as floats."""
    amax = np.abs(qs).max(axis=-1, keepdims=True).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = np.clip(np.rint(qs * inv), -127, 127).astype(np.float32)
    sc = np.where(amax > 0, amax / np.float32(127), 1).astype(np.float32)
    return codes * sc


def _attend(k, v, q, lens, q_lens, hat=None):
    """float64 attention of q_s = q * scale (already scaled, as float64) over each
    sequence's K/V; returns (out, bound term max|ds| per row and head)."""
    out = np.empty(q.shape, np.float64)
    ds = np.zeros(q.shape[:2], np.float64)
    hq, hkv = q.shape[1], k[0].shape[1]
    g = hq // hkv
    row = 0
    for kk, vv, n, ql in zip(k, v, lens, q_lens):
        kk, vv = kk.astype(np.float64), vv.astype(np.float64)
        for r in range(ql):
            pos = n - ql + r
            for h in range(hq):
                s = kk[:pos + 1, h // g] @ q[row, h]
                p = np.exp(s - s.max())
                out[row, h] = p / p.sum() @ vv[:pos + 1, h // g]
                if hat is not None:
                    ds[row, h] = hat(q[row, h], kk[:pos + 1, h // g])
            row += 1
    return out, ds


def _run(cache, isa, dots, q, sids, q_lens):
    _attention._force_isa(isa)
    _attention._force_dots(dots)
    try:
        return cache.attention(0, q, sids, q_lens=q_lens, precision="bf16")
    finally:
        _attention._force_dots(True)
        _attention._force_isa(None)


def _paths(isa):
    """(isa, dots on?) pairs to run: AVX-512 and above both with the dot instructions and
    without (the FMA path of the same mode)."""
    return [(isa, True), (isa, False)] if isa in ("avx512", "amx") else [(isa, True)]


SHAPES = [
    # (hkv, hq, d, lengths, q_lens): decode with odd tiles, a GEMM-sized prefill, a small
    # prefill on the row items, MHA, head dims the dot items take (32, 96) or leave (40)
    (2, 8, 128, [37, 300], None),
    (2, 8, 64, [300, 90], [64, 40]),
    (1, 4, 128, [50], [3]),
    (4, 4, 96, [129], None),
    (2, 4, 32, [77], [5]),
    (1, 2, 40, [61], None),
]


def _shape_id(s):
    return f"d{s[2]}-{'decode' if s[4] is None else 'prefill'}-{s[0]}x{s[1]}"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "float8_e4m3"])
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_bf16_mode_bounds(make_cache, isa, dtype, shape):
    hkv, hq, d, lengths, q_lens = shape
    cache = make_cache(num_layers=1, num_kv_heads=hkv, head_dim=d, block_size=16, dtype=dtype,
                       num_blocks=sum(-(-n // 16) for n in lengths) + 2)
    rng = np.random.default_rng(zlib.crc32(f"{dtype}-{d}-{hq}".encode()))
    sids, ks, vs = [], [], []
    for n in lengths:
        sid = cache.create_sequence()
        shape_ = (1, n, hkv, d)
        cache.append(sid, rng.standard_normal(shape_).astype(cache.config.compute_dtype),
                     rng.standard_normal(shape_).astype(cache.config.compute_dtype))
        k, v = cache.gather(sid)
        sids.append(sid)
        ks.append(k[0])
        vs.append(v[0])
    ql = q_lens or [1] * len(lengths)
    q = (rng.standard_normal((sum(ql), hq, d)) * 1.5).astype(np.float32)
    scale = np.float32(1 / math.sqrt(d))
    qs = q * scale                                   # float32, as the kernel scales it
    vmax = max(np.abs(v).max() for v in vs)
    exact, ds_bf = _attend(ks, vs, qs.astype(np.float64), lengths, ql,
                           hat=lambda qq, kk: 2.0 ** -9 * (np.abs(kk) @ np.abs(qq)).max())
    q_bf = _bf16(qs)
    for path, dots in _paths(isa):
        _attention._force_isa(path)
        _attention._force_dots(dots)
        vnni = dtype == "int8" and "vnni" in _attention.dot_isa() and d % 64 == 0 and d <= 256
        _attention._force_dots(True)
        _attention._force_isa(None)
        q_hat = _int8_codes(q_bf) if vnni else q_bf
        ref_hat, _ = _attend(ks, vs, q_hat.astype(np.float64), lengths, ql)
        got = _run(cache, path, dots, q, sids, q_lens).astype(np.float64)
        where = f"{dtype} {path} dots={dots} vnni={vnni}"
        # 1. against the rounded q: the weights' rounding alone
        err_hat = np.abs(got - ref_hat).max()
        assert err_hat <= 2.0 ** -8 * vmax + 1e-5 * max(1.0, np.abs(ref_hat).max()), \
            f"{where}: {err_hat} vs ref(q_hat)"
        # 2. against q itself: plus what q's rounding does to the scores
        ds = ds_bf
        if vnni:
            amax = np.abs(q_bf).max(axis=-1)          # [rows, hq]
            ksum = _attend(ks, vs, qs.astype(np.float64), lengths, ql,
                           hat=lambda qq, kk: np.abs(kk).sum(axis=1).max())[1]
            ds = ds_bf + amax / 254 * ksum
        bound = vmax * (2.0 ** -8 + 2 * ds) * 1.1 + 1e-5 * max(1.0, np.abs(exact).max())
        err = np.abs(got - exact).max(axis=-1)        # [rows, hq]
        assert (err <= bound).all(), f"{where}: {err.max()} > {bound[np.argmax(err - bound)]}"
        # and it is the opt-in that rounds: the default is far closer
        assert np.abs(cache.attention(0, q, sids, q_lens=q_lens) - exact).max() < \
            max(err_hat, 1e-4)


def test_bf16_mode_is_really_rounding(make_cache):
    """A q whose bf16 rounding moves the result: the opt-in differs from the default and
    matches the reference of the rounded q."""
    cache = make_cache(num_layers=1, num_kv_heads=1, head_dim=32, num_blocks=8,
                       block_size=16, dtype="float32")
    rng = np.random.default_rng(3)
    sid = cache.create_sequence()
    k = rng.standard_normal((1, 20, 1, 32)).astype(np.float32) * 4
    v = rng.standard_normal((1, 20, 1, 32)).astype(np.float32)
    cache.append(sid, k, v)
    q = (rng.standard_normal((1, 1, 32)) * 4).astype(np.float32)
    d = cache.attention(0, q, [sid])
    b = cache.attention(0, q, [sid], precision="bf16")
    assert np.abs(d - b).max() > 1e-5
    scale = np.float32(1 / math.sqrt(32))
    ref_hat, _ = _attend([k[0]], [v[0]], _bf16(q * scale).astype(np.float64), [20], [1])
    assert np.abs(b - ref_hat).max() <= 2.0 ** -8 * np.abs(v).max() + 1e-5


@pytest.mark.parametrize("bad, exc, msg", [
    ("bfloat16", ValueError, "expected one of ('fp32', 'bf16'), got 'bfloat16'"),
    ("", ValueError, "precision"),
    (16, TypeError, "precision: expected str, got int"),
    (None, TypeError, "precision: expected str, got NoneType"),
])
def test_bad_precision(make_cache, bad, exc, msg):
    cache = make_cache(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=4, block_size=4,
                       dtype="float32")
    sid = cache.create_sequence()
    cache.append(sid, np.ones((1, 3, 1, 8), np.float32), np.ones((1, 3, 1, 8), np.float32))
    before = cache.stats()
    with pytest.raises(exc) as e:
        cache.attention(0, np.ones((1, 1, 8), np.float32), [sid], precision=bad)
    assert msg in str(e.value)
    assert cache.stats() == before


def test_dot_isa_names_the_instructions():
    """dot_isa() is what the CPU has under the ISA in use; forced off or below AVX-512, the
    FMA path."""
    assert _attention.dot_isa() in ("avx512_bf16+vnni", "avx512_bf16", "avx512_vnni", "fma")
    _attention._force_dots(False)
    try:
        assert _attention.dot_isa() == "fma"
    finally:
        _attention._force_dots(True)
    _attention._force_isa("avx2")
    try:
        assert _attention.dot_isa() == "fma"
    finally:
        _attention._force_isa(None)
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split() \
        if os.path.exists("/proc/cpuinfo") else []
    if _attention.cpu_isa() in ("avx512", "amx"):
        assert ("bf16" in _attention.dot_isa()) == ("avx512_bf16" in flags)
        assert ("vnni" in _attention.dot_isa()) == ("avx512_vnni" in flags)
