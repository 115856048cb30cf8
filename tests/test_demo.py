"""`shmkv demo`: real chats (SmolLM2) served by several processes on one segment, checked
end to end.

The demo is run as a user runs it (``python -m shmkv demo --quick`` in a subprocess, from
a directory outside the checkout) and judged by what it prints and leaves behind.
"""
import os
import re
import subprocess
import sys

import pytest
from support.procout import stderr_lines

pytest.importorskip("torch")
pytest.importorskip("transformers")


def run_demo(tmp_path, *args, pre="", timeout=240):
    env = {k: v for k, v in os.environ.items()
           if k not in ("SHMKV_PLANT", "SHMKV_CRASH_POINT")}
    code = (f"import sys\n{pre}\nfrom shmkv.cli import main\n"
            f"sys.exit(main(['demo', *{list(args)!r}]))")
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=timeout, env=env, check=False)


@pytest.mark.slow
def test_demo_quick_real_inference(tmp_path):
    # run as `shmkv demo --quick`; while it runs, `shmkv top NAME` shows its segment
    env = {k: v for k, v in os.environ.items()
           if k not in ("SHMKV_PLANT", "SHMKV_CRASH_POINT")}
    p = subprocess.Popen([sys.executable, "-m", "shmkv", "demo", "--quick"], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        head = []
        for line in p.stdout:
            head.append(line)
            if "shmkv top " in line:
                break
        name = head[-1].split("shmkv top ")[-1].strip()
        top = subprocess.run([sys.executable, "-m", "shmkv", "top", name, "--iterations",
                              "1", "--plain"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60, env=env, check=False)
        rest, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert top.returncode == 0 and f"shmkv top {name}" in top.stdout, (top.stdout, top.stderr)
    assert "processes" in top.stdout and str(p.pid) in top.stdout, top.stdout
    r = subprocess.CompletedProcess(p.args, p.returncode, "".join(head) + rest, err)
    out = r.stdout
    assert r.returncode == 0, (out, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert "\x1b[" not in out, "colour codes on a pipe"

    # every output was recomputed with DynamicCache and is equal
    m = re.search(r"(\d+) of (\d+) outputs equal a single-process DynamicCache run", out)
    assert m, out
    n_equal, n = int(m.group(1)), int(m.group(2))
    assert n > 0 and n_equal == n, out
    assert "MISMATCH" not in out

    # the requests were of every kind, with prefix hits
    m = re.search(r"(\d+) of (\d+) served: (\d+) plain, (\d+) handed off prefill -> decode"
                  r".*?, (\d+) beam search .*?, (\d+) re-served after the kill", out)
    assert m, out
    served, total, plain, handoff, beam, again = map(int, m.groups())
    assert served == total == n and plain > 0 and handoff > 0 and beam > 0 and again >= 1
    m = re.search(r"([\d,]+) of ([\d,]+) prompt tokens were hits", out)
    assert m and int(m.group(1).replace(",", "")) > 0, out

    # turn 2 continues from turn 1's answer, token-exactly, and hits the answer's blocks
    m = re.search(r"(\d+) turns >= 2: [\d,]+ of [\d,]+ prompt tokens were hits; ([\d,]+) of "
                  r"their prompt tokens are earlier answers, ([\d,]+) of those hits", out)
    assert m, out
    n_later, in_prompts, ans_hit = (int(g.replace(",", "")) for g in m.groups())
    assert n_later >= 1 and in_prompts > 0 and 0 < ans_hit <= in_prompts, out

    # readable answers: the sample chats print the scripted user messages and real text
    assert "sample conversations" in out
    answers = re.findall(r"^    assistant: (.+)$", out, re.M)
    assert answers and any(len(re.findall(r"[A-Za-z]{3,}", a)) >= 3 for a in answers), out
    assert "Are you open on Monday morning?" in out, out

    # one worker was SIGKILLed while it held blocks, and recovery reclaimed them
    m = re.search(r"SIGKILLed worker \d+ \(pid \d+\) while .*? holding (\d+) sequences / "
                  r"(\d+) blocks", out)
    assert m and int(m.group(1)) >= 1 and int(m.group(2)) >= 1, out
    m = re.search(r"recovery +reclaimed (\d+) sequences, (\d+) blocks", out)
    assert m and int(m.group(1)) >= 1 and int(m.group(2)) >= 1, out
    assert re.search(r"exit -9", out), out

    # the end state, and nothing left in /dev/shm
    assert "used_blocks == 0, 0 sequences, check() == []" in out
    m = re.search(r"on segment /(\S+)", out)
    assert m, out
    assert not os.path.exists(f"/dev/shm/{m.group(1)}")
    assert out.rstrip().endswith("OK")


def test_demo_without_torch_says_how_to_get_it(tmp_path):
    for mod in ("torch", "transformers"):
        r = run_demo(tmp_path, "--quick", pre=f"sys.modules[{mod!r}] = None", timeout=60)
        assert r.returncode == 2, (r.stdout, r.stderr)
        lines = stderr_lines(r.stderr)
        assert len(lines) == 1 and 'pip install "shmkv[demo]"' in lines[0], r.stderr
        assert r.stdout == ""


def test_import_shmkv_never_imports_torch(tmp_path):
    code = ("import sys, shmkv, shmkv.demo, shmkv.cli\n"
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_synthetic_demo_still_runs(tmp_path):
    r = run_demo(tmp_path, "--synthetic", "--preset", "tiny", "--workers", "1",
                 "--duration", "1.5", timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "check()        [] (consistent)" in r.stdout
    m = re.search(r"segment /(\S+):", r.stdout)
    assert m and not os.path.exists(f"/dev/shm/{m.group(1)}")


def test_checker_tells_equal_near_tie_and_mismatch(monkeypatch):
    """The checker is not a rubber stamp: a changed token is a mismatch, and the same
    change counts as a near-tie only when the reference logits are that close."""
    import torch

    from shmkv.demo import report
    from shmkv.demo.model import SCENARIOS, Chat, Request, load_model
    from shmkv.demo.workers import gen_kwargs

    class NoBar:
        def __init__(self, *a):
            pass

        def update(self, *a, **k):
            pass

        def close(self):
            pass

    torch.set_num_threads(1)
    tok, model = load_model("sdpa")
    chat = Chat(tok)
    sc = SCENARIOS[0]
    prompt = chat.first_prompt(sc["system"], sc["scripts"][0][0])
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, **gen_kwargs("plain", 8, ids, chat.eos))
    ref = out[0, len(prompt):].tolist()
    assert len(ref) == 8 and chat.eos not in ref[:4], chat.text(ref)
    good = Request(rid=0, conv=0, turn=0, kind="plain", max_new=8, user="", prompt=prompt,
                   output=list(ref))
    bad_out = list(ref)
    bad_out[3] = (bad_out[3] + 1) % model.config.vocab_size
    bad = Request(rid=1, conv=0, turn=0, kind="handoff", max_new=8, user="", prompt=prompt,
                  output=bad_out)
    # two checker processes (the demo's way: one per core), then this process alone:
    # the same verdicts
    for procs in (2, 1):
        res = report.check_outputs([good, bad], model, chat.eos, NoBar, procs=procs)
        assert res["equal"] == [0] and not res["near"], procs
        assert [d["rid"] for d in res["bad"]] == [1] and res["bad"][0]["step"] == 3, procs
        assert res["bad"][0]["gap"] > 0
    monkeypatch.setattr(report, "NEAR_TIE", 1e9)        # everything is "close"
    res = report.check_outputs([bad], model, chat.eos, NoBar, procs=1)
    assert [d["rid"] for d in res["near"]] == [1] and not res["bad"]


def test_next_turn_extends_the_last_token_exactly():
    """Turn t + 1's ids are turn t's prompt + the generated ids + the template's close and
    the new user turn: a prefix of them is exactly the earlier request (what a prefix hit
    on the answer needs), and they equal the chat template's rendering of the same history
    whenever the answer re-tokenizes to the same ids."""
    from transformers import AutoTokenizer

    from shmkv.demo.model import SCENARIOS, Chat, make_traffic
    from shmkv.models import smollm2_dir

    chat = Chat(AutoTokenizer.from_pretrained(smollm2_dir(), local_files_only=True))
    assert chat.close == [chat.eos] + chat.encode("\n")
    convs = make_traffic(3, 3, max_new=16, beam_every=5, handoff_every=3)
    c = convs[1]
    assert c.system == SCENARIOS[1]["system"] and [r.turn for r in c.turns] == [0, 1, 2]
    r0 = c.start(chat)
    assert r0.prompt == chat.first_prompt(c.system, r0.user)
    answer = chat.encode("Open the self-service portal and reset it.") + [chat.eos]
    r0.output = answer
    r1 = c.advance(chat, r0)
    assert r1 is c.turns[1]
    assert r1.prompt[:len(r0.prompt) + len(answer)] == r0.prompt + answer
    assert r1.answers == [(len(r0.prompt), len(r0.prompt) + len(answer))]
    assert chat.text(r1.prompt[slice(*r1.answers[0])]) == (
        "Open the self-service portal and reset it.")
    assert r1.prompt == chat.retemplated(c.messages)
    # the report counts the answer tokens among a prompt's hits
    from shmkv.demo.report import answer_reuse

    r1.stats = {"hit": len(r0.prompt) + 5}
    assert answer_reuse([r0, r1]) == (len(answer), 5)     # r0 unserved: not counted
    # an answer cut at max_new (no eos) gets its <|im_end|> from the template
    cut = chat.encode("Try again in")
    r1.output = cut
    r2 = c.advance(chat, r1)
    n = len(r1.prompt)
    assert r2.prompt[:n + len(cut) + 2] == r1.prompt + cut + chat.close
    assert r2.answers[-1] == (n, n + len(cut))
    assert r2.prompt == chat.retemplated(c.messages)
    assert c.advance(chat, r2) is None
