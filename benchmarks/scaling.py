"""Scaling runs: 1, 2 and 4 processes on one segment; gather from 1 and 2 threads.

Processes are started with the ``spawn`` context, each attaches the segment, waits on a
barrier with the parent (so all start together), runs its loop for a fixed time and sends
back (operations, ns).  Aggregate throughput is the sum of the per-process rates.  Workers
that do not finish are ended by PID.  The worker lives in this importable module.
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time

import numpy as np
from timing import from_samples, record


# ---- the worker (runs in a spawned process) -------------------------------------------
def proc_worker(name, op, duration_s, barrier, conn):
    import shmkv
    from shmkv import _bench

    cache = shmkv.KVCache.attach(name)
    try:
        cfg = cache.config
        bs = cfg.block_size
        cs, rs, fr, ap = cache.create_sequence, cache.reserve, cache.free, cache.append
        k = np.ones((cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim), cfg.numpy_dtype)
        v = k.copy()
        # one untimed round first: lazily built state, caches
        s = cs()
        rs(s, bs)
        ap(s, k, v)
        fr(s)
        barrier.wait(120)
        ops = 0
        t0 = time.perf_counter_ns()
        end = t0 + int(duration_s * 1e9)
        while True:
            if op == "life":
                for _ in range(256):
                    s = cs()
                    rs(s, bs)
                    fr(s)
                ops += 256
            elif op == "append":
                s = cs()
                for _ in range(64):
                    ap(s, k, v)
                fr(s)
                ops += 64
            elif op == "alloc_free_kernel":
                _bench.bench_alloc_free(cache, 200_000)
                ops += 200_000
            elif op == "alloc_free_kernel_shared":     # the shared pool, no process cache
                _bench.bench_alloc_free(cache, 200_000, shared=True)
                ops += 200_000
            elif op == "cpu_ceiling":               # no shared state: the machine's scaling
                x = 0
                for i in range(256):
                    x += i * i
                ops += 256
            else:
                raise ValueError(op)
            t1 = time.perf_counter_ns()
            if t1 >= end:
                break
        conn.send({"ops": ops, "ns": t1 - t0})
    except BaseException as e:                      # reported, never swallowed
        conn.send({"error": repr(e)})
        raise
    finally:
        cache.close()
        conn.close()


def run_procs(name, op, nprocs, duration_s, timeout_s=120.0):
    """Aggregate ops/s of `nprocs` processes running `op` on segment `name`."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(nprocs + 1)
    procs, pipes = [], []
    try:
        for _ in range(nprocs):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=proc_worker, args=(name, op, duration_s, barrier, w),
                            daemon=True)
            p.start()
            w.close()
            procs.append(p)
            pipes.append(r)
        barrier.wait(timeout_s)
        res = []
        deadline = time.monotonic() + duration_s + timeout_s
        for r in pipes:
            if not r.poll(max(0.1, deadline - time.monotonic())):
                raise TimeoutError(f"{op}: a worker sent nothing")
            res.append(r.recv())
        for p in procs:
            p.join(30)
        bad = [x["error"] for x in res if "error" in x]
        bad += [f"exit code {p.exitcode}" for p in procs if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"{op} x{nprocs}: worker failed: {bad}")
        rates = [x["ops"] / x["ns"] * 1e9 for x in res]
        per_op_ns = [x["ns"] / x["ops"] for x in res]
        return sum(rates), per_op_ns
    finally:
        for p in procs:
            if p.is_alive():            # ended by its PID
                p.kill()
                p.join(10)
        for r in pipes:
            r.close()


def run_threads(fn_for_thread, nthreads, duration_s):
    """Aggregate calls/s of `nthreads` threads each looping fn_for_thread(i)()."""
    barrier = threading.Barrier(nthreads + 1)
    results = [None] * nthreads
    errors = []

    def work(i):
        try:
            fn = fn_for_thread(i)
            fn()                                           # untimed first call
            barrier.wait(60)
            n = 0
            t0 = time.perf_counter_ns()
            end = t0 + int(duration_s * 1e9)
            while True:
                fn()
                n += 1
                t1 = time.perf_counter_ns()
                if t1 >= end:
                    break
            results[i] = (n, t1 - t0)
        except BaseException as e:  # noqa: BLE001  (re-raised by the caller)
            errors.append(repr(e))
            barrier.abort()

    ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(nthreads)]
    for t in ts:
        t.start()
    try:
        barrier.wait(120)
    except threading.BrokenBarrierError:
        pass
    for t in ts:
        t.join(duration_s + 120)
    if errors:
        raise RuntimeError(f"thread failed: {errors}")
    return sum(n / ns * 1e9 for n, ns in results)


def scaling_records(section, op, config, impl, rates_by_n, per_op_by_n, note=""):
    """Records of an aggregate-throughput series: per n, the median aggregate rate (as
    ns per op of the whole group: 1e9 / rate), samples over repeats, and speedup vs 1."""
    out = []
    base = float(np.median(rates_by_n[1])) if 1 in rates_by_n else None
    if not base:
        return out
    for n, rates in sorted(rates_by_n.items()):
        agg = [1e9 / r for r in rates]
        st = from_samples(agg)
        med = float(np.median(rates))
        extra = {"workers": n, "aggregate_ops_s": round(med, 1),
                     "aggregate_ops_s_samples": [round(r, 1) for r in rates],
                     "speedup_vs_1": round(med / base, 3) if base else None}
        if per_op_by_n and n in per_op_by_n:
            extra["per_worker_ns_median"] = round(float(np.median(per_op_by_n[n])), 2)
        out.append(record(section, op, config, impl, st, kind="scaling", note=note, **extra))
    return out
