"""The demo's parent process: segment, workers, scheduling, the kill, progress.

The parent never runs the model while the workers serve; it hands tasks to idle workers
over one pipe each, keeps conversations in order (a turn is ready when the previous one
is answered), samples the segment (``snapshot``) for the shared-block count and the
progress line, SIGKILLs one worker while it holds sequences, and re-serves its request.
Whatever happens (an error, Ctrl-C), every process it started is ended by its PID and
the segment is unlinked.
"""
from __future__ import annotations

import collections
import multiprocessing as mp
import os
import signal
import sys
import time
import uuid
from multiprocessing.connection import wait

from ..cache import KVCache
from ..inspect import snapshot
from . import report
from .model import Chat, load_model, make_traffic
from .workers import worker_main

PRESETS = {  # conversations, turns each, most new tokens, workers
    "full": (12, 3, 48, 4),
    "quick": (4, 2, 32, 3),
}


MAX_WAITING_HANDOFFS = 8   # detached sequences waiting for a decode worker, at most
STALL_S = 300      # no message from any worker for this long: give up (exit 1)


class Worker:
    def __init__(self, wid, role, proc, conn):
        self.wid, self.role, self.proc, self.conn = wid, role, proc, conn
        self.pid = None
        self.t_begin = None         # when it said "begin" for its current task
        self.task = None            # (task name, Request) while busy
        self.alive = True
        self.served = 0


class Progress:
    """A rich progress bar on a terminal, plain lines every 5 s otherwise."""

    def __init__(self, total: int, what: str):
        self.total, self.what, self._rich, self._next = total, what, None, 0.0
        if sys.stdout.isatty():
            try:
                from rich import progress as rp

                # fits 80 columns: a fixed bar, the counts, then the info (cut if need be)
                self._rich = rp.Progress(rp.TextColumn("{task.description}"),
                                         rp.BarColumn(bar_width=16), rp.MofNCompleteColumn(),
                                         rp.TimeElapsedColumn(),
                                         rp.TextColumn("{task.fields[info]}"))
                self._rich.start()
                self._task = self._rich.add_task(what, total=total, info="")
            except ImportError:
                self._rich = None
        self.t0 = time.monotonic()

    def update(self, done: int, info: str = "", force: bool = False):
        if self._rich is not None:
            self._rich.update(self._task, completed=done, info=info)
            return
        now = time.monotonic()
        if force or now >= self._next:
            self._next = now + 5.0
            print(f"  [{now - self.t0:5.1f}s] {self.what} {done}/{self.total}  {info}",
                  flush=True)

    def log(self, line: str):
        if self._rich is not None:
            self._rich.console.print(line, highlight=False)
        else:
            print(line, flush=True)

    def close(self):
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


def run(args) -> int:
    t_phase = {"start": time.monotonic()}
    quick = "quick" if args.quick else "full"
    n_conv, turns, max_new, n_workers = PRESETS[quick]
    n_conv = args.conversations or n_conv
    turns = args.turns or turns
    max_new = args.max_new or max_new
    n_workers = args.workers or n_workers
    if n_workers < 3 or n_conv < 1 or not 1 <= turns <= 3 or max_new < 4:
        print("shmkv demo: needs --workers >= 3, --conversations >= 1, --turns 1 to 3 and "
              "--max-new >= 4", file=sys.stderr)
        return 2
    from ..models import ModelUnavailable, smollm2_dir

    try:
        model_dir = smollm2_dir()     # converted once here; every worker loads the cache
    except ModelUnavailable as e:
        print(f"shmkv demo: {e}", file=sys.stderr)
        return 2
    # Workers come from a fork server that imported torch and transformers once (6 s of
    # a 2-core machine's time per import): it forks each worker before any torch thread
    # exists, so every worker starts with the modules loaded and no thread pool to inherit.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "transformers", "shmkv.demo.workers",
                                "transformers.models.llama.modeling_llama",
                                "transformers.generation"])
    from multiprocessing import forkserver

    forkserver.ensure_running()       # it imports while this process does the same
    import torch
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ..integrations.transformers import config_for

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    chat = Chat(AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    convs = make_traffic(n_conv, turns, max_new=max_new, beam_every=5, handoff_every=3)
    reqs = [r for c in convs for r in c.turns]
    mcfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    cfg = config_for(mcfg, num_blocks=args.num_blocks, block_size=16, max_seqs=128)
    name = f"shmkv-demo-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    kv = KVCache.create(name, cfg)    # before its name is printed: `shmkv top NAME` works
    workers = []
    try:
        report.header(name, cfg, mcfg, model_dir, n_workers, reqs, convs)
        for wid in range(n_workers):
            parent_end, child_end = ctx.Pipe()
            role = "prefill" if wid == 0 else "serve"
            p = ctx.Process(target=worker_main, args=(name, wid, child_end),
                            name=f"shmkv-demo-{role}-{wid}", daemon=True)
            p.start()
            child_end.close()
            workers.append(Worker(wid, role, p, parent_end))
        victim = None if args.no_kill else workers[-1]
        served = _serve(kv, name, chat, convs, reqs, workers, victim)
        t_phase["served"] = time.monotonic()
        for w in workers:
            if w.alive:
                w.conn.send(None)
        for w in workers:
            w.proc.join(timeout=20)
        if served["errors"]:
            for rid, text in served["errors"]:
                print(f"  ! request {rid} failed in a worker:\n{text}", file=sys.stderr)
        checked = None
        if not args.no_check and not served["errors"]:
            checked = report.check_outputs(reqs, load_model("sdpa")[1], chat.eos, Progress)
        t_phase["checked"] = time.monotonic()
        served["phases"] = t_phase
        rec = kv.recover()
        served["final_recover"] = rec
        st = kv.stats()
        problems = kv.check()
        ok = report.results(args, kv, chat, convs, reqs, workers, victim, served, checked,
                            st, problems)
        if args.hold > 0:
            print(f"holding /{name} for {args.hold:g} s (shmkv top {name})", flush=True)
            time.sleep(args.hold)
        return 0 if ok else 1
    except KeyboardInterrupt:
        print(f"\nshmkv demo: interrupted; ending {sum(w.proc.is_alive() for w in workers)} "
              f"worker processes and unlinking /{name}", file=sys.stderr, flush=True)
        return 130
    finally:
        for w in workers:
            if w.proc.is_alive():
                os.kill(w.proc.pid, signal.SIGKILL)     # by PID, never by name
                w.proc.join(timeout=5)
        kv.unlink()
        kv.close()
        _stop_helpers()


def _stop_helpers():
    """End multiprocessing's helper processes this run started (the fork server, the
    resource tracker) by their PIDs, with multiprocessing's own stop (close the lifeline,
    then waitpid); they would also exit with us, a moment later."""
    from multiprocessing import forkserver, resource_tracker

    for helper in (getattr(forkserver, "_forkserver", None),
                   getattr(resource_tracker, "_resource_tracker", None)):
        stop = getattr(helper, "_stop", None)
        if stop is None:
            continue
        try:
            stop()
        except (OSError, ChildProcessError):
            pass


def _owned(snap, pid):
    """Sequences (and their blocks) a process owns in a snapshot."""
    seqs = [s for s in snap["sequences"] if s["owner_pid"] == pid and not s["detached"]]
    blocks = collections.Counter()         # block -> references from these sequences
    for s in seqs:
        blocks.update(int(b) for b in s["table"])
    return seqs, blocks


def _serve(kv, name, chat, convs, reqs, workers, victim):
    """Serve every request; returns what the report needs."""
    by_rid = {r.rid: r for r in reqs}
    ready = collections.deque(c.start(chat) for c in convs)
    handoffs = collections.deque()        # (Request, sid, first) awaiting a decode worker
    done, errors = set(), []
    kill_after = max(1, len(reqs) * 2 // 5)
    killed = None
    peak_shared, peak_used, tokens = 0, 0, 0
    t_start = None
    bar = Progress(len(reqs), "requests")
    by_conn = {w.conn: w for w in workers}
    n_ready, t_ready, info = 0, None, ""
    last_msg = time.monotonic()
    try:
        while len(done) < len(reqs):
            # start tasks on idle workers
            for w in workers:
                if not (w.alive and w.pid and w.task is None):
                    continue
                task = _next_task(w, ready, handoffs, any(x.alive and x.role == "prefill"
                                                          for x in workers))
                if task is None:
                    continue
                w.task, w.t_begin = task, None
                if t_start is None:
                    t_start = time.monotonic()
                kind, r = task[0], task[1]
                if kind == "decode":
                    w.conn.send(("decode", r.rid, task[2], r.prompt, task[3], r.max_new))
                elif kind == "prefill":
                    w.conn.send(("prefill", r.rid, r.prompt, r.max_new))
                else:
                    w.conn.send(("serve", r.rid, "beam" if r.kind == "beam" else "plain",
                                 r.prompt, r.max_new))
            live = [w.conn for w in workers if w.alive]
            if not live:
                raise RuntimeError("every worker is gone")
            got = wait(live, timeout=0.05)
            if got:
                last_msg = time.monotonic()
            elif time.monotonic() - last_msg > STALL_S:
                errors.append((-1, f"no worker reported anything for {STALL_S} s"))
                break
            for conn in got:
                w = by_conn[conn]
                try:
                    msg = conn.recv()
                except EOFError:
                    w.alive = False
                    errors.append((w.task[1].rid if w.task else -1,
                                   f"worker {w.wid} exited with {w.proc.exitcode}"))
                    continue
                if msg[0] == "ready":
                    w.pid = msg[1]
                    n_ready += 1
                    if n_ready == len(workers):
                        t_ready = time.monotonic()
                elif msg[0] == "begin":
                    w.t_begin = time.monotonic()
                elif msg[0] == "handoff":
                    r = by_rid[msg[1]]
                    r.stats.update(msg[3])
                    r.stats["prefill_pid"] = msg[3]["pid"]
                    handoffs.append((r, msg[2], msg[3]["first"]))
                    w.task = None
                    w.served += 1
                elif msg[0] == "done":
                    r = by_rid[msg[1]]
                    res = msg[2]
                    r.output = res.pop("output")
                    r.score = res.pop("score", 0.0)
                    r.stats.update(res)
                    r.stats["served_by"] = w.wid
                    tokens += len(r.output)
                    done.add(r.rid)
                    w.task = None
                    w.served += 1
                    nxt = convs[r.conv].advance(chat, r)   # its prompt extends r's ids
                    if nxt is not None:
                        ready.append(nxt)
                elif msg[0] == "error":
                    errors.append((msg[1], msg[2]))
                    done.add(msg[1])
                    w.task = None
            if errors:
                break
            snap = snapshot(name)
            shared = int((snap["ref_cnt"] > 1).sum())
            peak_shared, peak_used = max(peak_shared, shared), max(peak_used,
                                                                   snap["used_blocks"])
            if (victim is not None and killed is None and len(done) >= kill_after
                    and victim.task is not None and victim.task[0] != "prefill"
                    and victim.t_begin is not None
                    and time.monotonic() - victim.t_begin > 0.02):
                seqs, blocks = _owned(snap, victim.pid)
                if seqs and blocks:          # mid-request: it holds blocks
                    killed = _kill(kv, victim, seqs, blocks, snap, ready, t_start, bar)
            el = time.monotonic() - (t_start or time.monotonic())
            hit = sum(r.stats.get("hit", 0) for r in reqs)
            plen = sum(r.stats.get("prompt_len", 0) for r in reqs if "hit" in r.stats)
            if t_start:
                ans, ans_hit = report.answer_reuse(reqs)
                info = (f"{tokens / max(el, 1e-9):4.1f} tok/s  hits "
                        f"{100 * hit / max(plen, 1):2.0f}% (answers {ans_hit}/{ans})  "
                        f"blocks {snap['used_blocks']} ({shared} shared)")
            else:
                info = f"starting workers ({n_ready} of {len(workers)} ready)"
            bar.update(len(done), info)
        elapsed = time.monotonic() - t_start if t_start else 0.0
        bar.update(len(done), info, force=True)
    finally:
        bar.close()
    return dict(errors=errors, killed=killed, peak_shared=peak_shared, peak_used=peak_used,
                elapsed=elapsed, tokens=tokens, t_ready=t_ready)


def _next_task(w, ready, handoffs, have_prefill):
    if w.role == "prefill":
        if len(handoffs) >= MAX_WAITING_HANDOFFS:    # decode workers are behind: wait
            return None
        for r in ready:
            if r.kind == "handoff" and not r.reserved:
                ready.remove(r)
                return ("prefill", r)
        return None
    if handoffs:
        r, sid, first = handoffs.popleft()
        return ("decode", r, sid, first)
    for r in ready:
        if r.kind != "handoff" or r.reserved or not have_prefill:
            ready.remove(r)
            return ("serve", r)
    return None


def _kill(kv, victim, seqs, blocks, snap, ready, t_start, bar):
    """SIGKILL the victim mid-request; recover; put its request back in line."""
    task, r = victim.task[0], victim.task[1]
    task = {"decode": "decoding a handed-off sequence",
            "serve": "running beam search" if r.kind == "beam" else "generating"}.get(task, task)
    before = kv.stats()
    os.kill(victim.pid, signal.SIGKILL)
    victim.proc.join(timeout=10)
    victim.alive = False
    victim.task = None
    t = time.monotonic() - bar.t0
    rec = kv.recover()
    after = kv.stats()
    exclusive = sum(1 for b, n in blocks.items() if snap["ref_cnt"][b] <= n)
    info = dict(pid=victim.pid, wid=victim.wid, rid=r.rid, task=task, at=t,
                held_seqs=len(seqs), held_blocks=len(blocks), exclusive=exclusive,
                recover=rec,
                reclaimed_seqs=after["reclaimed_sequences"] - before["reclaimed_sequences"],
                reclaimed_blocks=after["reclaimed_blocks"] - before["reclaimed_blocks"],
                exitcode=victim.proc.exitcode)
    r.reserved = True
    r.stats = {}
    ready.appendleft(r)
    bar.log(f"  [{t:5.1f}s] SIGKILLed worker {victim.wid} (pid {victim.pid}) while "
            f"{task} for r{r.rid}, holding {len(seqs)} sequences / {len(blocks)} blocks "
            f"({exclusive} held by nobody else); recovery reclaimed "
            f"{info['reclaimed_seqs']} sequences, {info['reclaimed_blocks']} blocks; "
            f"r{r.rid} goes back in line")
    return info
