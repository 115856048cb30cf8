"""What both halves of ShmkvConnector hold: the connector's settings (read once from
``kv_connector_extra_config``, refused at engine start when wrong), the segment's handle
(None: the connector is off in this process), this interval's figures for vLLM's /metrics,
and the accounting of pool-lock waits that ran out.

vLLM runs the scheduler's half (scheduler.py) in EngineCore and the worker's (worker.py) in
each worker process; connector.py's ``ShmkvConnector`` holds the one its role asks for.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

import shmkv
from shmkv.pending import LOCK_TIMEOUT

from .segment import SegmentSpec
from .stats import ShmkvConnectorStats

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig

# under "vllm": the lines appear in vLLM's own log (vllm serve), formatted as vLLM's
log = logging.getLogger("vllm.shmkv")

# While the engine serves, a call into the segment waits at most STEP_LOCK_TIMEOUT s for
# its pool lock (``lock_timeout``), and after a wait that ran out this process does not
# wait for it again for LOCK_BACKOFF s (KVCache.lock_backoff: calls that find it held fail
# at once -- a miss, a dropped save).  A process stopped while holding the lock (Ctrl-Z,
# a debugger, ``docker pause``) costs each step at most one bound per second.  Attaching
# at engine start keeps the segment's own 10 s bound (a new engine's recovery pass).
STEP_LOCK_TIMEOUT = 0.1
LOCK_BACKOFF = 1.0


@dataclass(frozen=True)
class Settings:
    """The connector's own keys of ``kv_connector_extra_config`` (the segment's are
    segment.py's, the tier's tier.py's); see ShmkvConnector's docstring."""
    vb: int                         # vLLM's block size (tokens)
    model_id: str                   # the model part of the salt
    save: bool
    load: bool
    pending: bool
    pending_wait: float
    pending_stall: float
    pending_ttl: float
    pending_lock_timeout: float
    lock_timeout: float
    events: bool                    # vLLM's KV cache events are on

    @classmethod
    def of(cls, vllm_config: "VllmConfig", extra: Mapping[str, Any]) -> "Settings":
        """Read and checked: a wrong value is a ValueError at engine start."""
        kec = vllm_config.kv_events_config
        s = cls(vb=int(vllm_config.cache_config.block_size),
                model_id=str(extra.get("model_id") or vllm_config.model_config.model),
                save=bool(extra.get("save", True)), load=bool(extra.get("load", True)),
                pending=bool(extra.get("pending", True)),
                pending_wait=float(extra.get("pending_wait", 30.0)),
                pending_stall=float(extra.get("pending_stall", 2.0)),
                pending_ttl=float(extra.get("pending_ttl", 120.0)),
                pending_lock_timeout=float(extra.get("pending_lock_timeout", LOCK_TIMEOUT)),
                lock_timeout=float(extra.get("lock_timeout", STEP_LOCK_TIMEOUT)),
                events=bool(kec is not None and kec.enable_kv_cache_events))
        if not 0 < s.lock_timeout <= 10:
            raise ValueError(f"shmkv: lock_timeout must be in (0, 10] seconds, got "
                             f"{s.lock_timeout}")
        if not (0 <= s.pending_wait <= 600 and 0 <= s.pending_stall <= 600
                and 0 < s.pending_ttl <= 3600 and 0 <= s.pending_lock_timeout <= 1):
            raise ValueError("shmkv: pending_wait and pending_stall must be in [0, 600], "
                             "pending_ttl in (0, 3600] and pending_lock_timeout in [0, 1] "
                             f"seconds, got {s.pending_wait}, {s.pending_stall}, "
                             f"{s.pending_ttl}, {s.pending_lock_timeout}")
        return s


class Half:
    """The part both halves share.  ``kv`` None: the connector is off in this process (a
    missing package, no segment); every call then answers as a cache that holds nothing."""

    def __init__(self, vllm_config: "VllmConfig", settings: Settings,
                 spec: Optional[SegmentSpec], kv: Optional[shmkv.KVCache]):
        self._vllm_config = vllm_config
        self._spec = spec
        self._kv = kv
        self._vb = settings.vb
        self._bs = kv.config.block_size if kv is not None else settings.vb
        self._save_on = settings.save and kv is not None
        self._load_on = settings.load and kv is not None
        self._events_on = settings.events
        self._lock_timeout = settings.lock_timeout
        self._iv = ShmkvConnectorStats()        # this interval's figures (vLLM's /metrics)
        self._lock_count = 0                     # calls failed for the pool lock
        self._lock_warned = -1e9                 # when that was last logged

    def marks_on(self) -> bool:
        """Pending marks in use (the scheduler's, when on)."""
        return False

    def _bound_waits(self) -> None:
        """From here on the engine serves: the step's bound on the pool lock (see
        STEP_LOCK_TIMEOUT).  The ranks of one process share the segment's handle."""
        assert self._kv is not None
        self._kv.lock_timeout = self._lock_timeout
        self._kv.lock_backoff = LOCK_BACKOFF

    def _lock_failed(self, e: BaseException) -> bool:
        """Whether ``e`` is a pool-lock wait that ran out (or was refused in the backoff's
        pause): then it is counted (vLLM's /metrics) and the log says so at most once a
        minute, for every call that fails so meanwhile (the caller logs nothing)."""
        if not isinstance(e, shmkv.LockTimeout):
            return False
        self._iv.count("lock_timeouts")
        self._lock_count += 1
        now = time.monotonic()
        if now - self._lock_warned >= 60.0:
            self._lock_warned = now
            log.warning("shmkv: segment %r: its pool lock was held past lock_timeout (%.2f "
                        "s) by another process (one stopped while holding it: Ctrl-Z, a "
                        "debugger, docker pause?); %d calls went without the cache so far "
                        "(misses, dropped saves), waiting at most once a second",
                        self._spec.name if self._spec is not None else "?",
                        self._lock_timeout, self._lock_count)
        return True

    def take_stats(self) -> Optional[ShmkvConnectorStats]:
        """This interval's figures (None: nothing to report), and a new interval."""
        if self._kv is None or self._iv.is_empty():
            return None
        out, self._iv = self._iv, ShmkvConnectorStats()
        return out

    def shutdown(self) -> None:
        if self._kv is None:
            return
        try:
            self._kv.close()            # flushes the tier's queued writes first
        except Exception:
            pass
