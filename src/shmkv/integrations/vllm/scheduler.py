"""The scheduler's half of ShmkvConnector (connector.py), in vLLM's EngineCore: matches a
request's tokens against the segment's prefix index (``match_prefix``, salted by model,
``cache_salt`` and LoRA), counts whole vLLM blocks beyond the instance's own hit, and plans
per step which blocks the worker loads and which newly full blocks (prompt *and* generated
tokens) it publishes (metadata.py carries the plan to the workers, worker.py runs it).

Fleets: it marks the blocks it is about to compute as pending (shmkv.pending: owned by its
process, dropped when it dies), and a request whose prefix another instance is computing
answers vLLM "not yet" (``None``) until the blocks are published, for at most
``pending_wait`` seconds.  With a remote tier, what the segment lacks is looked up in a
background thread (tier.py), "not yet" meanwhile: the scheduler loop never waits on the
network.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

import shmkv
from shmkv.pending import EngineMarks, prefix_keys

from .common import Half, Settings, log
from .events import ShmkvKVEvents
from .faults import _fault
from .metadata import LoadOp, SaveOp, ShmkvConnectorMetadata
from .segment import SegmentSpec
from .stats import ShmkvConnectorStats
from .tier import TierLookups, TierSpec

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["ShmkvScheduler", "request_salt"]

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


def _ids(tokens: Any, n: int, pad: bool) -> np.ndarray:
    a = np.empty(n + (1 if pad else 0), dtype=np.int32)
    a[:n] = tokens[:n]
    if pad:
        a[n] = 0                # a token after the last full block: never hashed
    return a


class ShmkvScheduler(Half):
    """The scheduler's half (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", settings: Settings,
                 spec: Optional[SegmentSpec], kv: Optional[shmkv.KVCache],
                 tier: Optional[TierSpec]):
        super().__init__(vllm_config, settings, spec, kv)
        self._model_id = settings.model_id
        self._pending_wait = settings.pending_wait
        self._pending_stall = settings.pending_stall
        self._pending_ttl = settings.pending_ttl
        self._reqs: dict[str, _ReqState] = {}
        self._lookups: Optional[TierLookups] = None
        self._pending: Optional[EngineMarks] = None
        self._pending_lock_timeouts = 0       # of those, already counted in self._iv
        self._sched_events: Optional[ShmkvKVEvents] = None
        self._step: Optional[tuple[float, int]] = None    # this step's (start, tokens)
        self._spt: Optional[float] = None     # measured prefill seconds per token
        if kv is None:
            return
        assert spec is not None
        if tier is not None and self._load_on:
            self._lookups = TierLookups(spec.name, tier, trusted_owners=spec.trusted_owners)
        if self._load_on and self._save_on and settings.pending:
            # a bad NAME.pending turns only the marks off, with one warning
            self._pending = EngineMarks(spec.name, log, timeout=settings.pending_lock_timeout,
                                        trusted_owners=spec.trusted_owners)

    def marks_on(self) -> bool:
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
            if self.marks_on() and self._held_back(st, ids, hit, num_computed_tokens,
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
        if self.marks_on() and st.claim_range is not None:
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

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> ShmkvConnectorMetadata:
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


    def take_stats(self) -> Optional[ShmkvConnectorStats]:
        if self._pending is not None:           # marks operations that found the lock held
            n = self._pending.lock_timeouts
            if n > self._pending_lock_timeouts:
                self._iv.count("pending_lock_timeouts", n - self._pending_lock_timeouts)
                self._pending_lock_timeouts = n
        return super().take_stats()

    def shutdown(self) -> None:
        if self._lookups is not None:
            self._lookups.close()
        if self._pending is not None:
            self._pending.close()
        super().shutdown()
