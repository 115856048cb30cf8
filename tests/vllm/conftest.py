"""The vLLM test group (run with the vLLM venv: make test-vllm): without vLLM these tests
skip, except under CI=true, where a missing vLLM is a failure."""
from __future__ import annotations

import os

import pytest

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
    WHY = ""
except Exception as e:  # pragma: no cover - depends on the venv
    HAVE_VLLM = False
    WHY = f"{type(e).__name__}: {e}"


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        raise pytest.UsageError(f"CI=true and vLLM is not importable ({WHY}): run the vLLM "
                                "tests with the vLLM venv (make test-vllm)")
    mark = pytest.mark.skip(reason=f"vLLM is not installed ({WHY}); make test-vllm")
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(mark)
