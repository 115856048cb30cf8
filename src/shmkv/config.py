"""CacheConfig: the shape of a cache, immutable and validated on construction."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from ._sizes import DTYPES, HASHES, layout_of

if TYPE_CHECKING:
    import numpy as np

__all__ = ["CacheConfig", "DTYPES", "HASHES", "QUANTIZED"]

#: quantized pools: 1-byte codes plus float32 scales; read and written as
#: their compute dtype (float32)
QUANTIZED = ("int8", "float8_e4m3")

# Mirrors the SHMKV_MAX_* limits of _layout.h (checked again in C, where they are the law).
_LIMITS = {
    "num_layers": 4096,
    "num_kv_heads": 4096,
    "head_dim": 65536,
    "block_size": 65536,
    "num_blocks": 0x7FFFFFFE,
    "max_seqs": 1 << 24,
    "max_procs": 4096,
}

# Mirrors SHMKV_MAX_EVENTS / SHMKV_EVENT_MAX_TOKENS of _layout.h (the KV event ring).
_MAX_EVENTS = 1 << 24
_EVENT_MAX_TOKENS = 1024


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np  # numpy integers are integers too

            if isinstance(value, np.integer):
                return _check_int(name, int(value), lo, hi)
        except ImportError:  # pragma: no cover
            pass
        raise ValueError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: expected {lo} <= {name} <= {hi}, got {value}")


def _dtype_name(dtype: object) -> str:
    """A pool dtype's name: a name as it is, a numpy dtype or scalar type by its name
    (ml_dtypes' ``float8_e4m3fn`` is the pool ``"float8_e4m3"``)."""
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            import numpy as np

            name = np.dtype(dtype).name  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise ValueError(f"dtype: expected one of {sorted(DTYPES)} or a numpy dtype, "
                             f"got {dtype!r}") from None
        name = {"float8_e4m3fn": "float8_e4m3"}.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {dtype!r}")
    return name


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Shape of a paged KV cache.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model shape.  Each layer has a K and a V pool of
        ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    num_blocks : int
        Physical blocks in the pool, shared by all layers (one block id names the same
        position in every layer's pool).
    block_size : int
        Tokens per block.
    dtype : {"float16", "float32", "bfloat16", "int8", "float8_e4m3"} or a numpy dtype
        Element type of the pools.  A numpy dtype or scalar type (``np.float16``,
        ``np.dtype("float32")``, ``ml_dtypes.bfloat16``, ``ml_dtypes.float8_e4m3fn``) is
        taken as its name; the field always holds the name.  ``bfloat16`` and
        ``float8_e4m3`` need the ``ml_dtypes`` package for numpy arrays.  ``int8`` and
        ``float8_e4m3`` are *quantized*: ``int8`` is symmetric int8 with one float32
        scale per token and kv head (K and V apart), ``float8_e4m3`` is e4m3fn
        (``ml_dtypes.float8_e4m3fn``) with one float32 scale per layer and kv head
        (``KVCache.set_kv_scales``, default 1.0).  A quantized pool is written and read in
        its :attr:`compute_dtype` (float32): ``append``/``write`` take
        float32/float16/bfloat16 arrays and quantize, ``gather`` returns float32 (or, with
        ``raw=True``, the codes and scales).
    max_seqs : int
        Sequence slots in the segment.
    max_seq_len : int or None
        Longest sequence in tokens; rounded up to a multiple of ``block_size``.  ``None``
        (default) lets one sequence take the whole pool.  It sizes the block tables:
        ``max_seqs * max_seq_len / block_size * 4`` bytes.
    max_procs : int
        Process-table slots: processes that may be attached at once.
    hash : {"fast", "sha256"}
        Block-hash function of the prefix cache, fixed per segment.
    event_capacity : int
        KV events (``stored`` / ``removed`` / ``cleared``, vLLM's KV events) the segment
        keeps in its ring, 0 (default) turns them off.  Each takes one record of
        ``64 + 4 * block_size`` bytes (rounded to 64); at most 2**24, and ``block_size``
        at most 1024 while they are on (a ``stored`` event carries the block's token ids).

    Raises
    ------
    ValueError
        Naming the field, for any value out of range.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int = 16
    dtype: str = "float16"
    max_seqs: int = 1024
    max_seq_len: Optional[int] = None
    max_procs: int = 64
    hash: str = "fast"
    event_capacity: int = 0

    def __post_init__(self) -> None:
        for name, hi in _LIMITS.items():
            _check_int(name, getattr(self, name), 1, hi)
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        _check_int("event_capacity", self.event_capacity, 0, _MAX_EVENTS)
        object.__setattr__(self, "event_capacity", int(self.event_capacity))
        if self.event_capacity and self.block_size > _EVENT_MAX_TOKENS:
            raise ValueError(
                f"event_capacity: events carry a block's token ids, so block_size must be "
                f"<= {_EVENT_MAX_TOKENS} while they are on, got block_size {self.block_size}")
        if self.hash not in HASHES:
            raise ValueError(f"hash: expected one of {sorted(HASHES)}, got {self.hash!r}")
        whole = self.num_blocks * self.block_size
        if self.max_seq_len is None:
            msl = whole
        else:
            _check_int("max_seq_len", self.max_seq_len, 1, whole)
            msl = -(-int(self.max_seq_len) // self.block_size) * self.block_size
        object.__setattr__(self, "max_seq_len", msl)
        if self.dtype in ("bfloat16", "float8_e4m3"):
            try:
                import ml_dtypes  # noqa: F401
            except ImportError:
                raise ValueError(f"dtype: {self.dtype!r} needs the ml_dtypes package") from None
        # Sizes the C layout would reject (a segment over 2^48 bytes) fail here too.
        layout_of(self)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPES[self.dtype][1]

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of one block table."""
        assert self.max_seq_len is not None       # set by __post_init__
        return self.max_seq_len // self.block_size

    @property
    def quantized(self) -> bool:
        """True for the quantized pools (``int8``, ``float8_e4m3``)."""
        return self.dtype in QUANTIZED

    @property
    def bytes_per_token(self) -> int:
        """K+V bytes of one token over all layers (an int8 pool's per-token scales
        included: 4 bytes per kv head, K and V; float8's per-layer scales are not per
        token)."""
        per_head = self.head_dim * self.itemsize + (4 if self.dtype == "int8" else 0)
        return 2 * self.num_layers * self.num_kv_heads * per_head

    @property
    def bytes_per_block(self) -> int:
        """K+V bytes of one block over all layers."""
        return self.bytes_per_token * self.block_size

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the pools."""
        import numpy as np

        if self.dtype in ("bfloat16", "float8_e4m3"):
            import ml_dtypes

            ml: np.dtype[Any] = np.dtype(
                ml_dtypes.bfloat16 if self.dtype == "bfloat16" else ml_dtypes.float8_e4m3fn)
            return ml
        return np.dtype(self.dtype)

    @property
    def compute_dtype(self) -> np.dtype[Any]:
        """The numpy dtype K/V are read and written in: float32 for a quantized pool
        (what ``gather`` returns and ``append``/``write`` take, besides float16 and
        bfloat16), the pool's own dtype otherwise."""
        import numpy as np

        if self.quantized:
            return np.dtype(np.float32)
        return self.numpy_dtype

    def segment_size(self) -> int:
        """Bytes of the shared-memory segment this config lays out."""
        return layout_of(self)["segment_size"]
