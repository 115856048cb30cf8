"""Data that proves itself: ``Codec`` writes every token as a function of (lineage seed,
position) and reads a sequence back into its lineage or a ``DataError``; ``Prompts`` are the
shared prompt families the prefix cache must find; ``resolve_record`` decides what a journal
record whose writer died may have published."""
from __future__ import annotations

import random

import numpy as np

from .common import I_APPEND, I_TRIM, I_TRUNC, M24, SALT_BITS, TABLE_COLS, TABLE_ROWS, _base_table


class DataError(Exception):
    def __init__(self, pos, msg):
        super().__init__(msg)
        self.pos = pos


class Codec:
    def __init__(self, cfg):
        if cfg.numpy_dtype != np.float32:
            raise ValueError("the chaos harness needs dtype float32 (exact integers)")
        if cfg.head_dim < 4:
            raise ValueError("the chaos harness needs head_dim >= 4")
        self.L, self.H, self.D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        self.bs = cfg.block_size
        self.HD = self.H * self.D
        if self.L * self.HD <= TABLE_COLS:
            base = _base_table()
        else:
            base = np.random.default_rng(0x5eed).integers(
                0, 1 << 24, size=(2, TABLE_ROWS, self.L * self.HD),
                dtype=np.int32).astype(np.float32)
        # table[kv][layer]: [rows, heads*dim] (a view; each row contiguous)
        self.table = [[base[kv, :, l * self.HD:(l + 1) * self.HD] for l in range(self.L)]
                      for kv in range(2)]

    def _per_pos(self, segs, pos):
        starts = np.array([s for s, _ in segs], np.int64)
        seeds = np.array([d for _, d in segs], np.int64)
        idx = np.searchsorted(starts, pos, side="right") - 1
        return seeds[idx], starts[idx]

    def make_at(self, segs, pos):
        """K, V [layers, len(pos), heads, dim] of the lineage at original positions pos."""
        pos = np.asarray(pos, np.int64)
        seed, start = self._per_pos(segs, pos)
        n = pos.size
        rows = (seed + pos) % TABLE_ROWS
        rows_v = (rows * 7 + 3) % TABLE_ROWS
        k = np.empty((self.L, n, self.HD), np.float32)
        v = np.empty((self.L, n, self.HD), np.float32)
        for l in range(self.L):
            np.take(self.table[0][l], rows, axis=0, out=k[l])
            np.take(self.table[1][l], rows_v, axis=0, out=v[l])
        k[0, :, 0] = seed & M24
        k[0, :, 1] = (seed >> 24) & M24
        k[0, :, 2] = start
        k[0, :, 3] = pos
        return (k.reshape(self.L, n, self.H, self.D), v.reshape(self.L, n, self.H, self.D))

    def make(self, segs, a, b):
        """K, V [layers, b-a, heads, dim] of positions [a, b) of a lineage."""
        return self.make_at(segs, np.arange(a, b, dtype=np.int64))

    def tid(self, segs, pos):
        """Token ids (int32 >= 0) of the lineage at original positions pos: a function of
        (segment seed without its salt bits, position) -- so two lineages that agree on
        the ids up to a position agree on the data there, salt apart (the cache salt
        keeps those from sharing; its bits in the seed make their data differ)."""
        pos = np.asarray(pos, np.int64)
        seed, _ = self._per_pos(segs, pos)
        x = ((seed >> SALT_BITS).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             + pos.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F))
        x ^= x >> np.uint64(31)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(29)
        return (x >> np.uint64(33)).astype(np.int32)

    def orig(self, sink, trim, a, b):
        """Original positions of current positions [a, b) of a sequence trimmed by `trim`
        tokens after a sink of `sink` blocks."""
        pos = np.arange(a, b, dtype=np.int64)
        if trim:
            pos[pos >= sink * self.bs] += trim
        return pos

    def orig_e(self, e, a, b):
        return self.orig(e.sink, e.trim, a, b)

    def mismatch_at(self, k, v, segs, pos):
        """bool [n]: token i of k/v differs from the lineage at original position pos[i]."""
        n = k.shape[1]
        if n == 0:
            return np.zeros(0, bool)
        ek, ev = self.make_at(segs, pos)
        return ((k != ek).reshape(self.L, n, -1).any(axis=(0, 2))
                | (v != ev).reshape(self.L, n, -1).any(axis=(0, 2)))

    def mismatch(self, k, v, segs, a):
        """bool [n]: token a+i of k/v differs from the lineage."""
        return self.mismatch_at(k, v, segs, np.arange(a, a + k.shape[1], dtype=np.int64))

    def first_mismatch_at(self, k, v, segs, pos):
        """Index of the first token of k/v that differs from the lineage at pos, the number
        of differing tokens; (None, 0) if equal."""
        if k.shape[1] == 0:
            return None, 0
        idx = np.flatnonzero(self.mismatch_at(k, v, segs, pos))
        if idx.size == 0:
            return None, 0
        return int(idx[0]), int(idx.size)

    def first_mismatch(self, k, v, segs, a):
        """Index (relative to a) of the first token of k/v that differs from the lineage,
        the number of differing tokens; (None, 0) if equal."""
        return self.first_mismatch_at(k, v, segs,
                                      np.arange(a, a + k.shape[1], dtype=np.int64))

    def derive(self, k, v):
        """The lineage spelled out by the data of tokens [0, n); DataError if the data is
        not a well-formed lineage (garbage, a torn token, a token at the wrong place)."""
        return self.derive_full(k, v)[0]

    def derive_full(self, k, v):
        """(segs, original positions, m, T): the lineage the data of tokens [0, n) spells
        out, and where it was trimmed: tokens [0, m) are at their own positions, tokens
        [m, n) T positions later (m = n, T = 0: never trimmed).  A trim keeps whole
        blocks: m and T are multiples of the block size, m > 0.  DataError if the data is
        not a well-formed (possibly trimmed) lineage."""
        n = k.shape[1]
        if n == 0:
            return [], np.zeros(0, np.int64), 0, 0
        bs = self.bs
        f = k[0, :, 0, :4].astype(np.int64)
        seed = f[:, 0] | (f[:, 1] << 24)
        start, pos = f[:, 2], f[:, 3]
        idx = np.arange(n)
        off = pos - idx
        m, T = n, 0
        wrong = np.flatnonzero(off != 0)
        if wrong.size:
            m = int(wrong[0])
            T = int(off[m])
            if m == 0 or m % bs or T <= 0 or T % bs:
                raise DataError(m, f"token {m} says it is position {int(pos[m])} (not a "
                                   f"whole-block trim after a sink)")
            bad = np.flatnonzero(off[m:] != T)
            if bad.size:
                i = m + int(bad[0])
                raise DataError(i, f"token {i} says it is position {int(pos[i])} (trimmed "
                                   f"by {T} after token {m})")
        change = np.flatnonzero(seed[1:] != seed[:-1]) + 1
        run_starts = np.concatenate(([0], change)).astype(np.int64)
        run_id = np.cumsum(np.isin(idx, change))
        rs_start = start[run_starts]
        wrong = np.flatnonzero(start != rs_start[run_id])
        if wrong.size:
            i = int(wrong[0])
            raise DataError(i, f"token {i} (seed {int(seed[i]):#x}) says its segment starts "
                               f"at {int(start[i])}, its run's first token says "
                               f"{int(rs_start[run_id[i]])}")
        for r, a in enumerate(run_starts.tolist()):
            s0, p0 = int(rs_start[r]), int(pos[a])
            if a == 0:
                ok = s0 == 0
            elif a == m:             # first kept token after the trim: its segment may
                ok = int(pos[a - 1]) < s0 <= p0          # have begun in the dropped part
            else:
                ok = s0 == p0
            if not ok:
                raise DataError(a, f"token {a} (seed {int(seed[a]):#x}, position {p0}) "
                                   f"starts a run but says its segment starts at {s0}")
        seeds = seed[run_starts]
        if len(set(seeds.tolist())) != len(seeds):
            raise DataError(int(run_starts[-1]), "a lineage seed appears in two runs")
        segs = list(zip(rs_start.tolist(), seeds.tolist()))
        i, cnt = self.first_mismatch_at(k, v, segs, pos)
        if i is not None:
            raise DataError(i, f"token {i}: data differs from its own descriptor "
                               f"({cnt} such tokens)")
        return segs, pos, m, T

    def check_block(self, k, v, ids):
        """A findable (hashed) block: k, v [layers, block_size, ...] and its token ids
        must be one full block of a lineage at its own, block-aligned positions, and the
        ids those of that lineage.  Returns None or what is wrong."""
        bs = self.bs
        f = k[0, :, 0, :4].astype(np.int64)
        seed = f[:, 0] | (f[:, 1] << 24)
        start, pos = f[:, 2], f[:, 3]
        p0 = int(pos[0])
        if p0 % bs or not np.array_equal(pos, p0 + np.arange(bs)):
            return f"its tokens say positions {pos.tolist()} (not one whole block)"
        change = np.flatnonzero(seed[1:] != seed[:-1]) + 1
        run_starts = np.concatenate(([0], change)).astype(np.int64)
        segs = []
        for r, a in enumerate(run_starts.tolist()):
            b = int(run_starts[r + 1]) if r + 1 < len(run_starts) else bs
            st = start[a:b]
            if np.any(st != st[0]):
                return f"tokens {a}..{b} of one seed disagree on their segment's start"
            s0 = int(st[0])
            if (a == 0 and s0 > p0) or (a > 0 and s0 != int(pos[a])):
                return f"token {a} (position {int(pos[a])}) says its segment starts at {s0}"
            segs.append((s0, int(seed[a])))
        i, cnt = self.first_mismatch_at(k, v, segs, pos)
        if i is not None:
            return f"token {i} (position {int(pos[i])}): data differs from its own " \
                   f"descriptor ({cnt} such tokens)"
        want = self.tid(segs, pos)
        bad = np.flatnonzero(np.asarray(ids) != want)
        if bad.size:
            i = int(bad[0])
            return (f"token {i} (position {int(pos[i])}) has id {int(ids[i])}, its data says "
                    f"{int(want[i])} ({bad.size} such tokens)")
        return None


N_FAMILIES = 4          # prompt families (a system prompt each) ...


N_VARIANTS = 3          # ... with variants that branch off them (variant 0 does not)


SALT_PICK = (0, 0, 0, 0, 1, 1, 2)


class Prompts:
    """The prompts every process shares: family f, variant j, salt s is a fixed lineage
    (from the run's seed), so prompts of one family hit each other's blocks, live or
    cached, across processes; a variant shares the family's first blocks and then
    branches (at a block boundary or inside a block); a salted prompt has the same
    token ids as the unsalted one but other data (the salt is in its seeds' low bits), so
    a hit across salts shows as wrong data."""

    def __init__(self, seed, bs):
        r = random.Random(seed)
        self.fam = [(r.getrandbits(43) << SALT_BITS) | 0 for _ in range(N_FAMILIES)]
        self.var = []
        for _ in range(N_FAMILIES):
            vs = [(0, 0)]
            for _ in range(1, N_VARIANTS):
                bp = r.randrange(1, 6) * bs + (r.randrange(1, bs) if r.random() < 0.5 else 0)
                vs.append((bp, r.getrandbits(43) << SALT_BITS))
            self.var.append(vs)

    def segs(self, f, j, salt):
        bp, vs = self.var[f][j]
        if bp == 0:
            return [(0, self.fam[f] | salt)]
        return [(0, self.fam[f] | salt), (bp, vs | salt)]

    def all(self):
        return [(f, j, s) for f in range(N_FAMILIES) for j in range(N_VARIANTS)
                for s in sorted(set(SALT_PICK))]


def resolve_record(e, n, trimmed):
    """A record and what the segment shows now (n = seq_len, trimmed = trimmed()), read
    by someone who holds the record's claim or with every worker dead: what must have
    happened to the operation in flight.  An append publishes all of its tokens or
    none; a trim (its journal redone by recovery after a death) drops all of its blocks
    or none, and trimmed() says so; a truncate to i_n leaves i_len tokens or i_n (its
    publish is one store), the kept ones unchanged.  Returns (trim the data must show,
    confirmed current length, in-flight append or None, problems [(kind, msg, lost
    tokens)])."""
    probs = []
    if e.intent == I_APPEND:
        lens = (e.i_len, e.i_len + e.i_n)
        t_exp, conf = e.trim, e.i_len
        inflight = (e.i_len, e.i_n)
    elif e.intent == I_TRIM:
        lens = (e.i_len, e.i_len - e.i_n)
        trimmed_now = n == e.i_len - e.i_n
        t_exp = e.trim + e.i_n if trimmed_now else e.trim
        conf = n if trimmed_now else e.i_len
        inflight = None
    elif e.intent == I_TRUNC:
        lens = (e.i_len, e.i_n)
        t_exp, conf, inflight = e.trim, (e.i_n if n == e.i_n else e.i_len), None
    else:
        lens = (e.conf,)
        t_exp, conf, inflight = e.trim, e.conf, None
    if n not in lens:
        if e.intent == I_TRUNC:
            msg = (f"a truncate from {e.i_len} to {e.i_n} tokens died in flight; the "
                   f"sequence has {n} tokens (one of the two expected)")
            probs.append(("bad_truncate", msg, max(0, e.i_n - n)))
        elif e.intent == I_TRIM:
            msg = (f"a trim of {e.i_n} tokens at length {e.i_len} died in flight; the "
                   f"sequence has {n} tokens (all or none dropped expected)")
            probs.append(("bad_trim", msg, max(0, e.i_len - e.i_n - n)))
        elif n < min(lens):
            probs.append(("lost_tokens", f"has {n} tokens, expected one of {lens}",
                          conf - n if n < conf else 0))
        else:
            probs.append(("torn_publish", f"has {n} tokens, expected one of {lens}", 0))
    if trimmed != t_exp:
        msg = f"trimmed() says {trimmed}, the trims it went through dropped {t_exp} (length {n})"
        probs.append(("bad_trim", msg, 0))
    return t_exp, conf, inflight, probs
