"""`shmkv blocks NAME --png FILE` without Pillow: exit 2 and one line saying how to get it.

Pillow is made unimportable for one subprocess by a `PIL` package first on PYTHONPATH whose
import raises ImportError (what a missing Pillow raises); the same command without the shim
draws the PNG, so the shim and nothing else is what makes the first run fail.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.procout import stderr_lines

pytest.importorskip("PIL", reason="the control run draws a PNG with the real Pillow")


def _blocks_png(name, png, cwd, pythonpath=None):
    env = dict(os.environ)
    env.pop("NO_COLOR", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "shmkv", "blocks", name, "--png", str(png)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
                          check=False)


def test_png_without_pillow_says_how_to_get_it(cache, tmp_path):
    shim = tmp_path / "no_pillow"
    (shim / "PIL").mkdir(parents=True)
    (shim / "PIL" / "__init__.py").write_text(
        'raise ImportError("No module named \'PIL\' (test shim)", name="PIL")\n')
    png = tmp_path / "pool.png"

    r = _blocks_png(cache.name, png, tmp_path, pythonpath=shim)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = stderr_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("shmkv: --png needs Pillow"), lines[0]
    assert 'pip install "shmkv[cli]"' in lines[0] and "pip install Pillow" in lines[0]
    assert r.stdout == ""
    assert not png.exists()

    # control: the same command with the real Pillow writes the picture
    ok = _blocks_png(cache.name, png, tmp_path)
    assert ok.returncode == 0, (ok.returncode, ok.stdout, ok.stderr)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
