"""The "shmkv" attention function (paged attention over the block tables of the ShmkvCache
that produced the key states) and its mask function (no dense mask)."""
from __future__ import annotations

from typing import Optional

import torch

from . import cache as _cache
from .cache import ATTN_IMPLEMENTATION, _np

__all__ = ["ATTN_IMPLEMENTATION", "shmkv_attention_forward", "shmkv_mask"]


def _dense_attention(query, key, value, pad_mask, scaling, causal, sliding_window=None):
    """softmax(q k^T) v over dense K/V with a boolean mask (padding, causality); the
    fallback for what plain causal paged attention cannot express.  Returns
    ``[B, q_len, heads, dim]``."""
    B, Hq, q, D = query.shape
    Hk, kvlen = key.shape[1], key.shape[2]
    if Hq != Hk:
        rep = Hq // Hk
        key = key[:, :, None].expand(B, Hk, rep, kvlen, D).reshape(B, Hq, kvlen, D)
        value = value[:, :, None].expand(B, Hk, rep, kvlen, D).reshape(B, Hq, kvlen, D)
    mask = torch.ones(B, 1, q, kvlen, dtype=torch.bool, device=query.device)
    if causal:
        qpos = torch.arange(q, device=query.device)[:, None] + (kvlen - q)
        kpos = torch.arange(kvlen, device=query.device)[None, :]
        mask = mask & (kpos <= qpos)
        if sliding_window:
            mask = mask & (kpos > qpos - sliding_window)
    if pad_mask is not None:
        mask = mask & pad_mask[:, None, None, -kvlen:].to(torch.bool)
    # a query that may see nothing (a left pad) attends everywhere instead of giving NaN
    mask = mask | ~mask.any(dim=-1, keepdim=True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.to(query.dtype), value.to(query.dtype), attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


def shmkv_attention_forward(module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask, scaling: Optional[float] = None,
                            dropout: float = 0.0, **kwargs):
    """``attn_implementation="shmkv"``: paged attention over the block tables of the
    ``ShmkvCache`` that produced ``key`` (``query [B, heads, q_len, dim]``; returns
    ``([B, q_len, heads, dim], None)``)."""
    rec = getattr(_cache._TLS, "rec", None)
    _cache._TLS.rec = None
    if dropout and module.training:
        raise ValueError("shmkv attention: dropout in training mode is not supported "
                         "(it is an inference kernel); use attn_implementation='sdpa'")
    for what in ("softcap", "sinks"):
        if kwargs.get(what) is not None or getattr(module, what, None) is not None:
            raise ValueError(f"shmkv attention: attention {what} are not supported; use "
                             f"attn_implementation='sdpa'")
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    causal = getattr(module, "is_causal", True)
    pad = attention_mask
    if pad is not None and pad.ndim == 4:
        raise ValueError("shmkv attention: a 4-D attention mask is not supported; pass a 2-D "
                         "padding mask or use attn_implementation='sdpa'")
    if pad is not None and bool(pad.all()):
        pad = None
    if rec is None or rec[2] is not key:
        # K/V not from a ShmkvCache (no cache, or another Cache class): dense attention
        return _dense_attention(query, key, value, pad, scaling, causal, window), None
    cache, layer, _ = rec
    B, Hq, q, D = query.shape
    if pad is not None or window or (not causal and q > 1):
        if cache._prompt is not None and pad is not None:
            raise ValueError("ShmkvCache(prompt_ids=...): a padded batch cannot be shared "
                             "through the prefix cache (the positions of its tokens depend on "
                             "the padding); pass unpadded prompts of equal length")
        k, v = cache._full_kv(layer, cache._len + cache._step_n, query.dtype)
        return _dense_attention(query, k, v, pad, scaling, causal, window), None
    # [B, Hq, q, D] -> rows [B*q, Hq, D] in sequence order (a view in the usual layout)
    qq = query.detach().transpose(1, 2).reshape(B * q, Hq, D)
    qdt = qq.dtype
    if qdt not in (torch.float32, torch.float16) and qdt != cache._torch_dtype:
        qq = qq.to(torch.float32)
    qq = qq.contiguous()
    if qq.device.type != "cpu":
        qq = qq.cpu()
    out = torch.empty((B * q, Hq, D), dtype=torch.float32)
    cache.kv.attention(layer, _np(qq), cache._rows, q_lens=None if q == 1 else [q] * B,
                       scale=scaling, out=out.numpy(), precision=cache.precision)
    out = out.view(B, q, Hq, D)
    if out.dtype != query.dtype or out.device != query.device:
        out = out.to(device=query.device, dtype=query.dtype)
    return out, None


def shmkv_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
               kv_offset: int = 0, mask_function=None, attention_mask=None, **kwargs):
    """The mask function for ``"shmkv"``: no dense mask (the kernel is causal by
    construction); a 2-D padding mask is passed on only when it has a zero."""
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            attention_mask = None
    return attention_mask
