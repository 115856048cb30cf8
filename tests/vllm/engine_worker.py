"""One vLLM engine in its own process for the vLLM tests, demo and benchmark: reads a JSON
job file (model, connector extra config or none, requests), runs them in order, writes a
JSON result (token ids, num_cached_tokens, time to first token, and the worker's connector
counters after each request: SHMKV_VLLM_STATS).  Run as ``python engine_worker.py JOB.json
OUT.json`` from any directory."""
from __future__ import annotations

import json
import os
import sys
import time


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def main(job_path: str, out_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_space_gib", 1)))
    stats_file = out_path + ".connector.json"
    os.environ["SHMKV_VLLM_STATS"] = stats_file     # the worker's connector counters
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if job.get("block_size"):
        kw["block_size"] = int(job["block_size"])
    if job.get("extra") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ShmkvConnector",
            kv_connector_module_path="shmkv.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=job["extra"])
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], enforce_eager=True, dtype="float32",
              max_model_len=job.get("max_model_len", 4096), max_num_seqs=2,
              enable_prefix_caching=job.get("prefix_caching", True), seed=0, **kw)
    started = time.perf_counter() - t0
    results: list = []

    def dump() -> None:
        with open(out_path + ".tmp", "w") as f:
            json.dump({"results": results, "start_seconds": started}, f)
        os.replace(out_path + ".tmp", out_path)

    for req in job["requests"]:
        if "continue_from" in req:       # the next turn of a chat: previous prompt + answer
            prev = results[req["continue_from"]]
            req["prompt_ids"] = prev["prompt_ids"] + prev["token_ids"] + req["suffix_ids"]
        sp = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"],
                            ignore_eos=req.get("ignore_eos", False))
        prompt = {"prompt_token_ids": req["prompt_ids"]}
        if req.get("cache_salt"):
            prompt["cache_salt"] = req["cache_salt"]
        # time to first token: a 1-token request on the same prompt, then the real one
        ttft = None
        if req.get("ttft"):
            t = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1),
                         use_tqdm=False)
            ttft = time.perf_counter() - t
        t = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        results.append({"token_ids": list(out.outputs[0].token_ids),
                        "text": out.outputs[0].text,
                        "num_cached_tokens": out.num_cached_tokens,
                        "prompt_ids": req["prompt_ids"],
                        "ttft": ttft, "seconds": time.perf_counter() - t,
                        "connector": _read(stats_file)})
        dump()              # after each request: a later one may kill this engine
    dump()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
