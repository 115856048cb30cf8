"""Reads a segment on a host of tools/netlab.py (its /dev/shm is the host's own: only a
process in the host's mount namespace sees it).  tests/vllm/test_vllm_hosts.py runs it
there with ``Lab.run``:

    python hosts_worker.py stats SEGMENT                 -> the segment's tier counters (JSON)
    python hosts_worker.py stored SEGMENT MODEL IDS OUT  -> what the segment holds for the
        token ids in the JSON file IDS under the model's salt, saved to OUT (.npz)
"""
from __future__ import annotations

import json
import sys

import numpy as np
from serve_helpers import stored_kv

import shmkv


def main(argv: list[str]) -> int:
    op, seg = argv[0], argv[1]
    if op == "stats":
        kv = shmkv.KVCache.attach(seg)
        try:
            print(json.dumps({k: v for k, v in kv.stats().items() if k.startswith("tier_")}))
        finally:
            kv.close()
    elif op == "stored":
        model, ids, out = argv[2], argv[3], argv[4]
        with open(ids) as f:
            tokens = json.load(f)
        n, k, v, check = stored_kv(seg, model, tokens)
        np.savez(out, n=n, k=k, v=v, check=json.dumps(check))
    else:
        raise SystemExit(f"unknown op {op!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
