"""Worker operations on the sequences a worker owns (created, forked or adopted):
create (with and without prompt tokens), append, reserve+write, fork, verify, free, detach,
trim, truncate, priority and prefix match.  A mixin of ``Worker``; state lives there."""
from __future__ import annotations

import numpy as np

import shmkv

from .codec import N_FAMILIES, N_VARIANTS, SALT_PICK
from .common import (
    DETACHED,
    F_RESERVE_OK,
    F_TOK,
    FREED,
    I_DETACH,
    I_NONE,
    I_TRIM,
    I_TRUNC,
    MAXSEG,
    OWNED,
    SALT_SHIFT,
    SALTS,
    Entry,
)


class OwnOps:
    """Operations on the worker's own sequences (mixed into Worker)."""

    # -- own sequences -------------------------------------------------------------------
    def create_claimed(self, op, **kw):
        """create_sequence(**kw), timed as `op`, with its journal slot claimed: (slot, sid),
        or None when the pool was full (room is made) or the slot could not be claimed
        (the new sequence is freed again)."""
        try:
            sid = self.call(op, self.cache.create_sequence, **kw)
        except shmkv.CacheFullError:
            self.on_full("create")
            return None
        slot = sid % self.NS
        if not self.claim_new(slot, sid):
            self.call("free", self.cache.free, sid)
            return None
        return slot, sid

    def op_create(self):
        if self.rng.random() < 0.6:
            return self.op_create_prompt()
        got = self.create_claimed("create", priority=self.rng.randrange(4))
        if got is None:
            return
        slot, sid = got
        # some untokened (never hashed), some tokened with a lineage of their own
        flags = F_RESERVE_OK | (F_TOK if self.rng.random() < 0.4 else 0)
        e = Entry(sid, OWNED, holder=self.me, flags=flags, segs=[(0, self.new_seed())])
        self.J.write(slot, e)
        self.own[slot] = e
        if self.rng.random() < 0.8:
            self.op_append_own(e)

    def op_create_prompt(self):
        """create_sequence(tokens=prompt) of a shared prompt: it starts out holding the
        prompt's full blocks that any process published (live or cached).  Every shared
        token is checked (K/V, token ids); then the rest of the prompt is prefilled
        (append with tokens=, or reserve + write + commit), publishing its blocks."""
        bs = self.bs
        f, j = self.rng.randrange(N_FAMILIES), self.rng.randrange(N_VARIANTS)
        salt = self.rng.choice(SALT_PICK)
        segs = self.prompts.segs(f, j, salt)
        plen = self.rng.randint(2 * bs + 1, min(self.max_len - bs, 10 * bs))
        ids = self.codec.tid(segs, np.arange(plen))
        ev0 = self.call("events", self.cache.events, 2**62).next_seq   # for verify_hit
        got = self.create_claimed("create_tok", tokens=ids, salt=SALTS[salt],
                                  priority=self.rng.randrange(4))
        if got is None:
            return
        slot, sid = got
        self.ev0 = ev0
        h = self.call("seq_len", self.cache.seq_len, sid)
        self.bump("prompt_creates")
        # the decode after the prompt: the family's own stream (so decodes hit too) or
        # a lineage segment of this sequence's own
        if self.rng.random() < 0.5:
            segs = [x for x in segs if x[0] < plen] + [(plen, self.new_seed())]
        e = Entry(sid, OWNED, holder=self.me, conf=h, segs=segs,
                  flags=F_RESERVE_OK | F_TOK | (salt << SALT_SHIFT))
        self.J.write(slot, e)
        self.own[slot] = e
        if h % bs or h > (plen - 1) // bs * bs:
            self.fail("bad_hit", f"create_sequence(tokens= {plen} ids, salt {SALTS[salt]}) "
                                 f"-> {sid} starts with {h} tokens (full blocks of the "
                                 f"prompt but its last token expected)")
        elif h:
            self.verify_hit(e, ids, h, "create_sequence(tokens=)")
        if not self.mine(e):
            return
        # prefill the rest, in one go or in chunks
        while self.mine(e) and e.conf < plen:
            n = plen - e.conf
            if self.rng.random() < 0.4:
                n = min(n, self.rng.randint(1, 2 * bs))
            if e.flags & F_RESERVE_OK and self.rng.random() < 0.35:
                if not self.op_reserve_write(e, n):
                    return
            elif not self.append_n(e, n):
                return

    def verify_hit(self, e, ids, h, where):
        """The h tokens a new sequence got from the prefix cache: exactly the prompt's
        K/V and token ids, and still findable (we hold them: nothing can evict them)."""
        salt = SALTS[e.salt]
        k, v = self.call("gather", self.cache.gather, e.sid)
        if k.shape[1] != h:
            self.fail("bad_hit", f"{where}: sequence {e.sid} had {h} tokens, gathers "
                                 f"{k.shape[1]}; {e}")
            return
        i, cnt = self.codec.first_mismatch(k, v, e.segs, 0)
        if i is not None:
            self.fail("bad_hit", f"{where}: shared token {i} of {h} (block {i // self.bs}) "
                                 f"is not the prompt's ({cnt} tokens differ; salt {salt}); "
                                 f"{e}")
        got = self.call("token_ids", self.cache.token_ids, e.sid)
        if not np.array_equal(got, ids[:h]):
            bad = np.flatnonzero(got != ids[:h])
            self.fail("bad_hit", f"{where}: shared token {int(bad[0])} of {h} has id "
                                 f"{int(got[bad[0]])}, the prompt's is {int(ids[bad[0]])}; {e}")
        m = self.call("match_prefix", self.cache.match_prefix, ids, salt=salt)
        if m < h and self.reset_since(getattr(self, "ev0", 0)):
            self.bump("resets_excused")     # reset_prefix_cache() unhashed them meanwhile
        elif m < h:
            self.fail("bad_hit", f"{where}: match_prefix finds {m} tokens of the prompt "
                                 f"while sequence {e.sid} holds {h} of them; {e}")
        self.bump("prefix_hit_blocks", h // self.bs)
        self.bump("prefix_hit_tokens_verified", h)
        self.bump("tokens_verified", h)

    def pick_n(self, e):
        r = self.rng.random()
        if r < 0.5:
            n = self.rng.randint(1, 8)
        elif r < 0.9:
            n = self.rng.randint(9, 48)
        else:
            n = self.rng.randint(49, 128)
        return min(n, self.max_len - e.conf)

    def on_full(self, what):
        """CacheFullError: make room by freeing one of ours (or a pool sequence), now and
        then through evict()."""
        self.bump("cache_full")
        if self.rng.random() < 0.25:
            return self.op_evict()
        if self.own:
            victim = self.rng.choice(list(self.own.values()))
            self.op_free_own(victim)
        else:
            self.op_pool_claim(prefer_free=True)

    def mine(self, e):
        """e is still one of our live sequences (a nested op may have freed it)."""
        return e.state == OWNED and self.own.get(e.sid % self.NS) is e

    def data_for(self, e, n):
        """K, V and token ids of the next n tokens of e's lineage."""
        pos = self.codec.orig_e(e, e.conf, e.conf + n)
        k, v = self.codec.make_at(e.segs, pos)
        return k, v, self.codec.tid(e.segs, pos)

    def op_append_own(self, e):
        if not self.mine(e):
            return
        n = self.pick_n(e)
        if n <= 0:
            return self.op_free_own(e) if self.rng.random() < 0.5 else self.op_detach(e)
        self.append_n(e, n)

    def own_call(self, e, what, op, fn, *args, **kw):
        """self.call(op, fn, ...) that grows our sequence e: (True, its result), or
        (False, None) when the pool was full (room is made for the next try) or e
        vanished (reported)."""
        try:
            return True, self.call(op, fn, *args, **kw)
        except shmkv.CacheFullError:
            self.on_full(what)
        except shmkv.SequenceNotFound as ex:
            self.own_vanished(e, ex)
        return False, None

    def append_n(self, e, n):
        """Append n tokens to our sequence e (with their ids if it is tokened; now and
        then without, which ends its hashing).  True if they are there."""
        if not self.mine(e) or n <= 0:
            return False
        k, v, ids = self.data_for(e, n)
        if e.conf % self.bs:
            self.bump("cow_appends")
        slot = e.sid % self.NS
        if e.flags & F_TOK and self.rng.random() < 0.01:
            e.flags &= ~F_TOK                      # ids unknown from here on
            self.J.write(slot, e)
        tok = bool(e.flags & F_TOK)
        if tok:
            ok, _ = self.own_call(e, "append", "append_tok", self.cache.append, e.sid, k, v,
                                  tokens=ids)
        else:
            ok, _ = self.own_call(e, "append", "append", self.cache.append, e.sid, k, v)
        if not ok:
            return False
        if tok:
            self.bump("tok_appends")
        e.conf += n
        self.J.write(slot, e)
        return True

    def op_reserve_write(self, e, n=None):
        """The decode-loop flow: reserve (with token ids if tokened), write layer by
        layer, commit (tokened: publishes the blocks filled)."""
        if not self.mine(e):
            return False
        if n is None:
            n = self.pick_n(e)
        if n <= 0:
            self.op_free_own(e)
            return False
        k, v, ids = self.data_for(e, n)
        tok = bool(e.flags & F_TOK)
        if tok:
            ok, slots = self.own_call(e, "reserve", "reserve_tok", self.cache.reserve, e.sid,
                                      n, tokens=ids)
        else:
            ok, slots = self.own_call(e, "reserve", "reserve", self.cache.reserve, e.sid, n)
        if not ok:
            return False
        bs = self.bs
        want = (e.conf + np.arange(n)) % bs
        if slots.shape != (n,) or not np.array_equal(slots % bs, want):
            self.fail("exception", f"reserve({e.sid}, {n}) at {e.conf}: slots {slots}")
        order = np.arange(self.cfg.num_layers)
        if self.rng.random() < 0.5:
            order = order[::-1]
        for layer in order:
            self.call("write", self.cache.write, int(layer), slots, k[layer], v[layer])
        if tok:
            try:
                got = self.call("commit", self.cache.commit, e.sid)
            except shmkv.SequenceNotFound as ex:
                self.own_vanished(e, ex)
                return False
            self.bump("commits")
            self.bump("committed_blocks", got)
        e.conf += n
        self.J.write(e.sid % self.NS, e)
        return True

    def own_vanished(self, e, ex):
        self.fail("lost_sequence", f"sequence {e.sid} vanished while its owner (us) is "
                                   f"alive: {ex}; {e}")
        slot = e.sid % self.NS
        self.own.pop(slot, None)
        e.state = FREED
        self.J.write(slot, e)
        self.J.unlock(slot)

    def child_flags(self, e):
        return F_RESERVE_OK | (e.flags & (F_TOK | (3 << SALT_SHIFT)))

    def op_fork_own(self, e):
        if not self.mine(e):
            return
        if len(e.segs) >= MAXSEG - 1:
            return self.op_free_own(e)
        try:
            child = self.call("fork", self.cache.fork, e.sid)
        except shmkv.CacheFullError:
            return self.on_full("fork")
        except shmkv.SequenceNotFound as ex:
            return self.own_vanished(e, ex)
        lc = self.call("seq_len", self.cache.seq_len, child)
        if lc != e.conf:
            self.fail("lost_tokens" if lc < e.conf else "torn_publish",
                      f"fork({e.sid}) -> {child} has {lc} tokens, parent confirmed {e.conf}")
        if e.trim and self.rng.random() < 0.3:
            t = self.call("trimmed", self.cache.trimmed, child)
            if t != e.trim:
                self.fail("bad_trim", f"fork({e.sid}) -> {child}: trimmed() says {t}, the "
                                      f"parent's trims dropped {e.trim}; {e}")
        o = int(self.codec.orig_e(e, lc, lc + 1)[0])
        segs = [s for s in e.segs if s[0] < o] + [(o, self.new_seed())]
        self.adopt_child(child, lc, segs, self.child_flags(e), e.trim, e.sink)
        if self.rng.random() < 0.7:        # append to both: the shared partial block
            self.op_append_own(e)

    def adopt_child(self, child, lc, segs, flags=F_RESERVE_OK, trim=0, sink=0):
        cslot = child % self.NS
        if not self.claim_new(cslot, child):
            self.call("free", self.cache.free, child)
            return None
        ce = Entry(child, OWNED, holder=self.me, flags=flags, conf=lc, segs=segs,
                   trim=trim, sink=sink)
        self.J.write(cslot, ce)
        self.own[cslot] = ce
        if len(self.own) > self.MAX_OWN + 2:
            self.op_detach(ce)
        elif self.rng.random() < 0.7:
            self.op_append_own(ce)
        return ce

    def check_data(self, e, k, v, where, conf=None, inflight=None, trim=None):
        """Compare gathered tokens [0, n) with the lineage of e (trimmed by `trim`, default
        e.trim).  conf: the confirmed length (every token below it must be there and
        right).  inflight: (L, n) of an append that may or may not have published."""
        n = k.shape[1]
        conf = e.conf if conf is None else conf
        trim = e.trim if trim is None else trim
        if n < conf:
            self.fail("lost_tokens", f"{where}: sequence {e.sid} has {n} tokens, "
                                     f"{conf} were confirmed; {e}")
            self.bump("lost_token_count", conf - n)
        pos = self.codec.orig(e.sink, trim, 0, n)
        bad = self.codec.mismatch_at(k, v, e.segs, pos)
        idx = np.flatnonzero(bad)
        if idx.size:
            i, cnt = int(idx[0]), int(idx.size)
            lost = int(bad[:conf].sum())
            kind = "lost_tokens" if i < conf else "torn_publish"
            self.fail(kind, f"{where}: sequence {e.sid}: token {i} (position {int(pos[i])}) "
                            f"of {n} differs from what its writer appended ({cnt} tokens "
                            f"differ, confirmed {conf}, in flight {inflight}, trimmed "
                            f"{trim}); {e}")
            if lost:
                self.bump("lost_token_count", lost)
        self.bump("tokens_verified", n)
        self.bump("seqs_verified")

    def check_ids(self, e, n, where, trim=None):
        """token_ids() of a tokened sequence: the ids of its lineage at every position."""
        if not e.flags & F_TOK or n == 0:
            return
        trim = e.trim if trim is None else trim
        got = self.call("token_ids", self.cache.token_ids, e.sid)
        want = self.codec.tid(e.segs, self.codec.orig(e.sink, trim, 0, n))
        if got.shape != want.shape or not np.array_equal(got, want):
            m = min(got.size, want.size)
            bad = np.flatnonzero(got[:m] != want[:m])
            i = int(bad[0]) if bad.size else m
            self.fail("bad_ids", f"{where}: token_ids({e.sid}) has {got.size} ids, token {i} "
                                 f"differs from the id it was given ({bad.size} differ); {e}")
        self.bump("ids_verified", n)

    def gather(self, sid, n_hint=None):
        if n_hint is not None and self.rng.random() < 0.3:
            shape = (self.cfg.num_layers, n_hint, self.cfg.num_kv_heads, self.cfg.head_dim)
            out = (np.empty(shape, np.float32), np.empty(shape, np.float32))
            return self.call("gather", self.cache.gather, sid, 0, n_hint, out=out)
        return self.call("gather", self.cache.gather, sid)

    def op_verify_own(self, e):
        if not self.mine(e):
            return
        try:
            k, v = self.gather(e.sid)
        except shmkv.SequenceNotFound as ex:
            return self.own_vanished(e, ex)
        if k.shape[1] != e.conf:
            self.fail("lost_tokens" if k.shape[1] < e.conf else "torn_publish",
                      f"own sequence {e.sid} has {k.shape[1]} tokens, we appended {e.conf}")
        self.check_data(e, k, v, "own")
        if self.rng.random() < 0.5:
            self.check_ids(e, k.shape[1], "own")
        if e.trim or self.rng.random() < 0.2:
            t = self.call("trimmed", self.cache.trimmed, e.sid)
            if t != e.trim:
                self.fail("bad_trim", f"own sequence {e.sid}: trimmed() says {t}, its trims "
                                      f"dropped {e.trim}; {e}")
        if e.conf and self.rng.random() < 0.3:      # a token range
            a = self.rng.randrange(e.conf)
            b = self.rng.randint(a, e.conf)
            kk, vv = self.call("gather", self.cache.gather, e.sid, a, b)
            ek, ev = self.codec.make_at(e.segs, self.codec.orig_e(e, a, b))
            if not (np.array_equal(kk, ek) and np.array_equal(vv, ev)):
                self.fail("lost_tokens", f"gather({e.sid}, {a}, {b}) differs; {e}")

    def op_free_own(self, e):
        if not self.mine(e):
            return
        slot = e.sid % self.NS
        try:
            self.call("free", self.cache.free, e.sid)
        except shmkv.SequenceNotFound as ex:
            return self.own_vanished(e, ex)
        e.state, e.intent = FREED, I_NONE
        self.J.write(slot, e)
        self.own.pop(slot, None)
        self.J.unlock(slot)

    def op_detach(self, e):
        if not self.mine(e):
            return
        if np.count_nonzero(self.J.hints.copy()) > 2 * self.POOL_TARGET:
            return self.op_free_own(e)             # the pool is big enough
        slot = e.sid % self.NS
        self.J.gate_shared()                       # no evict() while a detach is on
        try:
            e.intent = I_DETACH
            self.J.write(slot, e)
            try:
                self.call("detach", self.cache.detach, e.sid)
            except shmkv.SequenceNotFound as ex:
                return self.own_vanished(e, ex)
            e.state, e.intent = DETACHED, I_NONE
            e.flags &= ~F_RESERVE_OK
            self.J.write(slot, e)
        finally:
            self.J.gate_release()
        self.own.pop(slot, None)
        self.J.unlock(slot)

    # -- trim, evict, priority -------------------------------------------------------------
    def trim_plan(self, e):
        """(sink_tokens, window_tokens, tokens it must drop) for a trim of e, or None."""
        bs, n = self.bs, e.conf
        sink = e.sink or self.rng.choice((1, 1, 2))
        sink_tokens = sink * bs - self.rng.randrange(bs)      # rounds up to `sink` blocks
        win = self.rng.randint(1, 3 * bs)
        nb = -(-n // bs)
        first_kept = (n - win) // bs if win < n else 0
        d = first_kept - min(sink, nb)
        if d <= 0:
            return None
        return sink, sink_tokens, win, d * bs

    def do_trim(self, slot, e, where):
        """trim_streaming of e (ours, or a pool sequence we claimed) under an I_TRIM
        intent; checks what it returns, seq_len, trimmed() and the kept data."""
        plan = self.trim_plan(e)
        if plan is None:
            return False
        sink, sink_tokens, win, drop = plan
        e.sink = sink
        e.intent, e.i_len, e.i_n = I_TRIM, e.conf, drop
        self.J.write(slot, e)
        self.on_pool = where == "pool"
        try:
            got = self.call("trim", self.cache.trim_streaming, e.sid, sink_tokens, win)
        finally:
            self.on_pool = False
        if got != drop:
            self.fail("bad_trim", f"{where}: trim_streaming({e.sid}, {sink_tokens}, {win}) "
                                  f"at length {e.conf} dropped {got} tokens, expected {drop}")
        n = self.call("seq_len", self.cache.seq_len, e.sid)
        t = self.call("trimmed", self.cache.trimmed, e.sid)
        if n != e.conf - got or t != e.trim + got:
            self.fail("bad_trim", f"{where}: after trim_streaming({e.sid}) dropped {got}: "
                                  f"seq_len {n} (expected {e.conf - got}), trimmed {t} "
                                  f"(expected {e.trim + got}); {e}")
        e.conf -= got
        e.trim += got
        e.intent = I_NONE
        self.J.write(slot, e)
        self.bump("trims")
        self.bump("trimmed_tokens", got)
        if self.rng.random() < 0.5:
            k, v = self.call("gather", self.cache.gather, e.sid)
            self.check_data(e, k, v, f"{where} after trim")
            self.check_ids(e, k.shape[1], f"{where} after trim")
        return True

    def op_trim_own(self, e):
        if not self.mine(e):
            return
        if self.trim_plan(e) is None:
            return self.op_append_own(e)
        try:
            self.do_trim(e.sid % self.NS, e, "own")
        except shmkv.SequenceNotFound as ex:
            self.own_vanished(e, ex)

    # -- truncate ------------------------------------------------------------------------
    def truncate_n(self, e):
        """Where to cut e: a speculative-decoding rollback (a few tokens), a block
        boundary, or anywhere (mostly inside a block that stays shared with forks or
        published: the next append must copy it)."""
        bs, L = self.bs, e.conf
        r = self.rng.random()
        if r < 0.35:
            return max(0, L - self.rng.randint(1, 2 * bs))
        if r < 0.55:
            return self.rng.randint(0, L // bs) * bs
        return self.rng.randint(0, L)

    def do_truncate(self, slot, e, where, n=None):
        """truncate(e, n) under an I_TRUNC intent (a death leaves the old length or n);
        checks seq_len, and starts a new lineage segment at n, so what is appended next
        differs from what was dropped: a write into a block others still read (a missed
        copy-on-write) shows in their data, a stale tail in ours."""
        n = self.truncate_n(e) if n is None else n
        L = e.conf
        e.intent, e.i_len, e.i_n = I_TRUNC, L, n
        e.cuts += 1                                # (readers: a truncate may come between)
        self.J.write(slot, e)
        self.on_pool = where == "pool"
        try:
            self.call("truncate", self.cache.truncate, e.sid, n)
        finally:
            self.on_pool = False
        got = self.call("seq_len", self.cache.seq_len, e.sid)
        if got != n:
            self.fail("bad_truncate", f"{where}: truncate({e.sid}, {n}) at length {L} left "
                                      f"{got} tokens; {e}")
        e.conf = n
        if len(e.segs) < MAXSEG - 1:
            o = int(self.codec.orig_e(e, n, n + 1)[0])
            e.segs = [s for s in e.segs if s[0] < o] + [(o, self.new_seed())]
        e.intent = I_NONE
        self.J.write(slot, e)
        self.bump("truncates")
        self.bump("truncated_tokens", L - n)
        if self.rng.random() < 0.4:
            k, v = self.call("gather", self.cache.gather, e.sid)
            self.check_data(e, k, v, f"{where} after truncate")
            self.check_ids(e, k.shape[1], f"{where} after truncate")
        return True

    def op_truncate_own(self, e):
        if not self.mine(e):
            return
        if e.conf == 0:
            return self.op_append_own(e)
        try:
            self.do_truncate(e.sid % self.NS, e, "own")
        except shmkv.SequenceNotFound as ex:
            return self.own_vanished(e, ex)
        if self.rng.random() < 0.6:                # go on from the cut (copy-on-write)
            self.op_append_own(e)

    def op_priority_or_match(self, e):
        if self.rng.random() < 0.5 and self.mine(e):
            try:
                self.call("set_priority", self.cache.set_priority, e.sid, self.rng.randrange(4))
            except shmkv.SequenceNotFound as ex:
                self.own_vanished(e, ex)
            return
        f, j = self.rng.randrange(N_FAMILIES), self.rng.randrange(N_VARIANTS)
        salt = self.rng.choice(SALT_PICK)
        plen = self.rng.randint(2, self.max_len)
        ids = self.codec.tid(self.prompts.segs(f, j, salt), np.arange(plen))
        m = self.call("match_prefix", self.cache.match_prefix, ids, salt=SALTS[salt])
        if m % self.bs or m > (plen - 1) // self.bs * self.bs:
            self.fail("bad_hit", f"match_prefix of a {plen}-token prompt says {m}")
        self.bump("matches")
