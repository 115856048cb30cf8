#!/usr/bin/env python3
"""tools/chaos.py -- the crash-safety proof of shmkv.

N worker processes run random create / append / fork / reserve+write / gather / paged
read / free / detach / adopt / recover / check loops on one segment.  A controller
SIGKILLs random workers every few milliseconds and restarts them; about half of the
restarted workers are armed with a named crash point (shmkv._core.CRASH_POINTS: the
process _exit(86)s at that line, inside the critical section), round-robin over the
points that have the fewest deaths, so deaths land inside every critical section and
not only between calls.  Every `--phase` seconds and at the end the controller kills
every worker at once and audits the segment: check() before and after recover(), an
independent block audit from the read-only snapshot (every block not referenced by a
live sequence must be free), and every surviving (detached) sequence gathered and
compared token by token with what its writers appended.

How data is verified without a side channel that could lie
----------------------------------------------------------
* Every token is a deterministic function of (segment seed, position): K/V rows come
  from a fixed table indexed by (seed + position), and four elements of K (layer 0,
  head 0) spell out the seed, the start of its lineage segment and the position.  A
  fork child continues its parent's lineage up to the fork point and then gets a new
  seed, so a copy-on-write slip shows as the wrong seed at the wrong place.  Any read
  (gather, fork, lock-free paged read) can check a sequence's structure from the data
  alone.
* A small shared journal (an mmap'd file, one double-buffered record per sequence
  slot, protected by a per-slot OFD lock that the kernel drops when its holder dies)
  records each sequence's lineage, the length its writer saw confirmed (written only
  AFTER the call returned) and the operation in flight (written BEFORE the call).
  After a death, whoever takes the slot next resolves the record against the segment:
  an append in flight may have published all of its n tokens or none of them; every
  confirmed token must still be there, bit for bit.
* Ownership: a worker owns what it created, forked or adopted.  detach() hands a
  sequence to the "pool"; pool sequences survive any death and are appended to
  (under the slot's journal lock, without adopting), forked, read lock-free, adopted
  and freed by other workers.  Non-detached sequences of a dead worker must be
  reclaimed (counted); a detached one must never vanish.
* Every shmkv call is timed; a call longer than --bound seconds, or a LockTimeout, is
  a failure ("no surviving worker ever blocked more than the bound").

Exit status 0 only if there was no failure of any kind and the counts were met
(--min-kills SIGKILLs, --min-per-point deaths at every crash point).  With --plant NAME
every process runs with a planted bug (shmkv._core.PLANTED_BUGS); add --expect-failure
to exit 0 only if the harness caught it.

Workers are started with multiprocessing's forkserver (default; ~15 ms a start, so the
2-core CI machine spends its time on chaos, not on importing numpy) or spawn
(--start-method spawn).  Both import the worker code as the module `chaos` from this
directory.
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import json
import mmap
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import uuid
import zlib

import numpy as np

import shmkv
from shmkv import _core

# workers are started by importing this file as the module `chaos`
TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
if TOOLS_DIR not in sys.path:
    sys.path.insert(0, TOOLS_DIR)

# --------------------------------------------------------------------------------------
# shared vocabulary
# --------------------------------------------------------------------------------------
OPS = ("attach", "create", "append", "reserve", "write", "fork", "gather", "paged_read",
       "free", "detach", "adopt", "recover", "check", "seq_len", "owner_pid", "tables",
       "stats", "create_tok", "append_tok", "reserve_tok", "commit", "match_prefix",
       "token_ids", "trim", "trimmed", "evict", "set_priority")
OP_INDEX = {n: i for i, n in enumerate(OPS)}

# failure kinds (each is counted; any count > 0 fails the run)
FAIL_KINDS = (
    "lost_tokens",      # a confirmed (published, call returned) token is missing or wrong
    "torn_publish",     # a published token that is not what its writer wrote (in flight)
    "garbage",          # a read saw data that is not a well-formed lineage
    "lost_sequence",    # a detached sequence, or one whose owner is alive, vanished
    "unreclaimed",      # a non-detached sequence of a dead worker survived recovery
    "unaccounted",      # a live sequence nobody created (after recovery, all dead)
    "invariant",        # check() returned problems
    "leak",             # a block neither free nor referenced, or ref_cnt != references
    "lock_timeout",     # a LockTimeout escaped a call
    "blocked",          # a call took longer than --bound
    "exception",        # any other unexpected exception in a worker
    "worker_crash",     # a worker died by an unexpected signal or exit status
    "harness",          # the harness itself could not do its job (journal)
    "bad_hit",          # a prefix-cache hit shared blocks whose K/V or token ids are not the
                        # prompt's (wrong data, wrong salt, a block reused under its hash)
    "bad_ids",          # token_ids() of a sequence differ from the ids it was given
    "bad_trim",         # trim_streaming dropped the wrong blocks, or trimmed() / seq_len()
                        # disagree with what was kept (after a death: with the trim journal)
    "bad_evict",        # evict() took a sequence it must not (a live process's own, an
                        # excluded one) or returned ids it did not free
    "bad_index",        # a hashed (findable) block whose data or token ids are not a
                        # well-formed full block, or whose ids do not match its data
)
FAIL_INDEX = {k: i for i, k in enumerate(FAIL_KINDS)}

LANE_FIELDS = ("inc", "pid", "ready", "lost_token_count", "tokens_verified",
               "seqs_verified", "reads_discarded", "reclaimed_seen", "cache_full",
               "pool_appends", "resolved_inflight", "cow_appends", "not_found",
               "claim_busy", "max_claim_wait_ns", "startup_ns_sum", "startup_ns_max",
               "startups", "ready_mono_ns", "prompt_creates", "prefix_hit_blocks",
               "prefix_hit_tokens_verified", "ids_verified", "tok_appends", "commits",
               "committed_blocks", "trims", "trimmed_tokens", "resolved_trims",
               "evict_calls", "evicted", "evicted_dead", "matches", "cur_op")
LF = {n: i for i, n in enumerate(LANE_FIELDS)}
N_LF = len(LANE_FIELDS)
LANE_WORDS = N_LF + len(FAIL_KINDS) + 2 * len(OPS)
FAIL_BASE = N_LF
CNT_BASE = N_LF + len(FAIL_KINDS)
MAX_BASE = CNT_BASE + len(OPS)

# journal entry states and intents
EMPTY, OWNED, DETACHED, FREED, ORPHAN = 0, 1, 2, 3, 4
STATE_NAMES = {EMPTY: "empty", OWNED: "owned", DETACHED: "detached", FREED: "freed",
               ORPHAN: "orphan"}
I_NONE, I_APPEND, I_FREE, I_DETACH, I_ADOPT, I_TRIM = 0, 1, 2, 3, 4, 5
INTENT_NAMES = {I_NONE: "-", I_APPEND: "append", I_FREE: "free", I_DETACH: "detach",
                I_ADOPT: "adopt", I_TRIM: "trim"}
F_RESERVE_OK = 1        # only this sequence's creator touches it: reserve+write allowed
F_TOK = 2               # every token was given with its id (tokens=): token_ids() is known
SALT_SHIFT = 4          # flags bits 4-5: the cache salt (0: none, 1..3: SALTS[i])
SALT_BITS = 2           # a lineage seed's low bits carry the salt: content differs, ids not
SALTS = (None, "tenant-a", "tenant-b", "tenant-c")

POOL_OP = 100           # cur_op: + this when the call is on a claimed pool sequence
MAXSEG = 32
# sid, state, intent, holder, flags, conf, i_len, i_n, nseg, trim, sink, starts, seeds
PAYLOAD = struct.Struct(f"<qIIqIIIIIII{MAXSEG}I{MAXSEG}Q")
COPY_BYTES = 512
assert 16 + PAYLOAD.size <= COPY_BYTES
ENTRY_BYTES = 2 * COPY_BYTES
JHDR_BYTES = 4096
LOCK_BASE = 1 << 30     # OFD lock of slot s: byte LOCK_BASE + s of the journal file
EVICT_GATE = -1         # ... and the detach/evict gate, byte LOCK_BASE - 1
M24 = (1 << 24) - 1
TABLE_ROWS = 509        # rows of the fill table (prime)
TABLE_COLS = 2048       # elements of one token (all layers, K or V) the shared table covers
_BASE_TABLE = None


def _base_table():
    """The fill table.  Made when the module is imported as `chaos` (the forkserver
    preloads it, so every worker inherits it instead of building it after each restart);
    not when the file runs as the controller's __main__ or a child's __mp_main__."""
    global _BASE_TABLE
    if _BASE_TABLE is None:
        _BASE_TABLE = np.random.default_rng(0x5eed).integers(
            0, 1 << 24, size=(2, TABLE_ROWS, TABLE_COLS), dtype=np.int32).astype(np.float32)
    return _BASE_TABLE


if __name__ == "chaos":
    _base_table()


class Entry:
    """One journal record: what the harness knows about the sequence in a slot.

    Positions: `conf`, `i_len` are current positions of the sequence; its lineage `segs`
    is in ORIGINAL positions (what the token was when it was appended).  They differ
    once trim_streaming dropped blocks: current position i < sink * block_size is
    original i, any later one is original i + trim."""
    __slots__ = (
        "conf",
        "flags",
        "holder",
        "i_len",
        "i_n",
        "intent",
        "segs",
        "sid",
        "sink",
        "state",
        "trim",
        "ver",
    )

    def __init__(self, sid=0, state=EMPTY, intent=I_NONE, holder=0, flags=0, conf=0,
                 i_len=0, i_n=0, segs=(), ver=0, trim=0, sink=0):
        self.sid, self.state, self.intent, self.holder = sid, state, intent, holder
        self.flags, self.conf, self.i_len, self.i_n = flags, conf, i_len, i_n
        self.segs = list(segs)
        self.ver = ver
        self.trim, self.sink = trim, sink

    @property
    def salt(self):
        return (self.flags >> SALT_SHIFT) & 3

    def pack(self):
        n = len(self.segs)
        if n > MAXSEG:
            raise ValueError("too many lineage segments")
        starts = [s for s, _ in self.segs] + [0] * (MAXSEG - n)
        seeds = [d for _, d in self.segs] + [0] * (MAXSEG - n)
        return PAYLOAD.pack(self.sid, self.state, self.intent, self.holder, self.flags,
                            self.conf, self.i_len, self.i_n, n, self.trim, self.sink,
                            *starts, *seeds)

    @classmethod
    def unpack(cls, raw, ver):
        v = PAYLOAD.unpack(raw)
        n = min(v[8], MAXSEG)
        starts = v[11:11 + MAXSEG]
        seeds = v[11 + MAXSEG:11 + 2 * MAXSEG]
        return cls(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7],
                   list(zip(starts[:n], seeds[:n])), ver, v[9], v[10])

    def copy(self):
        return Entry(self.sid, self.state, self.intent, self.holder, self.flags, self.conf,
                     self.i_len, self.i_n, self.segs, self.ver, self.trim, self.sink)

    def __repr__(self):
        return (f"Entry(sid={self.sid}, {STATE_NAMES.get(self.state, self.state)}, "
                f"intent={INTENT_NAMES.get(self.intent, self.intent)}({self.i_len},"
                f"{self.i_n}), holder={self.holder >> 32}.{self.holder & 0xffffffff}, "
                f"conf={self.conf}, flags={self.flags:#x}, trim={self.trim}, "
                f"sink={self.sink}, segs={self.segs})")


# --------------------------------------------------------------------------------------
# the journal: an mmap'd file every process opens for itself
# --------------------------------------------------------------------------------------
class Journal:
    def __init__(self, path, nlanes, nslots, create=False):
        self.path, self.nlanes, self.nslots = path, nlanes, nslots
        self.off_lanes = JHDR_BYTES
        self.off_hints = self.off_lanes + nlanes * LANE_WORDS * 8
        self.off_busy = self.off_hints + nslots * 8
        self.off_entries = self.off_busy + nslots * 8
        size = self.off_entries + nslots * ENTRY_BYTES
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(self.fd, size)
        self.mm = mmap.mmap(self.fd, size)
        self.lanes = np.frombuffer(self.mm, np.int64, nlanes * LANE_WORDS,
                                   self.off_lanes).reshape(nlanes, LANE_WORDS)
        # hints[slot]: sid of a detached sequence there (0: none); a hint, the record rules
        self.hints = np.frombuffer(self.mm, np.int64, nslots, self.off_hints)
        # busy[slot]: lane + 1 of a worker appending to that pool sequence right now
        self.busy = np.frombuffer(self.mm, np.int64, nslots, self.off_busy)
        self.held = set()

    def close(self):
        self.lanes = self.hints = self.busy = None
        try:
            self.mm.close()
        except BufferError:
            pass
        os.close(self.fd)

    # per-slot claim: an OFD write lock, dropped by the kernel when the holder dies
    def _lk(self, slot, typ, wait=False):
        data = struct.pack("hhqqi4x", typ, os.SEEK_SET, LOCK_BASE + slot, 1, 0)
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, data)

    def try_lock(self, slot):
        if slot in self.held:
            return True
        try:
            self._lk(slot, fcntl.F_WRLCK)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        self.held.add(slot)
        return True

    def unlock(self, slot):
        if slot in self.held:
            self._lk(slot, fcntl.F_UNLCK)
            self.held.discard(slot)

    # The detach gate: a detach (intent, call, record) holds it shared, an evict()
    # exclusively.  So no sequence becomes detached while an evictor's exclude list is
    # being used: evict() may take only the evictor's own sequences, the pool sequences
    # it claimed, and dead processes' sequences -- which the evictor can tell apart.
    def gate_shared(self):
        self._lk(EVICT_GATE, fcntl.F_RDLCK, wait=True)

    def gate_exclusive(self):
        try:
            self._lk(EVICT_GATE, fcntl.F_WRLCK)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def gate_release(self):
        self._lk(EVICT_GATE, fcntl.F_UNLCK)

    def slots_of_lane(self, lane):
        """Slots whose record (either copy, unverified: a hint) names a holder of `lane`."""
        h = np.frombuffer(self.mm, np.uint8, self.nslots * ENTRY_BYTES, self.off_entries)
        h = h.reshape(self.nslots, 2, COPY_BYTES)[:, :, 16 + 16:16 + 24].copy()   # holder
        holder = h.view("<i8").reshape(self.nslots, 2)
        return np.flatnonzero(((holder != 0) & ((holder >> 32) == lane)).any(axis=1)).tolist()

    def _copy_off(self, slot, c):
        return self.off_entries + slot * ENTRY_BYTES + c * COPY_BYTES

    def _read_copy(self, slot, c):
        o = self._copy_off(slot, c)
        raw = self.mm[o:o + 16 + PAYLOAD.size]
        crc, = struct.unpack_from("<I", raw, 0)
        ver, = struct.unpack_from("<Q", raw, 8)
        if ver == 0 or zlib.crc32(raw[8:]) != crc:
            return None
        return Entry.unpack(raw[16:], ver)

    def read(self, slot):
        """The newest intact copy of a slot's record (a torn copy is skipped), or None."""
        for _ in range(3):
            a, b = self._read_copy(slot, 0), self._read_copy(slot, 1)
            best = max((e for e in (a, b) if e is not None), key=lambda e: e.ver,
                       default=None)
            if best is not None:
                return best
            if self._raw_ver(slot, 0) == 0 and self._raw_ver(slot, 1) == 0:
                return None
        return None

    def _raw_ver(self, slot, c):
        return struct.unpack_from("<Q", self.mm, self._copy_off(slot, c) + 8)[0]

    def write(self, slot, e):
        """Writes the older copy, checksum last: a death mid-write leaves the other."""
        a, b = self._read_copy(slot, 0), self._read_copy(slot, 1)
        va = a.ver if a else 0
        vb = b.ver if b else 0
        c = 0 if va <= vb else 1
        e.ver = max(va, vb) + 1
        body = struct.pack("<Q", e.ver) + e.pack()
        o = self._copy_off(slot, c)
        self.mm[o + 4:o + 8] = b"\0\0\0\0"
        self.mm[o:o + 4] = b"\xff\xff\xff\xff"          # invalidate first
        self.mm[o + 8:o + 8 + len(body)] = body
        self.mm[o:o + 4] = struct.pack("<I", zlib.crc32(body))
        self.hints[slot] = e.sid if e.state == DETACHED else 0


def _lane_sum(J, base, n):
    return J.lanes[:, base:base + n].sum(axis=0)


# --------------------------------------------------------------------------------------
# the data: every token is a function of (lineage segment seed, position)
# --------------------------------------------------------------------------------------
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


# the shared prompts, and what a record says a sequence must be after a death
# --------------------------------------------------------------------------------------
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
    or none, and trimmed() says so.  Returns (trim the data must show, confirmed
    current length, in-flight append or None, problems [(kind, msg, lost tokens)])."""
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
    else:
        lens = (e.conf,)
        t_exp, conf, inflight = e.trim, e.conf, None
    if n not in lens:
        if e.intent == I_TRIM:
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


# --------------------------------------------------------------------------------------
# the worker
# --------------------------------------------------------------------------------------
class Worker:
    MAX_OWN = 6
    POOL_TARGET = 32

    def __init__(self, a):
        self.a = a
        self.lane, self.inc = a["lane"], a["inc"]
        self.me = (self.lane << 32) | self.inc
        self.rng = random.Random(a["seed"])
        self.J = Journal(a["journal"], a["lanes"], a["max_seqs"])
        self.lv = self.J.lanes[self.lane]
        self.own = {}
        self.bound_ns = int(a["bound"] * 1e9)
        self.fail_fd = os.open(a["failures"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.logged = {}
        self.cache = None
        self.focus = None
        self.on_pool = False        # the call is on a pool (detached) sequence we claimed

    # -- bookkeeping -------------------------------------------------------------------
    def bump(self, field, n=1):
        self.lv[LF[field]] += n

    def fail(self, kind, msg):
        self.lv[FAIL_BASE + FAIL_INDEX[kind]] += 1
        k = self.logged.get(kind, 0)
        self.logged[kind] = k + 1
        if k < 10:
            line = json.dumps({"kind": kind, "lane": self.lane, "inc": self.inc, "pid": os.getpid(),
                                   "t": time.time(), "msg": msg[:2000]}) + "\n"
            os.write(self.fail_fd, line.encode())

    def call(self, op, fn, *args, **kw):
        # what we are in (for the controller: where a crash point killed us)
        self.lv[LF["cur_op"]] = OP_INDEX[op] + 1 + (POOL_OP if self.on_pool else 0)
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kw)
        except shmkv.LockTimeout as e:
            self.fail("lock_timeout", f"{op}{args[:1]}: {e}")
            raise
        finally:
            dt = time.perf_counter_ns() - t0
            i = OP_INDEX[op]
            self.lv[CNT_BASE + i] += 1
            self.lv[MAX_BASE + i] = max(self.lv[MAX_BASE + i], dt)
            if dt > self.bound_ns:
                self.fail("blocked", f"{op}{args[:1]} took {dt / 1e9:.3f} s "
                                     f"(bound {self.bound_ns / 1e9} s)")

    def new_seed(self):
        return self.rng.getrandbits(47) | 1

    # -- main ------------------------------------------------------------------------------
    def run(self):
        a = self.a
        if not a.get("arm_via_env"):
            if a.get("plant"):
                _core.plant_bug(a["plant"])
            if a.get("crash"):
                _core.set_crash_point(a["crash"], a["countdown"])
        self.lv[LF["pid"]] = os.getpid()
        self.lv[LF["inc"]] = self.inc
        self.cache = self.call("attach", shmkv.KVCache.attach, a["name"], prefault=False)
        self.cache.lock_timeout = a["lock_timeout"]
        cfg = self.cache.config
        self.cfg = cfg
        self.bs = cfg.block_size
        self.NS = cfg.max_seqs
        self.max_len = cfg.max_blocks_per_seq * cfg.block_size
        self.codec = Codec(cfg)
        self.prompts = Prompts(a["prompt_seed"], self.bs)
        self.views = None
        # an armed worker leans towards the calls that reach its crash point (the older
        # points sit on paths every step takes; these two need a long tokened sequence)
        self.focus = {"publish_mid": self.focus_publish,
                      "trim_mid": self.focus_trim}.get(a.get("crash"))
        self.J.busy[self.J.busy == self.lane + 1] = 0      # left by our lane's last death
        self.resolve_lane()
        dt = time.time_ns() - a["t_start_ns"]

        self.bump("startup_ns_sum", dt)
        self.bump("startups")
        self.lv[LF["startup_ns_max"]] = max(self.lv[LF["startup_ns_max"]], dt)
        self.lv[LF["ready_mono_ns"]] = time.monotonic_ns()
        self.lv[LF["ready"]] = self.inc
        while True:
            try:
                self.step()
            except shmkv.LockTimeout:
                pass                                 # already counted
            except DataError as e:
                self.fail("garbage", str(e))
            except Exception:  # noqa: BLE001 -- any other exception is a finding
                self.fail("exception", traceback.format_exc())

    def step(self):
        r = self.rng.random()
        own = list(self.own.values())
        if not own or (len(own) < self.MAX_OWN and r < 0.10):
            return self.op_create()
        if self.focus is not None and self.rng.random() < 0.5:
            return self.focus()
        e = self.rng.choice(own)
        r = self.rng.random()
        if r < 0.18:
            self.op_append_own(e)
        elif r < 0.25:
            if e.flags & F_RESERVE_OK:
                self.op_reserve_write(e)
            else:
                self.op_append_own(e)
        elif r < 0.31:
            self.op_fork_own(e)
        elif r < 0.37:
            self.op_verify_own(e)
        elif r < 0.41:
            self.op_free_own(e)
        elif r < 0.47:
            self.op_detach(e)
        elif r < 0.50:
            self.op_trim_own(e)
        elif r < 0.51:
            self.op_evict()
        elif r < 0.52:
            self.op_priority_or_match(e)
        elif r < 0.71:
            self.op_pool_claim()
        elif r < 0.79:
            self.op_pool_fork()
        elif r < 0.95:
            self.op_pool_read()
        elif r < 0.98:
            self.call("recover", self.cache.recover)
        else:
            problems = self.call("check", self.cache.check)
            if problems:
                self.fail("invariant", f"check() in a worker: {problems[:10]}")

    def focus_publish(self):
        """Armed with publish_mid: tokened appends that fill a block at index >= 2 (where
        the point sits), to own sequences and to pool sequences (whose death mid-publish
        leaves a surviving sequence with part of its blocks indexed)."""
        r = self.rng.random()
        room = len(self.own) < self.MAX_OWN
        if r < 0.25 and room:
            return self.op_create_prompt()
        if r < 0.55:
            return self.op_pool_claim(mode="append")
        cands = [e for e in self.own.values() if e.flags & F_TOK and not e.trim
                 and e.conf + self.bs <= self.max_len]
        if not cands:
            if room:
                return self.op_create_prompt()
            return self.op_free_own(self.rng.choice(list(self.own.values())))
        e = self.rng.choice(cands)
        n = self.bs - e.conf % self.bs + self.rng.randrange(self.bs)
        n = min(n, self.max_len - e.conf)
        if e.flags & F_RESERVE_OK and self.rng.random() < 0.4:
            return self.op_reserve_write(e, n)
        return self.append_n(e, n)

    def focus_trim(self):
        """Armed with trim_mid: trims, mostly of pool sequences (a death mid-trim must
        leave them trimmed all or nothing, with trimmed() right, after recovery)."""
        if self.rng.random() < 0.6:
            return self.op_pool_claim(mode="trim")
        cands = [e for e in self.own.values() if e.conf > 3 * self.bs]
        if not cands:
            e = self.rng.choice(list(self.own.values()))
            return self.append_n(e, min(self.max_len - e.conf, 2 * self.bs))
        return self.op_trim_own(self.rng.choice(cands))

    # -- claims ----------------------------------------------------------------------------
    def claim_new(self, slot, sid):
        """Take the journal slot of a sequence we just created (its previous holder may
        still be letting go); judge the record it held.  False if it cannot be had."""
        t0 = time.perf_counter_ns()
        while not self.J.try_lock(slot):
            if time.perf_counter_ns() - t0 > 5e9:
                self.fail("harness",
                          f"slot {slot} of new sequence {sid}: its journal lock stayed held "
                          f"5 s (a live holder still believes its sequence is there): "
                          f"{self.J.read(slot)}")
                return False
            time.sleep(0.0002)
        dt = time.perf_counter_ns() - t0
        self.lv[LF["max_claim_wait_ns"]] = max(self.lv[LF["max_claim_wait_ns"]], dt)
        old = self.J.read(slot)
        if old is not None and old.sid != sid:
            self.judge_vanished(old, f"slot {slot} reused by {sid}")
        return True

    def judge_vanished(self, old, why):
        """`old` describes a sequence that no longer exists (its slot was reused or the
        sequence is gone).  Legitimate only if it was being freed, or owned by a worker
        that died (reclaimed)."""
        if old.state in (EMPTY, FREED):
            return
        if old.state in (OWNED, ORPHAN):
            self.bump("reclaimed_seen")
            return
        if old.intent in (I_FREE, I_ADOPT):
            return
        self.fail("lost_sequence", f"detached sequence vanished ({why}): {old}")

    def resolve_lane(self):
        """Records our lane's previous incarnations left behind: a pending detach may
        have happened; owned sequences must go (recovery reclaims them)."""
        for slot in self.J.slots_of_lane(self.lane):
            e = self.J.read(slot)
            if e is None or (e.holder >> 32) != self.lane or (e.holder & 0xffffffff) >= self.inc:
                continue
            if e.state not in (OWNED, ORPHAN):
                continue
            if not self.J.try_lock(slot):
                continue
            try:
                e = self.J.read(slot)
                if e is None or e.state not in (OWNED, ORPHAN) or (e.holder >> 32) != self.lane:
                    continue
                self.resolve_dead_owned(slot, e)
            finally:
                self.J.unlock(slot)

    def live_owner(self, sid):
        """(live, detached) of a sequence, from the segment."""
        try:
            pid = self.call("owner_pid", self.cache.owner_pid, sid)
        except shmkv.SequenceNotFound:
            return False, False
        return True, pid is None

    def resolve_dead_owned(self, slot, e):
        live, detached = self.live_owner(e.sid)
        if not live:
            self.bump("reclaimed_seen")
            e.state, e.intent = FREED, I_NONE
            self.J.write(slot, e)
            return
        if detached and e.intent == I_DETACH:
            e.state, e.intent, e.holder = DETACHED, I_NONE, self.me
            e.flags &= ~F_RESERVE_OK
            self.verify_claimed(slot, e)
            return
        e.state = ORPHAN               # owner dead: the next recovery must reclaim it
        self.J.write(slot, e)

    # -- own sequences -------------------------------------------------------------------
    def op_create(self):
        if self.rng.random() < 0.6:
            return self.op_create_prompt()
        try:
            sid = self.call("create", self.cache.create_sequence,
                            priority=self.rng.randrange(4))
        except shmkv.CacheFullError:
            return self.on_full("create")
        slot = sid % self.NS
        if not self.claim_new(slot, sid):
            self.call("free", self.cache.free, sid)
            return
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
        try:
            sid = self.call("create_tok", self.cache.create_sequence, tokens=ids,
                            salt=SALTS[salt], priority=self.rng.randrange(4))
        except shmkv.CacheFullError:
            return self.on_full("create")
        slot = sid % self.NS
        if not self.claim_new(slot, sid):
            self.call("free", self.cache.free, sid)
            return
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
        if m < h:
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
        try:
            if e.flags & F_TOK:
                self.call("append_tok", self.cache.append, e.sid, k, v, tokens=ids)
                self.bump("tok_appends")
            else:
                self.call("append", self.cache.append, e.sid, k, v)
        except shmkv.CacheFullError:
            self.on_full("append")
            return False
        except shmkv.SequenceNotFound as ex:
            self.own_vanished(e, ex)
            return False
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
        try:
            if tok:
                slots = self.call("reserve_tok", self.cache.reserve, e.sid, n, tokens=ids)
            else:
                slots = self.call("reserve", self.cache.reserve, e.sid, n)
        except shmkv.CacheFullError:
            self.on_full("reserve")
            return False
        except shmkv.SequenceNotFound as ex:
            self.own_vanished(e, ex)
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
        if e.intent in (I_APPEND, I_TRIM):
            self.bump("resolved_inflight" if e.intent == I_APPEND else "resolved_trims")
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
                        or (mode == "trim" and e.conf > 3 * self.bs)):
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
            if prefer_free or (npool > self.POOL_TARGET and r < 0.8 and mode is None) \
                    or e.conf >= self.max_len - 8:
                e.intent = I_FREE
                self.J.write(slot, e)
                try:
                    self.call("free", self.cache.free, e.sid)
                except shmkv.SequenceNotFound:
                    self._lost(slot, e)
                    return
                e.state, e.intent = FREED, I_NONE
                self.J.write(slot, e)
            elif r < 0.60:
                for _ in range(self.rng.randint(1, 3)):
                    if not self.pool_append(slot, e):
                        break
            elif r < 0.70:
                try:
                    if not self.do_trim(slot, e, "pool"):
                        self.pool_append(slot, e)
                except shmkv.SequenceNotFound:
                    self._lost(slot, e)
            elif r < 0.78 and len(self.own) < self.MAX_OWN:
                e.intent = I_ADOPT
                self.J.write(slot, e)
                try:
                    self.call("adopt", self.cache.adopt, e.sid)
                except shmkv.SequenceNotFound:
                    self._lost(slot, e)
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
            slot = self.pick_pool()
            if slot is None:
                return
            e = self.J.read(slot)
            if e is None or e.state != DETACHED:
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

    def check_pool_read(self, e1, e2, k, v, where):
        """A read of a pool sequence nobody let us hold: e1 its record read before the
        data (None: not read), e2 after it.  The data must be a well-formed (maybe
        trimmed) lineage; every token the records confirm must be there and right, in
        the places the trims that can have happened leave it.  Returns derive_full's
        (segs, positions, m, trim) or None (garbage: reported)."""
        n = k.shape[1]
        try:
            segs, pos, m, tr = self.codec.derive_full(k, v)
        except DataError as ex:
            self.fail("garbage", f"{where} ({n} tokens): {ex}; record {e1 or e2}")
            return None
        first = e1 if e1 is not None else e2
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
            if tr != e1.trim:
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
                    got = self.paged_read(sid)
                    if got is None:
                        return
                    k, v = got
                    e2 = self.J.read(slot)
                    if e2 is not None and e2.sid != sid:
                        e2 = None
                    self.check_pool_read(None, e2, k, v,
                                         f"paged read of {sid} during an append")
                    self.bump("tokens_verified", k.shape[1])
                    return
        slot = self.pick_pool()
        if slot is None:
            return
        e = self.J.read(slot)
        if e is None or e.state != DETACHED:
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


def worker_entry(a):
    """Process target (module `chaos`, importable by spawn and forkserver)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    w = None
    try:
        w = Worker(a)
        w.run()
    except BaseException:  # noqa: BLE001 -- record why the worker died, then die
        try:
            fd = os.open(a["failures"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            line = json.dumps({"kind": "exception", "lane": a["lane"], "inc": a["inc"],
                                   "pid": os.getpid(), "t": time.time(),
                                   "msg": "worker died: " + traceback.format_exc()[-2000:]})
            os.write(fd, (line + "\n").encode())
            if w is not None:
                w.lv[FAIL_BASE + FAIL_INDEX["exception"]] += 1
        finally:
            os._exit(3)


# --------------------------------------------------------------------------------------
# the controller
# --------------------------------------------------------------------------------------
def _unlink_segment(name):
    """The segment's name, whatever state the run is in (gone already is fine)."""
    import posix_ipc
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass


def _prepare_children(method):
    """Make worker starts cheap and importable.  (1) The forkserver imports its preload
    list before it applies the parent's sys.path, so it finds `chaos` only through
    PYTHONPATH.  (2) A child re-runs the parent's __main__ as __mp_main__; run as a
    script that means compiling this file again in every worker, run as the module
    `chaos` (what `python -m chaos` would do) it is a cached import."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if TOOLS_DIR not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([TOOLS_DIR] + paths)
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__spec__", None) is None and \
            os.path.abspath(getattr(main, "__file__", "")) == os.path.abspath(__file__):
        import importlib.util
        main.__spec__ = importlib.util.find_spec("chaos")

def _fmt_s(ns):
    return f"{ns / 1e9:.4f}"


class Controller:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.points = list(_core.CRASH_POINTS)
        self.cp_deaths = {p: 0 for p in self.points}
        self.cp_armed = {p: 0 for p in self.points}
        self.cp_ops = {p: {} for p in self.points}     # point -> the call it died in
        self.kills = 0                 # SIGKILLs landed on a running worker
        self.kills_quiesce = 0         # SIGKILLs of the kill-all audits
        self.restarts = 0
        self.inc = 0
        self.fails = {k: 0 for k in FAIL_KINDS}
        self.fail_lines = []
        self.checks = 0
        self.audits = 0
        self.max_leaked = 0
        self.lost_tokens_ctl = 0
        self.seqs_verified_ctl = 0
        self.tokens_verified_ctl = 0
        self.reclaimed_ctl = 0
        self.max_ctl_call_ns = 0
        self.armed_survived = 0
        self.exit_other = {}
        self.workers = {}              # lane -> dict(proc, inc, crash, started)
        self.heartbeat = time.monotonic()
        self.doing = "starting"
        self.done = False
        self.hung_workers = 0
        self.aimed_kills = 0
        self.sabotaged = 0
        self.t_start = time.monotonic()
        self.prompt_seed = self.rng.getrandbits(64)
        self.index_blocks_verified = 0      # hashed blocks checked in audits
        self.audit_probes = 0               # prompts probed in audits
        self.audit_hit_blocks = 0           # blocks those probes shared, verified
        self.resolved_trims_ctl = 0
        self.views = None

    def cfail(self, kind, msg):
        self.fails[kind] += 1
        if len(self.fail_lines) < 200:
            self.fail_lines.append({"kind": kind, "lane": -1, "msg": msg[:2000]})
        if self.args.verbose:
            print(f"  FAIL[{kind}] controller: {msg[:300]}", flush=True)

    def beat(self, doing):
        self.heartbeat = time.monotonic()
        self.doing = doing

    def ccall(self, fn, *a, **kw):
        self.beat(f"{getattr(fn, '__name__', fn)}{a[:1]}")
        t0 = time.perf_counter_ns()
        try:
            return fn(*a, **kw)
        finally:
            dt = time.perf_counter_ns() - t0
            self.max_ctl_call_ns = max(self.max_ctl_call_ns, dt)

    # -- setup ---------------------------------------------------------------------------
    def run(self):
        a = self.args
        if a.plant:
            _core.plant_bug(a.plant)      # the whole build is buggy, the controller too
        cfg = shmkv.CacheConfig(num_layers=a.layers, num_kv_heads=a.heads, head_dim=a.head_dim,
                                num_blocks=a.num_blocks, block_size=a.block_size,
                                dtype="float32", max_seqs=a.max_seqs,
                                max_seq_len=a.max_seq_len, max_procs=64)
        self.cfg = cfg
        self.name = f"shmkv-chaos-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.tmp = tempfile.mkdtemp(prefix="shmkv-chaos-", dir=shm_dir)
        self.cache = None
        try:
            self.cache = shmkv.KVCache.create(self.name, cfg)
            self.cache.lock_timeout = a.lock_timeout
            self.codec = Codec(cfg)
            self.prompts = Prompts(self.prompt_seed, cfg.block_size)
            self.J = Journal(os.path.join(self.tmp, "journal"), a.workers, cfg.max_seqs,
                             create=True)
            self.fail_path = os.path.join(self.tmp, "failures.jsonl")
            open(self.fail_path, "w").close()
            import multiprocessing as mp
            self.ctx = mp.get_context(a.start_method)
            _prepare_children(a.start_method)
            if a.start_method == "forkserver":
                self.ctx.set_forkserver_preload(["numpy", "shmkv", "chaos"])
            import threading
            threading.Thread(target=self._watchdog, daemon=True).start()
            return self._run()
        finally:
            self.done = True
            self._stop_all()
            try:
                if self.cache is not None:
                    self.cache.unlink()
                    self.cache.close()
            finally:
                _unlink_segment(self.name)
                if getattr(self, "J", None) is not None:
                    self.J.close()
                shutil.rmtree(self.tmp, ignore_errors=True)

    def _watchdog(self):
        """The controller itself stuck (a call that never returns: a wait that ignores
        its bound) is a failure too: report, clean up and exit from this thread."""
        limit = self.args.hang_limit
        while not self.done:
            time.sleep(0.5)
            stuck = time.monotonic() - self.heartbeat
            if stuck > limit and not self.done:
                self.cfail("blocked", f"the controller has been stuck for {stuck:.1f} s in "
                                      f"{self.doing} (a wait that ignores lock_timeout)")
                code = 1
                try:
                    for w in list(self.workers.values()):
                        try:
                            os.kill(w["proc"].pid, signal.SIGKILL)
                        except (ProcessLookupError, OSError):
                            pass
                    self.elapsed = time.monotonic() - self.t_start
                    code = self._summary()
                finally:
                    _unlink_segment(self.name)
                    shutil.rmtree(self.tmp, ignore_errors=True)
                    sys.stdout.flush()
                    os._exit(code)

    def _stop_all(self):
        for w in list(self.workers.values()):
            p = w["proc"]
            if p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.join(10)
        self.workers.clear()

    def _start(self, lane):
        a = self.args
        self.inc += 1
        crash, countdown = None, 0
        if a.arm > 0 and self.rng.random() < a.arm:
            need = min(self.cp_deaths.values())
            cands = [p for p in self.points if self.cp_deaths[p] == need]
            crash = self.rng.choice(cands)
            hi = {"recover_mid": 3, "create_mid": 4, "fork_mid": 3, "free_mid": 3,
                  "cow_after_copy": 2, "cow_commit_mid": 2, "publish_mid": 3,
                  "trim_mid": 2}.get(crash, 8)
            countdown = self.rng.randint(1, hi)
            self.cp_armed[crash] += 1
        args = {"name": self.name, "journal": self.J.path, "failures": self.fail_path,
                    "lanes": a.workers, "max_seqs": self.cfg.max_seqs, "lane": lane, "inc": self.inc,
                    "seed": self.rng.getrandbits(64), "crash": crash, "countdown": countdown,
                    "plant": a.plant, "bound": a.bound, "lock_timeout": a.lock_timeout,
                    "t_start_ns": time.time_ns(), "prompt_seed": self.prompt_seed}
        self.J.lanes[lane, LF["ready"]] = 0
        import chaos
        p = self.ctx.Process(target=chaos.worker_entry, args=(args,), daemon=True)
        if a.start_method == "spawn":
            # a fresh interpreter imports shmkv: arm it the documented way, through the
            # environment (SHMKV_CRASH_POINT=name:N, SHMKV_PLANT=name)
            args["arm_via_env"] = True
            env = {"SHMKV_CRASH_POINT": f"{crash}:{countdown}" if crash else None,
                   "SHMKV_PLANT": a.plant}
            saved = {k: os.environ.get(k) for k in env}
            try:
                for k, v in env.items():
                    if v:
                        os.environ[k] = v
                    else:
                        os.environ.pop(k, None)
                p.start()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        else:
            # forkserver children inherit an already imported shmkv: arm it by call
            p.start()
        self.workers[lane] = {"proc": p, "inc": self.inc, "crash": crash, "started": time.monotonic(),
                                  "killed": False,
                                  "life": self.rng.expovariate(1.0 / a.mean_life)}
        self.restarts += 1

    def _reap(self, lane, restart=True):
        w = self.workers.pop(lane)
        p = w["proc"]
        p.join(5)
        code = p.exitcode
        if code == 86 and w["crash"]:
            self.cp_deaths[w["crash"]] += 1
            cur = int(self.J.lanes[lane, LF["cur_op"]])
            if self.J.lanes[lane, LF["inc"]] != w["inc"] or cur <= 0:
                what = "attach"                  # before the worker's first call
            else:
                what = OPS[cur % POOL_OP - 1] + (" (pool)" if cur >= POOL_OP else "")
            d = self.cp_ops[w["crash"]]
            d[what] = d.get(what, 0) + 1
        elif code == -signal.SIGKILL and w["killed"]:
            if w["crash"]:
                self.armed_survived += 1
        else:
            self.exit_other[str(code)] = self.exit_other.get(str(code), 0) + 1
            self.cfail("worker_crash", f"worker lane {lane} inc {w['inc']} (crash point "
                                       f"{w['crash']}) ended with exit status {code}")
        if restart:
            self._start(lane)

    def _kill(self, lane, quiesce=False):
        w = self.workers[lane]
        if w["proc"].exitcode is not None:
            return False
        try:
            os.kill(w["proc"].pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        w["killed"] = True
        if quiesce:
            self.kills_quiesce += 1
        else:
            self.kills += 1
        return True

    # -- the loop ------------------------------------------------------------------------
    def _run(self):
        a = self.args
        from multiprocessing.connection import wait as mp_wait
        t_start = time.monotonic()
        self.t_start = t_start
        t_end = t_start + a.duration
        hard_end = t_start + max(a.duration, a.max_duration)
        extended = False
        for lane in range(a.workers):
            self._start(lane)
        next_kill = t_start + 0.5
        next_check = t_start + a.check_interval
        next_progress = t_start + a.progress
        # --phase 0: no audits but the final one (not one per loop turn once the run
        # goes on past --duration to meet the counts)
        phase_end = t_start + a.phase if a.phase > 0 else float("inf")
        last_ops = {}
        while True:
            now = time.monotonic()
            self.beat("main loop")
            if now >= t_end:
                if self.counts_met() or now >= hard_end or self.total_failures():
                    break
                if not extended:
                    extended = True
                    print(f"[{now - t_start:6.1f}s] counts not met yet: going on (at most "
                          f"until {hard_end - t_start:.0f} s)", flush=True)
            if self.args.fail_fast and self.total_failures():
                break
            timeout = max(0.0, min(next_kill, next_check, next_progress, phase_end,
                                   max(t_end, now + 0.001)) - now)
            sentinels = {w["proc"].sentinel: lane for lane, w in self.workers.items()}
            for s in mp_wait(list(sentinels), timeout):
                self._reap(sentinels[s])
            now = time.monotonic()
            if now >= next_kill:
                self._random_kill(now)
                next_kill = now + self.rng.expovariate(1.0 / a.kill_interval)
            if now >= next_check:
                self._check()
                self._hangs(now, last_ops)
                if a.sabotage:
                    self._sabotage()
                next_check = now + a.check_interval
            if now >= next_progress:
                self._progress(now)
                next_progress = now + a.progress
            # --phase 0: no audits until the final one (also while extended past t_end)
            if a.phase > 0 and now >= phase_end \
                    and max(t_end, hard_end if extended else t_end) - now > a.phase / 3:
                self._audit(final=False)
                for lane in range(a.workers):
                    self._start(lane)
                phase_end = time.monotonic() + a.phase
        self._audit(final=True)
        self.elapsed = time.monotonic() - t_start
        return self._summary()

    def _sabotage(self):
        """Harness self-test: damage a detached sequence, or a cached block that is still
        findable, behind the workers' backs, the way a core bug would; the run must
        catch it."""
        if self.args.sabotage == "corrupt_cached":
            snap = _core.snapshot(self.name, tables=False)
            cached = np.flatnonzero((np.asarray(snap["block_flags"]) & 1)
                                    & (np.asarray(snap["ref_cnt"]) == 0))
            if cached.size:
                b = int(cached[self.rng.randrange(cached.size)])
                t = self.rng.randrange(self.cfg.block_size)
                self.cache.value_cache(self.cfg.num_layers - 1)[b, t] += 1
                self.sabotaged += 1
            return
        idx = np.flatnonzero(self.J.hints.copy())
        if idx.size == 0:
            return
        slot = int(idx[self.rng.randrange(idx.size)])
        e = self.J.read(slot)
        if e is None or e.state != DETACHED or e.conf < 2:
            return
        try:
            if self.args.sabotage == "free_detached":
                self.cache.free(e.sid)
            else:                                 # corrupt_data: one confirmed token
                tab = self.cache.block_table(e.sid)
                t = self.rng.randrange(e.conf)
                bs = self.cfg.block_size
                self.cache.value_cache(self.cfg.num_layers - 1)[tab[t // bs], t % bs] += 1
            self.sabotaged += 1
        except shmkv.ShmkvError:
            pass

    def _hangs(self, now, last_ops):
        """A ready worker whose call counters have not moved for --hang-limit seconds is
        stuck inside a call (a wait that ignores lock_timeout): a failure; kill it."""
        for lane, w in self.workers.items():
            if w["killed"] or self.J.lanes[lane, LF["ready"]] != w["inc"]:
                continue
            ops = int(self.J.lanes[lane, CNT_BASE:CNT_BASE + len(OPS)].sum())
            prev = last_ops.get(lane)
            if prev is None or prev[0] != w["inc"] or prev[1] != ops:
                last_ops[lane] = (w["inc"], ops, now)
                continue
            if now - prev[2] > self.args.hang_limit:
                self.hung_workers += 1
                self.cfail("blocked", f"worker lane {lane} inc {w['inc']} made no call for "
                                      f"{now - prev[2]:.1f} s: stuck inside a call")
                self._kill(lane)

    def _random_kill(self, now):
        cands = []
        for lane, w in self.workers.items():
            if w["killed"] or w["proc"].exitcode is not None:
                continue
            if self.J.lanes[lane, LF["ready"]] != w["inc"]:
                continue                      # still starting: attach is tested by crash points
            ready_s = self.J.lanes[lane, LF["ready_mono_ns"]] / 1e9
            if now - ready_s < w["life"]:
                continue                      # its random life span is not over
            if w["crash"] and now - ready_s < self.args.armed_grace:
                continue                      # give the crash point its chance
            cands.append(lane)
        if not cands:
            return
        if self.rng.random() < self.args.aim:
            # aim: a worker inside a pool append right now (its death is what a detached
            # sequence must survive, with every confirmed token and no torn publish);
            # watch the journal's busy marks for up to 20 ms
            deadline = time.monotonic() + 0.02
            cset = set(cands)
            while time.monotonic() < deadline:
                aimed = [int(x) - 1 for x in self.J.busy.copy() if x and int(x) - 1 in cset]
                if aimed:
                    self.aimed_kills += 1
                    self._kill(self.rng.choice(aimed))
                    return
                time.sleep(0.0002)
        self._kill(self.rng.choice(cands))

    def counts_met(self):
        return (self.kills >= self.args.min_kills
                and min(self.cp_deaths.values()) >= self.args.min_per_point)

    def total_failures(self):
        lanes = _lane_sum(self.J, FAIL_BASE, len(FAIL_KINDS))
        return int(lanes.sum()) + sum(self.fails.values())

    def _check(self):
        self.checks += 1
        try:
            problems = self.ccall(self.cache.check)
        except shmkv.ShmkvError as e:
            self.cfail("invariant", f"check() raised {type(e).__name__}: {e}")
            return
        if problems:
            self.cfail("invariant", f"check() during the run: {problems[:8]}")
        st = self.ccall(self.cache.stats)
        if st["free_blocks"] + st["used_blocks"] != st["num_blocks"]:
            self.cfail("invariant", f"stats: free {st['free_blocks']} + used "
                                    f"{st['used_blocks']} != {st['num_blocks']}")

    def _progress(self, now):
        ops = int(_lane_sum(self.J, CNT_BASE, len(OPS)).sum())
        cp = sum(self.cp_deaths.values())
        st = self.cache.stats()
        print(f"[{now - self.t_start:6.1f}s] kills {self.kills} (+{self.kills_quiesce} in audits) "
              f"crash-point deaths {cp} (min/point {min(self.cp_deaths.values())}) "
              f"restarts {self.restarts} ops {ops} seqs {st['num_sequences']} "
              f"used {st['used_blocks']}/{st['num_blocks']} recoveries {st['recoveries']} "
              f"failures {self.total_failures()}", flush=True)

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
        self._index_audit()
        problems = self.ccall(c.check)
        if problems:
            self.cfail("invariant", f"check() after the audit's prefix lookups: {problems[:8]}")

    def _block_audit(self):
        """Independent of check(): recount every block's references from the read-only
        snapshot.  Also: with every worker dead and recovery run, no sequence lock may
        still be held (returns those sequences: gathering them would wait)."""
        snap = _core.snapshot(self.name)
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
        snap = _core.snapshot(self.name, tables=False)
        hashed = np.flatnonzero(np.asarray(snap["block_flags"]) & 1)
        if self.views is None:
            self.views = [(c.key_cache(l), c.value_cache(l)) for l in range(cfg.num_layers)]
        off = _core.layout_of(cfg)["off_tokens"]
        fd = os.open(f"/dev/shm/{self.name}", os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, off + cfg.num_blocks * bs * 4, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            toks = np.frombuffer(mm, np.int32, cfg.num_blocks * bs, off).reshape(-1, bs).copy()
        finally:
            mm.close()
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

    def _summary(self):
        a, J = self.args, self.J
        snap = _core.snapshot(self.name, tables=False)     # lock-free: safe even if wedged
        st = dict(snap["counters"], max_recovery_s=snap["max_recovery_s"])
        lane_fail = _lane_sum(J, FAIL_BASE, len(FAIL_KINDS))
        fails = {k: int(lane_fail[i]) + self.fails[k] for i, k in enumerate(FAIL_KINDS)}
        counts = _lane_sum(J, CNT_BASE, len(OPS))
        maxns = J.lanes[:, MAX_BASE:MAX_BASE + len(OPS)].max(axis=0)
        lf = {f: int(J.lanes[:, LF[f]].sum()) for f in LANE_FIELDS}
        lost_tokens = lf["lost_token_count"] + self.lost_tokens_ctl
        max_blocked = int(maxns.max())
        worst_op = OPS[int(maxns.argmax())]
        res = {
            "workers": a.workers, "duration_s": round(self.elapsed, 1), "plant": a.plant,
            "sigkills": self.kills, "aimed_kills": self.aimed_kills,
            "sigkills_in_audits": self.kills_quiesce,
            "sigkills_total": self.kills + self.kills_quiesce,
            "crash_point_deaths": dict(self.cp_deaths), "crash_points_armed": dict(self.cp_armed),
            "crash_point_calls": {p: dict(sorted(d.items(), key=lambda x: -x[1]))
                                  for p, d in self.cp_ops.items()},
            "armed_then_sigkilled": self.armed_survived, "restarts": self.restarts,
            "audits": self.audits, "checks": self.checks,
            "recoveries": st["recoveries"], "lock_owner_dead": st["lock_owner_dead"],
            "reclaimed_sequences": st["reclaimed_sequences"],
            "reclaimed_blocks": st["reclaimed_blocks"],
            "dead_owner_sequences_seen_reclaimed": lf["reclaimed_seen"] + self.reclaimed_ctl,
            "max_recovery_s": st["max_recovery_s"],
            "ops": {OPS[i]: int(counts[i]) for i in range(len(OPS))},
            "max_call_s": {OPS[i]: round(int(maxns[i]) / 1e9, 4) for i in range(len(OPS))},
            "max_blocked_s": round(max_blocked / 1e9, 4), "max_blocked_op": worst_op,
            "bound_s": a.bound, "controller_max_call_s": round(self.max_ctl_call_ns / 1e9, 4),
            "tokens_verified": lf["tokens_verified"] + self.tokens_verified_ctl,
            "sequences_verified": lf["seqs_verified"] + self.seqs_verified_ctl,
            "pool_appends": lf["pool_appends"], "cow_appends": lf["cow_appends"],
            "inflight_appends_resolved": lf["resolved_inflight"],
            "paged_reads_discarded": lf["reads_discarded"], "cache_full": lf["cache_full"],
            "worker_startup_mean_s": round(int(J.lanes[:, LF["startup_ns_sum"]].sum()) / 1e9 / max(1, int(J.lanes[:, LF["startups"]].sum())), 4),
            "worker_startup_max_s": round(int(J.lanes[:, LF["startup_ns_max"]].max()) / 1e9, 4),
            "max_journal_claim_wait_s": round(int(J.lanes[:, LF["max_claim_wait_ns"]].max()) / 1e9, 4),
            "lost_tokens": lost_tokens, "leaked_blocks_max": self.max_leaked,
            "failures": fails, "failure_total": sum(fails.values()),
            "exits_other": self.exit_other, "hung_workers": self.hung_workers,
            "sabotage": a.sabotage, "sabotaged": self.sabotaged,
            "prefix": {
                "prompt_creates": lf["prompt_creates"],
                "hit_blocks_verified_by_workers": lf["prefix_hit_blocks"],
                "hit_tokens_verified_by_workers": lf["prefix_hit_tokens_verified"],
                "audit_probes": self.audit_probes,
                "audit_hit_blocks_verified": self.audit_hit_blocks,
                "hashed_blocks_verified_in_audits": self.index_blocks_verified,
                "token_ids_verified": lf["ids_verified"],
                "tokened_appends": lf["tok_appends"], "commits": lf["commits"],
                "committed_blocks": lf["committed_blocks"],
                "trims": lf["trims"], "trimmed_tokens": lf["trimmed_tokens"],
                "inflight_trims_resolved": lf["resolved_trims"] + self.resolved_trims_ctl,
                "evict_calls": lf["evict_calls"], "evicted": lf["evicted"],
                "evicted_dead_owners": lf["evicted_dead"], "match_prefix_calls": lf["matches"],
                "live_hit_blocks": (st.get("prefix_hits", 0) // self.cfg.block_size
                                    - st.get("cached_blocks_reused", 0)),
                "segment": {k: st.get(k, 0) for k in (
                    "prefix_queries", "prefix_hits", "cached_blocks_reused",
                    "cached_blocks_evicted", "trimmed_blocks", "evictions_lru",
                    "evictions_lfu", "evictions_longest", "evictions_priority")},
            },
        }
        lines = self._read_failures() + self.fail_lines
        per_kind = {}
        for line in lines:
            per_kind.setdefault(line.get("kind"), []).append(line)
        res["failure_samples"] = [x for k in FAIL_KINDS for x in per_kind.get(k, [])[:5]]
        ok_counts = self.counts_met()
        res["counts_met"] = ok_counts
        caught = sorted(k for k, v in fails.items() if v)
        res["caught"] = caught
        if a.expect_failure:
            res["ok"] = bool(caught)
        else:
            res["ok"] = not caught and ok_counts
        self._print(res)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
        return 0 if res["ok"] else 1

    def _print(self, r):
        print()
        print("=" * 78)
        print(f"shmkv chaos: {r['workers']} workers, {r['duration_s']} s"
              + (f", planted bug: {r['plant']}" if r["plant"] else ""))
        print("-" * 78)
        rows = [
            ("SIGKILLs (random, running workers)", r["sigkills"]),
            ("  of which aimed at a pool append", r["aimed_kills"]),
            ("SIGKILLs (kill-all audits)", r["sigkills_in_audits"]),
            ("SIGKILLs total", r["sigkills_total"]),
            ("crash-point deaths total", sum(r["crash_point_deaths"].values())),
            ("worker restarts", r["restarts"]),
            ("worker start to ready, mean / max (s)", f"{r['worker_startup_mean_s']} / {r['worker_startup_max_s']}"),
            ("audits (kill all, recover, verify)", r["audits"]),
            ("check() calls by the controller", r["checks"]),
            ("recoveries (segment counter)", r["recoveries"]),
            ("pool lock EOWNERDEAD", r["lock_owner_dead"]),
            ("reclaimed sequences / blocks", f"{r['reclaimed_sequences']} / {r['reclaimed_blocks']}"),
            ("dead workers' sequences seen reclaimed", r["dead_owner_sequences_seen_reclaimed"]),
            ("longest recovery (max_recovery_s)", f"{r['max_recovery_s']:.6f}"),
            ("sequences / tokens verified", f"{r['sequences_verified']} / {r['tokens_verified']}"),
            ("in-flight appends resolved after a death", r["inflight_appends_resolved"]),
            ("prompts created with tokens= (create_sequence)", r["prefix"]["prompt_creates"]),
            ("prefix-hit blocks verified (workers / audits)",
             (f"{r['prefix']['hit_blocks_verified_by_workers']} / "
              f"{r['prefix']['audit_hit_blocks_verified']} ({r['prefix']['audit_probes']} probes)")),
            ("prefix-hit blocks live / cached; cached evicted",
             (f"{r['prefix']['live_hit_blocks']} / "
              f"{r['prefix']['segment']['cached_blocks_reused']}; "
              f"{r['prefix']['segment']['cached_blocks_evicted']}")),
            ("hashed blocks verified raw in audits", r["prefix"]["hashed_blocks_verified_in_audits"]),
            ("token ids verified", r["prefix"]["token_ids_verified"]),
            ("trims / in-flight trims resolved",
             f"{r['prefix']['trims']} / {r['prefix']['inflight_trims_resolved']}"),
            ("evict() calls / sequences evicted (of dead owners)",
             (f"{r['prefix']['evict_calls']} / {r['prefix']['evicted']} "
              f"({r['prefix']['evicted_dead_owners']})")),
            ("max blocked call (s)", f"{r['max_blocked_s']} ({r['max_blocked_op']}; bound {r['bound_s']})"),
            ("hung workers (no call returned)", r["hung_workers"]),
            ("invariant failures", r["failures"]["invariant"]),
            ("leaked blocks (max seen)", r["leaked_blocks_max"]),
            ("lost published tokens", r["lost_tokens"]),
            ("failures total", r["failure_total"]),
        ]
        w = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"  {k:<{w}}  {v}")
        print("  crash point deaths (armed):")
        for p, n in r["crash_point_deaths"].items():
            calls = ", ".join(f"{k} {v}" for k, v in list(r["crash_point_calls"][p].items())[:4])
            print(f"    {p:<24} {n:5d}  ({r['crash_points_armed'][p]})  in: {calls}")
        print("  calls (max seconds):")
        print("    " + ", ".join(f"{k} {r['ops'][k]} ({r['max_call_s'][k]})"
                                 for k in OPS if r["ops"][k]))
        bad = {k: v for k, v in r["failures"].items() if v}
        if bad:
            print("  FAILURES: " + ", ".join(f"{k}={v}" for k, v in bad.items()))
            for line in r["failure_samples"][:12]:
                print(f"    [{line.get('kind')}] lane {line.get('lane')}: "
                      f"{str(line.get('msg'))[:400]}")
        if not r["counts_met"]:
            print(f"  counts NOT met: need >= {self.args.min_kills} random SIGKILLs and >= "
                  f"{self.args.min_per_point} deaths at every crash point")
        if self.args.expect_failure:
            verdict = (f"planted bug {r['plant']!r} CAUGHT: {', '.join(r['caught'])}"
                       if r["ok"] else f"planted bug {r['plant']!r} NOT caught")
        else:
            verdict = "PASS" if r["ok"] else "FAIL"
        print("-" * 78)
        print(f"result: {verdict}")
        print("=" * 78, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--duration", type=float, default=120.0, help="seconds (at least)")
    p.add_argument("--max-duration", type=float, default=270.0,
                   help="after --duration, go on until --min-kills and --min-per-point are "
                        "met, but not past this many seconds")
    p.add_argument("--kill-interval", type=float, default=0.005,
                   help="mean seconds between SIGKILL attempts: each picks a random running "
                        "worker whose life span is over (workers still starting are left to "
                        "the crash points)")
    p.add_argument("--mean-life", type=float, default=0.25,
                   help="mean of the random (exponential) life span of a worker after it is "
                        "ready, before it may be SIGKILLed")
    p.add_argument("--aim", type=float, default=0.3,
                   help="fraction of SIGKILLs aimed at a worker that is inside a pool append")
    p.add_argument("--arm", type=float, default=0.3,
                   help="fraction of restarted workers armed with a crash point")
    p.add_argument("--armed-grace", type=float, default=1.5,
                   help="seconds an armed worker is spared from SIGKILL")
    p.add_argument("--phase", type=float, default=20.0,
                   help="seconds between kill-all audits (0: only at the end)")
    p.add_argument("--check-interval", type=float, default=0.5)
    p.add_argument("--progress", type=float, default=5.0)
    p.add_argument("--bound", type=float, default=1.0,
                   help="seconds a call may block; longer is a failure")
    p.add_argument("--lock-timeout", type=float, default=5.0)
    p.add_argument("--hang-limit", type=float, default=15.0,
                   help="seconds without progress after which a worker (or the controller) "
                        "counts as hung")
    p.add_argument("--min-kills", type=int, default=1000,
                   help="random SIGKILLs of running workers the run must reach (the kill-all "
                        "audits' SIGKILLs are counted apart)")
    p.add_argument("--min-per-point", type=int, default=20,
                   help="deaths the run must see at every crash point")
    p.add_argument("--plant", choices=_core.PLANTED_BUGS, default=None)
    p.add_argument("--sabotage", choices=("free_detached", "corrupt_data", "corrupt_cached"),
                   default=None,
                   help="harness self-test: the controller frees a detached sequence / "
                        "changes one confirmed token / changes one token of a cached, "
                        "findable block behind the workers' backs every check interval; "
                        "the run must FAIL")
    p.add_argument("--expect-failure", action="store_true",
                   help="exit 0 only if a failure was caught (for --plant)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failure")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--verbose", action="store_true")
    g = p.add_argument_group("segment")
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=1024)
    g.add_argument("--max-seqs", type=int, default=256)
    g.add_argument("--max-seq-len", type=int, default=256)
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = random.SystemRandom().getrandbits(32)
    return args


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None):
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)    # a stuck run: kill -USR1
    signal.signal(signal.SIGTERM, _terminate)                  # clean up on timeout(1)
    signal.signal(signal.SIGHUP, _terminate)
    args = parse_args(argv)
    print(f"shmkv chaos: seed {args.seed}, {args.workers} workers, {args.duration} s, "
          f"kill interval {args.kill_interval} s, plant {args.plant}", flush=True)
    return Controller(args).run()


if __name__ == "__main__":
    sys.exit(main())
