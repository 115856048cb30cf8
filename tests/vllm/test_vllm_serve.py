"""A fleet of real ``vllm serve`` instances on one segment, over HTTP, in vLLM's default dtype
on CPU (bfloat16: the float32 checkpoint is downcast) and in float16.

bfloat16 (three instances at once, each pinned): A and B share a segment; R is the reference,
configured with the connector but with ml_dtypes hidden, so its connector turns itself off
with one warning and R serves as vLLM alone.  In order:

1. a chat whose long system prompt A served is a hit on B (``cached_tokens``), and B's
   greedy answer is R's (R ran the same two chats: its own prefix cache, no segment) up to
   bfloat16's numerics.  Not the text: B computes its suffix after the prefix it loaded in
   shmkv blocks (SB tokens), R after its own cached vLLM blocks (VB tokens), so the two run
   different splits of the same computation on different kernels (``isa amx`` on an Intel
   Xeon with AMX), and a near-tie between two tokens can go either way in bf16.  So their
   per-token logprobs are compared (``assert_same_greedy``): within a tolerance while the
   tokens are equal, up to the first divergence, which must be a near-tie on both sides;
   K/V loaded wrong move the logprobs far more, from the first token;
2. the chat's next turn, sent to A, hits B's previous answer;
3. a burst: the same new prefix sent to A and B at once is computed by one of them; the
   other waits for it (pending marks) and loads it;
4. /metrics of each instance carries the connector's figures; vLLM's KV event stream
   carries the blocks saved and loaded with the shared tier's medium, decoded with vLLM's
   own classes;
5. A is SIGKILLed under load: B serves on, the segment is consistent once B's connector
   has recovered A's leftovers, and A restarted hits what A published before it died.

float16: two instances share, plus a reference without the connector.  In both dtypes the
stored K/V are checked against transformers' own computation of the prompt.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from serve_helpers import (
    BF16_LOGPROB_TOL,
    LOGPROBS,
    ServeInstance,
    assert_same_greedy,
    cached_tokens,
    common_prefix,
    connector_config,
    free_port,
    gpl_text,
    mapped_vllm_shm,
    stream_completion,
)
from serve_helpers import check_kv as _check_kv
from serve_helpers import stored_kv as _stored
from support import unique_name
from vllm_helpers import SB, VB, _model_dir

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False

def _sys(text: str) -> dict:
    return {"role": "system", "content": text}


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


class _Events:
    """Every frame published on a vLLM instance's KV event endpoint, from now on."""

    def __init__(self, endpoint: str):
        import zmq

        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVTIMEO, 200)
        self._sub.bind(endpoint)        # vLLM connects to a tcp://HOST:PORT endpoint
        self.frames: list[list[bytes]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                self.frames.append(self._sub.recv_multipart())
            except zmq.Again:
                continue

    def close(self) -> None:
        self._stop.set()
        self._t.join()
        self._sub.close(0)
        self._ctx.term()

    def stored(self) -> list:
        """vLLM's own decoding of every frame: its BlockStored events."""
        import msgspec
        from vllm.distributed.kv_events import BlockStored, KVEventBatch

        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        out = []
        for fr in list(self.frames):
            batch = dec.decode(fr[-1])
            out += [e for e in batch.events if isinstance(e, BlockStored)]
        return out


def _hide_ml_dtypes(tmp) -> str:
    d = tmp / "no_ml_dtypes"
    (d / "ml_dtypes").mkdir(parents=True)
    (d / "ml_dtypes" / "__init__.py").write_text(
        'raise ImportError("ml_dtypes is hidden by the test (a venv without it)")\n')
    return str(d)


def _unlink(seg: str) -> None:
    import shmkv

    try:
        shmkv.KVCache.attach(seg).unlink()
    except Exception:
        pass


def _stop_all(*insts) -> None:
    for x in insts:
        if x is not None:
            x.stop()


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    tmp = tmp_path_factory.mktemp("serve16b")
    model = _model_dir()
    seg, seg_r = unique_name("serve"), unique_name("serve-off")
    py = sys.executable
    ev_a, ev_b = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    # pending_wait, pending_stall: the burst's new prefix (~900 tokens) is one prefill step
    # of ~10 s on one core of an AVX2-only host in bfloat16 (no native bf16 there), nothing
    # published meanwhile: the instance that waits must outwait the one computing, on every
    # machine kind (the stall bound exceeds the longest step, as the docs say to set it)
    kv = connector_config(seg, size_gib=0.5, pending_wait=120, pending_stall=120)
    A = B = R = A2 = None
    subs: list[_Events] = []
    out: dict = {"model": model, "seg": seg, "seg_r": seg_r}
    try:
        subs = [_Events(ev_a), _Events(ev_b)]     # bound before the engines connect
        A = ServeInstance(py, model, tmp / "A.log", core=0, kv=kv, events_endpoint=ev_a)
        B = ServeInstance(py, model, tmp / "B.log", core=1, kv=kv, events_endpoint=ev_b)
        R = ServeInstance(py, model, tmp / "R.log", core=1, kv=connector_config(seg_r),
                          env={"PYTHONPATH": _hide_ml_dtypes(tmp)})
        for x in (A, B, R):
            x.wait_ready()
        time.sleep(1.0)                         # the publishers' connections are up
        S = _sys("You are a careful lawyer. Here is the licence:\n" + gpl_text(0, 4400))
        c1 = [S, _user("Summarize the licence in one sentence.")]
        c2 = [S, _user("Who may change the licence?")]
        out["t1"], out["t2"] = A.tokenize(c1), A.tokenize(c2)
        # 1. A serves S first; B's chat on S hits it; R answers both alone
        out["A1"] = A.chat(c1, max_tokens=24, **LOGPROBS)
        out["B2"] = B.chat(c2, max_tokens=24, **LOGPROBS)
        out["R1"] = R.chat(c1, max_tokens=24, **LOGPROBS)
        out["R2"] = R.chat(c2, max_tokens=24, **LOGPROBS)
        # 2. the next turn to the other instance
        c3 = c2 + [{"role": "assistant", "content": out["B2"]["choices"][0]["message"]
                    ["content"]}, _user("Say it again, shorter.")]
        out["t3"] = A.tokenize(c3)
        out["A3"] = A.chat(c3, max_tokens=16, **LOGPROBS)
        out["R3"] = R.chat(c3, max_tokens=16, **LOGPROBS)
        # 3. a burst: one new prefix on both at once
        burst = [_sys("Read this carefully:\n" + gpl_text(9000, 13000)), _user("What is it?")]
        out["tb"] = A.tokenize(burst)
        res: dict = {}
        ts = [threading.Thread(target=lambda n, x: res.__setitem__(n, x.chat(burst, 8)),
                               args=(n, x)) for n, x in (("A", A), ("B", B))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        out["burst"] = res
        time.sleep(2.0)                     # stats reach the front ends, events the subs
        out["mA"], out["mB"], out["mR"] = A.metrics(), B.metrics(), R.metrics()
        out["evA"], out["evB"] = subs[0].stored(), subs[1].stored()
        out["stored1"] = _stored(seg, model, out["t1"])
        out["log_R"] = R.tail(10**7)
        out["log_A"] = A.tail(10**7)
        R.stop()
        R = None
        # 5. A dies under load; B serves on
        long_q = [_sys("Tell stories.\n" + gpl_text(20000, 21000)), _user("A long story.")]
        err: list = []

        def load() -> None:
            try:
                A.chat(long_q, max_tokens=400, ignore_eos=True)
            except Exception as e:
                err.append(e)
        t = threading.Thread(target=load)
        t.start()
        time.sleep(3.0)
        A.kill()
        t.join()
        # what the killed engine mapped in /dev/shm outlives it; exactly that goes
        out["A_shm_seen"] = sorted(A.shm_seen)
        out["A_orphans"] = [p for p in A.shm_seen if os.path.exists(p)]
        A.cleanup()
        out["A_left"] = [p for p in A.shm_seen if os.path.exists(p)]
        out["killed_request_failed"] = bool(err)
        out["B_after"] = B.chat([_sys("After the crash:\n" + gpl_text(30000, 32000)),
                                 _user("Go on.")], max_tokens=8)
        time.sleep(4.0)                     # B's connector recovers within ~2 s
        import shmkv

        k = shmkv.KVCache.attach(seg)
        try:
            out["after_kill"] = {"check": k.check(), "stats": k.stats(),
                                 "seqs": len(k.sequences())}
        finally:
            k.close()
        cli = subprocess.run([sys.executable, "-m", "shmkv", "check", seg], cwd="/tmp",
                             capture_output=True, text=True, timeout=120)
        out["cli_check"] = (cli.returncode, cli.stdout + cli.stderr)
        out["log_B"] = B.tail(10**7)
        A2 = ServeInstance(py, model, tmp / "A2.log", core=0, kv=kv).wait_ready()
        out["A2_1"] = A2.chat(c1, max_tokens=24)
        _stop_all(A, B, A2)             # before the next module fixture starts its engines
        yield out
    finally:
        for s in subs:
            s.close()
        _stop_all(A, B, R, A2)
        _unlink(seg)
        _unlink(seg_r)


def test_b_hits_the_system_prompt_a_served_and_answers_as_vllm_alone(bf16):
    t1, t2 = bf16["t1"], bf16["t2"]
    common = common_prefix(t1, t2)
    assert common >= 896, common
    assert cached_tokens(bf16["A1"]) == 0                    # a fresh segment
    # B loads every whole shmkv block of the shared system prompt that A saved
    assert cached_tokens(bf16["B2"]) >= common // SB * SB - SB, (common, bf16["B2"]["usage"])
    assert cached_tokens(bf16["B2"]) >= common // VB * VB
    # the same answer as vLLM alone, up to bf16 numerics on a different prefix split
    for a, r in (("A1", "R1"), ("B2", "R2"), ("A3", "R3")):
        rep = assert_same_greedy(bf16[a], bf16[r], BF16_LOGPROB_TOL, what=f"{a} vs {r}")
        print(f"{a} vs {r}: {rep}")


def test_next_turn_on_the_other_instance_hits_the_previous_answer(bf16):
    t2, t3 = bf16["t2"], bf16["t3"]
    n2 = len(t2) + bf16["B2"]["usage"]["completion_tokens"]
    # B saved the whole vLLM blocks of its prompt and answer; A's own cache holds only S
    want = (n2 - 1) // VB * VB
    assert want > common_prefix(bf16["t1"], t3), "the answer's blocks must be more than S"
    assert cached_tokens(bf16["A3"]) >= want, (want, bf16["A3"]["usage"])


def test_a_burst_on_a_new_prefix_computes_it_once(bf16):
    a, b = bf16["burst"]["A"], bf16["burst"]["B"]
    n = len(bf16["tb"])
    hit = (n - 1) // VB * VB                 # what the computing instance saved in prefill
    loaded = sorted([cached_tokens(a), cached_tokens(b)])
    assert loaded[0] == 0, "one instance computes the new prefix"
    assert loaded[1] >= hit, (loaded, n)    # the other waited for it and loaded it
    waits = (bf16["mA"].get("vllm:shmkv_pending_waits_total", 0)
             + bf16["mB"].get("vllm:shmkv_pending_waits_total", 0))
    assert waits >= 1


def test_metrics_on_each_instance(bf16):
    mA, mB, mR = bf16["mA"], bf16["mB"], bf16["mR"]
    assert mA["vllm:shmkv_saved_tokens_total"] >= len(bf16["t1"]) // VB * VB
    assert mB["vllm:shmkv_loaded_tokens_total"] >= cached_tokens(bf16["B2"]) - VB
    assert mB["vllm:shmkv_loaded_blocks_total"] * SB == mB["vllm:shmkv_loaded_tokens_total"]
    assert mA["vllm:shmkv_lookups_total"] >= 3 and mB["vllm:shmkv_lookups_total"] >= 2
    assert mB["vllm:shmkv_load_seconds_count"] >= 1 and mA["vllm:shmkv_save_seconds_count"] >= 1
    # vLLM's own split of cached prompt tokens by tier: what the connector loaded came from
    # host memory (the connector's _cache_hit_source), none is "unspecified"
    def by(m: dict, source: str) -> float:
        return sum(v for k, v in m.items()
                   if k.startswith("vllm:prompt_tokens_cached_by_source_total{")
                   and f'source="{source}"' in k)
    for m in (mA, mB):
        assert by(m, "host") == m["vllm:external_prefix_cache_hits_total"], m
        assert by(m, "external_unspecified") == 0
    assert mB["vllm:external_prefix_cache_hits_total"] > 0
    for m in (mA, mB):
        assert m["vllm:shmkv_segment_blocks"] > 0
        held = m["vllm:shmkv_segment_used_blocks"] + m["vllm:shmkv_segment_cached_blocks"]
        assert 0 < held <= m["vllm:shmkv_segment_blocks"]
        assert m["vllm:shmkv_segment_usage_perc"] == pytest.approx(
            held / m["vllm:shmkv_segment_blocks"])
        assert m.get("vllm:shmkv_load_failures_total", 0) == 0
    # the front end labels them as vLLM's own (model_name, engine)
    assert any(k.startswith('vllm:shmkv_saved_tokens_total{') and 'model_name="smol"' in k
               for k in mA)
    # the reference's connector is off: it registers the metrics, and never counts
    assert mR.get("vllm:shmkv_loaded_tokens_total", 0) == 0
    assert mR.get("vllm:shmkv_saved_tokens_total", 0) == 0


def test_a_missing_optional_package_turns_the_connector_off_not_the_engine(bf16):
    log = bf16["log_R"]
    off = [ln for ln in log.splitlines() if "the connector is OFF" in ln and "WARNING" in ln]
    assert len(off) == 1, off
    assert "ml_dtypes" in off[0]
    assert not os.path.exists("/dev/shm/" + bf16["seg_r"])   # it never made its segment
    assert bf16["R1"]["choices"][0]["message"]["content"]    # and R served


def test_connector_logs_in_vllm_serves_log(bf16):
    assert "shmkv: scheduler on segment" in bf16["log_A"]
    assert "shmkv: worker on segment" in bf16["log_A"]


def test_events_announce_saved_and_loaded_blocks_on_vllms_stream(bf16):
    from shmkv.integrations.vllm.events import MEDIUM_SHARED

    for ev, tokens, what in ((bf16["evA"], bf16["t1"], "saved"),
                             (bf16["evB"], bf16["t2"], "loaded")):
        shared = [e for e in ev if e.medium == MEDIUM_SHARED]
        own = {h for e in ev if e.medium != MEDIUM_SHARED for h in e.block_hashes}
        assert shared, f"no {MEDIUM_SHARED} event for the blocks {what}"
        hashes = [h for e in shared for h in e.block_hashes]
        # vLLM's own hashes of the same blocks: the instance's own events carry them too
        assert set(hashes) <= own, what
        first = shared[0]
        assert first.block_size == VB and first.ownership == "shmkv:" + bf16["seg"]
        assert first.token_ids == tokens[:len(first.block_hashes) * VB]
        assert first.parent_block_hash is None


def test_a_killed_instance_leaves_a_consistent_segment_and_its_blocks_serve_on(bf16):
    assert bf16["killed_request_failed"]
    assert bf16["B_after"]["choices"][0]["message"]["content"]   # B served on
    after = bf16["after_kill"]
    assert after["check"] == []
    assert bf16["cli_check"][0] == 0, bf16["cli_check"][1]      # `shmkv check NAME`
    assert after["stats"]["reclaimed_sequences"] >= 1 or after["seqs"] == 0
    # B's connector recovered A's processes (its scheduler and worker were attached)
    lines = [ln for ln in bf16["log_B"].splitlines() if "shmkv: reclaimed" in ln]
    assert lines, "B's connector did not recover the dead instance"
    assert sum(int(ln.split("reclaimed ")[1].split()[0]) for ln in lines) >= 2, lines
    # the restarted A loads what the dead A published (its chat 1: S and the question)
    want = (len(bf16["t1"]) + bf16["A1"]["usage"]["completion_tokens"] - 1) // VB * VB
    want = min(want, (len(bf16["t1"]) - 1) // SB * SB)
    assert cached_tokens(bf16["A2_1"]) >= want > common_prefix(bf16["t1"], bf16["t2"]) - VB


def test_stored_kv_bf16_equals_transformers(bf16):
    import torch

    errs = _check_kv(bf16["model"], bf16["t1"], bf16["stored1"], torch.bfloat16, 0.05)
    assert errs[0] < 0.01           # layer 0: the same projections, rounded to bf16


@pytest.fixture(scope="module")
def fp16(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    tmp = tmp_path_factory.mktemp("serve16")
    model = _model_dir()
    seg = unique_name("serve16")
    py = sys.executable
    kv = connector_config(seg, size_gib=0.5)
    A = B = R = None
    out: dict = {"model": model, "seg": seg}
    try:
        A = ServeInstance(py, model, tmp / "A.log", core=0, kv=kv, dtype="float16")
        B = ServeInstance(py, model, tmp / "B.log", core=1, kv=kv, dtype="float16")
        R = ServeInstance(py, model, tmp / "R.log", core=0, dtype="float16")
        for x in (A, B, R):
            x.wait_ready()
        S = _sys("Read this:\n" + gpl_text(5000, 9400))
        c1, c2 = [S, _user("What does it say?")], [S, _user("Is it fair?")]
        out["t1"], out["t2"] = A.tokenize(c1), A.tokenize(c2)
        out["A1"], out["B2"] = A.chat(c1, max_tokens=24), B.chat(c2, max_tokens=24)
        out["R1"], out["R2"] = R.chat(c1, max_tokens=24), R.chat(c2, max_tokens=24)
        out["stored1"] = _stored(seg, model, out["t1"])
        _stop_all(A, B, R)
        yield out
    finally:
        _stop_all(A, B, R)
        _unlink(seg)


def test_fp16_instances_share_and_answer_as_vllm_alone(fp16):
    common = common_prefix(fp16["t1"], fp16["t2"])
    assert cached_tokens(fp16["B2"]) >= common // VB * VB >= 896
    for a, r in (("A1", "R1"), ("B2", "R2")):
        assert (fp16[a]["choices"][0]["message"]["content"]
                == fp16[r]["choices"][0]["message"]["content"]), a


def test_stored_kv_fp16_equals_transformers(fp16):
    import torch

    errs = _check_kv(fp16["model"], fp16["t1"], fp16["stored1"], torch.float16, 0.02)
    assert errs[0] < 0.005


def test_a_killed_engines_shm_files_are_removed_exactly(bf16):
    """vLLM's psm_* / sem.mp-* files of the SIGKILLed engine, recorded from /proc/PID/maps
    while it ran, outlive it; the harness unlinks exactly those."""
    assert any("/psm_" in p for p in bf16["A_shm_seen"]), bf16["A_shm_seen"]
    # whether any outlived it depends on whether vLLM's resource tracker (in the same
    # process group) died before it could unlink them: seen both ways here
    assert bf16["A_left"] == [], (bf16["A_orphans"], bf16["A_left"])


def _resp(picks: list, text: str = "") -> dict:
    """A hand-made chat completion asked with LOGPROBS: ``picks`` lists, per generated
    token, ``[(token, logprob), ...]`` with the chosen token first."""
    content = [{"token": p[0][0], "logprob": p[0][1],
                "top_logprobs": [{"token": t, "logprob": lp} for t, lp in p]} for p in picks]
    return {"choices": [{"message": {"content": text or " ".join(p[0][0] for p in picks)},
                         "logprobs": {"content": content}}]}


def test_assert_same_greedy_without_engines():
    tol = BF16_LOGPROB_TOL
    want = _resp([[("a", -0.1), ("x", -3.0)], [("b", -0.5), ("y", -1.2)],
                  [("c", -0.9), ("d", -1.0)], [("e", -0.2), ("z", -2.5)]])
    # equal answers, equal tokens with logprobs within tol
    assert assert_same_greedy(want, want, tol)["diverged_at"] is None
    near = _resp([[("a", -0.15), ("x", -2.9)], [("b", -0.45), ("y", -1.25)],
                  [("c", -0.95), ("d", -1.0)], [("e", -0.3), ("z", -2.4)]])
    rep = assert_same_greedy(near, want, tol)
    assert rep["equal"] == 4 and rep["max_diff"] == pytest.approx(0.1)
    # a near-tie at token 2 ("c" -0.9 vs "d" -1.0 in want) swapped in got: accepted, and
    # what follows (conditioned on another token) is not compared
    tie = _resp([[("a", -0.1), ("x", -3.0)], [("b", -0.5), ("y", -1.2)],
                 [("d", -0.92), ("c", -0.97)], [("q", -4.0), ("e", -5.0)]])
    rep = assert_same_greedy(tie, want, tol)
    assert rep["diverged_at"] == 2 and rep["equal"] == 2
    # a near-tie from the very first token is accepted too
    first = _resp([[("d", -0.6), ("c", -0.7)]])
    assert assert_same_greedy(first, _resp([[("c", -0.65), ("d", -0.66)]]), tol)[
        "diverged_at"] == 0
    # a divergence that is not a near-tie: the other's token far behind ...
    far = _resp([[("a", -0.1), ("x", -3.0)], [("y", -0.1), ("b", -2.6)]])
    with pytest.raises(AssertionError, match="diverge at token 1"):
        assert_same_greedy(far, want, tol)
    # ... or not among the candidates at all (a wrong prefix: another answer from token 0)
    other = _resp([[("w", -0.05), ("v", -3.0)], [("b", -0.5)]])
    with pytest.raises(AssertionError, match="diverge at token 0"):
        assert_same_greedy(other, want, tol)
    # a tie in one response only: want's "c" leads "d" by 0.1, got's "d" leads "c" by 1.5
    one_sided = _resp([[("a", -0.1), ("x", -3.0)], [("b", -0.5), ("y", -1.2)],
                       [("d", -0.2), ("c", -1.7)]])
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_same_greedy(one_sided, want, tol)
    # equal tokens whose logprobs drift beyond tol
    drift = _resp([[("a", -0.1), ("x", -3.0)], [("b", -0.5 - 2 * tol), ("y", -1.2)],
                   [("c", -0.9), ("d", -1.0)], [("e", -0.2), ("z", -2.5)]])
    with pytest.raises(AssertionError, match="token 1 'b'"):
        assert_same_greedy(drift, want, tol)
    # one answer stops where the other goes on
    with pytest.raises(AssertionError, match="stops after 2"):
        assert_same_greedy(_resp([[("a", -0.1)], [("b", -0.5)]]), want, tol)


def test_stream_completion_without_engines():
    """The benchmarks' streamed client (serve_helpers.stream_completion) against a local
    server speaking vLLM's SSE shapes: chat deltas and completion texts, the final usage
    chunk (cached tokens), TTFT before the end; a refusal is an error naming the status."""
    import http.server
    import json

    class SSE(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body.get("model") != "smol":
                self.send_response(404)
                self.end_headers()
                self.wfile.write(b'{"error": "no such model"}')
                return
            assert body["stream"] and body["stream_options"] == {"include_usage": True}
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chat = self.path.endswith("/chat/completions")
            for piece in ("Hel", "lo"):
                ch = {"delta": {"content": piece}} if chat else {"text": piece}
                self.wfile.write(b"data: " + json.dumps({"choices": [ch]}).encode() + b"\n\n")
                self.wfile.flush()
                time.sleep(0.05)
            usage = {"prompt_tokens": 7, "completion_tokens": 2,
                     "prompt_tokens_details": {"cached_tokens": 4}}
            self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode()
                             + b"\n\ndata: [DONE]\n\n")

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SSE)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        for path in ("/v1/chat/completions", "/v1/completions"):
            r = stream_completion(url, path, {"model": "smol"})
            assert (r["text"], r["prompt"], r["completion"], r["cached"]) == ("Hello", 7, 2, 4)
            assert 0 < r["ttft"] < r["seconds"] and r["seconds"] - r["ttft"] >= 0.04, r
        with pytest.raises(RuntimeError, match="HTTP 404"):
            stream_completion(url, "/v1/completions", {"model": "other"})
    finally:
        srv.shutdown()
        srv.server_close()


def test_semaphores_an_engine_maps_are_found_by_inode():
    """A POSIX semaphore is mapped under the temporary name glibc created it as (then
    unlinked), never under its sem.mp-* name: the cleanup finds it by inode, and only
    while a process maps it."""
    import posix_ipc

    name = f"/mp-{unique_name('sem')[-24:]}"
    path = "/dev/shm/sem." + name[1:]
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, initial_value=1)
    try:
        maps = open(f"/proc/{os.getpid()}/maps").read()
        assert path not in maps                       # so a match by name never saw it
        assert path in mapped_vllm_shm([os.getpid()])
        assert "/dev/shm/sem.mp-" not in "".join(mapped_vllm_shm([os.getppid()]))
    finally:
        sem.close()
        posix_ipc.unlink_semaphore(name)
    assert path not in mapped_vllm_shm([os.getpid()])

