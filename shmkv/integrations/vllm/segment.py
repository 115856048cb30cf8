"""The segment a vLLM instance shares: its layout derived from vLLM's model config, the
extra-config keys that size a new one, and attach-or-create with the fit check.

A segment fits a model when num_layers, num_kv_heads, head_dim and dtype are the model's
(as this worker sees them) and its block_size divides vLLM's; anything else is refused
with both layouts in the message, at engine start.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

import shmkv

from .tier import seed_for, tier_spec

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig

__all__ = ["SegmentSpec", "segment_spec", "open_segment"]

log = logging.getLogger("vllm.shmkv")

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
_DEFAULT_GIB = 1.0
DEFAULT_BLOCK = 16


@dataclass(frozen=True)
class SegmentSpec:
    name: str
    config: shmkv.CacheConfig       # what a new segment gets
    vllm_block_size: int
    hash_seed: Optional[int] = None  # a new segment's (hosts sharing a tier share it)


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"shmkv: KV dtype {dtype} is not supported (expected one of "
                         f"{sorted(_DTYPES)})")
    return _DTYPES[name]


def segment_spec(vllm_config: "VllmConfig", extra: Mapping[str, Any]) -> SegmentSpec:
    """The segment's name and the config a new one gets, from the model and the extra
    config (``segment``, ``num_blocks`` | ``size_gib``, ``block_size``, ``max_seqs``,
    ``hash_seed``; with a tier, tier.seed_for's default)."""
    name = extra.get("segment")
    if not isinstance(name, str) or not name.strip("/"):
        raise ValueError("shmkv: kv_connector_extra_config needs \"segment\": a segment name, "
                         f"got {name!r}")
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    if tp != 1 or pp != 1:
        # each rank holds a slice of the heads or layers: they would share shmkv blocks
        raise ValueError(f"shmkv: the connector supports one worker per instance "
                         f"(tensor_parallel_size 1, pipeline_parallel_size 1), got {tp}, {pp}")
    if cc.cache_dtype not in ("auto", None) and not str(cc.cache_dtype).startswith(
            ("float32", "float16", "bfloat16")):
        raise ValueError(f"shmkv: kv_cache_dtype {cc.cache_dtype!r} is not supported "
                         "(the connector stores the model's dtype)")
    vb = int(cc.block_size)
    # 16 by default (when it divides vLLM's): a hit ends at a 16-token boundary, so vLLM
    # recomputes at most 16 tokens of a prompt whose prefix is all there, not a whole block
    bs = int(extra.get("block_size", DEFAULT_BLOCK if vb % DEFAULT_BLOCK == 0 else vb))
    if bs < 1 or vb % bs:
        raise ValueError(f"shmkv: block_size must divide vLLM's block size {vb}, got {bs}")
    layers = mc.get_num_layers(pc)
    heads = mc.get_num_kv_heads(pc)
    head_dim = mc.get_head_size()
    dtype = _dtype_name(mc.dtype)
    per_block = 2 * layers * heads * head_dim * bs * (4 if dtype == "float32" else 2)
    if "num_blocks" in extra:
        num_blocks = int(extra["num_blocks"])
    else:
        num_blocks = max(64, int(float(extra.get("size_gib", _DEFAULT_GIB)) * 2**30 // per_block))
    max_seqs = int(extra.get("max_seqs", 256))
    cfg = shmkv.CacheConfig(num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                            num_blocks=num_blocks, block_size=bs, dtype=dtype,
                            max_seqs=max_seqs,
                            event_capacity=int(extra.get("event_capacity", 4096)))
    return SegmentSpec(name=name, config=cfg, vllm_block_size=vb,
                       hash_seed=seed_for(extra, tier_spec(extra)))


def check_fit(cfg: shmkv.CacheConfig, want: shmkv.CacheConfig, vb: int, name: str) -> None:
    """SegmentError naming both layouts when the segment cannot hold this model's K/V."""
    got = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
    exp = (want.num_layers, want.num_kv_heads, want.head_dim, want.dtype)
    if got != exp or vb % cfg.block_size:
        raise shmkv.SegmentError(
            f"shmkv: segment {name!r} does not fit this model: it has (num_layers, "
            f"num_kv_heads, head_dim, dtype) = {got} and block_size {cfg.block_size}; "
            f"the model needs {exp} and a block_size dividing vLLM's {vb}")


def open_segment(spec: SegmentSpec) -> shmkv.KVCache:
    """Attach the segment if it exists (it must fit), else create it (racing creators are
    safe: one wins, the others attach)."""
    while True:
        try:
            kv = shmkv.KVCache.attach(spec.name)
        except FileNotFoundError:
            try:
                return shmkv.KVCache.create(spec.name, spec.config,
                                            hash_seed=spec.hash_seed)
            except FileExistsError:
                continue                # another instance created it meanwhile: attach
        try:
            check_fit(kv.config, spec.config, spec.vllm_block_size, spec.name)
        except BaseException:
            kv.close()
            raise
        seed = kv._tier_layout()["hash_seed"]
        if spec.hash_seed is not None and seed != spec.hash_seed:
            log.warning("shmkv: segment %r hashes blocks with seed %#x, not the %#x asked "
                        "for: hosts whose segments use %#x share no tier blocks with it",
                        spec.name, seed, spec.hash_seed, spec.hash_seed)
        return kv
