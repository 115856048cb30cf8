"""A griffe extension for the docs' API reference (mkdocs.yml): Cython signatures.

The compiled modules are built with ``embedsignature`` and ``binding=False`` (setup.py):
their methods have no ``__signature__`` for griffe's inspection to read, but each
docstring opens with the signature Cython embedded, e.g.
``SequenceOps.create_sequence(self, tokens=None, salt=None, *, int priority=0)``. This
extension turns that line into the function's parameters (C types such as ``int`` dropped)
and removes it from the docstring, so the numpydoc ``Parameters`` section matches a real
signature and the page shows it once.
"""
from __future__ import annotations

import ast
import re
from typing import Any, List

import griffe

_SIG = re.compile(r"^\s*[A-Za-z_][\w.]*\((?P<args>.*)\)(?:\s*->\s*(?P<ret>.+))?\s*$")


def _split(args: str) -> List[str]:
    """Top-level comma split (defaults may hold tuples or calls)."""
    out, depth, cur = [], 0, ""
    for ch in args:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _python_arg(arg: str) -> str:
    """'int priority=0' -> 'priority=0'; 'double scale' -> 'scale'; '*' and '**kw' kept."""
    head, eq, default = arg.partition("=")
    words = head.split()
    return words[-1] + (eq + default if eq else "")


def _parameters(args: str) -> "griffe.Parameters | None":
    src = ", ".join(_python_arg(a) for a in _split(args))
    try:
        fn = ast.parse(f"def f({src}): pass").body[0]
    except SyntaxError:
        return None
    assert isinstance(fn, ast.FunctionDef)
    a = fn.args
    params = []
    pos = a.posonlyargs + a.args
    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    for i, (p, d) in enumerate(zip(pos, defaults)):
        if i == 0 and p.arg in ("self", "cls"):
            continue
        kind = (griffe.ParameterKind.positional_only if i < len(a.posonlyargs)
                else griffe.ParameterKind.positional_or_keyword)
        params.append(griffe.Parameter(p.arg, kind=kind,
                                       default=None if d is None else ast.unparse(d)))
    if a.vararg:
        params.append(griffe.Parameter(a.vararg.arg, kind=griffe.ParameterKind.var_positional))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append(griffe.Parameter(p.arg, kind=griffe.ParameterKind.keyword_only,
                                       default=None if d is None else ast.unparse(d)))
    if a.kwarg:
        params.append(griffe.Parameter(a.kwarg.arg, kind=griffe.ParameterKind.var_keyword))
    return griffe.Parameters(*params)


class CythonSignatures(griffe.Extension):
    def on_function_instance(self, *, node: Any, func: griffe.Function, **kwargs: Any) -> None:
        doc = func.docstring
        if doc is None or len(func.parameters):
            return
        first, _, rest = doc.value.partition("\n")
        m = _SIG.match(first)
        if not m or not first.lstrip().split("(")[0].endswith(func.name):
            return
        params = _parameters(m.group("args"))
        if params is None:
            return
        func.parameters = params
        doc.value = rest.lstrip("\n")
