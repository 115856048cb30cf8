"""Tensor parallel (tp.py): a shmkv block holds all KV heads, each rank writes and
reads its own slice, so a TP=1 and a TP=2 instance share blocks both ways.

A seeded tiny Llama (4 query / 2 KV heads, head_dim 32, random weights, SmolLM2's
tokenizer) is saved once into a temp dir; no hub.  Engines one at a time, TP=2 ranks
bound to cores 0 and 1 (``VLLM_CPU_OMP_THREADS_BIND="0|1"``):
A (TP=2) computes P1 and saves it; B (TP=1) loads P1's blocks (written by two ranks),
computes P2 and saves it; C (TP=2) loads P2's blocks (written by one rank), then a request
whose last rank SIGKILLs itself half-way through its slice of a save.  The reference
outputs are the same engine's on the same prompts under another ``cache_salt`` (nothing to
load); P1's blocks equal transformers' own DynamicCache for every head; after C's killed
save the segment is consistent and nothing of that prompt is findable."""
from __future__ import annotations

import numpy as np
import pytest
from configs_helpers import run_engine, tiny_llama, unlink
from support import unique_name

VB, BS, GEN = 128, 16, 8


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab - 100, n).tolist()


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    import shmkv
    from shmkv.integrations.vllm import request_salt

    tmp = tmp_path_factory.mktemp("vllm-tp")
    path = tiny_llama(tmp / "tiny-llama")
    p1, p2, p3 = (_ids(s, 300, 49000) for s in (1, 2, 3))
    seg = unique_name("vllm-tp")
    extra = {"segment": seg, "num_blocks": 256}
    tp2 = {"dtype": "float32", "tensor_parallel_size": 2}
    tp1 = {"dtype": "float32"}
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    try:
        rca, ra, loga = run_engine(tmp, "A", {"model": path, "extra": extra, "engine": tp2,
                                              "requests": [{"prompt_ids": p1, "max_tokens": GEN}]},
                                   env_extra=bind)
        assert rca == 0, loga[-4000:]
        kv = shmkv.KVCache.attach(seg)
        try:
            sid = kv.create_sequence(tokens=p1 + [0], salt=request_salt(path))
            stored = (kv.seq_len(sid), *kv.gather(sid))
            kv.free(sid)
            cfg = kv.config
        finally:
            kv.close()
        rcb, rb, logb = run_engine(tmp, "B", {"model": path, "extra": extra, "engine": tp1,
                                              "requests": [
            {"prompt_ids": p1, "max_tokens": GEN},
            {"prompt_ids": p1, "max_tokens": GEN, "cache_salt": "ref"},
            {"prompt_ids": p2, "max_tokens": GEN}]})
        assert rcb == 0, logb[-4000:]
        rcc, rc_, logc = run_engine(tmp, "C", {"model": path, "extra": extra, "engine": tp2,
                                               "requests": [
            {"prompt_ids": p2, "max_tokens": GEN},
            {"prompt_ids": p2, "max_tokens": GEN, "cache_salt": "ref"},
            {"prompt_ids": p3, "max_tokens": GEN, "cache_salt": "t:fault:kill_mid_save"}]},
                                    env_extra={**bind, "SHMKV_VLLM_FAULT": "1"})
        kv = shmkv.KVCache.attach(seg)      # attach runs recovery: C's rank died mid-save
        try:
            after = {"recovered": kv.recover(), "check": kv.check(), "stats": kv.stats(),
                     "p3_hit": kv.match_prefix(np.asarray(p3, np.int32),
                                               request_salt(path, "t:fault:kill_mid_save")),
                     "p1_hit": kv.match_prefix(np.asarray(p1, np.int32), request_salt(path))}
        finally:
            kv.close()
        yield {"path": path, "p1": p1, "A": ra["results"], "B": rb["results"],
               "C": rc_["results"], "rcC": rcc, "stored": stored, "cfg": cfg,
               "after": after, "logC": logc}
    finally:
        unlink(seg)


def test_tp2_segment_holds_all_heads(tp_runs):
    cfg = tp_runs["cfg"]
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (2, 2, 32)
    assert tp_runs["A"][0]["connector"]["saved_tokens"] >= 256


def test_tp2_stored_kv_equals_transformers(tp_runs):
    """Both ranks' slices at their heads: against transformers' DynamicCache."""
    import torch
    from transformers import AutoModelForCausalLM

    n, k, v = tp_runs["stored"]
    assert n == (300 + GEN - 1) // VB * VB == 256
    model = AutoModelForCausalLM.from_pretrained(tp_runs["path"], dtype=torch.float32,
                                                 attn_implementation="sdpa")
    with torch.no_grad():
        pkv = model(torch.tensor([tp_runs["p1"][:n]]), use_cache=True).past_key_values
    for layer in range(2):
        hk = pkv.layers[layer].keys[0].permute(1, 0, 2).numpy()
        hv = pkv.layers[layer].values[0].permute(1, 0, 2).numpy()
        np.testing.assert_allclose(k[layer], hk, atol=1e-4, rtol=1e-4, err_msg=f"K {layer}")
        np.testing.assert_allclose(v[layer], hv, atol=1e-4, rtol=1e-4, err_msg=f"V {layer}")


def test_tp1_loads_what_tp2_saved(tp_runs):
    B = tp_runs["B"]
    assert B[0]["num_cached_tokens"] == 256
    assert B[0]["connector"]["loaded_tokens"] == 256
    assert B[1]["num_cached_tokens"] == 0
    assert B[0]["token_ids"] == B[1]["token_ids"]


def test_tp2_loads_what_tp1_saved(tp_runs):
    C = tp_runs["C"]
    assert len(C) >= 2, tp_runs["logC"][-4000:]
    assert C[0]["num_cached_tokens"] == 256
    assert C[1]["num_cached_tokens"] == 0
    assert C[0]["token_ids"] == C[1]["token_ids"]


def test_tp2_rank_killed_mid_save_publishes_nothing(tp_runs):
    after = tp_runs["after"]
    assert len(tp_runs["C"]) == 2, "the killed request must not have completed"
    assert tp_runs["rcC"] != 0
    assert after["check"] == []
    assert after["p3_hit"] == 0                 # no half-written block is findable
    assert after["p1_hit"] >= 256               # what was committed before stays
    assert after["stats"]["num_sequences"] == 0
    assert after["stats"]["used_blocks"] == 0


@pytest.mark.parametrize("pack", [0, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rank_slice_c_copy_equals_torch_reference(pack, dtype):
    """A rank's copy between its [NB, H/tp, VB, 2D] tensor and its heads of pools holding
    all H: C (head0 into the pools' rows) against the torch reference on the slice, for
    the vec and AMX layouts; the other heads of the pools are left alone."""
    import torch

    from shmkv.integrations.vllm.layout import CpuLayout

    lay = CpuLayout(pack == 0, amx_pack=pack)
    if pack and dtype == "float32":
        lay = CpuLayout(False, amx_pack=1)
    g = torch.Generator().manual_seed(7)
    dt = getattr(torch, dtype)
    H, Hr, D, bs = 4, 2, 64, 16
    t = torch.randn(6, Hr, VB, 2 * D, generator=g).to(dt)
    kp = torch.randn(30, bs, H, D, generator=g).to(dt)
    vp = torch.randn(30, bs, H, D, generator=g).to(dt)
    shm = torch.randperm(30, generator=g)[:12]
    pieces = torch.randperm(4 * 8, generator=g)[:12] + 8
    vblk, sub = pieces // 8, pieces % 8
    for head0 in (0, 2):
        want, got = t.clone(), t.clone()
        lay.write(want, bs, vblk, sub, kp[:, :, head0:head0 + Hr].index_select(0, shm),
                  vp[:, :, head0:head0 + Hr].index_select(0, shm))
        lay.copy(got, kp, vp, bs, shm, vblk, sub, to_vllm=True, head0=head0)
        assert torch.equal(got, want)
        gk, gv = kp.clone(), vp.clone()
        lay.copy(t, gk, gv, bs, shm, vblk, sub, to_vllm=False, head0=head0)
        k, v = lay.read(t, bs, vblk, sub)
        wk, wv = kp.clone(), vp.clone()
        wk[shm, :, head0:head0 + Hr] = k
        wv[shm, :, head0:head0 + Hr] = v
        assert torch.equal(gk, wk) and torch.equal(gv, wv)
    with pytest.raises(ValueError, match="not a slice of the pools' 4 KV heads"):
        lay.copy(t, kp, vp, bs, shm, vblk, sub, to_vllm=True, head0=3)
