"""The segment a vLLM instance shares: its layout derived from vLLM's model config, the
extra-config keys that size a new one, and attach-or-create with the fit check.

A segment fits a model when num_layers, num_kv_heads, head_dim and dtype are the model's
and its block_size divides vLLM's; anything else is refused with both layouts in the
message, at engine start.  num_kv_heads is the model's total (a tensor-parallel rank holds
a slice of them and copies only its slice; tp.py).  The dtype is the KV cache's:
the model's for ``kv_cache_dtype="auto"``, ``float8_e4m3`` for vLLM's e4m3 fp8 cache
("fp8", "fp8_e4m3": its codes are stored as they are), whose per-layer scales are the
segment's scale table (:func:`check_fp8_scales`: instances with other scales are refused).
"""
from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

import shmkv
from shmkv._prefix import TierPort

from .tier import seed_for, tier_spec

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig

__all__ = ["SegmentSpec", "segment_spec", "open_segment", "cache_dtype_name", "check_fp8_scales",
           "vllm_kv_scales"]

log = logging.getLogger("vllm.shmkv")

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
FP8_E4M3 = ("fp8", "fp8_e4m3")         # vLLM's names of an e4m3 KV cache
_DEFAULT_GIB = 1.0
DEFAULT_BLOCK = 16


@dataclass(frozen=True)
class SegmentSpec:
    name: str
    config: shmkv.CacheConfig       # what a new segment gets
    vllm_block_size: int
    hash_seed: Optional[int] = None  # a new segment's (hosts sharing a tier share it)
    # the trust rule (shmkv/_shmfile.py): users besides this one whose segment (and pending
    # table) this instance may use; a new segment's mode and group
    trusted_owners: frozenset = frozenset()
    mode: int = 0o600
    group: Optional[int] = None


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"shmkv: KV dtype {dtype} is not supported (expected one of "
                         f"{sorted(_DTYPES)})")
    return _DTYPES[name]


def cache_dtype_name(cache_dtype: Any, model_dtype: Any) -> str:
    """The pool dtype that holds vLLM's KV cache bytes as they are: the model's dtype for
    "auto", a float dtype named outright, float8_e4m3 for vLLM's e4m3 fp8 cache."""
    cd = str(cache_dtype or "auto").replace("torch.", "")
    if cd == "auto":
        return _dtype_name(model_dtype)
    if cd in FP8_E4M3:
        return "float8_e4m3"
    if cd in _DTYPES:
        return _DTYPES[cd]
    raise ValueError(f"shmkv: kv_cache_dtype {cache_dtype!r} is not supported: expected "
                     f"'auto', one of {sorted(_DTYPES)} or one of {list(FP8_E4M3)} (vLLM's "
                     f"e4m3 codes, stored as they are in a float8_e4m3 pool; shmkv has no "
                     f"e5m2 pool)")


def check_fp8_scales(kv: shmkv.KVCache, k_scales: list, v_scales: list) -> None:
    """vLLM's per-layer fp8 scales against the segment's scale table (float8_e4m3 pools).

    The codes are copied as they are, so they mean ``code * scale`` with the scales of the
    instance that wrote them: instances with other scales must never share.  A segment
    that has never held a block takes this instance's scales; one that has, with other
    scales, is refused (SegmentError naming both).  The tier keys blocks by the scale
    table as well."""
    cfg = kv.config
    if cfg.dtype != "float8_e4m3":
        return
    if len(k_scales) != cfg.num_layers or len(v_scales) != cfg.num_layers:
        raise shmkv.SegmentError(f"shmkv: {len(k_scales)} layers' fp8 scales for a segment "
                                 f"of {cfg.num_layers} layers")
    import numpy as np

    want = np.asarray([k_scales, v_scales], dtype=np.float32)          # [2, L]
    have = np.stack([np.stack(kv.kv_scales(i)) for i in range(cfg.num_layers)], 1)  # [2, L, H]
    if (have == want[:, :, None]).all():
        return
    if kv.stats()["allocations"] == 0:          # nothing was ever written with the old ones
        for i in range(cfg.num_layers):
            kv.set_kv_scales(i, float(want[0, i]), float(want[1, i]))
        return
    bad = int(np.argwhere((have != want[:, :, None]).any(axis=(0, 2)))[0, 0])
    raise shmkv.SegmentError(
        f"shmkv: segment {kv.name!r} holds fp8 codes written with other scales: layer {bad} "
        f"has (k_scale, v_scale) = ({have[0, bad].tolist()}, {have[1, bad].tolist()}) per "
        f"kv head, this instance's vLLM uses ({want[0, bad]}, {want[1, bad]}); instances "
        f"with other fp8 scales cannot share blocks (name another segment)")


def vllm_kv_scales(vllm_config: "VllmConfig", layer_names: list) -> tuple[list, list]:
    """The float k/v scales vLLM's attention layers use (``_k_scale_float``), in order."""
    ctx = vllm_config.compilation_config.static_forward_context
    k, v = [], []
    for n in layer_names:
        layer = ctx.get(n)
        k.append(float(getattr(layer, "_k_scale_float", 1.0)))
        v.append(float(getattr(layer, "_v_scale_float", 1.0)))
    return k, v


def access_keys(extra: Mapping[str, Any]) -> tuple[frozenset, int, Optional[int]]:
    """(trusted uids, mode, gid) from the extra config's ``trusted_owners`` (user names or
    uids: a list, or one string separated by commas), ``segment_mode`` (an int or an octal
    string, "0o660" / "660") and ``segment_group`` (a group name or gid); ValueError
    naming the key."""
    from shmkv._shmfile import resolve_group, resolve_owners

    try:
        trusted = resolve_owners(extra.get("trusted_owners"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"shmkv: {e}") from None
    mode = extra.get("segment_mode", 0o600)
    if isinstance(mode, str):
        try:
            mode = int(mode.removeprefix("0o"), 8)
        except ValueError:
            raise ValueError(f"shmkv: segment_mode: expected an octal mode such as "
                             f"\"0o660\", got {mode!r}") from None
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
        got = oct(mode) if isinstance(mode, int) else repr(mode)
        raise ValueError(f"shmkv: segment_mode: expected 0 <= mode <= 0o777, got {got}")
    try:
        gid = resolve_group(extra.get("segment_group"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"shmkv: segment_{e}") from None
    return trusted, mode, gid


def segment_spec(vllm_config: "VllmConfig", extra: Mapping[str, Any]) -> SegmentSpec:
    """The segment's name and the config a new one gets, from the model and the extra
    config (``segment``, ``num_blocks`` | ``size_gib``, ``block_size``, ``max_seqs``,
    ``hash_seed``; with a tier, tier.seed_for's default; the access keys of
    :func:`access_keys`)."""
    name = extra.get("segment")
    if not isinstance(name, str) or not name.strip("/"):
        raise ValueError("shmkv: kv_connector_extra_config needs \"segment\": a segment name, "
                         f"got {name!r}")
    trusted, mode, gid = access_keys(extra)
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    if pp != 1:
        # each stage holds a slice of the layers: a block would be written by several
        # instances' stages with no one to publish it whole (not built)
        raise ValueError(f"shmkv: the connector does not support pipeline parallel "
                         f"(pipeline_parallel_size: expected 1, got {pp})")
    vb = int(cc.block_size)
    # 16 by default (when it divides vLLM's): a hit ends at a 16-token boundary, so vLLM
    # recomputes at most 16 tokens of a prompt whose prefix is all there, not a whole block
    bs = int(extra.get("block_size", DEFAULT_BLOCK if vb % DEFAULT_BLOCK == 0 else vb))
    if bs < 1 or vb % bs:
        raise ValueError(f"shmkv: block_size must divide vLLM's block size {vb}, got {bs}")
    layers = mc.get_num_layers(pc)
    heads = mc.get_total_num_kv_heads()
    if heads % tp:
        # vLLM then replicates KV heads over ranks: each rank's slice is not a slice
        raise ValueError(f"shmkv: tensor_parallel_size {tp} does not divide the model's "
                         f"{heads} KV heads (vLLM replicates them over ranks; the connector "
                         f"needs each rank to hold its own slice)")
    head_dim = mc.get_head_size()
    dtype = cache_dtype_name(cc.cache_dtype, mc.dtype)
    itemsize = {"float32": 4, "float8_e4m3": 1}.get(dtype, 2)
    per_block = 2 * layers * heads * head_dim * bs * itemsize
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
                       hash_seed=seed_for(extra, tier_spec(extra)),
                       trusted_owners=trusted, mode=mode, group=gid)


def check_fit(cfg: shmkv.CacheConfig, want: shmkv.CacheConfig, vb: int, name: str) -> None:
    """SegmentError naming both layouts when the segment cannot hold this model's K/V."""
    got = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
    exp = (want.num_layers, want.num_kv_heads, want.head_dim, want.dtype)
    if got != exp or vb % cfg.block_size:
        raise shmkv.SegmentError(
            f"shmkv: segment {name!r} does not fit this model: it has (num_layers, "
            f"num_kv_heads, head_dim, dtype) = {got} and block_size {cfg.block_size}; "
            f"the model needs {exp} and a block_size dividing vLLM's {vb}")


def off_reason(spec: SegmentSpec, e: BaseException) -> str:
    """Why ``open_segment(spec)`` failed, and what fixes it: the connector's one warning
    when it turns itself off at engine start."""
    name = spec.name
    what = f"{type(e).__name__}: {e}"
    if isinstance(e, shmkv.UntrustedSegmentError):
        fix = (f"remove it if it is not this fleet's (shmkv rm {name}), or name its owner in "
               f"the connector's trusted_owners")
    elif isinstance(e, shmkv.SegmentError):
        fix = (f"give this model another segment name (kv_connector_extra_config "
               f"\"segment\"), or remove the old segment once no engine uses it "
               f"(shmkv rm {name})")
    elif isinstance(e, OSError) and e.errno == errno.ENOSPC:
        fix = ("give /dev/shm more room (docker run --shm-size, a Kubernetes emptyDir with "
               "medium: Memory) or the segment fewer blocks (size_gib / num_blocks)")
    elif isinstance(e, PermissionError):
        fix = ("run the engines as the segment's owner, or create it for a group "
               "(segment_mode 0o660, segment_group)")
    else:
        fix = f"see the cause above; shmkv check {name} tells what the segment holds"
    return f"segment {name!r}: {what}. Fix: {fix}"


def open_segment(spec: SegmentSpec) -> shmkv.KVCache:
    """Attach the segment if it exists (it must fit, and be this user's or a trusted
    one's: UntrustedSegmentError naming the owner), else create it with the spec's mode
    and group (racing creators are safe: one wins, the others attach)."""
    while True:
        try:
            kv = shmkv.KVCache.attach(spec.name, trusted_owners=spec.trusted_owners)
        except FileNotFoundError:
            try:
                return shmkv.KVCache.create(spec.name, spec.config, mode=spec.mode,
                                            group=spec.group, hash_seed=spec.hash_seed)
            except FileExistsError:
                continue                # another instance created it meanwhile: attach
        try:
            check_fit(kv.config, spec.config, spec.vllm_block_size, spec.name)
        except BaseException:
            kv.close()
            raise
        seed = TierPort(kv).layout()["hash_seed"]
        if spec.hash_seed is not None and seed != spec.hash_seed:
            log.warning("shmkv: segment %r hashes blocks with seed %#x, not the %#x asked "
                        "for: hosts whose segments use %#x share no tier blocks with it",
                        spec.name, seed, spec.hash_seed, spec.hash_seed)
        return kv
