"""One vLLM engine in its own process for the configuration tests: like engine_worker.py,
with the engine options the configurations need (dtype, kv_cache_dtype,
tensor_parallel_size, block_size, chunked prefill, ...) and greedy requests given as token
ids.  Writes, after each request, a JSON result (token ids, num_cached_tokens, the worker
connectors' counters per rank: SHMKV_VLLM_STATS).  Run as ``python configs_worker.py
JOB.json OUT.json``.

``job["hook"]`` puts a fault into the model's forward on every rank (fault_hook.py, through
``LLM.apply_model``: the engine needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to send it).
A request with ``"flag": true`` creates the hook's flag file first.  A list in
``job["requests"]`` is a batch: its requests are generated together (one ``generate``
call; results in order).
``job["reset_prefix_cache"]``: vLLM's own prefix cache is emptied after each request or
batch (what a later request finds, it loads from the segment).
``job["stats"]``: ``"engine"`` adds vLLM's own counters after each request or batch
(preemptions among them)."""
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
    if job.get("stats") == "engine":
        kw["disable_log_stats"] = False
    llm = LLM(model=job["model"], enforce_eager=True, seed=0,
              max_num_seqs=job.get("max_num_seqs", 2),
              max_model_len=job.get("max_model_len", 2048), **kw)
    if job.get("hook"):
        import functools

        from fault_hook import install  # by reference: importable on every rank
        llm.apply_model(functools.partial(install, job["hook"]))
    results: list = []

    def dump() -> None:
        with open(out_path + ".tmp", "w") as f:
            json.dump({"results": results}, f)
        os.replace(out_path + ".tmp", out_path)

    # "requests" one at a time; a list in "requests" is a batch, generated together
    for item in job["requests"]:
        batch = item if isinstance(item, list) else [item]
        if any(req.get("flag") for req in batch):
            open(job["hook"]["flag"], "w").close()
        prompts, sps = [], []
        for req in batch:
            sps.append(SamplingParams(temperature=0.0, max_tokens=req["max_tokens"],
                                      ignore_eos=req.get("ignore_eos", True)))
            prompt = {"prompt_token_ids": req["prompt_ids"]}
            if req.get("cache_salt"):
                prompt["cache_salt"] = req["cache_salt"]
            prompts.append(prompt)
        outs = llm.generate(prompts, sps, use_tqdm=False)
        if job.get("reset_prefix_cache"):       # the next hits come from the segment
            llm.reset_prefix_cache()
        engine = ({m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
                  if job.get("stats") == "engine" else {})
        for out in outs:
            results.append({"token_ids": list(out.outputs[0].token_ids),
                            "num_cached_tokens": out.num_cached_tokens,
                            "connector": _read(stats_file), "engine": engine})
        dump()
    dump()

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
