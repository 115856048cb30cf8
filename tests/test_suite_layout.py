"""The suite's own layout (DEVELOP.md): directly under tests/ only test files and
conftest.py; what spawned children run is in tests/workers/, what tests share in
tests/support/; no test imports ``conftest``, which is pytest's to import (under
``--import-mode=importlib`` as ``tests.conftest``; a bare ``import conftest`` loads a
second copy, and in tests/vllm two conftest.py files could answer to the name)."""
import ast
import os

TESTS = os.path.dirname(os.path.abspath(__file__))


def _py_files(root):
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__" and not x.startswith("."))
        for f in sorted(files):
            if f.endswith(".py"):
                yield os.path.join(d, f)


def _imports_conftest(path):
    """The lines of `path` that import the module ``conftest`` (import, from-import,
    __import__ / importlib.import_module with the name spelled out)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Name) and node.func.id == "__import__")
                   or (isinstance(node.func, ast.Attribute)
                       and node.func.attr == "import_module"))):
            names = [node.args[0].value]
        else:
            continue
        if any(n == "conftest" or n.startswith("conftest.") for n in names):
            lines.append(node.lineno)
    return lines


def test_no_test_imports_conftest():
    found = {os.path.relpath(p, TESTS): ln for p in _py_files(TESTS)
             for ln in [_imports_conftest(p)] if ln}
    assert found == {}, (
        "import what tests share from tests/support/ (from support import ...), not from "
        f"conftest: {found}")


def test_only_tests_and_conftest_directly_under_tests():
    top = sorted(f for f in os.listdir(TESTS) if f.endswith(".py"))
    workers = [f for f in top if f.endswith("_workers.py")]
    assert workers == [], f"worker modules belong in tests/workers/: {workers}"
    other = [f for f in top if not (f.startswith("test_") or f == "conftest.py")]
    assert other == [], ("directly under tests/ only test_*.py and conftest.py: workers go "
                         f"in tests/workers/, shared helpers in tests/support/: {other}")


def test_the_checks_see_what_they_look_for(tmp_path):
    """_imports_conftest finds each way of importing conftest, and nothing else."""
    src = tmp_path / "m.py"
    for code, want in [("from conftest import SMALL\n", [1]),
                       ("import os\nimport conftest\n", [2]),
                       ("import conftest as c\n", [1]),
                       ("x = __import__('conftest')\n", [1]),
                       ("import importlib\nm = importlib.import_module('conftest')\n", [2]),
                       ("from support import SMALL\nimport conftest_like\n", []),
                       ("from .conftest import x\n", [])]:
        src.write_text(code)
        assert _imports_conftest(str(src)) == want, code
