"""make test-compat: each integration's dependencies at the lowest and the newest version
it is tested with (src/shmkv/_compat.py TESTED, the same ranges as pyproject's extras), in
plain venvs, against one wheel of this checkout.

Two venvs, each with every integration's dependency at one end of its range, everything
else at the tested set of constraints/compat-lowest.txt and compat-newest.txt (tools/lock.py):

  lowest   numpy 1.x (lowest), transformers, redis-py, pyzmq, msgspec at their lowest
  newest   numpy 2.x (newest), transformers, redis-py, pyzmq, msgspec at their newest

and, with --only latest (make compat-latest, outside CI's gate), a third with no constraints
at all: today's newest release of each (torch excepted, below), to learn before a commit
of the tested set what the next one will meet.

torch is 2.13.0 in both: the only build installable on the machines that test shmkv (a
looser request downloads a multi-GB CUDA build). The full suite runs in .venv (make test)
with the Makefile's pins; here a focused subset per venv: the core API on that numpy, the
transformers integration (publishing generated tokens included), KV events over ZMQ, the
remote tier against a local Redis Cluster (when redis-server is there: make redis), the
papercuts and the ranges. pip's cache is reused; the venvs are kept in .compat/ and
rebuilt only when their pins change.

Usage: python3 tools/test_compat.py --python .venv/bin/python [--wheel DIR]
                                   [--only lowest|newest|latest]
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
    spec = importlib.util.spec_from_file_location("_compat", os.path.join(ROOT, "src", "shmkv",
                                                                          "_compat.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TESTED


def combos():
    t = _tested()
    out = {end: [f"{d}=={t[d][1 if end == 'lowest' else 2]}" for d in sorted(t)]
           for end in ("lowest", "newest")}
    # today's newest: no version named, no constraints (torch: the CPU build on disk)
    out["latest"] = [d if d != "torch" else f"torch=={t[d][2]}" for d in sorted(t)]
    return out


def constraints(name):
    """The constraint file of a venv (None for `latest`: nothing held back)."""
    path = os.path.join(ROOT, "constraints", f"compat-{name}.txt")
    return path if name != "latest" else None


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def build_wheel(python, wheel_dir=None):
    if wheel_dir:                      # make's own build (the .venv's wheel)
        (whl,) = glob.glob(os.path.join(wheel_dir, "shmkv-*.whl"))
        return whl
    dist = os.path.join(OUT, "dist")
    shutil.rmtree(dist, ignore_errors=True)
    run([python, "-m", "pip", "--disable-pip-version-check", "wheel", "-q",
         "--no-build-isolation", "--no-deps", "-w", dist, ROOT])
    (whl,) = glob.glob(os.path.join(dist, "shmkv-*.whl"))
    return whl


def site_packages(python):
    return subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()


def seed_torch(src_python, path):
    """torch 2.13.0 (one CPU build on every end, ~1 GB unpacked) hard-linked from the
    release venv's site-packages instead of unpacked and byte-compiled again (two minutes
    of a CI core per venv).  Its dist-info comes too, so pip finds the pin satisfied and
    installs only what torch requires beside it.  pip never writes into an installed file
    (it replaces files), so neither venv can change the other's."""
    src = site_packages(src_python)
    dst = site_packages(os.path.join(path, "bin", "python"))
    (info,) = glob.glob(os.path.join(src, "torch-*.dist-info"))
    tops = {os.path.basename(info)}
    with open(os.path.join(info, "RECORD")) as f:
        for line in f:
            top = line.split(",", 1)[0].split("/", 1)[0]
            if top and top != "..":               # scripts in bin/ name .venv's python
                tops.add(top)
    for top in sorted(tops):
        if os.path.exists(os.path.join(src, top)):
            run(["cp", "-al", os.path.join(src, top), dst])


def venv(name, pins, src_python):
    path = os.path.join(OUT, name)
    stamp = os.path.join(path, ".pins")
    con = constraints(name)
    cflags = ["-c", con] if con else []
    want = "\n".join(BASE + pins) + ("\n" + open(con).read() if con else "")
    if name == "latest" or not (os.path.exists(stamp) and open(stamp).read() == want):
        shutil.rmtree(path, ignore_errors=True)
        run([sys.executable, "-m", "venv", path])
        pip = [os.path.join(path, "bin", "python"), "-m", "pip", "--disable-pip-version-check"]
        run(pip + ["install", "-q", "-U"] + cflags + ["pip"])
        if any(p.startswith("torch==") for p in pins):
            seed_torch(src_python, path)
        run(pip + ["install", "-q"] + cflags + BASE + pins)
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
    ap.add_argument("--wheel", help="a folder holding the wheel to test (else one is built)")
    ap.add_argument("--only", choices=("lowest", "newest", "latest"),
                    help="one venv (latest: only with --only, never by default)")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    t0 = time.monotonic()
    whl = build_wheel(args.python, args.wheel)
    report = []
    for name, pins in combos().items():
        if (args.only and name != args.only) or (not args.only and name == "latest"):
            continue
        t = time.monotonic()
        path = venv(name, pins, args.python)
        run([os.path.join(path, "bin", "python"), "-m", "pip", "--disable-pip-version-check",
             "install", "-q", "--no-deps", "--force-reinstall", whl])
        setup_s = time.monotonic() - t
        print(f"== test-compat {name}:\n" + versions(path), flush=True)
        t = time.monotonic()
        # bin/pytest, not python -m pytest: the checkout must not shadow the installed wheel
        # inside the tested ranges a version warning is a bug; past them (latest) it is due
        strict = [] if name == "latest" else ["-W", "error::shmkv._compat.ShmkvVersionWarning"]
        r = subprocess.run([os.path.join(path, "bin", "pytest"), "-q", "-p", "no:cacheprovider"]
                           + strict + TESTS, cwd=ROOT)
        report.append((name, versions(path), setup_s, time.monotonic() - t, r.returncode))
    print("\n== test-compat summary")
    for name, vs, setup_s, test_s, rc in report:
        print(f"{name}: {'passed' if rc == 0 else 'FAILED'} (venv {setup_s:.0f} s, tests "
              f"{test_s:.0f} s)\n{vs}", end="")
    print(f"total {time.monotonic() - t0:.0f} s")
    return 0 if report and all(r[4] == 0 for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
