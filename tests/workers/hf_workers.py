"""Workers and helpers for tests/test_transformers.py (importable: tests/ is on sys.path, and
`spawn` children inherit it).  The model is built from a config with seeded weights, the
same in every process: nothing is downloaded."""
import traceback

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 512


def model_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                initializer_range=0.5, rms_norm_eps=1e-6)
    base.update(kw)
    return LlamaConfig(**base)


def make_model(seed=0, dtype=torch.float32, attn="sdpa", **kw):
    """A tiny GQA Llama (2 layers, 4 q / 2 kv heads, head_dim 16) with seeded weights, large
    enough (initializer_range 0.5) that greedy tokens vary from step to step."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(model_config(**kw), dtype=dtype,
                                          attn_implementation=attn)
    return model.eval()


def prefill_prompt(name, prompt, q, salt=None):
    """In another process: attach, compute `prompt` ([batch, len] ids) through a ShmkvCache
    that publishes it, close.  Reports (hit before, length after, used blocks after close)."""
    try:
        import shmkv
        from shmkv.integrations.transformers import ShmkvCache

        kv = shmkv.KVCache.attach(name)
        model = make_model(attn="shmkv")
        ids = torch.as_tensor(prompt)
        with ShmkvCache(kv, prompt_ids=ids, salt=salt) as past:
            hit = past.get_seq_length()
            with torch.no_grad():
                model(ids[:, hit:], past_key_values=past, use_cache=True)
            after = past.get_seq_length()
        q.put(("ok", hit, after, kv.check()))
        kv.close()
    except BaseException:
        q.put(("error", traceback.format_exc()))
        raise
