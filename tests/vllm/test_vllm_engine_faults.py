"""Real engines stopped in the middle of a forward, and engines that preempt while the
connector's saves and loads are in flight.

Two engines of a seeded tiny Llama (float32; chunked prefill of one vLLM block per step,
so a long prompt takes several steps and each step publishes its block; a KV space of
12 vLLM blocks; vLLM's own prefix cache emptied after each batch, so what a request finds
it loads from the segment), one after the other on one segment:

* S, ``vllm serve`` with tensor parallel 2 and without async scheduling, and R, an offline
  engine of one rank with it (vLLM's default), each first run batches whose four requests
  of 300 tokens grow by 250 (20 blocks of 12): vLLM preempts and recomputes while two
  requests load their prompts from the segment and two save theirs.  The connector
  answers ``requires_kv_delivery`` with False (a best-effort cache); the engine must
  neither hang nor lose an answer: each ends, preempted (vLLM's own counter), answers as
  the same batch under another ``cache_salt`` (nothing to load), and every block the
  segment serves for those requests equals transformers' own DynamicCache.
* vLLM calls the connector's ``wait_for_save`` from the ``finally:`` of its step, so also
  when the forward raised.  S is then stopped by SIGTERM to its process group in the
  middle of a prompt's third prefill step: a hook before layer 1's attention (every rank,
  only for that prompt) says where it is and sleeps, so the signal lands with layer 0 of
  that step done and layer 1 not; vLLM's workers turn SIGTERM into SystemExit there.  R
  then serves that prompt (loading what S published) and the same prompt under another
  ``cache_salt``: the answers must be equal.  R's last prompt meets an error raised in
  layer 1 on its third prefill step: the engine dies.  After each, the segment serves
  exactly that prompt's first two vLLM blocks (the steps that completed), equal to
  transformers' K/V at every layer.  Before the fix (the ``finally`` published the
  stopped step, layer 1 stale) it served three.

And the locks: S's main batch runs while a SIGSTOPped process holds the pending table's
lock (every marks operation answers "no marks" within its bound; S serves on); then two
prompts while one holds the segment's pool lock (each of S's processes waits 0.1 s once,
then goes on without the cache; the holder killed, the next request loads), and two while
one is stopped on its process cache's fast path (nothing waits for it); and R starts
on a garbage ``NAME.pending`` (its marks turn off with one warning; the cache itself
serves on).

The faults are put into the real forward on every rank (fault_hook.py: a worker extension
and vLLM's ``/collective_rpc`` for ``vllm serve``, ``LLM.apply_model`` offline)."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from configs_helpers import run_engine, tiny_llama, unlink
from serve_helpers import ServeInstance, connector_config, post_json
from support import unique_name
from support.stopped_helpers import (
    FLOCK_HOLDER,
    POOL_LOCK_HOLDER,
    SEGMENT_HOLDER,
    end,
    start_stopped,
)
from vllm_helpers import needs_vllm

from shmkv.pending import pending_path

pytestmark = needs_vllm

VB, N, GEN = 128, 300, 250
ENGINE = {"dtype": "float32", "enable_chunked_prefill": True, "max_num_batched_tokens": VB,
          "num_gpu_blocks_override": 12}
HOOK_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
HERE = os.path.dirname(os.path.abspath(__file__))
PENDING_BYTES = 64 + 4096 * 32          # a pending table's size (shmkv.pending)


def _ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 48900, n).tolist()


def _batches(xs: list[list[int]]) -> list:
    return [[{"prompt_ids": x, "max_tokens": 4} for x in xs[:2]],         # saved first
            [{"prompt_ids": x, "max_tokens": GEN} for x in xs],           # 2 load, 2 save
            [{"prompt_ids": x, "max_tokens": GEN, "cache_salt": "ref"} for x in xs]]


def _serve_batch(url: str, reqs: list[dict]) -> list[dict]:
    """The requests of a batch sent at once (a thread each), as configs_worker.py's
    results: generated token ids and cached prompt tokens, in order."""
    out: list = [None] * len(reqs)

    def one(i: int) -> None:
        r = reqs[i]
        body = {"model": "smol", "prompt": r["prompt_ids"], "max_tokens": r["max_tokens"],
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        if r.get("cache_salt"):
            body["cache_salt"] = r["cache_salt"]
        resp = post_json(url + "/v1/completions", body)
        out[i] = {"token_ids": resp["choices"][0]["token_ids"],
                  "num_cached_tokens": (resp["usage"].get("prompt_tokens_details") or {})
                  .get("cached_tokens", 0)}

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(o is not None for o in out), "a request of the batch failed"
    return out


def _serve_s(tmp, path: str, seg: str, xs: list[list[int]], p: list[int],
             marker: str) -> dict:
    """S: `vllm serve` with tensor parallel 2, no async scheduling: the batches, then `p`
    stopped by SIGTERM to the instance's process group mid-forward (the hook's marker)."""
    stats = tmp / "S.stats.json"
    s = ServeInstance(sys.executable, path, tmp / "S.log", dtype="float32",
                      kv=connector_config(seg, num_blocks=1024),
                      env={"PYTHONPATH": os.pathsep.join(
                               [HERE] + [x for x in [os.environ.get("PYTHONPATH")] if x]),
                           "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
                           "SHMKV_VLLM_STATS": str(stats)},
                      extra_args=("--tensor-parallel-size", "2", "--max-model-len", "1024",
                                  "--max-num-seqs", "4", "--no-async-scheduling",
                                  "--enable-chunked-prefill", "--max-num-batched-tokens",
                                  str(VB), "--num-gpu-blocks-override", "12",
                                  "--worker-extension-cls", "fault_hook.FaultHook"))
    results: list[dict] = []
    try:
        s.wait_ready()
        spec = {"layer": 1, "mode": "sleep", "at_call": 3, "seconds": 300, "marker": marker,
                "flag": str(tmp / "S-flag")}
        post_json(s.url + "/collective_rpc",
                  {"method": "install_fault", "args": [json.dumps(spec)]})
        for i, batch in enumerate(_batches(xs)):
            # the main batch runs while a stopped process holds the pending table's lock
            holder = start_stopped(FLOCK_HOLDER, pending_path(seg)) if i == 1 else None
            try:
                got = _serve_batch(s.url, batch)
            finally:
                if holder is not None:
                    end(holder)
            post_json(s.url + "/reset_prefix_cache", {})   # later hits: from the segment
            m = s.metrics()
            engine = {"vllm:num_preemptions": m.get("vllm:num_preemptions_total", 0.0),
                      "pending_lock_timeouts":
                          m.get("vllm:shmkv_pending_lock_timeouts_total", 0.0)}
            results += [dict(r, connector=_read(stats), engine=engine) for r in got]
        pool_lock = _stopped_pool_lock_batch(s, seg, xs, stats)
        cache_lock = _stopped_cache_lock_batch(s, seg, xs)
        open(spec["flag"], "w").close()
        # p's request, on a connection of its own: after the SIGTERM, vLLM's API server
        # waits for open connections to close, so the test closes it
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=600)

        def last() -> None:
            try:
                conn.request("POST", "/v1/completions", body=json.dumps({
                    "model": "smol", "prompt": p, "max_tokens": 4, "temperature": 0}),
                    headers={"Content-Type": "application/json"})
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                pass                                    # the instance was stopped
        t = threading.Thread(target=last, daemon=True)
        t.start()
        t0 = time.monotonic()
        while not os.path.exists(marker) and s.proc.poll() is None \
                and time.monotonic() - t0 < 600:
            time.sleep(0.05)
        if os.path.exists(marker):
            time.sleep(0.2)                             # every rank is in the hook's sleep
            os.killpg(s.proc.pid, signal.SIGTERM)
            time.sleep(2.0)                             # the ranks' SystemExit, the shutdown
        try:
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            rc = s.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            rc = -999
        return {"rc": rc, "results": results, "log": s.tail(200_000), "stats": _read(stats),
                "pool_lock": pool_lock, "cache_lock": cache_lock}
    finally:
        s.stop()


def _stopped_pool_lock_batch(s: ServeInstance, seg: str, xs: list[list[int]], stats) -> dict:
    """S serves two prompts of the segment while a stopped process holds its pool lock,
    then one of them again once the holder is dead (killed where it stopped)."""
    reqs = [{"prompt_ids": x, "max_tokens": 16, "cache_salt": "ref"} for x in xs[:2]]
    before = _read(stats)
    holder = start_stopped(POOL_LOCK_HOLDER, seg)
    try:
        t0 = time.monotonic()
        during = _serve_batch(s.url, reqs)
        took = time.monotonic() - t0
        m = s.metrics()
        conn = _read(stats)
    finally:
        end(holder)
    post_json(s.url + "/reset_prefix_cache", {})
    return {"during": during, "seconds": took, "after": _serve_batch(s.url, reqs[:1]),
            "lock_timeouts": m.get("vllm:shmkv_lock_timeouts_total", 0.0),
            "save_seconds": conn.get("save_seconds", 0.0) - before.get("save_seconds", 0.0),
            "load_seconds": conn.get("load_seconds", 0.0) - before.get("load_seconds", 0.0)}


def _stopped_cache_lock_batch(s: ServeInstance, seg: str, xs: list[list[int]]) -> dict:
    """S serves two prompts of the segment while a process is stopped on its own process
    cache's fast path (that cache's lock held): nothing the connector calls waits for it."""
    reqs = [{"prompt_ids": x, "max_tokens": 16, "cache_salt": "ref"} for x in xs[2:4]]
    before = s.metrics().get("vllm:shmkv_lock_timeouts_total", 0.0)
    holder = start_stopped(SEGMENT_HOLDER, seg, "grow_before_tail", "0", "1")
    try:
        during = _serve_batch(s.url, reqs)
        m = s.metrics()
    finally:
        end(holder)
    post_json(s.url + "/reset_prefix_cache", {})
    return {"during": during,
            "lock_timeouts": m.get("vllm:shmkv_lock_timeouts_total", 0.0) - before}


def _served(kv, path: str, ids: list[int]) -> tuple[list[int], int, np.ndarray, np.ndarray]:
    """(ids, how many of them the segment serves, their K, V)."""
    from shmkv.integrations.vllm import request_salt

    sid = kv.create_sequence(tokens=ids + [0], salt=request_salt(path))
    try:
        return (ids, kv.seq_len(sid), *kv.gather(sid))
    finally:
        kv.free(sid)


def _after(seg: str, path: str, stopped: list[int], xs: list[list[int]],
           results: list[dict]) -> dict:
    """What the segment serves after an engine: the stopped prompt, and each preempted
    request's prompt and answer (attach runs recovery first)."""
    import shmkv

    kv = shmkv.KVCache.attach(seg)
    try:
        return {"stopped": _served(kv, path, stopped),
                "preempted": [_served(kv, path, x + r["token_ids"])
                              for x, r in zip(xs, results[2:6])],
                "check": kv.check(), "stats": kv.stats()}
    finally:
        kv.close()


def _read(p) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-engine-faults")
    path = tiny_llama(tmp / "tiny-llama")
    p, q = _ids(41, 700), _ids(42, 700)
    xs = {"S": [_ids(60 + i, N) for i in range(4)], "R": [_ids(70 + i, N) for i in range(4)]}
    seg = unique_name("vllm-engine-faults")
    common = {"model": path, "extra": {"segment": seg, "num_blocks": 1024},
              "max_model_len": 1024, "max_num_seqs": 4, "stats": "engine",
              "reset_prefix_cache": True}
    marker = str(tmp / "in-layer-1")
    out = {"path": path, "p": p, "q": q, "xs": xs, "marker": marker, "seg": seg}
    try:
        out["S"] = _serve_s(tmp, path, seg, xs["S"], p, marker)
        out["S"]["after"] = _after(seg, path, p, xs["S"], out["S"]["results"])
        # R meets a garbage NAME.pending (same size as a table, no table's magic)
        os.unlink(pending_path(seg))
        with open(os.open(pending_path(seg), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600),
                  "wb") as f:
            f.write(b"not a pending table " * (PENDING_BYTES // 20 + 1))
            f.truncate(PENDING_BYTES)
        rc, res, log = run_engine(
            tmp, "R", {**common, "engine": ENGINE,
                       "hook": {"layer": 1, "mode": "raise", "at_call": 3,
                                "flag": str(tmp / "R-flag")},
                       "requests": _batches(xs["R"]) + [
                           {"prompt_ids": p, "max_tokens": 8},
                           {"prompt_ids": p, "max_tokens": 8, "cache_salt": "ref"},
                           {"prompt_ids": q, "max_tokens": 4, "flag": True}]},
            env_extra=HOOK_ENV)
        out["R"] = {"rc": rc, "results": res["results"], "log": log,
                    "after": _after(seg, path, q, xs["R"], res["results"])}
        yield out
    finally:
        unlink(seg)


def _model_kv(path: str, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    with torch.no_grad():
        pkv = model(torch.tensor([ids]), use_cache=True).past_key_values
    return [(pkv.layers[i].keys[0].permute(1, 0, 2).numpy(),
             pkv.layers[i].values[0].permute(1, 0, 2).numpy()) for i in range(2)]


def _assert_model_kv(path: str, served) -> None:
    ids, n, k, v = served
    for layer, (hk, hv) in enumerate(_model_kv(path, ids[:n])):
        for b in range(-(-n // VB)):                 # block by block: which one is wrong
            s = slice(b * VB, (b + 1) * VB)
            np.testing.assert_allclose(k[layer][s], hk[s], atol=1e-4, rtol=1e-4,
                                       err_msg=f"K, layer {layer}, vLLM block {b}")
            np.testing.assert_allclose(v[layer][s], hv[s], atol=1e-4, rtol=1e-4,
                                       err_msg=f"V, layer {layer}, vLLM block {b}")


# ------------------------------------------------------------------ stopped mid-forward
def test_vllm_serve_sigterm_mid_forward_with_tensor_parallel_publishes_nothing_of_it(
        engines):
    S = engines["S"]
    assert os.path.exists(engines["marker"]), "S never reached the third step: " \
        + S["log"][-3000:]
    assert len(S["results"]) == 10 and S["rc"] != -999, S["log"][-3000:]
    assert S["stats"].get("unfinished_saves", 0) >= 1, S["log"][-3000:]
    assert "forward did not complete (SystemExit)" in S["log"], S["log"][-3000:]
    assert S["after"]["stopped"][1] == 2 * VB, "exactly the two steps that completed"
    _assert_model_kv(engines["path"], S["after"]["stopped"])


def test_a_second_instance_loads_what_the_stopped_one_published_and_answers_as_alone(
        engines):
    loaded, ref = engines["R"]["results"][10:12]
    assert loaded["num_cached_tokens"] == 2 * VB
    assert ref["num_cached_tokens"] == 0
    assert loaded["token_ids"] == ref["token_ids"]


def test_an_error_in_a_layer_publishes_nothing_of_that_step(engines):
    R = engines["R"]
    assert R["rc"] != 0 and len(R["results"]) == 12, R["log"][-3000:]
    assert "shmkv test: an error in layer 1" in R["log"]
    assert "forward did not complete (RuntimeError)" in R["log"], R["log"][-3000:]
    assert R["after"]["stopped"][1] == 2 * VB, "exactly the two steps that completed"
    _assert_model_kv(engines["path"], R["after"]["stopped"])


# ------------------------------------------------------------------ preempting
@pytest.mark.parametrize("tag", ["S", "R"])
def test_an_engine_preempting_while_it_loads_and_saves_answers_as_alone(engines, tag):
    """S: tensor parallel 2, no async scheduling; R: one rank, async scheduling."""
    res = engines[tag]["results"]
    assert res[9]["engine"].get("vllm:num_preemptions", 0) > 0, \
        "the test's KV space did not make the engine preempt"
    main, ref = res[2:6], res[6:10]
    for i in range(2):                          # loaded what the first batch saved
        assert main[i]["num_cached_tokens"] >= 2 * VB, (i, main[i]["num_cached_tokens"])
    assert all(r["num_cached_tokens"] == 0 for r in ref)
    assert main[-1]["connector"]["loaded_tokens"] >= 2 * 2 * VB
    assert [r["token_ids"] for r in main] == [r["token_ids"] for r in ref]
    assert all(len(r["token_ids"]) == GEN for r in main)


@pytest.mark.parametrize("tag", ["S", "R"])
def test_what_a_preempting_engine_published_is_the_models_kv(engines, tag):
    after = engines[tag]["after"]
    assert after["check"] == []
    assert after["stats"]["num_sequences"] == 0
    for served in after["preempted"]:
        assert served[1] >= 2 * VB              # every prompt's whole blocks at least
        _assert_model_kv(engines["path"], served)


# ------------------------------------------------------------------ the pending table
def test_a_stopped_holder_of_the_pending_lock_leaves_the_engine_serving(engines):
    """S's main batch ran while a SIGSTOPped process held the pending table's lock: every
    marks operation answered "no marks" within its bound (counted), and S served the
    batch with the answers it gives alone (the preemption test compares them)."""
    main = engines["S"]["results"][2:6]
    assert main[0]["engine"]["pending_lock_timeouts"] > 0
    assert all(len(r["token_ids"]) == GEN for r in main)


# ------------------------------------------------------------------ the pool lock
def test_a_stopped_holder_of_the_pool_lock_costs_steps_a_bound_not_a_freeze(engines):
    """S served two prompts of the segment while a SIGSTOPped process held the segment's
    pool lock: each of S's processes (the scheduler, both ranks) waited lock_timeout
    (0.1 s) once, then went on without the cache for a second at a time -- no load, the
    saves dropped, counted (vllm:shmkv_lock_timeouts_total), one warning -- with the
    answers it gives alone; the holder dead, the next request loads again.  Before the
    step's bound each lookup and each save waited the segment's 10 s: ~70 s for this
    batch (the bounds below are hang detectors, far from both)."""
    S = engines["S"]
    pl = S["pool_lock"]
    assert pl["lock_timeouts"] > 0, pl
    assert pl["seconds"] < 45, f"the batch took {pl['seconds']:.1f} s behind the holder"
    assert pl["save_seconds"] + pl["load_seconds"] < 5, pl
    ref = S["results"][6:8]                             # the same prompts, computed
    assert [r["token_ids"] for r in pl["during"]] == [r["token_ids"][:16] for r in ref]
    assert all(r["num_cached_tokens"] == 0 for r in pl["during"]), pl["during"]
    assert pl["after"][0]["num_cached_tokens"] >= 2 * VB, pl["after"]
    warned = [ln for ln in S["log"].splitlines() if "its pool lock was held past" in ln]
    assert 1 <= len(warned) <= 3, warned                # once per process, not per call


def test_a_stopped_holder_of_a_process_cache_costs_the_engine_nothing(engines):
    """S served two prompts of the segment while a SIGSTOPped process held its own process
    cache's lock (stopped on its fast path): the lookups, loads and saves take no other
    process's cache lock, so S loaded both prompts, no wait ran out, and the answers are
    those S gives alone."""
    S = engines["S"]
    cl = S["cache_lock"]
    assert cl["lock_timeouts"] == 0, cl
    assert all(r["num_cached_tokens"] >= 2 * VB for r in cl["during"]), cl["during"]
    ref = S["results"][8:10]
    assert [r["token_ids"] for r in cl["during"]] == [r["token_ids"][:16] for r in ref]


def test_a_garbage_pending_table_turns_only_the_marks_off_and_the_engine_serves(engines):
    R = engines["R"]
    off = [ln for ln in R["log"].splitlines()
           if "pending marks are OFF for this engine" in ln]
    assert len(off) == 1, off
    assert pending_path(engines["seg"]) in off[0] and "magic" in off[0], off[0]
    assert "fix:" in off[0]
    loaded = R["results"][10]                   # the cache itself stays on: it loads
    assert loaded["num_cached_tokens"] == 2 * VB
