"""Copy-on-write: fork shares every block; the shared partial last block is copied before
it is written, so what one sequence gathers is never changed by another."""
import numpy as np
import pytest
from workers.mp_workers import assert_consistent, assert_same, empty_kv, tokens


class Seqs:
    """The cache plus the expected contents of every sequence; every step re-checks all
    of them, so a write that leaks into another sequence is seen at once."""

    def __init__(self, cache):
        self.cache = cache
        self.cfg = cache.config
        self.bs = self.cfg.block_size
        self.want = {}
        self.seed = 0

    def new(self, n=0):
        sid = self.cache.create_sequence()
        self.want[sid] = empty_kv(self.cfg)
        if n:
            self.append(sid, n)
        return sid

    def fresh(self, n):
        self.seed += 1
        return tokens(self.cfg, n, 1000 + self.seed)

    def append(self, sid, n):
        k, v = self.fresh(n)
        self.cache.append(sid, k, v)
        self._extend(sid, k, v)

    def reserve_write(self, sid, n):
        k, v = self.fresh(n)
        slots = self.cache.reserve(sid, n)
        for layer in range(self.cfg.num_layers):
            self.cache.write(layer, slots, k[layer], v[layer])
        self._extend(sid, k, v)
        return slots

    def _extend(self, sid, k, v):
        wk, wv = self.want[sid]
        self.want[sid] = (np.concatenate([wk, k], 1), np.concatenate([wv, v], 1))

    def fork(self, sid):
        child = self.cache.fork(sid)
        self.want[child] = tuple(a.copy() for a in self.want[sid])
        return child

    def free(self, sid):
        self.cache.free(sid)
        del self.want[sid]

    def table(self, sid):
        return self.cache.block_table(sid).tolist()

    def cows(self):
        return self.cache.stats()["cow_copies"]

    def used(self):
        return self.cache.stats()["used_blocks"]

    def verify(self):
        assert sorted(self.cache.sequences()) == sorted(self.want)
        for sid, (k, v) in self.want.items():
            assert self.cache.seq_len(sid) == k.shape[1]
            gk, gv = self.cache.gather(sid)
            assert_same(gk, k, f"sequence {sid} k")
            assert_same(gv, v, f"sequence {sid} v")
        assert_consistent(self.cache)


@pytest.fixture(params=["float16", "float32", "int8"])
def seqs(request, make_cache):
    return Seqs(make_cache(dtype=request.param))


def test_fork_shares_every_block(seqs):
    p = seqs.new(6)                         # 2 blocks, 2 tokens in the partial last one
    st = seqs.cache.stats()
    c = seqs.fork(p)
    assert seqs.table(c) == seqs.table(p) and len(seqs.table(p)) == 2
    st2 = seqs.cache.stats()
    assert st2["used_blocks"] == st["used_blocks"] == 2        # nothing copied on fork
    assert st2["forks"] == st["forks"] + 1
    assert st2["allocations"] == st["allocations"]
    assert st2["cow_copies"] == st["cow_copies"]
    seqs.verify()


@pytest.mark.parametrize("first", ["parent", "child"])
@pytest.mark.parametrize("n1,n2", [(1, 1), (2, 1), (1, 7), (7, 3), (5, 9)])
def test_append_parent_and_child_in_both_orders(seqs, first, n1, n2):
    bs = seqs.bs
    p = seqs.new(6)
    c = seqs.fork(p)
    shared = seqs.table(p)
    a, b = (p, c) if first == "parent" else (c, p)
    cows = seqs.cows()
    seqs.append(a, n1)
    seqs.verify()
    # a got its own copy of the partial block; the full block is still shared
    assert seqs.cows() == cows + 1
    ta, tb = seqs.table(a), seqs.table(b)
    assert tb == shared                                  # b is untouched
    assert ta[0] == shared[0]                            # the full block: shared
    assert ta[1] != shared[1]                            # the partial one: copied
    assert len(ta) == -(-(6 + n1) // bs)
    assert not set(ta[1:]) & set(shared)
    assert seqs.used() == 2 + len(ta) - 1
    # now b is the only holder of the old partial block: it writes in place
    seqs.append(b, n2)
    seqs.verify()
    assert seqs.cows() == cows + 1
    tb2 = seqs.table(b)
    assert tb2[:2] == shared
    assert seqs.table(a) == ta
    assert seqs.used() == len(set(seqs.table(a)) | set(tb2))


def test_block_aligned_fork_needs_no_copy(seqs):
    p = seqs.new(2 * seqs.bs)
    c = seqs.fork(p)
    cows = seqs.cows()
    seqs.append(c, 1)
    seqs.append(p, 3)
    seqs.verify()
    assert seqs.cows() == cows
    tp, tc = seqs.table(p), seqs.table(c)
    assert tp[:2] == tc[:2] and tp[2] != tc[2]


def test_beam_search_many_forks(seqs):
    prompt = seqs.new(6)
    shared = seqs.table(prompt)
    beams = [seqs.fork(prompt) for _ in range(4)]
    cows = seqs.cows()
    for _ in range(5):
        for b in beams:
            seqs.append(b, 1)
        seqs.verify()
    # each beam copied the partial block once (the prompt kept the original)
    assert seqs.cows() == cows + 4
    assert seqs.table(prompt) == shared
    tables = [seqs.table(b) for b in beams]
    for t in tables:
        assert t[0] == shared[0] and len(t) == 3
    privately = [set(t[1:]) for t in tables]
    for i in range(4):
        assert not privately[i] & set(shared)
        for j in range(i):
            assert not privately[i] & privately[j]
    assert seqs.used() == 2 + 4 * 2
    # a beam is pruned, another forks from a survivor (its partial block shared again)
    seqs.free(beams.pop(0))
    nb = seqs.fork(beams[0])
    seqs.append(nb, 2)
    seqs.append(beams[0], 2)
    seqs.verify()
    for sid in list(seqs.want):
        seqs.free(sid)
    seqs.verify()
    assert seqs.used() == 0


def test_fork_of_a_fork(seqs):
    p = seqs.new(6)
    c = seqs.fork(p)
    g = seqs.fork(c)
    shared = seqs.table(p)
    assert seqs.table(c) == seqs.table(g) == shared
    cows = seqs.cows()
    seqs.append(c, 3)                    # p, g still share the original partial block
    seqs.verify()
    assert seqs.table(p) == seqs.table(g) == shared
    seqs.append(g, 1)                    # p still holds it: g copies too
    seqs.verify()
    assert seqs.table(p) == shared
    seqs.append(p, 2)                    # p is its last holder: in place
    seqs.verify()
    assert seqs.cows() == cows + 2
    assert seqs.table(p)[:2] == shared
    tc, tg = seqs.table(c), seqs.table(g)
    assert tc[0] == tg[0] == shared[0]
    assert len({tc[1], tg[1], shared[1]}) == 3
    gg = seqs.fork(g)                    # and a fork of the fork of the fork
    seqs.append(gg, 4)
    seqs.verify()


@pytest.mark.parametrize("diverged", [False, True])
def test_free_parent_then_append_child(seqs, diverged):
    p = seqs.new(6)
    c = seqs.fork(p)
    if diverged:
        seqs.append(p, 1)               # p now has its own copy; c holds the original
    tc = seqs.table(c)
    used = seqs.used()
    frees = seqs.cache.stats()["frees"]
    seqs.free(p)
    seqs.verify()
    # only p's private blocks went back; the shared ones stay for c
    assert seqs.used() == used - (1 if diverged else 0)
    assert seqs.cache.stats()["frees"] == frees + (1 if diverged else 0)
    cows = seqs.cows()
    seqs.append(c, 5)                    # sole holder now: no copy
    seqs.verify()
    assert seqs.cows() == cows
    assert seqs.table(c)[:2] == tc
    seqs.free(c)
    seqs.verify()
    assert seqs.used() == 0


def test_free_child_keeps_parent(seqs):
    p = seqs.new(9)
    c = seqs.fork(p)
    seqs.append(c, 4)
    seqs.free(c)
    seqs.verify()
    assert seqs.used() == 3
    seqs.append(p, 1)
    seqs.verify()


def test_reserve_write_on_a_forked_sequence(seqs):
    bs = seqs.bs
    p = seqs.new(6)
    c = seqs.fork(p)
    shared = seqs.table(p)
    cows = seqs.cows()
    slots = seqs.reserve_write(c, 3)
    tc = seqs.table(c)
    assert seqs.cows() == cows + 1
    assert tc[0] == shared[0] and tc[1] != shared[1]
    # the slots point into c's private copy, after the 2 copied tokens
    assert slots.tolist() == [tc[1] * bs + 2, tc[1] * bs + 3, tc[2] * bs + 0]
    assert seqs.table(p) == shared
    seqs.verify()                        # c = prompt + written, p = prompt
    # the other way round: reserve on the parent of a fresh fork
    c2 = seqs.fork(p)
    slots = seqs.reserve_write(p, 1)
    assert seqs.cows() == cows + 2
    tp = seqs.table(p)
    assert tp[1] != shared[1] and slots.tolist() == [tp[1] * bs + 2]
    assert seqs.table(c2) == shared
    seqs.verify()
    # reserve + write into a shared full-block boundary: nothing to copy
    q = seqs.new(2 * bs)
    d = seqs.fork(q)
    seqs.reserve_write(d, 2)
    assert seqs.cows() == cows + 2
    seqs.verify()


def test_copied_block_holds_the_shared_prefix(seqs):
    """The copy carries the tokens already in the partial block, in every layer, K and V."""
    bs = seqs.bs
    p = seqs.new(bs + 3)
    c = seqs.fork(p)
    seqs.append(c, 1)
    src, dst = seqs.table(p)[1], seqs.table(c)[1]
    assert src != dst
    for layer in range(seqs.cfg.num_layers):
        for pool in (seqs.cache.key_cache(layer), seqs.cache.value_cache(layer)):
            assert_same(pool[dst, :3], pool[src, :3])
    seqs.verify()


def test_private_block_writes_through_views_stay_private(seqs):
    p = seqs.new(6)
    c = seqs.fork(p)
    seqs.append(c, 1)
    tc = seqs.table(c)
    kc = seqs.cache.key_cache(0)
    k, _ = seqs.fresh(1)
    kc[tc[1], 0] = k[0, 0]               # c's private copy of the partial block
    seqs.want[c][0][0, 4] = k[0, 0]
    seqs.verify()                        # p did not change


def test_fork_empty_sequence(seqs):
    e = seqs.new(0)
    c = seqs.fork(e)
    assert seqs.table(c) == []
    seqs.append(c, 3)
    seqs.append(e, 5)
    seqs.verify()
    assert not set(seqs.table(c)) & set(seqs.table(e))


def test_interleaved_random_cow(seqs):
    """A few hundred random forks/appends/frees/reserves, everything re-checked."""
    rng = np.random.default_rng(1)
    seqs.new(5)
    for step in range(150):
        live = sorted(seqs.want)
        r = rng.random()
        if not live:
            seqs.new(int(rng.integers(0, 6)))
            continue
        sid = live[int(rng.integers(len(live)))]
        total = sum(len(seqs.table(s)) for s in live)
        if r < 0.25 and len(live) < 12:
            seqs.fork(sid)
        elif r < 0.55 and total < 40:
            seqs.append(sid, int(rng.integers(1, 6)))
        elif r < 0.7 and total < 40:
            seqs.reserve_write(sid, int(rng.integers(1, 4)))
        elif r < 0.85:
            seqs.free(sid)
        else:
            seqs.new(int(rng.integers(0, 6)))
        if step % 5 == 0:
            seqs.verify()
            used = set()
            for s in seqs.want:
                used.update(seqs.table(s))
            assert seqs.used() == len(used)
    seqs.verify()
