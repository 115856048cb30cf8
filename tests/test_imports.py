"""No import circle among shmkv's own modules -- counting the imports made inside functions,
which hide a circle from the interpreter's start-up but not from a reader (config.py once
imported ``_core`` inside its methods while ``_core`` imported config).  Read from the
source tree (``.py`` with ``ast``, ``.pyx`` by their import lines), not imported."""
from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shmkv"
_PYX_IMPORT = re.compile(r"^\s*from\s+(\.*)([\w.]*)\s+c?import\s+\(?([\w, ]+)", re.M)


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.suffix in (".py", ".pyx") and p.is_file():
            parts = list(p.relative_to(root.parent).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


def _base(mod: str, is_pkg: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    parts = mod.split(".")
    if not is_pkg:
        parts.pop()
    parts = parts[:len(parts) - (level - 1)]
    return ".".join(parts + ([name] if name else []))


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the same tree it imports, anywhere in its body."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        src = path.read_text()
        pairs: list[tuple[str, list[str]]] = []
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.ImportFrom):
                    pairs.append((_base(mod, is_pkg, node.level, node.module),
                                  [a.name for a in node.names]))
                elif isinstance(node, ast.Import):
                    pairs += [(a.name, []) for a in node.names]
        else:
            for m in _PYX_IMPORT.finditer(src):
                pairs.append((_base(mod, is_pkg, len(m.group(1)), m.group(2) or None),
                              [n.strip().split(" ")[0] for n in m.group(3).split(",")]))
        deps = set()
        for base, names in pairs:
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in mods]
            deps.update(subs or [base])
        graph[mod] = {d for d in deps if d in mods and d != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_among_shmkvs_modules():
    graph = import_graph(SRC)
    assert len(graph) > 40 and graph["shmkv._core"]          # the tree was read
    assert circles(graph) == []


def test_the_layout_binding_is_below_config_and_core():
    graph = import_graph(SRC)
    assert "shmkv._sizes" in graph["shmkv.config"] and "shmkv._core" not in graph["shmkv.config"]
    assert "shmkv._sizes" in graph["shmkv._core"]
    assert graph["shmkv._sizes"] == set()


def test_a_circle_through_a_function_level_import_is_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.pyx").write_text("from pkg.a cimport y\n")
    (pkg / "d.py").write_text("from . import a\n")
    assert circles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.c"]]
