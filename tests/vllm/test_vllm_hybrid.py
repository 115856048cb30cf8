"""Hybrid models (hybrid.py): sliding-window layers beside full ones.

A seeded tiny Gemma 3 (4 layers: sliding window 64, full, sliding, full; 4 query / 2 KV
heads, head_dim 32, random weights, SmolLM2's tokenizer; saved once into a temp dir, no
hub).  vLLM serves it with two KV cache groups (its hybrid manager) when no connector is
set; with the connector -- which does not implement SupportsHMA -- vLLM turns the hybrid
manager off and every layer keeps whole blocks in one group, which the connector shares
as full attention's.  Engine A computes P and saves it, engine B loads it: B's output
equals the same prompt's without a hit (another cache_salt, same engine) and A's; the
stored K/V equal transformers' own cache (all tokens of the full layers, and the tokens
transformers' sliding layers keep).  Without engines: several KV cache groups or a
non-attention group are refused with the reason."""
from __future__ import annotations

import numpy as np
import pytest
from configs_helpers import GEMMA3_LAYER_TYPES as LAYER_TYPES
from configs_helpers import run_engine, tiny_gemma3, unlink
from support import unique_name

VB, BS, GEN, N = 128, 16, 12, 400


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory):
    import shmkv
    from shmkv.integrations.vllm import request_salt

    tmp = tmp_path_factory.mktemp("vllm-hybrid")
    path = tiny_gemma3(tmp / "tiny-gemma3")
    p = np.random.default_rng(5).integers(100, 49000, N).tolist()
    eng = {"dtype": "float32"}
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    with torch.no_grad():
        ref = model.generate(torch.tensor([p]), max_new_tokens=GEN,
                             do_sample=False)[0, N:].tolist()
    # vLLM 0.32 CPU on this tiny Gemma 3 now and then answers [first token, 0, 0, ...] for
    # every request of one engine, in requests that loaded nothing (docs/known-issues.md:
    # seen only in engines with the connector configured, which on 2 cores also run two
    # OpenMP threads; the cause is not known, the connector's load path never ran).  Such
    # a round is run again, once, and said (a warning); a second one fails the assertions
    for attempt in range(2):
        seg = unique_name("vllm-hybrid")
        extra = {"segment": seg, "num_blocks": 256}
        try:
            rca, ra, loga = run_engine(tmp, f"A{attempt}", {
                "model": path, "extra": extra, "engine": eng,
                "requests": [{"prompt_ids": p, "max_tokens": GEN}]})
            assert rca == 0, loga[-4000:]
            kv = shmkv.KVCache.attach(seg)
            try:
                sid = kv.create_sequence(tokens=p + [0], salt=request_salt(path))
                stored = (kv.seq_len(sid), *kv.gather(sid))
                kv.free(sid)
            finally:
                kv.close()
            rcb, rb, logb = run_engine(tmp, f"B{attempt}", {
                "model": path, "extra": extra, "engine": eng, "requests": [
                    {"prompt_ids": p, "max_tokens": GEN},
                    {"prompt_ids": p, "max_tokens": GEN, "cache_salt": "ref"}]})
            assert rcb == 0, logb[-4000:]
        finally:
            unlink(seg)
        if (ra["results"][0]["token_ids"] == ref
                and rb["results"][1]["token_ids"] == ref):
            break
        if attempt == 0:
            import warnings
            warnings.warn(f"an engine computing the prompt without a load answered "
                          f"{ra['results'][0]['token_ids']} / {rb['results'][1]['token_ids']}"
                          f", transformers {ref} (docs/known-issues.md): the round runs again",
                          stacklevel=1)
    yield {"path": path, "p": p, "A": ra["results"], "B": rb["results"], "ref": ref,
           "stored": stored, "logA": loga, "attempts": attempt + 1}


def test_hybrid_model_shares_as_one_group_and_outputs_equal(hybrid_runs):
    A, B = hybrid_runs["A"], hybrid_runs["B"]
    # vLLM's own rule for a connector without SupportsHMA, in A's log
    assert "Turning off hybrid kv cache manager" in hybrid_runs["logA"]
    hit = min((N + GEN - 1) // VB * VB, (N - 1) // BS * BS)
    assert hit == 384
    assert B[0]["num_cached_tokens"] == hit
    assert B[0]["connector"]["loaded_tokens"] == hit
    assert B[1]["num_cached_tokens"] == 0
    assert B[0]["token_ids"] == B[1]["token_ids"]   # a hit does not change the output
    # and all of them against transformers' own greedy answer (independent of vLLM):
    # tells a wrong load (B) apart from a wrong computation without one (A)
    ref = hybrid_runs["ref"]
    assert len(set(ref)) > 3                        # the model's answer is not one token
    assert B[0]["token_ids"] == ref
    assert A[0]["token_ids"] == ref, ("engine A computed P without any load and its output "
                                      "differs from transformers'")


def test_hybrid_stored_kv_equals_transformers(hybrid_runs):
    import torch
    from transformers import AutoModelForCausalLM

    n, k, v = hybrid_runs["stored"]
    assert n == 384
    model = AutoModelForCausalLM.from_pretrained(hybrid_runs["path"], dtype=torch.float32,
                                                 attn_implementation="sdpa")
    with torch.no_grad():
        pkv = model(torch.tensor([hybrid_runs["p"][:n]]), use_cache=True).past_key_values
    for layer, kind in enumerate(LAYER_TYPES):
        hk = pkv.layers[layer].keys[0].permute(1, 0, 2).numpy()     # [kept, H, D]
        hv = pkv.layers[layer].values[0].permute(1, 0, 2).numpy()
        kept = hk.shape[0]
        if kind == "full_attention":
            assert kept == n
        else:
            assert 0 < kept < n         # transformers keeps only the window's tokens
        np.testing.assert_allclose(k[layer][n - kept:], hk, atol=1e-4, rtol=1e-4,
                                   err_msg=f"K of layer {layer} ({kind})")
        np.testing.assert_allclose(v[layer][n - kept:], hv, atol=1e-4, rtol=1e-4,
                                   err_msg=f"V of layer {layer} ({kind})")


def test_several_groups_or_ssm_state_refused():
    from types import SimpleNamespace as NS

    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from shmkv.integrations.vllm.hybrid import check_groups

    full = NS(kv_cache_spec=object.__new__(FullAttentionSpec), layer_names=["a"])
    slide = NS(kv_cache_spec=object.__new__(SlidingWindowSpec), layer_names=["b"])
    mamba = NS(kv_cache_spec=object.__new__(MambaSpec), layer_names=["m"])
    with pytest.raises(ValueError, match=r"2 groups \(FullAttentionSpec, "
                       r"SlidingWindowSpec\).*supports one group"):
        check_groups(NS(kv_cache_groups=[full, slide]))
    with pytest.raises(ValueError, match="MambaSpec.*attention K/V only"):
        check_groups(NS(kv_cache_groups=[mamba]))
    check_groups(None)
    check_groups(NS(kv_cache_groups=[full]))        # one attention group: served
