"""The remote tier through the vLLM connector (a Redis Cluster this module starts from
Debian's redis-server on free loopback ports, two segments standing for two hosts):

* the scheduler side alone (no engine): a request whose prefix only the tier holds is
  answered "not yet" (None) while a background thread lands the tier's blocks in the
  segment, then as a hit; a tier that hangs is given up on, one that is down is a miss;
* real engines, one at a time: engine A on host A's segment writes its blocks through;
  engine C on host C's own, empty segment gets them from the tier: C's num_cached_tokens
  covers A's full blocks, C's output equals A's (computed with no hit), and the K/V that
  landed in C's segment equal transformers' own."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from support import unique_name
from vllm_helpers import SB, VB, _model_dir, _prompts, _run_engine, expected_hit

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False

if os.environ.get("CI"):
    import redis  # noqa: F401   (CI: a missing client or server is a failure)
else:
    redis = pytest.importorskip("redis")
from shmkv.tier.cluster import free_ports, redis_available  # noqa: E402

if os.environ.get("CI") and not redis_available():
    raise RuntimeError("CI: redis-server is missing (make redis installs it)")
pytestmark = pytest.mark.skipif(not redis_available(),
                                reason="redis-server missing (make redis installs it)")


@pytest.fixture
def segments():
    """new(name_tag) -> a fresh segment name, unlinked at teardown."""
    import shmkv

    names: list[str] = []

    def new(tag: str) -> str:
        names.append(unique_name(tag))
        return names[-1]

    try:
        yield new
    finally:
        for n in names:
            try:
                shmkv.KVCache.attach(n).unlink()
            except Exception:
                pass


def _engine_config(extra: dict):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=_model_dir(), dtype="float32", enforce_eager=True,
                      max_model_len=2048, kv_transfer_config=KVTransferConfig(
                          kv_connector="ShmkvConnector",
                          kv_connector_module_path="shmkv.integrations.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config=extra)).create_engine_config()


def _request(rid: str, ids: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, list(ids), SamplingParams(max_tokens=1), None)


def _host_a_writes(cfg, tier_url: str, ids: np.ndarray, salt: str, name: str):
    """Host A: a segment of the same layout and seed computes `ids` (random K/V) and
    writes its full blocks through to the tier.  Returns (K, V) of those blocks."""
    import shmkv
    from shmkv.integrations.vllm.tier import DEFAULT_TIER_SEED

    a = shmkv.KVCache.create(name, cfg, hash_seed=DEFAULT_TIER_SEED)
    try:
        a.set_tier(shmkv.RedisTier(tier_url, cluster=True, timeout=1.0))
        n = (len(ids) - 1) // cfg.block_size * cfg.block_size
        rng = np.random.default_rng(7)
        shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
        k = rng.standard_normal(shape, dtype=np.float32)
        v = rng.standard_normal(shape, dtype=np.float32)
        sid = a.create_sequence(tokens=ids, salt=salt)
        a.append(sid, k, v, tokens=ids[:n])
        assert a.flush_tier(30) == n // cfg.block_size
        a.free(sid)
        return k, v
    finally:
        a.unlink()
        a.close()


def _ask(conn, req, timeout: float = 30.0) -> tuple[list, int]:
    """Calls get_num_new_matched_tokens as vLLM's scheduler does, once per 'step', until it
    stops answering None.  Returns (every answer, the final count)."""
    answers = []
    deadline = time.monotonic() + timeout
    while True:
        n, is_async = conn.get_num_new_matched_tokens(req, 0)
        assert is_async is False
        answers.append(n)
        if n is not None or time.monotonic() > deadline:
            return answers, n
        time.sleep(0.01)


def test_scheduler_asks_the_tier_in_the_background(cluster, segments):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    import shmkv
    from shmkv.integrations.vllm import ShmkvConnector, request_salt

    cluster.flushall()
    seg = segments("vtier-sched")
    extra = {"segment": seg, "num_blocks": 64, "tier": cluster.url}
    cfg = _engine_config(extra)
    conn = ShmkvConnector(cfg, KVConnectorRole.SCHEDULER, None)
    try:
        salt = request_salt(conn.connector_scheduler._model_id)
        rng = np.random.default_rng(1)
        ids = rng.integers(10, 40000, size=3 * VB + 20).astype(np.int32)
        bs = conn.connector_scheduler._kv.config.block_size
        full = (len(ids) - 1) // bs * bs
        assert full % VB != 0                      # the hit ends inside a vLLM block
        k, v = _host_a_writes(conn.connector_scheduler._kv.config, cluster.url, ids, salt,
                              segments("vtier-a"))
        answers, n = _ask(conn, _request("r1", ids))
        assert answers[0] is None                  # the scheduler loop did not wait
        assert n == full                           # then: every full block, from the tier
        # they are in this host's segment now, for every process: K/V as host A wrote them
        kv = shmkv.KVCache.attach(seg)
        try:
            sid = kv.create_sequence(tokens=ids, salt=salt)
            assert kv.seq_len(sid) == full
            kb, vb = kv.gather(sid)
            assert np.array_equal(kb, k) and np.array_equal(vb, v)
            kv.free(sid)
            assert kv.stats()["tier_hits"] == full // bs
            assert kv.check() == []
        finally:
            kv.close()
        # a second request on the same prefix: a local hit, no tier lookup at all
        answers, n = _ask(conn, _request("r2", ids))
        assert answers == [full]
        assert conn.connector_scheduler._lookups.stats["lookups"] == 1
        # a prompt nobody has: one lookup, a miss, then 0
        other = rng.integers(10, 40000, size=2 * VB + 5).astype(np.int32)
        answers, n = _ask(conn, _request("r3", other))
        assert answers[0] is None and n == 0
        # a salted tenant never sees another's blocks
        req = _request("r4", ids)
        req.cache_salt = "tenant-b"
        assert _ask(conn, req)[1] == 0
    finally:
        conn.shutdown()


def test_a_hung_tier_is_given_up_and_a_down_tier_is_a_miss(cluster, segments):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from shmkv.integrations.vllm import ShmkvConnector

    cluster.flushall()
    rng = np.random.default_rng(2)
    ids = rng.integers(10, 40000, size=2 * VB + 3).astype(np.int32)
    # every master stopped: reads hang until their socket timeout (3 s), the scheduler
    # gives up after tier_wait (0.2 s) and goes on with the local hit
    conn = ShmkvConnector(_engine_config({
        "segment": segments("vtier-hung"), "num_blocks": 8, "tier": cluster.url,
        "tier_timeout": 3.0, "tier_wait": 0.2}), KVConnectorRole.SCHEDULER, None)
    pids = [cluster.pid(i) for i in range(len(cluster.ports))]
    try:
        for p in pids:
            os.kill(p, signal.SIGSTOP)
        try:
            answers, n = _ask(conn, _request("h1", ids))
        finally:
            for p in pids:
                os.kill(p, signal.SIGCONT)
        assert answers[0] is None and n == 0
        assert conn.connector_scheduler._lookups.stats["given_up"] == 1
    finally:
        conn.shutdown()
    # nothing listens on this port: a counted miss, never an error
    port = free_ports(1)[0]
    conn = ShmkvConnector(_engine_config({
        "segment": segments("vtier-down"), "num_blocks": 8,
        "tier": f"redis://127.0.0.1:{port}", "tier_timeout": 0.3}),
        KVConnectorRole.SCHEDULER, None)
    try:
        answers, n = _ask(conn, _request("d1", ids))
        assert answers[0] is None and n == 0
        assert conn.connector_scheduler._kv.stats()["tier_errors"] >= 1
    finally:
        conn.shutdown()


def test_bad_tier_config_is_refused(segments):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from shmkv.integrations.vllm import ShmkvConnector

    for bad, match in (({"tier": "http://x:1"}, "redis://"),
                       ({"tier": "redis://127.0.0.1:1", "tier_wait": 0}, "tier_wait")):
        with pytest.raises(ValueError, match=match):
            ShmkvConnector(_engine_config({"segment": segments("vtier-bad"), **bad}),
                           KVConnectorRole.SCHEDULER, None)


@pytest.fixture(scope="module")
def two_hosts(cluster, tmp_path_factory):
    """Engine A on segment A, then engine C on its own empty segment, one tier."""
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    import shmkv
    from shmkv.integrations.vllm import request_salt

    cluster.flushall()
    tmp = tmp_path_factory.mktemp("vtier")
    model = _model_dir()
    P = _prompts(model)
    seg_a, seg_c = unique_name("vtier-A"), unique_name("vtier-C")
    job = {"model": model, "requests": [{"prompt_ids": P["p1"], "max_tokens": 32}]}
    try:
        rcA, rA = _run_engine(tmp, "A", {**job, "extra": {
            "segment": seg_a, "size_gib": 0.25, "tier": cluster.url}})
        assert rcA == 0, (tmp / "A.log").read_text()[-3000:]
        rcC, rC = _run_engine(tmp, "C", {**job, "extra": {
            "segment": seg_c, "size_gib": 0.25, "tier": cluster.url}})
        assert rcC == 0, (tmp / "C.log").read_text()[-3000:]
        kv = shmkv.KVCache.attach(seg_c)
        try:
            sid = kv.create_sequence(tokens=P["p1"] + [0], salt=request_salt(model))
            landed = (kv.seq_len(sid), *kv.gather(sid))
            kv.free(sid)
            c_stats, c_check = kv.stats(), kv.check()
        finally:
            kv.close()
        yield {"P": P, "model": model, "A": rA["results"], "C": rC["results"],
               "landed": landed, "c_stats": c_stats, "c_check": c_check}
    finally:
        for seg in (seg_a, seg_c):
            try:
                shmkv.KVCache.attach(seg).unlink()
            except Exception:
                pass


def test_engine_on_another_host_hits_through_the_tier(two_hosts):
    P, A, C = two_hosts["P"], two_hosts["A"], two_hosts["C"]
    full = expected_hit(len(P["p1"]), 32)
    assert A[0]["num_cached_tokens"] == 0                 # A computed it all
    assert C[0]["num_cached_tokens"] == full >= 896       # C loaded all of it via the tier
    assert C[0]["token_ids"] == A[0]["token_ids"]
    st = two_hosts["c_stats"]
    assert st["tier_hits"] == full // SB and st["tier_errors"] == 0
    assert two_hosts["c_check"] == []


def test_tier_blocks_equal_transformers(two_hosts):
    """What landed in C's segment from the tier is the model's K/V, not just A's bytes."""
    import torch
    from transformers import AutoModelForCausalLM

    n, k, v = two_hosts["landed"]
    ids = two_hosts["P"]["p1"]
    assert n >= (len(ids) - 1) // VB * VB
    model = AutoModelForCausalLM.from_pretrained(two_hosts["model"], dtype=torch.float32,
                                                 attn_implementation="sdpa")
    with torch.no_grad():
        pkv = model(torch.tensor([ids[:n]]), use_cache=True).past_key_values
    for layer in range(k.shape[0]):
        np.testing.assert_allclose(k[layer], pkv.layers[layer].keys[0].permute(1, 0, 2).numpy(),
                                   atol=1e-4, rtol=1e-4, err_msg=f"K of layer {layer}")
        np.testing.assert_allclose(v[layer],
                                   pkv.layers[layer].values[0].permute(1, 0, 2).numpy(),
                                   atol=1e-4, rtol=1e-4, err_msg=f"V of layer {layer}")
