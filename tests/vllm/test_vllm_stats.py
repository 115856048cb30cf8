"""The connector's statistics and events containers, against vLLM's own interfaces (no
engine: the serve tests read them off a live instance's /metrics and event stream)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")


def test_stats_add_up_keep_the_newest_gauges_and_reduce():
    from shmkv.integrations.vllm import ShmkvConnector
    from shmkv.integrations.vllm.stats import ShmkvConnectorStats

    a = ShmkvConnectorStats()
    assert a.is_empty()
    a.count("loaded_tokens", 128)
    a.observe("load_seconds", 0.002)
    a.set_gauges({"usage_perc": 0.25, "blocks": 100})
    b = ShmkvConnector.build_kv_connector_stats(data=a.to_dict())     # across processes
    assert isinstance(b, ShmkvConnectorStats) and not b.is_empty()
    c = ShmkvConnectorStats()
    c.count("loaded_tokens", 64)
    c.count("lookups")
    c.observe("load_seconds", 0.004)
    c.set_gauges({"usage_perc": 0.5})
    b.aggregate(c)
    assert b.data["c"] == {"loaded_tokens": 192, "lookups": 1}
    assert b.data["h"]["load_seconds"] == [0.002, 0.004]
    assert b.data["g"] == {"usage_perc": 0.5, "blocks": 100}
    assert b.reduce() == {"loaded_tokens": 192, "lookups": 1, "load_ms_avg": 3.0,
                          "segment_usage": 0.5}
    assert b.aggregate(ShmkvConnectorStats()) is b
    assert ShmkvConnector.build_kv_connector_stats().is_empty()


def test_prometheus_metrics_follow_vllms_names_and_labels():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from shmkv.integrations.vllm.stats import COUNTERS, GAUGES, ShmkvPromMetrics

    reg = CollectorRegistry()

    def bound(cls):
        class M(cls):
            def __init__(self, *a, **kw):
                kw.pop("multiprocess_mode", None)
                super().__init__(*a, registry=reg, **kw)
        return M

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    cfg = SimpleNamespace(kv_transfer_config=None)
    prom = ShmkvPromMetrics(cfg, types, ["model_name", "engine"],
                            {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe({"c": {"loaded_tokens": 256, "lookups": 2}, "g": {"usage_perc": 0.75},
                  "h": {"save_seconds": [0.001, 0.2]}}, engine_idx=1)
    prom.observe({"c": {"loaded_tokens": 16, "bogus": 5}, "g": {}, "h": {}}, engine_idx=1)
    lab = {"model_name": "m", "engine": "1"}
    get = reg.get_sample_value
    assert get("vllm:shmkv_loaded_tokens_total", lab) == 272
    assert get("vllm:shmkv_lookups_total", lab) == 2
    assert get("vllm:shmkv_segment_usage_perc", lab) == 0.75
    assert get("vllm:shmkv_save_seconds_count", lab) == 2
    assert get("vllm:shmkv_save_seconds_bucket", {**lab, "le": "0.001"}) == 1
    assert get("vllm:shmkv_loaded_tokens_total", {"model_name": "m", "engine": "0"}) is None
    names = {m.name for m in reg.collect()}
    assert {f"vllm:shmkv_{k}" for k in COUNTERS} <= names
    assert {f"vllm:shmkv_segment_{k}" for k in GAUGES} <= names


def test_events_are_published_once_every_worker_reported_them():
    from vllm.distributed.kv_events import BlockStored

    from shmkv.integrations.vllm.events import MEDIUM_SHARED, ShmkvKVEvents, stored_event

    e1 = stored_event([11, 12], None, list(range(256)), 128, "seg", None)
    e2 = stored_event([13], 12, list(range(256, 384)), 128, "seg", "lora-a")
    assert isinstance(e1, BlockStored) and e1.medium == MEDIUM_SHARED
    assert e1.ownership == "shmkv:seg" and e2.lora_name == "lora-a"
    w0, w1 = ShmkvKVEvents(), ShmkvKVEvents()
    w0.add_events([e1, e2])
    w1.add_events([e1])
    w0.add_events(w1.get_all_events())
    w0.increment_workers(1)                     # as vLLM's KVOutputAggregator does
    assert w0.get_number_of_workers() == 2
    assert w0.pop_common_events() == [e1]       # e2: only one rank wrote its slice
    assert w0.get_all_events() == [e2]
    with pytest.raises(ValueError, match="num_workers"):
        ShmkvKVEvents(0)
