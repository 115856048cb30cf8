"""Worker operations on the pool (detached sequences that outlive any worker): evict,
claim and verify, append under the slot's journal lock, fork, lock-free paged reads.  A
mixin of ``Worker``; state lives there."""
from __future__ import annotations

import numpy as np

import shmkv

from .codec import DataError, resolve_record
from .common import (
    CNT_BASE,
    DETACHED,
    EMPTY,
    F_RESERVE_OK,
    F_TOK,
    FREED,
    I_ADOPT,
    I_APPEND,
    I_FREE,
    I_NONE,
    I_TRIM,
    I_TRUNC,
    MAXSEG,
    OP_INDEX,
    ORPHAN,
    OWNED,
    SALT_SHIFT,
)


class PoolOps:
    """Operations on pool sequences (mixed into Worker)."""

    def op_evict(self):
        """evict() with an exclude list that leaves it exactly our own sequences, a pool
        sequence or two we claimed (intent free), and dead processes' sequences; the
        detach gate keeps new pool sequences from appearing meanwhile."""
        if not self.J.gate_exclusive():
            self.bump("claim_busy")
            return
        claimed = {}
        try:
            for _ in range(self.rng.randint(0, 2)):
                slot = self.pick_pool()
                if slot is None or slot in self.own or slot in claimed or slot in self.J.held:
                    continue
                if not self.J.try_lock(slot):
                    continue
                e = self.J.read(slot)
                if e is None or e.state != DETACHED or e.intent != I_NONE:
                    self.J.unlock(slot)
                    continue
                e.intent = I_FREE
                self.J.write(slot, e)
                claimed[slot] = e
            listing = self.call("evict", self.cache.sequences)
            mine = {e.sid for e in self.own.values()} | {e.sid for e in claimed.values()}
            exclude = set(listing) - mine
            st = self.call("stats", self.cache.stats)
            need = min(self.cfg.num_blocks, st["free_blocks"] + self.rng.randint(1, 48))
            policy = self.rng.choice(("lru", "lfu", "longest", "priority"))
            self.bump("evict_calls")
            evicted = self.call("evict", self.cache.evict, policy, need, exclude=sorted(exclude))
        finally:
            self.J.gate_release()
        for sid in evicted:
            slot = sid % self.NS
            e = self.own.get(slot)
            if e is not None and e.sid == sid:
                e.state, e.intent = FREED, I_NONE
                self.J.write(slot, e)
                self.own.pop(slot, None)
                self.J.unlock(slot)
            elif slot in claimed and claimed[slot].sid == sid:
                e = claimed.pop(slot)
                e.state, e.intent = FREED, I_NONE
                self.J.write(slot, e)
                self.J.unlock(slot)
            elif sid in exclude:
                self.fail("bad_evict", f"evict({policy}, {need}) took sequence {sid}, which "
                                       f"was excluded: {self.J.read(slot)}")
            else:
                self.bump("evicted_dead")        # a dead process's (reclaimable) sequence
            try:
                self.call("seq_len", self.cache.seq_len, sid)
                self.fail("bad_evict", f"evict() returned {sid}, which is still there")
            except shmkv.SequenceNotFound:
                pass
        self.bump("evicted", len(evicted))
        for slot, e in claimed.items():            # not taken: back to the pool
            e.intent = I_NONE
            self.J.write(slot, e)
            self.J.unlock(slot)

    # -- the pool of detached sequences ---------------------------------------------------
    def pick_pool(self):
        idx = np.flatnonzero(self.J.hints.copy())   # others change it meanwhile
        if idx.size == 0:
            return None
        return int(idx[self.rng.randrange(idx.size)])

    def peek_pool(self):
        """(slot, record) of a random pool sequence, read without its claim; (slot, None)
        when the pool is empty or the record is not a detached sequence (any more)."""
        slot = self.pick_pool()
        e = self.J.read(slot) if slot is not None else None
        if e is None or e.state != DETACHED:
            return slot, None
        return slot, e

    def verify_claimed(self, slot, e):
        """We hold the slot's lock and e is DETACHED (or just became so): resolve what a
        dead claimant left in flight, verify every token (and token id), write the
        resolved record.  Returns False if the sequence is gone (legitimately)."""
        self.on_pool = True
        try:
            k, v = self.gather(e.sid)      # first: waits out (recovers) a dead holder
            t = self.call("trimmed", self.cache.trimmed, e.sid)
        except shmkv.SequenceNotFound:
            self.on_pool = False
            if e.intent in (I_FREE, I_ADOPT):
                e.state, e.intent = FREED, I_NONE
                self.J.write(slot, e)
                return False
            self.fail("lost_sequence", f"detached sequence {e.sid} is gone: {e}")
            e.state, e.intent = FREED, I_NONE
            self.J.write(slot, e)
            return False
        self.on_pool = False
        n = k.shape[1]
        if e.intent in (I_APPEND, I_TRIM, I_TRUNC):
            self.bump({I_APPEND: "resolved_inflight", I_TRIM: "resolved_trims",
                       I_TRUNC: "resolved_truncates"}[e.intent])
        t_exp, conf, inflight, probs = resolve_record(e, n, t)
        for kind, msg, lost in probs:
            self.fail(kind, f"pool claim: sequence {e.sid}: {msg}; {e}")
            if lost:
                self.bump("lost_token_count", lost)
        self.check_data(e, k, v, "pool claim", conf=min(conf, n) if probs else conf,
                        inflight=inflight, trim=t_exp)
        self.check_ids(e, n, "pool claim", trim=t_exp)
        if e.intent == I_ADOPT:
            live, detached = self.live_owner(e.sid)
            if live and not detached:
                # adopted by a claimant that died: must be reclaimed by recovery
                e.state, e.intent = ORPHAN, I_NONE
                self.J.write(slot, e)
                return False
        e.conf = min(n, self.max_len)
        e.trim = t_exp
        e.intent, e.state = I_NONE, DETACHED
        e.flags &= ~F_RESERVE_OK
        self.J.write(slot, e)
        return True

    def op_pool_claim(self, prefer_free=False, mode=None):
        slot = self.pick_pool()
        if mode is not None:
            # focused: look (a few picks) for a sequence where the call reaches the point
            for _ in range(4):
                e = self.J.read(slot) if slot is not None else None
                if e is not None and e.state == DETACHED and (
                        (mode == "append" and e.flags & F_TOK and not e.trim
                         and e.conf + self.bs <= self.max_len)
                        or (mode == "trim" and e.conf > 3 * self.bs)
                        or (mode == "truncate" and e.conf > 2 * self.bs)):
                    break
                slot = self.pick_pool()
        if slot is None or slot in self.own:
            return
        if not self.J.try_lock(slot):
            self.bump("claim_busy")
            return
        keep = False
        try:
            e = self.J.read(slot)
            if e is None or e.state != DETACHED:
                return
            if (e.intent != I_NONE or self.rng.random() < 0.35) and \
                    not self.verify_claimed(slot, e):
                return
            npool = int(np.count_nonzero(self.J.hints.copy()))
            r = self.rng.random()
            if mode == "append":
                r = 0.5
            elif mode == "trim":
                r = 0.65
            elif mode == "truncate":
                r = 0.59
            if prefer_free or (npool > self.POOL_TARGET and r < 0.8 and mode is None) \
                    or e.conf >= self.max_len - 8:
                if not self.journaled(slot, e, I_FREE, "free", self.cache.free):
                    return
                e.state, e.intent = FREED, I_NONE
                self.J.write(slot, e)
            elif r < 0.56:
                for _ in range(self.rng.randint(1, 3)):
                    if not self.pool_append(slot, e):
                        break
            elif r < 0.62:
                try:
                    if e.conf and self.do_truncate(slot, e, "pool") and self.rng.random() < 0.6:
                        self.pool_append(slot, e)          # on from the cut (copy-on-write)
                except shmkv.SequenceNotFound:
                    self._lost(slot, e)
            elif r < 0.70:
                try:
                    if not self.do_trim(slot, e, "pool"):
                        self.pool_append(slot, e)
                except shmkv.SequenceNotFound:
                    self._lost(slot, e)
            elif r < 0.78 and len(self.own) < self.MAX_OWN:
                if not self.journaled(slot, e, I_ADOPT, "adopt", self.cache.adopt):
                    return
                e.state, e.intent, e.holder = OWNED, I_NONE, self.me
                e.flags &= ~F_RESERVE_OK
                self.J.write(slot, e)
                self.own[slot] = e
                keep = True
            elif r < 0.88:
                self.op_pool_fork(slot, e)
            else:
                self.verify_claimed(slot, e)
        finally:
            if not keep:
                self.J.unlock(slot)

    def journaled(self, slot, e, intent, op, fn):
        """Record `intent` in the slot's journal record, then call fn(e.sid) timed as `op`:
        True when it ran, False when the sequence was gone (the record is settled)."""
        e.intent = intent
        self.J.write(slot, e)
        try:
            self.call(op, fn, e.sid)
        except shmkv.SequenceNotFound:
            self._lost(slot, e)
            return False
        return True

    def _lost(self, slot, e):
        """A detached sequence we hold the claim on vanished: report it, and journal it
        as freed so nobody verifies it again."""
        self.fail("lost_sequence", f"detached sequence {e.sid} vanished under our claim: {e}")
        e.state, e.intent = FREED, I_NONE
        self.J.write(slot, e)

    def pool_append(self, slot, e):
        n = self.pick_n(e)
        if n <= 0:
            return False
        k, v, ids = self.data_for(e, n)
        if e.flags & F_TOK and self.rng.random() < 0.01:
            e.flags &= ~F_TOK                      # (written with the intent, below)
        tok = bool(e.flags & F_TOK)
        e.intent, e.i_len, e.i_n = I_APPEND, e.conf, n
        self.J.write(slot, e)
        self.J.busy[slot] = self.lane + 1         # readers and the controller aim here
        self.on_pool = True
        try:
            if tok:
                self.call("append_tok", self.cache.append, e.sid, k, v, tokens=ids)
                self.bump("tok_appends")
            else:
                self.call("append", self.cache.append, e.sid, k, v)
        except shmkv.CacheFullError:
            e.intent = I_NONE
            self.J.write(slot, e)
            self.bump("cache_full")
            return False
        except shmkv.SequenceNotFound:
            self._lost(slot, e)
            return False
        finally:
            self.J.busy[slot] = 0
            self.on_pool = False
        e.conf += n
        e.intent = I_NONE
        self.J.write(slot, e)
        self.bump("pool_appends")
        return True

    def op_pool_fork(self, slot=None, e=None):
        """Fork a pool sequence -- usually WITHOUT its claim, so the fork races with a
        claimant appending to it or trimming it (fork takes no sequence lock).  The
        child's inherited prefix is taken from the data itself and checked against the
        parent's record."""
        claimed = e is not None
        if e is None:
            slot, e = self.peek_pool()
            if e is None:
                return
        if len(e.segs) >= MAXSEG - 1:
            return
        try:
            child = self.call("fork", self.cache.fork, e.sid)
        except shmkv.SequenceNotFound:
            self.bump("not_found")
            return
        except shmkv.CacheFullError:
            return self.on_full("fork")
        e2 = e if claimed else self.J.read(slot)
        lc = self.call("seq_len", self.cache.seq_len, child)
        k, v = self.call("gather", self.cache.gather, child)
        t = self.call("trimmed", self.cache.trimmed, child)
        if k.shape[1] != lc:
            self.fail("torn_publish", f"fork child {child}: seq_len {lc}, gather {k.shape[1]}")
        got = self.check_pool_read(e, e2, k, v, f"fork({e.sid}) -> {child}")
        if got is None:
            self.call("free", self.cache.free, child)
            return
        segs, pos, m, tr = got
        if t != tr and tr == 0 and e.sink and lc <= e.sink * self.bs:
            tr, m = t, e.sink * self.bs   # truncated into the sink: no token shows the trim
        if t != tr:
            self.fail("bad_trim", f"fork({e.sid}) -> {child}: trimmed() says {t}, its data "
                                  f"says {tr} tokens were dropped; parent {e}")
        self.bump("tokens_verified", lc)
        if len(segs) >= MAXSEG - 1:
            self.call("free", self.cache.free, child)
            return
        # the child is tokened if the parent was, before the fork and after it (an
        # untokened append clears the flag in the record BEFORE it runs)
        flags = F_RESERVE_OK | (e.flags & (3 << SALT_SHIFT))
        if e.flags & F_TOK and e2 is not None and e2.sid == e.sid and e2.flags & F_TOK:
            flags |= F_TOK
        o = int(pos[-1]) + 1 if lc else 0
        self.adopt_child(child, lc, segs + [(o, self.new_seed())], flags, tr,
                         m // self.bs if tr else 0)

    def check_pool_read(self, e1, e2, k, v, where, e0=None):
        """A read of a pool sequence nobody let us hold: e1 its record read before the
        data (None: not read), e2 after it.  The data must be a well-formed (maybe
        trimmed) lineage; every token the records confirm must be there and right, in
        the places the trims that can have happened leave it.  e0: a record read before
        the data only to see whether a truncate came between (when e1 is None).  Returns derive_full's
        (segs, positions, m, trim) or None (garbage: reported)."""
        n = k.shape[1]
        first = e1 if e1 is not None else e2
        before = e1 if e1 is not None else e0
        if first is not None and first.state != EMPTY and (
                any(r is not None and r.sid == first.sid and r.intent == I_TRUNC
                    for r in (before, e2))
                or (before is not None and e2 is not None and e2.sid == before.sid
                    and e2.cuts != before.cuts)):
            # a truncate (then appends of a new lineage from the cut) may have come
            # between the records and the read: which tokens the first record confirmed
            # is unknown, and a lock-free read may mix the two lineages.  Discarded (the
            # claimants and the audits check the sequence whole).
            self.bump("reads_discarded")
            try:
                return self.codec.derive_full(k, v)
            except DataError:
                return None
        try:
            segs, pos, m, tr = self.codec.derive_full(k, v)
        except DataError as ex:
            self.fail("garbage", f"{where} ({n} tokens): {ex}; record {e1 or e2}")
            return None
        if first is None or first.state == EMPTY:
            return segs, pos, m, tr
        # records of this sequence (its lineage never changes; freed or adopted since
        # does not matter for what the data read before could show)
        recs = [r for r in (e1, e2) if r is not None and r.sid == first.sid]
        bs = self.bs
        lo = e1.trim if e1 is not None else 0
        if e2 is not None and e2.sid == first.sid:
            hi = max(r.trim + (r.i_n if r.intent == I_TRIM else 0) for r in recs)
        else:
            hi = 1 << 40          # no record after the read: a later trim can have come
        if tr and not (lo <= tr <= hi):
            self.fail("bad_trim", f"{where}: the data shows {tr} tokens dropped after token "
                                  f"{m}; the records allow {lo}..{hi}: {recs}")
        sink = max(r.sink for r in recs)
        if tr and sink and m != sink * bs:
            self.fail("bad_trim", f"{where}: the data is trimmed after token {m}, the sink "
                                  f"is {sink} blocks: {recs}")
        r0 = recs[0]
        # confirmed original positions: below the end of what the record confirmed
        if r0.conf:
            end = int(self.codec.orig_e(r0, r0.conf - 1, r0.conf)[0]) + 1
            sel = np.flatnonzero(pos < end)
            if sel.size:
                ks, vs = k[:, sel], v[:, sel]
                i, cnt = self.codec.first_mismatch_at(ks, vs, r0.segs, pos[sel])
                if i is not None:
                    i = int(sel[i])
                    self.fail("lost_tokens", f"{where}: confirmed token {i} (position "
                                             f"{int(pos[i])}) differs ({cnt}); {r0}")
                    self.bump("lost_token_count", cnt)
        # its length: appends only grow it; checkable when no trim can have come between
        if e1 is not None and e1 in recs and e2 is not None and e2.sid == e1.sid and \
                e1.intent != I_TRIM and e2.intent != I_TRIM and e2.trim == e1.trim:
            if n < e1.conf:
                self.fail("lost_tokens", f"{where}: {n} tokens, {e1.conf} confirmed; {e1}")
                self.bump("lost_token_count", e1.conf - n)
            # (a truncate into the sink leaves no token that could show the trim)
            if tr != e1.trim and (tr or n > e1.sink * bs):
                self.fail("bad_trim", f"{where}: the data shows {tr} tokens dropped, the "
                                      f"record {e1.trim} and no trim since; {e1}")
        return segs, pos, m, tr

    def op_pool_read(self):
        """Read a pool sequence nobody here holds: gather (sequence lock) or a lock-free
        paged read through batch_block_tables + key_cache/value_cache views (the decode
        path); check its structure, and its prefix against the journal.  Half the time
        aim at a sequence some worker is appending to right now (paged read: a gather
        would wait for the append to finish)."""
        if self.rng.random() < 0.5:
            idx = np.flatnonzero(self.J.busy.copy())
            if idx.size:
                slot = int(idx[self.rng.randrange(idx.size)])
                sid = int(self.J.hints[slot])
                if sid:                      # read first (fast), then consult the record
                    e0 = self.J.read(slot)       # (only: did a truncate come between?)
                    got = self.paged_read(sid)
                    if got is None:
                        return
                    k, v = got
                    e2 = self.J.read(slot)
                    if e2 is not None and e2.sid != sid:
                        e2 = None
                    self.check_pool_read(None, e2, k, v,
                                         f"paged read of {sid} during an append", e0=e0)
                    self.bump("tokens_verified", k.shape[1])
                    return
        slot, e = self.peek_pool()
        if e is None:
            return
        if self.rng.random() < 0.5:
            try:
                k, v = self.gather(e.sid)
            except shmkv.SequenceNotFound:
                self.bump("not_found")
                return
        else:
            got = self.paged_read(e.sid)
            if got is None:
                return
            k, v = got
        e2 = self.J.read(slot)
        self.check_pool_read(e, e2, k, v, f"pool read of {e.sid}")
        self.bump("tokens_verified", k.shape[1])

    def paged_read(self, sid):
        c, bs = self.cache, self.cfg.block_size
        if self.views is None:
            self.views = [(c.key_cache(l), c.value_cache(l)) for l in range(self.cfg.num_layers)]
        try:
            tables, lens = self.call("tables", c.batch_block_tables, [sid])
        except shmkv.SequenceNotFound:
            self.bump("not_found")
            return None
        n = int(lens[0])
        nb = -(-n // bs)
        tab = tables[0, :nb].copy()
        # newest tokens first, V (copied last by append) before K, last layer first: what
        # an early publish would leave unwritten is read while its copy may still run
        t = np.arange(n - 1, -1, -1)
        blk, off = tab[t // bs], t % bs
        L = len(self.views)
        v = [None] * L
        k = [None] * L
        for l in range(L - 1, -1, -1):
            v[l] = self.views[l][1][blk, off][::-1]
        for l in range(L - 1, -1, -1):
            k[l] = self.views[l][0][blk, off][::-1]
        k, v = np.stack(k), np.stack(v)
        self.lv[CNT_BASE + OP_INDEX["paged_read"]] += 1
        try:
            tables2, lens2 = self.call("tables", c.batch_block_tables, [sid])
        except shmkv.SequenceNotFound:
            self.bump("reads_discarded")
            return None
        if tables2.shape[1] < nb or not np.array_equal(tables2[0, :nb], tab) or \
                int(lens2[0]) < n:
            self.bump("reads_discarded")       # freed, copied-on-write or trimmed meanwhile
            return None
        return k, v
