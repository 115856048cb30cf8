"""config_for: a shmkv.CacheConfig laid out for a transformers model config."""
from __future__ import annotations

import torch

import shmkv

_TORCH_TO_SHMKV = {torch.float32: "float32", torch.float16: "float16",
                   torch.bfloat16: "bfloat16"}


def _dtype_name(dtype) -> str:
    if dtype is None:
        return "float32"
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), dtype)
    if dtype in _TORCH_TO_SHMKV:
        return _TORCH_TO_SHMKV[dtype]
    raise ValueError(f"dtype: expected torch.float32, float16 or bfloat16, got {dtype}")


def config_for(model_config, *, num_blocks: int, block_size: int = 16, max_seqs: int = 256,
               dtype=None, **kwargs) -> "shmkv.CacheConfig":
    """A ``shmkv.CacheConfig`` for a transformers model config.

    Reads ``num_hidden_layers``, ``num_key_value_heads`` (default: ``num_attention_heads``)
    and ``head_dim`` (default: ``hidden_size // num_attention_heads``) from the decoder's
    text config; ``dtype`` (a torch dtype or a shmkv dtype name) defaults to the model's
    (``config.dtype``; float32 when unset); ``"int8"`` or ``"float8_e4m3"`` give a
    quantized pool, read and written in float32.  Other keyword arguments go to ``CacheConfig``
    (``max_seq_len``, ``hash``, ...).
    """
    cfg = model_config
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if dtype is None:
        dtype = getattr(cfg, "dtype", None)
        name = _dtype_name(dtype)
    elif isinstance(dtype, str) and dtype in ("float32", "float16", "bfloat16", "int8",
                                              "float8_e4m3"):
        name = dtype
    else:
        name = _dtype_name(dtype)
    return shmkv.CacheConfig(num_layers=cfg.num_hidden_layers, num_kv_heads=kv_heads,
                             head_dim=head_dim, num_blocks=num_blocks, block_size=block_size,
                             dtype=name, max_seqs=max_seqs, **kwargs)
