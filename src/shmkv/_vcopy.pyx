# cython: language_level=3
"""shmkv._vcopy: the vLLM connector's block copy in C -- shmkv's pools
``[num_blocks, bs, H, D]`` <-> vLLM's CPU_ATTN layer tensor ``[num_blocks, H, VB, 2D]``
(per (block, head) K then V; K transposed ``[D, VB]`` or plain ``[VB, D]``, V ``[VB, D]``;
see shmkv/integrations/vllm/layout.py, which probes that layout against vLLM's own op).

Owns only the copy: raw addresses and shapes come from the caller (layout.py checks the
tensors' dtype, shape and contiguity); every block id and sub-block offset is checked
against those shapes before the first byte moves, so bad ids raise IndexError and write
nothing.  The copy runs with the GIL released; the transposed K goes through register
tiles (kernels/vtranspose.h: 16x16 with AVX-512F, 8x8 with AVX2) for 32-bit elements and
16x16 cache tiles otherwise.

vLLM's AMX layout (``amx_pack`` > 0: K and V packed for AMX tiles, kernels/vamx.h) has
its own per-piece copy; 1-byte elements (an fp8 cache's e4m3 codes) take both paths.
"""
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uintptr_t


cdef extern from "kernels/vtranspose.h" nogil:
    int shmkv_vt_isa()
    int shmkv_vt_force_isa(int isa)
    void shmkv_vt32(const uint32_t *src, Py_ssize_t ss, uint32_t *dst, Py_ssize_t ds,
                    Py_ssize_t rows, Py_ssize_t cols)
    void shmkv_vrows(void *dst, Py_ssize_t ds, const void *src, Py_ssize_t ss,
                     Py_ssize_t rows, size_t n)
    void shmkv_vfence()
    void shmkv_vt16_via32(uint16_t *rows, Py_ssize_t rs, uint16_t *kt, Py_ssize_t ks,
                          Py_ssize_t n, Py_ssize_t D, int to_kt)


cdef extern from "kernels/vamx.h" nogil:
    void shmkv_amx_piece(char *tile, char *k_row, char *v_row, Py_ssize_t rs, Py_ssize_t VB,
                         Py_ssize_t D, Py_ssize_t bs, Py_ssize_t s, int isz, int pack,
                         int to_vllm)


_ISAS = ("portable", "avx2", "avx512")


def transpose_isa():
    """The K transpose's instruction set: "portable", "avx2" or "avx512"."""
    return _ISAS[shmkv_vt_isa()]


def _force_transpose_isa(name):
    """Tests: pin the K transpose to ``name`` (capped at what the CPU has; None: the
    CPU's).  Returns the one now in use."""
    if name is not None and name not in _ISAS:
        raise ValueError(f"isa: expected one of {_ISAS} or None, got {name!r}")
    return _ISAS[shmkv_vt_force_isa(-1 if name is None else _ISAS.index(name))]

ctypedef fused elem_t:
    uint8_t
    uint16_t
    uint32_t

cdef enum:
    TILE = 16


cdef void _copy(elem_t* t, elem_t* kp, elem_t* vp, Py_ssize_t H, Py_ssize_t D,
                Py_ssize_t VB, Py_ssize_t bs, const int64_t* sblk, const int64_t* vblk,
                const int64_t* sub, Py_ssize_t m, bint k_t, bint to_vllm,
                Py_ssize_t PH) noexcept nogil:
    # PH: the pools' heads per token (>= H: a tensor-parallel rank's H heads are a slice;
    # kp/vp then point at the slice's first head)
    cdef Py_ssize_t i, h, j, d, j0, d0, j1, d1
    cdef Py_ssize_t HD = PH * D
    cdef size_t row = D * sizeof(elem_t)
    cdef elem_t* tile
    cdef elem_t* kv_k
    cdef elem_t* kv_v
    cdef elem_t* sk
    cdef elem_t* sv
    for i in range(m):
        sk = kp + sblk[i] * bs * HD
        sv = vp + sblk[i] * bs * HD
        for h in range(H):
            tile = t + (vblk[i] * H + h) * VB * 2 * D
            kv_v = tile + VB * D + sub[i] * bs * D          # [bs, D] rows of V
            if to_vllm:
                shmkv_vrows(kv_v, row, sv + h * D, HD * sizeof(elem_t), bs, row)
            else:
                shmkv_vrows(sv + h * D, HD * sizeof(elem_t), kv_v, row, bs, row)
            if not k_t:
                kv_k = tile + sub[i] * bs * D
                if to_vllm:
                    shmkv_vrows(kv_k, row, sk + h * D, HD * sizeof(elem_t), bs, row)
                else:
                    shmkv_vrows(sk + h * D, HD * sizeof(elem_t), kv_k, row, bs, row)
                continue
            kv_k = tile + sub[i] * bs                       # K[d, j] at kv_k[d * VB + j]
            if elem_t is uint32_t:
                if to_vllm:
                    shmkv_vt32(sk + h * D, HD, kv_k, VB, bs, D)
                else:
                    shmkv_vt32(kv_k, VB, sk + h * D, HD, D, bs)
            elif elem_t is uint16_t:
                # token pairs are 32-bit words of K^T: through shmkv_vt32
                shmkv_vt16_via32(sk + h * D, HD, kv_k, VB, bs, D, to_vllm)
            else:
                d0 = 0
                while d0 < D:
                    d1 = min(d0 + TILE, D)
                    j0 = 0
                    while j0 < bs:
                        j1 = min(j0 + TILE, bs)
                        if to_vllm:
                            for d in range(d0, d1):
                                for j in range(j0, j1):
                                    kv_k[d * VB + j] = sk[j * HD + h * D + d]
                        else:
                            for j in range(j0, j1):
                                for d in range(d0, d1):
                                    sk[j * HD + h * D + d] = kv_k[d * VB + j]
                        j0 = j1
                    d0 = d1


cdef void _copy_amx(char* t, char* kp, char* vp, Py_ssize_t H, Py_ssize_t D, Py_ssize_t VB,
                    Py_ssize_t bs, const int64_t* sblk, const int64_t* vblk,
                    const int64_t* sub, Py_ssize_t m, int isz, int pack,
                    bint to_vllm, Py_ssize_t PH) noexcept nogil:
    cdef Py_ssize_t i, h
    cdef Py_ssize_t rs = PH * D * isz                   # bytes between a pool's tokens
    cdef char* row_k
    cdef char* row_v
    for i in range(m):
        row_k = kp + sblk[i] * bs * rs
        row_v = vp + sblk[i] * bs * rs
        for h in range(H):
            shmkv_amx_piece(t + (vblk[i] * H + h) * VB * 2 * D * isz, row_k + h * D * isz,
                            row_v + h * D * isz, rs, VB, D, bs, sub[i], <int>isz, pack,
                            to_vllm)


def copy_blocks(uintptr_t t_ptr, Py_ssize_t t_blocks, uintptr_t k_ptr, uintptr_t v_ptr,
                Py_ssize_t pool_blocks, Py_ssize_t heads, Py_ssize_t head_dim,
                Py_ssize_t vllm_block_size, Py_ssize_t block_size, Py_ssize_t itemsize,
                const int64_t[::1] shm_ids, const int64_t[::1] vllm_ids,
                const int64_t[::1] sub, bint k_transposed, bint to_vllm, int amx_pack=0,
                Py_ssize_t pool_heads=0, Py_ssize_t head0=0):
    """Copy the shmkv blocks ``shm_ids[i]`` <-> the pieces ``(vllm_ids[i], sub[i])`` (sub-block
    ``sub[i]`` of ``block_size`` tokens inside vLLM block ``vllm_ids[i]``) of one layer:
    ``to_vllm`` loads (pools -> vLLM tensor), else saves.  The addresses must be those of
    C-contiguous arrays of the given shapes and ``itemsize`` (1, 2 or 4) bytes per element.
    ``amx_pack`` > 0: vLLM's AMX layout with that many elements per packed unit (2 for
    16-bit and fp8 caches, 1 for float32; ``k_transposed`` is then ignored), which needs
    ``block_size`` and ``head_dim`` multiples of 16 and ``amx_pack * itemsize`` <= 4.
    ``pool_heads`` > ``heads``: the pools hold ``pool_heads`` KV heads per token and vLLM's
    tensor the ``heads`` of them from ``head0`` on (a tensor-parallel rank's slice)."""
    cdef Py_ssize_t m = shm_ids.shape[0], i, r
    cdef const int64_t* ps
    cdef const int64_t* pv
    cdef const int64_t* pr
    if vllm_ids.shape[0] != m or sub.shape[0] != m:
        raise ValueError(f"shmkv: {m} shmkv block ids but {vllm_ids.shape[0]} vLLM ids "
                         f"and {sub.shape[0]} sub-block offsets (expected equal lengths)")
    if itemsize != 1 and itemsize != 2 and itemsize != 4:
        raise ValueError(f"shmkv: itemsize must be 1, 2 or 4, got {itemsize}")
    if amx_pack < 0 or (amx_pack and (amx_pack * itemsize > 4 or 4 % (amx_pack * itemsize)
                                      or block_size % 16 or head_dim % 16
                                      or head_dim % amx_pack)):
        raise ValueError(f"shmkv: the AMX layout needs block_size and head_dim multiples of "
                         f"16 and a pack of 1, 2 or 4 bytes dividing head_dim; got "
                         f"block_size {block_size}, head_dim {head_dim}, amx_pack "
                         f"{amx_pack}, itemsize {itemsize}")
    if (block_size <= 0 or vllm_block_size <= 0 or vllm_block_size % block_size
            or heads <= 0 or head_dim <= 0 or t_blocks < 0 or pool_blocks < 0):
        raise ValueError(f"shmkv: bad shapes (heads={heads}, head_dim={head_dim}, vLLM block "
                         f"size {vllm_block_size}, shmkv block size {block_size})")
    if pool_heads == 0:
        pool_heads = heads
    if head0 < 0 or head0 + heads > pool_heads:
        raise ValueError(f"shmkv: heads {head0}..{head0 + heads - 1} are not a slice of the "
                         f"pools' {pool_heads} KV heads (expected 0 <= head0 and head0 + heads "
                         f"<= pool_heads)")
    if m and (not t_ptr or not k_ptr or not v_ptr):
        raise ValueError("shmkv: a NULL address")
    r = vllm_block_size // block_size
    for i in range(m):
        if not 0 <= shm_ids[i] < pool_blocks:
            raise IndexError(f"shmkv: shmkv block id {shm_ids[i]} at {i} out of range "
                             f"(expected 0 <= id < {pool_blocks})")
        if not 0 <= vllm_ids[i] < t_blocks:
            raise IndexError(f"shmkv: vLLM block id {vllm_ids[i]} at {i} out of range "
                             f"(expected 0 <= id < {t_blocks})")
        if not 0 <= sub[i] < r:
            raise IndexError(f"shmkv: sub-block offset {sub[i]} at {i} out of range "
                             f"(expected 0 <= offset < {r})")
    if m == 0:
        return
    ps, pv, pr = &shm_ids[0], &vllm_ids[0], &sub[0]
    k_ptr += head0 * head_dim * itemsize            # the slice's first head
    v_ptr += head0 * head_dim * itemsize
    with nogil:
        if amx_pack:
            _copy_amx(<char*>t_ptr, <char*>k_ptr, <char*>v_ptr, heads, head_dim,
                      vllm_block_size, block_size, ps, pv, pr, m, <int>itemsize, amx_pack,
                      to_vllm, pool_heads)
        elif itemsize == 1:
            _copy[uint8_t](<uint8_t*>t_ptr, <uint8_t*>k_ptr, <uint8_t*>v_ptr, heads,
                           head_dim, vllm_block_size, block_size, ps, pv, pr, m,
                           k_transposed, to_vllm, pool_heads)
        elif itemsize == 2:
            _copy[uint16_t](<uint16_t*>t_ptr, <uint16_t*>k_ptr, <uint16_t*>v_ptr, heads,
                            head_dim, vllm_block_size, block_size, ps, pv, pr, m,
                            k_transposed, to_vllm, pool_heads)
        else:
            _copy[uint32_t](<uint32_t*>t_ptr, <uint32_t*>k_ptr, <uint32_t*>v_ptr, heads,
                            head_dim, vllm_block_size, block_size, ps, pv, pr, m,
                            k_transposed, to_vllm, pool_heads)
        shmkv_vfence()
