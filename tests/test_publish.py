"""ShmkvCache publishes the tokens it generates: the rules of the decoder hook on
the tiny seeded model (fast; the real model's chats are in test_real_model.py).

What is recorded is checked against the generated sequences themselves (``token_ids``) and
through what another cache can find (``match_prefix``); a forward whose ids are not safe to
record (padded, fed embeddings, shifted positions) must publish nothing."""
import inspect

import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaModel
from workers.hf_workers import VOCAB, make_model

from shmkv.integrations.transformers import ShmkvCache, config_for

BS = 4
GREEDY = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def model():
    return make_model(attn="shmkv")


@pytest.fixture
def make_kv(make_cache):
    def make(m, **kw):
        cfg = config_for(m.config, num_blocks=kw.pop("num_blocks", 256), block_size=BS,
                         max_seqs=kw.pop("max_seqs", 64), **kw)
        return make_cache(**{f: getattr(cfg, f) for f in (
            "num_layers", "num_kv_heads", "head_dim", "num_blocks", "block_size", "dtype",
            "max_seqs")})
    return make


def prompts(batch, length, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def full_blocks(n):
    return n // BS * BS


def stored(out, prompt_len):
    """Tokens a generate call leaves in the cache: all but the last generated one."""
    return out.sequences.shape[1] - 1 if out.sequences.shape[1] > prompt_len else prompt_len


def test_generated_tokens_are_recorded_and_published(model, make_kv):
    kv = make_kv(model)
    ids = prompts(2, 9, seed=1)
    with ShmkvCache(kv, prompt_ids=ids, model=model) as past:
        out = model.generate(ids, past_key_values=past, max_new_tokens=12, **GREEDY)
        n = stored(out, 9)
        for r, sid in enumerate(past.sequence_ids):
            assert kv.seq_len(sid) == n
            assert np.array_equal(kv.token_ids(sid), out.sequences[r, :n].numpy())
    # turn 2: the whole conversation so far, plus a new message
    nxt = torch.cat([out.sequences, prompts(2, 5, seed=2)], 1)
    for row in nxt:
        assert kv.match_prefix(row.numpy()) == full_blocks(n)
    ref = model.generate(nxt, past_key_values=DynamicCache(), max_new_tokens=6, **GREEDY)
    with ShmkvCache(kv, prompt_ids=nxt) as past:
        assert past.get_seq_length() == full_blocks(n)
        got = model.generate(nxt, past_key_values=past, max_new_tokens=6, **GREEDY)
    assert torch.equal(got.sequences, ref.sequences)
    scale = max(float(x.abs().max()) for x in ref.logits)
    assert max(float((a - b).abs().max()) for a, b in zip(ref.logits, got.logits)) < 1e-4 * scale
    assert kv.check() == []


# transformers 5.24 renamed every model forward's `past_key_values` to `cache` (the old name
# deprecated, translated by a decorator after the forward hooks ran): the decoder hook
# must find the cache under either name, or generated tokens silently stop being published
# (when it did not, a chat's next turn hit 16 of 94 tokens instead of 80).
CACHE_KWARGS = ["past_key_values"] + (
    ["cache"] if "cache" in inspect.signature(LlamaModel.forward).parameters else [])


@pytest.mark.parametrize("kwarg", CACHE_KWARGS)
def test_published_whichever_name_the_cache_is_passed_by(model, make_kv, kwarg):
    kv = make_kv(model)
    ids = prompts(1, 7, seed=21)
    with ShmkvCache(kv, prompt_ids=ids, model=model) as past:
        out = model.generate(ids, **{kwarg: past}, max_new_tokens=10, **GREEDY)
        n = stored(out, 7)
        assert n > full_blocks(7)                  # generated tokens reached the cache
        assert np.array_equal(kv.token_ids(past.sequence_ids[0]), out.sequences[0, :n].numpy())
        # direct calls, as a hand-written decode loop makes them
        step = out.sequences[:, n:n + 1]
        model(input_ids=step, **{kwarg: past}, use_cache=True)
        assert kv.seq_len(past.sequence_ids[0]) == n + 1
        assert np.array_equal(kv.token_ids(past.sequence_ids[0]),
                              out.sequences[0, :n + 1].numpy())
    assert kv.match_prefix(out.sequences[0].numpy()) == full_blocks(n + 1)


def test_binding_by_itself_and_without_prompt_ids(make_kv):
    m = make_model(attn="shmkv", seed=3)       # a model no cache has bound yet
    kv = make_kv(m)
    ids = prompts(1, 10, seed=3)
    # unbound, no prompt_ids: the first forward's ids are unknown, so that row is never
    # hashed (nothing wrong is published); the cache binds the model as it runs
    with ShmkvCache(kv) as past:
        out = m.generate(ids, past_key_values=past, max_new_tokens=8, do_sample=False)
    assert kv.match_prefix(out[0].numpy()) == 0
    # bound now: a new cache learns every forward's ids, the prompt's included
    with ShmkvCache(kv) as past:
        out = m.generate(ids, past_key_values=past, max_new_tokens=8, do_sample=False)
        sid = past.sequence_ids[0]
        assert np.array_equal(kv.token_ids(sid), out[0, :-1].numpy())
    assert kv.match_prefix(out[0].numpy()) == full_blocks(17)
    assert kv.check() == []


def test_manual_loop_and_positional_calls(model, make_kv):
    kv = make_kv(model)
    ids = prompts(1, 7, seed=4)
    seq = ids[0].tolist()
    with ShmkvCache(kv, model=model) as past, torch.no_grad():
        h = model.model(ids, None, None, past).last_hidden_state     # positional arguments
        x = model.lm_head(h[:, -1:]).argmax(-1)
        for _ in range(6):                                           # a hand-written loop
            seq.append(int(x))
            x = model(x, past_key_values=past).logits.argmax(-1)
        sid = past.sequence_ids[0]
        assert kv.token_ids(sid).tolist() == seq
    assert kv.match_prefix(np.array(seq + [0])) == full_blocks(13)
    assert kv.check() == []


def test_ids_that_contradict_prompt_ids_are_refused(model, make_kv):
    kv = make_kv(model)
    ids = prompts(1, 9, seed=5)
    other = ids.clone()
    other[0, 6] = (other[0, 6] + 1) % VOCAB
    used = kv.stats()["used_blocks"]
    with ShmkvCache(kv, prompt_ids=ids, model=model) as past:
        with pytest.raises(ValueError, match="differ from its prompt_ids"):
            model.generate(other, past_key_values=past, max_new_tokens=2)
        assert past.get_seq_length() == 0
    assert kv.stats()["used_blocks"] == used
    assert kv.match_prefix(ids[0].numpy()) == 0 and kv.match_prefix(other[0].numpy()) == 0
    assert kv.check() == []


@pytest.mark.parametrize("bound", [True, False])
def test_padded_batch_under_sdpa_records_nothing(make_kv, bound):
    m = make_model(attn="sdpa")                 # a fresh model: bound here, or by the cache
    kv = make_kv(m)
    ids = prompts(2, 10, seed=6)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0                                        # row 1 left-padded
    with ShmkvCache(kv, prompt_ids=ids, model=m if bound else None) as past:
        m.generate(ids, attention_mask=mask, past_key_values=past, max_new_tokens=8,
                   do_sample=False)
    # a token's K depends on the padding: neither the prompt nor the answer is published
    assert kv.match_prefix(ids[0].numpy()) == 0 and kv.match_prefix(ids[1].numpy()) == 0
    assert kv.check() == []


@pytest.mark.parametrize("bound", [True, False])
def test_inputs_embeds_and_shifted_positions_record_nothing(make_kv, bound):
    model = make_model(attn="shmkv")           # a fresh model: bound here, or by the cache
    kv = make_kv(model)
    ids = prompts(1, 9, seed=7)
    with ShmkvCache(kv, prompt_ids=ids, model=model if bound else None) as past:
        out = model.generate(inputs_embeds=model.get_input_embeddings()(ids),
                             past_key_values=past, max_new_tokens=9, do_sample=False)
    assert kv.match_prefix(torch.cat([ids, out], 1)[0].numpy()) == 0
    with ShmkvCache(kv, model=model) as past, torch.no_grad():
        model(ids, position_ids=torch.arange(9)[None] + 5, past_key_values=past)
    assert kv.match_prefix(ids[0].numpy()) == 0
    assert kv.check() == []


def test_beams_publish_the_chosen_beam(model, make_kv):
    kv = make_kv(model)
    ids = prompts(2, 6, seed=8)
    kw = dict(max_new_tokens=11, num_beams=3, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    ref = model.generate(ids, past_key_values=DynamicCache(), **kw)
    with ShmkvCache(kv, prompt_ids=ids) as past:
        out = model.generate(ids, past_key_values=past, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for row in out.sequences:
        assert kv.match_prefix(row.numpy()) == full_blocks(row.shape[0] - 1)
    assert kv.check() == []


def test_sampled_forks_record_their_own_tokens(model, make_kv):
    kv = make_kv(model)
    ids = prompts(1, 7, seed=9)
    torch.manual_seed(0)
    with ShmkvCache(kv, prompt_ids=ids, model=model) as past:
        out = model.generate(ids, past_key_values=past, max_new_tokens=10, do_sample=True,
                             num_return_sequences=3, top_k=0)
        for r, sid in enumerate(past.sequence_ids):
            assert np.array_equal(kv.token_ids(sid), out[r, :-1].numpy())
    for row in out:
        assert kv.match_prefix(row.numpy()) == full_blocks(16)
    assert kv.check() == []


def test_adopted_sequence_keeps_publishing(model, make_kv):
    kv = make_kv(model)
    ids = prompts(1, 10, seed=10)
    with ShmkvCache(kv, prompt_ids=ids, model=model) as past:    # the "prefill worker"
        with torch.no_grad():
            model(ids[:, :-1], past_key_values=past)          # all but the last token
        (sid,) = past.release()
    kv.detach(sid)
    kv.adopt(sid)                                                  # the "decode worker"
    ref = model.generate(ids, past_key_values=DynamicCache(), max_new_tokens=9, **GREEDY)
    with ShmkvCache(kv, sequence_ids=[sid], model=model) as past:
        out = model.generate(ids, past_key_values=past, max_new_tokens=9, **GREEDY)
    assert torch.equal(out.sequences, ref.sequences)
    assert kv.match_prefix(out.sequences[0].numpy()) == full_blocks(18)
    assert kv.check() == []


def test_bind_checks_its_argument(make_kv, model):
    kv = make_kv(model)
    with ShmkvCache(kv) as past:
        with pytest.raises(TypeError, match="torch.nn.Module"):
            past.bind("model")
        assert past.bind(model) is past
        assert past.bind(model) is past                            # idempotent
    pre = [h for h in model.model._forward_pre_hooks.values()
           if getattr(h, "__name__", "") == "_ids_pre_hook"]
    assert len(pre) == 1
