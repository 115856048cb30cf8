"""Tensor parallel: one shmkv block holds all of a token's KV heads; each vLLM
rank (one worker process per rank, each with its own connector) writes and reads only its
slice of them, so instances of any TP degree -- TP=1 and TP=2 alike -- share one cache.

vLLM gives every rank the same connector metadata each step and calls ``start_load_kv`` /
``wait_for_save`` on every rank in step; the ranks agree through vLLM's TP group (its gloo
``cpu_group``), a few ints per step that loads or saves:

* **save** (worker.py's ``_save``): rank 0 does the segment's bookkeeping --
  ``create_sequence`` (what is published already), ``reserve(tokens=)`` of the new blocks
  -- and forks the sequence once per other rank; it broadcasts the new blocks' ids and the
  forks' ids; rank r adopts fork r (it now owns a reference to the blocks it writes),
  copies its head slice of every layer into them; an all-reduce (MIN) of "my slice is
  written" follows, and rank 0 commits only when every rank's is.  A block is findable only
  once all slices are written.  A rank killed half-way: the all-reduce fails or never
  completes on the survivors (vLLM then stops the engine), nothing is committed; rank 0's
  sequence and the forks are owned by the ranks' processes, so the blocks stay allocated
  while any rank still writes into them, and recovery frees them once their owners are
  gone (a fork a killed rank never adopted is rank 0's and goes with it).  No block a
  killed save touched can be published or handed to another writer while a rank still
  writes to it.
* **load** (worker.py's ``_load``): each rank pins what the segment holds of the request's
  tokens (``create_sequence(tokens=)``: a published block has every slice), the ranks agree
  on the shortest hit (all-reduce MIN: a block evicted between two ranks' pins is loaded by
  none), each copies its slice, a second all-reduce (MIN) tells whether every rank's copy
  went through; short of that, every rank reports the same blocks to vLLM to recompute.

Pipeline parallel stays refused (segment.py).  The save and the load themselves are the
worker's (worker.py: one of each, for any TP degree); this module is the rank group they
run on: a single-rank instance is a group of one (:data:`SOLO`), whose collectives return
what they are given and cost nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["TPRank", "SOLO", "tp_rank", "rank_heads"]


@dataclass(frozen=True)
class TPRank:
    """One worker's place in its instance's group of ranks, and the group's collectives
    (on vLLM's gloo ``cpu_group``); a group of one (:data:`SOLO`) has no ``group`` and its
    collectives return their input."""
    rank: int               # this worker's rank in its TP group
    size: int               # tensor_parallel_size
    group: Any              # vLLM's GroupCoordinator (collectives on .cpu_group); SOLO: None

    def head0(self, heads_per_rank: int) -> int:
        """The first of this rank's KV heads among the model's (vLLM's slicing)."""
        return self.rank * heads_per_rank

    def _bcast(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (each passes a list of the same length)."""
        if self.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        torch.distributed.broadcast(t, src=self.group.ranks[0], group=self.group.cpu_group)
        return [int(x) for x in t.tolist()]

    def _min(self, x: int) -> int:
        """The smallest ``x`` of all ranks."""
        if self.size == 1:
            return x
        t = torch.tensor([x], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN,
                                     group=self.group.cpu_group)
        return int(t[0])


SOLO = TPRank(0, 1, None)   # a single-rank instance


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
    """The KV heads each rank holds."""
    return total_heads if tp is None else total_heads // tp.size
