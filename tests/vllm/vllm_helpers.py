"""What the vLLM tests share: the real model's directory, the prompts (a chat template over
the GPL's text: ~1k-token prompts), and one engine run in its own process group
(engine_worker.py), killed with its children whatever happens."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
from serve_helpers import run_group

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False
# a module's pytestmark where every test needs vLLM (the venv of make test-vllm-deps)
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")

WORKER = Path(__file__).with_name("engine_worker.py")
VB = 128                          # vLLM's block size on CPU
SB = 16                           # the connector's default shmkv block size (divides VB)


def expected_hit(prompt_len: int, a_generated: int) -> int:
    """Tokens of a prompt another engine can load after engine A ran it with `a_generated`
    tokens out: A saved the whole vLLM blocks it computed (the KV of all but its last
    generated token), and a hit ends at a shmkv block before the prompt's last token."""
    return min((prompt_len + a_generated - 1) // VB * VB, (prompt_len - 1) // SB * SB)
FAULT = {"overclaim": "t:fault:overclaim", "reset": "t:fault:reset_before_load",
         "kill": "t:fault:kill_mid_save"}
ENGINE_TIMEOUT = 900


def _model_dir() -> str:
    from shmkv.models import smollm2_dir

    return str(smollm2_dir())


def _run_engine(tmp: Path, tag: str, job: dict, fault: bool = False,
                core: Optional[int] = None) -> tuple[int, dict]:
    """(exit code, results) of one engine running `job` (engine_worker.py); `core`: pinned
    there, vLLM's OpenMP threads with it (serve_helpers.side_by_side)."""
    jp, op = tmp / f"{tag}.json", tmp / f"{tag}.out.json"
    jp.write_text(json.dumps(job))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    if fault:
        env["SHMKV_VLLM_FAULT"] = "1"
    cmd = [sys.executable, str(WORKER), str(jp), str(op)]
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    with open(tmp / f"{tag}.log", "w") as log:
        p = subprocess.Popen(cmd, cwd="/tmp", env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        rc = run_group(p, ENGINE_TIMEOUT)    # and removes what vLLM left in /dev/shm
    out = json.loads(op.read_text()) if op.exists() else {"results": []}
    return rc, out


def _prompts(model: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = Path("/usr/share/common-licenses/GPL-3").read_text()

    def chat(system: str, user: str) -> list[int]:
        ids = tok.apply_chat_template([{"role": "system", "content": system},
                                       {"role": "user", "content": user}],
                                      add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def plain(s: str) -> list[int]:
        return list(tok.encode(s, add_special_tokens=False))

    p1 = chat("You are a careful lawyer. Here is the licence:\n" + text[:4400],
              "Summarize the licence in one sentence.")
    p2 = chat("Read this:\n" + text[9000:10800], "What does it say?")
    return {
        "p1": p1,
        "turn1": chat("You are a helpful assistant.",
                      "Tell me a long story about a lighthouse keeper and his cat."),
        "suffix": plain("<|im_end|>\n<|im_start|>user\nNow tell me how it ends."
                        "<|im_end|>\n<|im_start|>assistant\n"),
        "p2": p2,
        "p2ext": p2 + plain(text[20000:21500]),
        "p2r": chat("Read this too:\n" + text[12000:13800], "What does it say?"),
        "p3": chat("And this:\n" + text[15000:16800], "What does it say?"),
    }


# ------------------------------------------- a connector worker driven as vLLM's runner
@contextlib.contextmanager
def runner_worker(seg: str) -> Iterator[tuple[Any, list[str], str]]:
    """(a WORKER-role ShmkvConnector on a new segment ``seg`` for the real model's config,
    its attention layers' names, the model's path), registered with real bfloat16 KV
    tensors of 8 vLLM blocks; shut down and the segment unlinked afterwards."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    import shmkv
    from shmkv.integrations.vllm import ShmkvConnector

    path = _model_dir()
    cfg = EngineArgs(model=path, dtype="bfloat16", enforce_eager=True, max_model_len=1024,
                     block_size=VB, kv_transfer_config=KVTransferConfig(
                         kv_connector="ShmkvConnector",
                         kv_connector_module_path="shmkv.integrations.vllm",
                         kv_role="kv_both", kv_load_failure_policy="recompute",
                         kv_connector_extra_config={"segment": seg, "num_blocks": 256})
                     ).create_engine_config()
    w = None
    try:
        w = ShmkvConnector(cfg, KVConnectorRole.WORKER, None)
        kvc = w.connector_worker._kv.config
        names = [f"model.layers.{i}.self_attn.attn" for i in range(kvc.num_layers)]
        g = torch.Generator().manual_seed(3)
        tensors = {n: torch.randn(8, kvc.num_kv_heads, VB, 2 * kvc.head_dim,
                                  generator=g).to(torch.bfloat16) for n in names}
        w.register_kv_caches(tensors)
        assert w.connector_worker._layout is not None
        yield w, names, path
    finally:
        if w is not None:
            w.shutdown()
        try:
            shmkv.KVCache.attach(seg).unlink()
        except FileNotFoundError:
            pass


def runner_step(w: Any, names: list[str], saves: list, layers_done: int,
                raise_exc: Optional[BaseException] = None, loads: Optional[list] = None):
    """One step as vLLM's runner makes it: metadata bound, the loads (start_load_kv),
    save_kv_layer after each layer that ran, wait_for_save in the finally (with the
    forward's exception in flight)."""
    from shmkv.integrations.vllm.connector import ShmkvConnectorMetadata

    w.bind_connector_metadata(ShmkvConnectorMetadata(saves=saves, loads=loads or []))
    try:
        try:
            w.start_load_kv(None)
            for n in names[:layers_done]:
                w.save_kv_layer(n, None, None)
            if raise_exc is not None:
                raise raise_exc
        finally:
            w.wait_for_save()
            w.clear_connector_metadata()
    except BaseException as e:
        if e is not raise_exc:
            raise
