"""What the connector's scheduler half hands its worker half each step (vLLM passes it
between the processes): the loads and saves of this step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["LoadOp", "SaveOp", "ShmkvConnectorMetadata"]


@dataclass
class LoadOp:
    req_id: str
    tokens: np.ndarray          # int32 ids of tokens [0, end), plus one more (never hashed)
    salt: str
    start: int                  # first token to load (vLLM-block aligned)
    end: int                    # one past the last (shmkv-block aligned)
    block_ids: list[int]        # vLLM blocks holding tokens [start, end), in order
    hashes: Optional[list[Any]] = None   # vLLM's hashes of its blocks [0, end) (events on)
    lora_name: Optional[str] = None


@dataclass
class SaveOp:
    req_id: str
    tokens: np.ndarray          # int32 ids of tokens [0, end) (end: vLLM-block aligned)
    salt: str
    block_ids: list[int]        # vLLM blocks of tokens [0, end), in order
    hashes: Optional[list[Any]] = None   # vLLM's hashes of those blocks (events on)
    lora_name: Optional[str] = None


@dataclass
class ShmkvConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
