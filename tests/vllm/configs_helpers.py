"""What the tests of vLLM CPU's configurations share (test_vllm_fp8.py, test_vllm_tp.py,
test_vllm_shared_hf.py, ...): one engine run in its own process group through
configs_worker.py, killed with its children whatever happens, vLLM's own /dev/shm/psm_*
files of an engine that had to be killed removed (only new ones no live process maps);
prompts from SmolLM2's tokenizer; the engine-config builder for in-process connectors."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from serve_helpers import run_group, side_by_side

WORKER = Path(__file__).with_name("configs_worker.py")
ENGINE_TIMEOUT = 900


def run_engine(tmp: Path, tag: str, job: dict, env_extra: dict | None = None,
               cpus: str | None = None, shm_mib: int | None = None) -> tuple[int, dict, str]:
    """(exit code, results, log) of one engine running `job` (configs_worker.py); `cpus`:
    pinned there (and vLLM's OpenMP threads with it); `shm_mib`: in a mount namespace of
    its own whose /dev/shm is a tmpfs of that size (gone with the engine)."""
    jp, op = tmp / f"{tag}.json", tmp / f"{tag}.out.json"
    jp.write_text(json.dumps(job))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               **(env_extra or {}))
    cmd = [sys.executable, str(WORKER), str(jp), str(op)]
    if shm_mib:
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               f'mount -t tmpfs -o size={int(shm_mib)}m shmkv-test /dev/shm && exec "$@"',
               "sh", *cmd]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpus)
    with open(tmp / f"{tag}.log", "w") as log:
        p = subprocess.Popen(cmd, cwd="/tmp", env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        # (and removes what vLLM left in /dev/shm)
        rc = run_group(p, ENGINE_TIMEOUT, own_shm=bool(shm_mib))
    out = json.loads(op.read_text()) if op.exists() else {"results": []}
    return rc, out, (tmp / f"{tag}.log").read_text(errors="replace")


def run_engines(tmp: Path, *runs: tuple) -> list[tuple[int, dict, str]]:
    """Independent engines side by side (serve_helpers.side_by_side), each pinned to a
    core of its own.  Each run is ``(tag, job)`` or ``(tag, job, run_engine keywords)``;
    results in the same order."""
    def call(run: tuple):
        tag, job, *kw = run
        return lambda core: run_engine(tmp, tag, job, **{
            **({"cpus": str(core)} if core is not None else {}), **(kw[0] if kw else {})})

    return side_by_side(*(call(r) for r in runs))


def tiny_llama(path: Path, seed: int = 33) -> str:
    """A seeded tiny Llama (2 layers, 4 query / 2 KV heads, head_dim 32, random weights,
    SmolLM2's tokenizer) saved into `path`: no hub, an engine starts in seconds."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(model_dir())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      initializer_range=0.1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def model_dir() -> str:
    from shmkv.models import smollm2_dir

    return str(smollm2_dir())


GEMMA3_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def tiny_gemma3(path) -> str:
    """A seeded tiny Gemma 3 (sliding 64 / full / sliding / full, 4 q / 2 kv heads, head_dim
    32, untied embeddings, SmolLM2's tokenizer) saved at ``path`` (test_vllm_hybrid.py and
    tools/repro_gemma3_zeros.py)."""
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tok = AutoTokenizer.from_pretrained(model_dir())
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, sliding_window=64, layer_types=GEMMA3_LAYER_TYPES,
                           max_position_embeddings=2048, initializer_range=0.1,
                           tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, pad_token_id=0)
    torch.manual_seed(33)
    Gemma3ForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def prompt_ids(model: str, start: int, n: int) -> list[int]:
    """`n` token ids of Debian's GPL-3 text from character `start` (distinct starts give
    prompts with no common prefix)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = Path("/usr/share/common-licenses/GPL-3").read_text()
    ids = tok.encode(text[start:start + 8 * n], add_special_tokens=False)[:n]
    assert len(ids) == n, (n, len(ids))
    return list(ids)


def engine_config(model: str, segment: str, **engine):
    """A VllmConfig with the connector on `segment` (in-process connector tests)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    engine.setdefault("enforce_eager", True)
    engine.setdefault("max_model_len", 1024)
    return EngineArgs(model=model, kv_transfer_config=KVTransferConfig(
        kv_connector="ShmkvConnector", kv_connector_module_path="shmkv.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"segment": segment}), **engine).create_engine_config()


def unlink(seg: str) -> None:
    import shmkv

    try:
        shmkv.KVCache.attach(seg).unlink()
    except FileNotFoundError:
        pass
