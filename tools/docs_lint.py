"""The shipped text says the technical thing on its own: no reference to the project's
private history that a reader outside it cannot follow.

A user reads the README, the docs and the sources; none of them may send that reader to
an issue tracker they cannot see ("see issue 12", "as the issue asks", "Target (issue)"),
to files that are not shipped (the private API.md, STYLE.md or STRUCTURE.md, anything
under ../shared/) or to how the work was organised ("this session", "the lead", "the
closing note of ...", "this branch").  Each of those says nothing to a stranger: the text
must say the technical thing itself (the API contract is docs/reference/index.md).  This
script reads every line of the shipped text and reports each match as ``file:line: text``.
The patterns are a short, precise list, so that the legitimate words stay free: an HTTP or
chat "session", "known issues", docs/reference/api.md.

A path of the repository a line cites (``tests/...``, ``tools/...``, ``docs/...``,
``src/shmkv/...``: a file with its suffix, no wildcard) must exist: a citation of a file
that was renamed or never committed sends the reader nowhere.

The files: README.md, CHANGELOG.md, DESIGN.md, DEVELOP.md, docs/**/*.md, benchmarks/*.md,
and everything under src/shmkv/ (except the generated Cython output src/shmkv/_*.c), tools/,
benchmarks/, tests/ and fuzz/, plus Makefile, .ci/run, pyproject.toml, setup.py and
mkdocs.yml: the files git knows, tracked or new and not ignored (``git ls-files``).
The check is plain regular expressions over lines, code included: the patterns are
precise enough that code does not match them.

    python tools/docs_lint.py              # exit 0: nothing found; 1: the lines, listed
    python tools/docs_lint.py FILE...      # check these files instead

Run by `make lint` and by tests/test_docs_lint.py.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELF = "tools/docs_lint.py"          # it spells the patterns out

# (pattern, what it is); each matched on its own against every line.
PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # an issue tracker the reader cannot see: "issue 21", "Issue #35", "issues 14 and 21"
    (re.compile(r"\bissues?[ -]#?\d+", re.I), "issue number"),
    # private files, not shipped (case-sensitive: docs/reference/api.md is a real page)
    (re.compile(r"\b(?:API|STYLE|STRUCTURE)\.md\b"), "private file"),
    (re.compile(r"\.\./shared\b"), "private path"),
    # how the project was made, not what it does
    (re.compile(r"\b(?:this|previous|earlier|last) session(?:'s)?(?! of)\b", re.I),
     "project history"),
    (re.compile(r"\bno session had\b|\bend of the session\b", re.I), "project history"),
    (re.compile(r"\bthe lead\b(?!-)", re.I), "project history"),
    (re.compile(r"\bfiled by\b|\bclosing note\b|\bhouse style\b|\bthe house\b", re.I),
     "project history"),
    (re.compile(r"\bthis branch\b|\bnot on main\b|\bbefore the deadline\b", re.I),
     "project history"),
    # the tracker's issue as the reason ("as the issue asks", "Target (issue)"); "a known
    # issue" and "this issue is fixed upstream" stay legitimate
    (re.compile(r"\bthe (?:core )?issue(?:'s| asks| asked| reports)\b|\(issue\)"
                r"|\b(?:until|before|since|of) this issue\b", re.I), "issue reference"),
]

# a file of the repository, cited: checked to exist (generated outputs and wildcards aside)
_CITED = re.compile(r"(?<![\w/.-])((?:tests|tools|benchmarks|docs|fuzz|src/shmkv)/[\w./-]*\w"
                    r"\.(?:py|md|pyx|pxd|pyi|h|c|inc|sh|txt|json))\b")
_CITES_PLANTED = {"tests/test_docs_lint.py"}     # plants citations of files that do not exist

_TOP = {"README.md", "CHANGELOG.md", "DESIGN.md", "DEVELOP.md", "Makefile", ".ci/run",
        "pyproject.toml", "setup.py", "mkdocs.yml"}
_TREES = ("src/shmkv/", "tools/", "benchmarks/", "tests/", "fuzz/")
_BINARY = (".png", ".jpg", ".gif", ".so", ".o", ".pyc", ".gz", ".whl")


def shipped(paths: Iterable[str]) -> Iterator[str]:
    """The shipped-text files among ``paths`` (relative to the repository root)."""
    for p in paths:
        if p == SELF or p.endswith(_BINARY):
            continue
        if p.startswith("src/shmkv/") and re.fullmatch(r"src/shmkv/_\w+\.c", p):
            continue                 # Cython's output, generated
        if (p in _TOP or p.startswith(_TREES)
                or (p.startswith("docs/") and p.endswith(".md"))):
            yield p


def git_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return sorted(set(out.split("\n")) - {""})


def check(path: str, shown: str) -> list[str]:
    """``shown:line: text`` for every line of ``path`` that matches a pattern."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
        return []                    # binary, or deleted from the work tree
    found = []
    cites = shown not in _CITES_PLANTED
    for n, line in enumerate(lines, 1):
        for pat, what in PATTERNS:
            if pat.search(line):
                found.append(f"{shown}:{n}: {line.strip()}  [{what}]")
                break
        else:
            if cites:
                for m in _CITED.finditer(line):
                    ref = m.group(1)
                    if (not ref.startswith("benchmarks/out/")
                            and not os.path.exists(os.path.join(ROOT, ref))):
                        found.append(f"{shown}:{n}: {line.strip()}  [{ref}: no such file in "
                                     "the repository]")
                        break
    return found


def main(argv: list[str]) -> int:
    if argv:
        files = [(p, p) for p in argv]
    else:
        files = [(os.path.join(ROOT, p), p) for p in shipped(git_files())]
    found = [hit for path, shown in files for hit in check(path, shown)]
    for hit in found:
        print(hit)
    if found:
        print(f"{len(found)} internal reference(s): say the technical thing on its own "
              "(tools/docs_lint.py)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
