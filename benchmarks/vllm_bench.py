"""vLLM on shmkv (issue 20): what ShmkvConnector costs and saves.  Run with the vLLM venv:

    .venv-vllm/bin/python benchmarks/vllm_bench.py            # copies + engines
    .venv-vllm/bin/python benchmarks/vllm_bench.py --copies   # the copy micro-benchmark only

- **copies**: the connector's load (shmkv blocks -> vLLM's CPU_ATTN layout, K transposed) and
  save (back) of N tokens over every layer of SmolLM2-135M (30 layers, 3 KV heads, head_dim
  64, float32), against a plain ``copy_`` of the same bytes between contiguous tensors (the
  memcpy floor), both on one torch thread; medians.
- **engines** (real vLLM 0.32, SmolLM2-135M-Instruct, one engine at a time, every engine
  pinned to the same core with ``taskset``: any kv_transfer_config makes vLLM reserve a core,
  so unpinned runs are not comparable): engine A (connector: save on, load off, vLLM's own
  prefix cache off) prefills fresh 1k / 4k-token prompts: its time to first token includes
  the save; engine B (connector: load on, save off, prefix cache off) answers the same
  prompts (every full block loaded from A's) and the same prompts under another cache_salt
  (nothing to load: a recompute).  Time to first token = a 1-token request, medians.
  A's TTFT over B's recompute is the save's cost on a prefill.

Writes benchmarks/RESULTS_vllm.md (tables); the machine may be shared: ratios are measured
within one run, against a baseline on the same core.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE.parent / "tests" / "vllm" / "engine_worker.py"
VB = 128


def _time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _copies_at(tokens: int, reps: int, lay) -> list[dict]:
    import torch

    import shmkv
    from shmkv.integrations.torch_views import pool_tensors

    L, H, D = 30, 3, 64
    nbv = tokens // VB
    name = f"shmkv-bench-vllm-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    cfg = shmkv.CacheConfig(num_layers=L, num_kv_heads=H, head_dim=D,
                            num_blocks=nbv + 8, block_size=VB, dtype="float32")
    kv = shmkv.KVCache.create(name, cfg)
    try:
        vl = [torch.randn(nbv + 4, H, VB, 2 * D) for _ in range(L)]
        pools = [pool_tensors(kv, i) for i in range(L)]
        vblk = torch.arange(2, 2 + nbv)                 # vLLM blocks 2.. (not 0)
        sub = torch.zeros(nbv, dtype=torch.int64)
        dst = torch.arange(3, 3 + nbv)                  # shmkv blocks 3..

        def save():             # the connector's path (C: shmkv._vcopy)
            for t, (kp, vp) in zip(vl, pools):
                lay.copy(t, kp, vp, VB, dst, vblk, sub, to_vllm=False)

        def load():
            for t, (kp, vp) in zip(vl, pools):
                lay.copy(t, kp, vp, VB, dst, vblk, sub, to_vllm=True)

        def save_torch():       # the torch reference (index ops over strided views)
            for t, (kp, vp) in zip(vl, pools):
                k, v = lay.read(t, VB, vblk, sub)
                kp[dst] = k
                vp[dst] = v

        def load_torch():
            for t, (kp, vp) in zip(vl, pools):
                lay.write(t, VB, vblk, sub, kp.index_select(0, dst), vp.index_select(0, dst))

        nbytes = 2 * L * tokens * H * D * 4
        a = torch.randn(nbytes // 4)
        b = torch.empty_like(a)
        res = {"memcpy": _time(lambda: b.copy_(a), reps), "save": _time(save, reps),
               "load": _time(load, reps), "save (torch)": _time(save_torch, reps),
               "load (torch)": _time(load_torch, reps)}
        return [{"tokens": tokens, "op": op, "ms": res[op] * 1e3,
                 "memcpy_ms": res["memcpy"] * 1e3, "gbs": nbytes / res[op] / 1e9,
                 "ratio": res[op] / res["memcpy"]}
                for op in ("save", "load", "save (torch)", "load (torch)")]
    finally:
        kv.unlink()
        kv.close()


def copies(tokens_list=(1024, 4096), reps=15) -> list[dict]:
    import torch

    from shmkv.integrations.vllm.layout import probe_layout

    torch.set_num_threads(1)
    lay = probe_layout("vec", torch.float32, 3, 64, VB, VB)
    assert lay is not None, "vLLM's vec layout not understood"
    return [r for tokens in tokens_list for r in _copies_at(tokens, reps, lay)]


def _engine(tmp: Path, tag: str, job: dict, core: str) -> dict:
    jp, op = tmp / f"{tag}.json", tmp / f"{tag}.out.json"
    jp.write_text(json.dumps(job))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2")
    cmd = [sys.executable, str(WORKER), str(jp), str(op)]
    if core:
        cmd = ["taskset", "-c", core, *cmd]
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
        raise SystemExit(f"engine {tag} failed (rc {rc}); see {tmp / (tag + '.log')}")
    return json.loads(op.read_text())


def engines(reps: int, core: str) -> list[dict]:
    from transformers import AutoTokenizer

    from shmkv.models import smollm2_dir

    model = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(model)
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    text = text * 3

    def prompt(n: int, i: int) -> list[int]:
        start = (i * 997) % 30000             # distinct prompts: no shared prefix
        ids = tok.encode(text[start:start + 8 * n], add_special_tokens=False)[:n]
        assert len(ids) == n, (n, len(ids))
        return ids

    sizes = (1024, 4096)
    prompts = {(n, i): prompt(n, 50 + i * 7 + n // 64) for n in sizes for i in range(reps)}
    seg = f"shmkv-bench-vllm-{os.getpid()}"
    extra = {"segment": seg, "size_gib": 1.0}
    tmp = Path(tempfile.mkdtemp(prefix="shmkv-vllm-bench-"))
    common = {"model": model, "max_model_len": 4200, "prefix_caching": False}
    # decode: a 1k prompt, 1 token (TTFT), then 161 tokens: 160 decode steps, one block
    # (tokens 1024-1151) fills and is saved
    dec = prompt(1024, 3)
    decode_req = {"prompt_ids": dec, "max_tokens": 161, "ttft": True, "ignore_eos": True,
                  "cache_salt": "decode"}
    try:
        a = _engine(tmp, "A", {**common, "extra": {**extra, "load": False},
                               "requests": [{"prompt_ids": p, "max_tokens": 1}
                                            for p in prompts.values()] + [decode_req]}, core)
        reqs = []
        for p in prompts.values():
            reqs.append({"prompt_ids": p, "max_tokens": 1})
            reqs.append({"prompt_ids": p, "max_tokens": 1, "cache_salt": "recompute"})
        b = _engine(tmp, "B", {**common, "extra": {**extra, "save": False},
                               "requests": reqs + [{**decode_req, "cache_salt": "x"}]}, core)
        c = _engine(tmp, "C", {**common, "extra": None,
                               "requests": [{"prompt_ids": p, "max_tokens": 1}
                                            for p in prompts.values()] + [decode_req]}, core)
    finally:
        try:
            import shmkv

            shmkv.KVCache.attach(seg).unlink()
        except Exception:
            pass
    rows = []
    keys = list(prompts)
    for n in sizes:
        idx = [j for j, k in enumerate(keys) if k[0] == n]
        a_t = [a["results"][j]["seconds"] for j in idx]
        c_t = [c["results"][j]["seconds"] for j in idx]
        hit = [b["results"][2 * j]["seconds"] for j in idx]
        miss = [b["results"][2 * j + 1]["seconds"] for j in idx]
        cached = [b["results"][2 * j]["num_cached_tokens"] for j in idx]
        same = all(b["results"][2 * j]["token_ids"] == b["results"][2 * j + 1]["token_ids"]
                   == a["results"][j]["token_ids"] == c["results"][j]["token_ids"]
                   for j in idx)
        rows.append({"tokens": n, "hit_s": statistics.median(hit),
                     "recompute_s": statistics.median(miss), "noconn_s": statistics.median(c_t),
                     "a_save_s": statistics.median(a_t), "cached": min(cached),
                     "same_first_token": same, "reps": len(idx)})

    def decode_ms(r):
        last = r["results"][-1]
        return (last["seconds"] - last["ttft"]) / 160 * 1e3

    rows.append({"decode": True, "save_ms": decode_ms(a), "nosave_ms": decode_ms(b),
                 "noconn_ms": decode_ms(c),
                 "same": a["results"][-1]["token_ids"] == b["results"][-1]["token_ids"]
                 == c["results"][-1]["token_ids"]})
    return rows


def report(copy_rows, engine_rows, core) -> str:
    out = ["# vLLM on shmkv (benchmarks/vllm_bench.py)", "",
           f"Machine: {os.cpu_count()} CPUs, shared with other jobs while measured; ratios "
           "are against a baseline taken in the same run.", ""]
    if copy_rows:
        out += ["## Copies between shmkv blocks and vLLM's CPU_ATTN layout (all 30 layers, "
                "1 torch thread)", "",
                "| tokens | op | ms | GB/s | memcpy of the same bytes, ms | ratio to memcpy |",
                "|---:|---|---:|---:|---:|---:|"]
        for r in copy_rows:
            out.append(f"| {r['tokens']} | {r['op']} | {r['ms']:.2f} | {r['gbs']:.2f} | "
                       f"{r['memcpy_ms']:.2f} | {r['ratio']:.2f}x |")
        out.append("")
    if engine_rows:
        out += [f"## Time to first token, vLLM 0.32 engines pinned to core {core}", "",
                "B: connector, load on, save off; A: connector, save on, load off; C: no "
                "connector. Every engine has vLLM's own prefix cache off.", "",
                "| prompt tokens | B, A's blocks loaded | B, recomputed | ratio | tokens "
                "loaded | A (recompute + save) | save's cost | C (no connector) | same "
                "first token | reps |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for r in engine_rows:
            if r.get("decode"):
                continue
            out.append(f"| {r['tokens']} | {r['hit_s']:.2f} s | {r['recompute_s']:.2f} s | "
                       f"{r['hit_s'] / r['recompute_s']:.3f}x | {r['cached']} | "
                       f"{r['a_save_s']:.2f} s | "
                       f"{(r['a_save_s'] / r['recompute_s'] - 1) * 100:+.1f}% | "
                       f"{r['noconn_s']:.2f} s | {r['same_first_token']} | {r['reps']} |")
        d = [r for r in engine_rows if r.get("decode")][0]
        out += ["", "## Decode, ms per token (1k-token prompt, 160 steps: one block "
                "saved; same engines)", "",
                "| A: save on | B: save off | save's cost | C: no connector | same tokens |",
                "|---:|---:|---:|---:|---|",
                f"| {d['save_ms']:.1f} | {d['nosave_ms']:.1f} | "
                f"{(d['save_ms'] / d['nosave_ms'] - 1) * 100:+.1f}% | {d['noconn_ms']:.1f} | "
                f"{d['same']} |", ""]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", action="store_true", help="the copy micro-benchmark only")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--core", default="1", help="taskset core list for the engines")
    ap.add_argument("--out", default=str(HERE / "RESULTS_vllm.md"))
    args = ap.parse_args()
    c = copies()
    e = [] if args.copies else engines(args.reps, args.core)
    text = report(c, e, args.core)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
