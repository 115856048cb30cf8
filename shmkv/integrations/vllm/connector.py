"""ShmkvConnector: a vLLM (v1 API) KV connector over one shmkv segment, so that every vLLM
instance on the host that names the same segment shares one prefix cache, with no server.

Owns the two halves vLLM runs in different processes:

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

With a remote tier configured (``tier`` in the extra config or ``$SHMKV_TIER``, see
tier.py), the worker writes what it commits through to it and the scheduler looks up
what the segment lacks in a background thread, answering "not yet" (``None``) to vLLM
meanwhile: a prompt prefilled on another host becomes a hit here, and the scheduler loop
never waits on the network.

Anything that goes wrong in the cache turns into a miss, never a failed request; only a
segment that cannot serve this model at all is an error, at engine start.
"""
from __future__ import annotations

import json
import logging
import os
import signal
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

import shmkv
from shmkv.integrations.torch_views import pool_tensors

from .hybrid import check_groups
from .layout import CpuLayout, probe_layout
from .segment import check_fp8_scales, open_segment, segment_spec, vllm_kv_scales
from .tier import TierLookups, tier_spec
from .tp import rank_heads, tp_load, tp_rank, tp_save

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["ShmkvConnector", "ShmkvConnectorMetadata", "request_salt"]

log = logging.getLogger("shmkv.vllm")

# Test-only fault injection (DEVELOP.md): off unless the engine's environment has
# SHMKV_VLLM_FAULT=1, and then only for requests whose cache_salt names the fault
# ("fault:NAME"), so one engine serves clean and faulty requests side by side:
#   reset_before_load  the worker drops the segment's prefix index right before the load
#                      (every matched block vanished between the match and the load)
#   overclaim          the scheduler claims one vLLM block more than it matched
#   kill_mid_save      the worker SIGKILLs itself after copying half the layers of a save
_FAULTS_ON = os.environ.get("SHMKV_VLLM_FAULT") == "1"


# SHMKV_VLLM_STATS=FILE: the worker's connector rewrites FILE (JSON: its counters, and the
# seconds its loads and saves took) after every step that loaded or saved (benchmarks).
_STATS_FILE = os.environ.get("SHMKV_VLLM_STATS") or None


def _fault(salt: str, name: str) -> bool:
    return _FAULTS_ON and f"fault:{name}" in salt


def request_salt(model_id: str, cache_salt: Optional[str] = None,
                 lora_name: Optional[str] = None) -> str:
    """The prefix-cache salt of a request: model identity, cache_salt and LoRA, so that
    different models or tenants never share a block."""
    return f"vllm\x00{model_id}\x00{cache_salt or ''}\x00{lora_name or ''}"


@dataclass
class LoadOp:
    req_id: str
    tokens: np.ndarray          # int32 ids of tokens [0, end), plus one more (never hashed)
    salt: str
    start: int                  # first token to load (vLLM-block aligned)
    end: int                    # one past the last (shmkv-block aligned)
    block_ids: list[int]        # vLLM blocks holding tokens [start, end), in order


@dataclass
class SaveOp:
    req_id: str
    tokens: np.ndarray          # int32 ids of tokens [0, end) (end: vLLM-block aligned)
    salt: str
    block_ids: list[int]        # vLLM blocks of tokens [0, end), in order


@dataclass
class ShmkvConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


@dataclass
class _ReqState:
    request: "Request"
    salt: str
    blocks: list[int] = field(default_factory=list)
    saved_upto: int = 0                       # tokens known to be in the segment
    load: Optional[tuple[int, int]] = None    # planned (start, end) of a load
    tier_done: bool = False                   # its tier lookup ran (or was given up on)


def _ids(tokens: Any, n: int, pad: bool) -> np.ndarray:
    a = np.empty(n + (1 if pad else 0), dtype=np.int32)
    a[:n] = tokens[:n]
    if pad:
        a[n] = 0                # a token after the last full block: never hashed
    return a


class ShmkvConnector(KVConnectorBase_V1):
    """vLLM KV connector over a shmkv segment; see the module docstring and README "vLLM".

    ``kv_connector_extra_config`` keys: ``segment`` (required), ``num_blocks`` or
    ``size_gib`` (a new segment's pool), ``block_size`` (a new segment's; default vLLM's),
    ``max_seqs``, ``model_id`` (the model part of the salt; default the model path:
    hosts that share a tier name the model alike), ``save`` (default true), ``load``
    (default true), ``hash_seed`` (a new segment's), ``tier`` (``redis://host:port``;
    default ``$SHMKV_TIER``), ``tier_cluster``, ``tier_timeout``, ``tier_wait`` (tier.py).
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_groups(kv_cache_config)       # one group of attention layers (hybrid.py)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._vb = int(vllm_config.cache_config.block_size)
        self._spec = segment_spec(vllm_config, extra)
        self._kv: shmkv.KVCache = open_segment(self._spec)
        self._bs = self._kv.config.block_size
        mc = vllm_config.model_config
        self._model_id = str(extra.get("model_id") or mc.model)
        self._save_on = bool(extra.get("save", True))
        self._load_on = bool(extra.get("load", True))
        tier = tier_spec(extra)
        self._lookups: Optional[TierLookups] = None
        try:
            if tier is not None and role == KVConnectorRole.SCHEDULER and self._load_on:
                self._lookups = TierLookups(self._spec.name, tier)
            elif tier is not None and role == KVConnectorRole.WORKER and self._save_on:
                self._kv.set_tier(tier.make(), read=False)    # commits write through
        except BaseException:
            self._kv.close()
            raise
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        # worker side
        self._layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._layout: Optional[CpuLayout] = None
        # tensor parallel: this worker's rank; it copies its slice of the heads (tp.py)
        self._tp = tp_rank(vllm_config, role == KVConnectorRole.WORKER)
        self._load_errors: set[int] = set()
        self._short_reqs: set[str] = set()       # requests whose load fell short this step
        self.stats: dict[str, float] = {
            "loaded_tokens": 0, "load_shortfall_tokens": 0, "saved_tokens": 0,
            "save_errors": 0, "load_errors": 0, "load_seconds": 0.0, "save_seconds": 0.0}

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
        st.load = None
        st.saved_upto = max(st.saved_upto, num_computed_tokens)
        if not self._load_on:
            return 0, False
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
        except Exception as e:              # a cache never fails a request
            log.warning("shmkv: match_prefix failed (%s: %s); no hit", type(e).__name__, e)
            return 0, False
        hit = hit // bs * bs
        if _fault(st.salt, "overclaim") and hit + vb <= limit:
            hit += vb
        if hit <= num_computed_tokens:
            return 0, False
        st.load = (num_computed_tokens, hit)
        return hit - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0 or st.load is None:
            st.load = None
        else:
            start = st.load[0]
            st.load = (start, start + num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = ShmkvConnectorMetadata()
        vb = self._vb
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
                        st.blocks[start // vb:-(-end // vb)]))
                    st.saved_upto = max(st.saved_upto, end)
            if not self._save_on:
                continue
            total = done + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            full = min(total, st.request.num_tokens, len(st.blocks) * vb) // vb * vb
            if full > st.saved_upto:
                meta.saves.append(SaveOp(req_id, _ids(st.request.all_token_ids, full, False),
                                         st.salt, st.blocks[:full // vb]))
                st.saved_upto = full
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks the worker could not load were computed from garbage in that step and
        are recomputed by vLLM: they are not in the segment, so plan to save them again."""
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
        self._reqs.pop(request.request_id, None)
        if self._lookups is not None:
            self._lookups.forget(request.request_id)
        return False, None

    # --------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

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
                self._save_on = self._load_on = False
                return
        # the model's dtype, as vLLM's backend picks its ISA (an fp8 cache's tensors are uint8)
        self._layout = self._self_test(self._vllm_config.model_config.dtype)
        if self._layout is None:
            self._save_on = self._load_on = False
            return
        # fp8: the codes mean code * scale with this instance's scales (segment.py)
        check_fp8_scales(self._kv, *vllm_kv_scales(self._vllm_config, names))
        self._layers = [(kv_caches[n], *pool_tensors(self._kv, i)) for i, n in enumerate(names)]

    def _self_test(self, dtype: torch.dtype) -> Optional[CpuLayout]:
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

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ShmkvConnectorMetadata)
        self._short_reqs = set()
        if meta.loads:
            t0 = time.perf_counter()
            for op in meta.loads:
                self._load(op)
            self.stats["load_seconds"] += time.perf_counter() - t0
            self._dump_stats()

    def _dump_stats(self) -> None:
        if _STATS_FILE is None:
            return
        try:
            with open(_STATS_FILE + ".tmp", "w") as f:
                json.dump(self.stats, f)
            os.replace(_STATS_FILE + ".tmp", _STATS_FILE)
        except OSError:
            pass

    def _load(self, op: LoadOp) -> None:
        if self._tp is not None:
            return tp_load(self, op)
        kv, vb = self._kv, self._vb
        good = op.start
        sid = None
        try:
            if self._layout is None:
                raise RuntimeError("loading is off")
            if _fault(op.salt, "reset_before_load"):
                kv.reset_prefix_cache()
            sid = kv.create_sequence(tokens=op.tokens, salt=op.salt)
            have = min(kv.seq_len(sid), op.end) // self._bs * self._bs
            if have > op.start:
                table = torch.from_numpy(kv.block_table(sid).astype(np.int64))
                bs = self._bs
                src = table[op.start // bs:have // bs]
                vblk, sub = self._pieces(op.block_ids, op.start, have)
                for t, kp, vp in self._layers:
                    self._layout.copy(t, kp, vp, bs, src, vblk, sub, to_vllm=True)
                good = have
        except Exception as e:
            log.warning("shmkv: load of %s failed (%s: %s); recomputing", op.req_id,
                        type(e).__name__, e)
        finally:
            if sid is not None:
                try:
                    kv.free(sid)
                except Exception:
                    pass
        self.stats["loaded_tokens"] += good - op.start
        if good < op.end:
            failed = op.block_ids[(good - op.start) // vb:]
            self._load_errors.update(failed)
            self._short_reqs.add(op.req_id)
            self.stats["load_shortfall_tokens"] += op.end - good
            self.stats["load_errors"] += 1

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return              # saved in wait_for_save, from the tensors registered above

    def wait_for_save(self) -> None:
        if self._layout is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, ShmkvConnectorMetadata)
        if not meta.saves:
            return
        t0 = time.perf_counter()
        for op in meta.saves:
            # a request whose load fell short was computed this step on blocks that hold
            # no valid K/V: vLLM recomputes it, and saves it then (update_connector_output)
            if op.req_id not in self._short_reqs:
                self._save(op)
        self.stats["save_seconds"] += time.perf_counter() - t0
        self._dump_stats()

    def _save(self, op: SaveOp) -> None:
        if self._tp is not None:
            return tp_save(self, op)
        kv, bs = self._kv, self._bs
        assert self._layout is not None
        end = len(op.tokens)
        sid = None
        try:
            padded = np.append(op.tokens, np.int32(0))
            sid = kv.create_sequence(tokens=padded, salt=op.salt)
            have = kv.seq_len(sid)              # already published (bs-aligned)
            if have >= end:
                return
            kv.reserve(sid, end - have, tokens=op.tokens[have:])
            table = torch.from_numpy(kv.block_table(sid).astype(np.int64))
            dst = table[have // bs:end // bs]
            vblk, sub = self._pieces(op.block_ids, 0, end)
            vblk, sub = vblk[have // bs:], sub[have // bs:]
            half = len(self._layers) // 2
            for i, (t, kp, vp) in enumerate(self._layers):
                if i == half and _fault(op.salt, "kill_mid_save"):
                    os.kill(os.getpid(), signal.SIGKILL)
                self._layout.copy(t, kp, vp, bs, dst, vblk, sub, to_vllm=False)
            kv.commit(sid)                      # every byte written: now findable
            self.stats["saved_tokens"] += end - have
        except Exception as e:                  # full pool, foreign segment...: a miss later
            self.stats["save_errors"] += 1
            log.warning("shmkv: save of %s failed (%s: %s)", op.req_id, type(e).__name__, e)
        finally:
            if sid is not None:
                try:
                    kv.free(sid)                # committed blocks stay cached
                except Exception:
                    pass

    def shutdown(self) -> None:
        if self._lookups is not None:
            self._lookups.close()
        try:
            self._kv.close()            # flushes the tier's queued writes first
        except Exception:
            pass
