"""vLLM's CPU_ATTN KV layout <-> shmkv blocks: the torch views, the vectorized copies and
the start-up self-test against vLLM's own ``cpu_attn_reshape_and_cache``.

Owns the one piece of knowledge about how vLLM (0.32, CPU platform) lays out a layer's
KV tensor: ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, where per (block,
head) the first ``block_size * head_dim`` elements hold K and the rest V.  For the
``vec``/``vec16`` ISAs K is stored transposed (``[head_dim, block_size]``) and V as
``[block_size, head_dim]``; other ISAs (AMX packs tiles) may differ.  Nothing here trusts
that description: :func:`probe_layout` writes known tokens with vLLM's op and returns the
layout that reads them back, or ``None``.

Copies work in shmkv-block units (shmkv's ``block_size`` divides vLLM's).  The connector's
path is :meth:`CpuLayout.copy`: one call per layer into ``shmkv._vcopy.copy_blocks`` (C, GIL
released, every id bounds-checked) when both sides are C-contiguous 2- or 4-byte tensors,
else the torch reference (:meth:`CpuLayout.read` / :meth:`CpuLayout.write`: one
``index_select``/``index_put_`` over a strided view per layer and pool), which the tests
compare it against; never a Python loop over tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["CpuLayout", "probe_layout", "probe_inputs", "LAYOUTS", "FP8_CACHE_DTYPES"]


@dataclass(frozen=True)
class CpuLayout:
    """How K and V sit in one (block, head) tile: K transposed ``[D, VB]`` or plain
    ``[VB, D]`` and V ``[VB, D]`` (``amx_pack`` 0), or vLLM's AMX packing with
    ``amx_pack`` elements per unit (``k_transposed`` is then False and unused)."""

    k_transposed: bool
    amx_pack: int = 0

    @property
    def name(self) -> str:
        if self.amx_pack:
            return f"amx (K and V packed for AMX tiles, {self.amx_pack} elements per unit)"
        return "K transposed" if self.k_transposed else "K row-major"

    def fits(self, head_dim: int, block_size: int, shmkv_block_size: int) -> bool:
        """Whether shmkv blocks of ``shmkv_block_size`` tokens can be cut out of this
        layout's tiles (the AMX packing groups 16 tokens and 16 dims)."""
        if shmkv_block_size < 1 or block_size % shmkv_block_size:
            return False
        p = self.amx_pack
        return not p or (shmkv_block_size % 16 == 0 and head_dim % 16 == 0
                         and head_dim % p == 0)

    def views(self, t: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k5, v5)``: views of a layer tensor ``[NB, H, VB, 2D]`` split into shmkv blocks.

        ``k5`` is ``[NB, H, D, R, bs]`` (transposed) or ``[NB, H, R, bs, D]``; ``v5`` is
        ``[NB, H, R, bs, D]``, with ``R = VB // bs``.  AMX: ``k`` is
        ``[NB, H, R, bs/16, D/p, 16, p]`` and ``v`` ``[NB, H, D/16, R, bs/p, 16, p]``.
        """
        nb, h, vb, d2 = t.shape
        d = d2 // 2
        r = vb // bs
        halves = t.view(nb, h, 2, vb * d)
        if self.amx_pack:
            p = self.amx_pack
            return (halves[:, :, 0].unflatten(-1, (r, bs // 16, d // p, 16, p)),
                    halves[:, :, 1].unflatten(-1, (d // 16, r, bs // p, 16, p)))
        if self.k_transposed:
            k5 = halves[:, :, 0].unflatten(-1, (d, r, bs))
        else:
            k5 = halves[:, :, 0].unflatten(-1, (r, bs, d))
        v5 = halves[:, :, 1].unflatten(-1, (r, bs, d))
        return k5, v5

    def read(self, t: torch.Tensor, bs: int, vblk: torch.Tensor,
             sub: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the shmkv-sized pieces ``(vblk[i], sub[i])`` as ``[m, bs, H, D]`` views
        (non-contiguous; the caller's ``index_put_`` does the one copy; AMX: copies)."""
        k5, v5 = self.views(t, bs)
        if self.amx_pack:
            m, h, d = len(vblk), t.shape[1], t.shape[3] // 2
            k = k5[vblk, :, sub].permute(0, 2, 4, 1, 3, 5)   # [m, bs/16, 16, H, D/p, p]
            v = v5[vblk, :, :, sub].permute(0, 3, 5, 1, 2, 4)  # [m, bs/p, p, H, D/16, 16]
            return k.reshape(m, bs, h, d), v.reshape(m, bs, h, d)
        if self.k_transposed:
            k = k5[vblk, :, :, sub].permute(0, 3, 1, 2)      # [m, H, D, bs] -> [m, bs, H, D]
        else:
            k = k5[vblk, :, sub].permute(0, 2, 1, 3)         # [m, H, bs, D] -> [m, bs, H, D]
        v = v5[vblk, :, sub].permute(0, 2, 1, 3)
        return k, v

    def write(self, t: torch.Tensor, bs: int, vblk: torch.Tensor, sub: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` ``[m, bs, H, D]`` into the pieces ``(vblk[i], sub[i])``."""
        k5, v5 = self.views(t, bs)
        if self.amx_pack:
            m, h, d, p = len(vblk), t.shape[1], t.shape[3] // 2, self.amx_pack
            k5[vblk, :, sub] = k.reshape(m, bs // 16, 16, h, d // p, p).permute(0, 3, 1, 4, 2, 5)
            v5[vblk, :, :, sub] = v.reshape(m, bs // p, p, h, d // 16, 16).permute(
                0, 3, 4, 1, 5, 2)
            return
        if self.k_transposed:
            k5[vblk, :, :, sub] = k.permute(0, 2, 3, 1)
        else:
            k5[vblk, :, sub] = k.permute(0, 2, 1, 3)
        v5[vblk, :, sub] = v.permute(0, 2, 1, 3)

    def copy(self, t: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, bs: int,
             shm: torch.Tensor, vblk: torch.Tensor, sub: torch.Tensor, to_vllm: bool,
             head0: int = 0) -> None:
        """Copy shmkv blocks ``shm[i]`` of the pools ``kp``, ``vp`` ``[NBs, bs, H, D]`` to
        (``to_vllm``, a load) or from (a save) the pieces ``(vblk[i], sub[i])`` of ``t``;
        in C when the tensors allow it, else through :meth:`read` / :meth:`write`.
        Pools with more KV heads than ``t`` (a tensor-parallel rank's slice): ``t``'s heads
        are the pools' ``head0 ..``."""
        nb, h, vb, d2 = t.shape
        ph = kp.shape[2] if kp.dim() == 4 else h
        if not (0 <= head0 and head0 + h <= ph):
            raise ValueError(f"shmkv: heads {head0}..{head0 + h - 1} are not a slice of the "
                             f"pools' {ph} KV heads")
        if t.dtype == torch.uint8 and kp.element_size() == 1:
            kp, vp = kp.view(torch.uint8), vp.view(torch.uint8)   # fp8: codes as they are
        if (_c_ok(t, kp, vp, bs) and self.fits(d2 // 2, vb, bs)
                and 4 % max(1, self.amx_pack * t.element_size()) == 0):
            from shmkv._vcopy import copy_blocks
            ids = [x.to(torch.int64).contiguous().numpy() for x in (shm, vblk, sub)]
            copy_blocks(t.data_ptr(), nb, kp.data_ptr(), vp.data_ptr(), kp.shape[0], h,
                        d2 // 2, vb, bs, t.element_size(), *ids, self.k_transposed, to_vllm,
                        self.amx_pack, ph, head0)
            return
        if ph != h:
            kp, vp = kp[:, :, head0:head0 + h], vp[:, :, head0:head0 + h]
        if to_vllm:
            self.write(t, bs, vblk, sub, kp.index_select(0, shm), vp.index_select(0, shm))
        else:
            k, v = self.read(t, bs, vblk, sub)
            kp[shm] = k
            vp[shm] = v


def _c_ok(t: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, bs: int) -> bool:
    """Whether :func:`shmkv._vcopy.copy_blocks` can take these tensors: CPU, C-contiguous,
    one 1-, 2- or 4-byte dtype, ``t`` ``[NB, H, VB, 2D]`` and pools ``[NBs, bs, H, D]``
    alike."""
    if t.dim() != 4 or kp.dim() != 4 or kp.shape != vp.shape:
        return False
    nb, h, vb, d2 = t.shape
    return (all(x.device.type == "cpu" and x.is_contiguous() and x.dtype == t.dtype
                for x in (t, kp, vp))
            and t.element_size() in (1, 2, 4) and d2 % 2 == 0 and bs > 0 and vb % bs == 0
            and kp.shape[1] == bs and kp.shape[2] >= h and kp.shape[3] == d2 // 2)


LAYOUTS: Sequence[CpuLayout] = (CpuLayout(k_transposed=True), CpuLayout(k_transposed=False),
                                 CpuLayout(False, amx_pack=2), CpuLayout(False, amx_pack=1),
                                 CpuLayout(False, amx_pack=4))

FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")      # vLLM's names of an e4m3 cache


def probe_inputs(dtype: torch.dtype, num_kv_heads: int, head_dim: int, tokens: int,
                 fp8: bool, seed: int = 20) -> tuple[torch.Tensor, torch.Tensor,
                                                      torch.Tensor, torch.Tensor]:
    """``(key, value, want_k, want_v)`` ``[tokens, H, D]``: K/V of the model's ``dtype``
    and what the cache must hold for them: the same values, or (``fp8``, scale 1) their
    e4m3 codes as uint8 -- drawn from normal e4m3 numbers, which every float dtype holds
    exactly, so vLLM's quantizer (which flushes subnormals) must give exactly these codes."""
    g = torch.Generator().manual_seed(seed)
    shape = (tokens, num_kv_heads, head_dim)
    if not fp8:
        key = torch.randn(*shape, generator=g).to(dtype)
        value = torch.randn(*shape, generator=g).to(dtype)
        return key, value, key, value
    codes = []
    for _ in range(2):
        mag = torch.randint(8, 120, shape, generator=g, dtype=torch.uint8)   # normal, < 448
        sign = torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7
        codes.append(mag | sign)
    vals = [c.view(torch.float8_e4m3fn).to(torch.float32).to(dtype) for c in codes]
    return vals[0], vals[1], codes[0], codes[1]


def probe_layout(isa: str, dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                 block_size: int, shmkv_block_size: int,
                 kv_cache_dtype: str = "auto") -> Optional[CpuLayout]:
    """The layout in :data:`LAYOUTS` under which vLLM's own op, for ``isa``, stores known K/V
    where :meth:`CpuLayout.read` finds them (and :meth:`CpuLayout.write` puts them back
    bit for bit); ``None`` when no candidate matches (the ISA packs differently) or the
    op is unavailable.  ``kv_cache_dtype`` "fp8"/"fp8_e4m3": the cache is uint8 e4m3 codes
    (vLLM quantizes with scale 1 here) and the candidates are checked on the codes."""
    try:
        from vllm import _custom_ops as ops
    except Exception:       # pragma: no cover - vLLM without its C extension
        return None
    h, d, vb, bs = num_kv_heads, head_dim, block_size, shmkv_block_size
    fp8 = kv_cache_dtype in FP8_CACHE_DTYPES
    key, value, want_k, want_v = probe_inputs(dtype, h, d, vb, fp8)
    scratch = torch.zeros(3, h, vb, 2 * d, dtype=torch.uint8 if fp8 else dtype)
    kc, vc = scratch.view(3, h, 2 * vb, d).chunk(2, dim=2)
    slots = torch.arange(vb, dtype=torch.int64) + vb          # every token of block 1
    try:
        if fp8:
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa, 1.0, 1.0,
                                           kv_cache_dtype)
        else:
            ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
    except Exception:
        return None
    r = vb // bs
    vblk = torch.ones(r, dtype=torch.int64)
    sub = torch.arange(r, dtype=torch.int64)
    want_k = want_k.reshape(r, bs, h, d)
    want_v = want_v.reshape(r, bs, h, d)
    for lay in LAYOUTS:
        if not lay.fits(d, vb, bs):
            continue
        k, v = lay.read(scratch, bs, vblk, sub)
        if not (torch.equal(k, want_k) and torch.equal(v, want_v)):
            continue
        if scratch[0].any() or scratch[2].any():
            continue                     # the op wrote outside block 1: not understood
        back = torch.zeros_like(scratch)
        lay.write(back, bs, vblk, sub, want_k, want_v)
        if torch.equal(back, scratch):   # the inverse puts back every byte the op wrote
            return lay
    return None
