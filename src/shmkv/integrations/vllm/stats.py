"""The connector's figures in vLLM's own statistics: ``ShmkvConnectorStats`` travels from the
worker and the scheduler to vLLM's front end each step (``get_kv_connector_stats`` /
``build_kv_connector_stats``), where ``ShmkvPromMetrics`` (``build_prom_metrics``) puts them
on the instance's ``/metrics`` and vLLM's periodic "KV Transfer metrics" log line shows
``reduce()``.

Per instance (counters and histograms, vLLM's ``model_name``/``engine`` labels):

=================================================  ==========================================
``vllm:shmkv_loaded_tokens_total``                  tokens loaded from the segment
``vllm:shmkv_loaded_blocks_total``                  shmkv blocks loaded
``vllm:shmkv_saved_tokens_total``                   tokens this instance published
``vllm:shmkv_saved_blocks_total``                   shmkv blocks it published
``vllm:shmkv_load_failures_total``                  loads that fell short (vLLM recomputed)
``vllm:shmkv_load_failed_tokens_total``             tokens those loads did not deliver
``vllm:shmkv_save_errors_total``                    saves that failed (full pool, ...)
``vllm:shmkv_unfinished_saves_total``               saves not made: their step's forward
                                                    did not complete (nothing published)
``vllm:shmkv_lookups_total``                        prefix lookups by the scheduler
``vllm:shmkv_lookup_hit_tokens_total``              tokens those lookups found
``vllm:shmkv_pending_waits_total``                  requests held back because another
                                                    instance was computing their prefix
``vllm:shmkv_pending_timeouts_total``               of those, computed here after the bound
``vllm:shmkv_pending_lock_timeouts_total``          pending-mark operations that found the
                                                    marks' lock held past its bound (answered
                                                    "no marks")
``vllm:shmkv_lock_timeouts_total``                  calls into the segment that found its pool
                                                    lock held past ``lock_timeout`` (or within
                                                    the second after): a miss, a dropped save
``vllm:shmkv_load_seconds``                         one step's loads (histogram)
``vllm:shmkv_save_seconds``                         one step's saves (histogram)
=================================================  ==========================================

Of the segment (gauges, the same for every instance on it; read at most once a second):
``vllm:shmkv_segment_blocks``, ``vllm:shmkv_segment_used_blocks``,
``vllm:shmkv_segment_cached_blocks``, ``vllm:shmkv_segment_usage_perc`` ((used + cached) /
all, 0-1: the segment's fill), ``vllm:shmkv_segment_evicted_blocks`` (cached blocks evicted
since the segment was created), ``vllm:shmkv_segment_reclaimed_blocks`` (blocks recovered
from dead processes since it was created).

Importing this module imports vLLM; nothing here touches the segment.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["COUNTERS", "GAUGES", "ShmkvConnectorStats", "ShmkvPromMetrics", "segment_gauges"]

# counter key -> help text (the metric is vllm:shmkv_<key>_total)
COUNTERS: Mapping[str, str] = {
    "loaded_tokens": "Tokens loaded from the shmkv segment instead of computed.",
    "loaded_blocks": "shmkv blocks loaded from the segment.",
    "saved_tokens": "Tokens this instance published to the shmkv segment.",
    "saved_blocks": "shmkv blocks this instance published to the segment.",
    "load_failures": "Loads from the shmkv segment that fell short (vLLM recomputed them).",
    "load_failed_tokens": "Tokens that loads from the shmkv segment did not deliver.",
    "save_errors": "Saves to the shmkv segment that failed (a full pool, ...).",
    "unfinished_saves": "Saves not made because their step's forward did not complete "
                        "(an exception, a stop): nothing of that step was published.",
    "lookups": "Prefix lookups in the shmkv segment by the scheduler.",
    "lookup_hit_tokens": "Tokens beyond the instance's own cache found in the segment.",
    "pending_waits": "Requests held back while another instance computed their prefix.",
    "pending_timeouts": "Held-back requests computed here after the pending bound.",
    "pending_lock_timeouts": "Pending-mark operations that found the marks' lock held past "
                             "its bound (answered no marks).",
    "lock_timeouts": "Calls into the shmkv segment that found its pool lock held past "
                     "lock_timeout, or within the second after (a miss, a dropped save).",
}
# gauge key -> help text (the metric is vllm:shmkv_segment_<key>)
GAUGES: Mapping[str, str] = {
    "blocks": "Blocks in the shmkv segment's pool.",
    "used_blocks": "Blocks of the shmkv segment referenced by live sequences.",
    "cached_blocks": "Blocks of the shmkv segment held only by its prefix cache "
                     "(evictable).",
    "usage_perc": "Fraction of the shmkv segment's blocks holding K/V: used by sequences "
                  "or held by the prefix cache (0-1).",
    "evicted_blocks": "Cached blocks the shmkv segment evicted since it was created.",
    "reclaimed_blocks": "Blocks recovered from dead processes since the segment was created.",
}
_HISTS = ("load_seconds", "save_seconds")
_BUCKETS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
            2.5]


def segment_gauges(st: Mapping[str, Any]) -> dict[str, float]:
    """The gauges from a segment's ``KVCache.stats()``."""
    n = int(st.get("num_blocks", 0))
    used, cached = int(st.get("used_blocks", 0)), int(st.get("cached_blocks", 0))
    return {"blocks": n, "used_blocks": used, "cached_blocks": cached,
            "usage_perc": (used + cached) / n if n else 0.0,
            "evicted_blocks": int(st.get("cached_blocks_evicted", 0)),
            "reclaimed_blocks": int(st.get("reclaimed_blocks", 0))}


@dataclass
class ShmkvConnectorStats(KVConnectorStats):
    """One interval's figures: ``data`` = ``{"c": {counter: n}, "h": {hist: [seconds]},
    "g": {gauge: value}}`` (plain types: vLLM serializes it between processes).  Counters
    add up, observations concatenate, gauges keep the newest."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:
            for k in ("c", "h", "g"):
                self.data.setdefault(k, {})

    def reset(self) -> None:
        self.data = {"c": {}, "h": {}, "g": {}}

    def count(self, key: str, n: float = 1) -> None:
        c = self.data["c"]
        c[key] = c.get(key, 0) + n

    def observe(self, key: str, seconds: float) -> None:
        self.data["h"].setdefault(key, []).append(float(seconds))

    def set_gauges(self, values: Mapping[str, float]) -> None:
        self.data["g"].update(values)

    def is_empty(self) -> bool:
        d = self.data
        return not (any(d["c"].values()) or any(d["h"].values()) or d["g"])

    def aggregate(self, other: KVConnectorStats) -> "ShmkvConnectorStats":
        if other.is_empty():
            return self
        o = other.data
        for k, v in o.get("c", {}).items():
            self.count(k, v)
        for k, v in o.get("h", {}).items():
            self.data["h"].setdefault(k, []).extend(v)
        self.data["g"].update(o.get("g", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in sorted(self.data["c"].items()) if v}
        for k, v in sorted(self.data["h"].items()):
            if v:
                out[f"{k.replace('_seconds', '')}_ms_avg"] = round(1e3 * sum(v) / len(v), 3)
        if "usage_perc" in self.data["g"]:
            out["segment_usage"] = round(float(self.data["g"]["usage_perc"]), 4)
        return out


class ShmkvPromMetrics(KVConnectorPromMetrics):
    """Registers the connector's metrics (module docstring) in vLLM's Prometheus registry and
    records each interval's :class:`ShmkvConnectorStats` there."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            k: self._counter_cls(name=f"vllm:shmkv_{k}", documentation=doc,
                                 labelnames=labelnames) for k, doc in COUNTERS.items()}
        self._gauges = {
            k: self._gauge_cls(name=f"vllm:shmkv_segment_{k}", documentation=doc,
                               labelnames=labelnames, multiprocess_mode="mostrecent")
            for k, doc in GAUGES.items()}
        self._hists = {
            k: self._histogram_cls(name=f"vllm:shmkv_{k}",
                                   documentation=f"Time of one step's {k.split('_')[0]}s "
                                   "between vLLM's KV cache and the shmkv segment.",
                                   buckets=_BUCKETS, labelnames=labelnames) for k in _HISTS}
        self._bound: dict[int, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {}

    def _for(self, engine_idx: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        if engine_idx not in self._bound:
            lv = self.per_engine_labelvalues[engine_idx]
            self._bound[engine_idx] = (
                {k: m.labels(*lv) for k, m in self._counters.items()},
                {k: m.labels(*lv) for k, m in self._gauges.items()},
                {k: m.labels(*lv) for k, m in self._hists.items()})
        return self._bound[engine_idx]

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        counters, gauges, hists = self._for(engine_idx)
        for k, v in transfer_stats_data.get("c", {}).items():
            if k in counters and v > 0:
                counters[k].inc(v)
        for k, v in transfer_stats_data.get("g", {}).items():
            if k in gauges:
                gauges[k].set(v)
        for k, vs in transfer_stats_data.get("h", {}).items():
            if k in hists:
                for s in vs:
                    hists[k].observe(s)
