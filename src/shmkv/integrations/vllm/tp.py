"""Tensor parallel: one shmkv block holds all of a token's KV heads; each vLLM
rank (one worker process per rank, each with its own connector) writes and reads only its
slice of them, so instances of any TP degree -- TP=1 and TP=2 alike -- share one cache.

vLLM gives every rank the same connector metadata each step and calls ``start_load_kv`` /
``wait_for_save`` on every rank in step; the ranks agree through vLLM's TP group (its gloo
``cpu_group``), a few ints per step that loads or saves:

* **save** (``tp_save``): rank 0 does the segment's bookkeeping -- ``create_sequence`` (what
  is published already), ``reserve(tokens=)`` of the new blocks -- and ``fork``\\ s the
  sequence once per other rank; it broadcasts the new blocks' ids and the forks' ids; rank
  r adopts fork r (it now owns a reference to the blocks it writes), copies its head slice
  of every layer into them; an all-reduce (MIN) of "my slice is written" follows, and rank
  0 ``commit``\\ s only when every rank's is.  A block is findable only once all slices are
  written.  A rank killed half-way: the all-reduce fails or never completes on the
  survivors (vLLM then stops the engine), nothing is committed; rank 0's sequence and the
  forks are owned by the ranks' processes, so the blocks stay allocated while any rank
  still writes into them, and recovery frees them once their owners are gone (a fork a
  killed rank never adopted is rank 0's and goes with it).  No block a killed save touched
  can be published or handed to another writer while a rank still writes to it.
* **load** (``tp_load``): each rank pins what the segment holds of the request's tokens
  (``create_sequence(tokens=)``: a published block has every slice), the ranks agree on
  the shortest hit (all-reduce MIN: a block evicted between two ranks' pins is loaded by
  none), each copies its slice, a second all-reduce (MIN) tells whether every rank's copy
  went through; short of that, every rank reports the same blocks to vLLM to recompute.

Pipeline parallel stays refused (segment.py).  This module reads the connector's worker
state (``_kv``, ``_layers``, ``_layout``, ``_bs``, ``_vb``, ``_pieces``, ``stats``, the
load-error sets): it is the TP half of ``ShmkvConnector._load`` / ``_save``.
"""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from .faults import _fault

log = logging.getLogger("shmkv.vllm")

__all__ = ["TPRank", "tp_rank", "tp_save", "tp_load"]


@dataclass
class TPRank:
    rank: int               # this worker's rank in its TP group
    size: int               # tensor_parallel_size
    group: Any              # vLLM's GroupCoordinator (collectives on .cpu_group)

    def head0(self, heads_per_rank: int) -> int:
        """The first of this rank's KV heads among the model's (vLLM's slicing)."""
        return self.rank * heads_per_rank

    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        torch.distributed.broadcast(t, src=self.group.ranks[0], group=self.group.cpu_group)
        return t

    def _min(self, x: int) -> int:
        t = torch.tensor([x], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN,
                                     group=self.group.cpu_group)
        return int(t[0])


def tp_rank(vllm_config: Any, is_worker: bool) -> Optional[TPRank]:
    """This worker's rank when the instance is tensor parallel, else None (TP 1, or the
    scheduler's connector, which holds no KV)."""
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if tp == 1 or not is_worker:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    g = get_tp_group()
    if g.world_size != tp:      # pragma: no cover - vLLM's own invariant
        raise ValueError(f"shmkv: the TP group has {g.world_size} ranks, "
                         f"tensor_parallel_size is {tp}")
    return TPRank(int(g.rank_in_group), tp, g)


def rank_heads(total_heads: int, tp: Optional[TPRank]) -> int:
    return total_heads if tp is None else total_heads // tp.size


def _copy_all(conn, dst: torch.Tensor, vblk: torch.Tensor, sub: torch.Tensor,
              to_vllm: bool, fault_half: bool = False) -> None:
    tp: TPRank = conn._tp
    h0 = tp.head0(conn._layers[0][0].shape[1])
    half = len(conn._layers) // 2
    for i, (t, kp, vp) in enumerate(conn._layers):
        if fault_half and i == half:
            os.kill(os.getpid(), signal.SIGKILL)
        conn._layout.copy(t, kp, vp, conn._bs, dst, vblk, sub, to_vllm=to_vllm, head0=h0)


def tp_save(conn, op, finished: bool = True) -> None:
    """``ShmkvConnector._save`` of a TP rank (see the module docstring).  ``finished``:
    this rank's forward completed; a rank whose forward did not votes no, and no rank
    commits (every rank still takes part in the collectives: the others wait for it)."""
    tp: TPRank = conn._tp
    kv, bs = conn._kv, conn._bs
    end = len(op.tokens)
    sid = None
    forks: list = []
    mine = None                 # the fork this rank adopted (ranks > 0)
    hdr = torch.tensor([-1, 0], dtype=torch.int64)          # [have, new blocks]; -1: skip
    if tp.rank == 0:
        try:
            sid = kv.create_sequence(tokens=np.append(op.tokens, np.int32(0)), salt=op.salt)
            have = kv.seq_len(sid)
            if have < end:
                kv.reserve(sid, end - have, tokens=op.tokens[have:])
                table = kv.block_table(sid)[have // bs:end // bs].astype(np.int64)
                for _ in range(tp.size - 1):    # one by one: a failed fork leaves the
                    forks.append(kv.fork(sid))  # earlier ones in the list, freed below
                hdr = torch.tensor([have, len(table)], dtype=torch.int64)
            else:
                hdr = torch.tensor([have, 0], dtype=torch.int64)
        except Exception as e:
            if not conn._lock_failed(e):
                log.warning("shmkv: save of %s failed on rank 0 (%s: %s)", op.req_id,
                            type(e).__name__, e)
            conn.stats["save_errors"] += 1
    ok = int(finished)
    try:
        tp._bcast(hdr)
        have, n = int(hdr[0]), int(hdr[1])
        if have < 0 or n == 0:
            return
        body = torch.zeros(n + tp.size - 1, dtype=torch.int64)
        if tp.rank == 0:
            body[:n] = torch.from_numpy(table)
            body[n:] = torch.tensor(forks, dtype=torch.int64)
        tp._bcast(body)
        dst = body[:n]
        try:
            if tp.rank > 0:
                mine = int(body[n + tp.rank - 1])
                kv.adopt(mine)      # a reference of this rank's own to what it writes
            vblk, sub = conn._pieces(op.block_ids, 0, end)
            vblk, sub = vblk[have // bs:], sub[have // bs:]
            if len(dst) != len(vblk):
                raise ValueError(f"{len(dst)} new shmkv blocks for {len(vblk)} pieces")
            if finished:
                _copy_all(conn, dst, vblk, sub, False,
                          fault_half=tp.rank == tp.size - 1 and _fault(op.salt, "kill_mid_save"))
        except Exception as e:
            ok = 0
            if not conn._lock_failed(e):
                log.warning("shmkv: save of %s failed on rank %d (%s: %s)", op.req_id,
                            tp.rank, type(e).__name__, e)
        ok = tp._min(ok)                    # every slice written?
        if ok and tp.rank == 0:
            try:
                kv.commit(sid)
            except Exception as e:          # a LockTimeout...: a miss later, never vLLM's
                ok = 0
                if not conn._lock_failed(e):
                    log.warning("shmkv: commit of %s failed on rank 0 (%s: %s)", op.req_id,
                                type(e).__name__, e)
        if ok:
            conn.stats["saved_tokens"] += end - have
        else:
            conn.stats["save_errors"] += 1
    finally:
        if tp.rank == 0:
            for f in forks:             # the ones no rank adopted are still this process's
                conn._free(f, only_if_mine=True)
        for s in (sid, mine):
            if s is not None:
                conn._free(s)           # committed blocks stay cached


def tp_load(conn, op) -> None:
    """``ShmkvConnector._load`` of a TP rank (see the module docstring)."""
    tp: TPRank = conn._tp
    kv, vb, bs = conn._kv, conn._vb, conn._bs
    sid = None
    have = op.start
    try:
        if conn._layout is None:
            raise RuntimeError("loading is off")
        if _fault(op.salt, "reset_before_load") and tp.rank == 0:
            kv.reset_prefix_cache()
        sid = kv.create_sequence(tokens=op.tokens, salt=op.salt)
        have = max(op.start, min(kv.seq_len(sid), op.end) // bs * bs)
    except Exception as e:
        if not conn._lock_failed(e):
            log.warning("shmkv: load of %s failed on rank %d (%s: %s); recomputing",
                        op.req_id, tp.rank, type(e).__name__, e)
    good = op.start
    try:
        have = tp._min(have)                # what every rank holds pinned
        if have > op.start:
            ok = 1
            try:
                table = torch.from_numpy(kv.block_table(sid).astype(np.int64))
                src = table[op.start // bs:have // bs]
                vblk, sub = conn._pieces(op.block_ids, op.start, have)
                _copy_all(conn, src, vblk, sub, True)
            except Exception as e:
                ok = 0
                if not conn._lock_failed(e):
                    log.warning("shmkv: load of %s failed on rank %d (%s: %s); "
                                "recomputing", op.req_id, tp.rank, type(e).__name__, e)
            if tp._min(ok):
                good = have
    finally:
        if sid is not None:
            conn._free(sid)
    conn.stats["loaded_tokens"] += good - op.start
    if good < op.end:
        conn._load_errors.update(op.block_ids[(good - op.start) // vb:])
        conn._short_reqs.add(op.req_id)
        conn.stats["load_shortfall_tokens"] += op.end - good
        conn.stats["load_errors"] += 1
