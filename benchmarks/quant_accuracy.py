"""Quantized pools: quality on real text with the real model.

    python benchmarks/quant_accuracy.py [--quick] [--tokens N]
        # -> benchmarks/out/quant_accuracy.json; the accuracy section of RESULTS_quant.md
        #    (and RESULTS.md's quant section) unless --quick

SmolLM2-135M-Instruct (``shmkv.models``, float32 weights) scores the GPL-3 text Debian ships
(``/usr/share/common-licenses/GPL-3``, its first ``--tokens`` tokens, 2,048 by default) by
teacher forcing, in 128-token chunks, once per KV store:

- the baseline: transformers' ``DynamicCache`` (float32) under ``"sdpa"``;
- ``ShmkvCache`` on a float32 / float16 / bfloat16 / int8 / float8_e4m3 pool, under
  ``attn_implementation="shmkv"`` (the paged kernel reads the pool, so every chunk's
  attention -- the prefill of the chunk included -- sees the stored K/V), and again under
  ``"sdpa"`` (``ShmkvCache`` hands sdpa the K/V read back from the pool): the two must agree;
- float8_e4m3 with each scale rule of ``calibrate_kv_scales`` (``"one"``: the pool's default
  1.0; ``"amax"``: amax / 448; ``"amax"`` x 2; ``"mse"``), calibrated on *another* text (the
  first 512 tokens of Debian's Apache-2.0 license), so that the scales are not fitted to the
  text they are scored on; and controls: amax / 448 times 2**u, u uniform in [0, 1) per
  scale (seeded), which show how much the code grid's phase alone moves the figures.

Reported per store: perplexity (exp of the mean negative log-likelihood of tokens 2..N) and
its change against the baseline, top-1 agreement (positions whose argmax equals the
baseline's), and the mean |log p difference| per token.  Targets: int8 <= +0.5%
perplexity, float8 <= +2.5%; the kernel's opt-in ``precision="bf16"`` within +0.1%
of the same pool's default.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import uuid

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = "/usr/share/common-licenses/GPL-3"
CALIB_TEXT = "/usr/share/common-licenses/Apache-2.0"
CHUNK = 128
#: (label, pool dtype, float8 scale rule or None, margin)
STORES = (("float32", "float32", None, 1.0),
          ("float16", "float16", None, 1.0),
          ("bfloat16", "bfloat16", None, 1.0),
          ("int8", "int8", None, 1.0),
          ("float8_e4m3, scales 1.0", "float8_e4m3", "one", 1.0),
          ("float8_e4m3, amax/448", "float8_e4m3", "amax", 1.0),
          ("float8_e4m3, 2 amax/448", "float8_e4m3", "amax", 2.0),
          ("float8_e4m3, mse", "float8_e4m3", "mse", 1.0),
          # the kernel's opt-in reduced precision: worth offering only if it
          # keeps perplexity within +0.1% of the same pool's default
          ("float32, precision bf16", "float32", None, 1.0, "bf16"),
          ("bfloat16, precision bf16", "bfloat16", None, 1.0, "bf16"),
          ("int8, precision bf16", "int8", None, 1.0, "bf16"))
#: the control: amax/448 times 2**u, u uniform in [0, 1) per (layer, head, K or V), seeded.
#: Inside e4m3's range a scale moves values only along the code grid (same relative step),
#: so these runs show how much perplexity moves by the grid's phase alone
PHASE_SEEDS = (1, 2, 3)
MARK = "quant-accuracy"


def read_tokens(tok, path, n):
    with open(path) as f:
        ids = tok(f.read(), return_tensors="pt").input_ids
    if ids.shape[1] < n:
        raise SystemExit(f"{path}: {ids.shape[1]} tokens, {n} needed")
    return ids[:, :n]


def score(model, ids, past, attn):
    """Logits [N, vocab] of teacher-forced ``ids`` through ``past``, CHUNK tokens a forward."""
    model.set_attn_implementation(attn)
    out = []
    with torch.inference_mode():
        for s in range(0, ids.shape[1], CHUNK):
            out.append(model(input_ids=ids[:, s:s + CHUNK], past_key_values=past,
                             use_cache=True).logits[0].double())
    return torch.cat(out)


def metrics(logits, ids, base):
    lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    top = logits[:-1].argmax(-1)
    r = {"nll": float(-lp.mean()), "ppl": float(torch.exp(-lp.mean())), "logp": lp}
    if base is not None:
        r["ppl_change"] = r["ppl"] / base["ppl"] - 1
        r["top1"] = float((top == base["top"]).double().mean())
        r["mean_abs_dlogp"] = float((lp - base["logp"]).abs().mean())
    r["top"] = top
    return r


def new_pool(model, dtype, n):
    import shmkv
    from shmkv.integrations.transformers import config_for

    cfg = config_for(model.config, num_blocks=n // 16 + 16, block_size=16, max_seqs=4,
                     dtype=dtype)
    return shmkv.KVCache.create(f"shmkv-qacc-{os.getpid()}-{uuid.uuid4().hex[:8]}", cfg)


def run(n_tokens, sdpa_check=True, only=()):
    from transformers import DynamicCache

    from shmkv.integrations.transformers import ShmkvCache, calibrate_kv_scales
    from shmkv.models import load_smollm2

    tok, model = load_smollm2(attn="shmkv")
    ids = read_tokens(tok, TEXT, n_tokens)
    calib = read_tokens(tok, CALIB_TEXT, 512)
    t0 = time.perf_counter()
    base = metrics(score(model, ids, DynamicCache(), "sdpa"), ids, None)
    print(f"DynamicCache fp32: ppl {base['ppl']:.4f} ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    rows = []
    stores = STORES + tuple((f"float8_e4m3, amax/448 · 2^u (seed {i})", "float8_e4m3",
                             "phase", float(i)) for i in PHASE_SEEDS)
    if only:
        stores = tuple(st for st in stores if st[0] in only)
    for label, dt, rule, margin, *prec in stores:
        prec = prec[0] if prec else "fp32"
        kv = new_pool(model, dt, n_tokens)
        try:
            scales = None
            if rule == "phase":
                ks, vs = calibrate_kv_scales(model, kv, calib, rule="amax")
                g = np.random.default_rng(int(margin))
                ks = ks * 2.0 ** g.random(ks.shape, dtype=np.float32)
                vs = vs * 2.0 ** g.random(vs.shape, dtype=np.float32)
                for layer in range(ks.shape[0]):
                    kv.set_kv_scales(layer, ks[layer], vs[layer])
            elif rule is not None:
                ks, vs = calibrate_kv_scales(model, kv, calib, rule=rule, margin=margin)
            if rule is not None:
                scales = {"k_min": float(ks.min()), "k_max": float(ks.max()),
                          "v_min": float(vs.min()), "v_max": float(vs.max())}
            row = {"store": label, "dtype": dt, "rule": rule, "margin": margin,
                   "scales": scales, "precision": prec}
            for attn in ("shmkv", "sdpa") if sdpa_check and rule != "phase" else ("shmkv",):
                with ShmkvCache(kv, precision=prec) as past:
                    m = metrics(score(model, ids, past, attn), ids, base)
                row[attn] = {k: m[k] for k in ("ppl", "ppl_change", "top1", "mean_abs_dlogp")}
                if attn == "shmkv":
                    top_shmkv = m["top"]
                else:
                    row["sdpa_vs_shmkv_top1"] = float((m["top"] == top_shmkv).double().mean())
            s = row["shmkv"]
            print(f"{label}: ppl {s['ppl']:.4f} ({s['ppl_change']:+.3%}), top-1 "
                  f"{s['top1']:.2%}" + (f"; sdpa ppl {row['sdpa']['ppl']:.4f}, top-1 "
                                        f"{row['sdpa']['top1']:.2%}" if "sdpa" in row else ""),
                  flush=True)
            rows.append(row)
        finally:
            kv.close()
            kv.unlink()
    return {"tokens": n_tokens, "chunk": CHUNK, "text": TEXT, "calibration_text": CALIB_TEXT,
            "calibration_tokens": int(calib.shape[1]), "baseline_ppl": base["ppl"],
            "rows": rows}


def target(row, rows=()):
    if row["rule"] == "phase":
        return "(control)"
    c = row["shmkv"]["ppl_change"]
    if row.get("precision", "fp32") != "fp32":     # against the same pool's default
        same = [r for r in rows if r["dtype"] == row["dtype"] and r["rule"] is None
                and r.get("precision", "fp32") == "fp32"]
        if not same:
            return ""
        d = (1 + c) / (1 + same[0]["shmkv"]["ppl_change"]) - 1
        return f"≤ +0.1% vs {row['dtype']}'s default ({d:+.3%}): " + \
            ("PASS" if d <= 0.001 else "FAIL")
    if row["dtype"] == "int8":
        return "≤ +0.5%: " + ("PASS" if c <= 0.005 else "FAIL")
    if row["dtype"] == "float8_e4m3":
        return "≤ +2.5%: " + ("PASS" if c <= 0.025 else "FAIL")
    return ""


def render(res, meta):
    out = [f"<!-- {MARK} -->",
           "### Quality on real text (SmolLM2-135M-Instruct)", "",
           f"`benchmarks/quant_accuracy.py`: SmolLM2-135M-Instruct (float32 weights, "
           f"`shmkv.models`) scores the first {res['tokens']:,} tokens of Debian's "
           f"`{res['text']}` by teacher forcing, {res['chunk']}-token chunks through "
           f"`ShmkvCache` on each pool with `attn_implementation=\"shmkv\"` (the kernel reads "
           f"the pool: every chunk's attention, its own prefill included, sees the stored "
           f"K/V), against transformers' `DynamicCache` in float32 under sdpa (perplexity "
           f"**{res['baseline_ppl']:.4f}**). Top-1: positions whose argmax equals the "
           f"baseline's. float8 scales from `calibrate_kv_scales(model, kv, ids, rule=...)` on "
           f"*another* text (the first {res['calibration_tokens']} tokens of "
           f"`{res['calibration_text']}`). The sdpa columns: the same pool under "
           f"`attn_implementation=\"sdpa\"` (K/V read back from the pool). *amax/448 · 2^u*: "
           f"controls, scales amax/448 times 2^u with u uniform in [0, 1) per layer, head and "
           f"K or V (seeded): inside e4m3's range a scale only moves values along the code "
           f"grid (the same relative step), so these rows show how far perplexity moves by the "
           f"grid's phase alone. "
           f"Load average {meta['load_start'][0]:.1f} at the start, "
           f"{meta['load_end'][0]:.1f} at the end (the figures do not depend on it).", "",
           "| pool | perplexity | vs DynamicCache fp32 | top-1 = fp32 | mean \\|Δ log p\\| "
           "/ token | sdpa: perplexity | sdpa: top-1 = fp32 | target |",
           "|---|---|---|---|---|---|---|---|",
           f"| DynamicCache float32 (baseline) | {res['baseline_ppl']:.4f} | | | | | | |"]
    for r in res["rows"]:
        s, d = r["shmkv"], r.get("sdpa")
        sd = (f"{d['ppl']:.4f} | {d['top1']:.2%}" if d else "– | –")
        out.append(f"| {r['store']} | {s['ppl']:.4f} | {s['ppl_change']:+.2%} | "
                   f"{s['top1']:.2%} | {s['mean_abs_dlogp']:.4f} | {sd} | "
                   f"{target(r, res['rows'])} |")
    return "\n".join(out) + f"\n<!-- /{MARK} -->\n"


def splice(path, section, anchor):
    """Replace the ``MARK`` section of ``path`` (or, the first time, everything from the line
    ``anchor`` up to the next title or closing marker, or the end) by ``section``."""
    with open(path) as f:
        text = f.read()
    pat = re.compile(rf"<!-- {MARK} -->.*?<!-- /{MARK} -->\n", re.S)
    if pat.search(text):
        text = pat.sub(lambda _m: section, text)
    else:
        i = text.index(anchor)
        ends = [j for j in (text.find(t, i + 1) for t in ("\n### ", "\n## ", "\n<!-- /"))
                if j >= 0]
        j = min(ends) if ends else len(text)
        text = text[:i] + section + text[j + 1:]
    with open(path, "w") as f:
        f.write(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="512 tokens, no sdpa re-run, "
                    "nothing written but the JSON")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stores", default="", help="only these stores (labels separated by ';', e.g. "
                    "'bfloat16;bfloat16, precision bf16'); nothing written but the JSON")
    ap.add_argument("--json", default=os.path.join(HERE, "out", "quant_accuracy.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import shmkv
    shmkv.set_num_threads(a.threads)
    meta = {"load_start": os.getloadavg(), "isa": shmkv._attention.isa()}
    only = tuple(x.strip() for x in a.stores.split(";")) if a.stores else ()
    res = run(a.tokens or (512 if a.quick else 2048), sdpa_check=not a.quick, only=only)
    meta["load_end"] = os.getloadavg()
    md = render(res, meta)
    print(md)
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(dict(results=res, meta=meta, table=md), f, indent=1)
    if not a.quick and not only:
        splice(os.path.join(HERE, "RESULTS_quant.md"), md, "### Accuracy on real activations")
        # RESULTS.md carries RESULTS_quant.md between its quant-bench markers (report.py)
        splice(os.path.join(HERE, "RESULTS.md"), md, "### Accuracy on real activations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
