"""A cache never stops the engine: whatever the host holds under the segment's
name or in /dev/shm -- no room for the segment, another model's or another version's
segment, another user's -- the connector turns itself off with one warning naming the
cause and the fix, and vLLM serves as it does without it.  (Mistakes in the connector's own
configuration are still refused at start: see test_vllm_trust.py, test_vllm_tier.py.)
Without vLLM these tests skip (conftest.py)."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest
from configs_helpers import engine_config, model_dir, prompt_ids, run_engines, unlink

import shmkv

NOBODY = 65534
# SmolLM2-135M's layout, float32 (engine_config's dtype), a small pool
FITS = shmkv.CacheConfig(num_layers=30, num_kv_heads=3, head_dim=64, num_blocks=16,
                         block_size=16, dtype="float32")


def _unique(tag: str) -> str:
    return f"shmkv-test-{tag}-{os.getpid()}-{os.urandom(3).hex()}"


def _connector(seg: str, role_name: str):
    """(a connector of `role_name` on `seg`, the messages it logged) -- read from its own
    logger: vLLM's logging does not propagate to the root logger pytest captures."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from shmkv.integrations.vllm import ShmkvConnector

    cfg = engine_config(model_dir(), seg, dtype="float32")
    got: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    lg, h = logging.getLogger("vllm.shmkv"), Keep(logging.INFO)
    lg.addHandler(h)
    level = lg.level
    lg.setLevel(logging.INFO)
    try:
        c = ShmkvConnector(cfg, getattr(KVConnectorRole, role_name), None)
    finally:
        lg.removeHandler(h)
        lg.setLevel(level)
    return c, got


@pytest.mark.parametrize("role_name", ["SCHEDULER", "WORKER"])
def test_another_models_segment_turns_the_connector_off(role_name):
    seg = _unique("vllm-other-model")
    wrong = shmkv.CacheConfig(num_layers=30, num_kv_heads=3, head_dim=32, num_blocks=16,
                              block_size=16, dtype="float32")
    kv = shmkv.KVCache.create(seg, wrong)
    try:
        c, logged = _connector(seg, role_name)
        assert c._half._kv is None and not c._half._save_on and not c._half._load_on
        msgs = [m for m in logged if "connector is OFF" in m]
        assert len(msgs) == 1, msgs
        assert "does not fit this model" in msgs[0]
        assert "(30, 3, 32, 'float32')" in msgs[0] and "(30, 3, 64, 'float32')" in msgs[0]
        assert f"shmkv rm {seg}" in msgs[0]                   # the fix
        assert kv.stats()["num_processes"] == 1               # it detached
        # the scheduler's half answers "no hit" and plans nothing
        if role_name == "SCHEDULER":
            class R:
                request_id, prompt_token_ids, num_tokens = "r", list(range(300)), 300
                cache_salt = lora_request = None
            assert c.get_num_new_matched_tokens(R(), 0) == (0, False)
    finally:
        kv.unlink()
        kv.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's file needs root")
def test_another_users_segment_turns_the_connector_off():
    seg = _unique("vllm-squatted")
    kv = shmkv.KVCache.create(seg, FITS, mode=0o666)
    kv.close()
    os.chown(f"/dev/shm/{seg}", NOBODY, NOBODY)
    try:
        c, logged = _connector(seg, "SCHEDULER")
        assert c._half._kv is None and not c._half._save_on and not c._half._load_on
        (msg,) = [m for m in logged if "connector is OFF" in m]
        assert "UntrustedSegmentError" in msg and "nobody (uid 65534)" in msg
        assert "trusted_owners" in msg                        # the fix
    finally:
        os.unlink(f"/dev/shm/{seg}")


def test_a_worker_whose_half_is_off_recomputes_what_the_scheduler_planned():
    """The scheduler's half may be on where a worker's is off (it opened the segment a
    moment earlier): a planned load is reported failed, so vLLM recomputes it."""
    from types import SimpleNamespace

    import numpy as np

    from shmkv.integrations.vllm.common import Settings
    from shmkv.integrations.vllm.metadata import LoadOp
    from shmkv.integrations.vllm.worker import ShmkvWorker

    settings = Settings(vb=128, model_id="m", save=True, load=True, pending=True,
                        pending_wait=30, pending_stall=2, pending_ttl=120,
                        pending_lock_timeout=0.05, lock_timeout=0.1, events=False)
    w = ShmkvWorker(SimpleNamespace(), settings, None, None, None, None)   # no segment
    w._load(LoadOp(req_id="r", tokens=np.arange(300, dtype=np.int32), salt="s", start=0,
                   end=256, block_ids=[7, 9], hashes=None, lora_name=None))
    assert w.get_block_ids_with_load_errors() == {7, 9}
    assert w.stats["load_shortfall_tokens"] == 256 and "r" in w._short_reqs


def test_no_room_in_dev_shm_the_engine_serves_without_the_connector(tmp_path):
    """vLLM in a mount namespace whose /dev/shm (a 320 MiB tmpfs) holds vLLM's own buffers
    but not the connector's 1 GiB segment: the engine starts and answers what the same
    engine without the connector answers (vLLM's default dtype: bfloat16 on CPU)."""
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare --mount (a /dev/shm of the test's own size)")
    model = model_dir()
    seg = _unique("vllm-noroom")
    reqs = [{"prompt_ids": prompt_ids(model, 3000, 300), "max_tokens": 12},
            {"prompt_ids": prompt_ids(model, 3000, 300), "max_tokens": 12}]
    small = {"shm_mib": 320}
    (rca, ra, loga), (rcb, rb, logb) = run_engines(
        tmp_path,
        ("A", {"model": model, "extra": {"segment": seg, "size_gib": 1}, "requests": reqs},
         small),
        ("B", {"model": model, "extra": None, "requests": reqs}, small))
    assert rcb == 0, logb[-3000:]
    assert rca == 0, loga[-4000:]
    assert "dtype=torch.bfloat16" in loga or "bfloat16" in loga
    off = [ln for ln in loga.splitlines() if "connector is OFF" in ln]
    assert off and all("No space left on device" in ln for ln in off), loga[-4000:]
    assert "Fix: give /dev/shm more room" in off[0]
    assert [r["token_ids"] for r in ra["results"]] == [r["token_ids"] for r in rb["results"]]
    assert len(ra["results"]) == 2 and len(ra["results"][0]["token_ids"]) == 12
    assert not os.path.exists(f"/dev/shm/{seg}")       # (it was never the host's)
    unlink(seg)


def test_the_connector_is_a_best_effort_cache_for_preemption():
    """vLLM 0.32 asks a kv_both connector whether a preempted request's hand-off must be
    delivered (default True: its output dropped and recomputed).  A save here is made
    inside its step, so nothing is in flight at a preemption: False."""
    seg = _unique("vllm-delivery")
    kv = shmkv.KVCache.create(seg, FITS)
    try:
        c, _ = _connector(seg, "SCHEDULER")
        assert c._half._kv is not None and c.requires_kv_delivery is False
        c._half._kv.close()
    finally:
        kv.unlink()
        kv.close()
