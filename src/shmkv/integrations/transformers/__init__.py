"""Hugging Face transformers on a shmkv segment: ``ShmkvCache`` and ``attn_implementation="shmkv"``.

``ShmkvCache`` is a ``transformers.Cache`` whose keys and values live in a shmkv segment:
one shmkv sequence per batch row, blocks shared copy-on-write between beams, prompts
shared through the host-wide prefix cache.  Importing this module registers the
attention function ``"shmkv"`` (``AttentionInterface``) and its mask function
(``AttentionMaskInterface``: no dense mask is built, only a padding mask is passed on).

How the pieces meet (one forward of ``q_len`` tokens for ``B`` rows):

* ``update(k, v, layer)`` -- layer 0 opens a *step*: each row's sequence is grown by
  ``reserve(sid, q_len, tokens=...)`` (the forward's token ids, learnt by a pre-hook on
  the model's decoder, or the prompt's, so that the blocks they fill are published --
  generated tokens included); every layer then scatters its K/V into those slots with one
  ``write`` (one copy, ``[B, kv_heads, q_len, dim]`` -> slots); the last layer ``commit``\\ s
  the blocks the step filled.  Under ``"shmkv"`` attention it returns the new K/V only; under any
  other implementation ("sdpa", "eager", ...) it returns the whole K/V of the rows, read
  from the pools through the block tables (the one copy such an implementation needs).
* The ``"shmkv"`` attention function runs ``cache.attention`` straight over the block
  tables (decode, or causal chunked prefill with ``q_lens``): no gather, no copy of the
  cache.  A batch with padding (a 2-D mask with zeros) cannot be expressed as plain
  causal paged attention: it falls back to a dense masked attention over K/V read from
  the pools (correct, slower).
* ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` (beam search)
  map to ``fork`` / ``free``: a row used once keeps its sequence, every further use is a
  fork (blocks shared copy-on-write), unused rows are freed.

Requires torch and transformers (``pip install "shmkv[transformers]"``; without them this
import raises ``ImportError`` saying so); the versions tested are in ``shmkv._compat.TESTED``
(another version warns once, ``ShmkvVersionWarning``).
"""
from __future__ import annotations

from ..._compat import check as _check

_check("torch", what="shmkv.integrations.transformers")
_check("transformers", what="shmkv.integrations.transformers")

from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from .attention import ATTN_IMPLEMENTATION, shmkv_attention_forward, shmkv_mask  # noqa: E402
from .cache import ShmkvCache  # noqa: E402
from .calibrate import calibrate_kv_scales  # noqa: E402
from .config import config_for  # noqa: E402

__all__ = ["ShmkvCache", "calibrate_kv_scales", "config_for", "shmkv_attention_forward",
           "shmkv_mask", "ATTN_IMPLEMENTATION"]

AttentionInterface.register(ATTN_IMPLEMENTATION, shmkv_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, shmkv_mask)
