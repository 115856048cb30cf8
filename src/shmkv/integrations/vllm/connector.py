"""ShmkvConnector: a vLLM (v1 API) KV connector over one shmkv segment, so that every vLLM
instance on the host that names the same segment shares one prefix cache, with no server.

vLLM runs it in two roles, in different processes; the connector holds the half its role
asks for (as vLLM's own connectors do) and hands every call of vLLM's to it: the scheduler's
half (scheduler.py) or the worker's (worker.py); what both hold is common.py's, what one
hands the other each step metadata.py's:

* scheduler side (EngineCore): matches a request's tokens against the segment's prefix
  index (``match_prefix``, salted by model, ``cache_salt`` and LoRA), counts whole vLLM
  blocks beyond the instance's own hit, and plans per step which blocks the worker loads
  and which newly full blocks (prompt *and* generated tokens) it publishes;
* worker side: loads synchronously in ``start_load_kv`` (a sequence created from the
  tokens pins the blocks while they are copied; what is no longer there is reported
  through ``get_block_ids_with_load_errors`` and recomputed), and publishes in
  ``wait_for_save`` (``reserve(tokens=)``, copy every layer, then ``commit``: a block is
  findable only once all of its bytes are written; a process killed before ``commit``
  leaves an unpublished sequence that recovery frees).

Fleets (README "Serving a fleet"): every ``vllm serve`` instance on the host that names the
segment shares it.  The scheduler marks the blocks it is about to compute as pending
(shmkv.pending: owned by its process, dropped when it dies), and a request on another
instance whose prefix is pending answers vLLM "not yet" (``None``) until the blocks are
published, for at most ``pending_wait`` seconds: a new prefix is computed once on the
host, not once per instance.  The figures go to vLLM's own ``/metrics`` (stats.py), and the
blocks saved to or loaded from the segment are announced on vLLM's own KV event stream
(events.py).

With a remote tier configured (``tier`` in the extra config or ``$SHMKV_TIER``, see
tier.py), the worker writes what it commits through to it and the scheduler looks up
what the segment lacks in a background thread, answering "not yet" (``None``) to vLLM
meanwhile: a prompt prefilled on another host becomes a hit here, and the scheduler loop
never waits on the network.

Anything that goes wrong in the cache turns into a miss, never a failed request.  What the
host holds never stops the engine either: a missing optional package (ml_dtypes for
bfloat16 K/V), no room in /dev/shm for the segment, another model's, another version's or
another user's segment under the name turn the connector off with one warning naming the
cause and the fix, and the engine serves without the shared cache.  Only a mistake in the
connector's own configuration (a bad key or value) is an error at engine start.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import shmkv

from .common import LOCK_BACKOFF, STEP_LOCK_TIMEOUT, Half, Settings, log  # noqa: F401
from .faults import _FAULTS_ON  # noqa: F401  (importable here as before)
from .hybrid import check_groups
from .metadata import LoadOp, SaveOp, ShmkvConnectorMetadata  # noqa: F401
from .scheduler import ShmkvScheduler, request_salt
from .segment import SegmentSpec, off_reason, open_segment, segment_spec
from .stats import ShmkvConnectorStats, ShmkvPromMetrics
from .tier import tier_spec
from .tp import tp_rank
from .worker import _STATS_FILE, ShmkvWorker  # noqa: F401  (_STATS_FILE: as _FAULTS_ON)

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["ShmkvConnector", "ShmkvConnectorMetadata", "request_salt"]


def _missing_package(dtype: str) -> Optional[str]:
    """Why the pools of ``dtype`` cannot be opened in this environment, or None."""
    if dtype in ("bfloat16", "float8_e4m3"):
        try:
            import ml_dtypes  # noqa: F401
        except ImportError as e:
            return f"{dtype} K/V need the ml_dtypes package ({type(e).__name__}: {e})"
    return None


class ShmkvConnector(KVConnectorBase_V1):
    """vLLM KV connector over a shmkv segment; see the module docstring and README "vLLM".

    ``kv_connector_extra_config`` keys: ``segment`` (required), ``num_blocks`` or
    ``size_gib`` (a new segment's pool), ``block_size`` (a new segment's; default vLLM's),
    ``max_seqs``, ``model_id`` (the model part of the salt; default the model path:
    hosts that share a tier name the model alike), ``save`` (default true), ``load``
    (default true), ``hash_seed`` (a new segment's), ``tier`` (``redis://host:port``;
    default ``$SHMKV_TIER``), ``tier_cluster``, ``tier_timeout``, ``tier_wait`` (tier.py),
    ``pending`` (default true: mark prefixes being computed, wait for other instances'),
    ``pending_wait`` (seconds a request waits for another instance's prefix at most;
    default 30), ``pending_stall`` (seconds it waits while no new block of that prefix is
    published and the instance computing it is past its own estimate of when it publishes
    -- from the prefill rate it measured -- then computes it itself; default 2),
    ``pending_ttl`` (seconds a mark lasts at most; default 120),
    ``pending_lock_timeout`` (seconds a step waits at most for the marks' lock, then answers
    "no marks"; default 0.05), ``lock_timeout`` (seconds a step's call waits at most for
    the segment's pool lock, then goes on without the cache -- a miss, a dropped save --
    and waits no more for a second; default 0.1).

    ``connector_scheduler`` (scheduler.py's ``ShmkvScheduler``) or ``connector_worker``
    (worker.py's ``ShmkvWorker``) is the half of this role; the other is None.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_groups(kv_cache_config)       # one group of attention layers (hybrid.py)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        settings = Settings.of(vllm_config, extra)     # the config's mistakes: refused
        scheduler = role == KVConnectorRole.SCHEDULER
        # a cache never stops an engine: what the host holds turns it off, one warning
        say = log.warning if scheduler else log.info
        spec: Optional[SegmentSpec] = None
        kv: Optional[shmkv.KVCache] = None
        tier = None
        missing = _missing_package(str(vllm_config.model_config.dtype).replace("torch.", ""))
        if missing is not None:
            say("shmkv: the connector is OFF for this engine: %s (pip install "
                "\"shmkv[vllm]\" installs it); vLLM serves without the shared cache", missing)
        else:
            spec = segment_spec(vllm_config, extra)
            tier = tier_spec(extra)
            try:
                kv = open_segment(spec)
            except Exception as e:
                # what the host holds (no room in /dev/shm, another user's or another
                # model's segment under the name, another version's): serves without it
                say("shmkv: the connector is OFF for this engine: %s; vLLM serves without "
                    "the shared cache", off_reason(spec, e))
        self.connector_scheduler: Optional[ShmkvScheduler] = None
        self.connector_worker: Optional[ShmkvWorker] = None
        try:
            if scheduler:
                self.connector_scheduler = ShmkvScheduler(vllm_config, settings, spec, kv,
                                                          tier)
            else:
                self.connector_worker = ShmkvWorker(vllm_config, settings, spec, kv, tier,
                                                    tp_rank(vllm_config, True))
        except BaseException:
            if kv is not None:
                kv.close()
            raise
        half = self._half
        if kv is None:
            return
        assert spec is not None
        log.info("shmkv: %s on segment %r (%d blocks of %d tokens, %s): load %s, save %s, "
                 "pending marks %s, events %s", role.name.lower(), spec.name,
                 kv.config.num_blocks, kv.config.block_size, kv.config.dtype,
                 *("on" if x else "off" for x in (half._load_on, half._save_on,
                                                   half.marks_on(), settings.events)))
        if scheduler:
            half._bound_waits()             # the worker's: once its tensors are registered

    @property
    def _half(self) -> Half:
        half = self.connector_scheduler or self.connector_worker
        assert half is not None
        return half

    def _sched(self) -> ShmkvScheduler:
        assert self.connector_scheduler is not None, "a scheduler call on a worker"
        return self.connector_scheduler

    def _work(self) -> ShmkvWorker:
        assert self.connector_worker is not None, "a worker call on the scheduler"
        return self.connector_worker

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache (vLLM 0.32 defaults it to True for ``kv_both``).  A
        save copies the step's blocks inside that step (``wait_for_save``), so nothing is
        in flight when the scheduler preempts a request afterwards; a save that did not
        happen is a future miss, never a wrong block.  True would make vLLM drop a
        preempted request's output and recompute it for a hand-off that does not exist."""
        return False

    # ------------------------------------------- vLLM's optional hooks, answered on purpose
    # (tests/vllm/test_vllm_api.py checks this class against vLLM 0.32's base class and the
    # newest release's: every hook that changes what vLLM does is answered here, not left
    # to the base class's default)

    # vLLM's metrics by where the loaded tokens came from: host memory (the segment; what
    # a remote tier holds is copied into the segment before vLLM loads it)
    _cache_hit_source = CacheHitSource.HOST

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """False: one group of attention layers only (hybrid.py refuses the others)."""
        return False

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """False: lookups match token ids under the connector's own salt, not vLLM's
        block hashes (vLLM 0.34)."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """In process (vLLM 0.34's ``KVCacheAccess.IN_PROCESS``): the worker copies
        between its own KV tensors and the segment with CPU copies; nothing registers the
        cache with a transport or exports it to another process."""
        try:
            from vllm.config.kv_transfer import KVCacheAccess
        except ImportError:                 # vLLM before 0.34: no such question
            return 0
        return KVCacheAccess.IN_PROCESS

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False (vLLM 0.34 defaults it to True): the worker keeps views of the KV tensors
        it registered and of the segment's pools; it has not been shown to follow sleep
        mode's remap of the cache, so vLLM refuses sleep mode with it rather than let a
        copy touch memory that is gone.  (vLLM's CPU platform has no sleep mode.)"""
        return False

    def unregister_kv_caches(self) -> None:
        """Before sleep (should vLLM call it anyway): no copy from here on -- loads are
        reported failed (vLLM recomputes), saves are skipped -- until
        :meth:`restore_kv_caches`.  Idempotent; nothing to do on the scheduler."""
        if self.connector_worker is not None:
            self.connector_worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """After wake-up: copies resume (the same tensors).  Idempotent."""
        if self.connector_worker is not None:
            self.connector_worker.restore_kv_caches()

    def may_load_async(self, request: "Request") -> bool:
        """False: every load is synchronous, in the step that needs it (``start_load_kv``);
        ``get_num_new_matched_tokens`` never answers ``load_kv_async=True`` (vLLM 0.34)."""
        return False
    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def take_events(self) -> "Any":
        """The save/load events every worker reported, for vLLM's KV event publisher."""
        return self._sched().take_events()

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ShmkvConnectorMetadata)
        self._work().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return                              # loads are synchronous (start_load_kv)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        self._work().save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        assert meta is None or isinstance(meta, ShmkvConnectorMetadata)
        self._work().wait_for_save(meta)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> "Any":
        return self._work().get_kv_connector_kv_cache_events()

    # ------------------------------------------------------------ both
    def get_kv_connector_stats(self) -> "Optional[KVConnectorStats]":
        """This interval's figures (stats.py), for vLLM's logger and /metrics; the worker
        adds the segment's gauges, read at most once a second."""
        return self._half.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None
                                 ) -> "Optional[KVConnectorStats]":
        return ShmkvConnectorStats(data=data) if data else ShmkvConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: Any,
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> "Optional[KVConnectorPromMetrics]":
        return ShmkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._half.shutdown()
