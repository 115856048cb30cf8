"""ShmkvConnector: a vLLM (v1 API) KV connector over one shmkv segment, so that every vLLM
instance on the host that names the same segment shares one prefix cache, with no server.

Owns the two halves vLLM runs in different processes (the scheduler's here, the worker's
in worker.py, what one hands the other each step in metadata.py):

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

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import shmkv
from shmkv.pending import LOCK_TIMEOUT, EngineMarks, prefix_keys

from .events import ShmkvKVEvents
from .faults import _FAULTS_ON, _fault  # noqa: F401  (_FAULTS_ON: importable here as before)
from .hybrid import check_groups
from .layout import CpuLayout
from .metadata import LoadOp, SaveOp, ShmkvConnectorMetadata
from .segment import off_reason, open_segment, segment_spec
from .stats import ShmkvConnectorStats, ShmkvPromMetrics, segment_gauges
from .tier import TierLookups, tier_spec
from .tp import tp_rank
from .worker import _STATS_FILE, _WorkerHalf  # noqa: F401  (_STATS_FILE: as _FAULTS_ON)

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["ShmkvConnector", "ShmkvConnectorMetadata", "request_salt"]

# While the engine serves, a call into the segment waits at most STEP_LOCK_TIMEOUT s for
# its pool lock (``lock_timeout``), and after a wait that ran out this process does not
# wait for it again for LOCK_BACKOFF s (KVCache.lock_backoff: calls that find it held fail
# at once -- a miss, a dropped save).  A process stopped while holding the lock (Ctrl-Z,
# a debugger, ``docker pause``) costs each step at most one bound per second.  Attaching
# at engine start keeps the segment's own 10 s bound (a new engine's recovery pass).
STEP_LOCK_TIMEOUT = 0.1
LOCK_BACKOFF = 1.0

# under "vllm": the lines appear in vLLM's own log (vllm serve), formatted as vLLM's
log = logging.getLogger("vllm.shmkv")

def request_salt(model_id: str, cache_salt: Optional[str] = None,
                 lora_name: Optional[str] = None) -> str:
    """The prefix-cache salt of a request: model identity, cache_salt and LoRA, so that
    different models or tenants never share a block."""
    return f"vllm\x00{model_id}\x00{cache_salt or ''}\x00{lora_name or ''}"


@dataclass
class _ReqState:
    request: "Request"
    salt: str
    blocks: list[int] = field(default_factory=list)
    saved_upto: int = 0                       # tokens known to be in the segment
    load: Optional[tuple[int, int]] = None    # planned (start, end) of a load
    tier_done: bool = False                   # its tier lookup ran (or was given up on)
    keys: Optional[np.ndarray] = None         # pending-mark keys of its blocks (cached)
    claimed: Optional[np.ndarray] = None      # the keys it marked pending
    wait_since: Optional[float] = None        # held back since (another instance computes)
    wait_hit: int = 0                         # the segment's hit when it last grew meanwhile
    progress_at: float = 0.0                  # when that was
    gave_up: bool = False                     # waited too long or saw no progress: computes
    claim_range: Optional[tuple[int, int]] = None   # blocks it will compute, to mark


# seconds a request's blocks are marked pending between its lookup and its allocation
_TENTATIVE_TTL = 2.0
# the prefill rate behind a claim's estimate of when it is published: steps of at least
# this many tokens are measured (shorter ones are mostly fixed cost); the estimate is this
# many times what the rate says, plus pending_stall
_RATE_MIN_TOKENS = 32
_ETA_MARGIN = 1.5


def _missing_package(dtype: str) -> Optional[str]:
    """Why the pools of ``dtype`` cannot be opened in this environment, or None."""
    if dtype in ("bfloat16", "float8_e4m3"):
        try:
            import ml_dtypes  # noqa: F401
        except ImportError as e:
            return f"{dtype} K/V need the ml_dtypes package ({type(e).__name__}: {e})"
    return None


def _ids(tokens: Any, n: int, pad: bool) -> np.ndarray:
    a = np.empty(n + (1 if pad else 0), dtype=np.int32)
    a[:n] = tokens[:n]
    if pad:
        a[n] = 0                # a token after the last full block: never hashed
    return a


class ShmkvConnector(_WorkerHalf, KVConnectorBase_V1):
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
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_groups(kv_cache_config)       # one group of attention layers (hybrid.py)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._vb = int(vllm_config.cache_config.block_size)
        mc = vllm_config.model_config
        self._model_id = str(extra.get("model_id") or mc.model)
        self._save_on = bool(extra.get("save", True))
        self._load_on = bool(extra.get("load", True))
        self._pending_wait = float(extra.get("pending_wait", 30.0))
        self._pending_stall = float(extra.get("pending_stall", 2.0))
        self._pending_ttl = float(extra.get("pending_ttl", 120.0))
        self._pending_lock_timeout = float(extra.get("pending_lock_timeout", LOCK_TIMEOUT))
        self._lock_timeout = float(extra.get("lock_timeout", STEP_LOCK_TIMEOUT))
        if not 0 < self._lock_timeout <= 10:
            raise ValueError(f"shmkv: lock_timeout must be in (0, 10] seconds, got "
                             f"{self._lock_timeout}")
        if not (0 <= self._pending_wait <= 600 and 0 <= self._pending_stall <= 600
                and 0 < self._pending_ttl <= 3600 and 0 <= self._pending_lock_timeout <= 1):
            raise ValueError("shmkv: pending_wait and pending_stall must be in [0, 600], "
                             "pending_ttl in (0, 3600] and pending_lock_timeout in [0, 1] "
                             f"seconds, got {self._pending_wait}, {self._pending_stall}, "
                             f"{self._pending_ttl}, {self._pending_lock_timeout}")
        kec = vllm_config.kv_events_config
        self._events_on = bool(kec is not None and kec.enable_kv_cache_events)
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._lookups: Optional[TierLookups] = None
        self._pending: Optional[EngineMarks] = None
        self._pending_lock_timeouts = 0       # of those, already counted in self._iv
        self._sched_events: Optional[ShmkvKVEvents] = None
        self._step: Optional[tuple[float, int]] = None    # this step's (start, tokens)
        self._spt: Optional[float] = None     # measured prefill seconds per token
        # worker side
        self._layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._layout: Optional[CpuLayout] = None
        self._asleep_layout: Optional[CpuLayout] = None     # unregister_kv_caches
        # tensor parallel: this worker's rank; it copies its slice of the heads (tp.py)
        self._tp = tp_rank(vllm_config, role == KVConnectorRole.WORKER)
        self._load_errors: set[int] = set()
        self._unfreed: list[tuple[int, bool]] = []   # sequences a lock timeout left to free
        self._lock_count = 0                     # calls failed for the pool lock
        self._lock_warned = -1e9                 # when that was last logged
        self._short_reqs: set[str] = set()       # requests whose load fell short this step
        # the forward's progress: the attention layers vLLM reported done this step
        # (save_kv_layer), out of all of them; a step that did not finish publishes nothing
        self._layer_names: frozenset[str] = frozenset()
        self._step_layers: set[str] = set()
        self._layer_reports = False              # vLLM calls save_kv_layer here
        self._events: list["KVCacheEvent"] = []  # this step's, for vLLM's publisher
        # figures: cumulative (SHMKV_VLLM_STATS) and this interval's (vLLM's /metrics)
        self.stats: dict[str, float] = {
            "loaded_tokens": 0, "load_shortfall_tokens": 0, "saved_tokens": 0,
            "save_errors": 0, "unfinished_saves": 0, "load_errors": 0, "load_seconds": 0.0,
            "save_seconds": 0.0}
        self._iv = ShmkvConnectorStats()
        self._gauges_at = 0.0

        self._kv: Optional[shmkv.KVCache] = None
        self._bs = self._vb
        missing = _missing_package(str(mc.dtype).replace("torch.", ""))
        if missing is not None:
            # a cache never stops an engine: it serves on, without the shared cache
            (log.warning if role == KVConnectorRole.SCHEDULER else log.info)(
                "shmkv: the connector is OFF for this engine: %s (pip install "
                "\"shmkv[vllm]\" installs it); vLLM serves without the shared cache",
                missing)
            self._save_on = self._load_on = False
            return
        self._spec = segment_spec(vllm_config, extra)   # the config's mistakes: refused
        tier = tier_spec(extra)
        try:
            self._kv = open_segment(self._spec)
        except Exception as e:
            # what the host holds (no room in /dev/shm, another user's or another model's
            # segment under the name, another version's): the engine serves on without it
            (log.warning if role == KVConnectorRole.SCHEDULER else log.info)(
                "shmkv: the connector is OFF for this engine: %s; vLLM serves without the "
                "shared cache", off_reason(self._spec, e))
            self._save_on = self._load_on = False
            return
        self._bs = self._kv.config.block_size
        try:
            if tier is not None and role == KVConnectorRole.SCHEDULER and self._load_on:
                self._lookups = TierLookups(self._spec.name, tier,
                                            trusted_owners=self._spec.trusted_owners)
            elif tier is not None and role == KVConnectorRole.WORKER and self._save_on:
                self._kv.set_tier(tier.make(), read=False)    # commits write through
            if (role == KVConnectorRole.SCHEDULER and self._load_on and self._save_on
                    and bool(extra.get("pending", True))):
                # a bad NAME.pending turns only the marks off, with one warning
                self._pending = EngineMarks(self._spec.name, log,
                                            timeout=self._pending_lock_timeout,
                                            trusted_owners=self._spec.trusted_owners)
        except BaseException:
            self._kv.close()
            raise
        log.info("shmkv: %s on segment %r (%d blocks of %d tokens, %s): load %s, save %s, "
                 "pending marks %s, events %s", role.name.lower(), self._spec.name,
                 self._kv.config.num_blocks, self._bs, self._kv.config.dtype,
                 *("on" if x else "off" for x in (self._load_on, self._save_on,
                                                   self._marks_on(),
                                                   self._events_on)))
        if role == KVConnectorRole.SCHEDULER:
            self._bound_waits()             # the worker's: once its tensors are registered

    def _bound_waits(self) -> None:
        """From here on the engine serves: the step's bound on the pool lock (see
        STEP_LOCK_TIMEOUT).  The ranks of one process share the segment's handle."""
        assert self._kv is not None
        self._kv.lock_timeout = self._lock_timeout
        self._kv.lock_backoff = LOCK_BACKOFF

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
        :meth:`restore_kv_caches`.  Idempotent."""
        if self._layout is not None:
            self._asleep_layout, self._layout = self._layout, None

    def restore_kv_caches(self) -> None:
        """After wake-up: copies resume (the same tensors).  Idempotent."""
        lay = self._asleep_layout
        if lay is not None:
            self._layout, self._asleep_layout = lay, None

    def may_load_async(self, request: "Request") -> bool:
        """False: every load is synchronous, in the step that needs it (``start_load_kv``);
        ``get_num_new_matched_tokens`` never answers ``load_kv_async=True`` (vLLM 0.34)."""
        return False

    def _marks_on(self) -> bool:
        return self._pending is not None and self._pending.on

    # ------------------------------------------------------------------ salts
    def _salt(self, request: "Request") -> str:
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        return request_salt(self._model_id, request.cache_salt, lora)

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState(request, self._salt(request))
            if self._load_on:
                self._iv.count("lookups")
        st.load = None
        st.saved_upto = max(st.saved_upto, num_computed_tokens)
        if not self._load_on:
            return 0, False
        assert self._kv is not None
        vb, bs = self._vb, self._bs
        n = request.num_tokens
        # vLLM computes at least the last token; a hit may end inside a vLLM block (at a
        # shmkv block boundary): vLLM computes the rest of that block
        limit = (n - 1) // bs * bs
        if limit <= num_computed_tokens:
            return 0, False
        ids = _ids(request.all_token_ids, limit, True)
        try:
            hit = self._kv.match_prefix(ids, st.salt)
            if (self._lookups is not None and hit < limit and not st.tier_done
                    and not getattr(request, "skip_reading_prefix_cache", False)):
                # the segment lacks some: the tier is asked in the background ("not yet"
                # to vLLM meanwhile); once done, what it had is in the segment
                if not self._lookups.ready(request.request_id, ids, st.salt):
                    return None, False
                st.tier_done = True
                hit = self._kv.match_prefix(ids, st.salt)
            hit = hit // bs * bs
            if self._marks_on() and self._held_back(st, ids, hit, num_computed_tokens,
                                                    limit):
                return None, False          # another instance computes it: not yet
        except Exception as e:              # a cache never fails a request
            if not self._lock_failed(e):
                log.warning("shmkv: match_prefix failed (%s: %s); no hit",
                            type(e).__name__, e)
            return 0, False
        if _fault(st.salt, "overclaim") and hit + vb <= limit:
            hit += vb
        if hit <= num_computed_tokens:
            return 0, False
        st.load = (num_computed_tokens, hit)
        return hit - num_computed_tokens, False

    def _held_back(self, st: _ReqState, ids: np.ndarray, hit: int, computed: int,
                   limit: int) -> bool:
        """Whether the request waits because another instance is computing at least one
        vLLM block of its prefix past what this instance has (segment or own cache);
        else it marks what it will compute and save itself as pending (shmkv.pending).
        Deciding and marking are one step (a claim): of two instances looking up one new
        prefix at once, exactly one computes it.  A request waits while the prefix keeps
        being published (its hit grows), for at most ``pending_stall`` seconds without a
        new block and ``pending_wait`` in all: an owner that stopped publishing (saves
        off or failing, preempted, stopped) costs a waiter seconds, not the mark's life."""
        assert self._pending is not None
        bs, vb = self._bs, self._vb
        if st.keys is None or len(st.keys) < limit // bs:
            st.keys = prefix_keys(ids[:limit], bs, st.salt)
        first = -(-max(hit, computed) // bs)                 # the first block not held here
        # what this instance computes and saves (whole vLLM blocks of the prompt, beyond
        # its own cache, which it does not save again) is pending until published.  Marked
        # now for a few seconds (closes the race with another instance's lookup of the same
        # step), and for pending_ttl once vLLM allocates the request's blocks, i.e. runs it
        # (update_state_after_alloc): a request left queued here holds others back briefly
        upto = min(limit, st.request.num_prompt_tokens // vb * vb) // bs
        st.claim_range = (first, upto) if upto > first else None
        if not st.gave_up:
            if st.claim_range is not None and st.claimed is None:
                others = self._claim(st, min(self._pending_ttl, _TENTATIVE_TTL))
            else:
                others = self._pending.held(st.keys[first:limit // bs])
            if others * bs < vb:
                return False
            now = time.monotonic()
            if st.wait_since is None:
                st.wait_since = st.progress_at = now
                st.wait_hit = hit
                self._iv.count("pending_waits")
            elif hit > st.wait_hit:                          # the owner publishes: progress
                st.wait_hit, st.progress_at = hit, now
            waited, stalled = now - st.wait_since, now - st.progress_at
            if waited < self._pending_wait and (
                    stalled < self._pending_stall
                    # no new block for a while, but the owner (alive: it marks) says it is
                    # still computing them: its estimate, from its own prefill rate
                    or now < self._pending.eta(st.keys[first:limit // bs])):
                return True
            st.gave_up = True                                # waited enough: compute it
            self._iv.count("pending_timeouts")
            log.info("shmkv: %s waited %.1f s for another instance's prefix (%.1f s without "
                     "a new block); computing it here", st.request.request_id, waited, stalled)
        # it computes the prefix here after all: it marks what no other live owner holds
        if st.claim_range is not None and st.claimed is None:
            self._claim(st, min(self._pending_ttl, _TENTATIVE_TTL))
        return False

    def _claim(self, st: _ReqState, ttl: float, eta: float = 0.0) -> int:
        """Claim the request's claim range; what :meth:`EngineMarks.claim` answers (0: the
        range is this request's, marked pending, unless the lock was busy)."""
        assert self._pending is not None and st.keys is not None and st.claim_range
        keys = st.keys[st.claim_range[0]:st.claim_range[1]]
        held = self._pending.claim(keys, ttl, holder=st.request.request_id, eta=eta)
        if held == 0:
            st.claimed = keys if st.claimed is None else np.union1d(st.claimed, keys)
        return held

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if self._marks_on() and st.claim_range is not None:
            # it runs now: pending until published, which it expects by the time its
            # measured prefill rate gives for the rest of the prompt (waiters read it)
            eta = 0.0
            if self._spt is not None:
                todo = st.request.num_prompt_tokens - st.claim_range[0] * self._bs
                eta = (time.monotonic() + _ETA_MARGIN * self._spt * max(todo, 0)
                       + self._pending_stall)
            self._claim(st, self._pending_ttl, eta)
        st.claim_range = None
        if num_external_tokens <= 0 or st.load is None:
            st.load = None
        else:
            start = st.load[0]
            st.load = (start, start + num_external_tokens)
            self._iv.count("lookup_hit_tokens", num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        # the step starts: timed until its output comes back (update_connector_output;
        # vLLM's CPU platform schedules synchronously: one step at a time)
        self._step = (time.monotonic(),
                      int(getattr(scheduler_output, "total_num_scheduled_tokens", 0)))
        meta = ShmkvConnectorMetadata()
        vb = self._vb
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            st = self._reqs.get(req_id)
            if st is not None and st.claimed is not None and self._pending is not None:
                # its blocks are gone: what it has not published, another instance computes
                # (or it does, claiming again, when it is scheduled again)
                self._pending.release(holder=req_id)
                st.claimed = None
        computed: dict[str, int] = {}
        for nr in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is None:
                continue
            st.blocks = list(nr.block_ids[0])
            computed[nr.req_id] = nr.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.blocks = list(nb[0]) if nb is not None else []
            elif nb is not None:
                st.blocks.extend(nb[0])
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, done in computed.items():
            st = self._reqs[req_id]
            if st.load is not None:
                start, end = st.load
                st.load = None
                if -(-end // vb) <= len(st.blocks) and done <= end:
                    meta.loads.append(LoadOp(
                        req_id, _ids(st.request.all_token_ids, end, True), st.salt, start, end,
                        st.blocks[start // vb:-(-end // vb)], *self._event_keys(st, end)))
                    st.saved_upto = max(st.saved_upto, end)
            if not self._save_on:
                continue
            total = done + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(total, st.request.num_tokens, len(st.blocks) * vb) // vb * vb
            if full > st.saved_upto:
                meta.saves.append(SaveOp(req_id, _ids(st.request.all_token_ids, full, False),
                                         st.salt, st.blocks[:full // vb],
                                         *self._event_keys(st, full)))
                st.saved_upto = full
        return meta

    def _event_keys(self, st: _ReqState, end: int) -> tuple[Optional[list[Any]],
                                                            Optional[str]]:
        """(vLLM's hashes of the request's blocks covering [0, end), its LoRA name) for the
        worker's events; (None, None) when events are off or vLLM has not hashed them."""
        if not self._events_on:
            return None, None
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        req = st.request
        hashes = getattr(req, "block_hashes", None) or []
        n = -(-end // self._vb)
        if len(hashes) < end // self._vb:
            return None, None
        lora = req.lora_request.lora_name if req.lora_request is not None else None
        return [maybe_convert_block_hash(h) for h in hashes[:n]], lora

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks the worker could not load were computed from garbage in that step and
        are recomputed by vLLM: they are not in the segment, so plan to save them again.
        Also the end of a step: the prefill rate behind the claims' estimates."""
        if self._step is not None:
            (t0, n), self._step = self._step, None
            dt = time.monotonic() - t0
            if n >= _RATE_MIN_TOKENS and 0 < dt < 600:
                spt = dt / n
                self._spt = spt if self._spt is None else 0.5 * (self._spt + spt)
        ev = getattr(connector_output, "kv_cache_events", None)
        if isinstance(ev, ShmkvKVEvents):
            if self._sched_events is None:
                self._sched_events = ev
            else:
                self._sched_events.add_events(ev.get_all_events())
        bad = getattr(connector_output, "invalid_block_ids", None)
        if not bad:
            return
        vb = self._vb
        for st in self._reqs.values():
            for i, b in enumerate(st.blocks[:-(-st.saved_upto // vb)]):
                if b in bad:
                    st.saved_upto = i * vb
                    break

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if self._lookups is not None:
            self._lookups.forget(request.request_id)
        if st is not None and st.claimed is not None and self._pending is not None:
            # never raises; if not done: they expire.  Another local request on the prefix
            # keeps the marks it claimed too
            self._pending.release(holder=request.request_id)
        return False, None

    def take_events(self) -> "Any":
        """The save/load events every worker reported, for vLLM's KV event publisher."""
        if self._sched_events is not None:
            ev, self._sched_events = self._sched_events, None
            yield from ev.pop_common_events()

    # ------------------------------------------------------------ vLLM's statistics
    def get_kv_connector_stats(self) -> "Optional[KVConnectorStats]":
        """This interval's figures (stats.py), for vLLM's logger and /metrics; the worker
        adds the segment's gauges, read at most once a second."""
        if self._kv is None:
            return None
        now = time.monotonic()
        if self._role == KVConnectorRole.WORKER and now - self._gauges_at >= 1.0:
            self._gauges_at = now
            self._housekeeping()
        if self._pending is not None:           # marks operations that found the lock held
            n = self._pending.lock_timeouts
            if n > self._pending_lock_timeouts:
                self._iv.count("pending_lock_timeouts", n - self._pending_lock_timeouts)
                self._pending_lock_timeouts = n
        if self._iv.is_empty():
            return None
        out, self._iv = self._iv, ShmkvConnectorStats()
        return out

    def _housekeeping(self) -> None:
        """Once a second, on the worker: recover what dead processes left in the segment
        (a killed instance's unpublished saves, its sequences: freed, never published),
        then read the segment's gauges.  Any surviving instance does it within ~1 s.

        Only rank 0 of a tensor-parallel instance recovers (its other ranks' passes
        would find the same dead); the pass itself reads only the process table when
        nothing died (no pool lock, no walk of the pool), returns at once when another
        process is recovering (``busy``), and reclaims in O(what died)."""
        assert self._kv is not None
        self._free_unfreed()
        try:
            got = self._kv.recover() if self._tp is None or self._tp.rank == 0 else {}
            if got.get("processes") or got.get("sequences") or got.get("blocks"):
                log.info("shmkv: reclaimed %d dead processes, their %d sequences and %d "
                         "blocks, from segment %r", got.get("processes", 0),
                         got.get("sequences", 0), got.get("blocks", 0), self._kv.name)
            self._iv.set_gauges(segment_gauges(self._kv.stats()))
        except Exception as e:              # housekeeping never fails a step
            self._lock_failed(e)
            log.debug("shmkv: housekeeping failed (%s: %s)", type(e).__name__, e)

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
        if self._lookups is not None:
            self._lookups.close()
        if self._pending is not None:
            self._pending.close()
        if self._kv is None:
            return
        try:
            self._kv.close()            # flushes the tier's queued writes first
        except Exception:
            pass
