"""Prefill (several query rows per sequence) at the shapes the tile path takes: head_dim a
multiple of 32, float16/bfloat16 pools, groups that do not fill a tile, blocks that do not
line up with the 32-key steps, keys split over threads -- every ISA path against the
float64 reference (test_attention.reference)."""
import numpy as np
import pytest
from support import ISAS
from test_attention import _table_entry, assert_close, fill, reference

import shmkv
from shmkv import _attention


@pytest.fixture
def two_threads():
    before = _attention.get_num_threads()
    _attention.set_num_threads(2)
    try:
        yield
    finally:
        _attention.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("d,hkv,hq,bs", [(64, 3, 9, 16), (128, 2, 8, 5), (32, 1, 1, 7),
                                         (64, 2, 32, 16)])
def test_prefill_tiles_match_reference(make_cache, isa, two_threads, dtype, d, hkv, hq, bs):
    cache = make_cache(num_layers=1, num_kv_heads=hkv, head_dim=d, num_blocks=700 // bs * 4,
                       block_size=bs, dtype=dtype)
    rng = np.random.default_rng(d + hq + bs)
    lengths, q_lens = [700, 45, 33, 130], [70, 45, 1, 33]
    sids = [cache.create_sequence() for _ in lengths]
    for sid, n in zip(sids, lengths):
        fill(cache, sid, n, rng, scale=2.0)     # sharper softmax than unit scores
    q = rng.standard_normal((sum(q_lens), hq, d)).astype(np.float32)
    assert_close(cache.attention(0, q, sids, q_lens=q_lens),
                 reference(cache, 0, q, sids, q_lens))


@pytest.mark.parametrize("spread", [8.0, 16.0])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "float8_e4m3"])
def test_prefill_with_a_sharp_softmax(make_cache, isa, two_threads, dtype, spread):
    """Scores spread ~8 (K scaled by 8): an error in a score is an absolute error in its
    exponent, |s| times the relative one, so the tiles must keep q.k's second-order
    products (q lo . K lo, q's third piece . K hi, ...).  With first-order products only
    the float16 pool was off by 3.7e-5 here, past the bound; the FMA paths by ~4e-6.
    Spread ~16 puts weights below 2^-100 of the row's max, which exp now returns as
    exactly 0 (a denormal weight cost a microcode assist per product)."""
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=128, num_blocks=70,
                       block_size=16, dtype=dtype)
    rng = np.random.default_rng(1)
    sid = cache.create_sequence()
    fill(cache, sid, 1000, rng, scale=spread)
    q = rng.standard_normal((64, 8, 128)).astype(np.float32)
    assert_close(cache.attention(0, q, [sid], q_lens=[64]), reference(cache, 0, q, [sid], [64]))


def test_one_long_prefill_split_over_threads(make_cache, isa, two_threads):
    """Few row tiles and many keys: the keys are split into chunks merged by log-sum-exp."""
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=64, num_blocks=300,
                       block_size=16, dtype="bfloat16")
    rng = np.random.default_rng(3)
    sid = cache.create_sequence()
    fill(cache, sid, 4000, rng)
    q = rng.standard_normal((24, 8, 64)).astype(np.float32)
    assert_close(cache.attention(0, q, [sid], q_lens=[24]), reference(cache, 0, q, [sid], [24]))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_prefill_llama_shape_with_bf16_exact_heads(make_cache, isa, two_threads, dtype):
    """The tiles skip the lo half of q for a head whose q values are all exactly bf16 (a
    bf16 model's), and keep it for the others: here kv heads 0, 2, 5 get bf16-exact q, the
    rest full float32, so a head given the wrong treatment is off by ~1e-3.  Llama's
    shape (8 kv heads x 4, head_dim 128) with 64-row items keeps only some heads' state
    at once (head groups), and 900 keys make several key chunks per group."""
    cache = make_cache(num_layers=1, num_kv_heads=8, head_dim=128, num_blocks=80,
                       block_size=16, dtype=dtype)
    rng = np.random.default_rng(21)
    lengths, q_lens = [900, 150], [70, 40]
    sids = [cache.create_sequence() for _ in lengths]
    for sid, n in zip(sids, lengths):
        fill(cache, sid, n, rng, scale=2.0)
    q = rng.standard_normal((sum(q_lens), 32, 128)).astype(np.float32)
    exact = np.zeros(32, bool)
    for h in (0, 2, 5):
        exact[4 * h:4 * h + 4] = True
    q[:, exact] = (q[:, exact].view(np.uint32) & 0xFFFF0000).view(np.float32)
    assert_close(cache.attention(0, q, sids, q_lens=q_lens),
                 reference(cache, 0, q, sids, q_lens))


@pytest.mark.skipif("amx" not in ISAS, reason="this CPU has no AMX-BF16 (the tile path)")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_tile_path_is_the_one_taken_and_agrees_with_avx512(make_cache, dtype):
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=64, num_blocks=64,
                       block_size=16, dtype=dtype)
    rng = np.random.default_rng(4)
    sid = cache.create_sequence()
    fill(cache, sid, 600, rng)
    q = rng.standard_normal((40, 8, 64)).astype(np.float32)
    before = _attention.isa()
    try:
        _attention._force_isa("avx512")
        fma = cache.attention(0, q, [sid], q_lens=[40])
        _attention._force_isa("amx")
        tiles = cache.attention(0, q, [sid], q_lens=[40])
    finally:
        _attention._force_isa(before)
    # different arithmetic (split bf16 products on tiles vs fp32 FMAs), the same answer
    assert not np.array_equal(fma, tiles)
    assert np.abs(fma - tiles).max() < 2e-5


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("bad", [-7, 10 ** 6])
def test_corrupt_block_table_in_a_prefill_is_segment_error(make_cache, isa, dtype, bad):
    """A block id read from shared memory is checked on the tile path too (the tile state
    is released on the way out: the next call works)."""
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=64, num_blocks=64,
                       block_size=16, dtype=dtype)
    rng = np.random.default_rng(6)
    sid = cache.create_sequence()
    fill(cache, sid, 300, rng)
    q = rng.standard_normal((40, 8, 64)).astype(np.float32)
    entry = _table_entry(cache, sid, 17)                 # a block the last rows read
    good = int(entry[0])
    entry[0] = bad
    try:
        with pytest.raises(shmkv.SegmentError):
            cache.attention(0, q, [sid], q_lens=[40])
    finally:
        entry[0] = good
    assert_close(cache.attention(0, q, [sid], q_lens=[40]), reference(cache, 0, q, [sid], [40]))
    assert cache.check() == []


@pytest.fixture
def rows_item():
    """The row item forced for prefill rows (_force_rows), restored after."""
    try:
        yield lambda on: _attention._force_rows(on)
    finally:
        _attention._force_rows(False)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "float8_e4m3"])
@pytest.mark.parametrize("d,hkv,hq,bs", [(64, 2, 8, 16), (24, 3, 9, 5), (128, 1, 16, 32)])
def test_gemm_item_agrees_with_row_item(make_cache, isa, two_threads, rows_item, dtype, d, hkv,
                                        hq, bs):
    """The GEMM-shaped FMA item against the row item and the float64 reference:
    query vectors that do not fill the lanes (45 x 3), a row tile split into key chunks
    (one long sequence, 2 threads), a block size that does not divide the 32-key step,
    head_dim 24 (the AVX2 item, also under avx512), quantized pools.  The two items do
    different arithmetic, so where a vector ISA runs the GEMM item they must differ in
    the last bits -- proof that it ran -- and agree to fp32 error."""
    cache = make_cache(num_layers=1, num_kv_heads=hkv, head_dim=d, num_blocks=2200 // bs + 8,
                       block_size=bs, dtype=dtype)
    rng = np.random.default_rng(d + hq + bs)
    lengths, q_lens = [1500, 45, 300], [70, 45, 40]
    sids = [cache.create_sequence() for _ in lengths]
    for sid, n in zip(sids, lengths):
        fill(cache, sid, n, rng, scale=2.0)
    q = rng.standard_normal((sum(q_lens), hq, d)).astype(np.float32)
    want = reference(cache, 0, q, sids, q_lens)
    rows_item(True)
    by_rows = cache.attention(0, q, sids, q_lens=q_lens)
    rows_item(False)
    gemm = cache.attention(0, q, sids, q_lens=q_lens)
    assert_close(by_rows, want)
    assert_close(gemm, want)
    # the AMX tiles take every pool's rows where head_dim is a multiple of 32
    tiles = isa == "amx" and d % 32 == 0
    if isa == "scalar" or tiles:    # the row item (or the tiles) either way
        assert np.array_equal(gemm, by_rows)
    else:
        assert not np.array_equal(gemm, by_rows)
    # the first row of the 45-token prompt sees one key: v[0] exactly on either item
    _, v = cache.gather(sids[1])
    first = sum(q_lens[:1])
    g = hq // hkv
    for h in range(hq):
        assert np.array_equal(gemm[first, h], v[0, 0, h // g].astype(np.float32))


@pytest.mark.parametrize("what", [np.nan, np.inf])
def test_gemm_item_keeps_a_bad_query_row_to_itself(make_cache, isa, two_threads, what):
    """The lanes of the GEMM item are query vectors: a NaN/inf in one row's q makes that
    row's output whatever it is, never a crash, and leaves the other rows exact."""
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=64, num_blocks=128,
                       block_size=16, dtype="float32")
    rng = np.random.default_rng(8)
    sid = cache.create_sequence()
    fill(cache, sid, 600, rng)
    q = rng.standard_normal((48, 8, 64)).astype(np.float32)
    want = reference(cache, 0, q, [sid], [48])
    q[5, 3, 7] = what
    got = cache.attention(0, q, [sid], q_lens=[48])
    keep = np.ones(48, bool)
    keep[5] = False
    assert_close(got[keep], want[keep])


@pytest.mark.parametrize("q_lens,seq_lens,threads,expect", [
    # prefill on the GEMM items / tiles: one row tile per thread is enough, no key split
    ([128], [1024], 2, (64, None)),
    ([64] * 4, [1024] * 4, 2, (64, None)),
    ([512], [4096], 2, (64, None)),
    ([512], [512], 2, (64, None)),          # a fresh prompt: 8 tiles, the causal triangle
    # rows evened out (a multiple of the threads, >= 128 query vectors per kv head)
    ([96], [1024], 2, (48, None)),          # 48 + 48, not 64 + 32
    ([192], [1024], 2, (48, None)),         # 4 x 48, not 3 x 64
    ([64], [1024], 2, (32, None)),
    # one tile would hold the other thread back: its keys split
    ([32], [1024], 2, (64, 512)),
    ([24], [4000], 2, (64, 2000)),
    ([1, 1, 1, 32], [1024] * 4, 2, (64, 512)),   # three decode rows beside one prefill
    # one thread: nothing to balance
    ([32], [1024], 1, (64, None)),
    ([96], [1024], 1, (64, None)),
    # decode (one row per sequence): split while there are fewer than 4 items per thread
    ([1], [32768], 2, (64, 4096)),
    ([1] * 3, [4096] * 3, 2, (64, 1536)),
    ([1] * 8, [4096] * 8, 2, (64, None)),
])
def test_work_items_keep_the_threads_busy_without_needless_splits(q_lens, seq_lens, threads,
                                                                   expect):
    """The planner's choices for Llama's group of 4 on the GEMM items or the tiles.  A key
    split costs every chunk the item's fixed work again plus a merge on one thread: with
    the decode rule (split below 4 items per thread), 128 rows into 1k took 1.9x the time
    on 2 threads (RESULTS_attention_amx.md, eighth pass)."""
    assert _attention._plan(q_lens, seq_lens, 4, True, threads) == expect


def test_work_item_plan_without_the_wide_items_is_the_decode_rule():
    # the row item (no GEMM item, no tiles): 8 rows per item, split below 4 items per thread
    assert _attention._plan([32], [1024], 4, False, 2) == (8, 512)
    assert _attention._plan([128], [1024], 4, False, 2) == (8, None)


@pytest.mark.parametrize("args", [([], [], 4, True, 2), ([5], [4], 4, True, 2),
                                  ([0], [4], 4, True, 2), ([4], [4], 0, True, 2),
                                  ([4], [4], 4, True, 0), ([4, 4], [4], 4, True, 2)])
def test_work_item_plan_refuses_what_the_kernel_never_gets(args):
    with pytest.raises(ValueError, match="expected"):
        _attention._plan(*args)


@pytest.mark.parametrize("q_lens,lengths", [([96], [300]), ([1, 1, 1, 32], [300, 40, 300, 300])])
def test_evened_rows_and_a_dominant_tile_match_reference(make_cache, isa, two_threads,
                                                         q_lens, lengths):
    """The two prefill plans the decode rule never made: rows evened out (48 + 48) and
    the keys of one large tile split beside single decode rows."""
    cache = make_cache(num_layers=1, num_kv_heads=2, head_dim=64, num_blocks=100,
                       block_size=16, dtype="bfloat16")
    rng = np.random.default_rng(31)
    sids = [cache.create_sequence() for _ in lengths]
    for sid, n in zip(sids, lengths):
        fill(cache, sid, n, rng, scale=2.0)
    q = rng.standard_normal((sum(q_lens), 8, 64)).astype(np.float32)
    assert_close(cache.attention(0, q, sids, q_lens=q_lens),
                 reference(cache, 0, q, sids, q_lens))
