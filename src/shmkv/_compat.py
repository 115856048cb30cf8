"""The versions of optional dependencies each integration is tested with.

``make test-compat`` runs each integration's tests at the lowest and the newest version of
its dependency that these ranges name; the extras in ``pyproject.toml`` admit exactly the
same ranges.  An integration calls :func:`check` when it is imported or first used: a
dependency that is missing raises ``ImportError`` naming the extra to install, one outside
its tested range warns once per process (``ShmkvVersionWarning``), and works on at the
user's risk.  Keep this table, the extras and the Makefile's ``test-compat`` lists in step
(``tests/test_compat.py`` checks that they agree).
"""
from __future__ import annotations

import warnings
from typing import Dict, Optional, Set, Tuple

__all__ = ["TESTED", "ShmkvVersionWarning", "check", "version_tuple"]

#: distribution -> (extra that installs it, lowest tested, newest tested); both inclusive.
#: The newest is the newest release on the index when the range was last tested: a
#: later release is untested, not refused.
TESTED: Dict[str, Tuple[str, str, str]] = {
    "transformers": ("transformers", "5.19.0", "5.25.0"),
    "torch": ("torch", "2.13.0", "2.13.0"),
    "redis": ("redis", "5.0.0", "8.2.0"),
    "pyzmq": ("events", "25.0.0", "27.3.0"),
    "msgspec": ("events", "0.18.0", "0.23.0"),
    "numpy": ("", "1.24.0", "2.4.6"),
}


class ShmkvVersionWarning(UserWarning):
    """An optional dependency's version is outside the range shmkv is tested with."""


_warned: Set[str] = set()


def version_tuple(v: str) -> Tuple[int, ...]:
    """'5.24.0' -> (5, 24, 0); '2.13.0+cpu' -> (2, 13, 0); '8.1.0rc1' -> (8, 1, 0)."""
    out = []
    for part in v.split("+")[0].split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if digits != part:
            break
    while len(out) < 3:
        out.append(0)
    return tuple(out)


def _installed(dist: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check(dist: str, *, what: str, module: Optional[str] = None) -> Optional[str]:
    """Checks that ``dist`` is importable (``module``, default the distribution's name) and
    warns once if its version is outside :data:`TESTED`.  ``what`` names the integration in
    the messages.  Returns the installed version (``None`` when the distribution's metadata
    is missing but the module imports: a vendored or source copy, not checked).

    Raises
    ------
    ImportError
        The module does not import; the message names the extra to install.
    """
    import importlib

    extra, lo, hi = TESTED[dist]
    try:
        importlib.import_module(module or dist)
    except ImportError as e:
        hint = f'pip install "shmkv[{extra}]"' if extra else f"pip install {dist}"
        raise ImportError(f"{what} needs {dist} ({lo} to {hi} tested), which does not "
                          f"import here ({e}): {hint}", name=e.name) from e
    v = _installed(dist)
    if v is None:
        return None
    if not version_tuple(lo) <= version_tuple(v) <= version_tuple(hi) and dist not in _warned:
        _warned.add(dist)
        warnings.warn(f"{what} is tested with {dist} {lo} to {hi}; {v} is installed "
                      f"(untested: it may work; report what breaks)",
                      ShmkvVersionWarning, stacklevel=3)
    return v
