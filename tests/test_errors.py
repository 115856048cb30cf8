"""Bad input and exhaustion: every error row of the API contract
(docs/reference/index.md, "Errors").

Every bad call must raise the documented exception (messages name expected vs. got) and
leave the segment exactly as it was: same stats, same sequences, same tables, same bytes,
check() == [].
"""
import contextlib
import functools
import types

import numpy as np
import pytest
from workers.mp_workers import assert_consistent, assert_same, footprint, tokens

import shmkv

HUGE = [2 ** 31, 2 ** 32, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 2 ** 70, 10 ** 30]


@pytest.fixture
def env(make_cache):
    """A cache with a few sequences: s (6 tokens, a partial last block), f (a fork of s),
    e (empty), dead (freed)."""
    cache = make_cache()
    cfg = cache.config
    x = types.SimpleNamespace(cache=cache, cfg=cfg)
    x.k, x.v = tokens(cfg, 6, 11)
    x.s = cache.create_sequence()
    cache.append(x.s, x.k, x.v)
    x.f = cache.fork(x.s)
    x.e = cache.create_sequence()
    x.dead = cache.create_sequence()
    cache.append(x.dead, x.k, x.v)
    cache.free(x.dead)
    x.slots = (cache.block_table(x.s)[0] * cfg.block_size + np.arange(2)).astype(np.int64)
    return x


def arr(cfg, *shape, dtype=None):
    return np.ones(shape, dtype or cfg.numpy_dtype)


def tok(cfg, n=1, dtype=None):
    return arr(cfg, cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)


def tok1(cfg, n=1, dtype=None):
    return arr(cfg, n, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)


def outs(cfg, n, dtype=None):
    return (tok(cfg, n, dtype), tok(cfg, n, dtype))


def expect_no_effect(x, call, exc, *in_msg):
    """call() raises exc, whose message contains every string of in_msg, and changes
    nothing at all."""
    before = footprint(x.cache)
    with pytest.raises(exc) as ei:
        call()
    msg = str(ei.value)
    for part in in_msg:
        assert part in msg, f"{part!r} not in message {msg!r}"
    after = footprint(x.cache)
    assert after == before
    assert_consistent(x.cache)
    return ei.value


# ========================================================================================
# wrong dtype: TypeError naming expected and got
# ========================================================================================
DTYPE_CASES = {
    # name: (call, the wrong dtype as the message should name it)
    "append k float32": (lambda c, x: c.append(x.s, tok(x.cfg, 1, np.float32),
                                               tok(x.cfg, 1)), "float32"),
    "append v float32": (lambda c, x: c.append(x.s, tok(x.cfg, 1),
                                               tok(x.cfg, 1, np.float32)), "float32"),
    "append k float64": (lambda c, x: c.append(x.s, tok(x.cfg, 1, np.float64),
                                               tok(x.cfg, 1)), "float64"),
    "append k int8": (lambda c, x: c.append(x.s, tok(x.cfg, 1, np.int8), tok(x.cfg, 1)),
                      "int8"),
    "append k int16": (lambda c, x: c.append(x.s, tok(x.cfg, 1, np.int16), tok(x.cfg, 1)),
                       "int16"),
    "append k big-endian": (lambda c, x: c.append(x.s, tok(x.cfg, 1, ">f2"),
                                                  tok(x.cfg, 1)), ">f2"),
    "write k float32": (lambda c, x: c.write(0, x.slots[:1], tok1(x.cfg, 1, np.float32),
                                             tok1(x.cfg, 1)), "float32"),
    "write v uint16": (lambda c, x: c.write(0, x.slots[:1], tok1(x.cfg, 1),
                                            tok1(x.cfg, 1, np.uint16)), "uint16"),
    "gather out[0] float32": (lambda c, x: c.gather(
        x.s, out=(tok(x.cfg, 6, np.float32), tok(x.cfg, 6))), "float32"),
    "gather out[1] float64": (lambda c, x: c.gather(
        x.s, out=(tok(x.cfg, 6), tok(x.cfg, 6, np.float64))), "float64"),
}


@pytest.mark.parametrize("case", sorted(DTYPE_CASES))
def test_wrong_dtype_is_type_error_naming_both(env, case):
    call, got = DTYPE_CASES[case]
    expect_no_effect(env, lambda: call(env.cache, env), TypeError, "float16", got)


@pytest.mark.parametrize("dtype,wrong", [("float32", np.float16), ("int8", np.uint8),
                                         ("int8", np.int8), ("float16", np.int8)])
def test_wrong_dtype_other_cache_dtypes(make_cache, dtype, wrong):
    cache = make_cache(dtype=dtype)
    cfg = cache.config
    x = types.SimpleNamespace(cache=cache, cfg=cfg)
    x.s = cache.create_sequence()
    good = tokens(cfg, 3, 0)
    cache.append(x.s, *good)
    bad = tok(cfg, 2, wrong)
    e = expect_no_effect(x, lambda: cache.append(x.s, bad, bad), TypeError, dtype)
    assert np.dtype(wrong).name in str(e)
    e = expect_no_effect(x, lambda: cache.gather(x.s, out=outs(cfg, 3, wrong)),
                         TypeError, dtype)
    assert np.dtype(wrong).name in str(e)
    slots = cache.reserve(x.s, 1)
    e = expect_no_effect(x, lambda: cache.write(1, slots, tok1(cfg, 1, wrong),
                                                tok1(cfg, 1, wrong)), TypeError, dtype)
    assert np.dtype(wrong).name in str(e)


# ========================================================================================
# wrong shapes, n < 1, ranges, layers: ValueError / IndexError naming expected and got
# ========================================================================================
SHAPE_CASES = {
    # name: (call, exception, strings the message must contain)
    "append 3-d k": (lambda c, x: c.append(x.s, tok1(x.cfg, 2), tok1(x.cfg, 2)),
                     ValueError, ["4", "(2, 2, 8)"]),
    "append 5-d k": (lambda c, x: c.append(x.s, arr(x.cfg, 1, 2, 1, 2, 8),
                                           arr(x.cfg, 1, 2, 1, 2, 8)),
                     ValueError, ["4", "(1, 2, 1, 2, 8)"]),
    "append 0-d k": (lambda c, x: c.append(x.s, np.float16(1), np.float16(1)),
                     (TypeError, ValueError), []),
    "append wrong layers": (lambda c, x: c.append(x.s, arr(x.cfg, 3, 1, 2, 8),
                                                  arr(x.cfg, 3, 1, 2, 8)),
                            ValueError, ["(3, 1, 2, 8)", "2"]),
    "append wrong heads": (lambda c, x: c.append(x.s, arr(x.cfg, 2, 1, 1, 8),
                                                 arr(x.cfg, 2, 1, 1, 8)),
                           ValueError, ["(2, 1, 1, 8)"]),
    "append wrong dim": (lambda c, x: c.append(x.s, arr(x.cfg, 2, 1, 2, 9),
                                               arr(x.cfg, 2, 1, 2, 9)),
                         ValueError, ["(2, 1, 2, 9)", "8"]),
    "append n=0": (lambda c, x: c.append(x.s, tok(x.cfg, 0), tok(x.cfg, 0)),
                   ValueError, ["(2, 0, 2, 8)"]),
    "append n=0 to empty": (lambda c, x: c.append(x.e, tok(x.cfg, 0), tok(x.cfg, 0)),
                            ValueError, ["(2, 0, 2, 8)"]),
    "append k/v n differ": (lambda c, x: c.append(x.s, tok(x.cfg, 2), tok(x.cfg, 3)),
                            ValueError, ["(2, 2, 2, 8)", "(2, 3, 2, 8)"]),
    "append v wrong dim": (lambda c, x: c.append(x.s, tok(x.cfg, 1),
                                                 arr(x.cfg, 2, 1, 2, 4)),
                           ValueError, ["(2, 1, 2, 4)"]),
    "append k list": (lambda c, x: c.append(x.s, tok(x.cfg).tolist(), tok(x.cfg)),
                      TypeError, ["ndarray", "list"]),
    "append v None": (lambda c, x: c.append(x.s, tok(x.cfg), None), TypeError, []),
    "append k object": (lambda c, x: c.append(x.s, tok(x.cfg, 1, object),
                                              tok(x.cfg, 1, object)), TypeError, ["object"]),
    "append fork n=0": (lambda c, x: c.append(x.f, tok(x.cfg, 0), tok(x.cfg, 0)),
                        ValueError, []),
    "gather stop > len": (lambda c, x: c.gather(x.s, 0, 7), IndexError, ["6", "7"]),
    "gather start > len": (lambda c, x: c.gather(x.s, 7, 7), IndexError, ["6", "7"]),
    "gather start > stop": (lambda c, x: c.gather(x.s, 4, 3), IndexError, ["4", "3"]),
    "gather start < 0": (lambda c, x: c.gather(x.s, -1, 3), (IndexError, ValueError),
                         ["-1"]),
    "gather stop < 0": (lambda c, x: c.gather(x.s, 0, -2), (IndexError, ValueError),
                        ["-2"]),
    "gather empty seq stop 1": (lambda c, x: c.gather(x.e, 0, 1), IndexError, ["0", "1"]),
    "gather out wrong n": (lambda c, x: c.gather(x.s, out=outs(x.cfg, 5)),
                           ValueError, ["(2, 6, 2, 8)", "(2, 5, 2, 8)"]),
    "gather out range n": (lambda c, x: c.gather(x.s, 1, 3, out=outs(x.cfg, 6)),
                           ValueError, ["(2, 2, 2, 8)", "(2, 6, 2, 8)"]),
    "gather out[1] shape": (lambda c, x: c.gather(x.s, out=(tok(x.cfg, 6),
                                                            arr(x.cfg, 2, 6, 2, 4))),
                            ValueError, ["(2, 6, 2, 8)", "(2, 6, 2, 4)"]),
    "gather out 3-d": (lambda c, x: c.gather(x.s, out=(tok1(x.cfg, 6), tok1(x.cfg, 6))),
                       ValueError, ["(6, 2, 8)"]),
    "gather out F-order": (lambda c, x: c.gather(
        x.s, out=(np.asfortranarray(tok(x.cfg, 6)), tok(x.cfg, 6))), ValueError,
        ["contiguous"]),
    "gather out strided": (lambda c, x: c.gather(
        x.s, out=(tok(x.cfg, 12)[:, ::2], tok(x.cfg, 6))), ValueError, ["contiguous"]),
    "gather out read-only": (lambda c, x: c.gather(
        x.s, out=(np.broadcast_to(np.float16(0), (2, 6, 2, 8)), tok(x.cfg, 6))),
        ValueError, []),
    "gather out overlapping": (lambda c, x: c.gather(x.s, out=(tok(x.cfg, 6),) * 2),
                               ValueError, []),
    "gather out list": (lambda c, x: c.gather(x.s, out=list(outs(x.cfg, 6))),
                        TypeError, ["tuple"]),
    "gather out 1-tuple": (lambda c, x: c.gather(x.s, out=(tok(x.cfg, 6),)), TypeError, []),
    "gather out 3-tuple": (lambda c, x: c.gather(x.s, out=outs(x.cfg, 6) + (tok(x.cfg, 6),)),
                           TypeError, []),
    "gather out of lists": (lambda c, x: c.gather(
        x.s, out=(tok(x.cfg, 6).tolist(), tok(x.cfg, 6))), TypeError, ["ndarray"]),
    "reserve n=0": (lambda c, x: c.reserve(x.s, 0), ValueError, ["0"]),
    "reserve n=-1": (lambda c, x: c.reserve(x.s, -1), ValueError, ["-1"]),
    "reserve n=-2**70": (lambda c, x: c.reserve(x.s, -2 ** 70), ValueError, []),
    "reserve np n=0": (lambda c, x: c.reserve(x.f, np.int64(0)), ValueError, ["0"]),
    "write layer -1": (lambda c, x: c.write(-1, x.slots[:1], tok1(x.cfg), tok1(x.cfg)),
                       (IndexError, ValueError), ["-1", "2"]),
    "write layer L": (lambda c, x: c.write(2, x.slots[:1], tok1(x.cfg), tok1(x.cfg)),
                      (IndexError, ValueError), ["2"]),
    "write layer 2**70": (lambda c, x: c.write(2 ** 70, x.slots[:1], tok1(x.cfg),
                                               tok1(x.cfg)), (IndexError, ValueError),
                          [str(2 ** 70)]),
    "write slot -1": (lambda c, x: c.write(0, np.array([x.slots[0], -1]), tok1(x.cfg, 2),
                                           tok1(x.cfg, 2)), (IndexError, ValueError),
                      ["-1", "256"]),
    "write slot = num slots": (lambda c, x: c.write(0, np.array([x.slots[0], 256]),
                                                    tok1(x.cfg, 2), tok1(x.cfg, 2)),
                               (IndexError, ValueError), ["256"]),
    "write slot 2**62": (lambda c, x: c.write(1, np.array([x.slots[0], 2 ** 62]),
                                              tok1(x.cfg, 2), tok1(x.cfg, 2)),
                         (IndexError, ValueError), []),
    "write slot uint64 max": (lambda c, x: c.write(1, np.array([2 ** 64 - 1], np.uint64),
                                                   tok1(x.cfg), tok1(x.cfg)),
                              (IndexError, ValueError), []),
    "write no slots": (lambda c, x: c.write(0, np.array([], np.int64), tok1(x.cfg, 0),
                                            tok1(x.cfg, 0)), ValueError, ["0"]),
    "write slots 2-d": (lambda c, x: c.write(0, x.slots.reshape(1, 2), tok1(x.cfg, 2),
                                             tok1(x.cfg, 2)), ValueError, ["(1, 2)"]),
    "write slots float": (lambda c, x: c.write(0, x.slots.astype(np.float64),
                                               tok1(x.cfg, 2), tok1(x.cfg, 2)),
                          TypeError, ["float64"]),
    "write slots bool": (lambda c, x: c.write(0, np.array([True]), tok1(x.cfg),
                                              tok1(x.cfg)), TypeError, ["bool"]),
    "write k n != slots": (lambda c, x: c.write(0, x.slots, tok1(x.cfg, 3), tok1(x.cfg, 3)),
                           ValueError, ["(2, 2, 8)", "(3, 2, 8)"]),
    "write v shape": (lambda c, x: c.write(0, x.slots, tok1(x.cfg, 2),
                                           arr(x.cfg, 2, 2, 4)),
                      ValueError, ["(2, 2, 8)", "(2, 2, 4)"]),
    "write 4-d k": (lambda c, x: c.write(0, x.slots, tok(x.cfg, 2), tok(x.cfg, 2)),
                    ValueError, ["3", "(2, 2, 2, 8)"]),
    "key_cache layer L": (lambda c, x: c.key_cache(2), (IndexError, ValueError), ["2"]),
    "key_cache layer -1": (lambda c, x: c.key_cache(-1), (IndexError, ValueError), ["-1"]),
    "value_cache layer 99": (lambda c, x: c.value_cache(99), (IndexError, ValueError),
                             ["99"]),
    "value_cache 2**64": (lambda c, x: c.value_cache(2 ** 64), (IndexError, ValueError), []),
    "batch 2-d": (lambda c, x: c.batch_block_tables([[x.s, x.f]]), ValueError, ["(1, 2)"]),
}


@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_wrong_shape_range_layer(env, case):
    call, exc, parts = SHAPE_CASES[case]
    expect_no_effect(env, lambda: call(env.cache, env), exc, *parts)


# ========================================================================================
# wrong types where ints are expected: TypeError; unknown ids: SequenceNotFound
# ========================================================================================
SID_CALLS = {
    "seq_len": lambda c, x, sid: c.seq_len(sid),
    "gather": lambda c, x, sid: c.gather(sid),
    "append": lambda c, x, sid: c.append(sid, tok(x.cfg), tok(x.cfg)),
    "fork": lambda c, x, sid: c.fork(sid),
    "free": lambda c, x, sid: c.free(sid),
    "reserve": lambda c, x, sid: c.reserve(sid, 1),
    "block_table": lambda c, x, sid: c.block_table(sid),
    "batch_block_tables": lambda c, x, sid: c.batch_block_tables([x.s, sid]),
    "detach": lambda c, x, sid: c.detach(sid),
    "adopt": lambda c, x, sid: c.adopt(sid),
    "owner_pid": lambda c, x, sid: c.owner_pid(sid),
}


BAD_SID_TYPES = {
    "float": lambda x: float(x.s),
    "float-frac": lambda x: x.s + 0.5,
    "np.float64": lambda x: np.float64(x.s),
    "bool": lambda x: True,
    "False": lambda x: False,
    "str": lambda x: str(x.s),
    "None": lambda x: None,
    "bytes": lambda x: b"1",
    "list": lambda x: [x.s],
    "complex": lambda x: complex(x.s, 0),
}


@pytest.mark.parametrize("kind", sorted(BAD_SID_TYPES))
@pytest.mark.parametrize("call", sorted(SID_CALLS))
def test_non_int_sid_is_type_error(env, call, kind):
    sid = BAD_SID_TYPES[kind](env)
    expect_no_effect(env, lambda: SID_CALLS[call](env.cache, env, sid), TypeError)


UNKNOWN_SIDS = {
    "freed": lambda x: x.dead,
    "never": lambda x: x.s + 12345 * x.cfg.max_seqs,
    "zero": lambda x: 0,
    "negative": lambda x: -1,
    "very negative": lambda x: -2 ** 63,
    "np.int64": lambda x: np.int64(x.dead),
    "np.uint64 max": lambda x: np.uint64(2 ** 64 - 1),
    **{f"huge {h:#x}": functools.partial(lambda h, x: h, h) for h in HUGE},
    **{f"-huge {h:#x}": functools.partial(lambda h, x: -h, h) for h in HUGE[3:]},
}


@pytest.mark.parametrize("which", sorted(UNKNOWN_SIDS))
@pytest.mark.parametrize("call", sorted(SID_CALLS))
def test_unknown_sid_is_sequence_not_found(env, call, which):
    sid = UNKNOWN_SIDS[which](env)
    e = expect_no_effect(env, lambda: SID_CALLS[call](env.cache, env, sid),
                         shmkv.SequenceNotFound)
    assert isinstance(e, KeyError) and isinstance(e, shmkv.ShmkvError)


def test_double_free_and_use_after_free(env):
    c = env.cache
    child = c.fork(env.f)
    c.free(child)
    for call in SID_CALLS.values():
        expect_no_effect(env, functools.partial(call, c, env, child), shmkv.SequenceNotFound)
    try:
        c.free(child)
    except KeyError:                       # catchable as the builtin too
        pass
    else:
        pytest.fail("second free did not raise")


BAD_INT_ARGS = {
    # name: (call, exception)
    "reserve n float": (lambda c, x: c.reserve(x.s, 1.0), TypeError),
    "reserve n bool": (lambda c, x: c.reserve(x.s, True), TypeError),
    "reserve n str": (lambda c, x: c.reserve(x.s, "1"), TypeError),
    "reserve n None": (lambda c, x: c.reserve(x.s, None), TypeError),
    "reserve n np.float": (lambda c, x: c.reserve(x.s, np.float32(2)), TypeError),
    "gather start float": (lambda c, x: c.gather(x.s, 1.0, 3), TypeError),
    "gather stop float": (lambda c, x: c.gather(x.s, 1, 3.0), TypeError),
    "gather start bool": (lambda c, x: c.gather(x.s, True, 3), TypeError),
    "gather stop bool": (lambda c, x: c.gather(x.s, 0, True), TypeError),
    "gather start str": (lambda c, x: c.gather(x.s, "0"), TypeError),
    "gather stop huge": (lambda c, x: c.gather(x.s, 0, 2 ** 70), (IndexError, ValueError)),
    "gather start huge": (lambda c, x: c.gather(x.s, 2 ** 64, 2 ** 64),
                          (IndexError, ValueError)),
    "gather stop 2**32": (lambda c, x: c.gather(x.s, 0, 2 ** 32), (IndexError, ValueError)),
    "gather stop -2**70": (lambda c, x: c.gather(x.s, 0, -2 ** 70), (IndexError, ValueError)),
    "gather stop np.uint64": (lambda c, x: c.gather(x.s, 0, np.uint64(2 ** 64 - 1)),
                              (IndexError, ValueError)),
    "write layer float": (lambda c, x: c.write(0.0, x.slots[:1], tok1(x.cfg), tok1(x.cfg)),
                          TypeError),
    "write layer bool": (lambda c, x: c.write(False, x.slots[:1], tok1(x.cfg), tok1(x.cfg)),
                         TypeError),
    "write layer None": (lambda c, x: c.write(None, x.slots[:1], tok1(x.cfg), tok1(x.cfg)),
                         TypeError),
    "key_cache float": (lambda c, x: c.key_cache(0.0), TypeError),
    "key_cache bool": (lambda c, x: c.key_cache(True), TypeError),
    "value_cache str": (lambda c, x: c.value_cache("0"), TypeError),
    "batch floats": (lambda c, x: c.batch_block_tables([float(x.s)]), TypeError),
    "batch fractional": (lambda c, x: c.batch_block_tables([x.s, x.f + 0.5]), TypeError),
    "batch bools": (lambda c, x: c.batch_block_tables([x.s, True]), TypeError),
    "batch float array": (lambda c, x: c.batch_block_tables(np.array([x.s], np.float64)),
                          TypeError),
    "batch bool array": (lambda c, x: c.batch_block_tables(np.array([True])), TypeError),
    "batch strs": (lambda c, x: c.batch_block_tables(["a"]), TypeError),
    "batch None": (lambda c, x: c.batch_block_tables(None), (TypeError, ValueError)),
    "batch int": (lambda c, x: c.batch_block_tables(x.s), (TypeError, ValueError)),
}


@pytest.mark.parametrize("case", sorted(BAD_INT_ARGS))
def test_float_bool_where_ints_expected(env, case):
    call, exc = BAD_INT_ARGS[case]
    expect_no_effect(env, lambda: call(env.cache, env), exc)


@pytest.mark.parametrize("n", HUGE)
def test_reserve_huge_n_is_cache_full_or_value_error(env, n):
    """A request longer than any sequence may be: CacheFullError (the sequence would
    exceed max_seq_len) or ValueError; never an OverflowError, never a partial grow."""
    e = expect_no_effect(env, lambda: env.cache.reserve(env.s, n),
                         (shmkv.CacheFullError, ValueError))
    assert not isinstance(e, OverflowError)


# ========================================================================================
# exhaustion: CacheFullError, also a MemoryError, and the call has no effect
# ========================================================================================
def fill(cache, leave_free, seed=0):
    """Sequences that take every block but `leave_free`, none near max_seq_len; the last
    one ends in a partial block.  Returns (last sid, its k, its v)."""
    cfg = cache.config
    nb = cache.stats()["free_blocks"] - leave_free
    assert nb >= 1
    while True:
        take = min(nb, cfg.max_blocks_per_seq // 2)
        sid = cache.create_sequence()
        nb -= take
        if nb == 0:
            k, v = tokens(cfg, take * cfg.block_size - 1, seed)
            cache.append(sid, k, v)
            break
        cache.append(sid, *tokens(cfg, take * cfg.block_size, seed + nb))
    assert cache.stats()["free_blocks"] == leave_free
    return sid, k, v


def _full(x, call):
    e = expect_no_effect(x, call, shmkv.CacheFullError)
    assert isinstance(e, MemoryError) and isinstance(e, shmkv.ShmkvError)
    return e


def test_pool_exhausted_append_and_reserve(make_cache):
    cache = make_cache()
    cfg = cache.config
    x = types.SimpleNamespace(cache=cache, cfg=cfg)
    sid, k, v = fill(cache, 0)
    bs = cfg.block_size
    e = _full(x, lambda: cache.append(sid, tok(cfg, 2), tok(cfg, 2)))
    assert "exhausted" in str(e) or "free" in str(e)
    _full(x, lambda: cache.reserve(sid, 2))
    other = cache.create_sequence()                # a sequence slot is not a block
    _full(x, lambda: cache.append(other, tok(cfg, 1), tok(cfg, 1)))
    _full(x, lambda: cache.reserve(other, 1))
    # the one free token slot of the partial last block still takes a token
    k1, v1 = tokens(cfg, 1, 99)
    cache.append(sid, k1, v1)
    assert cache.seq_len(sid) == len(cache.block_table(sid)) * bs
    assert cache.stats()["free_blocks"] == 0
    _full(x, lambda: cache.append(sid, tok(cfg, 1), tok(cfg, 1)))
    _full(x, lambda: cache.reserve(sid, 1))
    gk, gv = cache.gather(sid)
    assert_same(gk, np.concatenate([k, k1], 1))
    assert_same(gv, np.concatenate([v, v1], 1))
    # freeing makes room again, exactly
    nb = len(cache.block_table(sid))
    cache.free(sid)
    assert cache.stats()["free_blocks"] == nb
    cache.append(other, *tokens(cfg, 5, 1))
    assert_consistent(cache)


@pytest.mark.parametrize("free_left,want_blocks", [(0, 1), (1, 2), (2, 3), (3, 10)])
def test_pool_exhausted_is_all_or_nothing(make_cache, free_left, want_blocks):
    """A request for more blocks than are free takes none of them."""
    cache = make_cache()
    cfg = cache.config
    x = types.SimpleNamespace(cache=cache, cfg=cfg)
    whole = cache.create_sequence()
    cache.append(whole, *tokens(cfg, cfg.block_size, 3))      # ends on a block boundary
    fill(cache, free_left)
    fresh = cache.create_sequence()
    n = want_blocks * cfg.block_size
    for sid in (whole, fresh):
        _full(x, functools.partial(cache.append, sid, tok(cfg, n), tok(cfg, n)))
        _full(x, functools.partial(cache.reserve, sid, n))
    assert cache.seq_len(fresh) == 0 and len(cache.block_table(fresh)) == 0
    assert cache.stats()["free_blocks"] == free_left
    if free_left:                                             # what fits still fits
        cache.append(fresh, *tokens(cfg, free_left * cfg.block_size, 4))
        assert cache.stats()["free_blocks"] == 0
    assert_consistent(cache)


def test_pool_exhausted_copy_on_write(make_cache):
    """The copy of a shared partial block needs a free block: none → CacheFullError, and
    neither sequence changes."""
    cache = make_cache()
    cfg = cache.config
    x = types.SimpleNamespace(cache=cache, cfg=cfg)
    k, v = tokens(cfg, 6, 1)
    parent = cache.create_sequence()
    cache.append(parent, k, v)
    child = cache.fork(parent)
    filler, _, _ = fill(cache, 0, seed=2)
    cows = cache.stats()["cow_copies"]
    for sid in (child, parent):
        _full(x, functools.partial(cache.append, sid, tok(cfg, 1), tok(cfg, 1)))
        _full(x, functools.partial(cache.reserve, sid, 1))
    assert cache.stats()["cow_copies"] == cows
    assert cache.block_table(parent).tolist() == cache.block_table(child).tolist()
    for sid in (child, parent):
        gk, gv = cache.gather(sid)
        assert_same(gk, k)
        assert_same(gv, v)
    cache.free(filler)
    k2, v2 = tokens(cfg, 1, 5)
    cache.append(child, k2, v2)                               # now the copy happens
    assert cache.stats()["cow_copies"] == cows + 1
    assert_same(cache.gather(parent)[0], k)
    assert_same(cache.gather(child)[0], np.concatenate([k, k2], 1))
    assert_consistent(cache)


def test_sequence_slots_exhausted(make_cache):
    cache = make_cache(max_seqs=5)
    cfg = cache.config
    x = types.SimpleNamespace(cache=cache, cfg=cfg)
    sids = [cache.create_sequence() for _ in range(5)]
    cache.append(sids[0], *tokens(cfg, 6, 0))
    e = _full(x, lambda: cache.create_sequence())
    assert "slot" in str(e) or "max_seqs" in str(e)
    _full(x, lambda: cache.fork(sids[0]))
    _full(x, lambda: cache.fork(sids[1]))
    cache.free(sids[3])
    child = cache.fork(sids[0])                     # one slot back: room for one
    assert cache.block_table(child).tolist() == cache.block_table(sids[0]).tolist()
    _full(x, lambda: cache.create_sequence())
    assert sorted(cache.sequences()) == sorted(sids[:3] + sids[4:] + [child])
    for s in cache.sequences():
        cache.free(s)
    assert cache.stats()["free_blocks"] == cfg.num_blocks
    assert_consistent(cache)


@pytest.mark.parametrize("use", ["append", "reserve", "broadcast"])
def test_longer_than_max_seq_len(make_cache, use):
    cache = make_cache(max_seq_len=12)
    cfg = cache.config
    x = types.SimpleNamespace(cache=cache, cfg=cfg)
    sid = cache.create_sequence()
    cache.append(sid, *tokens(cfg, 10, 0))
    if use == "append":
        call = lambda: cache.append(sid, tok(cfg, 3), tok(cfg, 3))
    elif use == "reserve":
        call = lambda: cache.reserve(sid, 3)
    else:                               # read-only zero-stride input, still just too long
        b = np.broadcast_to(np.float16(1), tok(cfg, 3).shape)
        call = lambda: cache.append(sid, b, b)
    expect_no_effect(x, call, (shmkv.CacheFullError, ValueError))
    cache.append(sid, *tokens(cfg, 2, 1))                 # exactly max_seq_len is fine
    assert cache.seq_len(sid) == 12
    expect_no_effect(x, lambda: cache.reserve(sid, 1), (shmkv.CacheFullError, ValueError))


def test_cache_still_works_after_a_storm_of_bad_calls(env):
    c, cfg = env.cache, env.cfg
    # (whether each raises what it should is the other tests' business)
    for call, *_ in list(SHAPE_CASES.values()) + list(BAD_INT_ARGS.values()):
        with contextlib.suppress(Exception):
            call(c, env)
    k, v = tokens(cfg, 9, 42)
    c.append(env.s, k, v)
    gk, gv = c.gather(env.s)
    assert_same(gk, np.concatenate([env.k, k], 1))
    assert_same(gv, np.concatenate([env.v, v], 1))
    assert_same(c.gather(env.f)[0], env.k)
    assert_consistent(c)


def _unbound_methods():
    """Every public method of the handle's compiled classes, looked up on the class."""
    from shmkv import _core, _events, _inspect, _kvdata, _prefix, _quant, _sequences
    classes = [_core.Segment, _inspect.InspectOps, _prefix.PrefixOps, _sequences.SequenceOps,
               _quant.QuantOps, _kvdata.DataOps, _events.EventReader]
    out = []
    for cls in classes:
        for name, attr in vars(cls).items():
            # instance methods (class and static methods take no handle)
            if type(attr).__name__ == "method_descriptor" and not name.startswith("__"):
                out.append(pytest.param(cls, name, id=f"{cls.__name__}.{name}"))
    return out


def test_the_compiled_methods_are_method_descriptors():
    """binding=False took effect (else the test below would check nothing)."""
    assert len(_unbound_methods()) > 40


@pytest.mark.parametrize("cls,name", _unbound_methods())
def test_unbound_method_with_a_foreign_self_is_a_type_error(cls, name):
    """`KVCache.unlink("name")` -- a method called on the class with something else as
    self -- is a TypeError, not a crash: the compiled modules are built with binding=False,
    whose method descriptors check self (Cython 3's default cyfunctions do not, and read
    the str's memory as the handle's fields)."""
    with pytest.raises(TypeError):
        getattr(cls, name)("shmkv-not-a-handle")
