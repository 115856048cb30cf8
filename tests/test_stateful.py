"""A hypothesis state machine drives random create / append / fork / reserve+write / gather /
truncate / free / detach / adopt / close-and-reattach against a pure-Python model and compares every
gather exactly.  The pool is small, so CacheFullError happens; it must come exactly when
the pool (or the slots, or max_seq_len) is short, and have no effect at all."""
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support import unique_name
from workers.mp_workers import assert_same, footprint, tokens

import shmkv

SETTINGS = settings(max_examples=100, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

pick = st.integers(0, 1 << 16)


class KVCacheMachine(RuleBasedStateMachine):
    DTYPE = "float16"

    def __init__(self):
        super().__init__()
        self.cfg = shmkv.CacheConfig(num_layers=2, num_kv_heads=2, head_dim=4, num_blocks=9,
                                     block_size=4, max_seqs=6, dtype=self.DTYPE,
                                     max_seq_len=28)
        self.name = unique_name("sm")
        self.cache = shmkv.KVCache.create(self.name, self.cfg)
        self.model = {}            # sid -> (k, v): [num_layers, len, heads, dim] each
        self.detached = set()
        self.cow_tail = set()      # sids whose partial last block truncate kept shared
        self.seed = 0
        self.full_seen = 0

    def teardown(self):
        try:
            self.cache.close()
        finally:
            import posix_ipc

            try:
                posix_ipc.unlink_shared_memory("/" + self.name)
            except posix_ipc.ExistentialError:
                pass

    # ---- helpers ------------------------------------------------------------------------
    @staticmethod
    def _event(what):
        if currently_in_test_context():        # the fixed run below calls rules directly
            event(what)

    def _sid(self, i):
        live = sorted(self.model)
        return live[i % len(live)]

    def _fresh(self, n):
        self.seed += 1
        return tokens(self.cfg, n, self.seed)

    def _extend(self, sid, k, v):
        mk, mv = self.model[sid]
        self.model[sid] = (np.concatenate([mk, k], 1), np.concatenate([mv, v], 1))

    def _need(self, sid, n):
        """Blocks growing sid by n tokens takes (new ones + a copy of a shared partial
        last block), whether it is longer than max_seq_len, and how many fewer blocks are
        free afterwards (a copy made for a truncated tail nobody else holds any more
        releases the original)."""
        bs = self.cfg.block_size
        L = self.model[sid][0].shape[1]
        new = -(-(L + n) // bs) - -(-L // bs)
        cow = kept = 0
        if L % bs:
            last = self.cache.block_table(sid)[-1]
            holders = sum(1 for s in self.model if last in self.cache.block_table(s))
            cow = 1 if holders > 1 or sid in self.cow_tail else 0
            kept = 1 if holders > 1 else 0
        return new + cow, L + n > self.cfg.max_seq_len, new + kept

    def _grow(self, sid, n, how):
        k, v = self._fresh(n)
        need, too_long, taken = self._need(sid, n)
        before = footprint(self.cache)
        free = before["stats"]["free_blocks"]
        try:
            if how == "append":
                self.cache.append(sid, k, v)
            else:
                slots = self.cache.reserve(sid, n)
        except shmkv.CacheFullError:
            self.full_seen += 1
            self._event("CacheFullError: " + ("max_seq_len" if too_long else "pool"))
            assert too_long or need > free, (need, free)
            assert footprint(self.cache) == before
            return
        assert not too_long and need <= free, (need, free, too_long)
        self.cow_tail.discard(sid)             # a write into the tail copied it (or none)
        assert self.cache.stats()["free_blocks"] == free - taken
        if how == "reserve":
            L = self.model[sid][0].shape[1]
            table = self.cache.block_table(sid)
            bs = self.cfg.block_size
            assert slots.tolist() == [table[p // bs] * bs + p % bs for p in range(L, L + n)]
            for layer in reversed(range(self.cfg.num_layers)):
                self.cache.write(layer, slots, k[layer], v[layer])
        self._extend(sid, k, v)

    def _new_sequence(self, make):
        if len(self.model) >= self.cfg.max_seqs:
            before = footprint(self.cache)
            with pytest.raises(shmkv.CacheFullError):
                make()
            self.full_seen += 1
            self._event("CacheFullError: sequence slots")
            assert footprint(self.cache) == before
            return None
        return make()

    # ---- rules --------------------------------------------------------------------------
    @rule()
    def create(self):
        sid = self._new_sequence(self.cache.create_sequence)
        if sid is not None:
            assert sid not in self.model
            self.model[sid] = tokens(self.cfg, 0, 0)

    @precondition(lambda self: self.model)
    @rule(i=pick)
    def fork(self, i):
        src = self._sid(i)
        child = self._new_sequence(lambda: self.cache.fork(src))
        if child is not None:
            assert child not in self.model
            assert self.cache.block_table(child).tolist() == \
                self.cache.block_table(src).tolist()
            self.model[child] = tuple(a.copy() for a in self.model[src])
            if src in self.cow_tail:
                self.cow_tail.add(child)

    @precondition(lambda self: self.model)
    @rule(i=pick, n=st.integers(1, 9))
    def append(self, i, n):
        self._grow(self._sid(i), n, "append")

    @precondition(lambda self: self.model)
    @rule(i=pick, n=st.integers(1, 6))
    def reserve_write(self, i, n):
        self._grow(self._sid(i), n, "reserve")

    @precondition(lambda self: self.model)
    @rule(i=pick, data=st.data())
    def gather(self, i, data):
        sid = self._sid(i)
        k, v = self.model[sid]
        L = k.shape[1]
        a = data.draw(st.integers(0, L), label="start")
        b = data.draw(st.integers(a, L), label="stop")
        if data.draw(st.booleans(), label="out="):
            shape = (self.cfg.num_layers, b - a, self.cfg.num_kv_heads, self.cfg.head_dim)
            ko = np.full(shape, 7, self.cfg.compute_dtype)
            vo = np.full(shape, 7, self.cfg.compute_dtype)
            res = self.cache.gather(sid, a, b, out=(ko, vo))
            assert res[0] is ko and res[1] is vo
            gk, gv = ko, vo
        elif a == 0 and b == L and data.draw(st.booleans(), label="whole"):
            gk, gv = self.cache.gather(sid)
        else:
            gk, gv = self.cache.gather(sid, a, b)
        assert_same(gk, k[:, a:b], f"sequence {sid} k[{a}:{b}]")
        assert_same(gv, v[:, a:b], f"sequence {sid} v[{a}:{b}]")

    @precondition(lambda self: self.model)
    @rule(i=pick, data=st.data())
    def gather_out_of_range(self, i, data):
        sid = self._sid(i)
        L = self.model[sid][0].shape[1]
        a = data.draw(st.integers(0, L + 3), label="start")
        b = data.draw(st.integers(L + 1, L + 40) | st.integers(0, max(a - 1, 0)),
                      label="stop")
        if a <= b <= L:
            return
        before = footprint(self.cache)
        with pytest.raises((IndexError, ValueError)):
            self.cache.gather(sid, a, b)
        assert footprint(self.cache) == before

    @precondition(lambda self: self.model)
    @rule(i=pick, data=st.data())
    def truncate(self, i, data):
        """Keeps the first n tokens: exactly the blocks no other table holds come back,
        a kept partial block another table holds is copied on the next write."""
        sid = self._sid(i)
        k, v = self.model[sid]
        L = k.shape[1]
        n = data.draw(st.integers(0, L), label="n")
        bs = self.cfg.block_size
        table = self.cache.block_table(sid).tolist()
        others = {b for s in self.model if s != sid for b in self.cache.block_table(s)}
        keep = -(-n // bs)
        released = sum(1 for b in table[keep:] if b not in others)
        free = self.cache.stats()["free_blocks"]
        self.cache.truncate(sid, n)
        self._event(f"truncate: {'whole blocks' if n % bs == 0 else 'partial'}, "
                    f"{'shared tail' if n % bs and table[n // bs] in others else 'own'}")
        assert self.cache.stats()["free_blocks"] == free + released
        assert self.cache.block_table(sid).tolist() == table[:keep]
        self.model[sid] = (k[:, :n].copy(), v[:, :n].copy())
        self.cow_tail.discard(sid)
        if n % bs and table[n // bs] in others:
            self.cow_tail.add(sid)

    @precondition(lambda self: self.model)
    @rule(i=pick, data=st.data())
    def truncate_out_of_range(self, i, data):
        sid = self._sid(i)
        L = self.model[sid][0].shape[1]
        n = data.draw(st.integers(L + 1, L + 40) | st.integers(-5, -1), label="n")
        before = footprint(self.cache)
        with pytest.raises(ValueError):
            self.cache.truncate(sid, n)
        assert footprint(self.cache) == before

    @precondition(lambda self: self.model)
    @rule(i=pick)
    def free(self, i):
        sid = self._sid(i)
        self.cache.free(sid)
        del self.model[sid]
        self.detached.discard(sid)
        self.cow_tail.discard(sid)
        with pytest.raises(shmkv.SequenceNotFound):
            self.cache.seq_len(sid)

    @precondition(lambda self: self.model)
    @rule(i=pick)
    def detach(self, i):
        sid = self._sid(i)
        self.cache.detach(sid)
        self.detached.add(sid)
        assert self.cache.owner_pid(sid) is None

    @precondition(lambda self: self.detached)
    @rule(i=pick)
    def adopt(self, i):
        sid = sorted(self.detached)[i % len(self.detached)]
        self.cache.adopt(sid)
        self.detached.discard(sid)
        assert self.cache.owner_pid(sid) == os.getpid()

    @rule()
    def switch_handle(self):
        """A second handle, then the first closes: the process stays attached, nothing is
        reclaimed."""
        other = shmkv.KVCache.attach(self.name)
        self.cache.close()
        self.cache = other

    @rule()
    def close_and_reattach(self):
        """The last handle closes: every sequence this process owns is reclaimed, the
        detached ones survive."""
        self.cache.close()
        self.cache = shmkv.KVCache.attach(self.name)
        self.model = {s: kv for s, kv in self.model.items() if s in self.detached}
        self.cow_tail &= set(self.model)

    @precondition(lambda self: self.model)
    @rule(i=pick)
    def bad_dtype_append(self, i):
        sid = self._sid(i)
        wrong = (np.int8 if self.DTYPE == "int8"          # quantized: floats are right
                 else np.float32 if self.DTYPE != "float32" else np.float16)
        k = np.zeros((self.cfg.num_layers, 1, self.cfg.num_kv_heads, self.cfg.head_dim), wrong)
        before = footprint(self.cache)
        with pytest.raises(TypeError):
            self.cache.append(sid, k, k)
        assert footprint(self.cache) == before

    # ---- invariants ---------------------------------------------------------------------
    @invariant()
    def consistent(self):
        problems = self.cache.check()
        assert problems == [], problems
        s = self.cache.stats()
        assert s["free_blocks"] + s["used_blocks"] == s["num_blocks"] == self.cfg.num_blocks
        assert sorted(self.cache.sequences()) == sorted(self.model)
        assert s["num_sequences"] == len(self.model)
        used = set()
        for sid, (k, _) in self.model.items():
            assert self.cache.seq_len(sid) == k.shape[1]
            table = self.cache.block_table(sid).tolist()
            assert len(table) == -(-k.shape[1] // self.cfg.block_size)
            used.update(table)
        assert s["used_blocks"] == len(used)      # used iff referenced by some table


class Float16Machine(KVCacheMachine):
    DTYPE = "float16"


class Int8Machine(KVCacheMachine):
    DTYPE = "int8"


class Float32Machine(KVCacheMachine):
    DTYPE = "float32"


TestFloat16 = Float16Machine.TestCase
TestFloat16.settings = SETTINGS
TestInt8 = Int8Machine.TestCase
TestInt8.settings = settings(SETTINGS, max_examples=80, stateful_step_count=40)
TestFloat32 = Float32Machine.TestCase
TestFloat32.settings = settings(SETTINGS, max_examples=50, stateful_step_count=40)


def test_the_machine_reaches_cache_full():
    """The pool is small enough that the exhaustion paths are reachable (the 'no effect'
    checks are not vacuous): a fixed run through each of them."""
    m = Float16Machine()

    def at(sid):                            # the rule argument that picks sid
        return sorted(m.model).index(sid)

    try:
        m.create()
        m.create()
        a, b = sorted(m.model)
        for _ in range(3):
            m.append(at(a), 9)              # 27 tokens: 7 blocks
        m.append(at(a), 9)                  # 36 > max_seq_len 28: refused
        assert m.full_seen == 1
        m.append(at(b), 6)                  # 2 blocks: 9 of 9 used
        m.consistent()
        assert m.cache.stats()["free_blocks"] == 0
        m.append(at(b), 1)                  # fits the partial last block
        m.append(at(b), 2)                  # needs a block: refused
        assert m.full_seen == 2
        m.fork(at(a))                       # a ends in a partial block ...
        (c,) = set(m.model) - {a, b}
        m.reserve_write(at(c), 1)           # ... whose copy needs a block: refused
        m.append(at(a), 1)                  # the same for the parent
        assert m.full_seen == 4
        for _ in range(3):
            m.create()
        m.create()                          # the 7th sequence: no slot
        m.fork(at(a))                       # nor for a fork
        assert m.full_seen == 6
        m.consistent()
        m.free(at(b))
        m.reserve_write(at(c), 1)           # now the copy happens
        m.append(at(a), 1)                  # a is the last holder: in place
        m.consistent()
        assert m.cache.stats()["cow_copies"] == 1
        assert m.full_seen == 6
    finally:
        m.teardown()
