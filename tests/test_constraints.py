"""Every venv the project makes installs the committed tested set: a release on the index
cannot change what `make test` installs.

The Makefile's installs go through `$(PIPI)` / `$(VPIPI)` (pip with `-c constraints/...`)
or name one exact version with --no-deps; every distribution they name is pinned in that
venv's constraint file; dist-check and test-compat use their own files (tools/lock.py makes
them all).
"""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CON = os.path.join(ROOT, "constraints")


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _pins(name):
    pins = {}
    for line in _read("constraints", f"{name}.txt").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([0-9][A-Za-z0-9.\-]*)", line)
        assert m, f"constraints/{name}.txt: {line!r} is not NAME==VERSION"
        pins[_norm(m.group(1))] = m.group(2)
    return pins


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _makefile_commands():
    """The Makefile's recipe lines, continuation lines joined."""
    text = _read("Makefile").replace("\\\n", " ")
    return [ln.strip() for ln in text.splitlines() if ln.startswith("\t")]


@pytest.mark.parametrize("name", sorted(f[:-4] for f in os.listdir(CON) if f.endswith(".txt")))
def test_every_constraint_file_pins_exact_versions(name):
    assert len(_pins(name)) > 5


def test_every_makefile_install_is_constrained():
    installs = [c for c in _makefile_commands() if re.search(r"\bPIPI\)|\bpip\b.* install ", c)
                or re.search(r"\$\((V?PIP)\) install", c)]
    assert len(installs) >= 10
    venvs = {"PIPI": "main", "VPIPI": "vllm"}
    for cmd in installs:
        m = re.search(r"\$\((V?PIPI)\)", cmd)
        if m:
            pins = _pins(venvs[m.group(1)])
            names = re.findall(r'"([A-Za-z0-9_.\-]+)(?:[<>=!~][^"]*)?"|\s(pip|wheel|ruff)\b',
                               cmd.split(")", 1)[1])
            for quoted, bare in names:
                assert _norm(quoted or bare) in pins, (cmd, quoted or bare, venvs[m.group(1)])
            continue
        # otherwise: the project's own wheel or build, or one exact version without deps
        rest = cmd.split("install", 1)[1]
        own = "WHEEL_DIR)" in rest or rest.rstrip().endswith(" .")
        exact = "--no-deps" in rest and re.search(r'"[A-Za-z0-9_.\-]+==[0-9.]+"', rest)
        assert own or exact, f"an unconstrained install in the Makefile: {cmd}"


def test_the_vllm_venv_and_main_venv_pin_the_tested_torch():
    for name in ("main", "vllm", "compat-lowest", "compat-newest"):
        assert _pins(name)["torch"] == "2.13.0", name


def test_tools_use_their_constraints():
    assert "export PIP_CONSTRAINT=$ROOT/constraints/tools.txt" in _read("tools", "dist_check.sh")
    assert "PIP_CONSTRAINT=$ROOT/constraints/main.txt" in _read("tools", "dist_check.sh")
    src = _read("tools", "test_compat.py")
    assert '"constraints", f"compat-{name}.txt"' in src and "cflags + BASE + pins" in src


def test_the_compat_sets_hold_the_tested_ranges():
    """compat-lowest/newest pin each integration's dependency at the end of its range."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_compat", os.path.join(ROOT, "src", "shmkv",
                                                                          "_compat.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for i, end in ((1, "lowest"), (2, "newest")):
        pins = _pins(f"compat-{end}")
        for dist, t in mod.TESTED.items():
            assert pins[_norm(dist)] == t[i], (end, dist, pins[_norm(dist)], t[i])


def test_the_main_set_is_inside_the_tested_ranges():
    """What make test installs is what shmkv says it is tested with (no version warning)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_compat", os.path.join(ROOT, "src", "shmkv",
                                                                          "_compat.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name in ("main", "vllm"):
        pins = _pins(name)
        for dist, (_, lo, hi) in mod.TESTED.items():
            if _norm(dist) in pins:
                v = mod.version_tuple(pins[_norm(dist)])
                assert mod.version_tuple(lo) <= v <= mod.version_tuple(hi), (name, dist, v)
