"""vLLM on shmkv: what ShmkvConnector costs and saves.  Run with the vLLM venv:

    .venv-vllm/bin/python benchmarks/vllm_bench.py            # copies, engines, instances
    .venv-vllm/bin/python benchmarks/vllm_bench.py --copies   # the copy micro-benchmark only

- **copies**: the connector's load (shmkv blocks -> vLLM's CPU_ATTN layout, K transposed) and
  save (back) of N tokens over every layer of SmolLM2-135M (30 layers, 3 KV heads, head_dim
  64, float32), against a plain ``copy_`` of the same bytes between contiguous tensors (the
  memcpy floor), both on one torch thread; medians.
- **engines** (real vLLM 0.32, SmolLM2-135M-Instruct, one engine at a time, every engine
  pinned to the same core with ``taskset``: any kv_transfer_config makes vLLM reserve a core,
  so unpinned runs are not comparable), per shmkv block size (16, the default, and 128):
  engine A (connector: save on, load off, vLLM's own prefix cache off) prefills fresh 1k /
  4k-token prompts, its connector timing its own saves (SHMKV_VLLM_STATS); engine B
  (connector: load on, save off, prefix cache off) answers the same prompts (every block
  loaded from A's) and the same prompts under another cache_salt (nothing to load: a
  recompute); engine C (once) has no connector.  Time to first token = a 1-token request,
  medians.  Decode: 160 steps after a 1k prompt, one vLLM block saved on the way.
- **instances**: N instances one after another serving chats that share a system prompt,
  on one segment vs a segment each vs no connector: KV held in shmkv, hit rate, tokens/s,
  outputs equal.

Writes benchmarks/RESULTS_vllm.md (tables, the machine's ISA and load); ratios are measured
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


def _tokenizer_prompts():
    from transformers import AutoTokenizer

    from shmkv.models import smollm2_dir

    model = str(smollm2_dir())
    tok = AutoTokenizer.from_pretrained(model)
    text = Path("/usr/share/common-licenses/GPL-3").read_text() * 3

    def prompt(n: int, i: int) -> list[int]:
        start = (i * 997) % 30000             # distinct prompts: no shared prefix
        ids = tok.encode(text[start:start + 8 * n], add_special_tokens=False)[:n]
        assert len(ids) == n, (n, len(ids))
        return ids

    return model, tok, text, prompt


def _unlink(seg: str) -> None:
    try:
        import shmkv

        shmkv.KVCache.attach(seg).unlink()
    except Exception:
        pass


def engines(reps: int, core: str, block_sizes=(16, 128)) -> list[dict]:
    """Per shmkv block size (vLLM's is 128 on CPU; its CPU_ATTN takes multiples of 32):
    A (save on) prefills fresh prompts, B (load on) answers them from A's blocks and
    recomputes them under another salt; C (once) has no connector."""
    model, _, _, prompt = _tokenizer_prompts()
    sizes = (1024, 4096)
    prompts = {(n, i): prompt(n, 50 + i * 7 + n // 64) for n in sizes for i in range(reps)}
    tmp = Path(tempfile.mkdtemp(prefix="shmkv-vllm-bench-"))
    common = {"model": model, "max_model_len": 4200, "prefix_caching": False}
    # decode: a 1k prompt, 1 token (TTFT), then 161 tokens: 160 decode steps, one vLLM
    # block (tokens 1024-1151) fills and is saved
    dec = prompt(1024, 3)
    decode_req = {"prompt_ids": dec, "max_tokens": 161, "ttft": True, "ignore_eos": True,
                  "cache_salt": "decode"}
    rows = []
    for vb in block_sizes:                # (named vb in the rows: the shmkv block size)
        seg = f"shmkv-bench-vllm-{os.getpid()}-{vb}"
        extra = {"segment": seg, "size_gib": 1.0, "block_size": vb}
        job = common
        try:
            a = _engine(tmp, f"A{vb}", {**job, "extra": {**extra, "load": False},
                                        "requests": [{"prompt_ids": p, "max_tokens": 1}
                                                     for p in prompts.values()]
                                        + [decode_req]}, core)
            reqs = []
            for p in prompts.values():
                reqs.append({"prompt_ids": p, "max_tokens": 1})
                reqs.append({"prompt_ids": p, "max_tokens": 1, "cache_salt": "recompute"})
            b = _engine(tmp, f"B{vb}", {**job, "extra": {**extra, "save": False},
                                        "requests": reqs + [{**decode_req, "cache_salt": "x"}]},
                        core)
            c = None
            if vb == block_sizes[0]:
                c = _engine(tmp, f"C{vb}", {**job, "extra": None,
                                            "requests": [{"prompt_ids": p, "max_tokens": 1}
                                                         for p in prompts.values()]
                                            + [decode_req]}, core)
        finally:
            _unlink(seg)
        keys = list(prompts)
        ar = a["results"]
        for n in sizes:
            idx = [j for j, k in enumerate(keys) if k[0] == n]
            hit = [b["results"][2 * j]["seconds"] for j in idx]
            miss = [b["results"][2 * j + 1]["seconds"] for j in idx]
            # the save's own time inside A's engine, per request (counter differences)
            save_s = [ar[j]["connector"].get("save_seconds", 0.0)
                      - (ar[j - 1]["connector"].get("save_seconds", 0.0) if j else 0.0)
                      for j in idx]
            same = all(b["results"][2 * j]["token_ids"] == b["results"][2 * j + 1]["token_ids"]
                       == ar[j]["token_ids"]
                       and (c is None or c["results"][j]["token_ids"] == ar[j]["token_ids"])
                       for j in idx)
            rows.append({"vb": vb, "tokens": n, "hit_s": statistics.median(hit),
                         "recompute_s": statistics.median(miss),
                         "noconn_s": (statistics.median([c["results"][j]["seconds"]
                                                         for j in idx]) if c else None),
                         "a_s": statistics.median([ar[j]["seconds"] for j in idx]),
                         "save_in_a_s": statistics.median(save_s),
                         "cached": min(b["results"][2 * j]["num_cached_tokens"] for j in idx),
                         "same_first_token": same, "reps": len(idx)})
        if c is not None:
            def decode_ms(r):
                last = r["results"][-1]
                return (last["seconds"] - last["ttft"]) / 160 * 1e3

            last, before = ar[-1]["connector"], ar[-2]["connector"]
            rows.append({"decode": True, "vb": vb, "save_ms": decode_ms(a),
                         "nosave_ms": decode_ms(b), "noconn_ms": decode_ms(c),
                         "save_in_a_ms": (last.get("save_seconds", 0.0)
                                          - before.get("save_seconds", 0.0)) * 1e3,
                         "same": ar[-1]["token_ids"] == b["results"][-1]["token_ids"]
                         == c["results"][-1]["token_ids"]})
    return rows


def instances(n_inst: int, per: int, core: str) -> list[dict]:
    """N vLLM instances on one host serving chats that share a system prompt: one segment
    for all of them ("shared") vs a segment each ("own": every instance caches only what
    it computed) vs no connector ("none": vLLM's own prefix cache only, on in all three).  The instances run one after
    another (a 2-core machine), each pinned to the same core."""
    import shmkv

    model, tok, text, _ = _tokenizer_prompts()
    system = "You are a careful lawyer. Here is the licence:\n" + text[:4200]
    questions = ["Summarize it in one sentence.", "Who may copy the program?",
                 "What about patents?", "Can I sell copies?", "What is source code?",
                 "What if I modify it?", "Is there a warranty?", "What is a User Product?"]

    def chat(q: str) -> list[int]:
        ids = tok.apply_chat_template([{"role": "system", "content": system},
                                       {"role": "user", "content": q}],
                                      add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    tmp = Path(tempfile.mkdtemp(prefix="shmkv-vllm-inst-"))
    rows = []
    outputs: dict[str, list] = {}
    for mode in ("shared", "own", "none"):
        segs = []
        res = []
        try:
            for i in range(n_inst):
                seg = f"shmkv-bench-inst-{os.getpid()}-{mode}-{i if mode == 'own' else 0}"
                if seg not in segs and mode != "none":
                    segs.append(seg)
                reqs = [{"prompt_ids": chat(questions[(i * per + j) % len(questions)]),
                         "max_tokens": 32, "ignore_eos": True} for j in range(per)]
                r = _engine(tmp, f"{mode}{i}", {"model": model, "max_model_len": 2048,
                                                "extra": (None if mode == "none" else
                                                          {"segment": seg, "size_gib": 0.5}),
                                                "requests": reqs}, core)
                res += r["results"]
            used = 0
            for seg in segs:
                kv = shmkv.KVCache.attach(seg)
                try:
                    st = kv.stats()       # cached (findable, reclaimable) blocks count as free
                    used += (st["used_blocks"] + st["cached_blocks"]) * kv.config.bytes_per_block
                finally:
                    kv.close()
        finally:
            for seg in segs:
                _unlink(seg)
        prompt_toks = sum(len(r["prompt_ids"]) for r in res)
        seconds = sum(r["seconds"] for r in res)
        outputs[mode] = [r["token_ids"] for r in res]
        rows.append({"mode": mode, "instances": n_inst, "requests": len(res),
                     "prompt_tokens": prompt_toks,
                     "cached_tokens": sum(r["num_cached_tokens"] for r in res),
                     "seconds": seconds,
                     "gen_tokens": sum(len(r["token_ids"]) for r in res),
                     "kv_bytes": used, "segments": len(segs)})
    for r in rows:
        r["same_outputs"] = outputs[r["mode"]] == outputs["none"]
    return rows


def _isa() -> str:
    """The CPU's instruction-set level as shmkv's kernels see it (scalar/avx2/avx512/amx)."""
    from shmkv import _attention

    return f"ISA {_attention.cpu_isa()}"


def report(copy_rows, engine_rows, inst_rows, core, load: str) -> str:
    out = ["# vLLM on shmkv (benchmarks/vllm_bench.py)", "",
           f"Machine: {os.cpu_count()} CPUs, {_isa()}; load average when started: {load}. "
           "Ratios are against a baseline taken in the same run.", ""]
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
                "connector. Every engine has vLLM's own prefix cache off; vLLM's blocks are "
                "128 tokens. vLLM computes at least a prompt's last token, so a hit ends at "
                "the last shmkv block before it: with 16-token shmkv blocks (the default) "
                "a 1024-token prompt loads 1008 and computes 16, with 128-token ones it "
                "loads 896 and computes 128. \"save in A\": the "
                "seconds A's worker spent saving (its connector's own clock), over A's "
                "time to first token.", "",
                "| shmkv block | prompt tokens | B, A's blocks loaded | B, recomputed | ratio "
                "| tokens loaded | A (recompute + save) | save in A | C (no connector) "
                "| same first token | reps |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
        for r in engine_rows:
            if r.get("decode"):
                continue
            c = f"{r['noconn_s']:.2f} s" if r["noconn_s"] is not None else "-"
            out.append(f"| {r['vb']} | {r['tokens']} | {r['hit_s']:.2f} s | "
                       f"{r['recompute_s']:.2f} s | {r['hit_s'] / r['recompute_s']:.3f}x | "
                       f"{r['cached']} | {r['a_s']:.2f} s | {r['save_in_a_s'] * 1e3:.0f} ms "
                       f"({r['save_in_a_s'] / r['a_s'] * 100:.1f}%) | {c} | "
                       f"{r['same_first_token']} | {r['reps']} |")
        for d in [r for r in engine_rows if r.get("decode")]:
            out += ["", f"## Decode, ms per token (1k-token prompt, 160 steps: one vLLM "
                    f"block saved; shmkv block {d['vb']}; same engines)", "",
                    "| A: save on | B: save off | A over B | save in A, ms per token | C: no "
                    "connector | same tokens |",
                    "|---:|---:|---:|---:|---:|---|",
                    f"| {d['save_ms']:.1f} | {d['nosave_ms']:.1f} | "
                    f"{(d['save_ms'] / d['nosave_ms'] - 1) * 100:+.1f}% | "
                    f"{d['save_in_a_ms'] / 160:.3f} ({d['save_in_a_ms'] / 160 / d['save_ms'] * 100:.2f}%) | "
                    f"{d['noconn_ms']:.1f} | {d['same']} |"]
        out.append("")
    if inst_rows:
        n = inst_rows[0]["instances"]
        out += [f"## {n} instances on one host, chats sharing a ~900-token system prompt", "",
                f"{n} vLLM instances, {inst_rows[0]['requests'] // n} requests each (the same "
                "system prompt, distinct questions, 32 tokens out), one after another on "
                f"core {core}. shared: one segment for all; own: a segment each; none: no "
                "connector (vLLM's own prefix cache, on in all three). Every instance also "
                "holds what it uses in its own vLLM cache (loads are copies). KV in shmkv: "
                "the blocks held or cached in the segments at the end.", "",
                "| mode | prompt tokens | cached tokens | hit rate | request seconds | "
                "tokens/s (prompt+generated) | KV in shmkv | segments | outputs = none's |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in inst_rows:
            tps = (r["prompt_tokens"] + r["gen_tokens"]) / r["seconds"]
            out.append(f"| {r['mode']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                       f"{r['cached_tokens'] / r['prompt_tokens'] * 100:.0f}% | "
                       f"{r['seconds']:.1f} | {tps:.0f} | {r['kv_bytes'] / 2**20:.0f} MiB | "
                       f"{r['segments']} | {r['same_outputs']} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", action="store_true", help="the copy micro-benchmark only")
    ap.add_argument("--no-engines", action="store_true", help="skip the TTFT/decode engines")
    ap.add_argument("--no-instances", action="store_true", help="skip the N-instances run")
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--per-instance", type=int, default=4)
    ap.add_argument("--block-sizes", default="16,128", help="shmkv block sizes (divide 128)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--core", default="1", help="taskset core list for the engines")
    ap.add_argument("--out", default=str(HERE / "RESULTS_vllm.md"))
    args = ap.parse_args()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    c = copies()
    e, i = [], []
    if not args.copies:
        if not args.no_engines:
            e = engines(args.reps, args.core,
                        tuple(int(x) for x in args.block_sizes.split(",")))
        if not args.no_instances:
            i = instances(args.instances, args.per_instance, args.core)
    text = report(c, e, i, args.core, load)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
