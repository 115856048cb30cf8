"""Every Python example in README.md and docs/ runs, so none can rot.

The rules (also in docs/contributing-docs.md):

* Each page's ```python blocks run in order as one program (a page reads top to bottom:
  a later block may use what an earlier one made), in a subprocess started from /tmp (the
  installed package, never the checkout), with a time limit.
* An HTML comment right before a fence marks it (there is no mark that leaves an example
  out): ``<!-- example: needs=X,Y -->``
  says what the page needs beyond shmkv: a module name (``transformers``, ``redis``,
  ``zmq``, ...), ``redis-server`` (Debian's, on PATH: ``make redis``) or ``vllm``
  (the page runs with the vLLM venv's python, ``.venv-vllm``, which ``make test``
  builds). A page whose needs are missing *fails* with what to install: nothing is skipped.
  ``<!-- example: alone -->`` runs that block as a program of its own.
* A page must leave nothing in /dev/shm: every segment that appeared while it ran and whose
  name is in the page's code is a failure (other processes' segments are not ours).
* Signature summaries that are not programs use ```text fences, not ```python.
"""
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.environ.get("SHMKV_VLLM_PYTHON", os.path.join(ROOT, ".venv-vllm", "bin",
                                                               "python"))
# a fence may be indented (inside a list item): its code is dedented
FENCE = re.compile(r"^(?P<marks>(?:[ \t]*<!--\s*example:[^>]*-->\s*\n)*)(?P<ind>[ \t]*)```python"
                   r"[^\n]*\n(?P<code>.*?)^(?P=ind)```", re.M | re.S)
MARK = re.compile(r"<!--\s*example:\s*([^>]*?)\s*-->")


def pages():
    out = [os.path.join(ROOT, "README.md")]
    for d, _, files in os.walk(os.path.join(ROOT, "docs")):
        out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".md")]
    return sorted(out)


def blocks(path):
    """[(code, marks)] of a page's ```python blocks, marks a set of strings."""
    text = open(path, encoding="utf-8").read()
    out = []
    for m in FENCE.finditer(text):
        marks = set()
        for mk in MARK.findall(m.group("marks")):
            marks.update(x.strip() for x in mk.split(";") if x.strip())
        out.append((textwrap.dedent(m.group("code")), marks))
    # a marker separated from its fence by anything but whitespace marks nothing: refuse
    # it (markers quoted in code, as the docs' own rules page does, are not markers)
    prose = re.sub(r"`[^`\n]*`", "", re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text,
                                              flags=re.M | re.S))
    stray = len(MARK.findall(prose)) - sum(len(MARK.findall(m.group("marks")))
                                           for m in FENCE.finditer(text))
    assert stray == 0, f"{path}: an <!-- example: ... --> comment not right before a fence"
    return out


def programs(path):
    """[(label, source, needs)] to run for a page."""
    session, needs, out = [], set(), []
    for i, (code, marks) in enumerate(blocks(path)):
        bad = {m for m in marks if not (m == "alone" or m.startswith("needs="))}
        assert not bad, f"{path}: unknown example marks {bad}"
        n = {x for m in marks if m.startswith("needs=") for x in m[6:].split(",") if x}
        if "alone" in marks:
            out.append((f"block {i + 1}", code, n))
        else:
            session.append(code)
            needs |= n
    if session:
        out.insert(0, ("page", "\n".join(session), needs))
    return out


CASES = [(os.path.relpath(p, ROOT), label, src, needs)
         for p in pages() for label, src, needs in programs(p)]


def test_the_quick_start_is_in_the_first_120_lines():
    lines = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("```python"))
    end = next(i for i in range(first + 1, len(lines)) if lines[i].startswith("```"))
    assert end < 120, f"the README's first example ends at line {end + 1}"
    assert "shmkv.KVCache.create" in "\n".join(lines[first:end])


def test_every_page_with_examples_is_collected():
    assert any(c[0] == "README.md" for c in CASES)
    assert len({c[0] for c in CASES}) >= 8, sorted({c[0] for c in CASES})


def _shm():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _python(needs, page):
    if "vllm" in needs:
        if not os.path.exists(VLLM_PYTHON):
            pytest.fail(f"{page} needs vLLM: its python {VLLM_PYTHON} is missing "
                        "(make test-vllm-deps builds it)")
        return VLLM_PYTHON
    return sys.executable


@pytest.mark.parametrize("page, label, src, needs", CASES,
                         ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_example_runs(page, label, src, needs, tmp_path):
    python = _python(needs, page)
    for need in sorted(needs - {"vllm"}):
        if need == "redis-server":
            if not shutil.which("redis-server"):
                pytest.fail(f"{page} needs redis-server on PATH (make redis)")
            continue
        r = subprocess.run([python, "-c", f"import {need}"], cwd="/tmp",
                           capture_output=True, text=True)
        if r.returncode:
            pytest.fail(f"{page} needs {need}, which does not import in {python}: "
                        f"{r.stderr.strip().splitlines()[-1:]}")
    script = tmp_path / "example.py"
    script.write_text(src)
    before = _shm()
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore::FutureWarning")
    env.pop("PYTHONPATH", None)
    if "vllm" in needs:
        # the vLLM venv's shmkv is its own release build: under make sanitize the ASan
        # runtime preloaded into every child would instrument nothing of ours there, only
        # slow torch and vLLM down (and report on their code)
        env.pop("LD_PRELOAD", None)
    try:
        r = subprocess.run([python, str(script)], cwd="/tmp", capture_output=True, text=True,
                           timeout=900 if "vllm" in needs else 300, env=env,
                           start_new_session=True)
    finally:
        left = {n for n in _shm() - before if n in src}
        for n in left:                     # reported below; never left behind by the test
            try:
                os.unlink(os.path.join("/dev/shm", n))
            except OSError:
                pass
    assert r.returncode == 0, (f"{page} ({label}) exited {r.returncode}\n--- stdout\n"
                               f"{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")
    assert not left, f"{page} ({label}) left {sorted(left)} in /dev/shm"
