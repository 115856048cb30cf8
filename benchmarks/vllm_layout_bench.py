"""The vLLM connector's copies per KV layout, against memcpy: run with the vLLM
venv, ``.venv-vllm/bin/python benchmarks/vllm_layout_bench.py [--tokens 1024 4096]``.

For each configuration the connector serves -- vLLM's ``vec`` layout in float32 and
bfloat16, the ``amx`` layout in bfloat16 (what vLLM packs on AMX hosts; the layout is found
by the connector's probe with vLLM's own op, which runs on any CPU), an fp8 cache's e4m3
codes (``vec`` and ``amx``), and one rank's slice of a tensor-parallel (TP=2) instance -- the
load (shmkv blocks -> vLLM's tensor) and save (back) of N tokens over every layer of
SmolLM2-135M (30 layers, 3 KV heads, head_dim 64; the TP=2 row: a 2-rank model's
per-rank slice, 1 of 2 KV heads, into a segment block holding both), each through
``CpuLayout.copy`` (C) with shmkv blocks of 16 tokens (the default) and 128, against a
``copy_`` of the same bytes between contiguous tensors, on one torch thread; medians.
Prints a markdown table (paste it into RESULTS_vllm.md).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import uuid

VB = 128


def _time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _row(name, dtype, isa, cache, tokens, bs, reps, heads=3, slice_=None):
    import torch

    import shmkv
    from shmkv.integrations.torch_views import pool_tensors
    from shmkv.integrations.vllm.layout import probe_layout

    L, D = 30, 64
    fp8 = cache == "fp8"
    h_rank = heads if slice_ is None else slice_[1] - slice_[0]
    lay = probe_layout(isa, getattr(torch, dtype), h_rank, D, VB, bs, cache)
    assert lay is not None, (isa, dtype, cache)
    nbv = tokens // VB
    r = VB // bs
    seg = f"shmkv-bench-layout-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    cfg = shmkv.CacheConfig(num_layers=L, num_kv_heads=heads, head_dim=D,
                            num_blocks=tokens // bs + 8, block_size=bs,
                            dtype="float8_e4m3" if fp8 else dtype)
    kv = shmkv.KVCache.create(seg, cfg)
    try:
        tdt = torch.uint8 if fp8 else getattr(torch, dtype)
        vl = [torch.zeros(nbv + 4, h_rank, VB, 2 * D, dtype=tdt) for _ in range(L)]
        for t in vl:
            t.view(torch.uint8).copy_(torch.randint(0, 120, t.view(torch.uint8).shape,
                                                    dtype=torch.uint8))
        pools = [pool_tensors(kv, i) for i in range(L)]
        h0 = 0 if slice_ is None else slice_[0]     # a rank's heads among the pools'
        g = torch.arange(nbv * r)
        vblk, sub = 2 + g // r, g % r
        dst = torch.arange(3, 3 + nbv * r)

        def run(to_vllm):
            def f():
                for t, (kp, vp) in zip(vl, pools):
                    lay.copy(t, kp, vp, bs, dst, vblk, sub, to_vllm=to_vllm, head0=h0)
            return f

        nbytes = 2 * L * tokens * h_rank * D * (1 if fp8 else vl[0].element_size())
        a = torch.randint(0, 100, (nbytes,), dtype=torch.uint8)
        b = torch.empty_like(a)
        mc = _time(lambda: b.copy_(a), reps)
        out = []
        for op, to_vllm in (("save", False), ("load", True)):
            s = _time(run(to_vllm), reps)
            out.append({"config": name, "tokens": tokens, "bs": bs, "op": op, "ms": s * 1e3,
                        "memcpy_ms": mc * 1e3, "gbs": nbytes / s / 1e9, "ratio": s / mc,
                        "layout": lay.name})
        return out
    finally:
        kv.unlink()
        kv.close()


CONFIGS = [("vec float32", "float32", "vec", "auto", None),
           ("vec bfloat16", "bfloat16", "vec", "auto", None),
           ("amx bfloat16", "bfloat16", "amx", "auto", None),
           ("vec fp8 (e4m3 codes)", "bfloat16", "vec", "fp8", None),
           ("amx fp8 (e4m3 codes)", "bfloat16", "amx", "fp8", None),
           ("TP=2 rank slice, vec float32", "float32", "vec", "auto", (1, 2)),
           ("TP=2 rank slice, vec bfloat16", "bfloat16", "vec", "auto", (1, 2)),
           ("TP=2 rank slice, amx bfloat16", "bfloat16", "amx", "auto", (1, 2))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--only", default=None, help="a substring of the configurations' names")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    rows = []
    for name, dtype, isa, cache, sl in CONFIGS:
        if a.only and a.only not in name:
            continue
        heads = 2 if sl is not None else 3
        for tokens in a.tokens:
            for bs in (16, 128):
                rows += _row(name, dtype, isa, cache, tokens, bs, a.reps, heads, sl)
    from shmkv._vcopy import transpose_isa

    print(f"\n{platform.processor() or platform.machine()}, copy ISA {transpose_isa()}, "
          f"AMX tiles: {torch.cpu._is_amx_tile_supported()}, load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| configuration | tokens | shmkv block | op | ms | GB/s | memcpy, ms | ratio to memcpy |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['config']} | {r['tokens']} | {r['bs']} | {r['op']} | {r['ms']:.2f} | "
              f"{r['gbs']:.2f} | {r['memcpy_ms']:.2f} | {r['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
