"""Hybrid models: what the connector does with sliding-window layers beside full
ones, and what it refuses.

Decision: the connector does **not** implement vLLM's ``SupportsHMA``; a sliding-window
model is served with vLLM's hybrid KV cache manager off -- vLLM's own rule for a connector
without ``SupportsHMA`` ("Turning off hybrid kv cache manager ...") -- so every attention
layer, sliding or full, is in one KV cache group whose blocks hold every token's K/V (the
window is applied by the attention kernel).  Such blocks are shared as full attention's
are: a shmkv block holds all layers of its tokens, and a later request can use any prefix.
The price is vLLM's memory (sliding layers keep the whole prefix), not correctness.

Why not ``SupportsHMA`` (the sliding groups keeping only the window): with HMA, vLLM frees
a sliding-window group's blocks once they leave the window (null blocks in its block
table), while one shmkv block holds every layer of its 16 tokens; a block whose sliding
layers were already freed could only be published with bytes missing, and a hit can end at
any block, so "store only what a later request can use" would need per-layer validity in
the segment format (or a second segment per group) -- not built.  Recomputing the sliding
groups instead would need vLLM to recompute a group alone, which its connector API has no
hook for.  Models whose groups cannot be merged at all (hybrid SSM / Mamba layers, which
require HMA) are refused by vLLM itself at start-up; if the connector is ever handed
several KV cache groups or a non-attention group, :func:`check_groups` refuses at engine
start with the reason.
"""
from __future__ import annotations

from typing import Any

__all__ = ["check_groups"]


def check_groups(kv_cache_config: Any) -> None:
    """ValueError naming the reason when the KV cache is not one group of attention layers
    (``kv_cache_config`` None: vLLM gave none; nothing to check)."""
    if kv_cache_config is None:
        return
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) > 1:
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise ValueError(
            f"shmkv: the KV cache has {len(groups)} groups ({', '.join(kinds)}): the "
            f"connector supports one group (vLLM's hybrid KV cache manager off, which vLLM "
            f"does for connectors without SupportsHMA); a shmkv block holds every layer of "
            f"its tokens, so groups whose blocks vLLM frees apart cannot be stored")
    from vllm.v1.kv_cache_interface import AttentionSpec

    for g in groups:
        spec = g.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise ValueError(f"shmkv: KV cache group of {type(spec).__name__} (layers "
                             f"{list(g.layer_names)[:3]}...): the connector stores attention "
                             f"K/V only (no SSM/Mamba state)")
