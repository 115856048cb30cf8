"""Zero-copy torch views of shmkv arrays: the pools, gather results, attention outputs.

``torch.from_numpy`` already shares memory with float32/float16 arrays, but numpy's
bfloat16 (``ml_dtypes.bfloat16``) is a type torch does not know.  These helpers
reinterpret such arrays through a ``uint16`` view, so a bfloat16 pool is also a
``torch.bfloat16`` tensor over the very same shared-memory bytes.  Requires torch (the
``shmkv[transformers]`` extra installs it); ``import shmkv`` never imports torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["as_tensor", "pool_tensors"]


def as_tensor(array: np.ndarray) -> "torch.Tensor":
    """A torch tensor sharing ``array``'s memory (float32, float16, bfloat16, float8 e4m3fn,
    ints).

    Raises TypeError for a non-ndarray or a dtype torch cannot view without a copy.
    Writable or not, the tensor aliases the array: writes through it land in the array.
    """
    import torch

    if not isinstance(array, np.ndarray):
        raise TypeError(f"array: expected numpy.ndarray, got {type(array).__name__}")
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    if array.dtype.name == "float8_e4m3fn":        # a float8_e4m3 pool's codes
        return torch.from_numpy(array.view(np.uint8)).view(torch.float8_e4m3fn)
    try:
        return torch.from_numpy(array)
    except TypeError as e:
        raise TypeError(f"array: dtype {array.dtype} has no zero-copy torch view ({e})") from None


def pool_tensors(cache, layer: int) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """``(k, v)``: torch views of ``cache.key_cache(layer)`` and ``cache.value_cache(layer)``,
    each ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the pool's dtype."""
    return as_tensor(cache.key_cache(layer)), as_tensor(cache.value_cache(layer))
