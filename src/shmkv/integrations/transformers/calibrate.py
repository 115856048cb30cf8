"""calibrate_kv_scales: a float8_e4m3 pool's per-(layer, kv head) K/V scales from sample text.

A float8_e4m3 pool stores ``e4m3(x / scale[layer, head])`` (3 mantissa bits, saturating at
+-448 * scale, subnormal below 2**-6 * scale).  Within the normal range a scale does not change
the *relative* precision of a value, only where it falls on the code grid; what a scale
changes is which values saturate (too small a scale), which fall into the subnormals (too
large a scale) and the grid's phase.  This module runs the model on sample tokens with a
``DynamicCache`` (the float K/V as the model computes them, keys after RoPE, exactly what
``ShmkvCache`` would store), then chooses a scale per (layer, kv head) of K and of V by a
rule and sets it with ``kv.set_kv_scales``:

* ``"amax"`` (default): ``amax / 448 * margin`` (vLLM's ``calculate_kv_scales``; ``margin``
  > 1 leaves room for later tokens larger than the sample's): nothing of the sample
  saturates and the smallest heads' values stay out of the subnormals;
* ``"mse"``: the scale whose e4m3 round trip of the sample has the least squared error,
  searched over ``amax / 448 * 2**(j / 16)`` for ``j`` in ``[-32, 32]`` (saturating rare
  outliers is allowed when it pays): it tunes the grid's phase to the sample's values;
* ``"one"``: 1.0 for every head (the pool's default; sets them back).

``benchmarks/quant_accuracy.py`` measures the rules on real text (RESULTS_quant.md): on
SmolLM2-135M the rules land within the spread that the grid's phase alone gives (random
scales between amax/448 and 2 amax/448), because the model's K/V sit well inside e4m3's
range whatever the rule; "amax" is the default for its guarantee (no saturation of the
sample, whatever the model's magnitudes), not for a measured gain over 1.0 on this model.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

__all__ = ["calibrate_kv_scales", "kv_scale_rule", "KV_SCALE_RULES"]

#: the largest finite float8_e4m3 (fn) value: the pool saturates there
E4M3_MAX = 448.0
#: the rules :func:`calibrate_kv_scales` knows
KV_SCALE_RULES = ("amax", "mse", "one")
#: the "mse" rule's search: amax / 448 * 2**(j / _STEPS) for j in [-_SPAN, _SPAN]
_STEPS, _SPAN = 16, 32


def _e4m3_roundtrip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [..., heads, n] as a float8_e4m3 pool with per-head ``scale`` [heads, 1] reads
    it back: saturated to +-448, rounded to nearest even."""
    q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.to(torch.float32) * scale


def kv_scale_rule(x: torch.Tensor, rule: str = "amax", margin: float = 1.0) -> np.ndarray:
    """Scales for one layer's keys or values: ``x`` [heads, n] (every sample value of each
    kv head, float32) -> float32 [heads] by ``rule`` (see the module docstring)."""
    if rule not in KV_SCALE_RULES:
        raise ValueError(f"rule: expected one of {KV_SCALE_RULES}, got {rule!r}")
    if not (np.isfinite(margin) and margin > 0):
        raise ValueError(f"margin: expected a finite number > 0, got {margin!r}")
    x = x.to(torch.float32)
    heads = x.shape[0]
    if rule == "one":
        return np.ones(heads, np.float32)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("calibrate_kv_scales: the sample K/V hold NaN or inf")
    amax = x.abs().amax(dim=1).clamp_min(1e-30)            # [heads]
    base = amax / E4M3_MAX
    if rule == "amax":
        return (base * margin).numpy().astype(np.float32)
    best = torch.full((heads,), float("inf"))
    pick = base.clone()
    for j in range(-_SPAN, _SPAN + 1):
        s = base * 2.0 ** (j / _STEPS)
        err = ((_e4m3_roundtrip(x, s[:, None]) - x) ** 2).mean(dim=1)
        better = err < best
        best = torch.where(better, err, best)
        pick = torch.where(better, s, pick)
    return (pick * margin).numpy().astype(np.float32)


def calibrate_kv_scales(model, kv, input_ids, *, rule: str = "amax", margin: float = 1.0,
                        chunk: int = 512) -> Tuple[np.ndarray, np.ndarray]:
    """Set a float8_e4m3 pool's K/V scales from the model's K/V on sample tokens.

    Parameters
    ----------
    model : a transformers causal LM (its attention implementation is left as it is;
        "shmkv" runs dense attention over a ``DynamicCache``)
    kv : shmkv.KVCache
        A float8_e4m3 segment laid out for the model (:func:`config_for`); every attached
        process sees the new scales.  Set them before the pool holds data: data already
        written is read with the new scales.
    input_ids : torch.Tensor or array [batch, len] (or [len])
        Sample text, ideally like what will be served (a few hundred tokens or more).
    rule : "amax" (default), "mse" or "one" -- see the module docstring.
    margin : float
        Multiplies every scale (e.g. 2.0 with "amax" for headroom).
    chunk : int
        Tokens per forward (bounds the memory of the attention).

    Returns
    -------
    (k_scales, v_scales): float32 arrays [num_layers, num_kv_heads], as set.

    Raises
    ------
    TypeError
        ``kv`` is not a float8_e4m3 pool.
    ValueError
        Bad ``rule``, ``margin``, ``chunk`` or ``input_ids``; the model's layer or head count
        differs from the pool's; the sample K/V are not finite.  Nothing is set on an error.
    """
    from transformers import DynamicCache

    cfg = kv.config
    if cfg.dtype != "float8_e4m3":
        raise TypeError(f"calibrate_kv_scales: expected a float8_e4m3 pool, got {cfg.dtype}")
    if rule not in KV_SCALE_RULES:
        raise ValueError(f"rule: expected one of {KV_SCALE_RULES}, got {rule!r}")
    if not (isinstance(margin, (int, float)) and np.isfinite(margin) and margin > 0):
        raise ValueError(f"margin: expected a finite number > 0, got {margin!r}")
    if not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"chunk: expected an int >= 1, got {chunk!r}")
    ids = torch.as_tensor(np.asarray(input_ids) if not isinstance(input_ids, torch.Tensor)
                          else input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[1] < 1 or ids.dtype.is_floating_point:
        raise ValueError(f"input_ids: expected integer ids of shape [batch, len >= 1], got "
                         f"{tuple(ids.shape)} {ids.dtype}")
    ids = ids.to(torch.long)
    past = DynamicCache()
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            model(input_ids=ids[:, s:s + chunk], past_key_values=past, use_cache=True)
    layers = past.layers
    if len(layers) != cfg.num_layers:
        raise ValueError(f"calibrate_kv_scales: the pool has {cfg.num_layers} layers, the "
                         f"model {len(layers)}")
    ks, vs = [], []
    for lyr in layers:
        k, v = lyr.keys, lyr.values                       # [batch, heads, len, dim]
        if k.shape[1] != cfg.num_kv_heads:
            raise ValueError(f"calibrate_kv_scales: the pool has {cfg.num_kv_heads} kv "
                             f"heads, the model {k.shape[1]}")
        for x, acc in ((k, ks), (v, vs)):
            acc.append(kv_scale_rule(x.detach().float().transpose(0, 1).reshape(x.shape[1], -1),
                                     rule, margin))
    k_scales, v_scales = np.stack(ks), np.stack(vs)
    for name, a in (("k", k_scales), ("v", v_scales)):   # all checked before any is set
        if not (np.isfinite(a).all() and (a > 0).all() and (a < 3.0e38).all()):
            raise ValueError(f"calibrate_kv_scales: the {name} scales came out of range "
                             f"(min {a.min()}, max {a.max()}); the sample K/V are unusable")
    for layer in range(cfg.num_layers):
        kv.set_kv_scales(layer, k_scales[layer], v_scales[layer])
    return k_scales, v_scales
