"""A vLLM fleet on two hosts sharing through the remote tier: what a second host gets.

    make bench-hosts                      # RESULTS_hosts.md + hosts.png (~20 min on 2 cores)
    .venv-vllm/bin/python benchmarks/hosts_bench.py --quick --out /tmp/hosts.md

Hosts are tools/netlab.py's network namespaces (a switch of their own, each host its own
/dev/shm and so its own segment); a Redis Cluster of 3 masters + 3 replicas over three
hosts; ``vllm serve`` (SmolLM2-135M-Instruct, bfloat16, ``--enforce-eager``) on host A
pinned to core 0 and on host B pinned to core 1, each with ``ShmkvConnector`` on its own
segment.  Latency between B and the cluster is added by the lab's delaying proxy (this
kernel has no netem).  Times are client-side, streamed: TTFT is the first content chunk.

1. **B's first token for A's prefixes**: per added delay (0, 0.2, 1, 5 ms each way), a
   few new system prompts (~1000 tokens): A serves each (one token) and writes it through
   to the tier; B is asked the same chat (its prefix in the tier: B loads it over the
   network) and, in alternating order, the same chat under a ``cache_salt`` of its own
   (nothing to find: recompute).  Medians and their ratio.
2. **Multi-round QA across hosts** (LMCache's multi-round QA, scaled to this machine:
   users x rounds, one shared system prompt, each user's history growing by a question
   and the fleet's own answer per round): round r of user u goes to host (u + r) % 2, so
   every user's next round lands on the other host -- what a fleet without session
   affinity does.  The users of a round are sent at once.  With the tier on (at 0.2 and
   1 ms) and off (each host its own segment only): cached share of prompt tokens (vLLM's
   own prefix cache, and the connector's loads, of which from the tier), TTFT p50/p99,
   output tokens/s.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "tests" / "vllm"), str(HERE)]
from netlab import Lab, lab_available  # noqa: E402
from serve_helpers import (  # noqa: E402
    ServeInstance,
    connector_config,
    get_text,
    parse_metrics,
    stream_completion,
)

GPL = "/usr/share/common-licenses/GPL-3"
SEG = "shmkv-bench-hosts"
SB = 16


def text(a: int, b: int) -> str:
    with open(GPL) as f:
        t = f.read()
    n = len(t)
    return "".join(t[(a + i) % n] for i in range(b - a)) if b > n else t[a:b]


def stream_chat(url: str, messages: list[dict], max_tokens: int, **kw: Any) -> dict:
    """One greedy streamed chat completion (serve_helpers.stream_completion)."""
    return stream_completion(url, "/v1/chat/completions", {
        "model": "smol", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, **kw})


class Fleet:
    def __init__(self, lab: Lab, model: str, tmp: Path, tier_url: Optional[str]) -> None:
        self.lab = lab
        extra: dict = {"size_gib": 0.5}
        if tier_url:
            extra.update(tier=tier_url, tier_wait=1.0, tier_timeout=0.5)
        kv = connector_config(SEG, **extra)
        self.insts = {}
        for core, h in enumerate(("a", "b")):
            self.insts[h] = ServeInstance(
                sys.executable, model, tmp / f"{h}-{'tier' if tier_url else 'local'}.log",
                core=core, kv=kv, prefix=tuple(lab.prefix(h)),
                via=functools.partial(lab.call, h))
        for x in self.insts.values():
            x.wait_ready()
        for h in ("a", "b"):                    # an instance's first requests are slow
            for i in range(2):
                self.chat(h, [{"role": "user", "content": f"Warm up {i} {time.time()}"}], 4)

    def chat(self, host: str, messages: list[dict], max_tokens: int, **kw: Any) -> dict:
        return self.lab.call(host, stream_chat, self.insts[host].url, messages, max_tokens,
                             **kw)

    def metrics(self, host: str) -> dict:
        return parse_metrics(self.lab.call(host, get_text, self.insts[host].url + "/metrics"))

    def tier_hits(self, host: str) -> int:
        r = self.lab.run(host, [sys.executable, str(ROOT / "tests" / "vllm" / "hosts_worker.py"),
                                "stats", SEG], cwd="/tmp")
        return int(json.loads(r.stdout)["tier_hits"]) if r.returncode == 0 else 0

    def stop(self) -> None:
        for x in self.insts.values():
            x.stop()


def tier_keys(lab: Lab, c) -> int:
    masters = lab.masters(c)

    def run() -> int:
        import redis
        n = 0
        for ip, port in masters:
            r = redis.Redis(ip, port, socket_timeout=5)
            try:
                n += int(r.dbsize())
            finally:
                r.close()
        return n
    return int(lab.call("r", run))


def wait_keys(lab: Lab, c, want: int, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while tier_keys(lab, c) < want:
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the tier did not reach {want} keys in {timeout} s")
        time.sleep(0.1)
    time.sleep(0.3)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def first_token(lab: Lab, c, fleet: Fleet, delays: list[float], n: int, tag: str) -> list[dict]:
    rows = []
    for d in delays:
        if d:
            lab.delay("b", d / 1e3)
        try:
            hit, rec, cached, prompt = [], [], [], []
            for i in range(n):
                chat = [{"role": "system", "content": f"{tag} delay {d} prompt {i}:\n"
                         + text(3000 * i + 500, 3000 * i + 3100)},
                        {"role": "user", "content": "What is this about?"}]
                before = tier_keys(lab, c)
                a = fleet.chat("a", chat, 1)
                wait_keys(lab, c, before + a["prompt"] // 128 * 128 // SB)
                order = ["hit", "rec"] if i % 2 == 0 else ["rec", "hit"]
                for what in order:
                    if what == "hit":
                        r = fleet.chat("b", chat, 1)
                        hit.append(r["ttft"])
                        cached.append(r["cached"])
                        prompt.append(r["prompt"])
                    else:
                        r = fleet.chat("b", chat, 1, cache_salt=f"{tag}-{d}-{i}")
                        rec.append(r["ttft"])
            rows.append({"delay_ms": d, "n": n, "prompt": statistics.median(prompt),
                         "cached": statistics.median(cached),
                         "hit_ms": statistics.median(hit) * 1e3,
                         "recompute_ms": statistics.median(rec) * 1e3,
                         "ratio": statistics.median(hit) / statistics.median(rec),
                         "hits": hit, "recs": rec})
            print(f"  delay {d} ms: B's TTFT {rows[-1]['hit_ms']:.0f} ms with A's prefix "
                  f"vs {rows[-1]['recompute_ms']:.0f} ms recomputed "
                  f"({rows[-1]['ratio']:.2f}x)", flush=True)
        finally:
            if d:
                lab.undelay("b")
    return rows


def _ask(fleet: Fleet, host: str, messages: list[dict], answer: int, got: dict,
         u: int) -> None:
    got[u] = fleet.chat(host, messages, answer)


def qa(lab: Lab, fleet: Fleet, users: int, rounds: int, sys_chars: int, q_chars: int,
       answer: int, tag: str, delay: float) -> dict:
    if delay:
        lab.delay("b", delay / 1e3)
    try:
        system = {"role": "system", "content": f"{tag}: you answer questions on this "
                  f"document.\n" + text(1000, 1000 + sys_chars)}
        hist: list[list[dict]] = [[system] for _ in range(users)]
        m0 = {h: fleet.metrics(h) for h in ("a", "b")}
        t0_hits = {h: fleet.tier_hits(h) for h in ("a", "b")}
        res: list[dict] = []
        t0 = time.perf_counter()
        for r in range(rounds):
            asks = []
            for u in range(users):
                start = 6000 + (u * rounds + r) * q_chars
                hist[u].append({"role": "user", "content": f"User {u}, question {r}: what "
                                f"does this part say?\n" + text(start, start + q_chars)})
                asks.append((u, "ab"[(u + r) % 2]))
            got: dict = {}
            ts = [threading.Thread(target=_ask, args=(fleet, h, hist[u], answer, got, u))
                  for u, h in asks]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            for u, h in asks:
                hist[u].append({"role": "assistant", "content": got[u]["text"]})
                res.append({**got[u], "host": h, "round": r})
        wall = time.perf_counter() - t0
        m1 = {h: fleet.metrics(h) for h in ("a", "b")}
        tier_tokens = sum(fleet.tier_hits(h) - t0_hits[h] for h in ("a", "b")) * SB

        def delta(key: str) -> float:
            return sum(m1[h].get(key, 0.0) - m0[h].get(key, 0.0) for h in ("a", "b"))
        prompt = delta("vllm:prompt_tokens_total")
        local, ext = delta("vllm:prefix_cache_hits_total"), \
            delta("vllm:external_prefix_cache_hits_total")
        later = [x for x in res if x["round"] > 0]
        return {"requests": len(res), "wall_s": wall,
                "prompt_tokens": sum(x["prompt"] for x in res),
                "cached_share": sum(x["cached"] for x in res) / max(1, sum(x["prompt"]
                                                                          for x in res)),
                "later_cached_share": sum(x["cached"] for x in later)
                / max(1, sum(x["prompt"] for x in later)),
                "local_share": local / max(1.0, prompt), "external_share": ext / max(1.0, prompt),
                "tier_share": tier_tokens / max(1.0, prompt),
                "ttft_p50": pct([x["ttft"] for x in res], 50) * 1e3,
                "ttft_p99": pct([x["ttft"] for x in res], 99) * 1e3,
                "later_ttft_p50": pct([x["ttft"] for x in later], 50) * 1e3,
                "out_tok_s": sum(x["completion"] for x in res) / wall}
    finally:
        if delay:
            lab.undelay("b")


def main() -> int:
    # a SIGTERM (timeout, CI) ends the run through its finally blocks: engines stopped,
    # segments and namespaces removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer prompts, users, rounds")
    ap.add_argument("--out", default=str(HERE / "RESULTS_hosts.md"))
    ap.add_argument("--replot", action="store_true",
                    help="only draw the plot (next to --out) from the tables in --out")
    a = ap.parse_args()
    png = Path(a.out).parent / "hosts.png"
    if a.replot:
        plot(parse(Path(a.out).read_text()), png)
        return 0
    why = lab_available()
    if why:
        print(f"hosts_bench: {why}")
        return 2
    from serve_bench import machine, others
    from vllm_helpers import _model_dir

    n = 2 if a.quick else 3
    users, rounds = (4, 2) if a.quick else (4, 3)
    delays = [0.0, 1.0] if a.quick else [0.0, 0.2, 1.0, 5.0]
    qa_delays = [1.0] if a.quick else [0.2, 1.0]
    info, started = machine(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0, busy0 = os.getloadavg(), others()
    model = _model_dir()
    tmp = Path(f"/tmp/shmkv-hosts-bench-{os.getpid()}")
    tmp.mkdir(exist_ok=True)
    t_start = time.monotonic()
    out: dict = {"qa": {}}
    qa_args = dict(users=users, rounds=rounds, sys_chars=4400, q_chars=1600, answer=32)
    with Lab(["a", "b", "r"]) as lab:
        c = lab.cluster(["a", "b", "r"], replicas=["b", "r", "a"])
        fleet = Fleet(lab, model, tmp, c.url)
        try:
            print("B's first token for A's prefixes", flush=True)
            out["ttft"] = first_token(lab, c, fleet, delays, n, "t")
            for d in qa_delays:
                print(f"multi-round QA, tier on, {d} ms", flush=True)
                out["qa"][f"tier, +{d} ms"] = qa(lab, fleet, tag=f"qa-tier-{d}", delay=d,
                                                 **qa_args)
        finally:
            fleet.stop()
        fleet = Fleet(lab, model, tmp, None)
        try:
            print("multi-round QA, tier off", flush=True)
            out["qa"]["no tier"] = qa(lab, fleet, tag="qa-local", delay=0.0, **qa_args)
        finally:
            fleet.stop()
    total = time.monotonic() - t_start
    Path(a.out).write_text(report(out, info, started, load0, os.getloadavg(), busy0,
                                  others(), total, qa_args))
    print(Path(a.out).read_text())
    plot(parse(Path(a.out).read_text()), png)
    return 0


def report(out, info, started, l0, l1, b0, b1, total, qa_args) -> str:
    v = info.get("versions", {})
    L = ["# vLLM on two hosts through the remote tier (benchmarks/hosts_bench.py)", "",
         f"Measured {started} by `make bench-hosts` ({total / 60:.1f} min). Machine: "
         f"{info.get('cpus')} CPUs ({info.get('cpu')}), {info.get('mem_gib')} GiB; ISA "
         f"flags: {info.get('isa')} (shmkv kernels: {info.get('shmkv_isa', '?')}). "
         f"Versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if k != "vllm-router")
         + ".", "",
         f"Load average (1/5/15 min) before: {' '.join(f'{x:.2f}' for x in l0)}, after: "
         f"{' '.join(f'{x:.2f}' for x in l1)}. Other processes at the start: {b0}; at the "
         f"end: {b1}.", "",
         "Hosts: network namespaces of tools/netlab.py on one machine (a switch of their "
         "own; each host its own /dev/shm and segment); Redis Cluster of 3 masters + 3 "
         "replicas on three hosts; `vllm serve` (SmolLM2-135M-Instruct, bfloat16, "
         "`--enforce-eager`) on host A (core 0) and host B (core 1), each with the "
         "connector (`tier_wait` 1 s, `tier_timeout` 0.5 s). Added latency: B <-> cluster, "
         "each way, by the lab's delaying proxy. TTFT: first streamed content chunk, "
         "client side.", "",
         "## B's first token for a prefix A served", "",
         "Per delay, new system prompts of ~600 tokens: A serves each (writes it through); "
         "B is asked the same chat (loads A's blocks over the network) and, alternately "
         "first and second, under a cache_salt of its own (recomputes). Medians.", "",
         "| added delay (each way) | prompts | prompt tokens | cached on B | TTFT B, A's "
         "prefix | TTFT B, recomputed | ratio |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out["ttft"]:
        L.append(f"| {r['delay_ms']} ms | {r['n']} | {r['prompt']:.0f} | {r['cached']:.0f} | "
                 f"{r['hit_ms']:.0f} ms | {r['recompute_ms']:.0f} ms | {r['ratio']:.2f}x |")
    one = [r for r in out["ttft"] if r["delay_ms"] == 1.0]
    if one:
        ok = one[0]["ratio"] <= 0.3
        L += ["", f"Target: B's TTFT for A's prefixes <= 0.3x recompute at 1 ms: "
              f"{one[0]['ratio']:.2f}x: **{'met' if ok else 'NOT met'}**."]
    q = qa_args
    L += ["", "## Multi-round QA across two hosts", "",
          f"{q['users']} users x {q['rounds']} rounds; one system prompt of ~1000 tokens "
          f"shared by all; each round adds a question of ~{q['q_chars'] // 4} tokens and the "
          f"fleet's own answer ({q['answer']} tokens, `ignore_eos`) to the user's history; "
          "round r of user u is served by host (u + r) % 2 (each user's next round on the "
          "other host); a round's users at once. Cached share: cached / prompt tokens over "
          "all requests (later rounds: rounds >= 1); local: vLLM's own prefix cache; "
          "external: loaded by the connector (from the host's segment), of which tier: "
          "blocks that came over the network.", "",
          "| config | requests | prompt tokens | cached | cached, later rounds | local | "
          "external | of it from the tier | TTFT p50 | TTFT p99 | TTFT p50, later rounds | "
          "out tok/s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in out["qa"].items():
        L.append(f"| {name} | {r['requests']} | {r['prompt_tokens']} | "
                 f"{r['cached_share']:.1%} | {r['later_cached_share']:.1%} | "
                 f"{r['local_share']:.1%} | {r['external_share']:.1%} | {r['tier_share']:.1%} | "
                 f"{r['ttft_p50']:.0f} ms | {r['ttft_p99']:.0f} ms | "
                 f"{r['later_ttft_p50']:.0f} ms | {r['out_tok_s']:.1f} |")
    L += ["", "Raw TTFTs (s) of part 1, per delay: " + "; ".join(
        f"{r['delay_ms']} ms: hit {[round(x, 3) for x in r['hits']]}, recompute "
        f"{[round(x, 3) for x in r['recs']]}" for r in out["ttft"]), ""]
    return "\n".join(L)


def parse(md: str) -> dict:
    """The two tables of a report, back as numbers (the plot is drawn from what the
    committed report says)."""
    ttft, qa_rows = [], {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0].endswith(" ms") and cells[4].endswith(" ms"):
            ttft.append({"delay_ms": float(cells[0][:-3]), "hit_ms": float(cells[4][:-3]),
                         "recompute_ms": float(cells[5][:-3])})
        elif len(cells) == 12 and cells[1].isdigit():
            pc = [float(c.rstrip("%")) for c in cells[3:8]]
            qa_rows[cells[0]] = {"cached": pc[0], "later": pc[1], "local": pc[2],
                                 "external": pc[3], "tier": pc[4],
                                 "later_ttft_p50": float(cells[10].split()[0]) / 1e3}
    return {"ttft": ttft, "qa": qa_rows}


def plot(d: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    xs = range(len(d["ttft"]))
    a1.bar([x - 0.2 for x in xs], [r["recompute_ms"] / 1e3 for r in d["ttft"]], 0.4,
           label="B recomputes", color="#999999")
    a1.bar([x + 0.2 for x in xs], [r["hit_ms"] / 1e3 for r in d["ttft"]], 0.4,
           label="B loads A's prefix from the tier", color="#1f77b4")
    a1.set_xticks(list(xs))
    a1.set_xticklabels([f"+{r['delay_ms']:g} ms" for r in d["ttft"]])
    a1.set_ylabel("TTFT on host B (s)")
    a1.set_title("B's first token, ~600-token prompt A served")
    a1.set_ylim(0, 1.3 * max(r["recompute_ms"] / 1e3 for r in d["ttft"]))
    a1.legend(fontsize=8, loc="upper right")
    names = list(d["qa"])
    q = [d["qa"][n] for n in names]
    a2.bar(names, [r["local"] for r in q], label="vLLM's own cache", color="#999999")
    a2.bar(names, [r["external"] - r["tier"] for r in q], bottom=[r["local"] for r in q],
           label="connector: this host's segment", color="#2ca02c")
    a2.bar(names, [r["tier"] for r in q],
           bottom=[r["local"] + r["external"] - r["tier"] for r in q],
           label="connector: from the tier", color="#1f77b4")
    for i, r in enumerate(q):
        a2.text(i, r["local"] + r["external"] + 1, f"TTFT p50 later rounds "
                f"{r['later_ttft_p50']:.1f} s", ha="center", fontsize=8)
    a2.set_ylabel("cached share of prompt tokens (%)")
    a2.set_ylim(0, 100)
    a2.set_title("multi-round QA, users change host every round")
    a2.legend(fontsize=8, loc="lower right")
    fig.suptitle("vllm serve on two hosts (network namespaces), Redis Cluster tier")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
