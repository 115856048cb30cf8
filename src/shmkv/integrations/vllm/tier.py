"""The remote tier under the vLLM connector: which tier (extra config or environment), and
the scheduler's tier lookups, which run in a background thread so that the scheduler loop
never waits on the network.

* Worker side: the worker's handle writes what it commits through to the tier
  (``set_tier(tier, read=False)``: its loads and saves stay local, no network in a step).
* Scheduler side: a request whose local hit ends before its last full block is looked up
  in the tier by a thread of the EngineCore process, through a handle of its own
  (``set_tier(tier, write=False)``): ``match_prefix`` there lands the tier's consecutive
  blocks in the segment (published, findable by every process of the host).  Until it is
  done the connector answers ``None`` ("ask again") and vLLM schedules other requests;
  then the local match sees the landed blocks and the worker loads them as any other hit.
  A lookup that outlives ``tier_wait`` seconds is given up on (the request goes on with its
  local hit; what the lookup lands later is a hit for the next request).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import numpy as np

import shmkv

__all__ = ["TierSpec", "tier_spec", "TierLookups", "DEFAULT_TIER_SEED"]

log = logging.getLogger("vllm.shmkv")

# Hosts that share a tier must hash blocks with one seed (it is part of the tier's keys):
# a segment the connector creates with a tier configured gets this one unless the extra
# config ("hash_seed") or $SHMKV_HASH_SEED names another.
DEFAULT_TIER_SEED = 0x73686D6B_766C6C6D           # b"shmkvllm"
DEFAULT_TIER_WAIT = 5.0


@dataclass(frozen=True)
class TierSpec:
    url: str
    cluster: bool
    timeout: float
    wait: float                 # longest a request waits for its lookup, seconds

    def make(self) -> "shmkv.RedisTier":
        # a lookup runs in the background (TierLookups): it may ask for windows as long as
        # a request waits for it
        return shmkv.RedisTier(self.url, cluster=self.cluster, timeout=self.timeout,
                               connect_timeout=min(self.timeout, 0.5), deadline=self.wait)


def _flag(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() not in ("0", "false", "no", "off", "")
    return bool(v)


def tier_spec(extra: Mapping[str, Any]) -> Optional[TierSpec]:
    """The tier of the extra config's ``tier`` (a ``redis://host:port`` URL of any node),
    else of ``$SHMKV_TIER``; None when neither names one.  ``tier_cluster`` (default true:
    a Redis Cluster; false: one server), ``tier_timeout`` (seconds per call, default 1.0),
    ``tier_wait`` (default 5.0)."""
    url = extra.get("tier") or os.environ.get("SHMKV_TIER") or None
    if url is None:
        return None
    if not isinstance(url, str) or not url.startswith("redis://"):
        raise ValueError(f"shmkv: tier: expected a redis://host:port URL, got {url!r}")
    timeout = float(extra.get("tier_timeout", 1.0))
    wait = float(extra.get("tier_wait", DEFAULT_TIER_WAIT))
    if not timeout > 0 or not wait > 0:
        raise ValueError(f"shmkv: tier_timeout and tier_wait: expected > 0, got {timeout}, "
                         f"{wait}")
    return TierSpec(url=url, cluster=_flag(extra.get("tier_cluster", True)), timeout=timeout,
                    wait=wait)


def seed_for(extra: Mapping[str, Any], tier: Optional[TierSpec]) -> Optional[int]:
    """The hash seed a new segment gets: ``hash_seed`` of the extra config, else (with a
    tier) $SHMKV_HASH_SEED or DEFAULT_TIER_SEED, else None (KVCache.create's own rule)."""
    if "hash_seed" in extra:
        v = extra["hash_seed"]
        return int(v, 0) if isinstance(v, str) else int(v)
    if tier is None:
        return None
    env = os.environ.get("SHMKV_HASH_SEED")
    return int(env, 0) if env else DEFAULT_TIER_SEED


class TierLookups:
    """The scheduler's background tier lookups (one thread, one handle of its own)."""

    def __init__(self, segment: str, spec: TierSpec, *,
                 trusted_owners: frozenset = frozenset()) -> None:
        self._spec = spec
        self._kv = shmkv.KVCache.attach(segment, trusted_owners=trusted_owners)
        try:
            self._kv.set_tier(spec.make(), write=False)
        except BaseException:
            self._kv.close()
            raise
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shmkv-tier-lookup")
        self._pending: dict[str, tuple[Future[int], float]] = {}
        self._lock = threading.Lock()
        self.stats = {"lookups": 0, "given_up": 0, "failed": 0}

    def _lookup(self, ids: np.ndarray, salt: str) -> int:
        return int(self._kv.match_prefix(ids, salt))

    def ready(self, req_id: str, ids: np.ndarray, salt: str) -> bool:
        """Starts the request's lookup on the first call; False while it runs, True once it
        is done, failed or given up on (its state is dropped then)."""
        with self._lock:
            got = self._pending.get(req_id)
            if got is None:
                self.stats["lookups"] += 1
                fut = self._pool.submit(self._lookup, ids, salt)
                self._pending[req_id] = (fut, time.monotonic() + self._spec.wait)
                return False
            fut, deadline = got
            if not fut.done():
                if time.monotonic() < deadline:
                    return False
                self.stats["given_up"] += 1
                log.warning("shmkv: tier lookup of %s took over %.1f s: going on with the "
                            "local hit", req_id, self._spec.wait)
            elif fut.exception() is not None:
                self.stats["failed"] += 1
                log.warning("shmkv: tier lookup of %s failed (%r): local hit only", req_id,
                            fut.exception())
            del self._pending[req_id]
            return True

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._pending.pop(req_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)   # a lookup is bounded by timeouts
        try:
            self._kv.close()
        except Exception:
            pass
