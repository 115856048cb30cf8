"""The API of vLLM's ``KVConnectorBase_V1`` in a vLLM wheel, as JSON: what
tests/vllm/test_vllm_api.py checks ShmkvConnector against for a vLLM newer than the one
the project's venv runs (its files are pure Python: read with ``ast``, never imported, so
no GPU and none of its dependencies are needed).

    python tools/vllm_api.py vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl \\
        > tests/vllm/data/kv_connector_base_v1-0.34.0.json

(the wheel from ``pip download --no-deps vllm==0.34.0``).  For each method of the class:
its kind (``method``, ``classmethod``, ``staticmethod``, ``property``), whether it is
abstract, and its parameters (name and kind, in order)."""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
import zipfile

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
CLASS = "KVConnectorBase_V1"
_KINDS = ("classmethod", "staticmethod", "property")


def _decorators(fn: ast.FunctionDef) -> list[str]:
    out = []
    for d in fn.decorator_list:
        if isinstance(d, ast.Name):
            out.append(d.id)
        elif isinstance(d, ast.Attribute):
            out.append(d.attr)
    return out


def _params(fn: ast.FunctionDef) -> list[list[str]]:
    a = fn.args
    out = [[p.arg, "POSITIONAL_ONLY"] for p in a.posonlyargs]
    out += [[p.arg, "POSITIONAL_OR_KEYWORD"] for p in a.args]
    if a.vararg:
        out.append([a.vararg.arg, "VAR_POSITIONAL"])
    out += [[p.arg, "KEYWORD_ONLY"] for p in a.kwonlyargs]
    if a.kwarg:
        out.append([a.kwarg.arg, "VAR_KEYWORD"])
    return out


def api(source: str) -> dict:
    """``{name: {"kind", "abstract", "params"}}`` of the class in ``source``."""
    tree = ast.parse(source)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS),
               None)
    if cls is None:
        raise SystemExit(f"{BASE}: no class {CLASS}")
    out = {}
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decs = _decorators(fn)
        kind = next((k for k in _KINDS if k in decs), "method")
        if fn.name in out and kind == "method" and any(d in ("setter", "deleter")
                                                       for d in decs):
            continue                    # a property's setter: the property is recorded
        out[fn.name] = {"kind": kind, "abstract": "abstractmethod" in decs,
                        "params": _params(fn)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel")
    args = ap.parse_args()
    m = re.match(r"vllm-([^-]+)-", args.wheel.rsplit("/", 1)[-1])
    if not m:
        raise SystemExit(f"{args.wheel}: not a vllm wheel's name (vllm-VERSION-...whl)")
    with open(args.wheel, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    with zipfile.ZipFile(args.wheel) as z:
        source = z.read(BASE).decode("utf-8")
    head = {"vllm": m.group(1), "wheel": args.wheel.rsplit("/", 1)[-1],
            "wheel_sha256": sha, "file": BASE, "class": CLASS}
    methods = api(source)
    out = sys.stdout
    out.write("{\n")
    for k, v in head.items():
        out.write(f" {json.dumps(k)}: {json.dumps(v)},\n")
    out.write(' "methods": {\n')           # one method a line: reviewable diffs
    for i, name in enumerate(sorted(methods)):
        sep = "," if i < len(methods) - 1 else ""
        out.write(f"  {json.dumps(name)}: {json.dumps(methods[name], sort_keys=True)}{sep}\n")
    out.write(" }\n}\n")


if __name__ == "__main__":
    main()
