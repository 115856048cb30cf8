"""KV cache events for the blocks an instance saves to or loads from the segment, published
through vLLM's own event stream (``--kv-events-config``): the worker builds vLLM's
``BlockStored`` events (vLLM's block hashes, token ids and block size, ``medium``
:data:`MEDIUM_SHARED`, ``ownership`` ``"shmkv:<segment>"``) and hands them to vLLM
(``get_kv_connector_kv_cache_events``); the scheduler collects them
(``update_connector_output``) and gives vLLM's publisher those every worker reported
(``take_events``).  A router reading them knows the instance can serve those blocks from
host memory shared by every instance on the segment.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Optional, Sequence

from vllm.distributed.kv_events import BlockStored, KVCacheEvent, KVConnectorKVEvents

__all__ = ["MEDIUM_SHARED", "ShmkvKVEvents", "stored_event"]

MEDIUM_SHARED = "CPU_SHARED"      # host memory shared by the instances on one segment


def stored_event(hashes: Sequence[Any], parent: Any, token_ids: Sequence[int],
                 block_size: int, segment: str, lora_name: Optional[str]) -> BlockStored:
    """One ``BlockStored`` for consecutive vLLM blocks held in the segment."""
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                       token_ids=[int(t) for t in token_ids], block_size=block_size,
                       lora_id=None, medium=MEDIUM_SHARED, lora_name=lora_name,
                       ownership=f"shmkv:{segment}")


class ShmkvKVEvents(KVConnectorKVEvents):
    """The events of one step, counted per worker: with tensor parallel workers, an event
    is published once every worker reported it.  A worker with events on hands one every
    step, empty or not (always true: vLLM counts the workers by the containers it gets)."""

    def __init__(self, num_workers: int = 1) -> None:
        if num_workers <= 0:
            raise ValueError(f"num_workers: expected >= 1, got {num_workers}")
        self._events: Counter[KVCacheEvent] = Counter()
        self._workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.update(events)

    def aggregate(self) -> "ShmkvKVEvents":
        common = self.pop_common_events()
        self._events = Counter(common)
        self._workers = 1
        return self

    def pop_common_events(self) -> list[KVCacheEvent]:
        out = [e for e, n in self._events.items() if n >= self._workers]
        for e in out:
            del self._events[e]
        return out

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events.elements())

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()
        self._workers = 1
