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
       "stats")
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
)
FAIL_INDEX = {k: i for i, k in enumerate(FAIL_KINDS)}

LANE_FIELDS = ("inc", "pid", "ready", "lost_token_count", "tokens_verified",
               "seqs_verified", "reads_discarded", "reclaimed_seen", "cache_full",
               "pool_appends", "resolved_inflight", "cow_appends", "not_found",
               "claim_busy", "max_claim_wait_ns", "startup_ns_sum", "startup_ns_max",
               "startups", "ready_mono_ns")
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
I_NONE, I_APPEND, I_FREE, I_DETACH, I_ADOPT = 0, 1, 2, 3, 4
INTENT_NAMES = {I_NONE: "-", I_APPEND: "append", I_FREE: "free", I_DETACH: "detach",
                I_ADOPT: "adopt"}
F_RESERVE_OK = 1        # only this sequence's creator touches it: reserve+write allowed

MAXSEG = 32
PAYLOAD = struct.Struct(f"<qIIqIIIIII{MAXSEG}I{MAXSEG}Q")
COPY_BYTES = 512
assert 16 + PAYLOAD.size <= COPY_BYTES
ENTRY_BYTES = 2 * COPY_BYTES
JHDR_BYTES = 4096
LOCK_BASE = 1 << 30     # OFD lock of slot s: byte LOCK_BASE + s of the journal file
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
    """One journal record: what the harness knows about the sequence in a slot."""
    __slots__ = (
        "conf",
        "flags",
        "holder",
        "i_len",
        "i_n",
        "intent",
        "segs",
        "sid",
        "state",
        "ver",
    )

    def __init__(self, sid=0, state=EMPTY, intent=I_NONE, holder=0, flags=0, conf=0,
                 i_len=0, i_n=0, segs=(), ver=0):
        self.sid, self.state, self.intent, self.holder = sid, state, intent, holder
        self.flags, self.conf, self.i_len, self.i_n = flags, conf, i_len, i_n
        self.segs = list(segs)
        self.ver = ver

    def pack(self):
        n = len(self.segs)
        if n > MAXSEG:
            raise ValueError("too many lineage segments")
        starts = [s for s, _ in self.segs] + [0] * (MAXSEG - n)
        seeds = [d for _, d in self.segs] + [0] * (MAXSEG - n)
        return PAYLOAD.pack(self.sid, self.state, self.intent, self.holder, self.flags,
                            self.conf, self.i_len, self.i_n, n, 0, *starts, *seeds)

    @classmethod
    def unpack(cls, raw, ver):
        v = PAYLOAD.unpack(raw)
        n = min(v[8], MAXSEG)
        starts = v[10:10 + MAXSEG]
        seeds = v[10 + MAXSEG:10 + 2 * MAXSEG]
        return cls(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7],
                   list(zip(starts[:n], seeds[:n])), ver)

    def __repr__(self):
        return (f"Entry(sid={self.sid}, {STATE_NAMES.get(self.state, self.state)}, "
                f"intent={INTENT_NAMES.get(self.intent, self.intent)}({self.i_len},"
                f"{self.i_n}), holder={self.holder >> 32}.{self.holder & 0xffffffff}, "
                f"conf={self.conf}, segs={self.segs})")


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

    def _per_pos(self, segs, a, b):
        starts = np.array([s for s, _ in segs], np.int64)
        seeds = np.array([d for _, d in segs], np.int64)
        pos = np.arange(a, b, dtype=np.int64)
        idx = np.searchsorted(starts, pos, side="right") - 1
        return pos, seeds[idx], starts[idx]

    def make(self, segs, a, b):
        """K, V [layers, b-a, heads, dim] of positions [a, b) of a lineage."""
        pos, seed, start = self._per_pos(segs, a, b)
        n = b - a
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

    def mismatch(self, k, v, segs, a):
        """bool [n]: token a+i of k/v differs from the lineage."""
        n = k.shape[1]
        ek, ev = self.make(segs, a, a + n)
        return ((k != ek).reshape(self.L, n, -1).any(axis=(0, 2))
                | (v != ev).reshape(self.L, n, -1).any(axis=(0, 2)))

    def first_mismatch(self, k, v, segs, a):
        """Index (relative to a) of the first token of k/v that differs from the lineage,
        the number of differing tokens; (None, 0) if equal."""
        n = k.shape[1]
        if n == 0:
            return None, 0
        idx = np.flatnonzero(self.mismatch(k, v, segs, a))
        if idx.size == 0:
            return None, 0
        return int(idx[0]), int(idx.size)

    def derive(self, k, v):
        """The lineage spelled out by the data of tokens [0, n); DataError if the data is
        not a well-formed lineage (garbage, a torn token, a token at the wrong place)."""
        n = k.shape[1]
        if n == 0:
            return []
        f = k[0, :, 0, :4].astype(np.int64)
        seed = f[:, 0] | (f[:, 1] << 24)
        start, pos = f[:, 2], f[:, 3]
        wrong = np.flatnonzero(pos != np.arange(n))
        if wrong.size:
            i = int(wrong[0])
            raise DataError(i, f"token {i} says it is position {int(pos[i])}")
        change = np.flatnonzero(seed[1:] != seed[:-1]) + 1
        run_starts = np.concatenate(([0], change))
        run_id = np.cumsum(np.isin(np.arange(n), change))
        wrong = np.flatnonzero(start != run_starts[run_id])
        if wrong.size:
            i = int(wrong[0])
            raise DataError(i, f"token {i} (seed {int(seed[i]):#x}) says its segment starts "
                               f"at {int(start[i])}, its run starts at {int(run_starts[run_id[i]])}")
        seeds = seed[run_starts]
        if len(set(seeds.tolist())) != len(seeds):
            raise DataError(int(run_starts[-1]), "a lineage seed appears in two runs")
        segs = list(zip(run_starts.tolist(), seeds.tolist()))
        i, cnt = self.first_mismatch(k, v, segs, 0)
        if i is not None:
            raise DataError(i, f"token {i}: data differs from its own descriptor "
                               f"({cnt} such tokens)")
        return segs


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
        self.NS = cfg.max_seqs
        self.max_len = cfg.max_blocks_per_seq * cfg.block_size
        self.codec = Codec(cfg)
        self.views = None
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
        e = self.rng.choice(own)
        r = self.rng.random()
        if r < 0.20:
            self.op_append_own(e)
        elif r < 0.27:
            if e.flags & F_RESERVE_OK:
                self.op_reserve_write(e)
            else:
                self.op_append_own(e)
        elif r < 0.35:
            self.op_fork_own(e)
        elif r < 0.42:
            self.op_verify_own(e)
        elif r < 0.47:
            self.op_free_own(e)
        elif r < 0.54:
            self.op_detach(e)
        elif r < 0.74:
            self.op_pool_claim()
        elif r < 0.82:
            self.op_pool_fork()
        elif r < 0.95:
            self.op_pool_read()
        elif r < 0.98:
            self.call("recover", self.cache.recover)
        else:
            problems = self.call("check", self.cache.check)
            if problems:
                self.fail("invariant", f"check() in a worker: {problems[:10]}")

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
            e.state, e.intent, e.flags, e.holder = DETACHED, I_NONE, 0, self.me
            self.verify_claimed(slot, e)
            return
        e.state = ORPHAN               # owner dead: the next recovery must reclaim it
        self.J.write(slot, e)

    # -- own sequences -------------------------------------------------------------------
    def op_create(self):
        try:
            sid = self.call("create", self.cache.create_sequence,
                            priority=self.rng.randrange(4))
        except shmkv.CacheFullError:
            return self.on_full("create")
        slot = sid % self.NS
        if not self.claim_new(slot, sid):
            self.call("free", self.cache.free, sid)
            return
        e = Entry(sid, OWNED, holder=self.me, flags=F_RESERVE_OK, segs=[(0, self.new_seed())])
        self.J.write(slot, e)
        self.own[slot] = e
        if self.rng.random() < 0.8:
            self.op_append_own(e)

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
        """CacheFullError: make room by freeing one of ours (or a pool sequence)."""
        self.bump("cache_full")
        if self.own:
            victim = self.rng.choice(list(self.own.values()))
            self.op_free_own(victim)
        else:
            self.op_pool_claim(prefer_free=True)

    def mine(self, e):
        """e is still one of our live sequences (a nested op may have freed it)."""
        return e.state == OWNED and self.own.get(e.sid % self.NS) is e

    def op_append_own(self, e):
        if not self.mine(e):
            return
        n = self.pick_n(e)
        if n <= 0:
            return self.op_free_own(e) if self.rng.random() < 0.5 else self.op_detach(e)
        k, v = self.codec.make(e.segs, e.conf, e.conf + n)
        if e.conf % self.cfg.block_size:
            self.bump("cow_appends")
        try:
            self.call("append", self.cache.append, e.sid, k, v)
        except shmkv.CacheFullError:
            return self.on_full("append")
        except shmkv.SequenceNotFound as ex:
            return self.own_vanished(e, ex)
        e.conf += n
        self.J.write(e.sid % self.NS, e)

    def op_reserve_write(self, e):
        if not self.mine(e):
            return
        n = self.pick_n(e)
        if n <= 0:
            return self.op_free_own(e)
        k, v = self.codec.make(e.segs, e.conf, e.conf + n)
        try:
            slots = self.call("reserve", self.cache.reserve, e.sid, n)
        except shmkv.CacheFullError:
            return self.on_full("reserve")
        except shmkv.SequenceNotFound as ex:
            return self.own_vanished(e, ex)
        bs = self.cfg.block_size
        want = (e.conf + np.arange(n)) % bs
        if slots.shape != (n,) or not np.array_equal(slots % bs, want):
            self.fail("exception", f"reserve({e.sid}, {n}) at {e.conf}: slots {slots}")
        order = np.arange(self.cfg.num_layers)
        if self.rng.random() < 0.5:
            order = order[::-1]
        for layer in order:
            self.call("write", self.cache.write, int(layer), slots, k[layer], v[layer])
        e.conf += n
        self.J.write(e.sid % self.NS, e)

    def own_vanished(self, e, ex):
        self.fail("lost_sequence", f"sequence {e.sid} vanished while its owner (us) is "
                                   f"alive: {ex}; {e}")
        slot = e.sid % self.NS
        self.own.pop(slot, None)
        e.state = FREED
        self.J.write(slot, e)
        self.J.unlock(slot)

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
        segs = [s for s in e.segs if s[0] < lc] + [(lc, self.new_seed())]
        self.adopt_child(child, lc, segs)
        if self.rng.random() < 0.7:        # append to both: the shared partial block
            self.op_append_own(e)

    def adopt_child(self, child, lc, segs):
        cslot = child % self.NS
        if not self.claim_new(cslot, child):
            self.call("free", self.cache.free, child)
            return None
        ce = Entry(child, OWNED, holder=self.me, flags=F_RESERVE_OK, conf=lc, segs=segs)
        self.J.write(cslot, ce)
        self.own[cslot] = ce
        if len(self.own) > self.MAX_OWN + 2:
            self.op_detach(ce)
        elif self.rng.random() < 0.7:
            self.op_append_own(ce)
        return ce

    def check_data(self, e, k, v, where, conf=None, inflight=None):
        """Compare gathered tokens [0, n) with the lineage of e.  conf: the confirmed
        length (every token below it must be there and right).  inflight: (L, n) of an
        append that may or may not have published."""
        n = k.shape[1]
        conf = e.conf if conf is None else conf
        if n < conf:
            self.fail("lost_tokens", f"{where}: sequence {e.sid} has {n} tokens, "
                                     f"{conf} were confirmed; {e}")
            self.bump("lost_token_count", conf - n)
        bad = self.codec.mismatch(k, v, e.segs, 0) if n else np.zeros(0, bool)
        idx = np.flatnonzero(bad)
        if idx.size:
            i, cnt = int(idx[0]), int(idx.size)
            lost = int(bad[:conf].sum())
            kind = "lost_tokens" if i < conf else "torn_publish"
            self.fail(kind, f"{where}: sequence {e.sid}: token {i} of {n} differs from "
                            f"what its writer appended ({cnt} tokens differ, confirmed "
                            f"{conf}, in flight {inflight}); {e}")
            if lost:
                self.bump("lost_token_count", lost)
        self.bump("tokens_verified", n)
        self.bump("seqs_verified")

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
        if e.conf and self.rng.random() < 0.3:      # a token range
            a = self.rng.randrange(e.conf)
            b = self.rng.randint(a, e.conf)
            kk, vv = self.call("gather", self.cache.gather, e.sid, a, b)
            ek, ev = self.codec.make(e.segs, a, b)
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
        e.intent = I_DETACH
        self.J.write(slot, e)
        try:
            self.call("detach", self.cache.detach, e.sid)
        except shmkv.SequenceNotFound as ex:
            return self.own_vanished(e, ex)
        e.state, e.intent, e.flags = DETACHED, I_NONE, 0
        self.J.write(slot, e)
        self.own.pop(slot, None)
        self.J.unlock(slot)

    # -- the pool of detached sequences ---------------------------------------------------
    def pick_pool(self):
        idx = np.flatnonzero(self.J.hints.copy())   # others change it meanwhile
        if idx.size == 0:
            return None
        return int(idx[self.rng.randrange(idx.size)])

    def verify_claimed(self, slot, e):
        """We hold the slot's lock and e is DETACHED (or just became so): resolve what a
        dead claimant left in flight, verify every token, write the resolved record.
        Returns False if the sequence is gone (legitimately)."""
        try:
            k, v = self.gather(e.sid)
        except shmkv.SequenceNotFound:
            if e.intent in (I_FREE, I_ADOPT):
                e.state, e.intent = FREED, I_NONE
                self.J.write(slot, e)
                return False
            self.fail("lost_sequence", f"detached sequence {e.sid} is gone: {e}")
            e.state, e.intent = FREED, I_NONE
            self.J.write(slot, e)
            return False
        n = k.shape[1]
        inflight = None
        if e.intent == I_APPEND:
            inflight = (e.i_len, e.i_n)
            self.bump("resolved_inflight")
            if n not in (e.i_len, e.i_len + e.i_n):
                self.fail("torn_publish" if n > e.conf else "lost_tokens",
                          f"sequence {e.sid}: an append of {e.i_n} tokens at {e.i_len} died "
                          f"in flight; the sequence has {n} tokens (all or none expected)")
        elif n != e.conf:
            self.fail("lost_tokens" if n < e.conf else "torn_publish",
                      f"detached sequence {e.sid} has {n} tokens, {e.conf} confirmed "
                      f"and nothing in flight; {e}")
        self.check_data(e, k, v, "pool claim", inflight=inflight)
        if e.intent == I_ADOPT:
            live, detached = self.live_owner(e.sid)
            if live and not detached:
                # adopted by a claimant that died: must be reclaimed by recovery
                e.state, e.intent = ORPHAN, I_NONE
                self.J.write(slot, e)
                return False
        e.conf = min(n, self.max_len)
        e.intent, e.state, e.flags = I_NONE, DETACHED, 0
        self.J.write(slot, e)
        return True

    def op_pool_claim(self, prefer_free=False):
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
            if prefer_free or (npool > self.POOL_TARGET and r < 0.8) or e.conf >= self.max_len - 8:
                e.intent = I_FREE
                self.J.write(slot, e)
                try:
                    self.call("free", self.cache.free, e.sid)
                except shmkv.SequenceNotFound:
                    self.fail("lost_sequence", f"detached sequence {e.sid} vanished "
                                               f"under our claim: {e}")
                e.state, e.intent = FREED, I_NONE
                self.J.write(slot, e)
            elif r < 0.70:
                for _ in range(self.rng.randint(1, 3)):
                    if not self.pool_append(slot, e):
                        break
            elif r < 0.80 and len(self.own) < self.MAX_OWN:
                e.intent = I_ADOPT
                self.J.write(slot, e)
                try:
                    self.call("adopt", self.cache.adopt, e.sid)
                except shmkv.SequenceNotFound:
                    self.fail("lost_sequence", f"detached sequence {e.sid} vanished "
                                               f"under our claim: {e}")
                    e.state, e.intent = FREED, I_NONE
                    self.J.write(slot, e)
                    return
                e.state, e.intent, e.holder, e.flags = OWNED, I_NONE, self.me, 0
                self.J.write(slot, e)
                self.own[slot] = e
                keep = True
            elif r < 0.90:
                self.op_pool_fork(slot, e)
            else:
                self.verify_claimed(slot, e)
        finally:
            if not keep:
                self.J.unlock(slot)

    def pool_append(self, slot, e):
        n = self.pick_n(e)
        if n <= 0:
            return False
        k, v = self.codec.make(e.segs, e.conf, e.conf + n)
        e.intent, e.i_len, e.i_n = I_APPEND, e.conf, n
        self.J.write(slot, e)
        self.J.busy[slot] = self.lane + 1         # readers and the controller aim here
        try:
            self.call("append", self.cache.append, e.sid, k, v)
        except shmkv.CacheFullError:
            e.intent = I_NONE
            self.J.write(slot, e)
            self.bump("cache_full")
            return False
        except shmkv.SequenceNotFound:
            self.fail("lost_sequence", f"detached sequence {e.sid} vanished under our "
                                       f"claim: {e}")
            e.state, e.intent = FREED, I_NONE
            self.J.write(slot, e)
            return False
        finally:
            self.J.busy[slot] = 0
        e.conf += n
        e.intent = I_NONE
        self.J.write(slot, e)
        self.bump("pool_appends")
        return True

    def op_pool_fork(self, slot=None, e=None):
        """Fork a pool sequence -- usually WITHOUT its claim, so the fork races with a
        claimant appending to it (fork takes no sequence lock).  The child's inherited
        prefix is taken from the data itself and checked against the parent's record."""
        if e is None:
            slot = self.pick_pool()
            if slot is None:
                return
            e = self.J.read(slot)
            if e is None or e.state != DETACHED:
                return
        if len(e.segs) >= MAXSEG - 1:
            return
        conf_before = e.conf
        try:
            child = self.call("fork", self.cache.fork, e.sid)
        except shmkv.SequenceNotFound:
            self.bump("not_found")
            return
        except shmkv.CacheFullError:
            return self.on_full("fork")
        lc = self.call("seq_len", self.cache.seq_len, child)
        k, v = self.call("gather", self.cache.gather, child)
        if k.shape[1] != lc:
            self.fail("torn_publish", f"fork child {child}: seq_len {lc}, gather {k.shape[1]}")
        if lc < conf_before:
            self.fail("lost_tokens", f"fork({e.sid}) -> {child} has {lc} tokens, the "
                                     f"parent had {conf_before} confirmed; {e}")
            self.bump("lost_token_count", conf_before - lc)
        try:
            segs = self.codec.derive(k, v)
        except DataError as ex:
            self.fail("garbage", f"fork({e.sid}) -> {child} at {lc}: {ex}; parent {e}")
            self.call("free", self.cache.free, child)
            return
        m = min(lc, conf_before)
        if m:
            i, cnt = self.codec.first_mismatch(k[:, :m], v[:, :m], e.segs, 0)
            if i is not None:
                self.fail("lost_tokens", f"fork({e.sid}) -> {child}: inherited token {i} "
                                         f"differs from the parent's record ({cnt}); {e}")
                self.bump("lost_token_count", cnt)
        self.bump("tokens_verified", lc)
        if len(segs) >= MAXSEG - 1:
            self.call("free", self.cache.free, child)
            return
        self.adopt_child(child, lc, segs + [(lc, self.new_seed())])

    def op_pool_read(self):
        """Read a pool sequence nobody here holds: gather (sequence lock) or a lock-free
        paged read through batch_block_tables + key_cache/value_cache views (the decode
        path); check its structure, and its prefix against the journal.  Half the time
        aim at a sequence some worker is appending to right now (paged read: a gather
        would wait for the append to finish)."""
        slot, busy = None, False
        if self.rng.random() < 0.5:
            idx = np.flatnonzero(self.J.busy.copy())
            if idx.size:
                slot, busy = int(idx[self.rng.randrange(idx.size)]), True
                sid = int(self.J.hints[slot])
                if sid:                      # read first (fast), then consult the record
                    got = self.paged_read(sid)
                    if got is None:
                        return
                    k, v = got
                    try:
                        self.codec.derive(k, v)
                    except DataError as ex:
                        self.fail("garbage", f"paged read of {sid} during an append "
                                             f"({k.shape[1]} tokens): {ex}")
                        return
                    e = self.J.read(slot)
                    if e is not None and e.sid == sid:
                        self.check_pool_prefix(e, k, v, "paged read during an append",
                                               record_first=False)
                    self.bump("tokens_verified", k.shape[1])
                    return
                slot = None
        if slot is None:
            slot = self.pick_pool()
        if slot is None:
            return
        e = self.J.read(slot)
        if e is None or e.state != DETACHED:
            return
        if not busy and self.rng.random() < 0.5:
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
        n = k.shape[1]
        try:
            self.codec.derive(k, v)
        except DataError as ex:
            self.fail("garbage", f"pool read of {e.sid} ({n} tokens): {ex}; {e}")
            return
        self.check_pool_prefix(e, k, v, "pool read")
        self.bump("tokens_verified", n)

    def check_pool_prefix(self, e, k, v, where, record_first=True):
        """A read of a pool sequence: every token the record confirms must be right, and
        (if the record was read BEFORE the data) there."""
        n = k.shape[1]
        if record_first and n < e.conf:
            self.fail("lost_tokens", f"{where} of {e.sid}: {n} tokens, {e.conf} confirmed; {e}")
            self.bump("lost_token_count", e.conf - n)
        m = min(n, e.conf)
        if m:
            i, cnt = self.codec.first_mismatch(k[:, :m], v[:, :m], e.segs, 0)
            if i is not None:
                self.fail("lost_tokens", f"{where} of {e.sid}: confirmed token {i} differs "
                                         f"({cnt}); {e}")
                self.bump("lost_token_count", cnt)

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
            tables2, _ = self.call("tables", c.batch_block_tables, [sid])
        except shmkv.SequenceNotFound:
            self.bump("reads_discarded")
            return None
        if tables2.shape[1] < nb or not np.array_equal(tables2[0, :nb], tab):
            self.bump("reads_discarded")       # freed or copied-on-write meanwhile
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
        for lane, w in list(self.workers.items()):
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
                  "cow_after_copy": 2, "cow_commit_mid": 2}.get(crash, 8)
            countdown = self.rng.randint(1, hi)
            self.cp_armed[crash] += 1
        args = {"name": self.name, "journal": self.J.path, "failures": self.fail_path,
                    "lanes": a.workers, "max_seqs": self.cfg.max_seqs, "lane": lane, "inc": self.inc,
                    "seed": self.rng.getrandbits(64), "crash": crash, "countdown": countdown,
                    "plant": a.plant, "bound": a.bound, "lock_timeout": a.lock_timeout,
                    "t_start_ns": time.time_ns()}
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
        phase_end = t_start + a.phase if a.phase > 0 else t_end + 1
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
            if now >= phase_end and max(t_end, hard_end if extended else t_end) - now > a.phase / 3:
                self._audit(final=False)
                for lane in range(a.workers):
                    self._start(lane)
                phase_end = time.monotonic() + a.phase
        self._audit(final=True)
        self.elapsed = time.monotonic() - t_start
        return self._summary()

    def _sabotage(self):
        """Harness self-test: damage a detached sequence behind the workers' backs, the
        way a core bug would; the run must catch it."""
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
        k, v = self.ccall(self.cache.gather, e.sid)
        n = k.shape[1]
        conf = e.conf
        if e.intent == I_APPEND:
            ok_lens = (e.i_len, e.i_len + e.i_n)
        else:
            ok_lens = (conf,)
        if n not in ok_lens:
            kind = "lost_tokens" if n < conf else "torn_publish"
            self.cfail(kind, f"detached sequence {e.sid} has {n} tokens, expected one of "
                             f"{ok_lens}: {e}")
            if n < conf:
                self.lost_tokens_ctl += conf - n
        bad = self.codec.mismatch(k, v, e.segs, 0) if n else np.zeros(0, bool)
        idx = np.flatnonzero(bad)
        if idx.size:
            i, cnt = int(idx[0]), int(idx.size)
            lost = int(bad[:conf].sum())
            self.lost_tokens_ctl += lost
            self.cfail("lost_tokens" if i < conf else "torn_publish",
                       f"detached sequence {e.sid}: token {i} of {n} differs from what its "
                       f"writers appended ({cnt} differ, {lost} of them confirmed): {e}")
        self.seqs_verified_ctl += 1
        self.tokens_verified_ctl += n
        e.conf = n
        e.intent = I_NONE
        self.J.write(slot, e)

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
            print(f"    {p:<24} {n:5d}  ({r['crash_points_armed'][p]})")
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
    p.add_argument("--mean-life", type=float, default=0.35,
                   help="mean of the random (exponential) life span of a worker after it is "
                        "ready, before it may be SIGKILLed")
    p.add_argument("--aim", type=float, default=0.3,
                   help="fraction of SIGKILLs aimed at a worker that is inside a pool append")
    p.add_argument("--arm", type=float, default=0.35,
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
    p.add_argument("--sabotage", choices=("free_detached", "corrupt_data"), default=None,
                   help="harness self-test: the controller frees a detached sequence / "
                        "changes one confirmed token behind the workers' backs every check "
                        "interval; the run must FAIL")
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
