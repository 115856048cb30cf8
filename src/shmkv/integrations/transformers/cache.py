"""ShmkvCache: the transformers.Cache over a shmkv segment (rows, steps, beams, crop,
prefix reuse, hand-off).  See the package docstring for how the pieces meet; what a step
reserves and publishes, and the hooks that learn the ids, are in publish.py."""
from __future__ import annotations

import sys
import threading
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from shmkv.errors import CacheFullError

from ..torch_views import pool_tensors
from .publish import (  # with the rest of what moved to publish.py, importable here as before
    _SIGNATURES,  # noqa: F401
    _UNSAFE,
    _as_positions,  # noqa: F401
    _cache_arg,  # noqa: F401
    _decoder_of,
    _forward_args,  # noqa: F401
    _hook,
    _ids_post_hook,  # noqa: F401
    _ids_pre_hook,  # noqa: F401
    _Publishing,
    _running_decoder,
    _unsafe_forward,
)

#: the name under which the attention function is registered
ATTN_IMPLEMENTATION = "shmkv"


# ---- torch <-> numpy, zero-copy ---------------------------------------------------------
def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous CPU tensor (bfloat16 as ml_dtypes.bfloat16)."""
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


# The "shmkv" attention function must find the cache whose update produced its key
# states: transformers passes neither the cache nor the layer's cache object to it.  Each
# update leaves (cache, layer, key tensor) here; the attention function checks the key by
# identity, so a stale or foreign record is never used.
_TLS = threading.local()


def _caller_attn_implementation() -> Optional[str]:
    """The ``config._attn_implementation`` of the module whose forward called
    ``ShmkvCache.update`` (the standard ``past_key_values.update(k, v, self.layer_idx)``
    call of every transformers attention module), or None if no such module is found."""
    try:
        f = sys._getframe(2)
    except ValueError:            # called from the top of a stack
        return None
    for _ in range(3):
        if f is None:
            return None
        slf = f.f_locals.get("self")
        impl = getattr(getattr(slf, "config", None), "_attn_implementation", None)
        if impl is not None:
            return impl
        f = f.f_back
    return None


class _ShmkvLayer(CacheLayerMixin):
    """The per-layer view transformers iterates over (``cache.layers``); the data path is
    ``ShmkvCache.update``, which does every layer's work itself."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, cache: "ShmkvCache", layer_idx: int):
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return bool(self._cache._rows)

    @is_initialized.setter
    def is_initialized(self, value) -> None:
        pass

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int):
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length(self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass

    def offload(self):
        pass

    def prefetch(self):
        pass

    def crop(self, tokens_to_remove: int) -> None:  # the cache crops every layer at once
        pass

    def reorder_cache(self, beam_idx) -> None:
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass

    def batch_select_indices(self, indices) -> None:
        pass


class ShmkvCache(Cache, _Publishing):
    """A ``transformers.Cache`` over a shmkv segment: one shmkv sequence per batch row.

    Parameters
    ----------
    kv : shmkv.KVCache
        The segment (``KVCache.create`` / ``attach``), laid out for the model
        (:func:`config_for`).
    prompt_ids : torch.Tensor or ndarray [batch, len], optional
        The prompts ``generate`` will be called with.  Each row starts from the longest
        prefix of whole blocks any process of the host has published (at most ``len - 1``
        tokens; all rows start at the common minimum), and the prompt tokens this cache
        computes are published for every other process.  ``generate`` then computes only
        the rest (it slices ``input_ids`` by :meth:`get_seq_length`).
    salt : str or bytes, optional
        Prefix-cache salt (tenant isolation), with ``prompt_ids``.
    sequence_ids : list of int, optional
        Wrap existing sequences (e.g. just ``kv.adopt(sid)``-ed by a decode worker), one
        per batch row, all of the same length: their ``seq_len`` is the cached length.
    model : transformers model, optional
        :meth:`bind` it: the ids of every token the cache stores (prompt and generated)
        are learnt from the model's forwards, so every block they fill is published.
        Without it the cache binds the model on its first forward by itself (that forward's
        ids are then known only through ``prompt_ids``).
    precision : {"fp32", "bf16"}
        What ``attn_implementation="shmkv"`` asks the kernel for (``KVCache.attention``'s
        ``precision``): ``"fp32"``, the default, or the opt-in ``"bf16"`` (q and the softmax
        weights rounded to bf16, the CPU's bf16 / int8 dot instructions).  The K/V stored
        are the same either way; ``"sdpa"`` and ``"eager"`` ignore it.

    Notes
    -----
    The cache holds its sequences until :meth:`close` (or the ``with`` block, or the
    object being dropped) frees them, or :meth:`release` hands their ids back unfreed.
    Pool exhaustion during ``generate`` raises ``shmkv.CacheFullError`` after freeing
    everything the cache held.
    """

    is_compileable = False

    def __init__(self, kv, *, prompt_ids=None, salt=None,
                 sequence_ids: Optional[Sequence[int]] = None, model=None,
                 precision: str = "fp32"):
        if not isinstance(precision, str):
            raise TypeError(f"precision: expected str, got {type(precision).__name__}")
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision: expected one of ('fp32', 'bf16'), got {precision!r}")
        #: the kernel's precision under attn_implementation="shmkv"
        self.precision = precision
        cfg = kv.config
        self.kv = kv
        self._cfg = cfg
        self._num_layers = cfg.num_layers
        self._np_dtype = cfg.numpy_dtype
        # a quantized pool (int8, float8_e4m3) is written and read in float32 (its
        # compute dtype); write() quantizes, attention() dequantizes in registers
        self._torch_dtype = {"float32": torch.float32, "float16": torch.float16,
                             "bfloat16": torch.bfloat16}.get(cfg.dtype, torch.float32)
        self._rows: List[int] = []          # one sid per batch row
        self._len = 0                       # tokens every layer of every row holds
        self._step_n = 0                    # tokens of the open step (0: none open)
        self._step_layer = -1               # last layer written in the open step
        self._slots: Optional[np.ndarray] = None
        self._publish: List[int] = []       # sids to commit at the end of the step
        self._tables: Optional[torch.Tensor] = None
        self._pools: dict = {}
        self._prompt: Optional[np.ndarray] = None
        self._prompt_row: List[int] = []    # row -> row of prompt_ids
        self._salt = salt
        self._closed = False
        self._mode: Optional[str] = None
        # what the decoder's pre-hook saw of the forward now running (None outside one)
        self._seen: Optional[Tuple[Any, ...]] = None
        self._looked = False                # looked for the running model to bind
        super().__init__(layers=[_ShmkvLayer(self, i) for i in range(self._num_layers)])
        if sequence_ids is not None:
            sids = [int(s) for s in sequence_ids]
            lens = {kv.seq_len(s) for s in sids}
            if not sids:
                raise ValueError("sequence_ids: expected at least one sequence id")
            if len(lens) != 1:
                raise ValueError(f"sequence_ids: expected sequences of equal length, got "
                                 f"lengths {sorted(lens)}")
            self._rows = sids
            self._len = lens.pop()
            self._prompt_row = list(range(len(sids)))
        if prompt_ids is not None:
            ids = self._prompt_array(prompt_ids)
            if sequence_ids is not None:
                if ids.shape[0] != len(self._rows):
                    raise ValueError(f"prompt_ids: expected {len(self._rows)} rows (one per "
                                     f"sequence id), got {ids.shape[0]}")
                self._prompt = ids
            else:
                self._prompt = ids
                self._start_from_prefix(ids, salt)
        if model is not None:
            self.bind(model)

    # ---- construction (the prompt's start from the prefix cache: publish.py) -------------
    def bind(self, model) -> "ShmkvCache":
        """Learn token ids from ``model``'s forwards (returns ``self``).

        Registers, once per model (idempotent; inert for any other cache), a forward
        pre-hook and a forward hook on ``model.get_decoder()`` (the module that takes
        ``input_ids`` and ``past_key_values``).  From then on each step records the ids of
        the tokens it stores -- ``reserve(sid, n, tokens=ids)``, ``commit(sid)`` after the
        last layer -- so the blocks generated tokens fill are published like the prompt's.
        A forward fed ``inputs_embeds``, a padded batch (a mask with zeros) or positions
        other than the cache's next ones records nothing (the rows then stop being
        published: a wrong id would poison every process's prefix cache)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        _hook(_decoder_of(model))
        return self

    @property
    def mode(self) -> Optional[str]:
        """What :meth:`update` returns: ``None`` (default) asks the calling attention
        module's ``config._attn_implementation`` -- the new K/V for ``"shmkv"``, the whole
        K/V for any other; ``"paged"`` always the new K/V (only right under ``"shmkv"``);
        ``"full"`` always the whole K/V (right under every implementation)."""
        return self._mode

    @mode.setter
    def mode(self, value: Optional[str]) -> None:
        if value not in (None, "paged", "full"):
            raise ValueError(f"mode: expected None, 'paged' or 'full', got {value!r}")
        self._mode = value

    # ---- what transformers asks ---------------------------------------------------------
    @property
    def sequence_ids(self) -> List[int]:
        """One shmkv sequence id per batch row (empty before the first update)."""
        return list(self._rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached (before ``generate``: the prefix hit).  The same for every layer:
        the tokens of a forward count once its last layer has stored them, so a forward
        that raised half-way counts nothing (its tokens are dropped by the next one)."""
        return self._len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    def get_max_length(self, layer_idx=None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return len(self._rows) if self._rows else -1

    @property
    def is_initialized(self) -> bool:
        return bool(self._rows)

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_sliding(self) -> List[bool]:
        return [False] * self._num_layers

    @property
    def is_linear(self) -> List[bool]:
        return [False] * self._num_layers

    @property
    def is_dummy(self) -> List[bool]:
        return [False] * self._num_layers

    def __repr__(self) -> str:
        return (f"ShmkvCache({self.kv.name!r}, rows={self._rows}, seq_len={self._len}"
                f"{', closed' if self._closed else ''})")

    # ---- the data path ------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs):
        """Store this forward's K/V of ``layer_idx`` (``[batch, kv_heads, q_len, dim]``).

        Returns the new K/V under ``"shmkv"`` attention (which reads the pools itself),
        the rows' whole K/V otherwise."""
        if self._closed:
            raise ValueError("ShmkvCache: used after close() or release()")
        B, H, n, D = key_states.shape
        if layer_idx == 0:
            seen, self._seen = self._seen, None     # this forward's ids: used once
            if seen is None and not self._looked:
                self._looked = True                 # bind the model for its next forwards
                found = _running_decoder(self)
                if found is not None:
                    _hook(found[0])
                    if _unsafe_forward(found[1]):
                        seen = _UNSAFE              # this forward records nothing
            self._begin_step(B, n, seen)
        elif not self._step_n or layer_idx != self._step_layer + 1:
            raise ValueError(f"ShmkvCache.update: layer {layer_idx} out of order (expected "
                             f"layer {self._step_layer + 1 if self._step_n else 0})")
        elif n != self._step_n or B != len(self._rows):
            raise ValueError(f"ShmkvCache.update: layer {layer_idx} got {B} rows x {n} tokens,"
                             f" layer 0 of this step had {len(self._rows)} x {self._step_n}")
        self._write(layer_idx, key_states, value_states)
        self._step_layer = layer_idx
        if layer_idx == self._num_layers - 1:
            self._end_step()
        paged = self._mode == "paged" or (
            self._mode is None and _caller_attn_implementation() == ATTN_IMPLEMENTATION)
        if paged:
            _TLS.rec = (self, layer_idx, key_states)
            return key_states, value_states
        _TLS.rec = None
        return self._full_kv(layer_idx, self._len + self._step_n, key_states.dtype)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        B, H, n, D = k.shape
        # [B, H, n, D] -> [B*n, H, D]: a view when the projection left it [B, n, H, D]
        # in memory (the usual case), else the one copy into a contiguous buffer
        kk = k.detach().transpose(1, 2)
        vv = v.detach().transpose(1, 2)
        if kk.dtype != self._torch_dtype:
            kk, vv = kk.to(self._torch_dtype), vv.to(self._torch_dtype)
        kk = kk.reshape(B * n, H, D).contiguous()
        vv = vv.reshape(B * n, H, D).contiguous()
        if kk.device.type != "cpu":
            kk, vv = kk.cpu(), vv.cpu()
        self.kv.write(layer, self._slots, _np(kk), _np(vv))

    def _block_tables(self) -> torch.Tensor:
        if self._tables is None:
            tables, _ = self.kv.batch_block_tables(self._rows)
            self._tables = torch.from_numpy(tables.astype(np.int64))
        return self._tables

    def _pool(self, layer: int):
        p = self._pools.get(layer)
        if p is None:
            p = self._pools[layer] = pool_tensors(self.kv, layer)
        return p

    def _full_kv(self, layer: int, length: int, dtype: torch.dtype):
        """The rows' K/V ``[B, kv_heads, length, dim]`` read from the pools through the
        block tables (one copy, by torch indexing)."""
        bs = self._cfg.block_size
        nb = -(-length // bs)
        tab = self._block_tables()[:, :nb]
        if self._cfg.quantized:
            return self._full_kv_quantized(layer, length, tab, dtype)
        kp, vp = self._pool(layer)
        B = tab.shape[0]
        H, D = self._cfg.num_kv_heads, self._cfg.head_dim
        k = kp[tab].view(B, nb * bs, H, D)[:, :length].transpose(1, 2)
        v = vp[tab].view(B, nb * bs, H, D)[:, :length].transpose(1, 2)
        if k.dtype != dtype:
            k, v = k.to(dtype), v.to(dtype)
        return k, v

    def _full_kv_quantized(self, layer: int, length: int, tab: torch.Tensor,
                           dtype: torch.dtype):
        """_full_kv of a quantized pool: codes times scales, through the zero-copy views."""
        kv, cfg = self.kv, self._cfg
        t = tab.numpy()
        B, nb = t.shape
        H, D = cfg.num_kv_heads, cfg.head_dim
        out = []
        for codes, scales in ((kv.key_cache(layer), kv.key_scales(layer)),
                              (kv.value_cache(layer), kv.value_scales(layer))):
            x = codes[t].reshape(B, -1, H, D)[:, :length].astype(np.float32)
            if cfg.dtype == "int8":
                x *= scales[t].reshape(B, -1, H)[:, :length, :, None]
            else:
                x *= scales[None, None, :, None]
            out.append(torch.from_numpy(x).transpose(1, 2).to(dtype))
        return out[0], out[1]

    # ---- beams, crop --------------------------------------------------------------------
    def _select(self, indices: Iterable[int]) -> None:
        """New row i = old row indices[i]: the first use of an old row keeps its sequence,
        every further use forks it (copy-on-write), unused old rows are freed."""
        kv = self.kv
        old = self._rows
        idx = [int(i) for i in indices]
        R = len(old)
        for i in idx:
            if not 0 <= i < R:
                raise IndexError(f"ShmkvCache: row index {i} out of range for {R} rows")
        taken = [False] * R
        new: List[int] = []
        try:
            for i in idx:
                if taken[i]:
                    new.append(kv.fork(old[i]))
                else:
                    taken[i] = True
                    new.append(old[i])
        except CacheFullError:
            for sid, i in zip(new, idx):
                if sid != old[i]:
                    kv.free(sid)
            self._release_all()
            raise
        for i in range(R):
            if not taken[i]:
                kv.free(old[i])
        self._rows = new
        self._prompt_row = [self._prompt_row[i] for i in idx]
        self._tables = None

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: row i continues old row ``beam_idx[i]`` (forks, no copies)."""
        if self._rows:
            self._select(torch.as_tensor(beam_idx).tolist())

    def batch_select_indices(self, indices) -> None:
        if self._rows:
            self._select(torch.as_tensor(indices).tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._rows:
            self._select([i for i in range(len(self._rows)) for _ in range(int(repeats))])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens of every row (transformers' rule: a
        negative count; 0 is a no-op; a positive count is refused as by DynamicCache).

        Each row's sequence is truncated in place (``KVCache.truncate``: the ids in
        ``sequence_ids`` stay, blocks past the kept tokens are released, the hashes of
        the blocks kept whole stay published)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache "
                "instead.")
        if tokens_to_remove == 0 or not self._rows:
            return
        if self._step_n:
            self._rollback_step()
        keep = max(0, self._len + int(tokens_to_remove))
        for sid in self._rows:
            self.kv.truncate(sid, keep)
        self._len = keep
        self._tables = None

    def reset(self) -> None:
        """Free every row's sequence; the next update starts new ones."""
        self.close()
        self._closed = False

    # ---- lifetime -----------------------------------------------------------------------
    def _release_all(self) -> None:
        """Free every sequence this cache holds (pool exhaustion: nothing it took stays)."""
        rows, self._rows = self._rows, []
        self._prompt_row = []
        self._len = self._step_n = 0
        self._step_layer = -1
        self._publish = []
        self._tables = None
        err = None
        for sid in rows:
            try:
                self.kv.free(sid)
            except Exception as e:  # pragma: no cover - a sid freed behind our back
                err = err or e
        if err is not None:  # pragma: no cover
            raise err

    def release(self) -> List[int]:
        """Forget the sequences without freeing them and return their ids (one per row),
        e.g. to ``kv.detach`` them and hand them to another process.  An unfinished step
        is undone first."""
        if self._step_n:
            self._rollback_step()
        rows, self._rows = self._rows, []
        self._prompt_row = []
        self._len = 0
        self._tables = None
        self._closed = True
        return rows

    def close(self) -> None:
        """Free every sequence the cache still holds.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._rows and not self.kv.closed:
            self._release_all()
        self._rows = []

    def __enter__(self) -> "ShmkvCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
