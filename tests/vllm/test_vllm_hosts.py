"""vLLM on two hosts over a real network: ``vllm serve`` (bfloat16, vLLM's default on CPU)
on host A and on host B of tools/netlab.py -- network namespaces on a switch of their own,
each host its own /dev/shm and so its own segment -- sharing through a Redis Cluster of
three masters and three replicas spread over three hosts (the connector's ``tier``).

- a long system prompt served on A is a hit on B over the network (``cached_tokens``);
  B's greedy answer is B's own without the hit (the same chat under another
  ``cache_salt``: nothing to find), up to bfloat16's numerics; the K/V that landed in B's
  segment equal transformers' own computation;
- with 0.2, 1 and 5 ms added each way between B and the cluster, a hit still pays: B's
  time to the first token for A's prefix is below its recompute;
- faults while the hosts serve, none of which fails a request or loads anything wrong,
  and after each the hits come back: a master SIGKILLed (its replica takes over), host B
  cut off the network, B's link 2 s slower each way (a request waits at most the
  connector's ``tier_wait`` for its lookup, then computes), values in Redis overwritten
  with garbage and with a block of another layout (B loads the blocks before the bad
  one and computes the rest).

The requests go to the engines from threads of this process that joined the host's
network namespace (``Lab.call``); the engines' segments are read by a process on their
host (hosts_worker.py).  The engines, the cluster and the namespaces end with the module.
"""
from __future__ import annotations

import functools
import json
import os
import struct
import sys
import threading
import time
from typing import Optional

import numpy as np
import pytest
from serve_helpers import (
    BF16_LOGPROB_TOL,
    LOGPROBS,
    ServeInstance,
    assert_same_greedy,
    cached_tokens,
    check_kv,
    common_prefix,
    connector_config,
    gpl_text,
)
from vllm_helpers import SB, _model_dir, expected_hit

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir)
sys.path.insert(0, os.path.join(ROOT, "tools"))
from netlab import Lab, lab_available  # noqa: E402

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False

WHY = lab_available()
if os.environ.get("CI") and WHY:
    raise RuntimeError(f"CI: the network lab cannot run here: {WHY}")
pytestmark = [pytest.mark.skipif(WHY is not None, reason=WHY or ""),
              pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")]

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hosts_worker.py")
SEG = "shmkv-hosts"            # each host's own /dev/shm: one name, two segments
TIER_WAIT = 1.0                # the longest a request waits for its tier lookup (seconds)
TIER_TIMEOUT = 0.5             # one tier call's socket bound
QUEUE_SLACK = 2.0              # scheduler steps around a lookup, on a busy machine
BACKOFF_MAX = 5.0              # RedisTier's breaker: a failed tier is asked again <= 5 s on


def _chat(doc: str, text: str, question: str) -> list[dict]:
    return [{"role": "system", "content": f"{doc}\n{text}"},
            {"role": "user", "content": question}]


class Hosts:
    def __init__(self, lab: Lab, c, A: ServeInstance, B: ServeInstance, model: str,
                 tmp) -> None:
        self.lab, self.c, self.A, self.B, self.model, self.tmp = lab, c, A, B, model, tmp
        self.figures: dict = {}
        self.recompute: Optional[float] = None

    # ---- the cluster, seen from host r (not delayed, never cut off) ----------------
    def _on_masters(self, fn):
        masters = self.lab.masters(self.c)

        def run():
            import redis
            out = []
            for ip, port in masters:
                r = redis.Redis(ip, port, socket_timeout=5, socket_connect_timeout=5)
                try:
                    out.append(fn(r))
                finally:
                    r.close()
            return out
        return self.lab.call("r", run)

    def tier_keys(self) -> set:
        return set().union(*self._on_masters(lambda r: set(r.scan_iter(b"shmkv:*", 1000))))

    def wait_written(self, before: set, blocks: int, timeout: float = 30.0) -> set:
        """Until the tier holds at least ``blocks`` keys that were not in ``before`` (A's
        worker writes through in the background); those keys."""
        t0 = time.monotonic()
        while True:
            new = self.tier_keys() - before
            if len(new) >= blocks:
                time.sleep(0.3)                   # the rest of the batch
                return self.tier_keys() - before
            assert time.monotonic() - t0 < timeout, (len(new), blocks)
            time.sleep(0.1)

    def values(self, keys: set) -> dict:
        """key -> value, each read from the master that holds it."""
        def get(r):
            return {k: r.get(k) for k in set(r.scan_iter(b"shmkv:*", 1000)) & keys}
        out: dict = {}
        for d in self._on_masters(get):
            out.update(d)
        return out

    def overwrite(self, key: bytes, value: bytes) -> None:
        def put(r):
            if key in set(r.scan_iter(b"shmkv:*", 1000)):
                r.set(key, value)
                return 1
            return 0
        assert sum(self._on_masters(put)) == 1

    # ---- host B's segment ------------------------------------------------------------
    def b_stats(self) -> dict:
        r = self.lab.run("b", [sys.executable, HELPER, "stats", SEG], cwd="/tmp")
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout)

    def b_stored(self, tokens: list[int]):
        ids, out = self.tmp / "ids.json", self.tmp / "stored.npz"
        ids.write_text(json.dumps(tokens))
        r = self.lab.run("b", [sys.executable, HELPER, "stored", SEG, self.model, str(ids),
                               str(out)], cwd="/tmp")
        assert r.returncode == 0, r.stderr[-3000:]
        z = np.load(out)
        return int(z["n"]), z["k"], z["v"], json.loads(str(z["check"]))

    def queued(self, inst: ServeInstance, fn):
        """``fn()`` and the seconds the one request it sends spent waiting to be scheduled
        (vLLM's own ``request_queue_time``: a request held back for its tier lookup waits
        there).  What the bound on the lookup is about, whatever the compute takes on a
        busy machine."""
        def read() -> tuple[float, float]:
            m = inst.metrics()
            return (m.get("vllm:request_queue_time_seconds_count", 0.0),
                    m.get("vllm:request_queue_time_seconds_sum", 0.0))
        n0, s0 = read()
        out = fn()
        t0 = time.monotonic()
        while True:                       # recorded as the answer goes out: may lag it
            n1, s1 = read()
            if n1 >= n0 + 1:
                assert n1 == n0 + 1, (n0, n1)
                return out, s1 - s0
            assert time.monotonic() - t0 < 10.0, "no queue time recorded for the request"
            time.sleep(0.1)

    def publish(self, messages: list[dict]) -> tuple[list[int], set]:
        """A serves the chat (one token): its prompt's ids and the tier keys it wrote (its
        whole vLLM blocks: ``expected_hit``)."""
        before = self.tier_keys()
        ids = self.A.tokenize(messages)
        r = self.A.chat(messages, max_tokens=1)
        assert cached_tokens(r) == 0, r["usage"]             # new to A
        return ids, self.wait_written(before, expected_hit(len(ids), 1) // SB)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hosts")
    model = _model_dir()
    with Lab(["a", "b", "r"]) as lab:
        c = lab.cluster(["a", "b", "r"], replicas=["b", "r", "a"])
        kv = connector_config(SEG, size_gib=0.25, tier=c.url, tier_wait=TIER_WAIT,
                              tier_timeout=TIER_TIMEOUT)
        A = B = None
        try:
            A = ServeInstance(sys.executable, model, tmp / "A.log", core=0, kv=kv,
                              prefix=tuple(lab.prefix("a")),
                              via=functools.partial(lab.call, "a"))
            B = ServeInstance(sys.executable, model, tmp / "B.log", core=1, kv=kv,
                              prefix=tuple(lab.prefix("b")),
                              via=functools.partial(lab.call, "b"))
            A.wait_ready()
            B.wait_ready()
            h = Hosts(lab, c, A, B, model, tmp)
            yield h
            print(f"\ntwo hosts: {json.dumps(h.figures, indent=1)}")
        finally:
            for x in (A, B):
                if x is not None:
                    x.stop()


def test_a_system_prompt_served_on_a_is_a_hit_on_b_over_the_network(hosts):
    import torch

    h = hosts
    c1 = _chat("You are a careful lawyer. Here is the licence:", gpl_text(0, 4400),
               "Summarize the licence in one sentence.")
    c2 = c1[:1] + [{"role": "user", "content": "Who may change the licence?"}]
    t1, _ = h.publish(c1)
    t2 = h.B.tokenize(c2)
    b2 = h.B.chat(c2, max_tokens=12, **LOGPROBS)
    r2 = h.B.chat(c2, max_tokens=12, cache_salt="reference", **LOGPROBS)
    common, want = common_prefix(t1, t2), expected_hit(len(t1), 1)
    assert common >= want >= 896, (common, want)
    # B's own segment was empty: all A saved came over the network
    assert cached_tokens(b2) >= want, (want, b2["usage"])
    assert cached_tokens(r2) == 0, r2["usage"]
    rep = assert_same_greedy(b2, r2, BF16_LOGPROB_TOL, what="B (tier hit) vs B alone")
    st = h.b_stats()
    assert st["tier_hits"] >= want // SB and st["tier_errors"] == 0, st
    errs = check_kv(h.model, t2, h.b_stored(t2), torch.bfloat16, 0.05)
    assert errs[0] < 0.01           # layer 0: the same projections, rounded to bf16
    h.figures["first"] = {"common": common, "cached": cached_tokens(b2), "greedy": rep,
                          "hit_s": b2["seconds"], "recompute_s": r2["seconds"]}


@pytest.mark.parametrize("delay_ms", [0.2, 1.0, 5.0])
def test_with_latency_on_the_link_a_hit_still_pays(hosts, delay_ms):
    h = hosts
    h.lab.delay("b", delay_ms / 1e3)
    try:
        chat = _chat(f"Notes of {delay_ms} ms:", gpl_text(5000, 7600), "What is this about?")
        ids, _ = h.publish(chat)
        hit = h.B.chat(chat, max_tokens=1)
        if h.recompute is None:     # the same prompt computed by B (once: the delays'
            # prompts differ only in their first line)
            ref = h.B.chat(chat, max_tokens=1, cache_salt=f"reference-{delay_ms}")
            assert cached_tokens(ref) == 0
            h.recompute = ref["seconds"]
    finally:
        h.lab.undelay("b")
    want = expected_hit(len(ids), 1)
    assert cached_tokens(hit) >= want, (want, hit["usage"])
    # the first token (one token asked): with the prefix from the tier, and computed
    h.figures[f"delay {delay_ms} ms"] = {"prompt": len(ids), "cached": cached_tokens(hit),
                                        "hit_s": round(hit["seconds"], 3),
                                        "recompute_s": round(h.recompute, 3)}
    assert hit["seconds"] < h.recompute, h.figures


def _new_chats(tag: str, n: int, chars: int = 600) -> list[list[dict]]:
    return [_chat(f"{tag} #{i}:", gpl_text(8000 + 1000 * i, 8000 + 1000 * i + chars),
                  "Say one thing about it.") for i in range(n)]


def _serve_all(inst: ServeInstance, chats: list, out: list,
               h: Optional[Hosts] = None) -> None:
    """Sends the chats one after the other: ("ok", completion tokens, seconds, seconds
    queued or None) each, or ("failed", why, 0.0, None).  With ``h`` (no other request to
    ``inst`` meanwhile), each one's queue time is read from the engine's metrics."""
    for ch in chats:
        try:
            if h is None:
                r, q = inst.chat(ch, max_tokens=8), None
            else:
                r, q = h.queued(inst, functools.partial(inst.chat, ch, max_tokens=8))
            out.append(("ok", r["usage"]["completion_tokens"], r["seconds"], q))
        except Exception as e:            # the test fails on it, below
            out.append(("failed", repr(e), 0.0, None))


def _hit_resumes(h: Hosts, tag: str) -> dict:
    """A publishes a new prompt; B's first request for it loads it from the tier."""
    chat = _chat(f"{tag}, after:", gpl_text(12000, 13700), "And then?")
    ids, _ = h.publish(chat)
    before = h.b_stats()
    r = h.B.chat(chat, max_tokens=1)
    after = h.b_stats()
    want = expected_hit(len(ids), 1)
    assert cached_tokens(r) >= want, (tag, want, r["usage"], before, after)
    assert after["tier_hits"] - before["tier_hits"] >= want // SB, (before, after)
    return {"cached": cached_tokens(r), "of": len(ids), "seconds": round(r["seconds"], 3)}


def test_a_master_killed_while_both_hosts_serve(hosts):
    h = hosts
    got_a: list = []
    got_b: list = []
    ts = [threading.Thread(target=_serve_all, args=(h.A, _new_chats("A", 3), got_a)),
          threading.Thread(target=_serve_all, args=(h.B, _new_chats("B", 3), got_b))]
    for t in ts:
        t.start()
    time.sleep(1.0)
    h.lab.kill_node(h.c, 0)                   # master 0, on host a
    for t in ts:
        t.join()
    assert [g[0] for g in got_a + got_b] == ["ok"] * 6, (got_a, got_b)
    h.lab.wait_failover(h.c, 0)
    h.figures["failover"] = _hit_resumes(h, "After the failover")


def test_a_host_cut_off_the_network_serves_on_and_hits_again_once_healed(hosts):
    h = hosts
    ref = h.B.chat(_new_chats("Alone", 1)[0], max_tokens=8)   # computed, network up
    h.lab.partition("b")
    try:
        chats = _new_chats("Cut off", 2)
        got: list = []
        _serve_all(h.B, chats, got, h)
    finally:
        h.lab.heal("b")
    assert [g[0] for g in got] == ["ok", "ok"], got
    # each waited at most tier_wait for its lookup (then computed): its time in vLLM's
    # queue, not its wall clock, which a busy machine stretches however the cache does
    for g in got:
        assert g[3] < TIER_WAIT + QUEUE_SLACK, got
    time.sleep(BACKOFF_MAX + 1.0)             # B's breakers try the tier again
    h.figures["partition"] = {"requests_s": [round(g[2], 3) for g in got],
                              "queued_s": [round(g[3], 3) for g in got],
                              "ref_s": round(ref["seconds"], 3),
                              "after": _hit_resumes(h, "After the partition")}


def test_a_slow_link_costs_a_request_its_tier_wait_not_the_engine(hosts):
    h = hosts
    chat = _chat("Slow:", gpl_text(15000, 16700), "What now?")
    ids, _ = h.publish(chat)
    ref = h.B.chat(chat, max_tokens=1, cache_salt="reference-slow")    # computed
    h.lab.delay("b", 2.0)
    try:
        r, queued = h.queued(h.B, lambda: h.B.chat(chat, max_tokens=1))
    finally:
        h.lab.undelay("b")
    # its lookup (round trips of 4 s against a 0.5 s socket bound) is given up on after
    # tier_wait: the request computes, it does not wait for the network
    assert queued < TIER_WAIT + QUEUE_SLACK, (queued, r["seconds"], ref["seconds"])
    assert cached_tokens(r) == 0, r["usage"]
    time.sleep(BACKOFF_MAX + 1.0)
    h.figures["slow"] = {"request_s": round(r["seconds"], 3), "cached": cached_tokens(r),
                         "queued_s": round(queued, 3), "ref_s": round(ref["seconds"], 3),
                         "after": _hit_resumes(h, "After the slow link")}


def _block_of(values: dict, ids: list[int], i: int) -> bytes:
    """The key whose value holds block ``i`` of ``ids`` (its token ids, at offset 64)."""
    want = np.asarray(ids[i * SB:(i + 1) * SB], np.int32)
    keys = [k for k, v in values.items()
            if np.array_equal(np.frombuffer(v, np.int32, SB, 64), want)]
    assert len(keys) == 1, (i, len(keys))
    return keys[0]


def test_garbage_and_foreign_values_in_redis_are_never_loaded(hosts):
    import torch

    from shmkv._checksum import tier_checksum

    h = hosts
    out = {}
    for kind, bad in (("garbage", 20), ("foreign", 12)):
        chat = _chat(f"{kind.title()} ahead:", gpl_text(20000, 22600), "Summarize it.")
        ids, keys = h.publish(chat)
        vals = h.values(keys)
        key = _block_of(vals, ids, bad)
        v = bytearray(vals[key])
        if kind == "garbage":
            v[64 + 4 * SB + 1000] ^= 0xFF           # one byte of K: the checksum fails
        else:
            # a whole, sealed value of another layout (another fingerprint), same size
            v[16:32] = bytes(16)
            v[56:64] = struct.pack("<Q", tier_checksum(
                memoryview(v)[64:], tier_checksum(memoryview(v)[:56])))
        h.overwrite(key, bytes(v))
        before = h.b_stats()
        r = h.B.chat(chat, max_tokens=8, **LOGPROBS)
        after = h.b_stats()
        # the blocks before the bad one are loaded, the bad one and the rest computed
        assert cached_tokens(r) == bad * SB, (kind, r["usage"])
        assert after["tier_misses"] > before["tier_misses"], (before, after)
        # what B holds now (loaded, then computed) is the model's K/V
        check_kv(h.model, ids, h.b_stored(ids), torch.bfloat16, 0.05, min_tokens=512)
        if kind == "foreign":       # and its answer B's own (one reference: a prefill)
            ref = h.B.chat(chat, max_tokens=8, cache_salt="reference-bad", **LOGPROBS)
            assert_same_greedy(r, ref, BF16_LOGPROB_TOL, what=f"{kind}: B vs B alone")
        out[kind] = {"cached": cached_tokens(r), "of": len(ids)}
    h.figures["bad values"] = out
