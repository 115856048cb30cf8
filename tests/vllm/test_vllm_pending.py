"""Pending marks by progress, at the connector's scheduler half: engines are processes
running the real connector in vLLM's SCHEDULER role, built from the real model's engine
config and driven as vLLM's scheduler drives it (sched_worker.py) -- lookups, allocations,
preemptions, finished requests -- on one segment.

- a burst of 16 requests with one new prefix over two engines whose lookups interleave
  (each decides before the other marks): exactly one engine computes it, every request of
  the other waits;
- an engine's marks are shared by its requests: the first of two to finish leaves the
  other's; a preempted request's marks are dropped at once;
- a waiter waits while the prefix keeps being published, and stops waiting once nothing
  new has been published for ``pending_stall`` seconds (not ``pending_wait``);
- a waiter waits through the owner's one long prefill step (nothing published for longer
  than ``pending_stall``) as long as the owner's estimate, from the prefill rate it
  measured, says; once past it, it computes.

A real ``vllm serve`` fleet's burst is in test_vllm_serve.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from support import unique_name
from vllm_helpers import VB, _model_dir, needs_vllm

pytestmark = needs_vllm

HERE = os.path.dirname(os.path.abspath(__file__))
SB = 16                         # the connector's shmkv block size (its default)


class Engine:
    """One scheduler half in its own process (sched_worker.py)."""

    def __init__(self, seg: str, extra: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "sched_worker.py"), seg, json.dumps(extra)],
            cwd=HERE, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ready(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the scheduler process ended (rc {self.proc.wait()})"
        return json.loads(line)

    def __call__(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the scheduler process ended (rc {self.proc.wait()})"
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def fleet():
    """Two engines' scheduler halves (X, Y) on one new segment, for the module; each test
    sets their stall bound and speed (``set``) and uses prefixes of its own."""
    seg = unique_name("vllm-pending")
    made: list[Engine] = []
    try:
        # pending_lock_timeout 1 s (the most allowed): a marks operation that cannot get the
        # table's lock within its bound answers "no marks" (the engine computes: a bounded
        # wait, by design), which a loaded 2-core host can make happen at 50 ms; these
        # tests are about the decisions, not that bound (test_pending.py tests it)
        made = [Engine(seg, {"num_blocks": 512, "pending_wait": 120,
                             "pending_lock_timeout": 1.0}) for _ in range(2)]
        for e in made:
            assert e.ready()["marks"], "the pending marks are on"
        yield made[0], made[1], seg
    finally:
        for e in made:
            e.stop()
        import shmkv
        from shmkv.pending import unlink_pending
        try:
            shmkv.KVCache.attach(seg).unlink()
        except FileNotFoundError:
            pass
        unlink_pending(seg)


def _engines(fleet, stall: float, slow: bool = False):
    x, y, seg = fleet
    for e in (x, y):
        e("set", pending_stall=stall, slow=slow)
    return x, y, seg


def _prompt(prefix_id: int, blocks: int, suffix: int) -> list[int]:
    """``blocks`` vLLM blocks of a prefix named by ``prefix_id``, then 40 tokens of its own."""
    rng = np.random.default_rng(prefix_id)
    head = rng.integers(100, 20000, blocks * VB).tolist()
    return head + np.random.default_rng(10_000 + suffix).integers(100, 20000, 40).tolist()


def test_a_burst_of_16_requests_over_two_engines_computes_the_prefix_once(fleet):
    """Each engine's marks operations answer 0.3 s late, so the two engines' lookups of the
    new prefix interleave: both ask before either marks.  Deciding and marking are one
    claim: one engine wins and runs its 8 requests, the other's 8 wait.  (With a lookup
    that asked ``held`` and then marked in a second step, both engines saw "not held" and
    both computed the prefix.)"""
    x, y, _ = _engines(fleet, stall=120, slow=True)
    prefix = 1
    answers: dict = {}
    waits0 = {e: e("stats").get("pending_waits", 0) for e in (x, y)}

    def burst(name: str, e: Engine) -> None:
        for i in range(8):
            rid = f"{name}{i}"
            n = e("lookup", rid=rid, tokens=_prompt(prefix, 4, i))["n"]
            if n is not None:
                e("alloc", rid=rid)             # vLLM runs it
            answers[rid] = n
    ts = [threading.Thread(target=burst, args=a) for a in (("x", x), ("y", y))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    assert len(answers) == 16, answers
    ran = {rid[0] for rid, n in answers.items() if n is not None}
    assert len(ran) == 1, f"both engines compute the new prefix: {answers}"
    winner, loser = (x, y) if ran == {"x"} else (y, x)
    w, lo = sorted(ran)[0], "y" if ran == {"x"} else "x"
    assert all(answers[f"{w}{i}"] == 0 for i in range(8)), answers     # nothing to load
    assert all(answers[f"{lo}{i}"] is None for i in range(8)), answers  # all wait
    assert loser("stats")["pending_waits"] - waits0[loser] == 8
    # the winner's requests share its marks: they hold until the last of them finishes
    claimed = winner("marks")["claimed"]
    assert all(claimed[f"{w}{i}"] == 4 * VB // SB for i in range(8)), claimed
    for i in range(7):
        winner("finish", rid=f"{w}{i}")
        assert loser("lookup", rid=f"{lo}0", tokens=[])["n"] is None
    winner("finish", rid=f"{w}7")
    assert loser("lookup", rid=f"{lo}0", tokens=[])["n"] == 0   # not held: computes it
    x("set", pending_stall=120, slow=False)
    y("set", pending_stall=120, slow=False)


def test_a_preempted_requests_marks_are_dropped_at_once(fleet):
    x, y, _ = _engines(fleet, stall=120)
    for rid in ("p0", "p1"):                # two requests of X on one new prefix
        assert x("lookup", rid=rid, tokens=_prompt(2, 4, int(rid[1])))["n"] == 0
        x("alloc", rid=rid)
    assert y("lookup", rid="q0", tokens=_prompt(2, 4, 5))["n"] is None
    x("finish", rid="p0")                   # p1 still computes it: still marked
    assert y("lookup", rid="q0", tokens=[])["n"] is None
    x("preempt", rid="p1")                  # its blocks are gone: no mark left
    assert x("marks")["claimed"]["p1"] == 0
    assert y("lookup", rid="q0", tokens=[])["n"] == 0     # Y computes it now, and marks it
    assert y("marks")["claimed"]["q0"] == 4 * VB // SB
    assert x("lookup", rid="p1", tokens=[])["n"] is None  # resumed, X waits for Y


def _publish(kv, salt: str, tokens: list[int], blocks: range, gap: float,
             errors: list) -> None:
    """Publish vLLM blocks ``blocks`` of ``tokens`` as a computing engine's saves do, one
    every ``gap`` seconds (the K/V bytes are not what this test reads)."""
    try:
        for b in blocks:
            time.sleep(gap)
            end = (b + 1) * VB
            ids = np.asarray(tokens[:end] + [0], dtype=np.int32)
            sid = kv.create_sequence(tokens=ids, salt=salt)
            try:
                have = kv.seq_len(sid)
                kv.reserve(sid, end - have, tokens=ids[have:end])
                kv.commit(sid)
            finally:
                kv.free(sid)
    except BaseException as e:          # reported by the test, not lost in the thread
        errors.append(e)


def test_a_waiter_waits_while_the_prefix_is_published_and_not_once_it_stalls(fleet):
    """``pending_stall`` 3 s, ``pending_wait`` 120 s.  While X's prefix is published a vLLM
    block every 0.5 s (4 s in all), Y waits and then loads all of it; when publishing stops
    after 2 blocks (X's saves failing, X stopped), Y computes the rest after ~3 s without
    progress -- not after ``pending_wait``, the mark's owner being alive and its marks
    unexpired."""
    import shmkv
    from shmkv.integrations.vllm import request_salt

    x, y, seg = _engines(fleet, stall=3)
    kv = shmkv.KVCache.attach(seg)          # opened before any clock runs
    salt = request_salt(_model_dir(), None, None)
    try:
        _waits(x, y, kv, salt)
    finally:
        kv.close()


def _waits(x, y, kv, salt):
    timeouts0 = y("stats").get("pending_timeouts", 0)
    for k, (blocks, published) in enumerate(((8, 8), (8, 2))):
        tokens = _prompt(3 + k, blocks, 0)
        rx, ry = f"w{k}", f"v{k}"
        assert x("lookup", rid=rx, tokens=tokens)["n"] == 0
        x("alloc", rid=rx)
        assert y("lookup", rid=ry, tokens=_prompt(3 + k, blocks, 1))["n"] is None
        errors: list = []
        pub = threading.Thread(target=_publish,
                               args=(kv, salt, tokens, range(published), 0.5, errors))
        pub.start()
        got = y("until_runs", rid=ry, poll=0.05, bound=90)
        pub.join(60)
        assert not errors, errors
        assert got["n"] is not None, f"Y still waits after {got['seconds']:.0f} s"
        assert got["n"] == published * VB, got   # all of it / what was published: a load
        timeouts = y("stats").get("pending_timeouts", 0) - timeouts0
        if published == blocks:
            assert timeouts == 0                # it never gave up
        else:
            assert timeouts == 1


def test_a_waiter_waits_through_one_long_prefill_step_until_the_owners_estimate(fleet):
    """``pending_stall`` 1 s.  X has measured its prefill rate (a step of 64 tokens in
    0.15 s) and runs a request of ~1064 new tokens: its marks say it publishes them in about
    1.5 x rate x tokens + stall (~4.7 s).  Computing a long prompt in one step, X publishes
    all of it at once after 3 s: Y, which saw nothing new for 3 s (three times its stall
    bound), waited and loads all of it.  When X publishes nothing, Y computes once X's
    estimate has passed, not at its stall bound and not at ``pending_wait``.  (Judged by the
    stall bound alone, Y recomputed the prompt after 1 s: what a CPU engine's long prefill
    steps did to a fleet's shared system prompt.)"""
    import shmkv
    from shmkv.integrations.vllm import request_salt

    x, y, seg = _engines(fleet, stall=1)
    spt = x("step", tokens=64, seconds=0.15)["spt"]
    assert spt is not None and 0.15 / 64 <= spt < 1.0 / 64, spt
    kv = shmkv.KVCache.attach(seg)
    salt = request_salt(_model_dir(), None, None)
    try:
        timeouts0 = y("stats").get("pending_timeouts", 0)
        for k, published in enumerate((8, 0)):
            tokens = _prompt(20 + k, 8, 0)
            est = 1.5 * spt * len(tokens) + 1           # X's estimate, from its alloc
            rx, ry = f"e{k}", f"f{k}"
            assert x("lookup", rid=rx, tokens=tokens)["n"] == 0
            t_alloc = time.monotonic()
            x("alloc", rid=rx)
            assert y("lookup", rid=ry, tokens=_prompt(20 + k, 8, 1))["n"] is None
            errors: list = []
            # one long step: every block published together, 3 s after X started
            pub = threading.Thread(target=_publish, args=(
                kv, salt, tokens, range(published), 0, errors))
            timer = threading.Timer(3.0 - (time.monotonic() - t_alloc), pub.start)
            timer.start()
            got = y("until_runs", rid=ry, poll=0.05, bound=90)
            timer.join()
            if published:
                pub.join(60)
            assert not errors, errors
            timeouts = y("stats").get("pending_timeouts", 0) - timeouts0
            if published:
                assert got["n"] == 8 * VB, got      # it waited for the step: all loaded
                assert got["seconds"] >= 2.5 and timeouts == 0, (got, timeouts)
            else:
                assert got["n"] == 0, got            # computes it itself
                # not at its 1-s stall bound, by X's estimate (less what passed before Y
                # asked), and long before pending_wait (120 s here)
                assert est - 1.0 <= got["seconds"] <= est + 5, (got, est)
                assert timeouts == 1
            x("finish", rid=rx)
            y("finish", rid=ry)
    finally:
        kv.close()
