"""Quantized pools (issue 14): accuracy on real activations.

    python benchmarks/quant_accuracy.py [--quick]    # -> benchmarks/out/quant_accuracy.json

Two Llama models built from a config with seeded weights (nothing is downloaded):

- **test**: the transformers tests' model (tests/hf_workers.py: 2 layers, hidden 64,
  4 q / 2 kv heads, head_dim 16, vocab 512, initializer_range 0.5), position limit raised
  to 1024 for the 256-token runs;
- **demo**: the demo's model (branch demo, shmkv/demo/model.py, mirrored here: 4 layers,
  hidden 256, 8 q / 2 kv heads, head_dim 32, vocab 2048, initializer_range 0.2, seed 1234).

Both run in float32 with ``attn_implementation="shmkv"`` (the paged kernel reads the pool
directly, so every attention -- prefill included -- sees the stored, quantized K/V).  The
pools compared: float32 (the activations themselves), float16 (the baseline of the issue),
int8 and float8_e4m3 (per-(layer, kv head) scales calibrated on the prompt's K/V as vLLM's
``calculate_kv_scales`` does, ``amax / 448``, with a 2x margin against later tokens).

1. **attention output error**: a float32-pool greedy run records every decode query
   (post-RoPE, as the model hands it to the kernel); at 16 sampled steps the same K/V
   (gathered from the float32 pool: the model's activations) are appended to a float16,
   an int8 and a float8 pool and ``attention`` is called with the recorded queries.  Error
   vs the float16 pool's output: max relative (max |diff| / max |out16|) and mean relative
   (mean |diff| / mean |out16|), worst / mean over steps and layers; the float16 pool's own
   error vs float32 is given for scale.
2. **greedy agreement**: 256 tokens generated greedily from the same prompt with each pool;
   positions equal to the float16 pool's tokens, and the first divergence.  Random-weight
   models are chaotic (the demo model's own float32 and float16 pools part at the first
   near-tie), so also **teacher-forced top-1**: the float16 run's 256 tokens fed to every
   pool, the positions whose argmax equals the float16 pool's.
3. **log-likelihood**: a fixed 512-token text (seeded ids) scored by teacher forcing
   through each pool (one prefill); mean log p per token and its difference to float16,
   and the mean |difference| per token.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import uuid

import numpy as np
import torch

import shmkv
from shmkv.integrations.transformers import ShmkvCache, config_for

HERE = os.path.dirname(os.path.abspath(__file__))
POOLS = ("float32", "float16", "int8", "float8_e4m3")


def test_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, initializer_range=0.5, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, dtype=torch.float32,
                                         attn_implementation="shmkv").eval()


def demo_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=768,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=2048, initializer_range=0.2,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=0, dtype="float32")
    torch.manual_seed(1234)
    m = LlamaForCausalLM(cfg).to(torch.float32).eval()
    m.set_attn_implementation("shmkv")
    return m


class Pools:
    def __init__(self, model, num_blocks=1024):
        self.model = model
        self.kv = {}
        for dt in POOLS:
            cfg = config_for(model.config, num_blocks=num_blocks, block_size=16, max_seqs=16,
                             dtype=dt)
            self.kv[dt] = shmkv.KVCache.create(f"shmkv-qacc-{uuid.uuid4().hex[:10]}", cfg)

    def calibrate(self, prompt, margin=2.0):
        """float8 scales: amax / 448 per (layer, kv head) of the prompt's K and V."""
        kv32 = self.kv["float32"]
        with ShmkvCache(kv32) as past, torch.no_grad():
            self.model(prompt, past_key_values=past, use_cache=True)
            k, v = kv32.gather(past.sequence_ids[0])
        for layer in range(k.shape[0]):
            ks = np.abs(k[layer]).max(axis=(0, 2)) / 448 * margin
            vs = np.abs(v[layer]).max(axis=(0, 2)) / 448 * margin
            self.kv["float8_e4m3"].set_kv_scales(layer, np.maximum(ks, 1e-12),
                                                 np.maximum(vs, 1e-12))

    def close(self):
        for c in self.kv.values():
            c.close()
            c.unlink()


def greedy(model, kv, prompt, n, record=None):
    """n greedy tokens through a ShmkvCache on kv (``record``: list of (layer, q, scale) of
    every decode attention call)."""
    if record is not None:
        orig = kv.attention

        def spy(layer, q, sids, q_lens=None, scale=None, out=None):
            if q_lens is None:
                record.append((layer, q.copy(), scale))
            return orig(layer, q, sids, q_lens=q_lens, scale=scale, out=out)
        kv.attention = spy
    try:
        with ShmkvCache(kv) as past, torch.no_grad():
            out = model.generate(prompt, past_key_values=past, max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False)
            k, v = kv.gather(past.sequence_ids[0])
    finally:
        if record is not None:
            del kv.attention
    return out[0, prompt.shape[1]:].tolist(), (k, v)


def attention_errors(pools, prompt, steps_recorded, kvfull, nsample):
    """The recorded decode queries against the same K/V in each pool."""
    k32, v32 = kvfull
    L = k32.shape[0]
    P = prompt.shape[1]
    nsteps = len(steps_recorded) // L
    pick = sorted(set(np.linspace(0, nsteps - 1, nsample).round().astype(int).tolist()))
    res = {dt: dict(max_rel=[], mean_rel=[]) for dt in ("float16", "int8", "float8_e4m3")}
    res32 = dict(max_rel=[], mean_rel=[])
    for step in pick:
        n = P + step + 1                          # tokens the step's query attends to
        outs = {}
        for dt in ("float32", "float16", "int8", "float8_e4m3"):
            kv = pools.kv[dt]
            sid = kv.create_sequence()
            conv = np.float16 if dt == "float16" else np.float32
            kv.append(sid, k32[:, :n].astype(conv), v32[:, :n].astype(conv))
            outs[dt] = [kv.attention(layer, q, [sid], scale=sc)
                        for layer, q, sc in steps_recorded[step * L:(step + 1) * L]]
            kv.free(sid)
        for layer in range(L):
            o16 = outs["float16"][layer].astype(np.float64)
            for dt in ("int8", "float8_e4m3"):
                d = np.abs(outs[dt][layer] - o16)
                res[dt]["max_rel"].append(float(d.max() / np.abs(o16).max()))
                res[dt]["mean_rel"].append(float(d.mean() / np.abs(o16).mean()))
            o32 = outs["float32"][layer].astype(np.float64)
            for dt in ("float16", "int8", "float8_e4m3"):
                d = np.abs(outs[dt][layer] - o32)
                key = "vs32"
                res[dt].setdefault(key + "_max_rel", []).append(float(d.max() / np.abs(o32).max()))
            d = np.abs(o16 - o32)
            res32["max_rel"].append(float(d.max() / np.abs(o32).max()))
            res32["mean_rel"].append(float(d.mean() / np.abs(o32).mean()))
    out = {}
    for dt, r in res.items():
        out[dt] = {k: dict(worst=max(v), mean=float(np.mean(v))) for k, v in r.items() if v}
    out["float16_vs_float32"] = {k: dict(worst=max(v), mean=float(np.mean(v)))
                                 for k, v in res32.items()}
    out["steps_sampled"] = len(pick)
    return out


def loglik(model, kv, text, argmax=False):
    with ShmkvCache(kv) as past, torch.no_grad():
        logits = model(text, past_key_values=past, use_cache=True).logits[0].double()
    if argmax:
        return logits.argmax(-1).numpy()
    lp = torch.log_softmax(logits[:-1], -1).gather(1, text[0, 1:, None])[:, 0]
    return lp.numpy()


def run_model(name, model, vocab, gen, text_len, nsample):
    g = torch.Generator().manual_seed(42)
    prompt = torch.randint(1, vocab, (1, 64), generator=g)
    text = torch.randint(1, vocab, (1, text_len), generator=g)
    pools = Pools(model)
    try:
        pools.calibrate(prompt)
        rec = []
        toks32, kvfull = greedy(model, pools.kv["float32"], prompt, gen, record=rec)
        att = attention_errors(pools, prompt, rec, kvfull, nsample)
        toks = {"float32": toks32}
        for dt in ("float16", "int8", "float8_e4m3"):
            toks[dt], _ = greedy(model, pools.kv[dt], prompt, gen)
        agree = {}
        for dt in ("float32", "int8", "float8_e4m3"):
            a, b = np.array(toks[dt]), np.array(toks["float16"])
            div = int(np.argmax(a != b)) if (a != b).any() else len(a)
            agree[dt] = dict(equal=int((a == b).sum()), of=len(a), first_divergence=div)
        # teacher-forced: the fp16 run's sequence fed to every pool; top-1 of each
        # position vs the fp16 pool's (chaotic random-weight models make free-running
        # agreement a measure of the first near-tie more than of the pool)
        seq = torch.cat([prompt, torch.tensor([toks["float16"]])], 1)
        top = {dt: loglik(model, pools.kv[dt], seq, argmax=True)[prompt.shape[1] - 1:-1]
               for dt in POOLS}
        for dt in ("float32", "int8", "float8_e4m3"):
            agree[dt]["teacher_forced_top1"] = int((top[dt] == top["float16"]).sum())
        ll = {dt: loglik(model, pools.kv[dt], text) for dt in POOLS}
        lls = {dt: dict(mean_logp=float(ll[dt].mean()),
                        diff_vs_fp16=float(ll[dt].mean() - ll["float16"].mean()),
                        mean_abs_diff_per_token=float(np.abs(ll[dt] - ll["float16"]).mean()),
                        max_abs_diff_per_token=float(np.abs(ll[dt] - ll["float16"]).max()))
               for dt in POOLS}
    finally:
        pools.close()
    return dict(model=name, attention=att, greedy=agree, loglik=lls, gen_tokens=gen,
                text_tokens=text_len, prompt_tokens=prompt.shape[1])


def table(results):
    lines = []
    lines.append("| model | pool | attn max rel err vs fp16 (worst / mean) | attn mean rel err "
                 "vs fp16 (worst / mean) | greedy tokens = fp16 | first divergence | "
                 "teacher-forced top-1 = fp16 | mean log p diff vs fp16 | "
                 "mean abs log p diff / token |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        a, g, ll = r["attention"], r["greedy"], r["loglik"]
        for dt in ("float32", "int8", "float8_e4m3"):
            if dt == "float32":
                x = a["float16_vs_float32"]
                att = (f"(fp16 vs fp32: {x['max_rel']['worst']:.1e} / {x['max_rel']['mean']:.1e})",
                       f"({x['mean_rel']['worst']:.1e} / {x['mean_rel']['mean']:.1e})")
            else:
                x = a[dt]
                att = (f"{x['max_rel']['worst']:.1e} / {x['max_rel']['mean']:.1e}",
                       f"{x['mean_rel']['worst']:.1e} / {x['mean_rel']['mean']:.1e}")
            lines.append(
                f"| {r['model']} | {dt} | {att[0]} | {att[1]} | {g[dt]['equal']}/{g[dt]['of']} | "
                f"{g[dt]['first_divergence']} | {g[dt]['teacher_forced_top1']}/{g[dt]['of']} | "
                f"{ll[dt]['diff_vs_fp16']:+.2e} | "
                f"{ll[dt]['mean_abs_diff_per_token']:.2e} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=os.path.join(HERE, "out", "quant_accuracy.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    gen, text_len, nsample = (32, 128, 4) if a.quick else (256, 512, 16)
    results = [run_model("test", test_model(), 512, gen, text_len, nsample),
               run_model("demo", demo_model(), 2048, gen, text_len, nsample)]
    md = table(results)
    print(md)
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(dict(results=results, table=md, load=os.getloadavg()), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
