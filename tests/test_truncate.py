"""KVCache.truncate(sid, n) (the API contract, "Sequences"): keep the first n tokens
in place.  Unit tests against a model of the data and the refcounts, copy-on-write after
a truncate, prefix hashes, errors with nothing changed, another process truncating, and
a process killed inside truncate (crash point truncate_mid)."""
import multiprocessing as mp

import numpy as np
import pytest
from workers import truncate_workers
from workers.mp_workers import assert_same, footprint, tokens

import shmkv
from shmkv.inspect import snapshot

ctx = mp.get_context("spawn")


def _filled(cache, n, seed, ids=None):
    sid = cache.create_sequence()
    k, v = tokens(cache.config, n, seed)
    cache.append(sid, k, v, tokens=ids)
    return sid, k, v


def _refcounts(cache):
    return snapshot(cache.name)["ref_cnt"]


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_every_n_keeps_the_data_and_returns_the_blocks(make_cache, dtype):
    """Every n in 0..len (block boundaries included): the first n tokens and their ids
    unchanged, the table cut to the blocks that hold them, every other block free."""
    cache = make_cache(dtype=dtype)
    bs = cache.config.block_size
    L = 3 * bs + 2
    ids = np.arange(50, 50 + L)
    for n in range(L + 1):
        sid, k, v = _filled(cache, L, n, ids)
        table = cache.block_table(sid).tolist()
        free = cache.stats()["free_blocks"]
        cache.truncate(sid, n)
        keep = -(-n // bs)
        assert cache.seq_len(sid) == n
        assert cache.block_table(sid).tolist() == table[:keep]
        assert cache.stats()["free_blocks"] == free + len(table) - keep
        gk, gv = cache.gather(sid)
        assert_same(gk, k[:, :n], f"k after truncate to {n}")
        assert_same(gv, v[:, :n], f"v after truncate to {n}")
        assert cache.token_ids(sid).tolist() == ids[:n].tolist()
        assert cache.check() == []
        # the sequence goes on from n: what it gathers is the kept part + the new part
        k2, v2 = tokens(cache.config, 5, 100 + n)
        cache.append(sid, k2, v2, tokens=np.arange(900, 905))
        gk, gv = cache.gather(sid)
        assert_same(gk, np.concatenate([k[:, :n], k2], 1))
        assert_same(gv, np.concatenate([v[:, :n], v2], 1))
        assert cache.token_ids(sid).tolist() == ids[:n].tolist() + list(range(900, 905))
        cache.free(sid)
        assert cache.check() == [] and cache.stats()["used_blocks"] == 0


def test_truncate_to_the_length_changes_nothing(cache):
    sid, k, _ = _filled(cache, 7, 1)
    before = footprint(cache)
    cache.truncate(sid, 7)
    assert footprint(cache) == before


@pytest.mark.parametrize("n", [0, 3, 4, 5, 8, 9])
def test_forked_blocks_are_decrefd_and_copied_on_write(cache, n):
    """A shares every block with its fork B: truncate releases nothing to the pool
    (refcounts drop by one), and an append into a kept shared partial block copies it,
    so neither sequence ever sees the other's writes."""
    bs = cache.config.block_size
    a, k, v = _filled(cache, 10, 1)                    # 3 blocks, the last partial
    b = cache.fork(a)
    table = cache.block_table(a).tolist()
    rc = _refcounts(cache)
    free, cows = cache.stats()["free_blocks"], cache.stats()["cow_copies"]
    cache.truncate(a, n)
    keep = -(-n // bs)
    after = _refcounts(cache)
    for i, blk in enumerate(table):
        assert after[blk] == rc[blk] - (0 if i < keep else 1), (i, blk)
    assert cache.stats()["free_blocks"] == free
    ka, va = tokens(cache.config, 3, 2)
    cache.append(a, ka, va)
    copied = 1 if n % bs else 0
    assert cache.stats()["cow_copies"] == cows + copied
    assert_same(cache.gather(b)[0], k)
    assert_same(cache.gather(a)[0], np.concatenate([k[:, :n], ka], 1))
    kb, vb = tokens(cache.config, 4, 3)
    cache.append(b, kb, vb)
    assert_same(cache.gather(a)[0], np.concatenate([k[:, :n], ka], 1))
    assert_same(cache.gather(b)[1], np.concatenate([v, vb], 1))
    assert cache.check() == []
    cache.free(a)
    cache.free(b)
    assert cache.stats()["used_blocks"] == 0 and cache.check() == []


def test_the_fork_truncated_the_parent_copies_too(cache):
    """The fork truncates into a block the parent holds whole; the parent frees it, so
    the truncated one is its only holder -- its next write still copies (the mark set
    at truncate time), because the block may have been published meanwhile."""
    bs = cache.config.block_size
    ids = np.arange(2 * bs + 1)
    a, k, v = _filled(cache, 2 * bs + 1, 1, ids)      # blocks 0, 1 full and published
    b = cache.fork(a)
    cache.truncate(b, bs + 1)
    cache.free(a)                                      # block 1: only b holds it now
    cows = cache.stats()["cow_copies"]
    kb, vb = tokens(cache.config, 2, 5)
    cache.append(b, kb, vb)
    assert cache.stats()["cow_copies"] == cows + 1
    # block 1 is still findable whole, with the parent's data
    c = cache.create_sequence(tokens=ids)
    assert cache.seq_len(c) == 2 * bs
    assert_same(cache.gather(c)[0], k[:, :2 * bs])
    assert cache.check() == []


def test_prefix_hashes_of_kept_blocks_stay_and_the_partial_tail_is_copied(make_cache):
    """Blocks kept whole stay published; the block cut in two stays findable whole for
    others (it is full in the pool) and the sequence writes its new tokens into a copy,
    which is not findable until it is full again, then under its own hash."""
    cache = make_cache(num_blocks=32)
    bs = cache.config.block_size
    ids = np.arange(10, 10 + 3 * bs + 2)
    a, k, v = _filled(cache, len(ids), 1, ids)         # blocks 0-2 published
    other = shmkv.KVCache.attach(cache.name)
    try:
        assert other.match_prefix(ids) == 3 * bs
        cache.truncate(a, bs + 2)
        assert snapshot(cache.name)["sequences"][0]["hashed"] == 1
        # whole kept block 0 still hits; block 1 (cut) and 2 (released, cached) too
        assert other.match_prefix(ids[:bs + 1]) == bs
        assert other.match_prefix(ids) == 3 * bs
        new = np.arange(500, 500 + bs)              # refills block 1, 2 into block 2
        kn, vn = tokens(cache.config, bs, 2)
        cache.append(a, kn[:, :1], vn[:, :1], tokens=new[:1])
        seq_ids = np.concatenate([ids[:bs + 2], new[:1]])
        # the sequence's partial tail is not findable; the original block 1 still is
        assert other.match_prefix(np.concatenate([seq_ids, [7]])) == bs
        c = other.create_sequence(tokens=ids[:2 * bs + 1])
        assert other.seq_len(c) == 2 * bs
        assert_same(other.gather(c)[0], k[:, :2 * bs])    # not overwritten by a
        other.free(c)
        cache.append(a, kn[:, 1:], vn[:, 1:], tokens=new[1:])
        seq_ids = np.concatenate([ids[:bs + 2], new])
        assert cache.token_ids(a).tolist() == seq_ids.tolist()    # 2 blocks + 2
        assert other.match_prefix(np.concatenate([seq_ids, [7]])) == 2 * bs
        assert other.match_prefix(ids) == 3 * bs               # the old chain too
        assert cache.check() == []
    finally:
        other.close()


def test_hashed_exclusive_tail_truncated_in_place_is_copied(cache):
    """The cut block is hashed and only this sequence holds it: it stays in the index
    (whole), the next append copies it, check() sees the mark."""
    bs = cache.config.block_size
    ids = np.arange(2 * bs)
    a, k, _ = _filled(cache, 2 * bs, 1, ids)
    cache.truncate(a, bs + 1)
    assert cache.check() == []
    free, cows = cache.stats()["free_blocks"], cache.stats()["cow_copies"]
    cache.append(a, *tokens(cache.config, 1, 2))
    assert cache.stats()["cow_copies"] == cows + 1
    assert cache.stats()["free_blocks"] == free        # a copy taken, the original cached
    c = cache.create_sequence(tokens=np.concatenate([ids, [1]]))
    assert cache.seq_len(c) == 2 * bs
    assert_same(cache.gather(c)[0], k)


def test_an_untracked_sequence_cut_to_its_hashed_blocks_is_tracked_again(cache):
    """Appending without token ids stops the hashing; truncating back to the blocks
    whose ids were known starts it again."""
    bs = cache.config.block_size
    ids = np.arange(bs)
    a, _, _ = _filled(cache, bs, 1, ids)
    cache.append(a, *tokens(cache.config, bs, 2))       # untracked from here
    cache.truncate(a, bs)
    more = np.arange(100, 100 + bs)
    cache.append(a, *tokens(cache.config, bs, 3), tokens=more)
    assert cache.match_prefix(np.concatenate([ids, more, [1]])) == 2 * bs
    b, _, _ = _filled(cache, bs + 1, 4, np.arange(200, 200 + bs + 1))
    cache.append(b, *tokens(cache.config, bs, 5))       # untracked
    cache.truncate(b, bs + 1)                           # past the hashed blocks: still
    cache.append(b, *tokens(cache.config, bs - 1, 6), tokens=np.arange(bs - 1))
    assert cache.match_prefix(np.concatenate([np.arange(200, 200 + bs + 1),
                                              np.arange(bs - 1), [1]])) == bs


def test_a_trimmed_sequence_truncates(cache):
    bs = cache.config.block_size
    a, k, v = _filled(cache, 6 * bs + 1, 1)
    dropped = cache.trim_streaming(a, bs, 2 * bs)
    kk = np.concatenate([k[:, :bs], k[:, bs + dropped:]], 1)
    assert_same(cache.gather(a)[0], kk)
    cache.truncate(a, bs + 2)
    assert_same(cache.gather(a)[0], kk[:, :bs + 2])
    assert cache.trimmed(a) == dropped
    assert cache.check() == []


def test_errors_change_nothing(cache):
    sid, _, _ = _filled(cache, 6, 1)
    f = cache.fork(sid)
    before = footprint(cache)
    for n in (7, 100, -1, 2 ** 40):
        with pytest.raises(ValueError, match=r"expected 0 <= n <= seq_len 6, got"):
            cache.truncate(sid, n)
    for n in (1.0, "3", True, None):
        with pytest.raises(TypeError, match="expected int"):
            cache.truncate(sid, n)
    with pytest.raises(shmkv.SequenceNotFound):
        cache.truncate(sid + 10 ** 6, 0)
    assert footprint(cache) == before
    cache.free(f)
    with pytest.raises(shmkv.SequenceNotFound):
        cache.truncate(f, 0)
    cache.truncate(sid, np.int64(2))                    # numpy ints are ints
    assert cache.seq_len(sid) == 2 and cache.check() == []


def test_another_process_truncates(cache, spawn):
    """A sequence this process created is truncated and extended by another one."""
    bs = cache.config.block_size
    sid, k, v = _filled(cache, 3 * bs, 1, np.arange(3 * bs))
    keep = cache.fork(sid)
    p = spawn(truncate_workers.truncate_and_append, cache.name, sid,
              bs + 1, 9, 3)
    p.join(timeout=60)
    assert p.exitcode == 0
    k2, v2 = tokens(cache.config, 3, 9)
    gk, gv = cache.gather(sid)
    assert_same(gk, np.concatenate([k[:, :bs + 1], k2], 1))
    assert_same(gv, np.concatenate([v[:, :bs + 1], v2], 1))
    assert cache.token_ids(sid).tolist() == list(range(bs + 1)) + [1000, 1001, 1002]
    assert_same(cache.gather(keep)[0], k)
    assert cache.check() == []
    cache.free(sid)
    cache.free(keep)
    assert cache.stats()["used_blocks"] == 0 and cache.check() == []


@pytest.mark.parametrize("shared", [False, True], ids=["own-tail-fast-path", "shared-tail"])
def test_death_inside_truncate(cache, spawn, shared):
    """A process killed halfway through releasing the tail (the length published): after
    recovery check() is clean, the sequence holds its first n tokens, a fork that
    shares the tail is intact, and freeing everything leaves no block used (nothing
    leaked, nothing freed twice)."""
    bs = cache.config.block_size
    sid, k, v = _filled(cache, 5 * bs + 2, 1, np.arange(5 * bs + 2))
    other, ko, _ = _filled(cache, 2 * bs, 2)
    keep = cache.fork(sid) if shared else None
    n = bs + 1
    p = spawn(truncate_workers.die_in_truncate, cache.name, sid, n)
    p.join(timeout=60)
    assert p.exitcode == 86, "truncate_mid did not fire"
    cache.recover()
    assert cache.check() == []
    assert cache.seq_len(sid) == n
    assert_same(cache.gather(sid)[0], k[:, :n])
    assert_same(cache.gather(sid)[1], v[:, :n])
    assert_same(cache.gather(other)[0], ko)
    if keep is not None:
        assert_same(cache.gather(keep)[0], k)
    cache.append(sid, *tokens(cache.config, 2 * bs, 3))      # the lock is free again
    assert cache.check() == []
    for s in [sid, other] + ([keep] if keep is not None else []):
        cache.free(s)
    st = cache.stats()
    assert cache.check() == []
    assert st["used_blocks"] == 0 and st["free_blocks"] == cache.config.num_blocks
