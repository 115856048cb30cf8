"""ShmkvConnector with real vLLM engines on the real model (SmolLM2-135M-Instruct):
each engine in its own process group (engine_worker.py), pinned to one core: a baseline
without the connector beside engine A that fills a fresh segment, then engine B that
reads it.
B's requests cover the hit of A's prompt blocks, a chat's next turn hitting the previous
answer, two load shortfalls (blocks vanished between the scheduler's match and the
worker's load) and, last, a worker SIGKILLed in the middle of a save."""
from __future__ import annotations

import os

import numpy as np
import pytest
from serve_helpers import side_by_side
from support import unique_name
from vllm_helpers import FAULT, SB, VB, _model_dir, _prompts, _run_engine, expected_hit

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    import shmkv
    from shmkv.integrations.vllm import request_salt

    tmp = tmp_path_factory.mktemp("vllm")
    model = _model_dir()
    P = _prompts(model)
    seg = unique_name("vllm")
    extra = {"segment": seg, "size_gib": 0.25}
    base = {"model": model, "extra": None, "requests": [
        {"prompt_ids": P["p1"], "max_tokens": 32},
        {"prompt_ids": P["turn1"], "max_tokens": 260, "ignore_eos": True},
        {"continue_from": 1, "suffix_ids": P["suffix"], "max_tokens": 16},
        {"prompt_ids": P["p2ext"], "max_tokens": 16},
        {"prompt_ids": P["p2r"], "max_tokens": 16},
    ]}
    a = {"model": model, "extra": extra, "requests": [
        {"prompt_ids": P["p1"], "max_tokens": 32},
        {"prompt_ids": P["turn1"], "max_tokens": 260, "ignore_eos": True},
        {"prompt_ids": P["p2"], "max_tokens": 4, "cache_salt": FAULT["overclaim"]},
        {"prompt_ids": P["p2r"], "max_tokens": 4, "cache_salt": FAULT["reset"]},
    ]}
    try:
        # vLLM alone beside A (each on a core of its own): they share nothing
        (rc0, r0), (rcA, rA) = side_by_side(
            lambda core: _run_engine(tmp, "base", base, core=core),
            lambda core: _run_engine(tmp, "A", a, fault=True, core=core))
        assert rc0 == 0, (tmp / "base.log").read_text()[-3000:]
        assert rcA == 0, (tmp / "A.log").read_text()[-3000:]
        # what A stored, read before B's reset fault drops the prefix index: p1, and p2,
        # whose first load in A fell short (overclaim on an empty segment)
        kv = shmkv.KVCache.attach(seg)
        salt = request_salt(model)
        stored = {}
        for key, s in (("p1", salt), ("p2", request_salt(model, FAULT["overclaim"]))):
            sid = kv.create_sequence(tokens=P[key] + [0], salt=s)
            stored[key] = (kv.seq_len(sid), *kv.gather(sid))
            kv.free(sid)
        a_check = kv.check()
        kv.close()
        turn2 = rA["results"][1]["prompt_ids"] + rA["results"][1]["token_ids"] + P["suffix"]
        b = {"model": model, "extra": extra, "requests": [
            {"prompt_ids": P["p1"], "max_tokens": 32},
            {"prompt_ids": turn2, "max_tokens": 16},
            {"prompt_ids": P["p2ext"], "max_tokens": 16, "cache_salt": FAULT["overclaim"]},
            {"prompt_ids": P["p2r"], "max_tokens": 16, "cache_salt": FAULT["reset"]},
            {"prompt_ids": P["p3"], "max_tokens": 4, "cache_salt": FAULT["kill"]},
        ]}
        # pinned as base and A were (one core's threads: the same numerics as theirs)
        rcB, rB = _run_engine(tmp, "B", b, fault=True, core=min(os.sched_getaffinity(0)))
        kv = shmkv.KVCache.attach(seg)      # attach runs recovery: B's worker died mid-save
        try:
            after = {"recovered": kv.recover(), "check": kv.check(), "stats": kv.stats(),
                     "p3_hit": kv.match_prefix(P["p3"], request_salt(model, FAULT["kill"])),
                     "p1_hit": kv.match_prefix(P["p1"], salt)}
        finally:
            kv.close()
        yield {"P": P, "model": model, "base": r0["results"], "A": rA["results"],
               "B": rB["results"], "rcB": rcB, "stored": stored, "a_check": a_check,
               "after": after, "log_A": (tmp / "A.log").read_text(errors="replace"),
               "log_B": (tmp / "B.log").read_text(errors="replace")}
    finally:
        try:
            shmkv.KVCache.attach(seg).unlink()
        except Exception:
            pass


def test_b_loads_a_prompt_blocks_and_output_equals_baseline(runs):
    base, A, B, P = runs["base"], runs["A"], runs["B"], runs["P"]
    assert len(P["p1"]) >= 1000
    assert A[0]["token_ids"] == base[0]["token_ids"]
    assert A[0]["num_cached_tokens"] == 0
    # every block of the prompt A computed, to a shmkv block (16 tokens) inside a vLLM
    # block (vLLM computes the last token itself)
    assert B[0]["num_cached_tokens"] == expected_hit(len(P["p1"]), 32) >= 896
    assert expected_hit(len(P["p1"]), 32) % VB != 0, "the prompt should end a hit mid-block"
    assert B[0]["token_ids"] == base[0]["token_ids"]
    assert runs["a_check"] == []


@pytest.mark.parametrize("key", ["p1", "p2"])
def test_stored_kv_equals_transformers(runs, key):
    """p1: what A computed and saved; p2: what A saved after its first load of the prompt
    fell short (the step that computed on unloaded blocks must not be saved)."""
    import torch
    from transformers import AutoModelForCausalLM

    n, k, v = runs["stored"][key]
    ids = runs["P"][key]
    assert n >= len(ids) // VB * VB and n >= 3 * VB and n % SB == 0   # the prompt's blocks
    model = AutoModelForCausalLM.from_pretrained(runs["model"], dtype=torch.float32,
                                                 attn_implementation="sdpa")
    with torch.no_grad():
        out = model(torch.tensor([ids[:n]]), use_cache=True)
    pkv = out.past_key_values
    for layer in range(k.shape[0]):
        hk = pkv.layers[layer].keys[0].permute(1, 0, 2).numpy()     # [n, H, D]
        hv = pkv.layers[layer].values[0].permute(1, 0, 2).numpy()
        np.testing.assert_allclose(k[layer], hk, atol=1e-4, rtol=1e-4,
                                   err_msg=f"K of layer {layer}")
        np.testing.assert_allclose(v[layer], hv, atol=1e-4, rtol=1e-4,
                                   err_msg=f"V of layer {layer}")


def test_chat_next_turn_hits_previous_answer(runs):
    base, A, B = runs["base"], runs["A"], runs["B"]
    turn1 = A[1]
    assert turn1["token_ids"] == base[1]["token_ids"]
    answered = len(turn1["prompt_ids"]) + len(turn1["token_ids"])
    assert B[1]["num_cached_tokens"] > len(turn1["prompt_ids"]) + VB     # into the answer
    assert B[1]["num_cached_tokens"] == (answered - 1) // VB * VB
    assert B[1]["token_ids"] == base[2]["token_ids"]


def test_load_shortfall_recomputes_with_right_outputs(runs):
    base, B, P = runs["base"], runs["B"], runs["P"]
    # overclaim: the scheduler promised one block more than the segment held
    held = (len(P["p2"]) + 4 - 1) // VB * VB
    assert len(P["p2ext"]) - 1 >= held + VB
    assert B[2]["token_ids"] == base[3]["token_ids"]
    assert B[2]["num_cached_tokens"] == held + VB        # what the scheduler claimed
    # reset before load: every matched block vanished before the worker's load
    assert B[3]["token_ids"] == base[4]["token_ids"]
    # vLLM recomputed exactly what did not load: one block, then all three of p2r's
    log = runs["log_B"]
    assert "Recovered from KV load failure: 1 request(s) rescheduled (128 tokens affected)" \
        in log
    assert "Recovered from KV load failure: 1 request(s) rescheduled (384 tokens affected)" \
        in log
    # A's first p2 request claimed a block of an empty segment
    assert "rescheduled (128 tokens affected)" in runs["log_A"]


def test_worker_killed_mid_save_leaves_segment_consistent(runs):
    after = runs["after"]
    assert len(runs["B"]) == 4, "the killed request must not have completed"
    assert runs["rcB"] != 0
    assert after["check"] == []
    assert after["p3_hit"] == 0             # nothing half-written is findable
    assert after["stats"]["num_sequences"] == 0
    assert after["stats"]["used_blocks"] == 0
