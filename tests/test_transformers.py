"""shmkv.integrations.transformers: ShmkvCache and attn_implementation="shmkv" against
transformers' own DynamicCache on the same seeded model (transformers 5.23.0, torch 2.13.0).

Logits are compared step by step (``output_logits=True``): within 1e-4 of the logits'
scale (max |logit|) in float32.  In bfloat16 / float16 the paged kernel accumulates in
float32 and rounds once where torch's attention rounds its intermediates, so the bound is
a few units of the last place instead: 5e-2 (bf16) and 1e-2 (fp16) of the scale, with the
same greedy tokens."""
import contextlib

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from workers.hf_workers import VOCAB, make_model, model_config, prefill_prompt

import shmkv
import shmkv.integrations.transformers.attention as hf_attention
from shmkv.integrations.transformers import ShmkvCache, config_for

TOL = 1e-4
GREEDY = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture
def make_kv(make_cache):
    """make_kv(model, **overrides) -> a fresh segment laid out for the model (block 4)."""
    def make(m, **kw):
        cfg = config_for(m.config, num_blocks=kw.pop("num_blocks", 256),
                         block_size=kw.pop("block_size", 4), max_seqs=kw.pop("max_seqs", 64),
                         **kw)
        return make_cache(**{f: getattr(cfg, f) for f in (
            "num_layers", "num_kv_heads", "head_dim", "num_blocks", "block_size", "dtype",
            "max_seqs")})
    return make


def prompts(batch, length, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def rel_err(ref, out):
    scale = max(float(x.abs().max()) for x in ref.logits)
    assert len(ref.logits) == len(out.logits)
    return max(float((a - b).abs().max()) for a, b in zip(ref.logits, out.logits)) / scale


@contextlib.contextmanager
def paged_only(on=True):
    """Make sure "shmkv" runs the paged kernel: the dense fallback and the K/V read-back
    raise if used."""
    def boom(*a, **k):
        raise AssertionError("the dense fallback ran")
    with pytest.MonkeyPatch.context() as mp:
        if on:
            mp.setattr(hf_attention, "_dense_attention", boom)
            mp.setattr(ShmkvCache, "_full_kv", boom)
        yield


def settled(kv, base=0):
    st = kv.stats()
    assert st["used_blocks"] == base, st
    assert kv.check() == []


# ---- configuration and registration ------------------------------------------------------
def test_config_for_reads_the_model_config():
    cfg = config_for(model_config(), num_blocks=64, block_size=8, max_seqs=4)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (2, 2, 16)
    assert (cfg.num_blocks, cfg.block_size, cfg.max_seqs, cfg.dtype) == (64, 8, 4, "float32")
    cfg = config_for(model_config(head_dim=32, num_key_value_heads=None), num_blocks=8,
                     dtype=torch.bfloat16)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.dtype) == (4, 32, "bfloat16")
    m = make_model(dtype=torch.float16)
    assert config_for(m.config, num_blocks=8).dtype == "float16"
    with pytest.raises(ValueError, match="dtype"):
        config_for(model_config(), num_blocks=8, dtype=torch.float64)


def test_registered_and_selectable(model):
    assert "shmkv" in ALL_ATTENTION_FUNCTIONS and "shmkv" in ALL_MASK_ATTENTION_FUNCTIONS
    assert make_model(attn="shmkv").config._attn_implementation == "shmkv"
    m = make_model()
    m.set_attn_implementation("shmkv")
    assert m.config._attn_implementation == "shmkv"


# ---- the same logits as DynamicCache -------------------------------------------------------
@pytest.mark.parametrize("attn", ["shmkv", "sdpa", "eager"])
@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_matches_dynamic_cache(model, make_kv, attn, batch):
    model.set_attn_implementation(attn)
    kv = make_kv(model)
    ids = prompts(batch, 11, seed=batch)
    ref = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=7, **GREEDY)
    with ShmkvCache(kv) as past, paged_only(attn == "shmkv"):
        out = model.generate(ids, past_key_values=past, max_new_tokens=7, **GREEDY)
        assert len(past.sequence_ids) == batch
        assert past.get_seq_length() == 11 + 6          # the last token is never fed back
        assert all(kv.seq_len(s) == 17 for s in past.sequence_ids)
    assert torch.equal(out.sequences, ref.sequences)
    assert rel_err(ref, out) < TOL
    assert len(set(ref.sequences[0, 11:].tolist())) > 2   # the model does not just repeat
    settled(kv)


@pytest.mark.parametrize("attn", ["shmkv", "sdpa"])
def test_beam_search_forks_and_matches(model, make_kv, attn):
    model.set_attn_implementation(attn)
    kv = make_kv(model)
    ids = prompts(2, 9, seed=3)
    kw = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False,
              output_scores=True, return_dict_in_generate=True)
    ref = model.generate(ids, past_key_values=DynamicCache(), **kw)
    forks = kv.stats()["forks"]
    with ShmkvCache(kv) as past, paged_only(attn == "shmkv"):
        out = model.generate(ids, past_key_values=past, **kw)
        assert len(past.sequence_ids) == 6
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.allclose(out.sequences_scores, ref.sequences_scores, atol=1e-4)
    assert kv.stats()["forks"] > forks                  # beams share blocks, not copies
    settled(kv)


def test_sampling_matches(model, make_kv):
    model.set_attn_implementation("shmkv")
    kv = make_kv(model)
    ids = prompts(2, 8, seed=4)
    kw = dict(do_sample=True, top_k=40, temperature=1.3, max_new_tokens=8)
    torch.manual_seed(7)
    ref = model.generate(ids, past_key_values=DynamicCache(), **kw)
    torch.manual_seed(7)
    with ShmkvCache(kv) as past:
        out = model.generate(ids, past_key_values=past, **kw)
    assert torch.equal(out, ref)
    settled(kv)


def test_shmkv_attention_with_another_cache_is_dense_and_right(model):
    ids = prompts(2, 10, seed=5)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=5, **GREEDY)
    model.set_attn_implementation("shmkv")
    out = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=5, **GREEDY)
    assert torch.equal(out.sequences, ref.sequences) and rel_err(ref, out) < TOL


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 5e-2), (torch.float16, 1e-2)])
def test_half_precision_pool(make_kv, dtype, tol):
    m = make_model(dtype=dtype, attn="shmkv")
    kv = make_kv(m)
    assert kv.config.dtype == {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    ids = prompts(2, 10, seed=6)
    ref = m.generate(ids, past_key_values=DynamicCache(), max_new_tokens=6, **GREEDY)
    with ShmkvCache(kv) as past:
        out = m.generate(ids, past_key_values=past, max_new_tokens=6, **GREEDY)
    assert torch.equal(out.sequences, ref.sequences)
    assert rel_err(ref, out) < tol
    settled(kv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_precision_matches_dynamic_cache(make_kv, dtype):
    """ShmkvCache(precision="bf16"): the kernel's opt-in mode inside the model -- per-step
    logits (teacher-forced on DynamicCache's greedy tokens) within the half-precision bound
    of DynamicCache's; the mode reaches the kernel (its logits differ from the default's);
    in float32 the same greedy tokens."""
    m = make_model(dtype=dtype, attn="shmkv")
    kv = make_kv(m)
    ids = prompts(2, 10, seed=8)
    ref = m.generate(ids, past_key_values=DynamicCache(), max_new_tokens=6, **GREEDY)
    seq = ref.sequences                       # every cache is fed these tokens (teacher forcing)

    def forced(past):
        """The logits of each step: the prompt's prefill, then one token at a time."""
        with torch.no_grad():
            out = [m(seq[:, :10], past_key_values=past, use_cache=True).logits[:, -1]]
            for t in range(10, seq.shape[1] - 1):
                out.append(m(seq[:, t:t + 1], past_key_values=past, use_cache=True).logits[:, -1])
        return torch.stack(out).float()

    base = forced(DynamicCache())
    with paged_only():
        with ShmkvCache(kv, precision="bf16") as past:
            assert past.precision == "bf16"
            opt = forced(past)
        with ShmkvCache(kv) as past:
            assert past.precision == "fp32"
            exact = forced(past)
    scale = float(base.abs().max())
    assert float((opt - base).abs().max()) / scale < 5e-2
    assert float((exact - opt).abs().max()) > 0          # the opt-in really ran
    if dtype == torch.float32:                            # no near-ties to flip in fp32 here
        with ShmkvCache(kv, precision="bf16") as past:
            out = m.generate(ids, past_key_values=past, max_new_tokens=6, **GREEDY)
        assert torch.equal(out.sequences, ref.sequences)
    settled(kv)


@pytest.mark.parametrize("bad, exc", [("bfloat16", ValueError), (16, TypeError)])
def test_bad_precision_is_refused_before_anything_is_taken(model, make_kv, bad, exc):
    kv = make_kv(model)
    with pytest.raises(exc, match="precision"):
        ShmkvCache(kv, prompt_ids=prompts(1, 9), precision=bad)
    settled(kv)


# ---- padding -------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["shmkv", "sdpa"])
def test_left_padding_matches(model, make_kv, attn):
    model.set_attn_implementation(attn)
    kv = make_kv(model)
    ids = prompts(2, 12, seed=8)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ref = model.generate(ids, attention_mask=mask, past_key_values=DynamicCache(),
                         max_new_tokens=6, **GREEDY)
    with ShmkvCache(kv) as past:
        out = model.generate(ids, attention_mask=mask, past_key_values=past, max_new_tokens=6,
                             **GREEDY)
    assert torch.equal(out.sequences, ref.sequences) and rel_err(ref, out) < TOL
    settled(kv)


def test_padding_with_prompt_ids_is_refused(model, make_kv):
    model.set_attn_implementation("shmkv")
    kv = make_kv(model)
    ids = prompts(2, 12, seed=9)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with ShmkvCache(kv, prompt_ids=ids) as past:
        with pytest.raises(ValueError, match="padded batch"):
            model.generate(ids, attention_mask=mask, past_key_values=past, max_new_tokens=2)
    settled(kv)


# ---- prefix reuse --------------------------------------------------------------------------
def test_prefix_from_a_spawned_process_is_a_hit(model, make_kv, spawn):
    model.set_attn_implementation("shmkv")
    kv = make_kv(model)
    ids = prompts(1, 19, seed=10)
    q = spawn.ctx.Queue()
    p = spawn(prefill_prompt, kv.name, ids[:, :17].numpy(), q)
    p.join(120)
    assert p.exitcode == 0
    res = q.get(timeout=5)
    assert res[0] == "ok", res
    assert res[1:] == (0, 17, [])
    settled(kv)
    cold = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=6, **GREEDY)
    with ShmkvCache(kv, prompt_ids=ids) as past:
        assert past.get_seq_length() == 16                 # 4 whole blocks of the 17
        out = model.generate(ids, past_key_values=past, max_new_tokens=6, **GREEDY)
    assert torch.equal(out.sequences, cold.sequences) and rel_err(cold, out) < TOL
    settled(kv)


def test_fully_cached_prompt_leaves_one_token(model, make_kv):
    model.set_attn_implementation("shmkv")
    kv = make_kv(model)
    ids = prompts(2, 13, seed=11)                          # 12 = 3 whole blocks + 1
    with ShmkvCache(kv, prompt_ids=ids) as past:
        assert past.get_seq_length() == 0
        model.generate(ids, past_key_values=past, max_new_tokens=1)
    fed = []
    hook = model.model.register_forward_pre_hook(
        lambda mod, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        cold = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=4, **GREEDY)
        fed.clear()
        with ShmkvCache(kv, prompt_ids=ids) as past:
            assert past.get_seq_length() == 12
            out = model.generate(ids, past_key_values=past, max_new_tokens=4, **GREEDY)
    finally:
        hook.remove()
    assert fed == [1, 1, 1, 1]                             # prefill computed one token
    assert torch.equal(out.sequences, cold.sequences) and rel_err(cold, out) < TOL
    settled(kv)


def test_rows_start_at_the_common_minimum_and_salt_isolates(model, make_kv):
    model.set_attn_implementation("shmkv")
    kv = make_kv(model)
    a = prompts(1, 14, seed=12)
    with ShmkvCache(kv, prompt_ids=a[:, :9]) as past:      # publishes 2 blocks of a
        model.generate(a[:, :9], past_key_values=past, max_new_tokens=1)
    with ShmkvCache(kv, prompt_ids=a) as past:             # 3 blocks of a
        model.generate(a, past_key_values=past, max_new_tokens=1)
    b = torch.cat([a, a], 0)
    b[1, 6] = (b[1, 6] + 1) % VOCAB                        # row 1 shares only block 0
    cold = model.generate(b, past_key_values=DynamicCache(), max_new_tokens=3, **GREEDY)
    with ShmkvCache(kv, prompt_ids=b) as past:
        assert past.get_seq_length() == 4
        out = model.generate(b, past_key_values=past, max_new_tokens=3, **GREEDY)
    assert torch.equal(out.sequences, cold.sequences) and rel_err(cold, out) < TOL
    with ShmkvCache(kv, prompt_ids=a, salt="tenant-b") as past:
        assert past.get_seq_length() == 0
    settled(kv)


def test_beam_search_from_a_prefix_hit(model, make_kv):
    model.set_attn_implementation("shmkv")
    kv = make_kv(model)
    ids = prompts(2, 10, seed=13)
    with ShmkvCache(kv, prompt_ids=ids) as past:
        model.generate(ids, past_key_values=past, max_new_tokens=1)
    kw = dict(max_new_tokens=5, num_beams=3, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    ref = model.generate(ids, past_key_values=DynamicCache(), **kw)
    with ShmkvCache(kv, prompt_ids=ids) as past:
        assert past.get_seq_length() == 8
        out = model.generate(ids, past_key_values=past, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert torch.allclose(out.sequences_scores, ref.sequences_scores, atol=1e-4)
    settled(kv)


# ---- lifetime, errors, leaks ----------------------------------------------------------------
class _Boom(LogitsProcessor):
    def __init__(self, at):
        self.at, self.calls = at, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("boom")
        return scores


def test_no_leak_after_an_exception_inside_generate(model, make_kv):
    model.set_attn_implementation("shmkv")
    kv = make_kv(model)
    ids = prompts(2, 9, seed=14)
    base = kv.stats()["used_blocks"]
    with pytest.raises(RuntimeError, match="boom"):
        with ShmkvCache(kv) as past:
            model.generate(ids, past_key_values=past, max_new_tokens=8,
                           logits_processor=LogitsProcessorList([_Boom(3)]))
    settled(kv, base)
    # an exception half-way through a forward (after layer 0 wrote): the step is undone
    calls = []

    def hook(mod, args):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("layer 1 failed")
    h = model.model.layers[1].register_forward_pre_hook(hook)
    past = ShmkvCache(kv)
    try:
        with pytest.raises(RuntimeError, match="layer 1"):
            model.generate(ids, past_key_values=past, max_new_tokens=8)
    finally:
        h.remove()
    assert past.get_seq_length() == 9 + 2
    rows = past.sequence_ids
    ref = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=8)
    out = model.generate(ref[:, :12], past_key_values=past, max_new_tokens=5)
    assert past.sequence_ids == rows                   # the undo truncated them in place
    assert all(kv.seq_len(s) == 16 for s in past.sequence_ids)
    assert torch.equal(out, ref[:, :17])
    past.close()
    past.close()                                            # idempotent
    settled(kv, base)


def test_cache_full_releases_everything(model, make_kv):
    model.set_attn_implementation("shmkv")
    kv = make_kv(model, num_blocks=24)
    keep = kv.create_sequence()                            # someone else's blocks stay
    kv.append(keep, *[np.ones((2, 9, 2, 16), np.float32)] * 2)
    base = kv.stats()["used_blocks"]
    past = ShmkvCache(kv)
    with pytest.raises(shmkv.CacheFullError):
        model.generate(prompts(3, 20, seed=15), past_key_values=past, max_new_tokens=30,
                       num_beams=2)
    assert past.sequence_ids == [] and past.get_seq_length() == 0
    settled(kv, base)
    assert kv.seq_len(keep) == 9
    past.close()
    kv.free(keep)
    settled(kv)


def test_crop_and_assisted_decoding(model, make_kv):
    model.set_attn_implementation("shmkv")
    kv = make_kv(model)
    ids = prompts(1, 10, seed=16)
    assistant = make_model(seed=1, num_hidden_layers=1)
    ref = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=8, **GREEDY)
    with ShmkvCache(kv) as past:
        out = model.generate(ids, past_key_values=past, assistant_model=assistant,
                             max_new_tokens=8, **GREEDY)
    assert torch.equal(out.sequences, ref.sequences) and rel_err(ref, out) < 1e-3
    # crop by hand: the kept tokens are the same bytes
    with ShmkvCache(kv) as past:
        model.generate(ids, past_key_values=past, max_new_tokens=4)
        before = [kv.gather(s) for s in past.sequence_ids]
        rows, free = past.sequence_ids, kv.stats()["free_blocks"]
        past.crop(-3)
        assert past.get_seq_length() == 13 - 3
        assert past.sequence_ids == rows                    # truncated in place
        assert kv.stats()["free_blocks"] >= free            # nothing copied
        for s, (k, v) in zip(past.sequence_ids, before):
            gk, gv = kv.gather(s)
            assert np.array_equal(gk, k[:, :10]) and np.array_equal(gv, v[:, :10])
        past.crop(0)
        with pytest.raises(ValueError, match="positive"):
            past.crop(2)
    settled(kv)


def test_hand_off_between_caches(model, make_kv):
    model.set_attn_implementation("shmkv")
    kv = make_kv(model)
    ids = prompts(2, 9, seed=17)
    ref = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=8)
    past = ShmkvCache(kv)
    first = model.generate(ids, past_key_values=past, max_new_tokens=4)
    sids = past.release()
    assert past.sequence_ids == [] and [kv.seq_len(s) for s in sids] == [12, 12]
    for s in sids:
        kv.detach(s)
        assert kv.owner_pid(s) is None
        kv.adopt(s)
    with ShmkvCache(kv, sequence_ids=sids) as past2:
        assert past2.get_seq_length() == 12 and past2.sequence_ids == sids
        out = model.generate(first, past_key_values=past2, max_new_tokens=4)
    assert torch.equal(out, ref)
    settled(kv)
    a, b = kv.create_sequence(), kv.create_sequence()
    kv.append(a, *[np.zeros((2, 3, 2, 16), np.float32)] * 2)
    with pytest.raises(ValueError, match="equal length"):
        ShmkvCache(kv, sequence_ids=[a, b])
    kv.free(a)
    kv.free(b)


def test_reorder_cache_is_forks_and_frees(model, make_kv):
    kv = make_kv(model)
    past = ShmkvCache(kv)
    k = torch.randn(3, 2, 5, 16)
    for layer in range(2):
        past.update(k + layer, -k, layer)
    old = past.sequence_ids
    forks, used = kv.stats()["forks"], kv.stats()["used_blocks"]
    past.reorder_cache(torch.tensor([2, 0, 2]))
    new = past.sequence_ids
    assert new[0] == old[2] and new[1] == old[0] and new[2] not in old
    assert kv.stats()["forks"] == forks + 1
    assert kv.stats()["used_blocks"] == used - 2            # row 1 freed, row 2 shared
    assert old[1] not in kv.sequences()
    gk, _ = kv.gather(new[2])
    assert np.array_equal(gk[1], (k[2] + 1).transpose(0, 1).numpy())
    past.batch_repeat_interleave(2)
    assert len(past.sequence_ids) == 6
    past.batch_select_indices(torch.tensor([5]))
    assert len(past.sequence_ids) == 1 and past.get_seq_length() == 5
    past.close()
    settled(kv)


def test_sequence_slots_exhausted_by_beams_release_everything(model, make_kv):
    model.set_attn_implementation("shmkv")
    kv = make_kv(model, max_seqs=5)
    past = ShmkvCache(kv)
    with pytest.raises(shmkv.CacheFullError):
        model.generate(prompts(2, 6, seed=18), past_key_values=past, max_new_tokens=4,
                       num_beams=3)
    assert past.sequence_ids == [] and kv.sequences() == []
    settled(kv)


def test_mode_full_under_shmkv_is_right_and_mode_is_checked(model, make_kv):
    model.set_attn_implementation("shmkv")
    kv = make_kv(model)
    ids = prompts(2, 7, seed=19)
    ref = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=4, **GREEDY)
    with ShmkvCache(kv) as past:
        past.mode = "full"                      # whole K/V: dense attention, same logits
        out = model.generate(ids, past_key_values=past, max_new_tokens=4, **GREEDY)
        with pytest.raises(ValueError, match="mode"):
            past.mode = "fast"
    assert torch.equal(out.sequences, ref.sequences) and rel_err(ref, out) < TOL
    settled(kv)


# ---- quantized pools ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3"])
def test_quantized_pool_paged_and_dense_agree(model, make_kv, dtype):
    """config_for(..., dtype="int8" | "float8_e4m3"): ShmkvCache writes float32 and the
    pool quantizes; the paged kernel ("shmkv") and dense attention over the dequantized
    K/V ("sdpa", through the views) read the same values, so their logits agree to fp32
    rounding; both stay near DynamicCache's (the quantization's error)."""
    ids = prompts(2, 13, seed=5)
    res = {}
    for attn in ("shmkv", "sdpa"):
        model.set_attn_implementation(attn)
        kv = make_kv(model, dtype=dtype)
        assert kv.config.quantized
        with ShmkvCache(kv) as past, paged_only(attn == "shmkv"):
            res[attn] = model.generate(ids, past_key_values=past, max_new_tokens=5, **GREEDY)
            assert all(kv.seq_len(s) == 17 for s in past.sequence_ids)
        settled(kv)
    model.set_attn_implementation("sdpa")
    assert torch.equal(res["shmkv"].sequences[:, :14], res["sdpa"].sequences[:, :14])
    first = [(a[0:1], b[0:1]) for a, b in zip(res["shmkv"].logits[:1], res["sdpa"].logits[:1])]
    scale = max(float(a.abs().max()) for a, _ in first)
    assert max(float((a - b).abs().max()) for a, b in first) <= 1e-4 * scale
    ref = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=5, **GREEDY)
    err = float((ref.logits[0] - res["shmkv"].logits[0]).abs().max()) / float(
        ref.logits[0].abs().max())
    assert err < (0.05 if dtype == "int8" else 0.5)
