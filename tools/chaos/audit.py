"""The invariant checks of the kill-all audits: ``check()`` before and after
``recover()``, the independent block audit from the read-only snapshot, the journal audit
(every surviving detached sequence gathered and compared token by token), the prefix-index
audit and its probes.  A mixin of ``Controller``."""
from __future__ import annotations

import json

import numpy as np

import shmkv
from shmkv.inspect import snapshot

from .codec import resolve_record
from .common import (
    DETACHED,
    EMPTY,
    F_TOK,
    FREED,
    I_ADOPT,
    I_DETACH,
    I_FREE,
    I_NONE,
    I_TRIM,
    I_TRUNC,
    ORPHAN,
    OWNED,
    SALTS,
)
from .events import token_table


class Audits:
    """Kill-all audits (mixed into Controller)."""

    # -- the audit -----------------------------------------------------------------------
    def _audit(self, final):
        """Kill every worker at once, then: check() before and after recover(); block
        audit from the read-only snapshot; every journal record resolved and every
        surviving sequence verified token by token; nothing live unaccounted."""
        self.audits += 1
        for lane in list(self.workers):
            self._kill(lane, quiesce=True)
        for lane in list(self.workers):
            self._reap(lane, restart=False)
        c = self.cache
        try:
            problems = self.ccall(c.check)
            if problems:
                self.cfail("invariant", f"check() with every worker dead, before recover(): "
                                        f"{problems[:8]}")
            self.ccall(c.recover)
            problems = self.ccall(c.check)
            if problems:
                self.cfail("invariant", f"check() after recover(): {problems[:8]}")
        except shmkv.ShmkvError as e:
            self.cfail("invariant", f"audit: {type(e).__name__}: {e}")
            return
        locked = self._block_audit()
        self._journal_audit(locked)
        self._event_audit()                  # (events.py) before the probes below
        self._index_audit()
        problems = self.ccall(c.check)
        if problems:
            self.cfail("invariant", f"check() after the audit's prefix lookups: {problems[:8]}")

    def _block_audit(self):
        """Independent of check(): recount every block's references from the read-only
        snapshot.  Also: with every worker dead and recovery run, no sequence lock may
        still be held (returns those sequences: gathering them would wait)."""
        snap = snapshot(self.name)
        locked = set()
        for s in snap["sequences"]:
            if s["writer_token"]:
                locked.add(s["sid"])
                self.cfail("invariant", f"sequence {s['sid']}: its lock is still held by "
                                        f"token {s['writer_token']:#x} (alive: "
                                        f"{s['writer_alive']}) after recover() with every "
                                        f"worker dead")
        nb = self.cfg.num_blocks
        refs = np.zeros(nb, np.int64)
        for s in snap["sequences"]:
            t = s["table"]
            if t.size:
                np.add.at(refs, t.astype(np.int64), 1)
        for p in snap["processes"]:
            if p["alive"]:
                for b in p["inflight"]:
                    if 0 <= b < nb:
                        refs[b] += 1
        rc = snap["ref_cnt"].astype(np.int64)
        leaked = int(np.count_nonzero((rc > 0) & (refs == 0)))
        wrong = np.flatnonzero(rc != refs)
        st = self.cache.stats()
        referenced = int(np.count_nonzero(refs))
        self.max_leaked = max(self.max_leaked, leaked, st["used_blocks"] - referenced)
        if leaked or st["used_blocks"] != referenced:
            self.cfail("leak", f"{leaked} blocks have ref_cnt > 0 and no reference; "
                               f"stats used_blocks {st['used_blocks']}, referenced by live "
                               f"sequences {referenced}")
        if wrong.size:
            b = int(wrong[0])
            self.cfail("leak", f"{wrong.size} blocks have ref_cnt != references (block {b}: "
                               f"ref_cnt {int(rc[b])}, references {int(refs[b])})")
        return locked

    def _journal_audit(self, locked):
        c, J = self.cache, self.J
        live = set(c.sequences())
        accounted = set()
        for slot in range(self.cfg.max_seqs):
            e = J.read(slot)
            if e is None or e.state in (EMPTY, FREED):
                continue
            alive = e.sid in live
            detached = alive and c.owner_pid(e.sid) is None
            if e.state in (OWNED, ORPHAN):
                if e.intent == I_DETACH and detached:
                    e.state, e.intent = DETACHED, I_NONE
                elif alive:
                    self.cfail("unreclaimed", f"sequence {e.sid} of a dead worker survived "
                                              f"recovery (not detached): {e}")
                    accounted.add(e.sid)
                    continue
                else:
                    self.reclaimed_ctl += 1
                    e.state, e.intent = FREED, I_NONE
                    J.write(slot, e)
                    continue
            # DETACHED
            if not alive:
                if e.intent in (I_FREE, I_ADOPT):
                    e.state, e.intent = FREED, I_NONE
                    J.write(slot, e)
                    continue
                self.cfail("lost_sequence", f"detached sequence {e.sid} is gone: {e}")
                e.state, e.intent = FREED, I_NONE
                J.write(slot, e)
                continue
            if not detached:
                # an adopt in flight happened; its adopter is dead: must be reclaimed
                self.cfail("unreclaimed", f"sequence {e.sid} adopted by a dead worker "
                                          f"survived recovery: {e}")
                accounted.add(e.sid)
                continue
            accounted.add(e.sid)
            if e.sid in locked:
                continue                       # reported; a gather would wait on it
            self._verify_detached(slot, e)
        for sid in sorted(live - accounted):
            self.cfail("unaccounted", f"live sequence {sid} after recovery with every worker "
                                      f"dead is not a detached sequence in the journal "
                                      f"(owner pid {c.owner_pid(sid)})")

    def _verify_detached(self, slot, e):
        c = self.cache
        k, v = self.ccall(c.gather, e.sid)
        n = k.shape[1]
        t = self.ccall(c.trimmed, e.sid)
        if e.intent == I_TRIM:
            self.resolved_trims_ctl += 1
        elif e.intent == I_TRUNC:
            self.resolved_truncates_ctl += 1
        t_exp, conf, inflight, probs = resolve_record(e, n, t)
        for kind, msg, lost in probs:
            self.cfail(kind, f"detached sequence {e.sid}: {msg}: {e}")
            self.lost_tokens_ctl += lost
        pos = self.codec.orig(e.sink, t_exp, 0, n)
        bad = self.codec.mismatch_at(k, v, e.segs, pos)
        idx = np.flatnonzero(bad)
        if idx.size:
            i, cnt = int(idx[0]), int(idx.size)
            lost = int(bad[:conf].sum())
            self.lost_tokens_ctl += lost
            self.cfail("lost_tokens" if i < conf else "torn_publish",
                       f"detached sequence {e.sid}: token {i} (position {int(pos[i])}) of {n} "
                       f"differs from what its writers appended ({cnt} differ, {lost} of "
                       f"them confirmed; in flight {inflight}): {e}")
        if e.flags & F_TOK and n:
            got = self.ccall(c.token_ids, e.sid)
            want = self.codec.tid(e.segs, pos)
            if not np.array_equal(got, want):
                i = int(np.flatnonzero(got != want)[0])
                self.cfail("bad_ids", f"detached sequence {e.sid}: token_ids()[{i}] is "
                                      f"{int(got[i])}, it was given {int(want[i])}: {e}")
        self.seqs_verified_ctl += 1
        self.tokens_verified_ctl += n
        e.conf = n
        e.trim = t_exp
        e.intent = I_NONE
        self.J.write(slot, e)

    def _index_audit(self):
        """The prefix index after recovery, with every worker dead.  (1) Every hashed
        (findable) block, read raw: its K/V must be one whole block of a lineage at its
        own positions, and its token ids those of that lineage -- a block published
        before it was written, or reused while still findable, shows.  (2) Every shared
        prompt (each family, variant and salt) and every surviving tokened sequence's
        ids are looked up: create_sequence(tokens=) must share exactly the blocks
        match_prefix() promised, and they must hold exactly that prompt's K/V and ids
        (a wrong hit, a hit across salts, a chain that lost its head all show)."""
        c, cfg, bs = self.cache, self.cfg, self.cfg.block_size
        snap = snapshot(self.name, tables=False)
        hashed = np.flatnonzero(np.asarray(snap["block_flags"]) & 1)
        if self.views is None:
            self.views = [(c.key_cache(l), c.value_cache(l)) for l in range(cfg.num_layers)]
        toks = token_table(self.name, cfg)
        nbad = 0
        for b in hashed.tolist():
            k = np.stack([self.views[l][0][b] for l in range(cfg.num_layers)])
            v = np.stack([self.views[l][1][b] for l in range(cfg.num_layers)])
            err = self.codec.check_block(k, v, toks[b])
            if err:
                nbad += 1
                if nbad <= 5:
                    self.cfail("bad_index", f"hashed block {b} (ref_cnt "
                                            f"{int(snap['ref_cnt'][b])}): {err}")
        self.index_blocks_verified += int(hashed.size)
        # lookups: the shared prompts at full length, and the survivors' own ids
        probes = []
        for f, j, salt in self.prompts.all():
            probes.append((self.prompts.segs(f, j, salt), self.max_len_tokens(), salt,
                           f"prompt f{f} v{j} salt {SALTS[salt]}"))
        for slot in range(cfg.max_seqs):
            e = self.J.read(slot)
            if e is not None and e.state == DETACHED and e.flags & F_TOK and not e.trim \
                    and e.conf > bs:
                probes.append((e.segs, e.conf, e.salt, f"the ids of detached {e.sid}"))
        for segs, plen, salt, what in probes:
            self._probe(segs, plen, salt, what)

    def max_len_tokens(self):
        return self.cfg.max_blocks_per_seq * self.cfg.block_size

    def _probe(self, segs, plen, salt, what):
        c, bs = self.cache, self.cfg.block_size
        ids = self.codec.tid(segs, np.arange(plen))
        m = self.ccall(c.match_prefix, ids, salt=SALTS[salt])
        try:
            sid = self.ccall(c.create_sequence, tokens=ids, salt=SALTS[salt])
        except shmkv.CacheFullError:
            return
        try:
            h = self.ccall(c.seq_len, sid)
            self.audit_probes += 1
            if h != m or h % bs or h > (plen - 1) // bs * bs:
                self.cfail("bad_hit", f"audit, {what}: match_prefix says {m} tokens, "
                                      f"create_sequence(tokens=) shares {h}")
            if h:
                k, v = self.ccall(c.gather, sid)
                i, cnt = self.codec.first_mismatch(k, v, segs, 0)
                if i is not None:
                    self.cfail("bad_hit", f"audit, {what}: shared token {i} of {h} (block "
                                          f"{i // bs}, physical "
                                          f"{int(c.block_table(sid)[i // bs])}) is not the "
                                          f"prompt's ({cnt} tokens differ)")
                got = self.ccall(c.token_ids, sid)
                if not np.array_equal(got, ids[:h]):
                    i = int(np.flatnonzero(got != ids[:h])[0])
                    self.cfail("bad_hit", f"audit, {what}: shared token {i} of {h} has id "
                                          f"{int(got[i])}, the prompt's is {int(ids[i])}")
                self.audit_hit_blocks += h // bs
                self.tokens_verified_ctl += h
        finally:
            self.ccall(c.free, sid)

    # -- the report ----------------------------------------------------------------------
    def _read_failures(self):
        out = []
        try:
            with open(self.fail_path) as f:
                for line in f:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass
        except OSError:
            pass
        return out
