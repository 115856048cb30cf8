"""The demo's worker processes: each attaches the one segment and runs SmolLM2 on it.

A worker talks to the parent over its own pipe (one writer per pipe end, so a worker
SIGKILLed halfway through a send breaks only its own pipe, never a lock another process
needs).  Messages parent -> worker: ``(task, request fields...)`` or ``None`` (stop).
Worker -> parent: ``("ready", pid)``, ``("begin", rid)``, ``("done", rid, result)``,
``("handoff", rid, sid, result)``, ``("error", rid, text)``.

Every ``ShmkvCache`` is bound to the model (``model=``), so it learns the ids of the tokens
it generates and publishes the blocks they fill: a chat's next turn, served by any worker,
hits the previous answer as well as the prompt before it.

Tasks:
  ``serve``    prefill and decode one request in this process (greedy or beam search);
  ``prefill``  prefill, compute the first token, then release the sequence from its
               ``ShmkvCache``, ``kv.detach(sid)`` it and hand the sid to the parent;
  ``decode``   ``kv.adopt(sid)`` a handed-off sequence and continue generating from it.
"""
from __future__ import annotations

import os
import signal
import time
import traceback

from .model import cut_at_eos


def gen_kwargs(req_kind: str, max_new: int, ids, eos: int) -> dict:
    """The generation settings of a request kind (the checker uses the same): greedy or
    beam search, stopping at the eos (``<|im_end|>``) or after ``max_new`` tokens.  The
    attention mask is explicit: SmolLM2's pad id is its eos, which every earlier turn's
    answer in a prompt ends with, and without a mask generate() would treat those as
    padding."""
    import torch

    kw = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos,
              attention_mask=torch.ones_like(ids))
    if req_kind == "beam":
        kw.update(num_beams=3, return_dict_in_generate=True, output_scores=True)
    return kw


def _timer():
    """A logits processor that only records when each step's logits were ready: the first
    call is the end of the prefill, i.e. the first token's time."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepTimer(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    t = StepTimer()
    return t, LogitsProcessorList([t])


def worker_main(name: str, wid: int, conn, threads: int = 1) -> None:
    """Entry point of one worker process (spawned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the parent decides when we stop
    import torch

    import shmkv
    from shmkv.integrations.transformers import ShmkvCache

    from .model import load_model

    torch.set_num_threads(threads)
    shmkv.set_num_threads(threads)
    tok, model = load_model(attn="shmkv")      # the cached directory: the parent made it
    eos = int(tok.eos_token_id)
    kv = shmkv.KVCache.attach(name)
    # one short generation before saying ready, so that no request's time to first token
    # pays this process's first-call costs; no prompt_ids: its prompt is not published
    warm = torch.arange(3, 35).unsqueeze(0)
    with ShmkvCache(kv) as past, torch.no_grad():
        model.generate(warm, past_key_values=past, **gen_kwargs("plain", 2, warm, eos))
    conn.send(("ready", os.getpid()))
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            task, rid = msg[0], msg[1]
            try:
                conn.send(("begin", rid))
                if task == "serve":
                    conn.send(("done", rid, _serve(model, eos, kv, ShmkvCache, *msg[2:])))
                elif task == "prefill":
                    sid, res = _prefill(model, eos, kv, ShmkvCache, *msg[2:])
                    conn.send(("handoff", rid, sid, res))
                elif task == "decode":
                    conn.send(("done", rid, _decode(model, eos, kv, ShmkvCache, *msg[2:])))
                else:
                    raise ValueError(f"unknown task {task!r}")
            except Exception:
                conn.send(("error", rid, traceback.format_exc()))
    finally:
        kv.close()


def _serve(model, eos, kv, ShmkvCache, kind: str, prompt: list, max_new: int) -> dict:
    import torch

    t0 = time.perf_counter()
    ids = torch.tensor([prompt], dtype=torch.long)
    timer, procs = _timer()
    with ShmkvCache(kv, prompt_ids=ids, model=model) as past:
        hit = int(past.get_seq_length())
        with torch.no_grad():
            out = model.generate(ids, past_key_values=past, logits_processor=procs,
                                 **gen_kwargs(kind, max_new, ids, eos))
        peak_seqs = len(past.sequence_ids)
    t1 = time.perf_counter()
    res = dict(hit=hit, prompt_len=len(prompt), ttft=timer.times[0] - t0, t_total=t1 - t0,
               seqs=peak_seqs, pid=os.getpid())
    if kind == "beam":
        res["output"] = cut_at_eos(out.sequences[0, len(prompt):].tolist(), eos)
        res["score"] = float(out.sequences_scores[0])
    else:
        res["output"] = cut_at_eos(out[0, len(prompt):].tolist(), eos)
    return res


def _prefill(model, eos, kv, ShmkvCache, prompt: list, max_new: int):
    import torch

    t0 = time.perf_counter()
    ids = torch.tensor([prompt], dtype=torch.long)
    past = ShmkvCache(kv, prompt_ids=ids, model=model)
    try:
        hit = int(past.get_seq_length())
        with torch.no_grad():
            out = model.generate(ids, past_key_values=past, **gen_kwargs("plain", 1, ids, eos))
        first = int(out[0, -1])
        ttft = time.perf_counter() - t0
        (sid,) = past.release()        # ours, but no longer the cache's to free
    finally:
        past.close()                   # frees nothing after release(); all of it on error
    kv.detach(sid)                     # owned by nobody: survives us until adopted
    return sid, dict(hit=hit, prompt_len=len(prompt), first=first, ttft=ttft,
                     cached=kv.seq_len(sid), pid=os.getpid())


def _decode(model, eos, kv, ShmkvCache, sid: int, prompt: list, first: int, max_new: int) -> dict:
    import torch

    t0 = time.perf_counter()
    kv.adopt(sid)                      # ours now: freed by recovery if we die
    ids = torch.tensor([prompt + [first]], dtype=torch.long)
    with ShmkvCache(kv, sequence_ids=[sid], model=model) as past:
        adopted = int(past.get_seq_length())
        rest = []
        if first != eos and max_new > 1:   # else the answer is complete already
            with torch.no_grad():
                out = model.generate(ids, past_key_values=past,
                                     **gen_kwargs("plain", max_new - 1, ids, eos))
            rest = out[0, len(prompt) + 1:].tolist()
    res = dict(output=cut_at_eos([first] + rest, eos), adopted=adopted,
               t_total=time.perf_counter() - t0, pid=os.getpid())
    return res
