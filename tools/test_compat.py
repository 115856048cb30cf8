"""make test-compat: each integration's dependencies at the lowest and the newest version
it is tested with (shmkv/_compat.py TESTED, the same ranges as pyproject's extras), in
plain venvs, against one wheel of this checkout.

Two venvs, each with every integration's dependency at one end of its range:

  lowest   numpy 1.x (lowest), transformers, redis-py, pyzmq, msgspec at their lowest
  newest   numpy 2.x (newest), transformers, redis-py, pyzmq, msgspec at their newest

torch is 2.13.0 in both: the only build installable on the machines that test shmkv (a
looser request downloads a multi-GB CUDA build). The full suite runs in .venv (make test)
with the Makefile's pins; here a focused subset per venv: the core API on that numpy, the
transformers integration (publishing generated tokens included), KV events over ZMQ, the
remote tier against a local Redis Cluster (when redis-server is there: make redis), the
papercuts and the ranges. pip's cache is reused; the venvs are kept in .compat/ and
rebuilt only when their pins change.

Usage: python3 tools/test_compat.py --python .venv/bin/python [--only lowest|newest]
"""
import argparse
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, ".compat")

TESTS = ["tests/test_smoke.py", "tests/test_api.py", "tests/test_papercuts.py",
         "tests/test_compat.py", "tests/test_publish.py", "tests/test_transformers.py",
         "tests/test_events.py", "tests/test_tier.py"]
# what every venv needs besides the pins (the tests' own dependencies)
BASE = ["posix-ipc>=1.1", "pytest>=7.4", "hypothesis>=6.80", "ml_dtypes>=0.3"]


def _tested():
    spec = importlib.util.spec_from_file_location("_compat", os.path.join(ROOT, "shmkv",
                                                                          "_compat.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TESTED


def combos():
    t = _tested()
    return {end: [f"{d}=={t[d][1 if end == 'lowest' else 2]}" for d in sorted(t)]
            for end in ("lowest", "newest")}


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def build_wheel(python):
    dist = os.path.join(OUT, "dist")
    shutil.rmtree(dist, ignore_errors=True)
    run([python, "-m", "pip", "--disable-pip-version-check", "wheel", "-q",
         "--no-build-isolation", "--no-deps", "-w", dist, ROOT])
    (whl,) = glob.glob(os.path.join(dist, "shmkv-*.whl"))
    return whl


def venv(name, pins):
    path = os.path.join(OUT, name)
    stamp = os.path.join(path, ".pins")
    want = "\n".join(BASE + pins)
    if not (os.path.exists(stamp) and open(stamp).read() == want):
        shutil.rmtree(path, ignore_errors=True)
        run([sys.executable, "-m", "venv", path])
        pip = [os.path.join(path, "bin", "python"), "-m", "pip", "--disable-pip-version-check"]
        run(pip + ["install", "-q", "-U", "pip"])
        run(pip + ["install", "-q"] + BASE + pins)
        with open(stamp, "w") as f:
            f.write(want)
    return path


def versions(path):
    code = ("from importlib import metadata as m\n"
            "for d in ['numpy', 'torch', 'transformers', 'redis', 'pyzmq', 'msgspec', "
            "'ml_dtypes', 'shmkv']:\n"
            "    print(f'  {d:<13} {m.version(d)}')")
    return subprocess.run([os.path.join(path, "bin", "python"), "-c", code], cwd="/tmp",
                          check=True, capture_output=True, text=True).stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="builds the wheel (the .venv's python)")
    ap.add_argument("--only", choices=("lowest", "newest"))
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    t0 = time.monotonic()
    whl = build_wheel(args.python)
    report = []
    for name, pins in combos().items():
        if args.only and name != args.only:
            continue
        t = time.monotonic()
        path = venv(name, pins)
        run([os.path.join(path, "bin", "python"), "-m", "pip", "--disable-pip-version-check",
             "install", "-q", "--no-deps", "--force-reinstall", whl])
        setup_s = time.monotonic() - t
        print(f"== test-compat {name}:\n" + versions(path), flush=True)
        t = time.monotonic()
        # bin/pytest, not python -m pytest: the checkout must not shadow the installed wheel
        r = subprocess.run([os.path.join(path, "bin", "pytest"), "-q", "-p", "no:cacheprovider",
                            "-W", "error::shmkv._compat.ShmkvVersionWarning"] + TESTS,
                           cwd=ROOT)
        report.append((name, versions(path), setup_s, time.monotonic() - t, r.returncode))
    print("\n== test-compat summary")
    for name, vs, setup_s, test_s, rc in report:
        print(f"{name}: {'passed' if rc == 0 else 'FAILED'} (venv {setup_s:.0f} s, tests "
              f"{test_s:.0f} s)\n{vs}", end="")
    print(f"total {time.monotonic() - t0:.0f} s")
    return 0 if report and all(r[4] == 0 for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
