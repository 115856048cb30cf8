"""What the connector costs when nothing is shared: paired, interleaved runs of a workload
with no repeated prefix, with and without shmkv.

    make bench-noreuse                   # RESULTS_noreuse.md (~15 min on 2 cores)
    .venv-vllm/bin/python benchmarks/noreuse_bench.py --pairs 4 --out /tmp/noreuse.md

Two ``vllm serve`` instances run at once (SmolLM2-135M-Instruct, vLLM's default dtype,
``--enforce-eager``), each pinned to a core of its own: X with ``ShmkvConnector`` on a
segment, Y without.  A pair is one run of the load on X and one on Y, one after the other
(the other instance idle), the order alternating pair by pair (ABBA); after half of the
pairs both instances are restarted on each other's core, so a faster core favours
neither.  The load: requests whose prompts are fresh random token ids (nothing to find
in any cache; 250 of them, so that with 16 generated each request fills two vLLM blocks
that the connector saves -- a prompt under one block of 128 saves nothing and would
measure nothing), a fixed number in flight, ``ignore_eos``, streamed.  Per run: output
tokens/s over the run's wall time and the median TTFT; per pair the ratio X / Y.  The
connector's own clock: ``vllm:shmkv_save_seconds`` + ``vllm:shmkv_load_seconds`` (its
per-step save and load work) over X's run time.  The load average is printed before each
pair: a busy machine moves every figure.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "tests" / "vllm"), str(HERE)]
from serve_helpers import ServeInstance, connector_config, stream_completion  # noqa: E402


def stream(url: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(TTFT, completion tokens) of one streamed completion of token ids."""
    r = stream_completion(url, "/v1/completions", {
        "model": "smol", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    return r["ttft"], r["completion"]


def run_load(url: str, rng: random.Random, requests: int, tokens: int, out: int,
             concurrency: int) -> dict:
    prompts = [[rng.randrange(1000, 40000) for _ in range(tokens)] for _ in range(requests)]
    ttfts: list[float] = []
    done = [0]
    lock = threading.Lock()
    todo = list(prompts)

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                p = todo.pop()
            t, n = stream(url, p, out)
            with lock:
                ttfts.append(t)
                done[0] += n
    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    return {"wall": wall, "tok_s": done[0] / wall, "ttft_p50": statistics.median(ttfts)}


def conn_clock(x: ServeInstance) -> float:
    m = x.metrics()
    return (m.get("vllm:shmkv_save_seconds_sum", 0.0)
            + m.get("vllm:shmkv_load_seconds_sum", 0.0))


def main() -> int:
    # a SIGTERM (timeout, CI) ends the run through its finally blocks: engines stopped,
    # segments and namespaces removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=250)   # + 16 out: 2 whole vLLM blocks saved
    ap.add_argument("--out-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--out", default=str(HERE / "RESULTS_noreuse.md"))
    a = ap.parse_args()
    from serve_bench import machine, others
    from vllm_helpers import _model_dir

    import shmkv

    info, started = machine(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    model = _model_dir()
    tmp = Path(f"/tmp/shmkv-noreuse-{os.getpid()}")
    tmp.mkdir(exist_ok=True)
    seg = f"shmkv-noreuse-{os.getpid()}"
    rng = random.Random(0)
    rows: list[dict] = []
    busy0 = others()
    t_start = time.monotonic()
    try:
        for half in range(2):
            cx, cy = (0, 1) if half == 0 else (1, 0)
            X = ServeInstance(sys.executable, model, tmp / f"X{half}.log", core=cx,
                              kv=connector_config(seg, size_gib=0.5))
            Y = ServeInstance(sys.executable, model, tmp / f"Y{half}.log", core=cy)
            try:
                X.wait_ready()
                Y.wait_ready()
                for inst in (X, Y):          # warm-up: an instance's first runs are slow
                    run_load(inst.url, rng, a.concurrency, a.tokens, a.out_tokens,
                             a.concurrency)
                for _ in range(a.pairs // 2 + (a.pairs % 2 if half else 0)):
                    k = len(rows)
                    load1 = os.getloadavg()[0]
                    order = ("X", "Y") if k % 2 == 0 else ("Y", "X")
                    got = {}
                    for which in order:
                        inst = X if which == "X" else Y
                        c0 = conn_clock(X) if which == "X" else 0.0
                        got[which] = run_load(inst.url, rng, a.requests, a.tokens,
                                              a.out_tokens, a.concurrency)
                        if which == "X":
                            time.sleep(1.5)  # the last step's figures reach /metrics
                            got["clock"] = conn_clock(X) - c0
                    rows.append({"pair": k, "cores": f"X:{cx} Y:{cy}", "order": "".join(order),
                                 "load1": load1, **{f"{w}_{m}": got[w][m] for w in "XY"
                                                    for m in ("tok_s", "ttft_p50", "wall")},
                                 "clock": got["clock"]})
                    r = rows[-1]
                    print(f"pair {k} ({r['order']}, {r['cores']}, load {load1:.2f}): "
                          f"with {r['X_tok_s']:.1f} tok/s, without {r['Y_tok_s']:.1f} "
                          f"({r['X_tok_s'] / r['Y_tok_s']:.3f}); TTFT p50 "
                          f"{r['X_ttft_p50'] * 1e3:.0f} vs {r['Y_ttft_p50'] * 1e3:.0f} ms; "
                          f"connector clock {r['clock']:.3f} s of {r['X_wall']:.1f} s",
                          flush=True)
            finally:
                X.stop()
                Y.stop()
    finally:
        try:
            shmkv.KVCache.attach(seg).unlink()
        except Exception:
            pass
    total = time.monotonic() - t_start
    text = report(rows, info, started, busy0, others(), total, a)
    Path(a.out).write_text(text)
    print(text)
    return 0


def report(rows, info, started, b0, b1, total, a) -> str:
    v = info.get("versions", {})
    thr = [r["X_tok_s"] / r["Y_tok_s"] for r in rows]
    ttft = [r["X_ttft_p50"] / r["Y_ttft_p50"] for r in rows]
    clock = sum(r["clock"] for r in rows) / sum(r["X_wall"] for r in rows)
    q = statistics.quantiles
    L = ["# No reuse: what the connector costs when nothing is shared "
         "(benchmarks/noreuse_bench.py)", "",
         f"Measured {started} by `make bench-noreuse` ({total / 60:.1f} min). Machine: "
         f"{info.get('cpus')} CPUs ({info.get('cpu')}), {info.get('mem_gib')} GiB; ISA flags: "
         f"{info.get('isa')} (shmkv kernels: {info.get('shmkv_isa', '?')}). Versions: "
         + ", ".join(f"{k} {x}" for k, x in v.items() if k != "vllm-router") + ".", "",
         f"Other processes at the start: {b0}; at the end: {b1}. Load average (1 min) "
         "before each pair: in the table.", "",
         f"Two `vllm serve` instances at once (SmolLM2-135M-Instruct, bfloat16, "
         f"`--enforce-eager`), each pinned to a core: X with the connector, Y without; "
         f"pairs interleaved (order alternating), cores swapped after half of them. Load per "
         f"run: {a.requests} requests of {a.tokens} fresh random token ids, "
         f"{a.out_tokens} tokens out (`ignore_eos`), {a.concurrency} in flight, streamed.", "",
         "| pair | order | cores | load1 | with: tok/s | without: tok/s | ratio | with: "
         "TTFT p50 | without: TTFT p50 | ratio | connector clock |",
         "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r, t, f in zip(rows, thr, ttft):
        L.append(f"| {r['pair']} | {r['order']} | {r['cores']} | {r['load1']:.2f} | "
                 f"{r['X_tok_s']:.2f} | {r['Y_tok_s']:.2f} | {t:.3f} | "
                 f"{r['X_ttft_p50'] * 1e3:.0f} ms | {r['Y_ttft_p50'] * 1e3:.0f} ms | {f:.3f} | "
                 f"{r['clock'] * 1e3:.0f} ms of {r['X_wall']:.1f} s |")
    qt = q(thr, n=4) if len(thr) >= 2 else [thr[0]] * 3
    qf = q(ttft, n=4) if len(ttft) >= 2 else [ttft[0]] * 3
    over_t = 1 / statistics.median(thr) - 1
    over_f = statistics.median(ttft) - 1
    L += ["", f"Over {len(rows)} pairs: throughput with / without, median "
          f"{statistics.median(thr):.3f} (quartiles {qt[0]:.3f}-{qt[2]:.3f}): overhead "
          f"{over_t:+.1%}; TTFT p50 with / without, median {statistics.median(ttft):.3f} "
          f"(quartiles {qf[0]:.3f}-{qf[2]:.3f}): {over_f:+.1%}. Pairs where the instance with "
          f"the connector was faster: {sum(t > 1 for t in thr)} of {len(thr)}. The "
          f"connector's own clock (save + load work per step): {clock:.2%} of X's run time.",
          "", f"Target: <= 2% on throughput and TTFT: throughput "
          f"**{'met' if over_t <= 0.02 else 'NOT met'}**, TTFT "
          f"**{'met' if over_f <= 0.02 else 'NOT met'}** (medians of the per-pair ratios).", ""]
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
