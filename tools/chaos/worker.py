"""The worker process: ``Worker`` (its state, the timed ``call`` wrapper, the main loop
that picks operations, and resolving what a dead predecessor left in its lane and slots)
and ``worker_entry``, the process target the controller starts."""
from __future__ import annotations

import json
import os
import random
import signal
import time
import traceback

import shmkv
from shmkv import _core

from .codec import Codec, DataError, Prompts
from .common import (
    CNT_BASE,
    DETACHED,
    EMPTY,
    F_RESERVE_OK,
    F_TOK,
    FAIL_BASE,
    FAIL_INDEX,
    FREED,
    I_ADOPT,
    I_DETACH,
    I_FREE,
    I_NONE,
    LF,
    MAX_BASE,
    OP_INDEX,
    ORPHAN,
    OWNED,
    POOL_OP,
    Journal,
)
from .events import event_error
from .worker_own import OwnOps
from .worker_pool import PoolOps


class Worker(OwnOps, PoolOps):
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
        self.ev_cursor = None       # next KV event seq this worker reads (op_events)

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
                      "trim_mid": self.focus_trim,
                      "truncate_mid": self.focus_truncate,
                      "event_mid": self.focus_publish,
                      "reset_mid": self.focus_reset}.get(a.get("crash"))
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
        elif r < 0.53:
            self.op_truncate_own(e)
        elif r < 0.54:
            self.op_evict()
        elif r < 0.55:
            self.op_priority_or_match(e)
        elif r < 0.71:
            self.op_pool_claim()
        elif r < 0.79:
            self.op_pool_fork()
        elif r < 0.94:
            self.op_pool_read()
        elif r < 0.95:
            self.op_events()
        elif r < 0.98:
            # both passes: the scheduled one (the pass of what died, when something
            # did) and the full one, which reaches recover_mid with nothing dead too
            self.call("recover", self.cache.recover, full=self.rng.random() < 0.5)
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

    # -- KV events: a lock-free reader racing the writers, and the rare index reset -----
    def op_events(self):
        """Read the KV events after our cursor while other workers write (and die
        writing) them: seqs dense (lost + returned == asked), every event whole and
        well-formed.  Now and then reset the prefix index instead ("cleared")."""
        if self.rng.random() < 0.03:
            return self.op_reset()
        c, bs = self.cache, self.bs
        since = self.ev_cursor
        if since is None:
            since = self.call("events", c.events, 2**62).next_seq
        b = self.call("events", c.events, since)
        seqs = [ev.seq for ev in b.events]
        if seqs != list(range(since + b.lost, since + b.lost + len(seqs))) \
                or b.next_seq != since + b.lost + len(seqs):
            self.fail("bad_event", f"events({since}): seqs {seqs[:5]}.. lost {b.lost} "
                                   f"next {b.next_seq}: not dense")
        for ev in b.events:
            err = event_error(ev, bs)
            if err:
                self.fail("bad_event", f"event {ev.seq}: {err}: {ev}")
                break
        self.bump("events_read", len(b.events))
        self.bump("events_lost", b.lost)
        self.ev_cursor = b.next_seq

    def op_reset(self):
        if not self.a.get("resets", True):
            return
        self.call("reset_prefix", self.cache.reset_prefix_cache)
        self.bump("resets")

    def reset_since(self, seq):
        """Did a reset_prefix_cache() ("cleared") happen since event seq (or can we not
        tell: events lost)?  Excuses a prefix hit that stopped being findable."""
        b = self.call("events", self.cache.events, seq)
        return b.lost > 0 or any(ev.kind == "cleared" for ev in b.events)

    def focus_reset(self):
        """Armed with reset_mid: cached blocks to drop (a tokened prompt), then resets."""
        if self.rng.random() < 0.5:
            return self.op_reset()
        if len(self.own) < self.MAX_OWN:
            return self.op_create_prompt()
        return self.op_free_own(self.rng.choice(list(self.own.values())))

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

    def focus_truncate(self):
        """Armed with truncate_mid (passed only when a block is released): truncates of
        pool sequences (a death must leave the old length or the new one, the kept
        tokens intact, forks and published blocks untouched) and of our own (reclaimed
        whole by recovery: what must hold is everything they shared)."""
        if self.rng.random() < 0.5:
            return self.op_pool_claim(mode="truncate")
        cands = [e for e in self.own.values() if e.conf > 2 * self.bs]
        if not cands:
            e = self.rng.choice(list(self.own.values()))
            return self.append_n(e, min(self.max_len - e.conf, 3 * self.bs))
        e = self.rng.choice(cands)
        if self.rng.random() < 0.4:
            self.op_fork_own(e)                    # shared blocks: the pool-lock path
        return self.op_truncate_own(e)

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
