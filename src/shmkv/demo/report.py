"""The demo's checking and its results table.

Checking, not assuming: every request is generated again with transformers' own
``DynamicCache`` and ``attn_implementation="sdpa"`` from the very prompt the worker saw,
by one checker process per core (a 135M model at batch 1 does not use a second thread:
one process checking 36 answers took ~5 minutes of one core). Greedy requests must give
the same token ids, beam requests the same best sequence. Where a token differs, the
reference logits at the first differing step say whether that step was a near-tie (the
two candidates' logits within 1e-4 of the logits' scale: a rounding difference between
two correct attention kernels can flip it); near-ties are counted apart and explained,
any other difference is a mismatch and the demo exits 1.
"""
from __future__ import annotations

import os
import statistics
import textwrap

from .model import SCENARIOS, cut_at_eos
from .workers import gen_kwargs

NEAR_TIE = 1e-4


def header(name, cfg, mcfg, model_dir, n_workers, reqs, convs):
    mib = cfg.num_blocks * cfg.bytes_per_block / 2**20
    print(f"shmkv demo: {n_workers} worker processes on segment /{name}", flush=True)
    print(f"  model    SmolLM2-135M-Instruct (Llama, {mcfg.num_hidden_layers} layers, "
          f"{mcfg.num_attention_heads} query / {mcfg.num_key_value_heads} KV heads, vocab "
          f"{mcfg.vocab_size:,}), float32, loaded in every process from {model_dir}")
    print(f"  cache    {cfg.num_blocks} blocks x {cfg.block_size} tokens, "
          f"{cfg.bytes_per_block // 1024} KiB each ({mib:.0f} MiB), {cfg.dtype}")
    turns = max(len(c.turns) for c in convs)
    print(f"  traffic  {len(reqs)} requests: {len(convs)} chats of up to {turns} turns over "
          f"{len(SCENARIOS)} shared system prompts (" + ", ".join(s["name"] for s in SCENARIOS)
          + "); each turn continues from the previous answer")
    print(f"  watch it live in another terminal:  shmkv top {name}", flush=True)


def answer_reuse(reqs):
    """``(tokens of earlier answers in served prompts, how many of them were prefix hits)``"""
    total = hit = 0
    for r in reqs:
        if "hit" not in r.stats:
            continue
        h = r.stats["hit"]
        for a, b in r.answers:
            total += b - a
            hit += max(0, min(b, h) - a)
    return total, hit


def _first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else None


_MODEL = None      # a checker process's reference model (loaded by _checker_init)


def _checker_init() -> None:
    """A checker process: one thread (there is one checker per core), its own model."""
    global _MODEL
    import torch

    from .model import load_model

    torch.set_num_threads(1)
    _MODEL = load_model("sdpa")[1]


def check_one(model, req, eos):
    """Recompute one request with DynamicCache: ``(verdict, rid, detail)``, verdict
    "equal", "near" (a near-tie at the first differing step) or "bad"."""
    import torch
    from transformers import DynamicCache

    rid, prompt, output, kind, max_new, score = req
    ids = torch.tensor([prompt], dtype=torch.long)
    kind = "beam" if kind == "beam" else "plain"
    kw = gen_kwargs(kind, max_new, ids, eos)
    kw.update(return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        out = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kw)
    ref = cut_at_eos(out.sequences[0, len(prompt):].tolist(), eos)
    j = _first_diff(output, ref)
    if j is None:
        return "equal", rid, None
    if kind == "beam":
        ref_score = float(out.sequences_scores[0])
        gap = abs(ref_score - score)
        tie = gap <= NEAR_TIE * max(1.0, abs(ref_score))
        return ("near" if tie else "bad"), rid, dict(rid=rid, step=j, gap=gap, beam=True,
                                                     ours=output, ref=ref)
    # greedy: at step j both runs had the same prefix; the reference logits there say how
    # close our token was to its choice
    logits = out.scores[j][0] if j < len(out.scores) else None
    if logits is None or j >= len(output):
        return "bad", rid, dict(rid=rid, step=j, gap=float("inf"), beam=False, ours=output,
                                ref=ref)
    gap = float(logits[ref[j]] - logits[output[j]])
    scale = float(logits.abs().max())
    tie = gap <= NEAR_TIE * scale
    return ("near" if tie else "bad"), rid, dict(rid=rid, step=j, gap=gap, scale=scale,
                                                 beam=False, ours=output, ref=ref)


def _check_in_checker(job):
    req, eos = job
    return check_one(_MODEL, req, eos)


def check_outputs(reqs, model, eos, Progress, procs=None):
    """Recompute every request with DynamicCache; -> dict(equal, near_ties, mismatches),
    each in request order.  ``procs`` checker processes (default: one per core this
    process may use; the workers are done by now), each with its own model; with one,
    ``model`` checks them all here."""
    import multiprocessing as mp

    jobs = [((r.rid, list(r.prompt), list(r.output), r.kind, r.max_new, r.score), eos)
            for r in reqs]
    procs = min(procs or len(os.sched_getaffinity(0)), len(jobs)) or 1
    got = {"equal": [], "near": [], "bad": []}
    bar = Progress(len(reqs), "checking")
    try:
        if procs == 1:
            results = (check_one(model, req, e) for req, e in jobs)
            pool = None
        else:
            # the fork server (started with torch and transformers imported) makes them
            pool = mp.get_context("forkserver").Pool(procs, initializer=_checker_init)
            results = pool.imap_unordered(_check_in_checker, jobs)
        try:
            for i, (verdict, rid, detail) in enumerate(results):
                got[verdict].append((rid, detail))
                bar.update(i + 1, f"{len(got['equal'])} equal, {len(got['near'])} near-tie, "
                                  f"{len(got['bad'])} mismatch")
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
    finally:
        bar.close()
    equal = sorted(rid for rid, _ in got["equal"])
    near = [d for _, d in sorted(got["near"], key=lambda x: x[0])]
    bad = [d for _, d in sorted(got["bad"], key=lambda x: x[0])]
    return dict(equal=equal, near=near, bad=bad)


def _median_ms(xs):
    return f"{1000 * statistics.median(xs):.0f} ms" if xs else "-"


def results(args, kv, chat, convs, reqs, workers, victim, served, checked, st,
            problems) -> bool:
    kinds = {"plain": 0, "handoff": 0, "beam": 0}
    for r in reqs:
        if r.output:
            kinds["handoff" if "first" in r.stats else
                  ("beam" if r.kind == "beam" else "plain")] += 1
    reserved = [r for r in reqs if r.reserved]
    n_done = sum(1 for r in reqs if r.output)
    el = served["elapsed"]
    ttft_hit = [r.stats["ttft"] for r in reqs if "ttft" in r.stats and r.stats["hit"] > 0]
    ttft_miss = [r.stats["ttft"] for r in reqs if "ttft" in r.stats and r.stats["hit"] == 0]
    hit = sum(r.stats.get("hit", 0) for r in reqs)
    plen = sum(r.stats.get("prompt_len", 0) for r in reqs)
    n_hit = sum(1 for r in reqs if r.stats.get("hit", 0) > 0)
    roles = collections_count(w.role for w in workers)
    k = served["killed"]
    rows = [
        ("workers", f"{len(workers)} processes: {roles.get('prefill', 0)} prefill, "
                    f"{roles.get('serve', 0)} serve/decode; "
                    + ", ".join(f"w{w.wid} {w.served}" for w in workers) + " tasks; "
                    + _phases(served)),
        ("requests", f"{n_done} of {len(reqs)} served: {kinds['plain']} plain, "
                     f"{kinds['handoff']} handed off prefill -> decode (detach/adopt), "
                     f"{kinds['beam']} beam search (3 beams = forks), "
                     f"{len(reserved)} re-served after the kill"),
        ("hand-off", _handoff_line(reqs)),
        ("tokens", f"{served['tokens']:,} generated in {el:.1f} s: "
                   f"{served['tokens'] / max(el, 1e-9):,.1f} tokens/s "
                   f"({len(workers)} processes on {ncpu()} cores); "
                   + _answers_line(chat, reqs)),
        ("first token", f"median {_median_ms(ttft_hit)} with a prefix hit "
                        f"({len(ttft_hit)} requests), {_median_ms(ttft_miss)} without "
                        f"({len(ttft_miss)}); from the worker taking the request"),
        ("prefix cache", f"{hit:,} of {plen:,} prompt tokens were hits "
                         f"({100 * hit / max(plen, 1):.0f}%), {n_hit} of "
                         f"{sum(1 for r in reqs if 'hit' in r.stats)} requests hit; "
                         f"{st['cached_blocks']} blocks still cached"),
        ("chat turns", _turns_line(chat, convs, reqs)),
        ("blocks", f"peak {served['peak_used']} used of {st['num_blocks']}, "
                   f"peak {served['peak_shared']} shared (refcount > 1); {st['forks']} forks, "
                   f"{st['cow_copies']} copy-on-write copies"),
    ]
    if victim is None:
        rows.append(("killed worker", "none (--no-kill)"))
    elif k is None:
        rows.append(("killed worker", "NOT KILLED: it never held a sequence when due"))
    else:
        again = next((r for r in reqs if r.rid == k["rid"]), None)
        rows.append(("killed worker",
                     f"w{k['wid']} pid {k['pid']} SIGKILLed at {k['at']:.1f} s while "
                     f"{k['task']} for r{k['rid']}, exit {k['exitcode']}, holding "
                     f"{k['held_seqs']} sequences / {k['held_blocks']} blocks"))
        rec = k["recover"]
        rows.append(("recovery", f"reclaimed {k['reclaimed_seqs']} sequences, "
                                 f"{k['reclaimed_blocks']} blocks"
                                 + (" (the rest stay with their other holders)"
                                    if k["reclaimed_blocks"] < k["held_blocks"] else "")
                                 + f" in {rec.get('duration_s', 0) * 1e6:.0f} us; "
                                 f"r{k['rid']} re-served by "
                                 f"w{again.stats.get('served_by', '?') if again else '?'}"))
    end_ok = st["used_blocks"] == 0 and not problems
    rows.append(("end state", f"used_blocks == {st['used_blocks']}, "
                              f"{st['num_sequences']} sequences, check() == "
                              + ("[]" if not problems else f"{len(problems)} problems")))
    if checked is not None:
        n = len(reqs)
        line = (f"{len(checked['equal'])} of {n} outputs equal a single-process "
                f"DynamicCache run (sdpa) of the same request")
        if checked["near"]:
            line += f"; {len(checked['near'])} differ at a near-tie (see below)"
        if checked["bad"]:
            line += f"; {len(checked['bad'])} MISMATCH"
        rows.append(("outputs", line))
    else:
        rows.append(("outputs", "not checked (--no-check)"))
    w = max(len(a) for a, _ in rows)
    print("\nshmkv demo results")
    for a, b in rows:
        print(f"  {a:<{w}}  {b}")
    for p in problems[:20]:
        print(f"  ! {p}")
    if checked:
        for d in checked["near"]:
            print(f"  near-tie r{d['rid']}: first differs at token {d['step']}, "
                  f"where the reference's two candidates are {d['gap']:.2e} apart "
                  f"(logit scale {d.get('scale', 1):.1f}): two fp32 attention kernels "
                  "(shmkv's C kernel and torch sdpa) round differently, and greedy "
                  "decoding follows either")
        for d in checked["bad"]:
            print(f"  MISMATCH r{d['rid']} at token {d['step']} (gap {d['gap']:.3g}):\n"
                  f"    ours {d['ours']}\n    ref  {d['ref']}")
    _samples(chat, convs, 2 if args.quick else 3)
    ok = (end_ok and not served["errors"] and "NOT" not in _handoff_line(reqs)
          and (victim is None or k is not None) and (checked is None or not checked["bad"]))
    print(f"\n{'OK' if ok else 'FAILED'}", flush=True)
    return ok


def _handoff_line(reqs):
    h = [r for r in reqs if "adopted" in r.stats]
    if not h:
        return "none"
    short = [r.rid for r in h if r.stats["adopted"] != len(r.prompt)]
    line = (f"{len(h)} sequences prefilled by the prefill worker, detached, adopted by a "
            f"decode worker: ")
    if short:
        return line + f"{len(short)} did NOT hold their whole prompt (r{short[0]}, ...)"
    return line + (f"each held its whole prompt ({sum(len(r.prompt) for r in h):,} "
                   f"tokens, none recomputed)")


def _phases(served):
    ph = served.get("phases", {})
    t0, ready = ph.get("start"), served.get("t_ready")
    parts = []
    if t0 and ready:
        parts.append(f"ready in {ready - t0:.1f} s")
    if "served" in ph and "checked" in ph:
        parts.append(f"check {ph['checked'] - ph['served']:.1f} s")
    return ", ".join(parts)


def _answers_line(chat, reqs):
    out = [r.output for r in reqs if r.output]
    if not out:
        return "no answers"
    at_eos = sum(1 for o in out if o[-1] == chat.eos)
    return (f"{at_eos} of {len(out)} answers ended at <|im_end|>, the others at max_new; "
            f"{statistics.mean(len(o) for o in out):.0f} tokens on average")


def _turns_line(chat, convs, reqs):
    """How the turns >= 2 reused the answers before them, and whether their concatenated
    ids equal a re-templated history (the reason for concatenating: see model.py)."""
    later = [r for r in reqs if r.turn > 0 and "hit" in r.stats]
    if not later:
        return "no turn >= 2 served"
    total, hit = answer_reuse(later)
    ptok = sum(len(r.prompt) for r in later)
    phit = sum(r.stats["hit"] for r in later)
    line = (f"{len(later)} turns >= 2: {phit:,} of {ptok:,} prompt tokens were hits; "
            f"{total:,} of their prompt tokens are earlier answers, {hit:,} of those hits "
            f"({100 * hit / max(total, 1):.0f}%)")
    same = 0
    for r in later:
        # the history up to r: system, then user/assistant pairs, then r's message
        msgs = convs[r.conv].messages[:2 * r.turn + 2]
        same += chat.retemplated(msgs) == r.prompt
    return line + (f"; re-templating the decoded history gives the same ids in {same} of "
                   f"{len(later)}")


def _samples(chat, convs, n):
    """A few whole conversations, one per scenario while they last, wrapped."""
    picked, seen = [], set()
    for c in convs:
        if c.scenario not in seen and all(r.output for r in c.turns):
            picked.append(c)
            seen.add(c.scenario)
    shared = {}
    for c in convs:
        shared[c.scenario] = shared.get(c.scenario, 0) + 1
    print("\nsample conversations")
    for c in picked[:n]:
        n_sys = len(chat.encode(chat.render([{"role": "system", "content": c.system}])))
        print(f"  chat {c.cid} ({SCENARIOS[c.scenario]['name']}: its {n_sys}-token system "
              f"prompt is shared by {_n(shared[c.scenario], 'chat')})")
        for r in c.turns:
            _wrapped("user", r.user)
            how = ("<|im_end|>" if r.output and r.output[-1] == chat.eos else "max_new")
            _wrapped("assistant", chat.text(r.output))
            print(f"{'':15}[r{r.rid} {r.kind}: {len(r.prompt)}-token prompt, "
                  f"{r.stats.get('hit', 0)} hit; {len(r.output)} tokens, ended at {how}]")


def _n(n, what):
    return f"{n} {what}" + ("" if n == 1 else "s")


def _wrapped(who, text, width=92):
    print(textwrap.fill(text or "(empty)", width=width, initial_indent=f"    {who + ':':<11}",
                        subsequent_indent=" " * 15))


def collections_count(it):
    d = {}
    for x in it:
        d[x] = d.get(x, 0) + 1
    return d


def ncpu():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()
