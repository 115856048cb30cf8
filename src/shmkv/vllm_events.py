"""vLLM's KV event schemas (``vllm/distributed/kv_events.py``) for the wire: vLLM 0.32's
(the default) and v0.11.0's (``--vllm-schema 0.11``).

The structs are declared as vLLM declares them, so that ``msgspec.msgpack.Decoder(
KVEventBatch)`` in a vLLM event consumer decodes what shmkv publishes:

* **0.32** (default): the batch is ``array_like`` (``[ts, events, dp_rank]``); each event
  is a msgpack **map** tagged ``"type"`` (the class name), ``omit_defaults``, with the
  fields vLLM 0.32 added: ``lora_name`` (required, ``None`` here) and the optional
  ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``, ... (left at their defaults).
* **0.11**: the events are ``array_like`` too (arrays whose first element is the tag) and
  have no ``lora_name``.  A 0.32 consumer cannot decode these, nor a 0.11 consumer the maps.

``ExternalBlockHash`` is vLLM's ``bytes | int``; shmkv always sends ints (see
:mod:`shmkv.events`).  Imports msgspec (the ``events`` extra); :mod:`shmkv.events`
imports this module lazily.
"""
from typing import Any, Dict, List, Optional, Tuple, Union

import msgspec

__all__ = ["SCHEMAS", "DEFAULT_SCHEMA", "EventBatch", "KVCacheEvent", "BlockStored",
           "BlockRemoved", "AllBlocksCleared", "KVEventBatch", "LegacyKVCacheEvent",
           "LegacyBlockStored", "LegacyBlockRemoved", "LegacyAllBlocksCleared",
           "LegacyKVEventBatch", "classes", "MEDIUM_GPU", "MEDIUM_CPU", "ExternalBlockHash"]

#: the vLLM releases whose event schema shmkv speaks; the first is the default
SCHEMAS = ("0.32", "0.11")
DEFAULT_SCHEMA = SCHEMAS[0]

ExternalBlockHash = Union[bytes, int]
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: List[Any]
    data_parallel_rank: Optional[int] = None


# ------------------------------------------------------------------ vLLM 0.32 (maps)
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events (vLLM 0.32: maps tagged "type")."""


class BlockStored(KVCacheEvent):
    block_hashes: List[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: List[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


# ---------------------------------------------------------------- vLLM 0.11 (arrays)
class LegacyKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                         tag=True):
    """Base class of vLLM v0.11.0's events (arrays, the tag first)."""


class LegacyBlockStored(LegacyKVCacheEvent, tag="BlockStored"):
    block_hashes: List[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class LegacyBlockRemoved(LegacyKVCacheEvent, tag="BlockRemoved"):
    block_hashes: List[ExternalBlockHash]
    medium: Optional[str]


class LegacyAllBlocksCleared(LegacyKVCacheEvent, tag="AllBlocksCleared"):
    pass


class LegacyKVEventBatch(EventBatch):
    events: List[Union[LegacyBlockStored, LegacyBlockRemoved, LegacyAllBlocksCleared]]


_CLASSES: Dict[str, Tuple[Any, Any, Any, Any]] = {
    "0.32": (BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch),
    "0.11": (LegacyBlockStored, LegacyBlockRemoved, LegacyAllBlocksCleared,
             LegacyKVEventBatch),
}


def classes(schema: str = DEFAULT_SCHEMA) -> Tuple[Any, Any, Any, Any]:
    """``(BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch)`` of a schema."""
    try:
        return _CLASSES[schema]
    except KeyError:
        raise ValueError(f"schema: expected one of {SCHEMAS}, got {schema!r}") from None
