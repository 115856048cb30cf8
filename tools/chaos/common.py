"""The chaos harness's shared vocabulary: operation and failure names, the per-lane
counter layout, sequence states and intents, the journal (``Entry``: one sequence's record;
``Journal``: the mmap'd file of double-buffered records under per-slot OFD locks), and the
deterministic fill table every token's data comes from.  Imports nothing of ``chaos``."""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import zlib

import numpy as np

OPS = ("attach", "create", "append", "reserve", "write", "fork", "gather", "paged_read",
       "free", "detach", "adopt", "recover", "check", "seq_len", "owner_pid", "tables",
       "stats", "create_tok", "append_tok", "reserve_tok", "commit", "match_prefix",
       "token_ids", "trim", "trimmed", "evict", "set_priority", "events", "reset_prefix",
       "truncate")


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
    "bad_event",        # a KV event read torn or malformed, seqs not dense, or a "stored"
                        # event whose block (still findable) holds other token ids
    "bad_truncate",     # truncate(sid, n) left another length than n, or a death inside
                        # it left neither the old length nor n
)


FAIL_INDEX = {k: i for i, k in enumerate(FAIL_KINDS)}


LANE_FIELDS = ("inc", "pid", "ready", "lost_token_count", "tokens_verified",
               "seqs_verified", "reads_discarded", "reclaimed_seen", "cache_full",
               "pool_appends", "resolved_inflight", "cow_appends", "not_found",
               "claim_busy", "max_claim_wait_ns", "startup_ns_sum", "startup_ns_max",
               "startups", "ready_mono_ns", "prompt_creates", "prefix_hit_blocks",
               "prefix_hit_tokens_verified", "ids_verified", "tok_appends", "commits",
               "committed_blocks", "trims", "trimmed_tokens", "resolved_trims",
               "evict_calls", "evicted", "evicted_dead", "matches", "cur_op",
               "events_read", "events_lost", "resets", "resets_excused",
               "truncates", "truncated_tokens", "resolved_truncates")


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


I_NONE, I_APPEND, I_FREE, I_DETACH, I_ADOPT, I_TRIM, I_TRUNC = 0, 1, 2, 3, 4, 5, 6


INTENT_NAMES = {I_NONE: "-", I_APPEND: "append", I_FREE: "free", I_DETACH: "detach",
                I_ADOPT: "adopt", I_TRIM: "trim", I_TRUNC: "truncate"}


F_RESERVE_OK = 1        # only this sequence's creator touches it: reserve+write allowed


F_TOK = 2               # every token was given with its id (tokens=): token_ids() is known


SALT_SHIFT = 4          # flags bits 4-5: the cache salt (0: none, 1..3: SALTS[i])


SALT_BITS = 2           # a lineage seed's low bits carry the salt: content differs, ids not


SALTS = (None, "tenant-a", "tenant-b", "tenant-c")


POOL_OP = 100           # cur_op: + this when the call is on a claimed pool sequence


MAXSEG = 32


# sid, state, intent, holder, flags, conf, i_len, i_n, nseg, trim, sink, starts, seeds, cuts
PAYLOAD = struct.Struct(f"<qIIqIIIIIII{MAXSEG}I{MAXSEG}QI")


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


class Entry:
    """One journal record: what the harness knows about the sequence in a slot.

    Positions: `conf`, `i_len` are current positions of the sequence; its lineage `segs`
    is in ORIGINAL positions (what the token was when it was appended).  They differ
    once trim_streaming dropped blocks: current position i < sink * block_size is
    original i, any later one is original i + trim.  `cuts` counts the truncates the
    sequence went through (a reader whose two records differ in it, or show one in
    flight, cannot tell which of the tokens it read the first record confirmed)."""
    __slots__ = (
        "conf",
        "cuts",
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
                 i_len=0, i_n=0, segs=(), ver=0, trim=0, sink=0, cuts=0):
        self.sid, self.state, self.intent, self.holder = sid, state, intent, holder
        self.flags, self.conf, self.i_len, self.i_n = flags, conf, i_len, i_n
        self.segs = list(segs)
        self.ver = ver
        self.trim, self.sink = trim, sink
        self.cuts = cuts

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
                            *starts, *seeds, self.cuts)

    @classmethod
    def unpack(cls, raw, ver):
        v = PAYLOAD.unpack(raw)
        n = min(v[8], MAXSEG)
        starts = v[11:11 + MAXSEG]
        seeds = v[11 + MAXSEG:11 + 2 * MAXSEG]
        return cls(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7],
                   list(zip(starts[:n], seeds[:n])), ver, v[9], v[10], v[11 + 2 * MAXSEG])

    def copy(self):
        return Entry(self.sid, self.state, self.intent, self.holder, self.flags, self.conf,
                     self.i_len, self.i_n, self.segs, self.ver, self.trim, self.sink,
                     self.cuts)

    def __repr__(self):
        return (f"Entry(sid={self.sid}, {STATE_NAMES.get(self.state, self.state)}, "
                f"intent={INTENT_NAMES.get(self.intent, self.intent)}({self.i_len},"
                f"{self.i_n}), holder={self.holder >> 32}.{self.holder & 0xffffffff}, "
                f"conf={self.conf}, flags={self.flags:#x}, trim={self.trim}, "
                f"sink={self.sink}, cuts={self.cuts}, segs={self.segs})")


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
        if not self._try_lk(slot):
            return False
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
        return self._try_lk(EVICT_GATE)

    def _try_lk(self, byte):
        """Take the exclusive OFD lock of `byte` without waiting: False when another
        process holds it."""
        try:
            self._lk(byte, fcntl.F_WRLCK)
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
