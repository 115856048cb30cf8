"""Recovery's cost: the scheduled pass (``recover()``) against the full pass
(``recover(full=True)``, what every ``recover()`` ran before), at 16k to 1M blocks.

    python benchmarks/recover_bench.py            # RESULTS_recover.md (about 2 minutes)
    python benchmarks/recover_bench.py --quick    # 16k and 131k only, into benchmarks/out/

Per pool size, in one run, on one segment (1 layer, 1 KV head, head_dim 8, float16,
block_size 4: the pool's bytes do not matter to recovery, its block count does) half used
by 512 live sequences of this process and an eighth cached (published, then freed):

- **idle pass**: nothing dead; median wall time of ``recover()`` vs ``recover(full=True)``;
- **reclaim**: a forked process creates 16 sequences of 64 blocks (1,024 blocks) and is
  SIGKILLed; median wall time of the pass that reclaims it, scheduled vs full (a new
  victim each time, forked and killed untimed);
- **stall** (131k and 1M blocks): a forked appender appends one token at a time (1 layer,
  every 4th append takes a block) and records every call's latency while this process
  recovers back to back -- full passes, scheduled idle passes, or scheduled passes that
  each reclaim a fresh victim (its fork and kill are in the loop); the appender's longest
  call and its 99.9th percentile, against a quiet baseline (the recoverer sleeping).

Medians of repeats; the machine's load is printed and stored.  Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import select
import signal
import sys
import time
import uuid

import numpy as np

import shmkv

HERE = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(os.path.dirname(HERE), "src", "shmkv")
if os.path.abspath(shmkv.__file__).startswith(_SRC):
    sys.exit("recover_bench: run it against the installed shmkv (cd elsewhere / make)")

SIZES = [1 << 14, 1 << 17, 1 << 19, 1 << 20]
BS = 4
LIVE_SEQS = 512
VICTIM_SEQS, VICTIM_BLOCKS = 16, 64


def cpu_model() -> str:
    try:
        m = re.search(r"^model name\s*:\s*(.*)$", open("/proc/cpuinfo").read(), re.M)
        return m.group(1).strip() if m else platform.processor() or "?"
    except OSError:
        return platform.processor() or "?"


def med(xs):
    return float(np.median(np.asarray(xs, dtype=np.float64)))


def fmt(ns: float) -> str:
    if ns < 1e3:
        return f"{ns:.0f} ns"
    if ns < 1e6:
        return f"{ns / 1e3:.1f} µs"
    return f"{ns / 1e6:.2f} ms"


def make_segment(nb: int):
    per = nb // 2 // LIVE_SEQS
    cfg = shmkv.CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, block_size=BS,
                            num_blocks=nb, max_seqs=1024,
                            max_seq_len=(max(per, VICTIM_BLOCKS) + 4) * BS, dtype="float16")
    name = f"shmkv-recbench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cache = shmkv.KVCache.create(name, cfg)
    try:
        fill(cache, nb, per)
    except BaseException:
        cache.unlink()
        cache.close()
        raise
    return name, cache


def fill(cache, nb, per):
    live = []
    for _ in range(LIVE_SEQS):
        s = cache.create_sequence()
        cache.reserve(s, per * BS)
        live.append(s)
    # an eighth of the pool cached: published chains, freed (on the LRU list, indexed)
    rng = np.random.default_rng(nb)
    chain = min(per, 256)
    for _ in range(max(1, nb // 8 // chain)):
        ids = rng.integers(0, 1 << 30, chain * BS, dtype=np.int32)
        s = cache.create_sequence()
        cache.reserve(s, len(ids), tokens=ids)
        cache.commit(s)
        cache.free(s)


def _wait(fd, seconds):
    return bool(select.select([fd], [], [], seconds)[0])


def fork_victim(cache) -> int:
    """A forked process that creates VICTIM_SEQS sequences of VICTIM_BLOCKS blocks and
    waits (bounded) to be SIGKILLed; returns its pid once it holds them."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            for _ in range(VICTIM_SEQS):
                s = cache.create_sequence()
                cache.reserve(s, VICTIM_BLOCKS * BS)
            os.write(w, b"k")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    ok = _wait(r, 60) and os.read(r, 1) == b"k"
    os.close(r)
    if not ok:
        raise RuntimeError("the victim did not report")
    return pid


def kill(pid):
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def timed(fn):
    t0 = time.perf_counter_ns()
    r = fn()
    return time.perf_counter_ns() - t0, r


def bench_passes(cache, nb, quick):
    out = {}
    idle = []
    for _ in range(300):
        dt, r = timed(cache.recover)
        assert r["blocks_visited"] == 0 and not r["full"], r
        idle.append(dt)
    out["idle_after_ns"] = med(idle)
    reps = 15 if nb <= 1 << 17 else (5 if quick else 7)
    full = []
    for _ in range(reps):
        dt, r = timed(lambda: cache.recover(full=True))
        full.append(dt)
    out["idle_before_ns"] = med(full)
    for key, call in (("reclaim_after_ns", cache.recover),
                      ("reclaim_before_ns", lambda: cache.recover(full=True))):
        xs, visited = [], []
        for _ in range(7):
            kill(fork_victim(cache))
            dt, r = timed(call)
            assert r["processes"] == 1 and r["sequences"] == VICTIM_SEQS, r
            xs.append(dt)
            visited.append(r["blocks_visited"])
        out[key] = med(xs)
        out[key.replace("_ns", "_visited")] = int(med(visited))
    return out


def appender(cache, seconds, w):
    """The forked appender: one token per call, every call timed; a json line back."""
    code = 0
    try:
        cfg = cache.config
        k = np.ones((1, 1, 1, cfg.head_dim), np.float16)
        cap = cfg.max_seq_len - BS
        s, n, lat = cache.create_sequence(), 0, []
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            t0 = time.perf_counter_ns()
            cache.append(s, k, k)
            lat.append(time.perf_counter_ns() - t0)
            n += 1
            if n >= cap:
                cache.free(s)
                s, n = cache.create_sequence(), 0
        a = np.asarray(lat, dtype=np.float64)
        os.write(w, (json.dumps({"calls": len(lat), "max_ns": float(a.max()),
                                 "p999_ns": float(np.percentile(a, 99.9)),
                                 "p50_ns": float(np.median(a))}) + "\n").encode())
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def bench_stall(cache, seconds):
    res = {}
    modes = [("quiet", None),
             ("full passes (before)", lambda: cache.recover(full=True)),
             ("scheduled, idle (after)", cache.recover),
             ("scheduled, reclaiming (after)", lambda: (kill(fork_victim(cache)),
                                                        cache.recover()))]
    for label, work in modes:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            appender(cache, seconds, w)
        os.close(w)
        passes = 0
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            if work is None:
                time.sleep(0.05)
            else:
                work()
                passes += 1
        if not _wait(r, seconds + 60):
            kill(pid)
            raise RuntimeError("the appender did not report")
        line = os.read(r, 4096).decode()
        os.close(r)
        os.waitpid(pid, 0)
        d = json.loads(line)
        d["passes"] = passes
        res[label] = d
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    sizes = SIZES[:2] if args.quick else SIZES
    stall_sizes = [1 << 17] if args.quick else [1 << 17, 1 << 20]
    md = args.md or (os.path.join(HERE, "out", "RESULTS_recover.md") if args.quick
                     else os.path.join(HERE, "RESULTS_recover.md"))
    cpu = cpu_model()
    load0 = os.getloadavg()[0]
    print(f"CPU: {cpu} ({os.cpu_count()} CPUs), load {load0:.2f}", file=sys.stderr)
    t_start = time.monotonic()
    rows, stalls = {}, {}
    for nb in sizes:
        name, cache = make_segment(nb)
        try:
            print(f"{nb} blocks ...", file=sys.stderr)
            rows[nb] = bench_passes(cache, nb, args.quick)
            print(f"  {json.dumps(rows[nb])}", file=sys.stderr)
            if nb in stall_sizes:
                stalls[nb] = bench_stall(cache, 3.0 if args.quick else 4.0)
                print(f"  {json.dumps(stalls[nb])}", file=sys.stderr)
            assert cache.check() == []
        finally:
            cache.unlink()
            cache.close()
    took = time.monotonic() - t_start
    load1 = os.getloadavg()[0]

    lines = [
        "# Recovery: the scheduled pass vs the full pass",
        "",
        f"`benchmarks/recover_bench.py` on **{cpu}** ({os.cpu_count()} CPUs), load "
        f"{load0:.2f} at the start, {load1:.2f} at the end; {took:.0f} s.  "
        f"Medians (wall time of the call).  Segment: 1 layer, 1 KV head, head_dim 8, float16, "
        f"block_size {BS}; half the pool used by {LIVE_SEQS} live sequences, an eighth "
        "cached.  *Before* is `recover(full=True)`, the pass every `recover()` ran before "
        "(O(pool) under the pool lock); *after* is `recover()`: the gate, one recoverer, the "
        "pass of what died.",
        "",
        f"Reclaim: one SIGKILLed process holding {VICTIM_SEQS} sequences x {VICTIM_BLOCKS} "
        f"blocks ({VICTIM_SEQS * VICTIM_BLOCKS} blocks); `visited` is the pass's "
        "`blocks_visited`.",
        "",
        "| blocks | idle before | idle after | ratio | reclaim before | reclaim after | ratio "
        "| visited before / after |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for nb, r in rows.items():
        lines.append(
            f"| {nb:,} | {fmt(r['idle_before_ns'])} | {fmt(r['idle_after_ns'])} | "
            f"{r['idle_before_ns'] / r['idle_after_ns']:,.0f}x | {fmt(r['reclaim_before_ns'])} | "
            f"{fmt(r['reclaim_after_ns'])} | {r['reclaim_before_ns'] / r['reclaim_after_ns']:,.1f}x"
            f" | {r['reclaim_before_visited']:,} / {r['reclaim_after_visited']:,} |")
    lines += [
        "",
        "## The longest stall of an appending process while another recovers",
        "",
        "A forked process appends one token per call for the whole window; this process "
        "recovers back to back meanwhile (*reclaiming*: each pass reclaims a victim forked "
        "and killed in the same loop, so there are fewer passes).",
        "",
        "| blocks | recoverer | passes | appends | median | p99.9 | longest |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for nb, modes in stalls.items():
        for label, d in modes.items():
            lines.append(f"| {nb:,} | {label} | {d['passes']:,} | {d['calls']:,} | "
                         f"{fmt(d['p50_ns'])} | {fmt(d['p999_ns'])} | {fmt(d['max_ns'])} |")
    lines.append("")
    os.makedirs(os.path.dirname(md), exist_ok=True)
    with open(md, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {md}", file=sys.stderr)


if __name__ == "__main__":
    main()
