"""Does vLLM CPU answer ``[t, 0, 0, ...]`` on a tiny Gemma 3, with or without shmkv?

docs/known-issues.md describes the symptom: ``tests/vllm/test_vllm_hybrid.py``'s engine,
computing a 400-token prompt itself with nothing loaded, answered ``[1333, 0, 0, ...]``
instead of transformers' greedy answer, now and then.  This script builds the same model
the same way (a seeded tiny Gemma 3: sliding window 64 / full / sliding / full, 4 query /
2 KV heads, head_dim 32, random weights, SmolLM2's tokenizer), asks transformers for the
greedy answer to the same prompt, then starts fresh vLLM engines (``LLM``, offline, float32,
``enforce_eager``, as the test's ``configs_worker.py`` does) one after another, in three
modes, interleaved:

* ``plain``: no KV connector: vLLM's hybrid KV cache manager on (two KV cache groups);
* ``nohma``: no KV connector, ``disable_hybrid_kv_cache_manager=True`` (one group, as
  vLLM runs the model beside a connector without ``SupportsHMA``);
* ``shmkv``: the shmkv connector on a fresh segment (one group; nothing to load: every
  request has its own ``cache_salt``), removed afterwards.

Mind the threads: vLLM CPU reserves one core for itself and one more for a KV connector,
so on a 2-core machine its automatic binding gives a ``plain`` or ``nohma`` engine one
OpenMP thread (core 0) and a ``shmkv`` engine two (it cannot reserve both: "Selected CPU
core number (2) should be greater than reserved CPU core number (2)").  ``--omp-bind``
sets the same binding for every mode.  Each engine's log (``vllm``'s "OpenMP thread
binding info") is in the temp directory the script prints at the end.

Each engine answers the prompt ``--requests`` times, one request after the other, each
with another ``cache_salt`` (so each computes the whole prompt; the first has none, as the
test's engine A), and every answer is compared with transformers'.  ``--load`` runs a busy
loop on core 1 (started and ended here, by its PID) and pins the engines to core 0
(``--no-pin``: leaves them on every core, one of their OpenMP threads beside the loop).

    .venv-vllm/bin/python tools/repro_gemma3_zeros.py [--engines 4] [--requests 3]
        [--modes plain,nohma,shmkv] [--load [--no-pin]] [--json out.json]

It prints one line per engine and a summary (answers equal / wrong per mode); exit 0 when
every answer equals transformers', 1 otherwise.  It leaves nothing in /dev/shm: the files
each engine's processes mapped there (vLLM's ``psm_*`` buffers, ``sem.mp-*``) are removed
after the engine is gone if no live process maps them, and the shmkv segment is unlinked.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

# the hybrid test's model and the vLLM tests' engine-group runner, not copies of them
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                "tests", "vllm"))
from configs_helpers import tiny_gemma3  # noqa: E402
from serve_helpers import run_group  # noqa: E402

N, GEN = 400, 12                       # the test's prompt length and answer length


def prompt() -> list:
    import numpy as np

    return np.random.default_rng(5).integers(100, 49000, N).tolist()


def reference(path: str, p: list) -> list:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    with torch.no_grad():
        return model.generate(torch.tensor([p]), max_new_tokens=GEN,
                              do_sample=False)[0, N:].tolist()


# ------------------------------------------------------------------ one engine (child)
def engine(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict = {"dtype": "float32"}
    if job["mode"] == "shmkv":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ShmkvConnector", kv_connector_module_path="shmkv.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"segment": job["segment"], "num_blocks": 256})
    elif job["mode"] == "nohma":
        kw["disable_hybrid_kv_cache_manager"] = True
    t0 = time.monotonic()
    llm = LLM(model=job["model"], enforce_eager=True, seed=0, max_num_seqs=2,
              max_model_len=2048, **kw)
    started = time.monotonic() - t0
    answers = []
    for i in range(job["requests"]):
        req = {"prompt_token_ids": job["prompt"]}
        if i:
            req["cache_salt"] = f"repro-{i}"    # computes the whole prompt again
        out = llm.generate([req], SamplingParams(temperature=0.0, max_tokens=GEN,
                                                 ignore_eos=True), use_tqdm=False)[0]
        answers.append({"token_ids": list(out.outputs[0].token_ids),
                        "num_cached_tokens": out.num_cached_tokens})
    Path(out_path).write_text(json.dumps({"answers": answers, "start_s": started}))


# ------------------------------------------------------------------ the parent
def run_engine(tmp: Path, tag: str, job: dict, cpus: str | None,
               omp_bind: str | None = None) -> tuple:
    jp, op, lp = tmp / f"{tag}.json", tmp / f"{tag}.out.json", tmp / f"{tag}.log"
    jp.write_text(json.dumps(job))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--engine", str(jp), str(op)]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    if omp_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
    t0 = time.monotonic()
    with open(lp, "w") as log:
        p = subprocess.Popen(cmd, cwd="/tmp", env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        # kills the engine's group, removes the /dev/shm files it left that nothing maps
        rc = run_group(p, 600)
    out = json.loads(op.read_text()) if op.exists() else None
    return rc, out, time.monotonic() - t0, lp


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=4, help="engines per mode (default 4)")
    ap.add_argument("--requests", type=int, default=3, help="requests per engine (default 3)")
    ap.add_argument("--modes", default="plain,nohma,shmkv")
    ap.add_argument("--load", action="store_true",
                    help="busy loop on core 1, engines pinned to core 0")
    ap.add_argument("--no-pin", action="store_true",
                    help="with --load: leave the engines on every core (vLLM binds its "
                         "OpenMP threads to all of them, one beside the busy loop)")
    ap.add_argument("--omp-bind", metavar="CPUS",
                    help="VLLM_CPU_OMP_THREADS_BIND for every engine (e.g. 0-1: two OpenMP "
                         "threads, as vLLM picks beside a connector on a 2-core machine)")
    ap.add_argument("--model-dir", help="build the model here (default: a temp dir)")
    ap.add_argument("--json", help="write every answer here")
    ap.add_argument("--engine", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:
        engine(*a.engine)
        return 0

    modes = [m for m in a.modes.split(",") if m]
    assert set(modes) <= {"plain", "nohma", "shmkv"}, modes
    tmp = Path(tempfile.mkdtemp(prefix="repro-gemma3-"))
    path = tiny_gemma3(Path(a.model_dir) if a.model_dir else tmp / "tiny-gemma3")
    p = prompt()
    ref = reference(path, p)
    print(f"transformers' greedy answer: {ref}", flush=True)
    busy = None
    if a.load:
        busy = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c",
                                 "while True: pass"])
    rows: list = []
    try:
        for e in range(a.engines):
            for mode in modes:            # interleaved: the machine's state is shared
                seg = f"repro-gemma3-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                job = {"model": path, "prompt": p, "requests": a.requests, "mode": mode,
                       "segment": seg}
                try:
                    rc, out, wall, log = run_engine(tmp, f"{mode}{e}", job,
                                                    "0" if a.load and not a.no_pin else None,
                                                    a.omp_bind)
                finally:
                    if mode == "shmkv":
                        try:
                            import shmkv

                            shmkv.KVCache.attach(seg).unlink()
                        except FileNotFoundError:
                            pass
                answers = out["answers"] if out else []
                ok = [x["token_ids"] == ref for x in answers]
                rows.append({"mode": mode, "engine": e, "rc": rc, "wall_s": round(wall, 1),
                             "answers": answers, "equal": ok})
                bad = [x["token_ids"] for x, good in zip(answers, ok) if not good]
                print(f"{mode:5} engine {e}: rc {rc}, {wall:5.1f} s, "
                      f"{sum(ok)}/{len(answers)} equal transformers'"
                      + (f"; WRONG: {bad}" if bad else "")
                      + ("" if rc == 0 else f" (log: {log})"), flush=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    where = "every core" if a.no_pin else "core 0"
    print(f"\n{'mode':5}  engines  answers  equal  wrong   "
          f"(load: {f'core 1 busy, engines on {where}' if a.load else 'none'})")
    failed = False
    for mode in modes:
        rs = [r for r in rows if r["mode"] == mode]
        n = sum(len(r["equal"]) for r in rs)
        good = sum(sum(r["equal"]) for r in rs)
        failed |= good != n or any(r["rc"] != 0 for r in rs)
        print(f"{mode:5}  {len(rs):7}  {n:7}  {good:5}  {n - good:5}")
    print(f"engine logs: {tmp}")
    if a.json:
        Path(a.json).write_text(json.dumps({"reference": ref, "load": a.load, "no_pin": a.no_pin,
                                            "omp_bind": a.omp_bind, "runs": rows},
                                           indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
