"""One segment, two kinds of engine: a transformers process (``ShmkvCache``) and a
vLLM instance with the same model and salt share blocks both ways.

What has to agree: the salt (``request_salt(model_id)``: the transformers side passes the
same string the connector builds from the model path), the block hashing (both go through
the segment's ``match_prefix`` / ``reserve(tokens=)``), the block size (16: ``config_for``'s
and the connector's default, dividing vLLM's 128) and the layout (``config_for`` gives the
model's layers, KV heads, head_dim and dtype, what the connector asks).

One vLLM engine (SmolLM2, float32): before it, this process prefills prompt H with
``ShmkvCache`` (and its stored K/V equal transformers' own DynamicCache); the engine's first
request loads H's blocks, its second computes prompt V and saves it; the same prompts under
another ``cache_salt`` (nothing to load: the engine's own output without a hit) give the
reference outputs.  After it, ``ShmkvCache`` on V starts from vLLM's blocks: they equal
DynamicCache's K/V and greedy generation equals DynamicCache's."""
from __future__ import annotations

import numpy as np
import pytest
from configs_helpers import model_dir, prompt_ids, run_engine, unlink
from support import unique_name

VB, BS = 128, 16
N_H, N_V, GEN = 600, 520, 12


def _dynamic_kv(model, ids):
    import torch

    with torch.no_grad():
        pkv = model(torch.tensor([ids]), use_cache=True).past_key_values
    return ([pkv.layers[i].keys[0].permute(1, 0, 2).numpy() for i in range(len(pkv.layers))],
            [pkv.layers[i].values[0].permute(1, 0, 2).numpy() for i in range(len(pkv.layers))])


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    import shmkv
    from shmkv.integrations.transformers import ShmkvCache, config_for
    from shmkv.integrations.vllm import request_salt

    tmp = tmp_path_factory.mktemp("vllm-hf")
    path = model_dir()
    salt = request_salt(path)             # what the connector uses: model_id = the path
    h_ids = prompt_ids(path, 4000, N_H)
    v_ids = prompt_ids(path, 9000, N_V)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    seg = unique_name("vllm-hf")
    kv = shmkv.KVCache.create(seg, config_for(model.config, num_blocks=512, block_size=BS,
                                              max_seqs=16))
    try:
        # transformers prefills H through ShmkvCache: its prompt blocks are published
        with ShmkvCache(kv, prompt_ids=torch.tensor([h_ids]), salt=salt, model=model) as past:
            assert past.get_seq_length() == 0
            model.generate(torch.tensor([h_ids]), past_key_values=past, max_new_tokens=1,
                           do_sample=False)
        sid = kv.create_sequence(tokens=np.asarray(h_ids + [0], np.int32), salt=salt)
        hf_stored = (kv.seq_len(sid), *kv.gather(sid))
        kv.free(sid)
        dyn_h = _dynamic_kv(model, h_ids[:hf_stored[0]])
        job = {"model": path, "extra": {"segment": seg}, "engine": {"dtype": "float32"},
               "requests": [{"prompt_ids": h_ids, "max_tokens": GEN},
                            {"prompt_ids": v_ids, "max_tokens": GEN},
                            {"prompt_ids": h_ids, "max_tokens": GEN, "cache_salt": "ref"},
                            {"prompt_ids": v_ids, "max_tokens": GEN, "cache_salt": "ref"}]}
        rc, out, log = run_engine(tmp, "V", job)
        assert rc == 0, log[-3000:]
        # transformers on V: starts from vLLM's blocks
        with ShmkvCache(kv, prompt_ids=torch.tensor([v_ids]), salt=salt, model=model) as past:
            hit = past.get_seq_length()
            k, v = kv.gather(past.sequence_ids[0], 0, hit)
            gen = model.generate(torch.tensor([v_ids]), past_key_values=past,
                                 max_new_tokens=GEN, do_sample=False)[0, N_V:].tolist()
        ref = model.generate(torch.tensor([v_ids]), max_new_tokens=GEN, do_sample=False,
                             past_key_values=None)[0, N_V:].tolist()
        dyn_v = _dynamic_kv(model, v_ids[:hit])
        yield {"vllm": out["results"], "hf_stored": hf_stored, "dyn_h": dyn_h,
               "hit_v": hit, "vllm_kv_v": (k, v), "dyn_v": dyn_v, "gen": gen, "ref": ref,
               "check": kv.check()}
    finally:
        kv.close()
        unlink(seg)


def test_transformers_blocks_equal_dynamic_cache(shared):
    n, k, v = shared["hf_stored"]
    assert n == (N_H - 1) // BS * BS                 # every whole block of the prompt
    dk, dv = shared["dyn_h"]
    for i in range(len(dk)):
        np.testing.assert_allclose(k[i], dk[i], atol=1e-4, rtol=1e-4, err_msg=f"K {i}")
        np.testing.assert_allclose(v[i], dv[i], atol=1e-4, rtol=1e-4, err_msg=f"V {i}")


def test_vllm_loads_what_transformers_computed(shared):
    r = shared["vllm"]
    assert r[0]["num_cached_tokens"] == (N_H - 1) // BS * BS == 592
    assert r[0]["connector"]["loaded_tokens"] == 592
    assert r[2]["num_cached_tokens"] == 0             # another salt: nothing to load
    assert r[0]["token_ids"] == r[2]["token_ids"]     # the engine's output without a hit
    assert r[1]["num_cached_tokens"] == 0 and r[3]["num_cached_tokens"] == 0
    assert r[1]["token_ids"] == r[3]["token_ids"]


def test_transformers_loads_what_vllm_computed(shared):
    hit = shared["hit_v"]
    # vLLM saved the whole vLLM blocks it computed of V (prompt + answer: 520 + 12)
    assert hit == min((N_V + GEN - 1) // VB * VB, (N_V - 1) // BS * BS) == 512
    k, v = shared["vllm_kv_v"]
    dk, dv = shared["dyn_v"]
    for i in range(len(dk)):
        np.testing.assert_allclose(k[i], dk[i], atol=1e-4, rtol=1e-4, err_msg=f"K {i}")
        np.testing.assert_allclose(v[i], dv[i], atol=1e-4, rtol=1e-4, err_msg=f"V {i}")
    assert shared["gen"] == shared["ref"]
    assert shared["check"] == []
