"""make demo-serve: a fleet as users deploy it -- two ``vllm serve`` instances (each pinned to
a core) sharing one shmkv segment, PyPI's ``vllm-router`` in front (round-robin), and a chat
client talking to the router: users who share a long system prompt, and a multi-turn chat
whose turns alternate between the instances.  Per request: which instance served it, the
prompt tokens it found cached (``usage.prompt_tokens_details.cached_tokens``: its own prefix
cache and the segment) and the time to first token (streamed).  At the end: the segment's
figures and each instance's connector metrics from its ``/metrics``.

Run with the vLLM venv (``make demo-serve`` installs vllm-router into it); everything it
starts it stops, the segment it creates it unlinks.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "vllm"))

from serve_helpers import (  # noqa: E402
    ServeInstance,
    connector_config,
    free_port,
    get_text,
    parse_metrics,
)

GPL = "/usr/share/common-licenses/GPL-3"


def _router(port: int, workers: list[str], log: Path) -> subprocess.Popen:
    exe = shutil.which("vllm-router", path=os.path.dirname(sys.executable))
    if exe is None:
        sys.exit("vllm-router is not installed in this venv: make demo-serve installs it")
    f = open(log, "w")
    return subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), "--policy",
                             "round_robin", "--worker-urls", *workers], stdout=f,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _wait(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=3):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


def _stream_chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    """A streamed greedy chat: the answer, its usage and the time to its first token."""
    body = {"model": "smol", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for ch in chunk.get("choices", []):
                piece = ch.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"text": "".join(text), "usage": usage, "ttft": ttft or 0.0}


def _served(insts: dict, before: dict) -> str:
    """Which instance's request counter moved (requests are sent one at a time)."""
    for name, inst in insts.items():
        now = inst.metrics().get("vllm:request_success_total", 0.0)
        if now > before[name]:
            before[name] = now
            return name
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the converted SmolLM2")
    args = ap.parse_args()
    if args.model is None:
        from shmkv.models import smollm2_dir

        args.model = str(smollm2_dir())
    import shmkv

    seg = f"shmkv-demo-serve-{uuid.uuid4().hex[:8]}"
    tmp = Path(tempfile.mkdtemp(prefix="shmkv-demo-serve-"))
    kv = connector_config(seg, size_gib=1)
    insts: dict[str, ServeInstance] = {}
    router = None
    try:
        print(f"starting two vllm serve instances on segment {seg!r} (logs in {tmp}) ...")
        for i, name in enumerate(("A", "B")):
            insts[name] = ServeInstance(sys.executable, args.model, tmp / f"{name}.log",
                                        core=i % (os.cpu_count() or 1), kv=kv)
        for inst in insts.values():
            inst.wait_ready()
        port = free_port()
        router = _router(port, [i.url for i in insts.values()], tmp / "router.log")
        url = f"http://127.0.0.1:{port}"
        _wait(url + "/health", router)
        print(f"vllm-router (round_robin) on {url} -> " +
              ", ".join(f"{n} {i.url}" for n, i in insts.items()))
        text = Path(GPL).read_text()
        system = {"role": "system", "content": "You are a careful lawyer. The licence:\n" +
                  text[:4400]}
        before = {n: i.metrics().get("vllm:request_success_total", 0.0)
                  for n, i in insts.items()}
        print(f"\n{'request':<34} {'served by':>9} {'prompt':>7} {'cached':>7} {'TTFT':>8}")

        def ask(label: str, messages: list[dict], max_tokens: int = 24) -> dict:
            r = _stream_chat(url, messages, max_tokens)
            u = r["usage"]
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            print(f"{label:<34} {_served(insts, before):>9} {u.get('prompt_tokens', 0):>7} "
                  f"{cached:>7} {r['ttft'] * 1e3:>6.0f} ms")
            return r
        for user in ("Summarize the licence.", "Who may copy it?", "What is a patent?",
                     "Can I sell copies?"):
            ask(f"shared system prompt: {user[:14]}", [system, {"role": "user",
                                                                  "content": user}])
        chat = [system, {"role": "user", "content": "Explain section 2 briefly."}]
        for turn in range(1, 5):
            r = ask(f"chat, turn {turn}", chat)
            chat += [{"role": "assistant", "content": r["text"]},
                     {"role": "user", "content": "And then? Be brief."}]
        print("\nthe segment:")
        with shmkv.KVCache.attach(seg) as c:
            st = c.stats()
        print(f"  {st['used_blocks']} of {st['num_blocks']} blocks in use "
              f"({st['cached_blocks']} in the prefix cache), {st['prefix_queries']} prefix "
              f"queries, {st['prefix_hits']} hits, {st['cached_blocks_evicted']} evicted")
        for name, inst in insts.items():
            m = parse_metrics(get_text(inst.url + "/metrics"))
            print(f"instance {name}: loaded {m.get('vllm:shmkv_loaded_tokens_total', 0):.0f} "
                  f"tokens from the segment, saved {m.get('vllm:shmkv_saved_tokens_total', 0):.0f}, "
                  f"{m.get('vllm:shmkv_lookups_total', 0):.0f} lookups, "
                  f"{m.get('vllm:shmkv_pending_waits_total', 0):.0f} pending waits, "
                  f"load failures {m.get('vllm:shmkv_load_failures_total', 0):.0f}; vLLM: "
                  f"{m.get('vllm:prefix_cache_hits_total', 0):.0f} local and "
                  f"{m.get('vllm:external_prefix_cache_hits_total', 0):.0f} external "
                  f"cached prompt tokens")
    finally:
        if router is not None:
            try:
                os.killpg(router.pid, signal.SIGTERM)
                router.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(router.pid, signal.SIGKILL)
                router.wait()
        for inst in insts.values():
            inst.stop()
        try:
            shmkv.KVCache.attach(seg).unlink()
        except Exception:
            pass
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
