"""Publishing what a ShmkvCache stores: the token ids of every forward, learnt by hooks on
the model's decoder, and the step that stores a forward's tokens with those ids (``reserve``
with ``tokens=``, ``commit`` after the last layer) so that the blocks they fill are
published for every process of the host; its undo, and a prompt's start from the blocks
other processes published.

``_Publishing`` is the part of ``ShmkvCache`` (cache.py) that does this; the fields it
reads and writes are set up by ``ShmkvCache.__init__``: ``kv``, ``_rows``,
``_prompt_row``, ``_len``, ``_step_n``, ``_step_layer``, ``_slots``, ``_publish``,
``_tables``, ``_prompt``, ``_seen``.  The hooks hand ids only to a ``_Publishing`` cache
and are inert for any other."""
from __future__ import annotations

import inspect
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from shmkv.errors import CacheFullError

# ---- learning the token ids of every forward ----------------------------------------------
# ``update`` gets K/V, never the ids they were computed from.  A forward pre-hook on the
# model's decoder (the module that takes ``input_ids`` and ``past_key_values``, named
# ``cache`` from transformers 5.24: both are looked for) hands a
# ShmkvCache the ids, the padding mask and the positions of the forward it is about to run;
# a forward hook (always called, also when the forward raises) takes them back.  Layer 0's
# ``update`` uses them only when they have its shape [batch, n], the positions are the
# cache's next n and nothing is padded: never a wrong id (a hash of wrong ids would poison
# the host's prefix cache).  The hooks are inert for any other cache.
_SIGNATURES: Dict[type, inspect.Signature] = {}


def _forward_args(module: torch.nn.Module, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """The decoder forward's arguments by name (positional ones bound by its signature)."""
    if not args:
        return kwargs
    sig = _SIGNATURES.get(type(module))
    if sig is None:
        sig = _SIGNATURES[type(module)] = inspect.signature(module.forward)
    try:
        return dict(sig.bind_partial(*args, **kwargs).arguments)
    except TypeError:
        return {}


def _cache_arg(a: Dict[str, Any]) -> Any:
    """The cache a forward was given: ``past_key_values`` (transformers <= 5.23) or
    ``cache`` (5.24 renamed the argument of every model's forward; ``past_key_values`` is
    deprecated until 5.40, translated to ``cache`` by a decorator on the forward, so a
    forward hook sees whichever name the caller used and ``generate`` passes ``cache``)."""
    past = a.get("past_key_values")
    return a.get("cache") if past is None else past


def _ids_pre_hook(module, args, kwargs):
    a = _forward_args(module, args, kwargs)
    past = _cache_arg(a)
    if isinstance(past, _Publishing):
        past._seen = (a.get("input_ids"), a.get("attention_mask"), a.get("position_ids"),
                      a.get("cache_position"), a.get("inputs_embeds"))
    return None


def _ids_post_hook(module, args, kwargs, output):
    past = _cache_arg(_forward_args(module, args, kwargs))
    if isinstance(past, _Publishing):
        past._seen = None
    return None


def _decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module that embeds the ids: ``model.get_decoder()`` where it answers with a
    module (a multimodal wrapper's language model then gets embeddings, not ids, and
    nothing is recorded), else ``model`` itself."""
    get = getattr(model, "get_decoder", None)
    if callable(get):
        try:
            dec = get()
        except Exception:
            dec = None
        if isinstance(dec, torch.nn.Module):
            return dec
    return model


def _hook(decoder: torch.nn.Module) -> None:
    """Registers the two hooks on ``decoder`` once (idempotent)."""
    if any(h is _ids_pre_hook for h in decoder._forward_pre_hooks.values()):
        return
    decoder.register_forward_pre_hook(_ids_pre_hook, with_kwargs=True)
    decoder.register_forward_hook(_ids_post_hook, with_kwargs=True, always_call=True)


def _running_decoder(cache: "_Publishing") -> Optional[Tuple[torch.nn.Module, Dict[str, Any]]]:
    """The model (a ``PreTrainedModel``) whose forward called ``update`` with ``cache`` as
    its ``past_key_values`` (``cache`` from transformers 5.24; the innermost such frame
    within a few of the caller's), with
    that frame's locals."""
    from transformers import PreTrainedModel

    try:
        f = sys._getframe(2)
    except ValueError:            # called from the top of a stack
        return None
    for _ in range(24):
        if f is None:
            return None
        loc = f.f_locals
        if ((loc.get("past_key_values") is cache or loc.get("cache") is cache)
                and isinstance(loc.get("self"), PreTrainedModel)):
            return loc["self"], loc
        f = f.f_back
    return None


#: a forward whose ids must not be recorded
_UNSAFE: Tuple[Any, ...] = (None, None, None, None, None)


def _unsafe_forward(loc: Dict[str, Any]) -> bool:
    """Whether the locals of a decoder forward show a padded batch (a 2-D mask with a
    zero) or embeddings fed instead of ids: only a veto (a forward not bound yet is
    otherwise recorded from ``prompt_ids``)."""
    m = loc.get("attention_mask")
    if isinstance(m, torch.Tensor) and m.ndim == 2 and not bool(m.all()):
        return True
    return "input_ids" in loc and loc["input_ids"] is None


def _as_positions(x, n: int) -> Optional[np.ndarray]:
    if not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.shape[-1] != n:
        return None
    return x.detach().cpu().numpy()


class _Publishing:
    """The steps of a ShmkvCache: what each forward reserves, with which ids, and what it
    publishes (a mixin of ``ShmkvCache``; see the module docstring for its fields)."""

    # ---- construction ------------------------------------------------------------------
    @staticmethod
    def _prompt_array(prompt_ids) -> np.ndarray:
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.detach().cpu().numpy()
        ids = np.asarray(prompt_ids)
        if ids.ndim == 1:
            ids = ids[None, :]
        if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
            raise ValueError(f"prompt_ids: expected shape [batch, len >= 1], got {ids.shape}")
        if ids.dtype.kind not in "iu":
            raise TypeError(f"prompt_ids: expected integer token ids, got {ids.dtype}")
        return np.ascontiguousarray(ids, dtype=np.int32)

    def _start_from_prefix(self, ids: np.ndarray, salt) -> None:
        kv = self.kv
        m = min(kv.match_prefix(row, salt) for row in ids)
        for _ in range(8):            # a hit can be evicted between match and create
            sids: List[int] = []
            try:
                for row in ids:
                    # tokens [0, m + 1): shares at most the m tokens of whole blocks
                    sids.append(kv.create_sequence(tokens=row[:m + 1], salt=salt))
                lens = [kv.seq_len(s) for s in sids]
            except BaseException:
                for s in sids:
                    kv.free(s)
                raise
            if min(lens) == max(lens) == m:
                break
            for s in sids:
                kv.free(s)
            m = min(lens)
        else:  # pragma: no cover - needs a pathological eviction race
            raise RuntimeError("ShmkvCache: the prefix hit kept changing under eviction")
        self._rows = sids
        self._len = m
        self._prompt_row = list(range(len(sids)))

    # ---- a step: reserve with the forward's ids, commit after the last layer ------------
    def _begin_step(self, B: int, n: int, seen=None) -> None:
        kv = self.kv
        try:
            if self._step_n:              # the previous forward died half-way: undo it
                self._rollback_step()
            if not self._rows:
                for r in range(B):        # one by one: a failure leaves none unaccounted
                    self._rows.append(kv.create_sequence())
                    self._prompt_row.append(r)
            elif B != len(self._rows):
                R = len(self._rows)
                if B % R:
                    raise ValueError(f"ShmkvCache: a batch of {B} rows, but the cache holds "
                                     f"{R} sequences (expected a multiple of {R})")
                self._select([i for i in range(R) for _ in range(B // R)])
            parts, publish = [], []
            start = self._len
            ids = self._forward_ids(seen, B, n, start)
            if ids is not None:           # checked before anything is reserved
                for r in range(B):
                    toks = self._prompt_tokens(r, start, n)
                    if toks is not None and not np.array_equal(ids[r, :len(toks)], toks):
                        raise ValueError(
                            f"ShmkvCache: row {r} is fed token ids that differ from its "
                            f"prompt_ids at positions [{start}, {start + len(toks)}): "
                            f"expected {toks.tolist()[:16]}, got {ids[r, :len(toks)].tolist()[:16]}"
                            f" (first 16)")
            for r, sid in enumerate(self._rows):
                toks = self._prompt_tokens(r, start, n) if ids is None else ids[r]
                if toks is None or (seen is not None and ids is None):
                    # unknown ids (or a forward whose ids are not safe to record): the
                    # row stops being hashed from here on
                    parts.append(kv.reserve(sid, n))
                else:
                    k = len(toks)
                    parts.append(kv.reserve(sid, k, tokens=toks))
                    if k < n:
                        parts.append(kv.reserve(sid, n - k))
                    publish.append(sid)
        except CacheFullError:
            self._release_all()
            raise
        except BaseException:
            # leave the rows as they were before this step
            self._step_n = n
            self._rollback_step()
            raise
        self._slots = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self._publish = publish
        self._step_n = n
        self._step_layer = -1
        self._tables = None

    @staticmethod
    def _forward_ids(seen, B: int, n: int, start: int) -> Optional[np.ndarray]:
        """The ids ``[B, n]`` (int32) of the forward the decoder's pre-hook saw, when it is
        safe to record them: integer ids of this step's shape, no ``inputs_embeds``, no
        padding (a 2-D mask of ones, or none), positions ``start .. start + n - 1``."""
        if seen is None:
            return None
        ids, mask, pos, cpos, embeds = seen
        if (embeds is not None or not isinstance(ids, torch.Tensor)
                or ids.dtype not in (torch.int64, torch.int32) or tuple(ids.shape) != (B, n)):
            return None
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.ndim != 2
                                 or mask.shape[0] != B or not bool(mask.all())):
            return None
        want = np.arange(start, start + n)
        for p in (pos, cpos):
            if p is None:
                continue
            a = _as_positions(p, n)        # [n], [1, n] or [B, n]
            if (a is None or a.ndim > 2 or (a.ndim == 2 and a.shape[0] not in (1, B))
                    or not bool((a == want).all())):
                return None
        out = ids.detach().cpu().numpy()
        if out.size and (out.min() < 0 or out.max() > np.iinfo(np.int32).max):
            return None
        return np.ascontiguousarray(out, dtype=np.int32)

    def _prompt_tokens(self, row: int, start: int, n: int) -> Optional[np.ndarray]:
        """The prompt's token ids at [start, start + n) of ``row`` (only the part inside the
        prompt), or None."""
        if self._prompt is None:
            return None
        T = self._prompt.shape[1]
        if start >= T:
            return None
        return self._prompt[self._prompt_row[row], start:min(start + n, T)]

    def _end_step(self) -> None:
        for sid in self._publish:
            self.kv.commit(sid)
        self._publish = []
        self._len += self._step_n
        self._step_n = 0
        self._step_layer = -1

    def _rollback_step(self) -> None:
        """Undo a step that was opened but not finished (an exception inside the forward):
        every row is truncated back to the last finished step, in place (same ids)."""
        keep = self._len
        self._step_n = 0
        self._step_layer = -1
        self._publish = []
        for sid in self._rows:
            if self.kv.seq_len(sid) != keep:
                self.kv.truncate(sid, keep)
        self._tables = None
