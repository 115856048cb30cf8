"""The tested versions: shmkv._compat.TESTED, the extras' ranges in
pyproject.toml and the runtime warning say the same thing."""
import os
import re
import warnings

import pytest

from shmkv import _compat

PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "pyproject.toml")


def _requirements():
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")
    with open(PYPROJECT, "rb") as f:
        proj = tomllib.load(f)["project"]
    reqs = {"": proj["dependencies"]}
    reqs.update(proj["optional-dependencies"])
    return reqs


def _spec(reqs, dist):
    for r in reqs:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", r)
        if m and m.group(1).lower() == dist:
            return m.group(2).replace(" ", "")
    return None


@pytest.mark.parametrize("dist", sorted(_compat.TESTED))
def test_extras_say_exactly_what_is_tested(dist):
    # a library's requirement: the lowest version tested, no cap (the newest tested is
    # where the run-time warning starts, not a limit pip enforces)
    extra, lo, hi = _compat.TESTED[dist]
    spec = _spec(_requirements()[extra], dist)
    assert spec == f">={lo}", f"pyproject's {extra or 'dependencies'}: {dist}{spec}, " \
                              f"lowest tested {lo}"


def test_every_extra_naming_a_tested_dist_uses_its_range():
    for extra, reqs in _requirements().items():
        for dist, (_, lo, _hi) in _compat.TESTED.items():
            spec = _spec(reqs, dist)
            if spec is None or extra in ("bench",):   # benchmarks' own baselines
                continue
            assert spec == f">={lo}", f"extra {extra!r}: {dist}{spec}, lowest tested {lo}"


@pytest.mark.parametrize("v, t", [("5.24.0", (5, 24, 0)), ("2.13.0+cpu", (2, 13, 0)),
                                  ("8.1", (8, 1, 0)), ("0.22.0rc1", (0, 22, 0)),
                                  ("27.3.0.post1", (27, 3, 0))])
def test_version_tuple(v, t):
    assert _compat.version_tuple(v) == t


def test_untested_version_warns_once(monkeypatch):
    monkeypatch.setattr(_compat, "_warned", set())
    monkeypatch.setitem(_compat.TESTED, "numpy", ("", "0.0.1", "0.0.2"))   # none installs it
    import numpy
    with pytest.warns(_compat.ShmkvVersionWarning, match=r"tested with numpy 0\.0\.1 to "
                      r"0\.0\.2; " + re.escape(numpy.__version__) + " is installed"):
        assert _compat.check("numpy", what="the test") == numpy.__version__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.check("numpy", what="the test")          # once per process


def test_tested_version_is_quiet(monkeypatch):
    monkeypatch.setattr(_compat, "_warned", set())
    import numpy
    monkeypatch.setitem(_compat.TESTED, "numpy", ("", numpy.__version__, numpy.__version__))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compat.check("numpy", what="the test")


def test_missing_dependency_names_the_extra(monkeypatch):
    monkeypatch.setitem(_compat.TESTED, "no-such-dist-34", ("events", "1.0.0", "2.0.0"))
    with pytest.raises(ImportError, match=r'needs no-such-dist-34 \(1\.0\.0 to 2\.0\.0 tested\)'
                       r'.*pip install "shmkv\[events\]"'):
        _compat.check("no-such-dist-34", what="the test", module="no_such_module_34")


def test_no_requirement_caps_or_pins():
    """Every requirement of the package and its extras is a lower bound (or a != of a
    release known broken): no <, <=, == or ~= that would fight the application's versions."""
    for extra, reqs in _requirements().items():
        for r in reqs:
            m = re.fullmatch(r"([A-Za-z0-9_.\[\],-]+)\s*(.*)", r)
            assert m, r
            for clause in filter(None, m.group(2).replace(" ", "").split(",")):
                assert clause.startswith((">=", "!=")), \
                    f"{extra or 'dependencies'}: {r!r}: expected lower bounds only"
