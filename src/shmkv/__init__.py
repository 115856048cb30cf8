"""shmkv: a paged KV cache for LLM inference in one POSIX shared-memory segment."""
from ._attention import get_num_threads, set_num_threads
from .cache import KVCache
from .config import CacheConfig
from .errors import (
    CacheFullError,
    LockTimeout,
    SegmentError,
    SequenceNotFound,
    ShmkvError,
    UntrustedSegmentError,
)

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "KVCache",
    "ShmkvError",
    "CacheFullError",
    "SequenceNotFound",
    "SegmentError",
    "LockTimeout",
    "UntrustedSegmentError",
    "set_num_threads",
    "get_num_threads",
    "RedisTier",
    "__version__",
]

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tier import RedisTier as RedisTier


def __getattr__(name: str) -> Any:
    # the remote tier is imported on first use: ``import shmkv`` never imports redis
    if name == "RedisTier":
        from .tier import RedisTier

        return RedisTier
    raise AttributeError(f"module 'shmkv' has no attribute {name!r}")
