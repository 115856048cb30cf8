"""The C kernels' layering, checked: no file calls, declares or includes what a file above
it defines.

The order lives in one place, src/shmkv/kernels/layers.txt (bottom first).  This script reads
every file of src/shmkv/kernels/, finds the functions and function-like macros each defines
(text only: comments and strings stripped, brace depth followed), and reports every name
a file uses that only a file *above* it defines, and every `#include "x"` of a file above.
A file missing from layers.txt (or listed but missing) is an error too, so a new header
has to be given its place.

    python tools/kernel_layers.py            # exit 0: no upward use; 1: the uses, listed
    python tools/kernel_layers.py --graph    # also print who uses whom

Run by `make lint` and by tests/test_kernel_layers.py.  The check is textual: a call
made through a macro's expansion is seen where the macro's name is written, and a
function pointer counts as a use wherever its name appears.
"""
from __future__ import annotations

import argparse
import fnmatch
import os
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "src", "shmkv", "kernels")
LAYERS = os.path.join(KERNELS, "layers.txt")
SOURCES = (".h", ".c", ".inc")

_KEYWORDS = frozenset(
    "if for while switch return sizeof do else case goto break continue defined "
    "__attribute__ __builtin_expect __typeof__ typeof _Static_assert static_assert "
    "_Alignof alignof _Alignas __asm__ asm __extension__ __declspec".split())
_IDENT = re.compile(r"[A-Za-z_]\w*")
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
_MACRO = re.compile(r"^\s*#\s*define\s+([A-Za-z_]\w*)\(", re.M)


def read_layers(path: str = LAYERS) -> list[list[str]]:
    """The layers of layers.txt, bottom first: each a list of file names or fnmatch
    patterns (the files of one line are one room; blank lines and # comments skipped)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if words:
                out.append(words)
    return out


def rank_of(name: str, layers: list[list[str]]) -> int | None:
    """The layer (0 = bottom) of a file: the first line that names it or a pattern of it."""
    for i, words in enumerate(layers):
        if name in words:
            return i
    for i, words in enumerate(layers):
        if any(fnmatch.fnmatchcase(name, w) for w in words):
            return i
    return None


def strip_c(text: str) -> str:
    """Comments and string/char literals blanked (newlines kept, so line numbers hold)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * (j - i - 2) + c if j - i >= 2 else text[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _code_only(text: str) -> str:
    """strip_c, then preprocessor lines (with their continuations) blanked -- except the
    bodies of function-like macros, which are code that calls."""
    lines = strip_c(text).split("\n")
    out = []
    in_pp = keep = False
    for line in lines:
        start = not in_pp and line.lstrip().startswith("#")
        if start:
            keep = bool(_MACRO.match(line))
            if keep:          # drop "#define NAME(args)" itself, keep the body
                m = _MACRO.match(line)
                assert m is not None
                j = _group_end(line, m.end() - 1)
                line = " " * j + line[j:]
        if start or in_pp:
            in_pp = line.rstrip().endswith("\\")
            out.append(line.rstrip("\\") if keep else "")
        else:
            out.append(line)
    return "\n".join(out)


def _group_end(code: str, i: int) -> int:
    """One past the ")" that closes the "(" at code[i]."""
    depth = 0
    while i < len(code):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        i += 1
        if depth == 0:
            break
    return i


def definitions(text: str) -> dict[str, int]:
    """Functions (bodies at file scope) and function-like macros a C text defines: name
    -> line.  A prototype (no body) is a use, not a definition."""
    defs: dict[str, int] = {}
    for m in _MACRO.finditer(strip_c(text)):
        defs.setdefault(m.group(1), text.count("\n", 0, m.start()) + 1)
    code = _code_only(text)
    depth = 0
    last_name: tuple[str, int] | None = None   # the identifier before the last "(" at depth 0
    i, n = 0, len(code)
    while i < n:
        c = code[i]
        if c == "{":
            if depth == 0 and last_name is not None:
                # "name(...) {" -- possibly with attributes between ")" and "{"
                defs.setdefault(last_name[0], code.count("\n", 0, last_name[1]) + 1)
            depth += 1
            last_name = None
        elif c == "}":
            depth = max(depth - 1, 0)
        elif c in ";=":
            if depth == 0:
                last_name = None
        elif depth == 0 and (c.isalpha() or c == "_"):
            ident = _IDENT.match(code, i)
            assert ident is not None
            word = ident.group()
            j = ident.end()
            while j < n and code[j] in " \t\n":
                j += 1
            if j < n and code[j] == "(" and word not in _KEYWORDS:
                # a definition's name is the identifier before its parameter list; skip
                # the balanced list so a parameter's name is not taken for it
                k = _group_end(code, j)
                # "FN(name)(args)": a name made by a macro; the macro stands for it
                q = k
                while q < n and code[q] in " \t\n":
                    q += 1
                if q < n and code[q] == "(":
                    k = _group_end(code, q)
                last_name = (word, i)
                i = k
                continue
            i = j
            continue
        i += 1
    return defs


def uses(text: str) -> dict[str, int]:
    """Every identifier the code uses (outside comments, strings and preprocessor lines,
    macro bodies included): name -> first line."""
    code = _code_only(text)
    found: dict[str, int] = {}
    for m in _IDENT.finditer(code):
        found.setdefault(m.group(), code.count("\n", 0, m.start()) + 1)
    return found


def includes(text: str) -> list[tuple[str, int]]:
    stripped = strip_c(text)
    return [(m.group(1), stripped.count("\n", 0, m.start()) + 1)
            for m in _INCLUDE.finditer(text)]


def check(sources: Mapping[str, str],
          layers: list[list[str]]) -> tuple[list[str], dict[str, set[str]]]:
    """The violations (one line each) and the graph file -> files it uses, for sources
    {file name: text} placed by layers (bottom first).  Files of one layer may use each
    other (one room: a .c and the headers it includes as parts of itself)."""
    errors = []
    rank: dict[str, int] = {}
    for name in sorted(sources):
        r = rank_of(name, layers)
        if r is None:
            errors.append(f"{name}: not in layers.txt (give it its place, bottom first)")
        else:
            rank[name] = r
    for words in layers:
        for w in words:
            if not any(w == f or fnmatch.fnmatchcase(f, w) for f in sources):
                errors.append(f"layers.txt: {w} is listed but no file matches it")
    defined: dict[str, set[str]] = defaultdict(set)
    for name, text in sources.items():
        for d in definitions(text):
            defined[d].add(name)
    graph: dict[str, set[str]] = defaultdict(set)
    for name, text in sorted(sources.items()):
        if name not in rank:
            continue
        here = rank[name]
        for inc, line in includes(text):
            target = os.path.normpath(inc)
            hit = target if target in rank else os.path.basename(target)
            if hit in rank and rank[hit] > here:
                errors.append(f"{name}:{line}: includes {inc}, a layer above it")
        mine = set(definitions(text))
        for ident, line in sorted(uses(text).items(), key=lambda kv: kv[1]):
            owners = defined.get(ident)
            if not owners or ident in mine:
                continue
            ranked = {o for o in owners if o in rank}
            graph[name].update(ranked)
            if ranked and min(rank[o] for o in ranked) > here:
                above = ", ".join(sorted(ranked))
                errors.append(f"{name}:{line}: uses {ident}, defined above it in {above}")
    return errors, graph


def load(directory: str = KERNELS, layers: list[list[str]] | None = None) -> dict[str, str]:
    """The C files of the kernels' folder, and the files layers.txt names by a path
    (such as ../_layout.h), keyed by that path."""
    names = [f for f in sorted(os.listdir(directory)) if f.endswith(SOURCES)]
    names += [w for words in layers or [] for w in words
              if "/" in w and not any(ch in w for ch in "*?[")]
    out = {}
    for f in names:
        with open(os.path.join(directory, f), encoding="utf-8") as fh:
            out[os.path.normpath(f)] = fh.read()
    return out


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=KERNELS, help="the kernels' folder")
    ap.add_argument("--layers", default=None, help="the order (default: DIR/layers.txt)")
    ap.add_argument("--graph", action="store_true", help="print who uses whom")
    a = ap.parse_args(None if argv is None else list(argv))
    layers = read_layers(a.layers or os.path.join(a.dir, "layers.txt"))
    sources = load(a.dir, layers)
    errors, graph = check(sources, layers)
    if a.graph:
        def key(f: str) -> tuple[int, str]:
            r = rank_of(f, layers)
            return (len(layers) if r is None else r, f)
        for name in sorted(sources, key=key):
            print(f"{name:20s} -> {', '.join(sorted(graph.get(name, ()), key=key))}")
    for e in errors:
        print(e)
    if errors:
        print(f"kernel layers: {len(errors)} upward use(s) or misplaced file(s) "
              f"(order: {os.path.relpath(a.layers or os.path.join(a.dir, 'layers.txt'))})")
        return 1
    print(f"kernel layers: {len(sources)} files in {len(layers)} layers, no upward use")
    return 0


if __name__ == "__main__":
    sys.exit(main())
