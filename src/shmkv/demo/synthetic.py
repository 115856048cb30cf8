"""shmkv demo: simulated inference traffic from several worker processes on one cache.

Each worker plays an inference engine: requests arrive (a shared system prompt plus a
user part, so prompts prefilled by any worker are prefix-cache hits for all), the rest
of each prompt is prefilled in chunks, then every live sequence gains one token per
decode step; some requests fork into beams (copy-on-write); finished requests are freed.
When the pool runs out, the oldest request is preempted (freed), as vLLM's scheduler
would.  One extra worker is SIGKILLed halfway through, holding sequences and blocks:
recovery reclaims them.  The parent shows progress, then throughput, prefix hits, peak
blocks, COW copies, what recovery reclaimed and the result of ``check()``, and unlinks
its segment.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import time
import uuid

import numpy as np

from ..cache import KVCache
from ..config import CacheConfig
from ..errors import CacheFullError

PRESETS = {
    # name: (layers, kv heads, head_dim, block_size, num_blocks)
    "tiny": (2, 2, 16, 16, 512),
    "small": (8, 8, 128, 16, 1024),          # 1 MiB blocks, 1 GiB pool
    "llama3-8b": (32, 8, 128, 16, 512),      # 2 MiB blocks, 1 GiB pool
}


def _worker(name: str, wid: int, duration: float, seed: int, prompt_max: int,
            gen_max: int, concurrency: int, beam_every: int, q, n_system: int = 8) -> None:
    """One simulated engine; reports its counts on q at the end (and every second)."""
    rng = np.random.default_rng(seed)
    shared = np.random.default_rng(12345)           # the same system prompts everywhere
    system = [shared.integers(0, 32000, int(shared.integers(128, 384)))
              for _ in range(n_system)]
    cache = KVCache.attach(name)
    try:
        cfg = cache.config
        L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        dt = cfg.numpy_dtype
        chunk = 64
        pre = rng.standard_normal((L, chunk, H, D)).astype(dt)
        tok = rng.standard_normal((L, 1, H, D)).astype(dt)
        live = []            # [sid, tokens still to generate]
        counts = dict(prefill_tokens=0, decode_tokens=0, requests=0, finished=0, forks=0,
                      preempted=0, bytes=0, gathers=0, prefix_hit_tokens=0)
        t_start = time.monotonic()
        q.put(("start", wid, t_start))
        t_end = t_start + duration
        next_report = t_start + 1.0
        step = 0
        while time.monotonic() < t_end:
            step += 1
            # admit new requests up to the concurrency target
            while len(live) < concurrency:
                user = rng.integers(0, 32000, int(rng.integers(16, prompt_max + 1)))
                ids = (np.concatenate([system[int(rng.integers(len(system)))], user])
                       if len(system) else user)
                try:
                    sid = cache.create_sequence(tokens=ids)   # shares any cached prefix
                except CacheFullError:
                    break
                n = len(ids)
                hit = cache.seq_len(sid)
                counts["prefix_hit_tokens"] += hit
                try:
                    done = hit
                    while done < n:
                        m = min(chunk, n - done)
                        cache.append(sid, pre[:, :m], pre[:, :m], tokens=ids[done:done + m])
                        done += m
                except CacheFullError:
                    cache.free(sid)
                    if live:                         # preempt the oldest request
                        cache.free(live.pop(0)[0])
                        counts["preempted"] += 1
                    break
                counts["prefill_tokens"] += n - hit
                counts["bytes"] += (n - hit) * cfg.bytes_per_token
                counts["requests"] += 1
                live.append([sid, int(rng.integers(8, gen_max + 1))])
                if beam_every and counts["requests"] % beam_every == 0:
                    for _ in range(int(rng.integers(1, 4))):     # beam search: 2..4 beams
                        try:
                            live.append([cache.fork(sid), live[-1][1]])
                            counts["forks"] += 1
                        except CacheFullError:
                            break
            # one decode step: every live sequence gains a token
            survivors = []
            for sid, left in live:
                try:
                    t_id = rng.integers(0, 32000, 1)
                    if step % 2:
                        cache.append(sid, tok, tok, tokens=t_id)
                    else:                                 # vLLM flow: reserve, write, commit
                        slots = cache.reserve(sid, 1, tokens=t_id)
                        for layer in range(L):
                            cache.write(layer, slots, tok[layer], tok[layer])
                        cache.commit(sid)
                except CacheFullError:
                    cache.free(sid)                        # preempted
                    counts["preempted"] += 1
                    continue
                counts["decode_tokens"] += 1
                counts["bytes"] += cfg.bytes_per_token
                if left <= 1:
                    if rng.random() < 0.1:               # read back now and then
                        k, _ = cache.gather(sid)
                        counts["gathers"] += 1
                        counts["bytes"] += 2 * k.nbytes
                    cache.free(sid)
                    counts["finished"] += 1
                else:
                    survivors.append([sid, left - 1])
            live = survivors
            if time.monotonic() >= next_report:
                q.put(("progress", wid, dict(counts)))
                next_report += 1.0
        for sid, _ in live:
            cache.free(sid)
        counts["t_start"], counts["t_end"] = t_start, time.monotonic()
        q.put(("done", wid, counts))
    finally:
        cache.close()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def build_parser(prog: str = "shmkv demo --synthetic") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Spawn worker processes that run simulated inference traffic (chunked "
                    "prefill, decode steps, beam forks, frees) against one fresh shmkv "
                    "segment; print throughput, peak blocks, COW copies and check(). "
                    "The segment is unlinked at the end.")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of traffic (default 8)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small",
                   help="model shape and pool size (default small: 8 layers, 8 KV heads, "
                        "head_dim 128, fp16, 1024 blocks of 16 tokens = 1 GiB)")
    p.add_argument("--num-blocks", type=int, default=None, help="override the pool size")
    p.add_argument("--concurrency", type=int, default=24,
                   help="live requests per worker (default 24)")
    p.add_argument("--prompt-max", type=int, default=512, help="longest prompt (default 512)")
    p.add_argument("--gen-max", type=int, default=128, help="longest generation (default 128)")
    p.add_argument("--beam-every", type=int, default=5,
                   help="every Nth request forks into beams (0: never; default 5)")
    p.add_argument("--system-prompts", type=int, default=8,
                   help="shared system prompts requests start with (prefix-cache hits "
                        "across workers; 0: none; default 8)")
    p.add_argument("--no-kill", action="store_true",
                   help="do not run the extra worker that is SIGKILLed halfway through")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1 or args.duration <= 0:
        print("shmkv demo: --workers must be >= 1 and --duration > 0", file=sys.stderr)
        return 2
    L, H, D, bs, nb = PRESETS[args.preset]
    cfg = CacheConfig(num_layers=L, num_kv_heads=H, head_dim=D, block_size=bs,
                      num_blocks=args.num_blocks or nb, dtype="float16", max_seqs=1024,
                      max_procs=max(8, args.workers + 2))
    name = f"shmkv-demo-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tty = sys.stdout.isatty()
    print(f"shmkv demo: segment /{name}: {L} layers x {H} KV heads x {D} dims, fp16, "
          f"{cfg.num_blocks} blocks x {bs} tokens "
          f"({_fmt_bytes(cfg.num_blocks * cfg.bytes_per_block)} "
          f"pool); {args.workers} workers for {args.duration:g} s", flush=True)
    cache = KVCache.create(name, cfg)
    ctx = mp.get_context("spawn")
    workers = []
    victim = None
    try:
        q = ctx.Queue()
        for w in range(args.workers):
            p = ctx.Process(target=_worker, name=f"shmkv-demo-worker-{w}",
                            args=(name, w, args.duration, args.seed + w, args.prompt_max,
                                  args.gen_max, args.concurrency, args.beam_every, q,
                                  args.system_prompts))
            p.start()
            workers.append(p)
        if not args.no_kill:      # an extra engine that dies mid-run, holding blocks
            victim_q = ctx.Queue()     # kept referenced: the child unpickles it later
            victim = ctx.Process(target=_worker, name="shmkv-demo-victim",
                                 args=(name, -1, args.duration, args.seed + 999,
                                       args.prompt_max, args.gen_max, 4, 0, victim_q,
                                       args.system_prompts))
            victim.start()
        kill_at = None
        t0 = time.monotonic()
        latest, done = {}, {}
        peak_used = 0
        deadline = t0 + args.duration + 60
        next_line = 0.0
        while len(done) < len(workers) and time.monotonic() < deadline:
            if victim is not None and kill_at is not None and time.monotonic() >= kill_at \
                    and victim.is_alive():
                os.kill(victim.pid, signal.SIGKILL)          # mid-decode, blocks held
                victim.join(timeout=10)
                held = sum(1 for x in cache.sequences() if cache.owner_pid(x) == victim.pid)
                print(f"  [{time.monotonic() - t0:5.1f}s] SIGKILLed worker pid {victim.pid} "
                      f"holding {held} sequences", flush=True)
            try:
                kind, wid, counts = q.get(timeout=0.5)
                if kind == "start":
                    if kill_at is None:
                        kill_at = counts + args.duration / 2
                    continue
                if kind == "done":
                    done[wid] = counts
                latest[wid] = counts
            except Exception:  # queue.Empty
                pass
            if any(p.exitcode not in (None, 0) for p in workers):
                break
            if time.monotonic() < next_line and len(done) < len(workers):
                continue
            next_line = time.monotonic() + 0.5
            st = cache.stats()
            peak_used = max(peak_used, st["used_blocks"])
            el = time.monotonic() - t0
            toks = sum(c["prefill_tokens"] + c["decode_tokens"] for c in latest.values())
            line = (f"  [{el:5.1f}s] blocks used {st['used_blocks']:>5}/{st['num_blocks']} "
                    f"({100 * st['used_blocks'] / st['num_blocks']:3.0f}%)  sequences "
                    f"{st['num_sequences']:>4}  tokens {toks:>9,}  forks {st['forks']:>5}  "
                    f"COW {st['cow_copies']:>5}")
            print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)
        if tty:
            print()
        if done:   # the traffic window: first worker start to last worker end
            elapsed = (max(c["t_end"] for c in done.values())
                       - min(c["t_start"] for c in done.values()))
        else:
            elapsed = time.monotonic() - t0
        for p in workers:
            p.join(timeout=30)
        bad = [(p.name, p.exitcode) for p in workers if p.exitcode != 0]
        if victim is not None and victim.is_alive():        # killed it before it got going
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(timeout=10)
        rec = cache.recover()
        problems = cache.check()
        st = cache.stats()
        tot = {k: sum(c[k] for c in done.values()) for k in
               ("prefill_tokens", "decode_tokens", "requests", "finished", "forks",
                "preempted", "bytes", "gathers", "prefix_hit_tokens")}
        prompt_tokens = tot["prefill_tokens"] + tot["prefix_hit_tokens"]
        hit_pct = 100 * tot["prefix_hit_tokens"] / max(1, prompt_tokens)
        toks = tot["prefill_tokens"] + tot["decode_tokens"]
        rows = [
            ("workers", f"{args.workers} processes, {elapsed:.1f} s"),
            ("requests", f"{tot['requests']:,} admitted, {tot['finished']:,} finished, "
                         f"{tot['preempted']:,} preempted"),
            ("tokens", f"{toks:,} ({tot['prefill_tokens']:,} prefill + "
                       f"{tot['decode_tokens']:,} decode)"),
            ("throughput", f"{toks / elapsed:,.0f} tokens/s, "
                           f"{tot['bytes'] / elapsed / 1e9:.2f} GB/s of KV written+read"),
            ("decode", f"{tot['decode_tokens'] / elapsed:,.0f} tokens/s "
                       f"({cfg.bytes_per_token / 1024:.0f} KiB each)"),
            ("prefix cache", f"{tot['prefix_hit_tokens']:,} of {prompt_tokens:,} prompt tokens "
                             f"were hits ({hit_pct:.0f}%, not recomputed), "
                             f"{st['cached_blocks']} blocks still cached"),
            ("forks", f"{st['forks']:,} (beams), {st['cow_copies']:,} copy-on-write copies"),
            ("peak blocks", f"{st['peak_used_blocks']:,} of {st['num_blocks']:,} "
                            f"({100 * st['peak_used_blocks'] / st['num_blocks']:.0f}%)"),
            ("allocations", f"{st['allocations']:,} blocks allocated, "
                            f"{st['cached_blocks_reused']:,} reused from the prefix cache, "
                            f"{st['frees']:,} freed"),
            ("killed worker", "none" if victim is None else
                              f"pid {victim.pid} (exit {victim.exitcode}): recovery reclaimed "
                              f"{st['reclaimed_sequences']} sequences / "
                              f"{st['reclaimed_blocks']} blocks ({st['recoveries']} passes: on "
                              f"attach, before CacheFullError, and {rec['sequences']} sequences "
                              f"in the final recover()); longest pass "
                              f"{st['max_recovery_s'] * 1e6:.0f} us"),
            ("end state", f"{st['used_blocks']} blocks used, {st['num_sequences']} sequences"),
            ("check()", "[] (consistent)" if not problems else f"{len(problems)} problems"),
        ]
        w = max(len(r[0]) for r in rows)
        print("\nshmkv demo results")
        for k, v in rows:
            print(f"  {k:<{w}}  {v}")
        for line in problems[:20]:
            print(f"  ! {line}")
        if bad:
            print(f"  ! workers failed: {bad}", file=sys.stderr)
        ok = not problems and not bad and st["used_blocks"] == 0
        return 0 if ok else 1
    finally:
        for p in workers + ([victim] if victim is not None else []):
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        cache.unlink()
        cache.close()


if __name__ == "__main__":
    sys.exit(main())
