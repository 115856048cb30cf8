"""vLLM's KV event schema, v0.11.0 (``vllm/distributed/kv_events.py``), for the wire.

The structs are declared as vLLM declares them -- msgspec ``Struct``s, ``array_like``
(encoded as msgpack arrays, fields in this order), ``omit_defaults``, ``gc=False``, and
``tag=True`` on the events (the class name is the tag, the array's first element) -- so
that ``msgspec.msgpack.Decoder(KVEventBatch)`` in an existing vLLM event consumer
decodes what shmkv publishes.  ``ExternalBlockHash`` is vLLM's ``Union[bytes, int]``;
shmkv always sends ints (see :mod:`shmkv.events`).

Imports msgspec (the ``events`` extra); :mod:`shmkv.events` imports this module lazily.
"""
from typing import Any, List, Optional, Union

import msgspec

__all__ = ["EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared",
           "KVEventBatch", "MEDIUM_GPU", "ExternalBlockHash"]

ExternalBlockHash = Union[bytes, int]
MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: List[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: List[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: List[ExternalBlockHash]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
