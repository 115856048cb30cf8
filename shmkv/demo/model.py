"""The demo's model and its traffic: a small Llama built from a config with seeded weights.

No weights are downloaded or shipped: every process (each worker and the checker) builds
the same model from ``LlamaConfig`` and ``torch.manual_seed(SEED)``, so they all hold
bit-identical weights.  The weights are random, so the model "speaks" nothing: its token
ids are shown as pseudo-words (two syllables per id, one word per id) only so that the
printed samples are easier to tell apart than lists of numbers.

The traffic is a list of chat conversations.  Each starts with one of a few system
prompts shared by many conversations; turn ``t``'s prompt is the system prompt, every
earlier user message and model answer, and the new user message, so a later turn's
prompt extends an earlier one and is a prefix-cache hit for whichever worker serves it.
A turn becomes ready when the previous turn of its conversation has been answered.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

SEED = 1234
VOCAB = 2048

_SYLLABLES = [c + v for c in "bdfgklmnprstvzhj" for v in ("a", "e", "i", "o", "u", "ai",
                                                             "ou", "ei")]     # 128


def llama_config():
    """The model's config: 4 layers, hidden 256, 8 query / 2 KV heads (GQA), head_dim 32.

    ``initializer_range`` is raised from 0.02 to 0.2 so that greedy decoding of random
    weights wanders over the vocabulary instead of repeating one token."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=768,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       max_position_embeddings=2048, initializer_range=0.2,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                       pad_token_id=0, dtype="float32")


def build_model(attn: str = "sdpa"):
    """The demo model, float32, eval mode, with its weights drawn from ``SEED``."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(llama_config()).to(torch.float32).eval()
    model.set_attn_implementation(attn)
    return model


def word(tok: int) -> str:
    """Token id -> a pseudo-word, one per id (2048 ids = 16 x 128 syllable pairs)."""
    a, b = divmod(int(tok) % VOCAB, 128)
    return _SYLLABLES[a * 8] + _SYLLABLES[b]


def words(toks, limit: int = 12) -> str:
    toks = list(toks)
    text = " ".join(word(t) for t in toks[:limit])
    return text + (" ..." if len(toks) > limit else "")


@dataclass
class Request:
    """One turn of one conversation, as served (and re-checked)."""
    rid: int
    conv: int
    turn: int
    kind: str                  # "plain" | "handoff" | "beam"
    max_new: int
    user: list                 # this turn's user message (token ids)
    prompt: list = field(default_factory=list)   # filled when the turn becomes ready
    output: list = field(default_factory=list)   # generated ids (beam: the best beam)
    score: float = 0.0         # beam: the best beam's sequence score
    reserved: bool = False     # re-served after its worker was killed
    stats: dict = field(default_factory=dict)    # timings and prefix hit of the serving


@dataclass
class Conversation:
    cid: int
    system: list
    turns: list                # [Request]
    history: list = field(default_factory=list)  # ids of every earlier user msg + answer

    def prompt_for(self, turn: int) -> list:
        return self.system + self.history + self.turns[turn].user


def make_traffic(n_conversations: int, turns: int, n_system: int, max_new: int,
                 beam_every: int, handoff_every: int, seed: int = 7):
    """Conversations sharing ``n_system`` system prompts; every ``beam_every``-th request
    is served with beam search, every ``handoff_every``-th one prefilled by the prefill
    worker and decoded by another."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(56, 100))]
               for _ in range(n_system)]
    convs, rid = [], 0
    for c in range(n_conversations):
        reqs = []
        for t in range(rng.randrange(max(1, turns - 1), turns + 1)):
            if beam_every and rid % beam_every == beam_every - 1:
                kind = "beam"
            elif handoff_every and rid % handoff_every == 1:
                kind = "handoff"
            else:
                kind = "plain"
            user = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 28))]
            reqs.append(Request(rid=rid, conv=c, turn=t, kind=kind, user=user,
                                max_new=rng.randrange(max(4, max_new // 2), max_new + 1)))
            rid += 1
        convs.append(Conversation(cid=c, system=systems[c % n_system], turns=reqs))
    return systems, convs
