"""The physical floor of moving the same bytes, measured in the same run.

``shmkv._bench.bench_memcpy(nbytes, iters, span)`` loops memcpy in C over buffers it
allocates per call, with source and destination walking ``span`` bytes.  Its destination
buffer is never touched before the timed loop (the compiler drops the memset of a buffer
that is only written and then freed), so the first pass over the span pays one page fault
per 4 KiB.  We therefore measure the steady state by difference: one call of one pass and
one call of k passes; (T_k - T_1) / (iters_k - iters_1) cancels the first pass, faults
included.

Three spans per size: *hot* (span = nbytes: the same buffers again and again), *matched*
(span = the bytes of pool the timed shmkv op touches, so the floor has the same working
set as the op), and *cold* (span well past the last-level cache).  For copies of at
least 8 MiB per array, which shmkv makes with streaming (non-temporal) stores, the same
matched span once more with ``bench_memcpy(..., streaming=True)``: the floor of that way
of copying (no read of the destination before it is written).

For the decode append, a fourth floor that the contiguous memcpy cannot give: the
*layout-matched rows* (:func:`layout_rows`) -- the same 2 * num_layers rows of one token
written where the paged layout puts them (one row per layer and K/V pool, each in its own
pool), in one strided C copy over the same slots a sample fills, with no lock, table or
bookkeeping.  The contiguous memcpy of the same bytes is one stream; the rows are 64
(Llama) separate destinations a layer stride apart, which is what the op must do.
"""
from __future__ import annotations

import math
import time

import numpy as np
from timing import STEAL, from_samples, measure, record

from shmkv import _bench

COLD_SPAN = 256 << 20
FLOOR_AFTER = "memcpy matched, after shmkv"
LAYOUT_ROWS = "layout-matched rows"


def llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs), 32 MiB if unknown."""
    best = 0
    try:
        import glob

        for p in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
            with open(p) as f:
                t = f.read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20}.get(t[-1], 1)
            best = max(best, int(t.rstrip("KM")) * mult)
    except (OSError, ValueError):
        pass
    return best or (32 << 20)


class Evictor:
    """Call it (untimed) before a timed call to leave that call cold: it reads a buffer of
    twice the last-level cache (at least 64 MiB, at most 1 GiB) once, on every thread of the
    kernel's pool.  A decode step reads every layer's K and V once (a Llama-3-8B layer at 4k
    x 8 is 134 MB, 32 layers of it per step), so no layer finds its rows in cache: a
    benchmark of one layer called again and again would time a warm cache no step sees, and
    how much each call gains from it depends on what ran just before."""

    def __init__(self, nbytes: int | None = None):
        n = nbytes if nbytes is not None else min(max(2 * llc_bytes(), 64 << 20), 1 << 30)
        self.buf = np.ones(n, np.uint8)          # touched: its pages exist before timing
        self.nbytes = n

    def __call__(self) -> None:
        _bench.bench_read(self.buf)


STREAM_MIN = 8 << 20          # shmkv streams copies of >= 8 MiB per K or V array
STREAM_FLOOR = "streaming copy matched"


def memcpy_steady(nbytes: int, span: int, reps: int, min_sample_ns: float,
                  streaming: bool = False) -> dict:
    """Steady-state ns per memcpy of nbytes over a span (first pass cancelled).

    k, the number of passes, is chosen so that (k - 1) passes last about min_sample_ns
    (at most 16 GiB copied per call): a pilot of 1 and 4 passes estimates the steady cost,
    clamped between the cost at 50 GB/s (faster than any copy here) and the pilot's
    4-pass average (which still holds a quarter of the first-pass faults).  When the
    faults of a pass cost more than its copies (large spans), a small k would leave the
    difference to the noise of the fault costs; this k keeps it to a few percent.
    """
    span = max(span, nbytes)
    per = max(1, span // nbytes)

    def total(passes):
        # retaken when other tasks held this thread's CPU for more than STEAL of the call
        for _ in range(5):
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            ns = _bench.bench_memcpy(nbytes, per * passes, span,
                                    streaming=streaming) * per * passes
            w, c = time.perf_counter_ns() - w0, time.thread_time_ns() - c0
            if w - c <= STEAL * w:
                break
        return ns

    t1, t4 = total(1), total(4)
    hi = max(t4 / (4 * per), 1.0)
    lo = nbytes / 50.0                                   # ns at 50 GB/s
    est = min(hi, max(lo, (t4 - t1) / (3 * per)))
    # the signal (k - 1 passes) must also dwarf the first pass's faults, whose cost
    # varies with the machine's other memory traffic: 10x their cost at ~0.5 us a page
    signal = max(min_sample_ns, 10 * (span / 4096) * 500)
    k = 1 + max(3, math.ceil(signal / (est * per)))
    k = min(k, 1 + max(3, (16 << 30) // (per * nbytes)))
    samples = []
    for _ in range(reps):
        t1 = total(1)
        samples.append(max(total(k) - t1, 0.0) / (per * (k - 1)))
    return from_samples(samples, span=span, iters_per_pass=per, passes=k)


def numpy_copy(nbytes: int, budget) -> dict:
    """np.copyto of nbytes between two pre-touched contiguous arrays (hot when it fits)."""
    n = nbytes // 2
    src = np.ones(n, np.float16)
    dst = np.zeros(n, np.float16)

    def run(_s, calls):
        c = np.copyto
        for _ in range(calls):
            c(dst, src)
    return measure(run, repeat=budget.repeat, min_repeat=budget.min_repeat,
                   max_seconds=budget.max_seconds, target_sample_ns=budget.sample_ns)


def measure_floors(cfg_name, wl, ops, budget, progress, cold=True) -> list:
    """Floor records for every op of `ops` that moves bytes (cold: also the 256 MiB-span
    figure, context only, skipped in quick mode)."""
    out = []
    done = {}
    for op in ops:
        nbytes = wl.nbytes(op)
        if nbytes is None:
            continue
        ws = wl.working_set(op)
        kinds = (("memcpy matched", ws), ("memcpy hot", nbytes)) + (
            (("memcpy cold", COLD_SPAN),) if cold else ()) + (
            ((STREAM_FLOOR, ws),) if nbytes // 2 >= STREAM_MIN else ())
        for impl, span in kinds:
            stream = impl == STREAM_FLOOR
            key = (nbytes, max(span, nbytes), stream)
            if key not in done:
                progress.step(f"{cfg_name}/floor/{op}: {impl} ({nbytes} B over {span} B)")
                done[key] = memcpy_steady(nbytes, span, budget.floor_reps, budget.floor_ns,
                                          streaming=stream)
            r = record("ops", op, cfg_name, impl, done[key], kind="floor", nbytes=nbytes,
                       working_set=ws)
            out.append(r)
            progress.result(r)
        key = ("numpy", nbytes)
        if key not in done:
            progress.step(f"{cfg_name}/floor/{op}: numpy copy ({nbytes} B)")
            done[key] = numpy_copy(nbytes, budget)
        r = record("ops", op, cfg_name, "numpy copy", done[key], kind="floor", nbytes=nbytes)
        out.append(r)
        progress.result(r)
    return out


def matched_again(cfg_name, wl, ops, budget, progress) -> list:
    """The matched floors once more, right after shmkv's ops: other jobs on the machine
    change what an L3-sized working set costs from one minute to the next, and the floor
    used for the ratios is the lowest of both measurements (a floor is a lower bound)."""
    out = []
    done = {}
    for op in ops:
        nbytes = wl.nbytes(op)
        if nbytes is None:
            continue
        ws = wl.working_set(op)
        key = (nbytes, max(ws, nbytes))
        if key not in done:
            progress.step(f"{cfg_name}/floor/{op}: memcpy matched, again after shmkv")
            done[key] = memcpy_steady(nbytes, ws, budget.floor_reps, budget.floor_ns)
        r = record("ops", op, cfg_name, FLOOR_AFTER, done[key], kind="floor", nbytes=nbytes,
                   working_set=ws)
        out.append(r)
        progress.result(r)
    return out



def layout_rows(cfg_name, cache, wl, budget, progress, calls: int) -> list:
    """The layout-matched floor of ``append1``: ``_bench.bench_append_rows`` writes wl.k1 /
    wl.v1 (one token, every layer) into the K and V pools at the slots of `calls` tokens
    reserved from a sequence of `cache` (the blocks a sample of append1 fills), cycling."""
    progress.step(f"{cfg_name}/floor/append1: {LAYOUT_ROWS}")
    sid = cache.create_sequence()
    try:
        slots = cache.reserve(sid, calls)

        def run(_s, n):
            _bench.bench_append_rows(cache, wl.k1, wl.v1, slots, n)
        stats = measure(run, calls=calls, repeat=budget.repeat, min_repeat=budget.min_repeat,
                        max_seconds=budget.max_seconds, target_sample_ns=budget.sample_ns)
    finally:
        cache.free(sid)
    r = record("ops", "append1", cfg_name, LAYOUT_ROWS, stats, kind="floor",
               nbytes=wl.nbytes("append1"), working_set=wl.working_set("append1"),
               note=f"{2 * wl.cfg.num_layers} rows of {wl.cfg.bytes_per_token // (2 * wl.cfg.num_layers)} B "
                    "where the paged layout puts them, one strided C copy per token")
    progress.result(r)
    return [r]
