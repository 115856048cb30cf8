# cython: language_level=3, binding=False
# binding=False: the methods of the cdef classes are method descriptors, which check
# self; Cython 3's cyfunctions do not (KVCache.unlink("name") crashed the interpreter).
"""shmkv._quant: quantized pools (int8, float8_e4m3) -- the link of the method
chain between the sequences and the K/V data (DataOps subclasses it).

QuantOps: the codecs' wrappers (quantize float32 / float16 / bfloat16 input in C into
private scratch -- a non-finite value raises ValueError before any lock is taken, so a
call that raises writes nothing -- and dequantize codes into float32), a float8 pool's
per-(layer, kv head) scale table (set_kv_scales / kv_scales), the zero-copy scale views
(key_scales / value_scales, matching key_cache / value_cache), the quantized gather (codes
and scales copied out under the sequence lock, then dequantized, or returned raw), and
what both gathers share: the layer argument, the out= check, page-aligned buffers.

Writes: a float8 pool's scale table (set_kv_scales, under pool_lock).  Everything else
here reads (the gather under the sequence lock) or works on private buffers.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport uint8_t, int8_t, uint32_t, uint64_t, int32_t, int64_t

from shmkv._core cimport *
from shmkv._sequences cimport SequenceOps
from shmkv._prefix cimport token_range

cnp.import_array()
bind_debug_state()

# the most bytes of quantization scratch a handle keeps between calls, per K and per V (a
# 512-token Llama-3-8B append: 16.5 MiB each); bigger buffers are freed after the call
SCRATCH_KEEP = 32 << 20


cdef class QuantOps(SequenceOps):
    cdef int64_t _layer(self, object layer) except -1:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer: expected int, got {type(layer).__name__}")
        if not 0 <= layer < self.ctx.cfg.num_layers:
            raise IndexError(
                f"layer: expected 0 <= layer < {self.ctx.cfg.num_layers}, got {layer}")
        return <int64_t>layer


    # ---- quantized pools ------------------------------------------------------------------
    cdef cnp.ndarray _farray(self, object a, str what, int ndim):
        """A quantized pool's input: float32 / float16 as they are (C-contiguous), bfloat16
        -> float32 (the quantizers read float32 and float16)."""
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{what}: expected numpy.ndarray, got {type(a).__name__}")
        cdef cnp.ndarray arr = <cnp.ndarray>a
        cdef int tn = cnp.PyArray_TYPE(arr)
        # the decode loop's case in C: a native float32 / float16 C-contiguous array of the
        # right rank is used as it is (dtype.name is a Python-level property: 1.8 us a
        # read, three reads a call were most of a 1-token append's overhead)
        if ((tn == cnp.NPY_FLOAT32 or tn == cnp.NPY_FLOAT16)
                and cnp.PyArray_ISNOTSWAPPED(arr) and cnp.PyArray_NDIM(arr) == ndim
                and cnp.PyArray_IS_C_CONTIGUOUS(arr)):
            return arr
        dt = a.dtype
        if dt.name not in ("float32", "float16", "bfloat16") or not dt.isnative:
            raise TypeError(f"{what}: expected dtype float32, float16 or bfloat16 (the "
                            f"{self.config.dtype} pool quantizes floats), got {dt}")
        if a.ndim != ndim:
            raise ValueError(f"{what}: expected a {ndim}-d array, got shape {a.shape}")
        return np.ascontiguousarray(a, dtype=np.float16 if dt.name == "float16" else np.float32)

    cdef cnp.ndarray _scratch(self, int i, size_t nbytes):
        """A private buffer of >= nbytes for codes and scales: this handle's cache slot i
        (0 K, 1 V), taken out of it until _scratch_back, or a new one.  Kept between calls
        because fresh pages cost their clearing (a quarter of a 512-token int8 append)."""
        if self._qbufs is None:
            self._qbufs = [None, None]
        cdef cnp.ndarray buf = self._qbufs[i]
        self._qbufs[i] = None               # taken: a thread calling meanwhile makes its own
        if buf is None or <size_t>cnp.PyArray_NBYTES(buf) < nbytes:
            buf = np.empty(nbytes, np.uint8)
        return buf

    cdef int _scratch_back(self, int i, cnp.ndarray q) except -1:
        """Give the buffer under codes q from _quantize back to cache slot i (up to
        SCRATCH_KEEP bytes are kept per slot; a bigger one is freed)."""
        if q is None or self._qbufs is None:
            return 0
        base = <object>cnp.PyArray_BASE(q)
        if (isinstance(base, np.ndarray) and self._qbufs[i] is None
                and cnp.PyArray_NBYTES(base) <= SCRATCH_KEEP):
            self._qbufs[i] = base
        return 0

    cdef tuple _quantize(self, cnp.ndarray x, uint32_t layers, uint64_t n, uint32_t layer0,
                         int is_v, str what):
        """x: float32 or float16 [layers][n][heads][d] -> (codes of x's shape in the pool's dtype,
        float32 scales [layers][n][heads] or None), views of the scratch buffer of slot
        is_v (the caller gives it back with _scratch_back(is_v, codes) once they are
        copied).  ValueError on a non-finite value: nothing in the segment is touched
        (this runs before any lock)."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef uint32_t hkv = c.cfg.num_kv_heads, d = c.cfg.head_dim
        cdef uint64_t rows = <uint64_t>layers * n * hkv
        cdef int nd = cnp.PyArray_NDIM(x)
        cdef bint i8 = c.cfg.dtype == SHMKV_I8
        cdef size_t qbytes = (rows * d + 63) & ~(<size_t>63)      # scales 64-byte aligned
        cdef cnp.ndarray buf = self._scratch(is_v, qbytes + (rows * 4 if i8 else 0))
        cdef uint8_t *bp = <uint8_t *>cnp.PyArray_DATA(buf)
        cdef cnp.ndarray q = cnp.PyArray_SimpleNewFromData(nd, cnp.PyArray_DIMS(x),
                                                           cnp.NPY_INT8, bp)
        cnp.set_array_base(q, buf)
        cdef cnp.ndarray sc = None
        cdef const void *xp = <const void *>cnp.PyArray_DATA(x)
        cdef int f16 = cnp.PyArray_ITEMSIZE(x) == 2
        cdef int st
        cdef const float *hs
        if i8:
            sc = cnp.PyArray_SimpleNewFromData(nd - 1, cnp.PyArray_DIMS(x), cnp.NPY_FLOAT32,
                                               bp + qbytes)
            cnp.set_array_base(sc, buf)
            with nogil:
                st = shmkv_quant_i8(xp, f16, rows, d, <int8_t *>bp, <float *>(bp + qbytes))
        else:
            hs = c.hscale + (<uint64_t>is_v * c.cfg.num_layers + layer0) * hkv
            with nogil:
                st = shmkv_quant_e4m3(xp, f16, layers, n, hkv, d, hs, bp)
        if st != SHMKV_OK:
            self._scratch_back(is_v, q)
            raise ValueError(f"{what}: expected finite values (a {self.config.dtype} pool "
                             f"cannot hold NaN or inf); nothing was written")
        return q, sc

    cdef object _dequantize(self, cnp.ndarray q, cnp.ndarray sc, uint32_t layers,
                            uint64_t n, int is_v, cnp.ndarray out):
        """codes [layers][n][heads][d] (+ int8 scales) -> float32 into out."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef uint32_t hkv = c.cfg.num_kv_heads, d = c.cfg.head_dim
        cdef uint64_t rows = <uint64_t>layers * n * hkv
        cdef float *op = <float *>cnp.PyArray_DATA(out)
        cdef const uint8_t *qp = <const uint8_t *>cnp.PyArray_DATA(q)
        cdef const float *sp
        cdef const float *hs
        if c.cfg.dtype == SHMKV_I8:
            sp = <const float *>cnp.PyArray_DATA(sc)
            with nogil:
                shmkv_dequant_i8(<const int8_t *>qp, sp, rows, d, op)
        else:
            hs = c.hscale + <uint64_t>is_v * c.cfg.num_layers * hkv
            with nogil:
                shmkv_dequant_e4m3(qp, layers, n, hkv, d, hs, op)
        return out

    def set_kv_scales(self, layer, k_scale, v_scale):
        """Set a float8_e4m3 pool's per-head scales of one layer (vLLM's ``k_scale`` /
        ``v_scale``, one per kv head, or one number for every head).

        A code ``q`` of layer ``layer``, kv head ``h`` stands for ``q * scale[h]``; a
        value is stored as ``e4m3(x / scale[h])``, saturated to ``+-448 * scale[h]``.
        The default is 1.0.  Set them before writing the layer: data written before
        reads with the new scales (as in vLLM, the scales belong to the pool, not to the
        data).  Every process attached sees the new scales.

        Raises
        ------
        TypeError
            The pool is not float8_e4m3 (an int8 pool's scales are per token, computed).
        ValueError
            A scale that is not finite and > 0, or the wrong count; nothing changes.
        IndexError
            ``layer`` out of range.
        """
        cdef shmkv_ctx_t *c = ctx_of(self)
        if c.cfg.dtype != SHMKV_E4M3:
            raise TypeError(f"set_kv_scales: expected a float8_e4m3 pool, got "
                            f"{self.config.dtype} (an int8 pool's scales are per token)")
        cdef int64_t lyr = self._layer(layer)
        cdef uint32_t hkv = c.cfg.num_kv_heads
        arrs = []
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            a = np.asarray(x, dtype=np.float64)
            if a.ndim == 0:
                a = np.full(hkv, float(a))
            if a.shape != (hkv,):
                raise ValueError(f"{name}: expected a number or {hkv} scales (one per kv "
                                 f"head), got shape {a.shape}")
            if not (np.isfinite(a).all() and (a > 0).all() and (a < 3.0e38).all()):
                raise ValueError(f"{name}: expected finite scales > 0, got {a.tolist()}")
            arrs.append(a.astype(np.float32))
        cdef float[::1] kv = arrs[0]
        cdef float[::1] vv = arrs[1]
        cdef uint32_t h
        cdef uint64_t base = <uint64_t>lyr * hkv, vbase = <uint64_t>c.cfg.num_layers * hkv
        pool_lock(c)
        for h in range(hkv):
            c.hscale[base + h] = kv[h]
            c.hscale[vbase + base + h] = vv[h]
        shmkv_pool_unlock(c)

    def kv_scales(self, layer):
        """A float8_e4m3 pool's per-head scales of one layer: (k_scale, v_scale), float32
        arrays [num_kv_heads] (copies).  TypeError for other pools."""
        cdef shmkv_ctx_t *c = ctx_of(self)
        if c.cfg.dtype != SHMKV_E4M3:
            raise TypeError(f"kv_scales: expected a float8_e4m3 pool, got {self.config.dtype}")
        cdef int64_t lyr = self._layer(layer)
        hkv = c.cfg.num_kv_heads
        return (self._hscale_view(True)[lyr].copy(), self._hscale_view(False)[lyr].copy())

    cdef object _hscale_view(self, bint is_k):
        cdef shmkv_ctx_t *c = ctx_of(self)
        n = <int64_t>c.cfg.num_layers * c.cfg.num_kv_heads
        off = c.lay.off_hscale + (0 if is_k else n * 4)
        arr = np.frombuffer(self._att.mapping, dtype=np.float32, count=n, offset=off)
        return arr.reshape(c.cfg.num_layers, c.cfg.num_kv_heads)

    cdef object _scale_view(self, object layer, bint is_k):
        cdef shmkv_ctx_t *c = ctx_of(self)
        cdef int64_t lyr = self._layer(layer)
        if c.cfg.dtype == SHMKV_I8:
            off = (c.lay.off_kscale if is_k else c.lay.off_vscale) + lyr * c.lay.scale_stride
            count = <int64_t>c.cfg.num_blocks * c.cfg.block_size * c.cfg.num_kv_heads
            arr = np.frombuffer(self._att.mapping, dtype=np.float32, count=count, offset=off)
            return arr.reshape(c.cfg.num_blocks, c.cfg.block_size, c.cfg.num_kv_heads)
        if c.cfg.dtype == SHMKV_E4M3:
            return self._hscale_view(is_k)[lyr]
        raise TypeError(f"key_scales: expected a quantized pool (int8, float8_e4m3), got "
                        f"{self.config.dtype}")

    def key_scales(self, layer):
        """Zero-copy float32 view of one layer's K scales, matching :meth:`key_cache`:
        ``[num_blocks, block_size, num_kv_heads]`` for an int8 pool (element
        ``[b, o, h]`` scales ``key_cache(layer)[b, o, h, :]``), ``[num_kv_heads]`` for a
        float8_e4m3 pool.  TypeError for a float pool."""
        return self._scale_view(layer, True)

    def value_scales(self, layer):
        """Zero-copy view of one layer's V scales (see key_scales)."""
        return self._scale_view(layer, False)


    cdef object _gather_quant(self, object sid, object start, object stop, object out,
                              bint raw):
        cdef shmkv_ctx_t *c = ctx_of(self)
        if not shmkv_dtype_quantized(c.cfg.dtype):
            raise TypeError(f"gather(raw=True): expected a quantized pool (int8, "
                            f"float8_e4m3), got {self.config.dtype}")
        if raw and out is not None:
            raise TypeError("gather: out= and raw=True do not go together")
        cdef int64_t s = as_sid(sid)
        cdef uint32_t slot
        cdef int64_t a, b
        cdef int st
        cdef cnp.ndarray kq, vq, ks = None, vs = None, ko, vo
        cdef uint8_t *kb
        cdef uint8_t *vb
        cdef uint8_t *ksb = NULL
        cdef uint8_t *vsb = NULL
        cdef bint i8 = c.cfg.dtype == SHMKV_I8
        seq_lock(c, s, &slot)
        try:
            token_range(start, stop, valid_len(c, slot, s), s, &a, &b)
            shape = (c.cfg.num_layers, b - a, c.cfg.num_kv_heads, c.cfg.head_dim)
            if out is not None:
                ko, vo = self._check_out(out, shape)
            kq = _aligned_empty(shape, self._dtype)
            vq = _aligned_empty(shape, self._dtype)
            if i8:
                ks = np.empty(shape[:-1], np.float32)
                vs = np.empty(shape[:-1], np.float32)
                ksb = <uint8_t *>cnp.PyArray_DATA(ks)
                vsb = <uint8_t *>cnp.PyArray_DATA(vs)
            st = shmkv_seq_check_span(c, slot, a, b - a)
            if st != SHMKV_OK:
                raise_status(st, f"sequence {s}")
            kb = <uint8_t *>cnp.PyArray_DATA(kq)
            vb = <uint8_t *>cnp.PyArray_DATA(vq)
            with nogil:
                shmkv_seq_copy(c, slot, a, b - a, c.kpool, kb, 0)
                shmkv_seq_copy(c, slot, a, b - a, c.vpool, vb, 0)
                if i8:
                    shmkv_seq_copy_rows(c, slot, a, b - a, <uint8_t *>c.kscale,
                                        c.lay.scale_stride, c.lay.scale_bytes, ksb, 0)
                    shmkv_seq_copy_rows(c, slot, a, b - a, <uint8_t *>c.vscale,
                                        c.lay.scale_stride, c.lay.scale_bytes, vsb, 0)
            shmkv_seq_touch(c, slot)
            shmkv_count_proc(c, SHMKV_PC_GATHERED, b - a)
        finally:
            shmkv_seq_unlock(c, slot)
        if raw:
            if not i8:
                ks = self._hscale_view(True).copy()
                vs = self._hscale_view(False).copy()
            return kq, vq, ks, vs
        if out is None:
            ko = _aligned_empty(shape, np.dtype(np.float32))
            vo = _aligned_empty(shape, np.dtype(np.float32))
        self._dequantize(kq, ks, c.cfg.num_layers, b - a, 0, ko)
        self._dequantize(vq, vs, c.cfg.num_layers, b - a, 1, vo)
        if out is not None:
            return out
        return ko, vo

    cdef tuple _check_out(self, object out, tuple shape):
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"out: expected a tuple (k_out, v_out), got {type(out).__name__}")
        res = []
        for name, a in zip(("out[0]", "out[1]"), out):
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{name}: expected numpy.ndarray, got {type(a).__name__}")
            if a.dtype != self.config.compute_dtype or not a.dtype.isnative:
                raise TypeError(f"{name}: expected dtype {self.config.compute_dtype}, got "
                                f"{a.dtype}")
            if a.shape != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {a.shape}")
            if not a.flags.c_contiguous:
                raise ValueError(f"{name}: expected a C-contiguous array")
            if not a.flags.writeable:
                raise ValueError(f"{name}: expected a writable array")
            res.append(a)
        if np.shares_memory(res[0], res[1]):
            raise ValueError("out: k_out and v_out must not overlap")
        return tuple(res)


def _force_quant_isa(name):
    """Test hook: the quantizers' path, "scalar" (portable C), "avx2" (AVX2 + F16C) or
    "avx512" (AVX-512 F/BW/VL), if the CPU runs it, or None for the default (the CPU's
    best, capped by SHMKV_ISA).  Returns the path
    now in use (read back from the switch the dispatch reads)."""
    global shmkv_q_isa      # quant.h's switch (without this, Cython makes a local of it)
    names = ("scalar", "avx2", "avx512")
    if name is None:
        shmkv_q_isa = -1
    elif name in names:
        want = names.index(name)
        if want > shmkv_quant_cpu_isa():
            raise ValueError(f"isa {name!r}: this CPU does not run it (best: "
                             f"{names[shmkv_quant_cpu_isa()]!r})")
        shmkv_q_isa = want
    else:
        raise ValueError(f"isa: expected 'scalar', 'avx2', 'avx512' or None, got {name!r}")
    return names[shmkv_quant_isa()]


cdef object _aligned_empty(tuple shape, object dtype):
    """np.empty with its data on a page boundary, like the pools: block copies then run
    at the same page offset on both sides, clear of 4K aliasing (a destination a few
    bytes past the source's page offset stalls every load behind the stores; malloc's
    page+16 pointers cost gather 1.4x the floor, page-aligned ones 0.8x)."""
    cdef Py_ssize_t n = dtype.itemsize
    for d in shape:
        n *= d
    raw = np.empty(n + 4096, np.uint8)
    cdef size_t addr = <size_t>cnp.PyArray_DATA(raw)
    cdef Py_ssize_t off = (4096 - <Py_ssize_t>(addr % 4096)) % 4096
    return raw[off:off + n].view(dtype).reshape(shape)
