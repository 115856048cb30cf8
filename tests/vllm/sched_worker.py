"""One vLLM engine's scheduler half of the connector, driven over stdin/stdout as vLLM's
scheduler drives it (test_vllm_pending.py): the real connector class in the SCHEDULER role,
built from the real model's engine config, with requests that carry what vLLM's ``Request``
carries for it.  One JSON command per line in, one JSON answer per line out:

- ``{"op": "lookup", "rid": R, "tokens": [...]}`` -- ``get_num_new_matched_tokens(R, 0)``
  (the request is made on first use); ``{"n": tokens to load, or None: "not yet"}``;
- ``{"op": "alloc", "rid": R}`` -- ``update_state_after_alloc``: vLLM runs the request;
- ``{"op": "until_runs", "rid": R, "poll": s, "bound": s}`` -- lookups every ``poll``
  seconds while the answer is "not yet" (vLLM retries each step), at most ``bound``;
  ``{"n": ..., "lookups": k, "seconds": t}``;
- ``{"op": "preempt", "rid": R}`` -- a step's ``build_connector_meta`` with R among the
  preempted requests; ``{"op": "finish", "rid": R}`` -- ``request_finished``;
- ``{"op": "marks"}`` -- ``{"claimed": {rid: keys claimed}}``; ``{"op": "stats"}``;
- ``{"op": "set", "pending_stall": s, "slow": bool}`` -- the connector's stall bound, and
  whether every pending-marks operation answers 0.3 s late (after the table's lock is let
  go), so that two engines' lookups of one prefix interleave: each decides before the
  other marks; it also forgets the prefill rate the engine measured;
- ``{"op": "step", "tokens": n, "seconds": s}`` -- one engine step of ``n`` scheduled
  tokens that takes ``s`` seconds (``build_connector_meta`` ... ``update_connector_output``);
  ``{"spt": the prefill seconds per token the connector measured}``.

argv: segment, JSON of extra connector keys.
"""
from __future__ import annotations

import json
import os
import sys
import time
import types

import numpy as np

SLOW = False


def _slowable_marks() -> None:
    from shmkv import pending

    for name in ("held", "claim", "claim_keys"):
        orig = getattr(pending.PendingMarks, name, None)
        if orig is None:
            continue

        def slowed(self, *a, _orig=orig, **k):
            out = _orig(self, *a, **k)
            if SLOW:
                time.sleep(0.3)
            return out
        setattr(pending.PendingMarks, name, slowed)


def main() -> None:
    global SLOW
    seg, extra = sys.argv[1], json.loads(sys.argv[2])
    # answers on the real stdout; vLLM's log lines (it logs to stdout) go to stderr
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm_helpers import VB, _model_dir

    from shmkv.integrations.vllm import ShmkvConnector

    _slowable_marks()
    cfg = EngineArgs(model=_model_dir(), dtype="bfloat16", enforce_eager=True,
                     max_model_len=2048, block_size=VB, kv_transfer_config=KVTransferConfig(
                         kv_connector="ShmkvConnector",
                         kv_connector_module_path="shmkv.integrations.vllm",
                         kv_role="kv_both", kv_load_failure_policy="recompute",
                         kv_connector_extra_config={"segment": seg, **extra})
                     ).create_engine_config()
    conn = ShmkvConnector(cfg, KVConnectorRole.SCHEDULER, None)
    reqs: dict[str, types.SimpleNamespace] = {}

    def request(rid: str, tokens=None) -> types.SimpleNamespace:
        if rid not in reqs:
            t = [int(x) for x in tokens]
            reqs[rid] = types.SimpleNamespace(
                request_id=rid, all_token_ids=t, num_tokens=len(t), num_prompt_tokens=len(t),
                cache_salt=None, lora_request=None, skip_reading_prefix_cache=False)
        return reqs[rid]

    marks = conn.connector_scheduler.marks_on()
    print(json.dumps({"ready": True, "marks": marks}), file=answers, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        out: dict = {}
        if op == "lookup":
            out["n"] = conn.get_num_new_matched_tokens(request(cmd["rid"], cmd["tokens"]), 0)[0]
        elif op == "until_runs":
            r, t0, k = request(cmd["rid"]), time.monotonic(), 0
            while True:
                n, k = conn.get_num_new_matched_tokens(r, 0)[0], k + 1
                if n is not None or time.monotonic() - t0 > cmd["bound"]:
                    break
                time.sleep(cmd["poll"])
            out.update(n=n, lookups=k, seconds=time.monotonic() - t0)
        elif op == "alloc":
            conn.update_state_after_alloc(request(cmd["rid"]), None, 0)
        elif op == "preempt":
            so = types.SimpleNamespace(
                preempted_req_ids={cmd["rid"]}, scheduled_new_reqs=[],
                scheduled_cached_reqs=types.SimpleNamespace(
                    req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                    num_computed_tokens=[]),
                num_scheduled_tokens={})
            conn.build_connector_meta(so)
        elif op == "step":
            so = types.SimpleNamespace(
                preempted_req_ids=set(), scheduled_new_reqs=[],
                scheduled_cached_reqs=types.SimpleNamespace(
                    req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                    num_computed_tokens=[]),
                num_scheduled_tokens={}, total_num_scheduled_tokens=int(cmd["tokens"]))
            conn.build_connector_meta(so)
            time.sleep(float(cmd["seconds"]))
            conn.update_connector_output(types.SimpleNamespace(kv_cache_events=None,
                                                               invalid_block_ids=None))
            out["spt"] = conn.connector_scheduler._spt
        elif op == "finish":
            conn.request_finished(request(cmd["rid"]), [])
        elif op == "marks":
            out["claimed"] = {rid: conn.connector_scheduler._pending.claimed(rid) for rid in reqs}
        elif op == "set":
            conn.connector_scheduler._pending_stall = float(cmd["pending_stall"])
            conn.connector_scheduler._spt = None
            SLOW = bool(cmd["slow"])
        elif op == "stats":
            out.update(conn.connector_scheduler._iv.data["c"])       # this interval's counters
        else:
            raise ValueError(f"unknown op {op!r}")
        print(json.dumps(out, default=lambda x: int(x) if isinstance(x, np.integer) else str(x)),
              file=answers, flush=True)
    conn.shutdown()


if __name__ == "__main__":
    main()
