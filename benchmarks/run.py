"""shmkv benchmark suite: shmkv's hot operations beside the memcpy floor and four peers.

    python benchmarks/run.py            # full run: benchmarks/RESULTS.md, benchmarks/out/
    python benchmarks/run.py --quick    # < 2 minutes: benchmarks/out/ only

Writes benchmarks/out/results.json (every record), a Markdown report (RESULTS.md) and
benchmarks/out/chart.png.  Progress goes to stderr.  See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import floors
import numpy as np
import report
import scaling
import suite
from timing import STEAL, fmt_ns, loop_overhead_ns, measure, measure_interleaved, record

import shmkv
from shmkv import _bench, _core

_SRC = os.path.join(os.path.dirname(HERE), "src", "shmkv")


@dataclasses.dataclass
class Budget:
    repeat: int
    min_repeat: int
    max_seconds: float
    warmup: int
    sample_ns: float
    floor_reps: int
    floor_ns: float
    scale_duration: float
    scale_reps: int
    scale_wait_s: float


FULL = Budget(repeat=40, min_repeat=7, max_seconds=2.0, warmup=2, sample_ns=2e6,
              floor_reps=5, floor_ns=2e8, scale_duration=1.5, scale_reps=3,
              scale_wait_s=240)
QUICK = Budget(repeat=12, min_repeat=3, max_seconds=0.3, warmup=1, sample_ns=5e5,
               floor_reps=1, floor_ns=3e7, scale_duration=0.4, scale_reps=1,
               scale_wait_s=8)


SHAPES = {
    # a 4-layer model: 4 KiB per token, 64 KiB per block
    "small": {"num_layers": 4, "num_kv_heads": 4, "head_dim": 64, "num_blocks": 12288},
    # Llama-3-8B's KV shape: 128 KiB per token, 2 MiB per block; 1024 blocks = 2 GiB
    "llama": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "num_blocks": 1024},
}


def make_cfg(name, **over):
    kw = dict(SHAPES[name], block_size=16, dtype="float16", max_seqs=1024)
    kw.update(over)
    return shmkv.CacheConfig(**kw)


def configs():
    """(name, CacheConfig, ops).  batch_block_tables needs 256 sequences of up to 1k
    tokens, more blocks than the Llama pool holds, and is metadata only: small only."""
    return [("small", make_cfg("small"), suite.OPS),
            ("llama", make_cfg("llama"), tuple(o for o in suite.OPS if o != "bbt256"))]


def others_running():
    """Runnable tasks on the machine other than this process (procs_running of
    /proc/stat, minus the reader itself); None where /proc/stat is unreadable."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running"):
                    return max(0, int(line.split()[1]) - 1)
    except (OSError, ValueError):
        pass
    return None


def wait_quiet(max_wait_s, progress, threshold=0.25, window_s=3.0):
    """Waits (up to max_wait_s) until other runnable tasks average <= threshold over a
    window: other jobs on a 2-core machine make every figure meaningless."""
    t_end = time.monotonic() + max_wait_s
    told = False
    while True:
        xs = []
        t_w = time.monotonic() + window_s
        while time.monotonic() < t_w:
            x = others_running()
            if x is None:
                return None
            xs.append(x)
            time.sleep(0.05)
        mean = sum(xs) / len(xs)
        if mean <= threshold:
            return mean
        if time.monotonic() > t_end:
            progress.note(f"machine still busy after {max_wait_s:.0f}s ({mean:.2f} other "
                          "runnable tasks on average); measuring anyway")
            return mean
        if not told:
            progress.note(f"waiting for a quiet machine ({mean:.2f} other runnable tasks; "
                          f"up to {max_wait_s:.0f}s, --wait-quiet 0 to skip)")
            told = True


class Progress:
    """Progress lines on stderr: elapsed time, what runs now, each result.  Samples the
    machine's other runnable tasks at every step and tags each result with it."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.load = None
        self.loads = []

    def _line(self, text):
        print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    def step(self, text):
        self.load = others_running()
        if self.load is not None:
            self.loads.append(self.load)
        self._line(f"... {text}")

    def result(self, r):
        r["others_running"] = self.load
        spread = f"[{fmt_ns(r.get('p10_ns'))} .. {fmt_ns(r.get('p90_ns'))}]"
        self._line(f"    {r['config']:>5} {r['impl']:<26} {r['op']:<14} "
                   f"{fmt_ns(r.get('median_ns')):>9} {spread}")

    def note(self, text):
        self._line(f"!!! {text}")


def seg_name(tag):
    return f"shmkv-bench-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_meta(args, budget):
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = None
    import lmdb
    import matplotlib
    import redis

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full", "budget": dataclasses.asdict(budget),
        "cpu": cpu, "cpus": os.cpu_count(), "llc_bytes": floors.llc_bytes(), "mem_bytes": mem,
        "kernel": platform.release(), "python": platform.python_version(),
        "numpy": np.__version__, "shmkv": shmkv.__version__, "shmkv_file": shmkv.__file__,
        "layout_version": _core.LAYOUT_VERSION,
        "git_commit": _run(["git", "-C", os.path.dirname(HERE), "rev-parse", "--short", "HEAD"]),
        "lmdb": ".".join(map(str, lmdb.version())), "redis_py": redis.__version__,
        "matplotlib": matplotlib.__version__,
        "redis_server": _run([args.redis_server, "--version"]) if args.redis_server else None,
        "loop_overhead_ns": round(loop_overhead_ns(), 2),
        "nice": os.nice(0),
    }


# ---- shmkv itself ---------------------------------------------------------------------
def bench_shmkv(cfg_name, cfg, ops, wl, budget, progress):
    out = []
    name = seg_name(cfg_name)
    progress.step(f"{cfg_name}/shmkv: creating {cfg.segment_size() / 2**20:.0f} MiB segment")
    cache = shmkv.KVCache.create(name, cfg)
    try:
        suite.verify(cache, cfg, wl)
        out += suite.run_ops(cache, "shmkv", cfg_name, cfg, wl, budget, progress, ops)
        out += floors.matched_again(cfg_name, wl, ops, budget, progress)
        if "append1" in ops:
            out += floors.layout_rows(cfg_name, cache, wl, budget, progress, suite.APPEND_CALLS)
        # kernel-only: block alloc+free with no Python in the loop
        for shared, impl, note in (
                (False, "shmkv kernel alloc+free", "bench_alloc_free: one block alloc+free "
                 "through this process's block cache (the path reserve/free take), C loop"),
                (True, "shmkv kernel alloc+free (shared pool)", "bench_alloc_free(shared="
                 "True): the shared free stack under the pool lock, C loop")):
            progress.step(f"{cfg_name}/shmkv: kernel-only alloc+free hook"
                          + (" (shared pool)" if shared else ""))
            samples, dropped = [], 0
            t_end = time.monotonic() + budget.max_seconds
            while len(samples) < budget.min_repeat or (
                    time.monotonic() < t_end and len(samples) < budget.repeat):
                c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                ns = _bench.bench_alloc_free(cache, 200_000, shared=shared)
                w, c = time.perf_counter_ns() - w0, time.thread_time_ns() - c0
                if w - c > STEAL * w and dropped < 2 * budget.repeat:
                    dropped += 1                    # preempted by other tasks: taken again
                    continue
                samples.append(ns)
            r = record("ops", "life", cfg_name, impl, _stats(samples), kind="kernel",
                       note=note, preempted_dropped=dropped)
            out.append(r)
            progress.result(r)
        if "prefill512" in ops:
            out += prefill_alignment(cache, cfg_name, cfg, wl, budget, progress)
        if "gather1k_out" in ops:
            out += gather_alignment(cache, cfg_name, cfg, wl, budget, progress)
        # the cost of fresh arrays beside gather into fresh arrays
        if "gather1k_new" in ops:
            shape = (cfg.num_layers, 1024, cfg.num_kv_heads, cfg.head_dim)
            dt = cfg.numpy_dtype
            page = os.sysconf("SC_PAGE_SIZE") // dt.itemsize

            def alloc(_s, n):
                for _ in range(n):
                    np.empty(shape, dt)
                    np.empty(shape, dt)

            def alloc_touch(_s, n):
                for _ in range(n):
                    a = np.empty(shape, dt)
                    b = np.empty(shape, dt)
                    a.reshape(-1)[::page] = 0            # one write per page: the faults
                    b.reshape(-1)[::page] = 0
            for impl, fn in (("np.empty x2", alloc), ("np.empty x2 + page faults", alloc_touch)):
                progress.step(f"{cfg_name}/gather1k_new: {impl}")
                st = measure(fn, repeat=budget.repeat, min_repeat=budget.min_repeat,
                             max_seconds=budget.max_seconds, target_sample_ns=budget.sample_ns)
                r = record("ops", "gather1k_new", cfg_name, impl, st, kind="alloc",
                           nbytes=wl.nbytes("gather1k_new"))
                out.append(r)
                progress.result(r)
        bad = cache.check()
        out.append(record("checks", "check_after_ops", cfg_name, "shmkv",
                          {"ok": bad == [], "problems": bad[:20]}, kind="check"))
        if bad:
            progress.note(f"{cfg_name}: cache.check() after the ops: {bad[:5]}")
    finally:
        cache.close()
        cache.unlink()
    return out


def page_aligned(shape, dtype, offset=0):
    """An array whose data starts `offset` bytes past a page boundary."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + 2 * 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096 + offset
    a = raw[start:start + nbytes].view(dtype).reshape(shape)
    a.fill(1)                                      # pages touched: no faults timed
    return a


ALIGN_OFFSETS = (0, 16, 64)


def prefill_alignment(cache, cfg_name, cfg, wl, budget, progress):
    """prefill512 from numpy's own k/v arrays and from k/v placed at chosen offsets past
    a page boundary, taken in turn (interleaved): a relative-alignment diagnostic."""
    shape = wl.kp.shape
    srcs = {f"shmkv, k/v numpy-allocated (page+{wl.kp.ctypes.data % 4096})": (wl.kp, wl.vp)}
    for off in ALIGN_OFFSETS:
        k = page_aligned(shape, cfg.numpy_dtype, off)
        v = page_aligned(shape, cfg.numpy_dtype, off)
        k[...] = wl.kp
        v[...] = wl.vp
        srcs[f"shmkv, k/v at page+{off}"] = (k, v)

    def runner(k, v):
        def run(s, n):
            for _ in range(n):
                cache.append(s, k, v)
        return run
    progress.step(f"{cfg_name}/shmkv/prefill512: source alignment, interleaved")
    res = measure_interleaved({name: runner(k, v) for name, (k, v) in srcs.items()},
                              setup=lambda n: cache.create_sequence(), teardown=cache.free,
                              repeat=budget.repeat, min_repeat=budget.min_repeat,
                              max_seconds=2 * budget.max_seconds, warmup=budget.warmup)
    out = []
    for name, st in res.items():
        r = record("ops", "prefill512", cfg_name, name, st, kind="diagnostic",
                   nbytes=wl.nbytes("prefill512"),
                   note="source arrays at a chosen offset past a page boundary; the pool's "
                        "blocks start on one; variants taken in turn")
        out.append(r)
        progress.result(r)
    return out


def gather_alignment(cache, cfg_name, cfg, wl, budget, progress):
    """gather1k_out into numpy's own arrays and into arrays placed at chosen offsets past
    a page boundary, taken in turn (interleaved).  numpy's large arrays start 16 bytes
    past one (the malloc header of an mmap'd chunk); the pool's blocks start on one."""
    shape = (cfg.num_layers, 1024, cfg.num_kv_heads, cfg.head_dim)
    sid = cache.create_sequence()
    try:
        cache.append(sid, wl.kp, wl.vp)
        cache.append(sid, wl.kp, wl.vp)
        dk = np.ones(shape, cfg.numpy_dtype)
        dv = np.ones(shape, cfg.numpy_dtype)
        outs = {f"shmkv, out= numpy-allocated (page+{dk.ctypes.data % 4096})": (dk, dv)}
        for off in ALIGN_OFFSETS:
            outs[f"shmkv, out= at page+{off}"] = (page_aligned(shape, cfg.numpy_dtype, off),
                                                  page_aligned(shape, cfg.numpy_dtype, off))

        def runner(o):
            def run(_s, n):
                for _ in range(n):
                    cache.gather(sid, out=o)
            return run
        progress.step(f"{cfg_name}/shmkv/gather1k_out: destination alignment, interleaved")
        res = measure_interleaved({name: runner(o) for name, o in outs.items()},
                                  repeat=budget.repeat, min_repeat=budget.min_repeat,
                                  max_seconds=2 * budget.max_seconds, warmup=budget.warmup)
        out = []
        for name, st in res.items():
            r = record("ops", "gather1k_out", cfg_name, name, st, kind="diagnostic",
                       nbytes=wl.nbytes("gather1k_out"),
                       note="out arrays at a chosen offset past a page boundary; the pool's "
                            "blocks start on one; variants taken in turn")
            out.append(r)
            progress.result(r)
        del outs, dk, dv
    finally:
        cache.free(sid)
    return out


def _stats(samples):
    from timing import from_samples
    return from_samples(samples)


# ---- peers ------------------------------------------------------------------------------
def peer_factories(args, redis_server):
    """(label, factory or None, why skipped)."""
    from peers.lmdb_kv import LmdbCache
    from peers.naive_shm import NaiveShmCache
    from peers.vllm_pool import VllmStyleCache
    out = [("vLLM-style pool (py)", VllmStyleCache, None),
           ("naive shm+Manager", NaiveShmCache, None),
           ("LMDB", LmdbCache, None)]
    if redis_server is not None:
        from peers.redis_kv import RedisCache
        out.append(("Redis", lambda cfg: RedisCache(cfg, redis_server), None))
    else:
        out.append(("Redis", None, args.redis_skip_reason))
    return [p for p in out if not args.peers or p[0].split()[0].lower() in args.peers]


def bench_peer(label, factory, cfg_name, cfg, ops, wl, budget, progress):
    progress.step(f"{cfg_name}/{label}: setting up")
    impl = factory(cfg)
    try:
        suite.verify(impl, cfg, wl)
        out = suite.run_ops(impl, label, cfg_name, cfg, wl, budget, progress, ops, kind="peer",
                            in_thread=label not in report.SERVER_PEERS)
        pool = getattr(impl, "pool", None)
        if hasattr(pool, "get_new_blocks"):
            # the pool alone, beside shmkv's kernel-only figure: one block out and back
            progress.step(f"{cfg_name}/{label}: pool alloc+free of one block")

            def pool_af(_s, n):
                get, put = pool.get_new_blocks, pool.free_blocks
                for _ in range(n):
                    put(get(1))
            st = measure(pool_af, repeat=budget.repeat, min_repeat=budget.min_repeat,
                         max_seconds=budget.max_seconds, target_sample_ns=budget.sample_ns)
            r = record("ops", "life", cfg_name, f"{label} alloc+free", st, kind="peer",
                       note="get_new_blocks(1) + free_blocks, no sequence")
            out.append(r)
            progress.result(r)
        return out
    finally:
        impl.close()


# ---- scaling -------------------------------------------------------------------------------
GATE = 1.8      # a scaling round counts when a no-shared-state loop ran this much faster
                # on 2 workers than on 1, before and after it: the 2 cores were ours


def gated_rounds(what, run_ceiling, run_op, workers, budget, progress):
    """Rounds of [ceiling x1, ceiling x2, op x n for n in workers, ceiling x2]; a round
    is kept when min(ceiling x2) / ceiling x1 >= GATE.  Tries until budget.scale_reps
    rounds are kept or budget.scale_wait_s has passed; with none kept, every round is
    used and the records say so.  Returns (rounds used, kept, tried)."""
    kept, tried = [], []
    t_end = time.monotonic() + budget.scale_wait_s
    while len(kept) < budget.scale_reps:
        progress.step(f"{what}: round {len(tried) + 1} (ceiling, then {workers} workers)")
        c1 = run_ceiling(1)
        c2 = run_ceiling(2)
        res = {n: run_op(n) for n in workers}
        c2 = min(c2, run_ceiling(2))
        rnd = {"ceiling": {1: c1, 2: c2}, "gate": c2 / c1, "res": res}
        tried.append(rnd)
        if rnd["gate"] >= GATE:
            kept.append(rnd)
        else:
            progress.note(f"{what}: round dropped, the machine gave x{rnd['gate']:.2f} "
                          f"(< {GATE}) to a loop with no shared state")
        if time.monotonic() > t_end:
            break
    return (kept or tried), len(kept), len(tried)


def _series(rounds, key):
    rates, per = {}, {}
    for rnd in rounds:
        for n, v in rnd[key].items():
            rate, per_op = v if isinstance(v, tuple) else (v, None)
            rates.setdefault(n, []).append(rate)
            if per_op:
                per.setdefault(n, []).extend(per_op)
    return rates, per


def bench_scaling(budget, progress):
    out = []
    small = make_cfg("small", num_blocks=1024)
    llama = make_cfg("llama", num_blocks=192)
    dur = budget.scale_duration
    cdur = max(0.2, dur / 3)
    for cfg_name, cfg, ops in (("small", small, ("life", "alloc_free_kernel",
                                                 "alloc_free_kernel_shared", "append")),
                               ("llama", llama, ("append",))):
        name = seg_name(f"scale-{cfg_name}")
        cache = shmkv.KVCache.create(name, cfg)
        try:
            for op in ops:
                rounds, nkept, ntried = gated_rounds(
                    f"scaling {cfg_name}/{op}",
                    lambda n, name=name: scaling.run_procs(name, "cpu_ceiling", n, cdur)[0],
                    lambda n, name=name, op=op: scaling.run_procs(name, op, n, dur),
                    (1, 2, 4), budget, progress)
                gate = (f"{nkept} of {ntried} rounds kept (a no-shared-state loop ran "
                        f">= x{GATE} on 2 processes around them)" if nkept else
                        f"machine busy: none of {ntried} rounds reached x{GATE} on the "
                        "no-shared-state loop; all are used")
                rates, per = _series(rounds, "res")
                recs = scaling.scaling_records("scaling", op, cfg_name, "shmkv", rates, per,
                                               note=f"processes on one segment; {gate}")
                crates, _ = _series(rounds, "ceiling")
                recs += scaling.scaling_records(
                    "scaling", "cpu_ceiling", cfg_name, "python loop (ceiling)", crates, None,
                    note=f"pure-Python loop, no shared state, in the rounds of {op}")
                for r in recs:
                    r["paired_with"] = op
                    r["rounds_kept"], r["rounds_tried"] = nkept, ntried
                    progress.result(r)
                out += recs
            # gather from threads: small (the copy stays in the caches, so two threads
            # can only scale if the GIL is released) and llama (128 MiB from DRAM: one
            # thread already draws most of the memory bandwidth)
            out += bench_threads(cache, cfg_name, cfg, budget, progress)
            bad = cache.check()
            out.append(record("checks", "check_after_scaling", cfg_name, "shmkv",
                              {"ok": bad == [], "problems": bad[:20]}, kind="check"))
            if bad:
                progress.note(f"scaling {cfg_name}: cache.check(): {bad[:5]}")
        finally:
            cache.close()
            cache.unlink()
    return out


def bench_threads(cache, cfg_name, cfg, budget, progress):
    """gather 1k tokens (out=) from 1 and 2 threads of this process, in gated rounds
    (ceiling: a GIL-free C loop, bench_memcpy of 4 KiB in cache, per thread); numpy copy
    of the same bytes from 1 and 2 threads beside it: the machine's copy bandwidth."""
    out = []
    dur = budget.scale_duration
    cdur = max(0.2, dur / 3)
    L, H, D, dt = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.numpy_dtype
    kp = np.ones((L, 512, H, D), dt)
    sids = []
    try:
        for _ in range(2):
            s = cache.create_sequence()
            sids.append(s)
            cache.append(s, kp, kp)
            cache.append(s, kp, kp)
        outs = [(np.ones((L, 1024, H, D), dt), np.ones((L, 1024, H, D), dt))
                for _ in range(2)]
        nbytes = 2 * outs[0][0].nbytes
        srcs = [np.ones(nbytes // 2, dt) for _ in range(2)]
        dsts = [np.ones(nbytes // 2, dt) for _ in range(2)]
        series = (
            ("shmkv", lambda i: lambda: cache.gather(sids[i], out=outs[i]),
             "each thread gathers its own sequence (out=)"),
            ("shmkv, one shared sequence", lambda i: lambda: cache.gather(sids[0], out=outs[i]),
             "both threads gather the same sequence: its lock serialises them"),
            ("numpy copy (ceiling)", lambda i: lambda: np.copyto(dsts[i], srcs[i]),
             "np.copyto of the same bytes per thread: the machine's copy bandwidth"))

        def ceiling(n):
            return scaling.run_threads(lambda i: lambda: _bench.bench_memcpy(4096, 20000, 4096),
                                       n, cdur)

        def run_all(n):
            return {label: scaling.run_threads(fn, n, dur) for label, fn, _ in series}
        rounds, nkept, ntried = gated_rounds(f"threads {cfg_name}/gather1k_out", ceiling,
                                             run_all, (1, 2),
                                             budget, progress)
        gate = (f"{nkept} of {ntried} rounds kept" if nkept else
                f"machine busy: none of {ntried} rounds reached x{GATE}; all are used")
        kept = {"rounds_kept": nkept, "rounds_tried": ntried}
        for label, _, note in series:
            rates = {}
            for rnd in rounds:
                for n, res in rnd["res"].items():
                    rates.setdefault(n, []).append(res[label])
            recs = scaling.scaling_records("threads", "gather1k_out", cfg_name, label, rates,
                                           None, note=f"{note}; {gate}")
            for r in recs:
                r["nbytes"] = nbytes
                r.update(kept)
                progress.result(r)
            out += recs
        crates, _ = _series(rounds, "ceiling")
        recs = scaling.scaling_records("threads", "cpu_ceiling", cfg_name,
                                       "C loop without the GIL (ceiling)", crates, None,
                                       note="bench_memcpy of 4 KiB in cache, per thread")
        for r in recs:
            r.update(kept)
            progress.result(r)
        out += recs
    finally:
        for s in sids:
            cache.free(s)
    return out


# ---- main ---------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short run (< 2 minutes)")
    ap.add_argument("--out", default=os.path.join(HERE, "out"), help="output directory")
    ap.add_argument("--md", default=None, help="Markdown report path (default: "
                    "benchmarks/RESULTS.md, or OUT/RESULTS.md with --quick)")
    ap.add_argument("--configs", default="small,llama", help="comma list: small,llama")
    ap.add_argument("--peers", default=None,
                    help="comma list of peers to run: vllm-style,naive,lmdb,redis (default all)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--redis-server", default=None, help="redis-server binary (default: PATH)")
    ap.add_argument("--wait-quiet", type=float, default=None, metavar="S",
                    help="wait up to S seconds for no other runnable tasks before starting "
                         "(default: 600 full, 0 quick)")
    ap.add_argument("--report-only", metavar="JSON", default=None,
                    help="measure nothing: re-evaluate the targets and rewrite the report and "
                         "chart from an existing results.json")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.report_only) as f:
            results = json.load(f)
        results["targets"] = report.evaluate_targets(results)
        md_path = args.md or os.path.join(os.path.dirname(args.report_only), "RESULTS.md")
        chart_path = os.path.join(os.path.dirname(os.path.abspath(args.report_only)),
                                  "chart.png")
        report.draw_chart(results, chart_path)
        with open(md_path, "w") as f:
            f.write(report.markdown(results, chart_rel=os.path.relpath(
                chart_path, os.path.dirname(md_path))) + report.extra_sections())
        print(report.targets_text(results))
        return 0

    if os.path.abspath(shmkv.__file__).startswith(_SRC + os.sep):
        sys.exit(f"benchmarks must run against the installed package, imported {shmkv.__file__}"
                 " (run from outside the repo root, or `make bench`)")
    budget = QUICK if args.quick else FULL
    args.peers = set(args.peers.lower().split(",")) if args.peers else None
    if args.no_peers:
        args.peers = {"none"}
    args.redis_server = args.redis_server or shutil.which("redis-server")
    args.redis_skip_reason = None if args.redis_server else "redis-server not installed"
    md_path = args.md or (os.path.join(args.out, "RESULTS.md") if args.quick
                          else os.path.join(HERE, "RESULTS.md"))
    os.makedirs(args.out, exist_ok=True)
    progress = Progress()
    progress.step(f"shmkv benchmarks, {'quick' if args.quick else 'full'} mode")
    wait = args.wait_quiet if args.wait_quiet is not None else (0 if args.quick else 600)
    quiet_at_start = wait_quiet(wait, progress) if wait > 0 else others_running()
    meta = machine_meta(args, budget)
    meta["others_running_at_start"] = quiet_at_start
    records, skipped = [], []
    all_cfgs = {n: (c, ops) for n, c, ops in configs()}
    wanted = [n for n in args.configs.split(",") if n]

    redis_server = None
    try:
        if args.redis_server and (args.peers is None or "redis" in args.peers):
            from peers.redis_kv import RedisServer
            try:
                redis_server = RedisServer(args.redis_server)
                redis_server.client().close()
            except Exception as e:  # noqa: BLE001  (the run goes on without this peer)
                args.redis_skip_reason = f"redis-server failed to start: {e}"
                if redis_server is not None:
                    redis_server.stop()
                redis_server = None
        for cfg_name in wanted:
            cfg, ops = all_cfgs[cfg_name]
            progress.step(f"config {cfg_name}: {cfg}")
            wl = suite.Workload(cfg)
            records += floors.measure_floors(cfg_name, wl, ops, budget, progress,
                                             cold=not args.quick)
            records += bench_shmkv(cfg_name, cfg, ops, wl, budget, progress)
            for label, factory, why in peer_factories(args, redis_server):
                if factory is None:
                    skipped.append({"config": cfg_name, "impl": label, "reason": why})
                    progress.note(f"{cfg_name}/{label}: skipped ({why})")
                    continue
                try:
                    records += bench_peer(label, factory, cfg_name, cfg, ops, wl, budget,
                                          progress)
                except Exception as e:  # noqa: BLE001  (reported; the other peers still run)
                    skipped.append({"config": cfg_name, "impl": label, "reason": repr(e)})
                    progress.note(f"{cfg_name}/{label}: FAILED, skipped: {e!r}")
                    traceback.print_exc(file=sys.stderr)
                gc.collect()
            del wl
            gc.collect()
        if not args.no_scaling:
            records += bench_scaling(budget, progress)
    finally:
        if redis_server is not None:
            redis_server.stop()

    ld = progress.loads
    meta["others_running"] = {
        "mean": round(sum(ld) / len(ld), 2) if ld else None, "max": max(ld) if ld else None,
        "busy_fraction": round(sum(1 for x in ld if x > 0) / len(ld), 3) if ld else None,
        "samples": len(ld), "note": "runnable tasks other than the benchmark, sampled at "
                              "every progress step (between measurements)"}
    meta["duration_s"] = round(time.monotonic() - progress.t0, 1)
    results = {"meta": meta, "records": records, "skipped": skipped}
    results["targets"] = report.evaluate_targets(results)
    json_path = os.path.join(args.out, "results.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    chart_path = os.path.join(args.out, "chart.png")
    report.draw_chart(results, chart_path)
    md = report.markdown(results, chart_rel=os.path.relpath(chart_path, os.path.dirname(md_path)))
    md += report.extra_sections()
    with open(md_path, "w") as f:
        f.write(md)
    progress.step(f"wrote {json_path}, {md_path}, {chart_path}")
    print(report.targets_text(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
