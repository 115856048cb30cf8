"""The shipped text has no internal references (tools/docs_lint.py, also run by `make
lint`): the checkout passes, and a planted reference is caught, so the check can fail.
Reads the source tree through git; skipped where the tests are not in a git checkout."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "docs_lint.py")
if not os.path.exists(os.path.join(ROOT, ".git")) or shutil.which("git") is None:
    pytest.skip("no git checkout beside the tests", allow_module_level=True)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import docs_lint  # noqa: E402


def _run(*args):
    return subprocess.run([sys.executable, TOOL, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)


def test_the_checkout_has_no_internal_reference():
    r = _run()
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == ""


def test_a_planted_issue_number_is_reported(tmp_path):
    page = tmp_path / "page.md"
    # spelled in two pieces so that this file does not match itself
    page.write_text("# A page\n\nThe fix (see iss" + "ue 12) is in.\n")
    r = _run(str(page))
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{page}:3: The fix (see iss" + "ue 12) is in." in r.stdout


@pytest.mark.parametrize("line", [
    "API" + ".md, the contract",
    "../" + "shared/notes.txt",
    "measured in this " + "session",
    "ask the " + "lead",
    "Target (" + "issue): 2x",
])
def test_each_kind_of_reference_is_reported(tmp_path, line):
    f = tmp_path / "x.py"
    f.write_text(f"# {line}\n")
    r = _run(str(f))
    assert r.returncode == 1 and f"{f}:1:" in r.stdout, (line, r.stdout)


def test_legitimate_uses_pass(tmp_path):
    f = tmp_path / "ok.md"
    f.write_text("[API reference](reference/api.md); see known issues.\n"
                 "with requests.Session() as s: one HTTP session per client\n"
                 "when the last session of a regular user ends, logind removes IPC\n"
                 "the sessions workload: 16 chats, each session's turns in order\n")
    r = _run(str(f))
    assert r.returncode == 0, r.stdout


def test_the_file_list_is_the_shipped_text():
    files = ["README.md", "docs/a/b.md", "docs/pool-map.png", "src/shmkv/_core.pyx",
             "src/shmkv/_core.c", "src/shmkv/kernels/attention.c", "tests/test_x.py", "Makefile",
             ".ci/run", "constraints/main.txt", "LICENSE", "tools/docs_lint.py"]
    assert list(docs_lint.shipped(files)) == [
        "README.md", "docs/a/b.md", "src/shmkv/_core.pyx", "src/shmkv/kernels/attention.c",
        "tests/test_x.py", "Makefile", ".ci/run"]


def test_a_citation_of_a_file_not_in_the_repository_is_reported(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("# the versions agree (tests/test_compat.py checks it)\n"
                 "# each worker module in tests/*_workers.py; plots in benchmarks/out/a.png\n")
    assert _run(str(f)).returncode == 0
    f.write_text("# the versions agree (tests/test_compat_" + "ranges.py checks it)\n")
    r = _run(str(f))
    assert r.returncode == 1 and "no such file in the repository" in r.stdout, r.stdout
