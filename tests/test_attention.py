"""cache.attention: paged attention over the block tables, checked against a float64 numpy
reference computed from gather() -- every dtype, GQA group, ISA path and thread count, with
forks, other processes writing, a forked child, and every bad input of the contract."""
import math
import multiprocessing as mp
import os
import subprocess
import sys

import numpy as np
import pytest
from support import ISAS
from workers.attn_workers import tokens as _tokens
from workers.attn_workers import writer as _writer
from workers.recovery_workers import segment_bytes

import shmkv
from shmkv import _attention, _bench
from shmkv.inspect import struct_layout

DTYPES = ["float32", "float16", "bfloat16"]
QDTYPES = ["int8", "float8_e4m3"]     # quantized pools: the reference reads gather()'s
                                      # dequantized float32, so the tolerance is fp32's


@pytest.fixture
def threads():
    before = _attention.get_num_threads()
    try:
        yield _attention.set_num_threads
    finally:
        _attention.set_num_threads(before)


def reference(cache, layer, q, sids, q_lens=None, scale=None):
    """softmax(q k^T scale) v in float64, from gather(); causal rows with q_lens."""
    hq, d = q.shape[1], q.shape[2]
    hkv = cache.config.num_kv_heads
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q_lens = [1] * len(sids) if q_lens is None else list(q_lens)
    out = np.empty(q.shape, np.float64)
    row = 0
    for sid, ql in zip(sids, q_lens):
        k, v = cache.gather(sid)
        k = k[layer].astype(np.float64)
        v = v[layer].astype(np.float64)
        n = k.shape[0]
        for r in range(ql):
            pos = n - ql + r
            qq = q[row].astype(np.float64)
            for h in range(hq):
                s = k[:pos + 1, h // g] @ qq[h] * scale
                p = np.exp(s - s.max())
                out[row, h] = (p / p.sum()) @ v[:pos + 1, h // g]
            row += 1
    return out


def fill(cache, sid, n, rng, scale=1.0):
    cfg = cache.config
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    k = (rng.standard_normal(shape) * scale).astype(cfg.compute_dtype)
    v = rng.standard_normal(shape).astype(cfg.compute_dtype)
    cache.append(sid, k, v)
    return k, v


def assert_close(got, want, tol=2e-5):
    assert got.dtype == np.float32 and got.shape == want.shape
    err = np.abs(got.astype(np.float64) - want).max()
    assert err <= tol * max(1.0, np.abs(want).max()), f"max error {err}"


# ---- correctness against the reference ------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES + QDTYPES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_matches_reference(make_cache, isa, dtype, group):
    cache = make_cache(num_layers=2, num_kv_heads=2, head_dim=64, num_blocks=128,
                       block_size=16, dtype=dtype)
    rng = np.random.default_rng(group)
    lengths = [1, 7, 16, 32, 100, 531]      # inside one block, exact blocks, many blocks
    sids = [cache.create_sequence() for _ in lengths]
    for sid, n in zip(sids, lengths):
        fill(cache, sid, n, rng)
    q = rng.standard_normal((len(sids), 2 * group, 64)).astype(np.float32)
    for layer in range(2):
        assert_close(cache.attention(layer, q, sids), reference(cache, layer, q, sids))
    assert cache.check() == []


@pytest.mark.parametrize("head_dim", [24, 40, 56, 72, 88, 120])
def test_decode_head_dims_matches_reference(make_cache, isa, head_dim):
    """head_dim of 3 to 15 vector chunks: every split of the V accumulation into passes of
    3, 2 and 1 chunks (AVX2) and of 4 (AVX-512), grouped query heads, float16 and float32."""
    for dtype in ("float16", "float32"):
        cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=head_dim, num_blocks=64,
                           block_size=16, dtype=dtype)
        rng = np.random.default_rng(head_dim)
        lengths = [5, 16, 77]
        sids = [cache.create_sequence() for _ in lengths]
        for sid, n in zip(sids, lengths):
            fill(cache, sid, n, rng)
        q = rng.standard_normal((len(sids), 8, head_dim)).astype(np.float32)
        assert_close(cache.attention(0, q, sids), reference(cache, 0, q, sids))


@pytest.mark.parametrize("dtype", DTYPES + QDTYPES)
def test_chunked_prefill_matches_reference(make_cache, isa, dtype):
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=32, num_blocks=128,
                       block_size=16, dtype=dtype)
    rng = np.random.default_rng(1)
    lengths, q_lens = [5, 40, 300, 17], [5, 1, 37, 16]
    sids = [cache.create_sequence() for _ in lengths]
    for sid, n in zip(sids, lengths):
        fill(cache, sid, n, rng)
    q = rng.standard_normal((sum(q_lens), 8, 32)).astype(np.float32)
    assert_close(cache.attention(0, q, sids, q_lens=q_lens),
                 reference(cache, 0, q, sids, q_lens))
    # q_lens as an ndarray, scale given, q in the pool's dtype
    q2 = q.astype(np.float16 if cache.config.quantized else cache.config.numpy_dtype)
    got = cache.attention(0, q2, sids, q_lens=np.array(q_lens, np.int64), scale=0.3)
    assert_close(got, reference(cache, 0, q2, sids, q_lens, scale=0.3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_first_query_of_a_prompt_returns_v0_exactly(make_cache, isa, dtype):
    """The first row of a prompt attends to one token: the result is v[0], bit for bit."""
    cache = make_cache(num_layers=1, num_kv_heads=1, head_dim=32, num_blocks=64,
                       block_size=16, dtype=dtype)
    sid = cache.create_sequence()
    rng = np.random.default_rng(2)
    _, v = fill(cache, sid, 50, rng, scale=5.0)
    q = rng.standard_normal((50, 4, 32)).astype(np.float32) * 10
    out = cache.attention(0, q, [sid], q_lens=[50])
    want = v[0, 0, 0].astype(np.float32)
    for h in range(4):
        assert np.array_equal(out[0, h], want)


def test_long_sequence_with_sharp_softmax(make_cache, isa, threads):
    """32k tokens, a query that picks out one token: any error in the split-KV merge (a
    chunk's max or sum rescaled wrongly) moves the result away from that token's v."""
    threads(2)
    n = 32768
    cache = make_cache(num_layers=1, num_kv_heads=1, head_dim=32, num_blocks=n // 16 + 4,
                       block_size=16, dtype="float32", max_seqs=4)
    sid = cache.create_sequence()
    rng = np.random.default_rng(3)
    k, v = fill(cache, sid, n, rng)
    hits = [3, 12345, 20000, n - 1]
    q = np.stack([k[0, t, 0] * 16.0 for t in hits])[None].astype(np.float32)   # [1, 4, 32]
    out = cache.attention(0, q, [sid])
    want = reference(cache, 0, q, [sid])
    assert_close(out, want, tol=5e-5)
    # the softmax is sharp: the result is close to the picked v
    for h, t in enumerate(hits):
        assert np.abs(want[0, h] - v[0, t, 0]).max() < 0.05


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_long_sequence_half_precision(make_cache, threads, dtype):
    threads(2)
    n = 8192 + 77
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=128, num_blocks=n // 16 + 4,
                       block_size=16, dtype=dtype, max_seqs=4)
    sid = cache.create_sequence()
    rng = np.random.default_rng(4)
    fill(cache, sid, n, rng)
    q = rng.standard_normal((1, 8, 128)).astype(np.float32)
    assert_close(cache.attention(0, q, [sid]), reference(cache, 0, q, [sid]))


def test_one_thread_and_many_agree(make_cache, threads):
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=64, num_blocks=1100,
                       block_size=16, dtype="float16")
    rng = np.random.default_rng(5)
    sids = [cache.create_sequence() for _ in range(3)]
    for sid, n in zip(sids, [4000, 9000, 3000]):
        fill(cache, sid, n, rng)
    q = rng.standard_normal((3, 8, 64)).astype(np.float32)
    want = reference(cache, 0, q, sids)
    results = []
    for n in (1, 2, 3):
        threads(n)
        assert _attention.get_num_threads() == n
        results.append(cache.attention(0, q, sids))
        assert_close(results[-1], want)
    assert np.abs(results[0] - results[1]).max() < 1e-5


def test_out_is_written_and_returned(make_cache):
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=8, num_blocks=16, block_size=4)
    sid = cache.create_sequence()
    fill(cache, sid, 9, np.random.default_rng(6))
    q = np.random.default_rng(7).standard_normal((1, 4, 8)).astype(np.float16)
    out = np.full((1, 4, 8), np.nan, np.float32)
    assert cache.attention(0, q, [sid], out=out) is out
    assert_close(out, reference(cache, 0, q, [sid]), tol=1e-3)


def test_same_sequence_twice_and_unsorted_sids(make_cache):
    cache = make_cache(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=32, block_size=4)
    rng = np.random.default_rng(8)
    sids = [cache.create_sequence() for _ in range(3)]
    for sid, n in zip(sids, [3, 10, 21]):
        fill(cache, sid, n, rng)
    order = [sids[2], sids[0], sids[2], sids[1]]
    q = rng.standard_normal((4, 2, 8)).astype(np.float32)
    assert_close(cache.attention(0, q, order), reference(cache, 0, q, order), tol=1e-3)
    assert_close(cache.attention(0, q, np.array(order)), reference(cache, 0, q, order), tol=1e-3)


def test_nan_and_inf_in_q_do_not_crash(make_cache):
    cache = make_cache(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=16, block_size=4)
    sid = cache.create_sequence()
    fill(cache, sid, 9, np.random.default_rng(9))
    for bad in (np.nan, np.inf, -np.inf):
        q = np.ones((1, 2, 8), np.float32)
        q[0, 0, 3] = bad
        out = cache.attention(0, q, [sid])
        assert np.isfinite(out[0, 1]).all()          # the other head is untouched
    assert cache.check() == []


def test_forked_sequences_after_copy_on_write(make_cache, isa):
    cache = make_cache(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=64,
                       block_size=16, dtype="float16")
    rng = np.random.default_rng(10)
    parent = cache.create_sequence()
    fill(cache, parent, 37, rng)                  # a shared partial last block
    child = cache.fork(parent)
    fill(cache, child, 5, rng)                    # copy-on-write of the last block
    fill(cache, parent, 20, rng)
    sids = [parent, child]
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    for layer in range(2):
        assert_close(cache.attention(layer, q, sids), reference(cache, layer, q, sids))
    assert cache.check() == []


# ---- other processes ------------------------------------------------------------------------
def _ref_prefix(k, v, q, n):
    """reference over the first n tokens of layer 0 (kv heads 1)"""
    kk = k[0, :n, 0].astype(np.float64)
    vv = v[0, :n, 0].astype(np.float64)
    out = np.empty(q.shape[1:], np.float64)
    for h in range(q.shape[1]):
        s = kk @ q[0, h].astype(np.float64) / math.sqrt(q.shape[2])
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ vv
    return out


def test_reads_a_sequence_another_process_is_appending_to(seg_name):
    cfg = shmkv.CacheConfig(num_layers=1, num_kv_heads=1, head_dim=16, num_blocks=64,
                            block_size=16, dtype="float16", max_seqs=8)
    n = 400
    ctx = mp.get_context("spawn")
    ready, go, release = ctx.Queue(), ctx.Event(), ctx.Event()
    with shmkv.KVCache.create(seg_name, cfg) as cache:
        proc = ctx.Process(target=_writer, args=(seg_name, 11, n, ready, go, release))
        proc.start()
        try:
            sid = ready.get(timeout=60)
            k, v = _tokens(cfg, 11, n)
            q = np.random.default_rng(12).standard_normal((1, 2, 16)).astype(np.float32)
            go.set()
            seen = set()
            finished = False
            while not finished:
                finished = not ready.empty()
                before = cache.seq_len(sid)
                out = cache.attention(0, q, [sid])[0]
                after = cache.seq_len(sid)
                # the result is attention over exactly some published prefix in [before, after]
                errs = {m: np.abs(out - _ref_prefix(k, v, q, m)).max()
                        for m in range(before, after + 1)}
                best = min(errs, key=errs.get)
                assert errs[best] < 1e-4, (before, after, errs)
                seen.add(best)
            assert ready.get(timeout=60) == "done"
            out = cache.attention(0, q, [sid])[0]
            assert np.abs(out - _ref_prefix(k, v, q, n)).max() < 1e-4
            release.set()
            proc.join(60)
            assert proc.exitcode == 0
            assert len(seen) > 1                     # it really read while the writer wrote
            assert cache.check() == []
        finally:
            go.set()
            release.set()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def test_attention_in_a_forked_child(make_cache, threads):
    """Workers are forked from a parent that already ran the kernel on its thread pool: the
    child's pool must start afresh (no inherited mutex held, no missing threads)."""
    threads(2)
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=64, num_blocks=1100,
                       block_size=16, dtype="float16")
    rng = np.random.default_rng(13)
    sid = cache.create_sequence()
    fill(cache, sid, 16000, rng)
    q = rng.standard_normal((1, 8, 64)).astype(np.float32)
    want = cache.attention(0, q, [sid])                       # runs on the pool
    assert_close(want, reference(cache, 0, q, [sid]))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                              # the child
        code = 1
        try:
            os.close(r)
            got = cache.attention(0, q, [sid])
            _attention.set_num_threads(2)
            got2 = cache.attention(0, q, [sid])
            code = 0 if (np.abs(got - want).max() < 1e-6
                         and np.abs(got2 - want).max() < 1e-6) else 3
            os.write(w, b"%d" % code)
        finally:
            os._exit(code)
    os.close(w)
    try:
        msg = os.read(r, 16)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(r)
    assert msg == b"0" and os.waitstatus_to_exitcode(status) == 0
    assert_close(cache.attention(0, q, [sid]), reference(cache, 0, q, [sid]))


# ---- threads and ISA knobs ------------------------------------------------------------------
def test_thread_and_isa_knobs(threads):
    assert _attention.get_num_threads() >= 1
    threads(3)
    assert shmkv.get_num_threads() == 3
    shmkv.set_num_threads(0)                                 # 0: back to the affinity mask
    assert shmkv.get_num_threads() == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="expected 0 <= n"):
        shmkv.set_num_threads(-1)
    with pytest.raises(ValueError, match="isa"):
        _attention._force_isa("sse9")
    assert _attention.isa() in ISAS


def test_read_floor_helper():
    buf = np.ones(1 << 20, np.uint8)
    assert _bench.bench_read(buf) > 0
    assert _bench.bench_read(buf, threads=1) > 0


def test_fma_rate_helper(isa):
    """The benchmark's dot-product bound: lane-FMAs per second in the path's width.  A
    vector path runs several lanes per FMA: far above the scalar rate of the same CPU."""
    rate = _bench.bench_fma(threads=1, rounds=200_000)
    assert rate > 0
    if isa != "scalar":
        _attention._force_isa("scalar")
        try:
            assert rate > 3 * _bench.bench_fma(threads=1, rounds=50_000)
        finally:
            _attention._force_isa(isa)
    for bad in ({"threads": -1}, {"threads": 5000}, {"rounds": 0}):
        with pytest.raises(ValueError, match="expected"):
            _bench.bench_fma(**bad)


# ---- bad input: the contract's errors, and the segment unchanged ----------------------------
@pytest.fixture
def loaded(make_cache):
    cache = make_cache(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=32, block_size=4)
    rng = np.random.default_rng(14)
    sids = [cache.create_sequence() for _ in range(2)]
    for sid, n in zip(sids, [5, 9]):
        fill(cache, sid, n, rng)
    empty = cache.create_sequence()
    return cache, sids, empty


def _q(rows, heads=4, d=8, dtype=np.float32):
    return np.zeros((rows, heads, d), dtype)


BAD = [
    ("layer out of range", lambda s, e: dict(layer=2), IndexError, "0 <= layer < 2"),
    ("negative layer", lambda s, e: dict(layer=-1), IndexError, "layer"),
    ("layer not int", lambda s, e: dict(layer=0.0), TypeError, "layer"),
    ("q rank 2", lambda s, e: dict(q=np.zeros((2, 32), np.float32)), ValueError, "3 dim"),
    ("q head_dim", lambda s, e: dict(q=_q(2, d=16)), ValueError, "head_dim 8"),
    ("heads not multiple", lambda s, e: dict(q=_q(2, heads=3)), ValueError, "multiple"),
    ("q zero rows", lambda s, e: dict(q=_q(0), sids=[]), ValueError, "row"),
    ("q float64", lambda s, e: dict(q=_q(2, dtype=np.float64)), TypeError, "float32"),
    ("q int", lambda s, e: dict(q=_q(2, dtype=np.int32)), TypeError, "dtype"),
    ("q not array", lambda s, e: dict(q=[[[0.0] * 8] * 4] * 2), TypeError, "ndarray"),
    ("len(sids) != rows", lambda s, e: dict(sids=s[:1]), ValueError, "expected 2 ids"),
    ("unknown sid", lambda s, e: dict(sids=[s[0], 10 ** 6]), shmkv.SequenceNotFound,
     "1000000: unknown"),
    ("negative sid", lambda s, e: dict(sids=[s[0], -5]), shmkv.SequenceNotFound, "-5: unknown"),
    ("sid not int", lambda s, e: dict(sids=[s[0], "x"]), TypeError, "int"),
    ("float sid array", lambda s, e: dict(sids=np.array(s, np.float64)), TypeError, "integer"),
    ("empty sequence", lambda s, e: dict(sids=[s[0], e]), ValueError, "empty"),
    ("q_lens count", lambda s, e: dict(q_lens=[2]), ValueError, "one per sid"),
    ("q_lens sum", lambda s, e: dict(q=_q(3), q_lens=[1, 1]), ValueError, "summing"),
    ("q_lens zero", lambda s, e: dict(q=_q(3), q_lens=[0, 3]), ValueError, ">= 1"),
    ("q_lens > seq_len", lambda s, e: dict(q=_q(7), q_lens=[6, 1]), ValueError, "seq_len 5"),
    ("q_lens 2-d", lambda s, e: dict(q_lens=np.ones((1, 2), np.int64)), ValueError, "1-d"),
    ("out dtype", lambda s, e: dict(out=np.zeros((2, 4, 8), np.float64)), TypeError, "float32"),
    ("out shape", lambda s, e: dict(out=np.zeros((2, 4, 9), np.float32)), ValueError, "shape"),
    ("out not contiguous", lambda s, e: dict(out=np.zeros((2, 4, 16), np.float32)[:, :, ::2]),
     ValueError, "contiguous"),
    ("out read-only", lambda s, e: dict(out=np.broadcast_to(np.zeros(8, np.float32), (2, 4, 8))),
     ValueError, "writable"),
    ("out not array", lambda s, e: dict(out=[0.0]), TypeError, "ndarray"),
]


@pytest.mark.parametrize("what,args,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input(loaded, what, args, exc, msg):
    cache, sids, empty = loaded
    call = dict(layer=0, q=_q(2), sids=sids, q_lens=None, out=None)
    call.update(args(sids, empty))
    used = cache.stats()["used_blocks"]
    lens = [cache.seq_len(s) for s in sids]
    with pytest.raises(exc, match=msg):
        cache.attention(call.pop("layer"), call.pop("q"), call.pop("sids"), **call)
    assert cache.stats()["used_blocks"] == used
    assert [cache.seq_len(s) for s in sids] == lens
    assert cache.check() == []
    # and the cache still works
    assert cache.attention(0, _q(2), sids).shape == (2, 4, 8)


def test_out_overlapping_q_is_refused(loaded):
    cache, sids, _ = loaded
    buf = np.zeros((2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="overlap"):
        cache.attention(0, buf, sids, out=buf)


def test_bfloat16_q_needs_a_bfloat16_pool(make_cache):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    cache = make_cache(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=16, block_size=4,
                       dtype="float16")
    sid = cache.create_sequence()
    fill(cache, sid, 3, np.random.default_rng(15))
    with pytest.raises(TypeError, match="float32, float16 or the pool"):
        cache.attention(0, np.zeros((1, 2, 8), ml_dtypes.bfloat16), [sid])


def test_attention_after_close_is_an_error(make_cache):
    cache = make_cache()
    sid = cache.create_sequence()
    fill(cache, sid, 3, np.random.default_rng(16))
    cache.close()
    with pytest.raises(ValueError, match="closed"):
        cache.attention(0, _q(1, heads=2), [sid])


# ---- a hostile segment ----------------------------------------------------------------------
def _seq_field(cache, sid, field):
    lay = cache._debug_info()["layout"]
    seq = struct_layout()["seq"]
    off, code = seq["fields"][field]
    slot = sid % cache.config.max_seqs
    return np.ndarray((1,), np.dtype(code), buffer=segment_bytes(cache),
                      offset=lay["off_seqs"] + seq["size"] * slot + off)


def _table_entry(cache, sid, i):
    lay = cache._debug_info()["layout"]
    width = cache.config.max_blocks_per_seq
    slot = sid % cache.config.max_seqs
    return np.ndarray((1,), np.int32, buffer=segment_bytes(cache),
                      offset=lay["off_tables"] + 4 * (slot * width + i))


@pytest.mark.parametrize("bad", [-7, 10 ** 6, 2 ** 31 - 1])
def test_corrupt_block_table_is_segment_error(make_cache, isa, bad):
    cache = make_cache(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=32, block_size=4)
    sid = cache.create_sequence()
    fill(cache, sid, 10, np.random.default_rng(17))
    entry = _table_entry(cache, sid, 1)
    good = int(entry[0])
    entry[0] = bad
    try:
        with pytest.raises(shmkv.SegmentError):
            cache.attention(0, _q(1, heads=2), [sid])
        with pytest.raises(shmkv.SegmentError):
            cache.attention(0, _q(3, heads=2), [sid], q_lens=[3])
    finally:
        entry[0] = good
    assert cache.attention(0, _q(1, heads=2), [sid]).shape == (1, 2, 8)
    assert cache.check() == []


@pytest.mark.parametrize("bad", [10 ** 6, 2 ** 32 - 1, 13])
def test_corrupt_sequence_length_is_segment_error(make_cache, bad):
    cache = make_cache(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=32, block_size=4)
    sid = cache.create_sequence()
    fill(cache, sid, 10, np.random.default_rng(18))      # 3 blocks: 13 tokens would need 4
    length = _seq_field(cache, sid, "len")
    good = int(length[0])
    length[0] = bad
    try:
        with pytest.raises(shmkv.SegmentError):
            cache.attention(0, _q(1, heads=2), [sid])
    finally:
        length[0] = good
    assert cache.check() == []



@pytest.mark.parametrize("var", ["SHMKV_ISA", "SHMKV_ATTN_ISA"])
def test_one_override_caps_every_kernel(var):
    """kernels/cpu.h reads one override, SHMKV_ISA (SHMKV_ATTN_ISA, its older name, still
    works): it caps the attention kernel, the quantizers and the vLLM copy alike; a _force
    hook's None returns to that cap, and the CPU's best is still reported."""
    code = ("from shmkv import _attention, _quant, _vcopy\n"
            "_attention._force_isa('scalar'); _attention._force_isa(None)\n"
            "print(_attention.isa(), _quant._force_quant_isa(None), _vcopy.transpose_isa(),"
            " _attention.cpu_isa() == %r)" % _attention.cpu_isa())
    env = {k: v for k, v in os.environ.items() if k not in ("SHMKV_ISA", "SHMKV_ATTN_ISA")}
    env[var] = "scalar"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["scalar", "scalar", "portable", "True"]
