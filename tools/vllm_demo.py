"""make demo-vllm: two vLLM instances share one prefix cache through a shmkv segment.

Three engines run one after the other (each is 3 processes and ~1 GB; 2 cores): a
baseline without the connector, instance A and instance B on one fresh segment.  The
traffic is chat requests over two shared system prompts; A serves the first turn of
some conversations, B serves the others and the next turn of A's.  For every request the
demo prints the tokens the connector supplied (``num_cached_tokens``; instances have
their own prefix cache turned off here, so every cached token came from the segment),
the time to first token, and whether the answer equals the baseline's, token for token.

    .venv-vllm/bin/python tools/vllm_demo.py [--core 1] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "vllm" / "engine_worker.py"

SYSTEMS = {
    "support": "You are the support assistant of Lighthouse Networks, an internet provider. "
               "Be brief and polite. Policies: " + " ".join(
                   f"Rule {i}: customers on plan {chr(65 + i % 5)} get {10 * (i + 1)} GB of "
                   f"storage, a {i + 2}-day refund window and phone support from "
                   f"{8 + i % 3}am to {5 + i % 4}pm." for i in range(24)),
    "tutor": "You are a patient tutor of history for high-school students. Answer in two "
             "or three sentences. Curriculum notes: " + " ".join(
                 f"Unit {i}: the period from {1500 + 20 * i} to {1520 + 20 * i}, its trade "
                 f"routes, its wars and its inventions; exam weight {i % 4 + 1} points."
                 for i in range(24)),
}
QUESTIONS = {
    "support": ["How much storage does plan C get?", "Can I get a refund after a week?",
                "When can I call support?"],
    "tutor": ["Why did explorers look for new trade routes?", "What was the printing press?",
              "Who was Napoleon?"],
}


def _run(tmp: Path, tag: str, job: dict, core: str) -> dict:
    jp, op = tmp / f"{tag}.json", tmp / f"{tag}.out.json"
    jp.write_text(json.dumps(job))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, str(WORKER), str(jp), str(op)]
    if core:
        cmd = ["taskset", "-c", core, *cmd]
    print(f"  starting engine {tag} (about a minute)...", flush=True)
    with open(tmp / f"{tag}.log", "w") as log:
        p = subprocess.Popen(cmd, cwd="/tmp", env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=1800)
        finally:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
    if rc != 0:
        raise SystemExit(f"engine {tag} failed (rc {rc}): {tmp / (tag + '.log')}")
    return json.loads(op.read_text())["results"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--core", default="", help="taskset core list for every engine")
    ap.add_argument("--keep", action="store_true", help="keep the segment")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    import shmkv
    from shmkv.models import smollm2_dir

    model = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(model)

    def chat(msgs):
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    convs = [(s, q) for s in SYSTEMS for q in QUESTIONS[s]]
    first = [chat([{"role": "system", "content": SYSTEMS[s]}, {"role": "user", "content": q}])
             for s, q in convs]
    follow = tok.encode("<|im_end|>\n<|im_start|>user\nThank you. Can you say that in one "
                        "word?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    seg = f"shmkv-demo-vllm-{os.getpid()}"
    tmp = Path(tempfile.mkdtemp(prefix="shmkv-vllm-demo-"))
    common = {"model": model, "max_model_len": 4096, "prefix_caching": False}
    extra = {"segment": seg, "size_gib": 0.5}
    a_idx = [0, 3]                      # A serves one conversation per system prompt
    b_idx = [i for i in range(len(convs)) if i not in a_idx]
    print(f"shmkv + vLLM demo: segment {seg}; {len(convs)} conversations over "
          f"{len(SYSTEMS)} system prompts ({', '.join(str(len(first[i])) for i in a_idx)} "
          f"tokens)")
    try:
        base_reqs = [{"prompt_ids": p, "max_tokens": 48, "ttft": True} for p in first]
        base_reqs += [{"continue_from": i, "suffix_ids": follow, "max_tokens": 16,
                       "ttft": True} for i in a_idx]
        base = _run(tmp, "baseline (no connector)", {**common, "extra": None,
                                                     "requests": base_reqs}, args.core)
        A = _run(tmp, "A", {**common, "extra": extra, "requests": [
            {"prompt_ids": first[i], "max_tokens": 48, "ttft": True} for i in a_idx]},
            args.core)
        b_reqs = [{"prompt_ids": first[i], "max_tokens": 48, "ttft": True} for i in b_idx]
        for j in range(len(a_idx)):
            b_reqs.append({"prompt_ids": A[j]["prompt_ids"] + A[j]["token_ids"] + follow,
                           "max_tokens": 16, "ttft": True})
        B = _run(tmp, "B", {**common, "extra": extra, "requests": b_reqs}, args.core)
        rows = []
        for j, i in enumerate(a_idx):
            rows.append(("A", f"{convs[i][0]}: {convs[i][1]}", A[j], base[i]))
        for j, i in enumerate(b_idx):
            rows.append(("B", f"{convs[i][0]}: {convs[i][1]}", B[j], base[i]))
        for j, i in enumerate(a_idx):
            rows.append(("B", f"{convs[i][0]}: turn 2 of A's chat", B[len(b_idx) + j],
                         base[len(convs) + j]))
        ok = True
        print(f"\n{'inst':4} {'request':52} {'prompt':>6} {'cached':>6} {'TTFT':>7} "
              f"{'no-conn':>7}  same")
        for inst, what, r, b in rows:
            same = r["token_ids"] == b["token_ids"]
            ok &= same
            print(f"{inst:4} {what[:52]:52} {len(r['prompt_ids']):6} "
                  f"{r['num_cached_tokens']:6} {r['ttft']:6.2f}s {b['ttft']:6.2f}s  "
                  f"{'yes' if same else 'NO'}")
        print("\nanswers (B):")
        for _inst, what, r, _ in rows[len(a_idx):]:
            print(f"  [{what}] {r['text'].strip()[:110]!r}")
        kv = shmkv.KVCache.attach(seg)
        st = kv.stats()
        print(f"\nsegment: {st['cached_blocks']} cached blocks of {st['num_blocks']}, "
              f"check() = {kv.check()}, prefix hits {st['prefix_hits']} of "
              f"{st['prefix_queries']} queries")
        kv.close()
        print("every answer equals the baseline's" if ok else "MISMATCH against the baseline")
        if not ok:
            raise SystemExit(1)
    finally:
        if not args.keep:
            try:
                shmkv.KVCache.attach(seg).unlink()
            except Exception:
                pass


if __name__ == "__main__":
    main()
