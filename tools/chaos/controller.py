"""The controller: starts the workers, SIGKILLs them at random and aims at pool
appends, arms restarted ones with crash points, watches for hangs, runs the periodic
check and the kill-all audits (``audit``), and decides the verdict (``report``)."""
from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid

import numpy as np

import shmkv
from shmkv import _core
from shmkv.inspect import snapshot

from .audit import Audits
from .codec import Codec, Prompts
from .common import CNT_BASE, DETACHED, FAIL_BASE, FAIL_KINDS, LF, OPS, POOL_OP, Journal, _lane_sum
from .events import EventAudits
from .report import Report
from .worker import worker_entry


def _unlink_segment(name):
    """The segment's name, whatever state the run is in (gone already is fine)."""
    import posix_ipc
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass


# the folder that holds the package `chaos`: the workers import their code from there
TOOLS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prepare_children(method):
    """Make worker starts importable.  The forkserver imports its preload list before it
    applies the parent's sys.path, so it finds `chaos` only through PYTHONPATH.  (A child
    re-runs the parent's __main__ only for a plain script; ours is chaos/__main__.py,
    which multiprocessing never re-runs, so a start costs no compile.)"""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if TOOLS_DIR not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([TOOLS_DIR] + paths)


def _fmt_s(ns):
    return f"{ns / 1e9:.4f}"


# a planted bug that only a death at one point makes visible: half the armed workers
# get that point (the others keep every point covered)
PLANT_AIM = {"torn_event": "event_mid"}


class Controller(Audits, EventAudits, Report):

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
        self.resolved_truncates_ctl = 0
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
                                max_seq_len=a.max_seq_len, max_procs=64,
                                event_capacity=a.events)
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
            if PLANT_AIM.get(a.plant) and self.rng.random() < 0.5:
                crash = PLANT_AIM[a.plant]      # where the planted bug shows
            hi = {"recover_mid": 3, "create_mid": 4, "fork_mid": 3, "free_mid": 3,
                  "cow_after_copy": 2, "cow_commit_mid": 2, "publish_mid": 3,
                  "trim_mid": 2, "reset_mid": 2, "event_mid": 4,
                  "truncate_mid": 2}.get(crash, 8)
            countdown = self.rng.randint(1, hi)
            self.cp_armed[crash] += 1
        args = {"name": self.name, "journal": self.J.path, "failures": self.fail_path,
                    "lanes": a.workers, "max_seqs": self.cfg.max_seqs, "lane": lane, "inc": self.inc,
                    "seed": self.rng.getrandbits(64), "crash": crash, "countdown": countdown,
                    "plant": a.plant, "bound": a.bound, "lock_timeout": a.lock_timeout,
                    "t_start_ns": time.time_ns(), "prompt_seed": self.prompt_seed,
                    # a reset of the prefix index would un-hash the cached block the
                    # corrupt_cached sabotage damaged, and nothing could catch it then
                    "resets": a.sabotage != "corrupt_cached"}
        self.J.lanes[lane, LF["ready"]] = 0
        p = self.ctx.Process(target=worker_entry, args=(args,), daemon=True)
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
            if w["crash"] == "event_mid":
                self._event_live_check()
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
            snap = snapshot(self.name, tables=False)
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
                if t // bs >= len(tab):
                    return    # adopted and changed since the journal said so: next time
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
