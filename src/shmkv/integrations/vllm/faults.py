"""Test-only fault injection of the vLLM connector, for both halves and tp.py (DESIGN.md,
"The vLLM connector").

Off unless the engine's environment has SHMKV_VLLM_FAULT=1, and then only for requests whose
cache_salt names the fault ("fault:NAME"), so one engine serves clean and faulty requests
side by side:

- ``reset_before_load``: the worker drops the segment's prefix index right before the load
  (every matched block vanished between the match and the load)
- ``overclaim``: the scheduler claims one vLLM block more than it matched
- ``kill_mid_save``: the worker SIGKILLs itself after copying half the layers of a save
"""
from __future__ import annotations

import os

_FAULTS_ON = os.environ.get("SHMKV_VLLM_FAULT") == "1"


def _fault(salt: str, name: str) -> bool:
    return _FAULTS_ON and f"fault:{name}" in salt
