"""The worker half of ShmkvConnector (connector.py): the copies between vLLM's KV tensors and
the segment.  ``register_kv_caches`` checks the tensors and vLLM's layout (layout.py);
``start_load_kv`` loads what the scheduler planned (a sequence created from the tokens pins
the blocks while they are copied; what is no longer there is reported through
``get_block_ids_with_load_errors`` and recomputed); ``wait_for_save`` publishes
(``reserve(tokens=)``, copy every layer, then ``commit``: a block is findable only once all
of its bytes are written).  A tensor-parallel rank copies its slice of the heads (tp.py).

Only a step whose forward completed publishes.  vLLM calls ``wait_for_save`` from the
``finally:`` of its step (``_get_kv_connector_output``), so also when the forward raised
(SIGTERM turned into SystemExit in a worker, KeyboardInterrupt, an error in a layer): the
step's blocks then hold the K/V of the layers that ran and stale bytes in the others.  So a
save is made only when no exception is in flight (``sys.exc_info()`` inside that
``finally``) and, where vLLM reports each attention layer done (``save_kv_layer``, called
after the layer's attention), every layer reported it this step; otherwise the step
publishes nothing (``unfinished_saves``) and its tokens are a miss for later requests.

The once-a-second housekeeping is here too: recovery of what dead processes left in the
segment, and the segment's gauges for vLLM's /metrics."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

import shmkv
from shmkv.integrations.torch_views import pool_tensors

from .common import Half, Settings, log
from .events import ShmkvKVEvents, stored_event
from .faults import _fault
from .layout import CpuLayout, probe_layout
from .metadata import LoadOp, SaveOp, ShmkvConnectorMetadata
from .segment import SegmentSpec, check_fp8_scales, vllm_kv_scales
from .stats import ShmkvConnectorStats, segment_gauges
from .tier import TierSpec
from .tp import SOLO, TPRank, rank_heads

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent

__all__ = ["ShmkvWorker"]

# SHMKV_VLLM_STATS=FILE: the worker's connector rewrites FILE (JSON: its counters, and the
# seconds its loads and saves took) after every step that loaded or saved.  For the tests
# and benchmarks that drive the offline LLM class; deployments read vLLM's /metrics.
_STATS_FILE = os.environ.get("SHMKV_VLLM_STATS") or None


class ShmkvWorker(Half):
    """The worker's half (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", settings: Settings,
                 spec: Optional[SegmentSpec], kv: Optional[shmkv.KVCache],
                 tier: Optional[TierSpec], tp: Optional[TPRank]):
        super().__init__(vllm_config, settings, spec, kv)
        # tensor parallel: this worker's rank; it copies its slice of the heads (tp.py)
        self._tp = tp
        self._layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._layout: Optional[CpuLayout] = None
        self._asleep_layout: Optional[CpuLayout] = None     # unregister_kv_caches
        self._load_errors: set[int] = set()
        self._unfreed: list[tuple[int, bool]] = []   # sequences a lock timeout left to free
        self._short_reqs: set[str] = set()       # requests whose load fell short this step
        # the forward's progress: the attention layers vLLM reported done this step
        # (save_kv_layer), out of all of them; a step that did not finish publishes nothing
        self._layer_names: frozenset[str] = frozenset()
        self._step_layers: set[str] = set()
        self._layer_reports = False              # vLLM calls save_kv_layer here
        self._events: list["KVCacheEvent"] = []  # this step's, for vLLM's publisher
        # cumulative figures (SHMKV_VLLM_STATS); this interval's are self._iv
        self.stats: dict[str, float] = {
            "loaded_tokens": 0, "load_shortfall_tokens": 0, "saved_tokens": 0,
            "save_errors": 0, "unfinished_saves": 0, "load_errors": 0, "load_seconds": 0.0,
            "save_seconds": 0.0}
        self._gauges_at = 0.0
        if kv is not None and tier is not None and self._save_on:
            kv.set_tier(tier.make(), read=False)    # commits write through

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        try:
            on = self._register(kv_caches)
        except Exception as e:              # a cache never stops the engine
            log.warning("shmkv: the connector is OFF for this engine: %s: %s; vLLM serves "
                        "without the shared cache", type(e).__name__, e)
            on = False
        if self._tp is not None:
            # every rank on, or none: a rank off alone would leave the others waiting for
            # it in each save's and load's collectives
            on = bool(self._tp._min(int(on)))
        if not on:
            self._save_on = self._load_on = False
            self._layout, self._layers, self._layer_names = None, [], frozenset()
        if self._kv is not None:
            self._bound_waits()             # the engine serves from here on

    def _register(self, kv_caches: dict[str, torch.Tensor]) -> bool:
        """Checks vLLM's KV tensors against the segment, picks the copy layout: on?"""
        from vllm.model_executor.models.utils import extract_layer_index

        if self._kv is None:
            return False                    # off (a missing package, the segment): no copy
        cfg = self._kv.config
        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != cfg.num_layers:
            raise shmkv.SegmentError(
                f"shmkv: the model has {len(names)} attention layers here, the segment "
                f"{self._kv.name!r} has num_layers={cfg.num_layers}")
        h, d, vb = rank_heads(cfg.num_kv_heads, self._tp), cfg.head_dim, self._vb
        want = (h, vb, 2 * d)
        for n in names:
            t = kv_caches[n]
            if t.dim() != 4 or tuple(t.shape[1:]) != want or not t.is_contiguous():
                log.warning("shmkv: layer %s's KV tensor is %s (contiguous=%s), expected "
                            "[num_blocks, %d, %d, %d] contiguous (CPU_ATTN): the connector is "
                            "off", n, tuple(t.shape), t.is_contiguous(), *want)
                return False
        # the model's dtype, as vLLM's backend picks its ISA (an fp8 cache's tensors are uint8)
        self._layout = self._self_test(self._vllm_config.model_config.dtype)
        if self._layout is None:
            return False
        # fp8: the codes mean code * scale with this instance's scales (segment.py)
        check_fp8_scales(self._kv, *vllm_kv_scales(self._vllm_config, names))
        self._layers = [(kv_caches[n], *pool_tensors(self._kv, i)) for i, n in enumerate(names)]
        self._layer_names = frozenset(names)
        return True

    def _free(self, sid: int, only_if_mine: bool = False) -> None:
        """Frees one of this worker's sequences (committed blocks stay cached); with
        ``only_if_mine``, only while this process owns it (a fork another rank did not
        adopt).  One that cannot be freed now (the pool lock held past the bound) is
        freed by a later step: nothing stays pinned while the process lives."""
        assert self._kv is not None
        try:
            if not only_if_mine or self._kv.owner_pid(sid) == os.getpid():
                self._kv.free(sid)
        except shmkv.LockTimeout:
            self._unfreed.append((sid, only_if_mine))
        except Exception:
            pass

    def _free_unfreed(self) -> None:
        todo, self._unfreed = self._unfreed, []
        for i, (sid, only_if_mine) in enumerate(todo):
            self._free(sid, only_if_mine)
            if self._unfreed:               # the lock is still held: the next step
                self._unfreed += todo[i + 1:]
                return

    def _self_test(self, dtype: torch.dtype) -> Optional[CpuLayout]:
        assert self._kv is not None
        cfg = self._kv.config
        isa = "?"
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(dtype, self._vb, cfg.head_dim,
                                self._vllm_config.cache_config.cache_dtype)
            lay = probe_layout(isa, dtype, cfg.num_kv_heads, cfg.head_dim, self._vb, self._bs,
                               str(self._vllm_config.cache_config.cache_dtype))
        except Exception as e:
            log.warning("shmkv: the layout self-test raised %s: %s", type(e).__name__, e)
            lay = None
        if lay is None:
            log.warning("shmkv: vLLM's KV layout for ISA %r is not one this connector "
                        "understands: saving and loading are off (no wrong bytes stored)", isa)
        else:
            log.info("shmkv: ISA %r, layout %s", isa, lay.name)
        return lay

    def _pieces(self, block_ids: list[int], t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(vLLM block, piece) of every shmkv block of tokens [t0, t1) (bs-aligned)."""
        bs, r = self._bs, self._vb // self._bs
        g = torch.arange(t0 // bs, t1 // bs, dtype=torch.int64)
        first = t0 // self._vb
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        return ids[g // r - first], g % r

    def start_load_kv(self, meta: ShmkvConnectorMetadata) -> None:
        self._short_reqs = set()
        if self._unfreed:
            self._free_unfreed()
        if meta.loads:
            t0 = time.perf_counter()
            for op in meta.loads:
                self._load(op)
            dt = time.perf_counter() - t0
            self.stats["load_seconds"] += dt
            self._iv.observe("load_seconds", dt)
            self._dump_stats()

    def _dump_stats(self) -> None:
        if _STATS_FILE is None:
            return
        # a temporary file of this process's own: the ranks of a tensor-parallel engine
        # write at the same moment, and one shared name let one rank's bytes land in the
        # middle of another's (the last whole file wins)
        tmp = f"{_STATS_FILE}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(self.stats, f)
            os.replace(tmp, _STATS_FILE)
        except OSError:
            pass

    def _load(self, op: LoadOp) -> None:
        """Loads what the scheduler planned (``op``) into vLLM's blocks, and accounts for
        it: what could not be loaded is reported to vLLM, which recomputes it."""
        good = self._copy_in(op)
        self.stats["loaded_tokens"] += good - op.start
        self._account_load(op, good)
        if good < op.end:
            self._load_errors.update(op.block_ids[(good - op.start) // self._vb:])
            self._short_reqs.add(op.req_id)
            self.stats["load_shortfall_tokens"] += op.end - good
            self.stats["load_errors"] += 1

    def _copy_in(self, op: LoadOp) -> int:
        """Copies this rank's slice of ``op``'s blocks from the segment; the end of what
        every rank loaded (``op.start``: nothing).  Each rank pins what the segment holds of
        the tokens (``create_sequence(tokens=)``: a published block has every slice), the
        ranks agree on the shortest hit (a block evicted between two ranks' pins is loaded
        by none), each copies its slice, and the load counts only if every rank's copy went
        through (tp.py; a single rank's collectives are no-ops)."""
        tp: TPRank = self._tp or SOLO
        kv, bs = self._kv, self._bs
        sid = None
        have = op.start
        try:
            if kv is None or self._layout is None:   # (the scheduler's half may be on)
                raise RuntimeError("loading is off in this worker")
            if _fault(op.salt, "reset_before_load") and tp.rank == 0:
                kv.reset_prefix_cache()
            sid = kv.create_sequence(tokens=op.tokens, salt=op.salt)
            have = max(op.start, min(kv.seq_len(sid), op.end) // bs * bs)
        except Exception as e:
            self._warn_failed("load", op, tp, e, "; recomputing")
        good = op.start
        try:
            have = tp._min(have)                # what every rank holds pinned
            if have > op.start:
                ok = 1
                try:
                    assert kv is not None and sid is not None
                    table = torch.from_numpy(kv.block_table(sid).astype(np.int64))
                    self._copy_layers(tp, table[op.start // bs:have // bs],
                                      *self._pieces(op.block_ids, op.start, have), True)
                except Exception as e:
                    ok = 0
                    self._warn_failed("load", op, tp, e, "; recomputing")
                if tp._min(ok):
                    good = have
        finally:
            if sid is not None:
                self._free(sid)
        return good

    def _warn_failed(self, what: str, op: Any, tp: TPRank, e: BaseException,
                     then: str = "") -> None:
        """One line in vLLM's log for a failed load, save or commit (a pool-lock timeout
        is counted and said once a minute instead: ``_lock_failed``)."""
        if not self._lock_failed(e):
            where = f" on rank {tp.rank}" if tp.size > 1 else ""
            log.warning("shmkv: %s of %s failed%s (%s: %s)%s", what, op.req_id, where,
                        type(e).__name__, e, then)

    def _copy_layers(self, tp: TPRank, shm: torch.Tensor, vblk: torch.Tensor,
                     sub: torch.Tensor, to_vllm: bool, fault_half: bool = False) -> None:
        """This rank's head slice of every layer, between shmkv blocks ``shm`` and vLLM's
        pieces ``(vblk, sub)``."""
        assert self._layout is not None
        h0 = tp.head0(self._layers[0][0].shape[1]) if self._layers else 0
        half = len(self._layers) // 2
        for i, (t, kp, vp) in enumerate(self._layers):
            if fault_half and i == half:
                os.kill(os.getpid(), signal.SIGKILL)
            self._layout.copy(t, kp, vp, self._bs, shm, vblk, sub, to_vllm=to_vllm, head0=h0)

    def _account_load(self, op: LoadOp, good: int) -> None:
        """This interval's figures and events for a load that delivered [start, good)."""
        vb = self._vb
        self._iv.count("loaded_tokens", good - op.start)
        self._iv.count("loaded_blocks", (good - op.start) // self._bs)
        if op.hashes is not None and good // vb > op.start // vb:
            self._announce(op.hashes, op.tokens, op.start // vb, good // vb, op.lora_name)
        if good < op.end:
            self._iv.count("load_failures")
            self._iv.count("load_failed_tokens", op.end - good)

    def _announce(self, hashes: list[Any], tokens: np.ndarray, b0: int, b1: int,
                  lora_name: Optional[str]) -> None:
        """An event for vLLM blocks [b0, b1) of a request, now held by the segment."""
        if not self._events_on or b1 > len(hashes):
            return
        vb = self._vb
        assert self._kv is not None
        self._events.append(stored_event(hashes[b0:b1], hashes[b0 - 1] if b0 else None,
                                         tokens[b0 * vb:b1 * vb].tolist(), vb,
                                         self._kv.name.lstrip("/"), lora_name))

    def get_kv_connector_kv_cache_events(self) -> Optional[ShmkvKVEvents]:
        """This step's events (every step, empty or not, while events are on)."""
        if not self._events_on or self._kv is None:
            return None
        out = ShmkvKVEvents(num_workers=1)
        out.add_events(self._events)
        self._events = []
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def save_kv_layer(self, layer_name: str) -> None:
        # saved in wait_for_save, from the tensors registered above; here only the
        # forward's progress: this layer's attention ran, its K/V are in place
        self._step_layers.add(layer_name)
        self._layer_reports = True

    def _forward_finished(self, written: set[str]) -> bool:
        """Did this step's forward complete?  No exception in flight (vLLM calls
        wait_for_save from a ``finally``), and every attention layer reported done where
        vLLM reports layers (see the module docstring)."""
        if sys.exc_info()[0] is not None:
            return False
        return not self._layer_reports or written >= self._layer_names

    def wait_for_save(self, meta: Optional[ShmkvConnectorMetadata]) -> None:
        """Publishes the step's saves (``meta``: the step's plan, None when vLLM gave
        none)."""
        written, self._step_layers = self._step_layers, set()
        if self._layout is None or meta is None:
            return
        if not meta.saves:
            return
        finished = self._forward_finished(written)
        if not finished:
            self.stats["unfinished_saves"] += len(meta.saves)
            self._iv.count("unfinished_saves", len(meta.saves))
            exc = sys.exc_info()[1]
            log.warning("shmkv: this step's forward did not complete (%s): its %d saves "
                        "publish nothing", f"{type(exc).__name__}" if exc is not None else
                        f"{len(written)} of {len(self._layer_names)} layers done",
                        len(meta.saves))
            self._dump_stats()              # now: a stopping rank may not get further
            if self._tp is None:
                return
            # tensor parallel: every rank still takes part in each save's collectives
            # (the others wait for it), and none commits (tp_save's all-ranks vote)
        t0 = time.perf_counter()
        for op in meta.saves:
            # a request whose load fell short was computed this step on blocks that hold
            # no valid K/V: vLLM recomputes it, and saves it then (update_connector_output)
            if op.req_id not in self._short_reqs:
                self._save(op, finished)
        dt = time.perf_counter() - t0
        self.stats["save_seconds"] += dt
        self._iv.observe("save_seconds", dt)
        self._dump_stats()

    def _save(self, op: SaveOp, finished: bool = True) -> None:
        """Publishes ``op``'s new blocks and accounts for it (a failure is a miss later,
        never vLLM's error)."""
        have, end, ok = self._copy_out(op, finished)
        if not ok:
            self.stats["save_errors"] += 1
            self._iv.count("save_errors")
        elif end > have:
            self.stats["saved_tokens"] += end - have
            self._account_save(op, have, end)

    def _copy_out(self, op: SaveOp, finished: bool) -> tuple[int, int, bool]:
        """Copies this rank's slice of ``op``'s new blocks into the segment and publishes
        them once every rank's slice is written: ``(have, end, ok)``, the tokens the
        segment held already, the end of ``op``, and whether it went through (a rank that
        failed counts it; ``have == end``: nothing new, nothing done).  ``finished``: this
        rank's forward completed; a rank whose forward did not votes no and nothing is
        published, every rank still taking part in the collectives.

        Rank 0 does the segment's bookkeeping -- ``create_sequence`` (what is published
        already), ``reserve(tokens=)`` of the new blocks -- and forks the sequence once
        per other rank; it shares the new blocks' ids and the forks'; rank r adopts fork r
        (a reference of its own to the blocks it writes) and copies its head slice; rank 0
        commits only when every rank's slice is written (tp.py; a single rank's
        collectives are no-ops)."""
        tp: TPRank = self._tp or SOLO
        kv, bs = self._kv, self._bs
        assert kv is not None
        end = len(op.tokens)
        sid = mine = None           # rank 0's sequence; the fork this rank adopted (> 0)
        forks: list[int] = []
        table: list[int] = []
        hdr = [-1, 0]               # [have, new blocks]; have -1: rank 0 failed, skip
        if tp.rank == 0:
            try:
                sid = kv.create_sequence(tokens=np.append(op.tokens, np.int32(0)),
                                         salt=op.salt)
                have = kv.seq_len(sid)          # already published (bs-aligned)
                if have < end:
                    kv.reserve(sid, end - have, tokens=op.tokens[have:])
                    table = kv.block_table(sid)[have // bs:end // bs].tolist()
                    for _ in range(tp.size - 1):    # one by one: a failed fork leaves the
                        forks.append(kv.fork(sid))  # earlier ones in the list, freed below
                hdr = [have, len(table)]
            except Exception as e:          # full pool, foreign segment...: a miss later
                self._warn_failed("save", op, tp, e)
        try:
            have, n = tp._bcast(hdr)
            if have < 0:
                return 0, 0, tp.rank != 0       # rank 0 failed (and counts it)
            if n == 0:
                return have, have, True         # nothing new
            body = tp._bcast(table + forks if tp.rank == 0 else [0] * (n + tp.size - 1))
            ok = int(finished)
            try:
                if tp.rank > 0:
                    mine = body[n + tp.rank - 1]
                    kv.adopt(mine)      # a reference of this rank's own to what it writes
                vblk, sub = self._pieces(op.block_ids, 0, end)
                vblk, sub = vblk[have // bs:], sub[have // bs:]
                if n != len(vblk):
                    raise ValueError(f"{n} new shmkv blocks for {len(vblk)} pieces")
                if finished:
                    self._copy_layers(tp, torch.tensor(body[:n], dtype=torch.int64), vblk,
                                      sub, False, fault_half=tp.rank == tp.size - 1
                                      and _fault(op.salt, "kill_mid_save"))
            except Exception as e:
                ok = 0
                self._warn_failed("save", op, tp, e)
            ok = tp._min(ok)                    # every slice written?
            if ok and tp.rank == 0:
                try:
                    kv.commit(sid)              # every byte written: now findable
                except Exception as e:          # a LockTimeout...: a miss later
                    ok = 0
                    self._warn_failed("commit", op, tp, e)
            return have, end, bool(ok)
        finally:
            for f in forks:             # the ones no rank adopted are still this process's
                self._free(f, only_if_mine=True)
            for s in (sid, mine):
                if s is not None:
                    self._free(s)       # committed blocks stay cached

    def _account_save(self, op: SaveOp, have: int, end: int) -> None:
        """This interval's figures and events for a save that published [have, end)."""
        self._iv.count("saved_tokens", end - have)
        self._iv.count("saved_blocks", (end - have) // self._bs)
        if op.hashes is not None:
            self._announce(op.hashes, op.tokens, have // self._vb, end // self._vb,
                           op.lora_name)

    # ------------------------------------------------------- sleep (vLLM 0.34's hooks)
    def unregister_kv_caches(self) -> None:
        """No copy from here on -- loads are reported failed (vLLM recomputes), saves
        are skipped -- until :meth:`restore_kv_caches`.  Idempotent."""
        if self._layout is not None:
            self._asleep_layout, self._layout = self._layout, None

    def restore_kv_caches(self) -> None:
        """Copies resume (the same tensors).  Idempotent."""
        lay = self._asleep_layout
        if lay is not None:
            self._layout, self._asleep_layout = lay, None

    # ------------------------------------------------------------- housekeeping
    def take_stats(self) -> Optional[ShmkvConnectorStats]:
        """This interval's figures, with the segment's gauges read at most once a second
        (and the housekeeping that goes with them)."""
        if self._kv is None:
            return None
        now = time.monotonic()
        if now - self._gauges_at >= 1.0:
            self._gauges_at = now
            self._housekeeping()
        return super().take_stats()

    def _housekeeping(self) -> None:
        """Once a second: recover what dead processes left in the segment (a killed
        instance's unpublished saves, its sequences: freed, never published), then read
        the segment's gauges.  Any surviving instance does it within ~1 s.

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
