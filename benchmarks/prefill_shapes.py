"""Short prefills -- a prefix hit's tail, a short prompt, a few chunks side by side -- on 2
threads, against gather + torch SDPA on the stored dtype and, with --base, another build's
kernel (its ``_attention*.so``), all interleaved call by call in one process
(RESULTS_attention_amx.md, eighth pass: how the work items are cut).  One Llama-3-8B layer
(32 q heads over 8 kv heads, head_dim 128); q exactly in the pool's dtype, as a model in
that dtype hands it over.  The outputs of this build and the base are checked against each
other (2e-5).

    .venv/bin/python benchmarks/prefill_shapes.py [--dtypes bfloat16,float16,float32]
                                                  [--isa avx512] [--base OLD/_attention*.so]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import attention_bench as ab  # noqa: E402

from shmkv import _attention  # noqa: E402

# (sequences, context length, rows per sequence)
SHAPES = [(1, 1024, 32), (1, 1024, 64), (1, 1024, 96), (1, 1024, 128), (1, 1024, 192),
          (1, 1024, 256), (1, 4096, 24), (1, 4096, 128), (1, 4096, 512), (1, 512, 512),
          (4, 1024, 64), (3, 2048, 100)]


def run_shape(dt, n, length, rows, rounds, base, torch_too):
    case = ab.Case(dt, n, length)
    try:
        q = (np.random.default_rng(2).standard_normal((n * rows, ab.HQ, ab.D), np.float32)
             .astype(case.cfg.compute_dtype).astype(np.float32))
        out, out_b = np.empty_like(q), np.empty_like(q)
        ql = [rows] * n
        fns = {"shmkv": lambda: _attention.attention(case.cache, 0, q, case.sids, q_lens=ql,
                                                     out=out)}
        if base is not None:
            fns["base"] = lambda: base.attention(case.cache, 0, q, case.sids, q_lens=ql,
                                                 out=out_b)
        if torch_too:
            fns["torch"] = ab.torch_gather_sdpa(case, q, False, q_lens=rows)
        r = ab.interleaved(fns, rounds)
        if base is not None:
            err = float(np.abs(out - out_b).max())
            if not err < 2e-5:
                raise SystemExit(f"{dt} {n}x{rows} into {length}: this build and the base "
                                 f"differ by {err:.3g}")
        return {k: v["median_ns"] / 1e6 for k, v in r.items()}
    finally:
        case.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--isa", help="force this kernel ISA (both builds), e.g. avx512")
    ap.add_argument("--base", metavar="SO", help="another build's _attention*.so")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    base = ab.load_base(args.base) if args.base else None
    mods = [_attention] + ([base] if base else [])
    torch_too = not args.no_torch
    if torch_too:
        import torch
        torch.set_num_threads(2)
    for m in mods:
        m.set_num_threads(2)
        m._force_isa(args.isa)
    print(f"kernel ISA {_attention.isa()} (CPU {_attention.cpu_isa()}), 2 threads, medians of "
          f"{args.rounds} interleaved rounds, load {os.getloadavg()[0]:.2f}"
          + (f"; base: {args.base}" if base else ""))
    head = "| shape | shmkv |" + (" base | shmkv / base |" if base else "") + \
        (" torch SDPA (stored dtype) | shmkv / torch |" if torch_too else "")
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for dt in args.dtypes.split(","):
        for n, length, rows in SHAPES:
            t = run_shape(dt, n, length, rows, args.rounds, base, torch_too)
            row = f"| {dt} {n} x {rows} into {length} | {t['shmkv']:.2f} ms |"
            if base:
                row += f" {t['base']:.2f} ms | {t['shmkv'] / t['base']:.2f}x |"
            if torch_too:
                row += f" {t['torch']:.2f} ms | {t['shmkv'] / t['torch']:.2f}x |"
            print(row, flush=True)
    for m in mods:
        m._force_isa(None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
