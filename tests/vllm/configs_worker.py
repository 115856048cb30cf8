"""One vLLM engine in its own process for test_vllm_configs.py (issue 33): like
engine_worker.py, with the engine options the configurations need (dtype, kv_cache_dtype,
tensor_parallel_size, block_size) and greedy requests given as token ids.  Writes, after
each request, a JSON result (token ids, num_cached_tokens, the worker connectors' counters
per rank: SHMKV_VLLM_STATS).  Run as ``python configs_worker.py JOB.json OUT.json``."""
from __future__ import annotations

import json
import os
import sys


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
    os.environ["SHMKV_VLLM_STATS"] = stats_file
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = dict(job.get("engine", {}))
    if job.get("extra") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ShmkvConnector",
            kv_connector_module_path="shmkv.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=job["extra"])
    llm = LLM(model=job["model"], enforce_eager=True, max_num_seqs=2, seed=0,
              max_model_len=job.get("max_model_len", 2048), **kw)
    results: list = []

    def dump() -> None:
        with open(out_path + ".tmp", "w") as f:
            json.dump({"results": results}, f)
        os.replace(out_path + ".tmp", out_path)

    for req in job["requests"]:
        sp = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"],
                            ignore_eos=req.get("ignore_eos", True))
        prompt = {"prompt_token_ids": req["prompt_ids"]}
        if req.get("cache_salt"):
            prompt["cache_salt"] = req["cache_salt"]
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        results.append({"token_ids": list(out.outputs[0].token_ids),
                        "num_cached_tokens": out.num_cached_tokens,
                        "connector": _read(stats_file)})
        dump()
    dump()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
