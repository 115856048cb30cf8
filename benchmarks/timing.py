"""The one timing helper every shmkv benchmark uses.

A *sample* is one timed batch: ``run(state, calls)`` performs ``calls`` operations between
two ``time.perf_counter_ns()`` reads; the per-call time of the sample is the batch time
divided by ``calls``.  ``setup(calls)`` and ``teardown(state)`` run outside the timed
region (creating the sequences a batch works on, freeing them afterwards).  Garbage
collection is off inside the timed region, the same for every implementation.

Results are summarised as median, p10/p90 and quartiles (IQR) of the per-call sample
times, and stored as plain dicts (JSON-serialisable records, see :func:`record`).
"""
from __future__ import annotations

import gc
import math
import time
from typing import Callable

__all__ = ["fmt_ns", "from_samples", "loop_overhead_ns", "measure", "measure_interleaved",
           "record", "summarize"]


#: a sample whose thread was off the CPU for more than this share of its wall time was
#: preempted by other tasks (the machine is shared): it is dropped and taken again
STEAL = 0.2


def _quantile(xs: list, q: float) -> float:
    """Linear-interpolated quantile of a sorted list (numpy's default method)."""
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(samples_ns) -> dict:
    """median / p10 / p90 / q1 / q3 / min / max of per-call times in ns."""
    xs = sorted(float(x) for x in samples_ns)
    return {
        "median_ns": _quantile(xs, 0.5),
        "p10_ns": _quantile(xs, 0.10),
        "p90_ns": _quantile(xs, 0.90),
        "q1_ns": _quantile(xs, 0.25),
        "q3_ns": _quantile(xs, 0.75),
        "min_ns": xs[0] if xs else math.nan,
        "max_ns": xs[-1] if xs else math.nan,
        "samples": len(xs),
    }


def _timed(run: Callable, state, calls: int) -> tuple:
    """(wall ns, this thread's CPU ns) of one batch."""
    gc_was = gc.isenabled()
    gc.disable()
    try:
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        run(state, calls)
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
    finally:
        if gc_was:
            gc.enable()
    return t1 - t0, c1 - c0


def measure(run: Callable, *, calls: int | None = None, max_calls: int = 1 << 20,
            setup: Callable | None = None, teardown: Callable | None = None,
            repeat: int = 30, min_repeat: int = 5, warmup: int = 1,
            max_seconds: float = 2.0, target_sample_ns: float = 2e6,
            in_thread: bool = True) -> dict:
    """Time ``run(state, calls)``; return the summary of per-call ns plus ``calls``.

    Parameters
    ----------
    run : callable(state, calls)
        Performs ``calls`` operations (its own tight loop, so every implementation pays
        the same loop overhead).
    calls : int or None
        Operations per sample.  None calibrates: doubles from 1 until a sample takes a
        quarter of ``target_sample_ns``, then scales to ``target_sample_ns``, capped at
        ``max_calls``.
    setup, teardown : callables, untimed
        ``setup(calls) -> state`` before each sample, ``teardown(state)`` after.
    repeat, min_repeat, max_seconds
        Up to ``repeat`` samples; stops early once ``max_seconds`` of wall time (setup
        included) have passed and ``min_repeat`` samples exist.
    warmup : int
        Untimed samples first (caches, branch predictors, lazily built state).
    in_thread : bool
        The work runs in this thread (not in a server process): a sample during which
        the thread lost the CPU to other tasks for more than STEAL of its wall time is
        dropped and taken again (at most 2 * repeat times; the count is reported as
        ``preempted_dropped``).  The machine is shared; its other jobs are not what is
        measured.  Off for peers whose work runs in another process.
    """
    setup = setup or (lambda n: None)
    teardown = teardown or (lambda s: None)

    def one(n: int) -> tuple:
        state = setup(n)
        try:
            return _timed(run, state, n)
        finally:
            teardown(state)

    t_start = time.monotonic()
    if calls is None:
        n = 1
        one(1)                                  # first touch, outside calibration
        while True:
            dt = max(one(n)[0], 1)
            if dt >= target_sample_ns / 4 or n >= max_calls:
                break
            n = min(n * 2, max_calls)
        calls = int(min(max_calls, max(1, math.ceil(n * target_sample_ns / dt))))
    for _ in range(warmup):
        one(calls)
    samples, cpu = [], []
    dropped = 0
    while len(samples) < repeat:
        wall, c = one(calls)
        if in_thread and wall - c > STEAL * wall and dropped < 2 * repeat:
            dropped += 1                        # preempted: other tasks had the CPU
            continue
        samples.append(wall / calls)
        cpu.append(c / calls)
        if len(samples) >= min_repeat and time.monotonic() - t_start > max_seconds:
            break
    out = summarize(samples)
    out["preempted_dropped"] = dropped
    # CPU time of this thread per call: equal to the wall time on a quiet machine for
    # work done in this thread; wall well above it means waiting (a server, a lock) or
    # other tasks taking the CPU.  Diagnostic only; every figure reported is wall time.
    out["cpu_median_ns"] = summarize(cpu)["median_ns"]
    out["calls_per_sample"] = calls
    out["wall_s"] = round(time.monotonic() - t_start, 3)
    return out


def measure_interleaved(runs: dict, *, calls: int = 1, setup: Callable | None = None,
                        teardown: Callable | None = None, repeat: int = 30,
                        min_repeat: int = 5, warmup: int = 1,
                        max_seconds: float = 2.0) -> dict:
    """Like :func:`measure` for several variants of one op, taken in turn (one sample of
    each per round), so that every variant sees the same state of a shared machine;
    {name: summary}.  Work runs in this thread: preempted samples are taken again."""
    setup = setup or (lambda n: None)
    teardown = teardown or (lambda s: None)

    def one(run):
        state = setup(calls)
        try:
            return _timed(run, state, calls)
        finally:
            teardown(state)

    t_start = time.monotonic()
    for _ in range(warmup):
        for run in runs.values():
            one(run)
    samples = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    dropped = 0
    rounds = 0
    while rounds < repeat:
        for k, run in runs.items():
            while True:
                wall, c = one(run)
                if wall - c > STEAL * wall and dropped < 2 * repeat * len(runs):
                    dropped += 1
                    continue
                break
            samples[k].append(wall / calls)
            cpu[k].append(c / calls)
        rounds += 1
        if rounds >= min_repeat and time.monotonic() - t_start > max_seconds:
            break
    out = {}
    for k in runs:
        st = summarize(samples[k])
        st["cpu_median_ns"] = summarize(cpu[k])["median_ns"]
        st["calls_per_sample"] = calls
        st["preempted_dropped"] = dropped if k == next(iter(runs)) else 0
        st["interleaved_with"] = [x for x in runs if x != k]
        out[k] = st
    return out


def from_samples(samples_ns, **extra) -> dict:
    """Summary of per-call ns measured elsewhere (a kernel hook, a worker process)."""
    out = summarize(samples_ns)
    out.update(extra)
    return out


def record(section: str, op: str, config: str, impl: str, stats: dict, *,
           kind: str = "python", nbytes: int | None = None, note: str = "",
           **extra) -> dict:
    """One JSON-serialisable result row.

    kind: "python" (called from Python), "kernel" (C loop, no Python), "floor" (memcpy /
    numpy copy of the same bytes), "peer" (another implementation), "scaling".
    """
    r = {"section": section, "op": op, "config": config, "impl": impl, "kind": kind, "nbytes": nbytes,
             "note": note}
    r.update({k: (round(v, 3) if isinstance(v, float) else v) for k, v in stats.items()})
    r.update(extra)
    return r


def loop_overhead_ns(n: int = 200_000) -> float:
    """ns per iteration of an empty ``for _ in range(n)`` loop (reported, not subtracted)."""
    def run(_s, calls):
        for _ in range(calls):
            pass
    return measure(run, calls=n, repeat=7, min_repeat=7, max_seconds=1.0)["median_ns"]


def fmt_ns(ns) -> str:
    """Human units: 152 ns, 1.46 µs, 12.6 ms, 1.02 s."""
    if ns is None or (isinstance(ns, float) and math.isnan(ns)):
        return "–"
    ns = float(ns)
    if ns < 1e3:
        return f"{ns:.0f} ns" if ns >= 10 else f"{ns:.1f} ns"
    if ns < 1e6:
        v, u = ns / 1e3, "µs"
    elif ns < 1e9:
        v, u = ns / 1e6, "ms"
    else:
        v, u = ns / 1e9, "s"
    return f"{v:.3g} {u}" if v < 100 else f"{v:.0f} {u}"
