"""The attention kernel inside a real model: its share of a decode step against its cost alone.

    python benchmarks/model_attention_bench.py                # SmolLM2 shape, 4 rows x 4k
    python benchmarks/model_attention_bench.py --quick        # 1k context, fewer steps
    python benchmarks/model_attention_bench.py --pool own     # the kernel's own thread pool

Owns the "model" section of RESULTS_attention.md's numbers (printed; the .md is written by
hand from its output). The model is SmolLM2-135M's shape (30 layers, hidden 576, 9 q / 3 kv
heads, head_dim 64, vocab 49152, float32): the real weights from ``shmkv.models`` when that
module exists and the model is in its cache (``--real``), else a seeded LlamaConfig of the
same shape -- the cost of the attention does not depend on the weights' values.

Per decode step of ``batch`` rows at ``ctx`` tokens of context, interleaved step by step:
ShmkvCache + "shmkv" (with every ``kv.attention`` call timed inside the step) and
DynamicCache + "sdpa"; then, between the steps, the same ``kv.attention`` call alone (the
kernel alone: one layer, the same q shape). Torch and the kernel on their default threads
(every core): the set-up whose torch OpenMP threads spin after each linear layer.

Targets (reported, never asserted): the attention's share of a step <= 1.2x the kernel
alone; the step <= 0.75x DynamicCache + sdpa's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               max_position_embeddings=16384, rope_theta=100000.0, tie_word_embeddings=True,
               initializer_range=0.02)
BS = 16


def load_model(real, dtype="float32"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import shmkv.integrations.transformers  # noqa: F401  (registers "shmkv")
    if real:
        from shmkv.models import load_smollm2  # type: ignore[import-not-found]
        _, m = load_smollm2(attn="shmkv")
        return m.to(getattr(torch, dtype)).eval(), f"SmolLM2-135M-Instruct (real weights, {dtype})"
    torch.manual_seed(0)
    m = LlamaForCausalLM._from_config(LlamaConfig(**SMOLLM2), dtype=getattr(torch, dtype),
                                      attn_implementation="shmkv")
    return m.eval(), f"SmolLM2-135M shape, seeded weights, {dtype}"


def as_np(t, cfg):
    """A CPU tensor's values as an array of the pool's dtype (bfloat16 through its bits)."""
    import torch
    t = t.contiguous()
    if t.dtype == torch.bfloat16 and cfg.dtype == "bfloat16":
        return t.view(torch.int16).numpy().view(cfg.numpy_dtype)
    return t.float().numpy().astype(cfg.numpy_dtype)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def run(model, batch, ctx, steps, precision="fp32"):
    import numpy as np
    import torch
    from transformers import DynamicCache

    import shmkv
    from shmkv.integrations.transformers import ShmkvCache, config_for

    c = model.config
    L, H, D, Hq = c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.num_attention_heads
    cfg = config_for(c, num_blocks=batch * (ctx + steps + 8 + BS) // BS + 64, block_size=BS,
                     max_seqs=batch + 4, dtype=str(model.dtype).removeprefix("torch."))
    kv = shmkv.KVCache.create(f"shmkv-bench-model-{os.getpid()}-{uuid.uuid4().hex[:8]}", cfg)
    g = torch.Generator().manual_seed(ctx + batch)
    try:
        sids = []
        dc = DynamicCache()
        tdt = model.dtype
        for layer_chunk in range(L):            # one layer at a time: bounded memory
            k = torch.randn(batch, ctx, H, D, generator=g).to(tdt)
            v = torch.randn(batch, ctx, H, D, generator=g).to(tdt)
            dc.update(k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), layer_chunk)
        for b in range(batch):                  # the same K/V into the pools
            s = kv.create_sequence()
            kk = np.stack([as_np(dc.layers[i].keys[b].transpose(0, 1), cfg) for i in range(L)])
            vv = np.stack([as_np(dc.layers[i].values[b].transpose(0, 1), cfg) for i in range(L)])
            kv.append(s, np.ascontiguousarray(kk), np.ascontiguousarray(vv))
            sids.append(s)
        tok = torch.randint(0, c.vocab_size, (batch, 1), generator=g)
        past = ShmkvCache(kv, sequence_ids=list(sids), precision=precision)
        inside = []
        real_attention = kv.attention

        def timed(*a, **kw):                   # every kernel call inside the model's steps
            t0 = time.perf_counter_ns()
            r = real_attention(*a, **kw)
            inside.append(time.perf_counter_ns() - t0)
            return r
        kv.attention = timed
        q = np.random.default_rng(0).standard_normal((batch, Hq, D), dtype=np.float32)
        out = np.empty_like(q)
        alone, t_shmkv, t_dyn = [], [], []
        with torch.inference_mode():
            for i in range(steps + 2):
                model.set_attn_implementation("shmkv")
                n0 = len(inside)
                t0 = time.perf_counter_ns()
                model(input_ids=tok, past_key_values=past, use_cache=True)
                t1 = time.perf_counter_ns()
                model.set_attn_implementation("sdpa")
                t2 = time.perf_counter_ns()
                model(input_ids=tok, past_key_values=dc, use_cache=True)
                t3 = time.perf_counter_ns()
                time.sleep(0.02)               # torch's threads asleep: the kernel alone
                for layer in range(0, L, 3):   # the same call shape, one layer at a time
                    a0 = time.perf_counter_ns()
                    real_attention(layer, q, sids, out=out, precision=precision)
                    a1 = time.perf_counter_ns()
                    if i >= 2:
                        alone.append(a1 - a0)
                if i < 2:
                    del inside[n0:]
                    continue
                t_shmkv.append(t1 - t0)
                t_dyn.append(t3 - t2)
        past.close()
    finally:
        kv.close()
        kv.unlink()
    r = {"batch": batch, "context": ctx, "alone_ms": median(alone) / 1e6,
         "inside_ms": median(inside) / 1e6, "step_shmkv_ms": median(t_shmkv) / 1e6,
         "step_dynamic_ms": median(t_dyn) / 1e6, "layers": L}
    r["share_ratio"] = r["inside_ms"] / r["alone_ms"]
    r["step_ratio"] = r["step_shmkv_ms"] / r["step_dynamic_ms"]
    r["attn_share_of_step"] = r["inside_ms"] * L / r["step_shmkv_ms"]
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--real", action="store_true", help="shmkv.models' SmolLM2 weights")
    ap.add_argument("--pool", choices=["auto", "own"], default="auto",
                    help="own: the kernel's own pthread pool (SHMKV_ATTN_POOL=own), the "
                         "behaviour before it shared torch's OpenMP team")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, nargs="*", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the model's dtype, and so the pool's")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="ShmkvCache(precision=...): the kernel's mode")
    args = ap.parse_args(argv)
    if args.pool == "own":
        os.environ["SHMKV_ATTN_POOL"] = "own"
    import torch
    import transformers

    import shmkv
    from shmkv import _attention
    model, what = load_model(args.real, args.dtype)
    ctxs = args.context or ([1024] if args.quick else [4096])
    steps = args.steps or (6 if args.quick else 15)
    print(f"# {what}; torch {torch.__version__} on {torch.get_num_threads()} threads, "
          f"transformers {transformers.__version__}; shmkv kernel on "
          f"{shmkv.get_num_threads()} threads, pool {_attention.pool()!r}, ISA "
          f"{_attention.isa()} (CPU: {_attention.cpu_isa()}), precision {args.precision!r} "
          f"(dot instructions: {_attention.dot_isa()}); {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for ctx in ctxs:
        r = run(model, args.batch, ctx, steps, args.precision)
        print(f"| {r['batch']} x {ctx // 1024}k | {_attention.pool()} | {r['alone_ms']:.2f} ms | "
              f"{r['inside_ms']:.2f} ms | {r['share_ratio']:.2f}x | {r['step_shmkv_ms']:.1f} ms | "
              f"{r['step_dynamic_ms']:.1f} ms | {r['step_ratio']:.2f}x | "
              f"{100 * r['attn_share_of_step']:.0f}% |", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
