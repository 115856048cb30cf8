# cython: language_level=3
"""shmkv._attention: paged attention over the block tables (the wrapper of
kernels/attention.c).

It checks the arguments, takes the lock of every sequence of the batch (the rule of
``gather``: a sequence another process is appending to is read as it was when its lock
was taken), releases the GIL around the whole kernel call, and translates failures into
the exceptions of the API contract (docs/reference/index.md).  ``KVCache.attention`` calls :func:`attention`.
"""
import math
import operator

import numpy as np

cimport cython
cimport numpy as cnp
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t
from libc.stdlib cimport malloc, free

from shmkv._core cimport (shmkv_ctx_t, shmkv_sid_slot, shmkv_table, segment_ctx,
                          raise_status, lock_seqs, unlock_seqs, bind_debug_state)
from shmkv._layout cimport *

from .errors import SegmentError, SequenceNotFound

cnp.import_array()
bind_debug_state()     # it compiles the kernels too: their switches are _core's

cdef extern from "kernels/attention.h" nogil:
    enum:
        SHMKV_ATT_F32
        SHMKV_ATT_F16
        SHMKV_ATT_BF16
        SHMKV_ATT_I8
        SHMKV_ATT_E4M3
        SHMKV_ISA_SCALAR
        SHMKV_ISA_AVX2
        SHMKV_ISA_AVX512
        SHMKV_ISA_AMX
        SHMKV_ATT_OK
        SHMKV_ATT_ECORRUPT
        SHMKV_ATT_ENOMEM
        SHMKV_PREC_FP32
        SHMKV_PREC_BF16
    ctypedef struct shmkv_attn_args_t:
        const uint8_t *kpool
        const uint8_t *vpool
        int kv_dtype
        const float *kscale
        const float *vscale
        const float *khead
        const float *vhead
        uint32_t num_blocks, block_size, hkv, hq, d
        uint32_t nseq
        const int32_t *const *tables
        const uint32_t *seq_lens
        const uint32_t *q_lens
        const uint64_t *q_start
        const void *q
        int q_dtype
        float *out
        float scale
        int precision
    int shmkv_attention(const shmkv_attn_args_t *a, int *bad_seq)
    int shmkv_attn_set_threads(int n)
    int shmkv_attn_get_threads()
    int shmkv_attn_cpu_isa()
    int shmkv_attn_isa()
    int shmkv_attn_force_isa(int isa)
    int shmkv_attn_force_rows(int on)
    int shmkv_attn_dot_isa()
    int shmkv_attn_force_dots(int on)
    int shmkv_attn_plan(const uint32_t *q_lens, const uint32_t *seq_lens, uint32_t nseq,
                        uint32_t group, int wide, int threads, uint32_t *rt, uint64_t *chunk)
    const char *shmkv_attn_pool()
    const char *shmkv_attn_build()
    double shmkv_attn_run_timed(shmkv_task_fn fn, void *job, int threads, int *used,
                                void (*setup)(void *job, int t) noexcept nogil)

ISA_NAMES = ("scalar", "avx2", "avx512", "amx")

# pool dtype code (config.DTYPES) -> kernel element type; the quantized pools (int8,
# float8_e4m3) are read directly, their scales applied to scores and probabilities
_KV_TYPES = {1: SHMKV_ATT_F16, 2: SHMKV_ATT_F32, 3: SHMKV_ATT_BF16, 4: SHMKV_ATT_I8,
             5: SHMKV_ATT_E4M3}
_POOL_NAMES = {1: "float16", 2: "float32", 3: "bfloat16", 4: "int8", 5: "float8_e4m3"}


def set_num_threads(n):
    """Threads of the attention kernel's own pool, the calling thread included (default:
    the CPUs of this process's affinity mask; 0 restores that)."""
    n = operator.index(n)
    if n < 0 or n > 1024:
        raise ValueError(f"n: expected 0 <= n <= 1024, got {n}")
    shmkv_attn_set_threads(<int>n)


def get_num_threads():
    """Threads the attention kernel uses."""
    return shmkv_attn_get_threads()


def isa():
    """The instruction set the kernel uses now: "amx" (AVX-512, prefill on AMX-BF16 tiles),
    "avx512", "avx2" or "scalar"."""
    return ISA_NAMES[shmkv_attn_isa()]


def pool():
    """The threads the kernel runs on: "openmp" (the team of an OpenMP runtime already in
    the process, torch's, shared instead of fought over) or "own" (the kernel's pool)."""
    return shmkv_attn_pool().decode()


def cpu_isa():
    """The best instruction set this CPU runs."""
    return ISA_NAMES[shmkv_attn_cpu_isa()]


def _force_isa(name):
    """Test hook: force a path ("scalar", "avx2", "avx512", "amx"), or None for the default
    (the CPU's best, capped by SHMKV_ISA=name, or its older name SHMKV_ATTN_ISA, read once
    at the first probe).  ValueError if this CPU cannot run it."""
    if name is None:
        shmkv_attn_force_isa(-1)
        return
    if name not in ISA_NAMES:
        raise ValueError(f"isa: expected one of {ISA_NAMES}, got {name!r}")
    if shmkv_attn_force_isa(ISA_NAMES.index(name)) != 0:
        raise ValueError(f"isa {name!r}: this CPU runs at most {cpu_isa()!r}")


def _force_rows(on):
    """Test and benchmark hook: True runs prefill rows on the row item only (the kernel
    before the GEMM-shaped item existed); False (the default) takes the GEMM item where
    it applies: a vector ISA, several rows, at least 32 query vectors per kv head, and no
    AMX tile path for the pool."""
    shmkv_attn_force_rows(1 if on else 0)


PRECISIONS = ("fp32", "bf16")


def dot_isa():
    """The dot-product instructions ``precision="bf16"`` runs on here, under the ISA in use:
    "avx512_bf16+vnni", "avx512_bf16", "avx512_vnni", or "fma" (no such instructions, or
    switched off: q and the weights are rounded the same way, the products are FMAs)."""
    bits = shmkv_attn_dot_isa()
    names = [n for b, n in ((1, "avx512_bf16"), (2, "avx512_vnni")) if bits & b]
    if len(names) == 2:
        return "avx512_bf16+vnni"
    return names[0] if names else "fma"


def _build():
    """The compiler that built the kernel, and whether it optimised (what the default
    mode's recorded digests belong to)."""
    return shmkv_attn_build().decode()


def _force_dots(on):
    """Test and benchmark hook: False runs ``precision="bf16"`` on the FMA paths even where
    the CPU has the bf16 / int8 dot instructions; True (the default) uses them."""
    shmkv_attn_force_dots(1 if on else 0)


def _plan(q_lens, seq_lens, group, wide, threads):
    """Test hook: the work items the kernel makes for sequences with these query rows and
    lengths (``group`` query heads per kv head; ``wide``: the GEMM items or the tiles are in
    use; ``threads`` threads): (query rows per item, keys per chunk or None when the keys
    are not split)."""
    ql = np.ascontiguousarray(q_lens, dtype=np.uint32)
    sl = np.ascontiguousarray(seq_lens, dtype=np.uint32)
    if ql.ndim != 1 or ql.shape[0] == 0 or sl.shape != ql.shape:
        raise ValueError(f"q_lens, seq_lens: expected two 1-d sequences of one length >= 1, "
                         f"got shapes {ql.shape} and {sl.shape}")
    g, t = operator.index(group), operator.index(threads)
    if not (1 <= g <= 1 << 16 and 1 <= t <= 1024):
        raise ValueError(f"group, threads: expected 1..65536 and 1..1024, got {g}, {t}")
    cdef const uint32_t[::1] qv = ql
    cdef const uint32_t[::1] sv = sl
    cdef uint32_t rt = 0
    cdef uint64_t chunk = 0
    if shmkv_attn_plan(&qv[0], &sv[0], <uint32_t>qv.shape[0], g, 1 if wide else 0, t,
                       &rt, &chunk) != 0:
        raise ValueError("q_lens, seq_lens, group, threads: expected 1 <= q_len <= seq_len, "
                         f"group >= 1, threads >= 1; got {list(ql)}, {list(sl)}, {group}, "
                         f"{threads}")
    return int(rt), (None if chunk == 0xFFFFFFFFFFFFFFFF else int(chunk))


cdef double run_timed(shmkv_task_fn fn, void *job, int threads, int *used,
                      void (*setup)(void *job, int t) noexcept nogil) noexcept nogil:
    """shmkv._bench's way onto the kernel's pool (kernels/bench_floor.h): see
    shmkv_attn_run_timed in kernels/attention.h."""
    return shmkv_attn_run_timed(fn, job, threads, used, setup)


cdef int _q_type(object dt, object pool_dt, int pool_code) except -1:
    if dt == np.float32:
        return SHMKV_ATT_F32
    if dt == np.float16:
        return SHMKV_ATT_F16
    if pool_code == 3 and dt == pool_dt:
        return SHMKV_ATT_BF16
    raise TypeError(f"q: expected dtype float32, float16 or the pool's "
                    f"{_POOL_NAMES.get(pool_code)}, got {dt}")


def attention(cache, layer, q, sids, q_lens=None, scale=None, out=None, precision="fp32"):
    """See KVCache.attention."""
    cdef shmkv_ctx_t *c = segment_ctx(cache)
    if not isinstance(precision, str):
        raise TypeError(f"precision: expected str, got {type(precision).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    cdef uint32_t hkv = c.cfg.num_kv_heads, D = c.cfg.head_dim
    # ---- arguments (nothing is locked yet) -------------------------------------------
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"layer: expected int, got {type(layer).__name__}")
    if not 0 <= layer < c.cfg.num_layers:
        raise IndexError(f"layer: expected 0 <= layer < {c.cfg.num_layers}, got {layer}")
    cdef int pool_code = <int>c.cfg.dtype
    if pool_code not in _KV_TYPES:
        raise TypeError(f"attention: pools of dtype {_POOL_NAMES.get(pool_code, pool_code)} "
                        f"are not supported yet (float32, float16, bfloat16 are)")
    if not isinstance(q, np.ndarray):
        raise TypeError(f"q: expected numpy.ndarray, got {type(q).__name__}")
    pool_dt = cache.config.numpy_dtype
    cdef int qt = _q_type(q.dtype, pool_dt, pool_code)
    if q.ndim != 3:
        raise ValueError(f"q: expected 3 dimensions [rows, num_q_heads, {D}], got shape "
                         f"{q.shape}")
    cdef Py_ssize_t rows = q.shape[0], hq = q.shape[1]
    if q.shape[2] != D:
        raise ValueError(f"q: expected head_dim {D}, got shape {q.shape}")
    if hq < 1 or hq % hkv:
        raise ValueError(f"q: expected num_q_heads a multiple of num_kv_heads {hkv}, got "
                         f"{hq}")
    if rows < 1:
        raise ValueError(f"q: expected at least one row, got shape {q.shape}")
    sa = _int_vector(sids, "sids", "ids", _sid_bound)
    cdef Py_ssize_t B = sa.shape[0], i
    if q_lens is None:
        if B != rows:
            raise ValueError(f"sids: expected {rows} ids (one per row of q), got {B}")
        la = np.ones(B, np.int64)
    else:
        la = _int_vector(q_lens, "q_lens", "lengths", _len_bound)
        if la.shape[0] != B:
            raise ValueError(f"q_lens: expected {B} lengths (one per sid), got "
                             f"{la.shape[0]}")
        if B and la.min() < 1:
            raise ValueError(f"q_lens: expected every length >= 1, got {la.min()}")
        if int(la.sum()) != rows:
            raise ValueError(f"q_lens: expected lengths summing to q's {rows} rows, got "
                             f"{int(la.sum())}")
    if B == 0:
        raise ValueError("sids: expected at least one sequence")
    if out is None:
        oa = np.empty(q.shape, np.float32)
    else:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out: expected numpy.ndarray, got {type(out).__name__}")
        if out.dtype != np.float32:
            raise TypeError(f"out: expected dtype float32, got {out.dtype}")
        if out.shape != q.shape:
            raise ValueError(f"out: expected shape {q.shape}, got {out.shape}")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("out: expected a C-contiguous, writable array")
        if np.shares_memory(out, q):
            raise ValueError("out: must not overlap q")
        oa = out
    qa = np.ascontiguousarray(q)
    fscale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    # ---- the distinct sequences, in lock order (ascending slot) --------------------------
    cdef const int64_t *sp = <const int64_t *>cnp.PyArray_DATA(sa)
    cdef const int64_t *lp = <const int64_t *>cnp.PyArray_DATA(la)
    uniq = sorted(set(sa.tolist()), key=lambda s: (s % c.cfg.max_seqs, s))
    cdef Py_ssize_t U = len(uniq)
    ua = np.array(uniq, np.int64)
    cdef const int64_t *up = <const int64_t *>cnp.PyArray_DATA(ua)
    # one malloc for the per-call arrays (a few bytes per sequence)
    cdef size_t per = sizeof(uint32_t) * 2 + sizeof(uint64_t) * 2 + sizeof(void *)
    cdef uint8_t *mem = <uint8_t *>malloc(<size_t>(U + B) * per + 64)
    if mem == NULL:
        raise MemoryError()
    cdef uint32_t *uslots = <uint32_t *>mem
    cdef uint32_t *ulens = uslots + U
    cdef uint32_t *slens = ulens + U
    cdef uint32_t *qls = slens + B
    cdef uint64_t *qst = <uint64_t *>(<uint8_t *>(qls + B) + (8 - (<size_t>(qls + B)) % 8) % 8)
    cdef const int32_t **tabs = <const int32_t **>(qst + B)
    cdef shmkv_attn_args_t a
    cdef int st, bad = -1
    cdef Py_ssize_t u, pos
    cdef uint64_t start = 0
    cdef bint locked = False
    cdef uint64_t lyr
    try:
        lock_seqs(c, up, U, uslots, ulens)
        locked = True
        index = {uniq[u]: u for u in range(U)}
        for i in range(B):
            u = index[sp[i]]
            if ulens[u] == 0:
                raise ValueError(f"sequence {sp[i]}: empty (no tokens to attend to)")
            if <uint64_t>lp[i] > ulens[u]:
                raise ValueError(f"q_lens[{i}]: expected <= seq_len {ulens[u]} of sequence "
                                 f"{sp[i]}, got {lp[i]}")
            slens[i] = ulens[u]
            qls[i] = <uint32_t>lp[i]
            qst[i] = start
            start += <uint64_t>lp[i]
            tabs[i] = shmkv_table(c, uslots[u])
        a.kpool = c.kpool + <uint64_t>layer * c.lay.layer_stride
        a.vpool = c.vpool + <uint64_t>layer * c.lay.layer_stride
        a.kv_dtype = _KV_TYPES[pool_code]
        a.kscale = a.vscale = a.khead = a.vhead = NULL
        lyr = <uint64_t>layer
        if c.kscale != NULL and c.vscale != NULL:          # int8: per-slot scales
            a.kscale = <const float *>(<uint8_t *>c.kscale + lyr * c.lay.scale_stride)
            a.vscale = <const float *>(<uint8_t *>c.vscale + lyr * c.lay.scale_stride)
        if c.hscale != NULL:                               # float8: per-head scales
            a.khead = c.hscale + lyr * hkv
            a.vhead = c.hscale + (<uint64_t>c.cfg.num_layers + lyr) * hkv
        a.num_blocks = c.cfg.num_blocks
        a.block_size = c.cfg.block_size
        a.hkv = hkv
        a.hq = <uint32_t>hq
        a.d = D
        a.nseq = <uint32_t>B
        a.tables = tabs
        a.seq_lens = slens
        a.q_lens = qls
        a.q_start = qst
        a.q = cnp.PyArray_DATA(qa)
        a.q_dtype = qt
        a.out = <float *>cnp.PyArray_DATA(oa)
        a.scale = <float>fscale
        a.precision = SHMKV_PREC_BF16 if precision == "bf16" else SHMKV_PREC_FP32
        with nogil:
            st = shmkv_attention(&a, &bad)
        if st == SHMKV_ATT_ENOMEM:
            raise MemoryError("attention: scratch memory")
        if st == SHMKV_ATT_ECORRUPT:
            raise SegmentError(f"sequence {sp[bad] if 0 <= bad < B else '?'}: its block "
                               f"table holds a block id outside the pool", reason="corrupt")
        if st != SHMKV_ATT_OK:
            raise SegmentError(f"attention: kernel status {st}")
    finally:
        if locked:
            unlock_seqs(c, uslots, U)
        free(mem)
    return oa


ctypedef object (*_bound_t)(object v)


cdef object _sid_bound(object v):
    if v < 0 or v > 0x7FFFFFFFFFFFFFFF:
        return SequenceNotFound(f"sequence {v}: unknown or freed sequence")
    return None


cdef object _len_bound(object v):
    if v > 0x7FFFFFFF:
        return ValueError(f"q_lens: expected lengths < 2**31, got {v}")
    return None


cdef object _int_vector(object x, str what, str noun, _bound_t bound):
    """``x``, a 1-d integer ndarray or an iterable of ints, as a contiguous int64 vector.
    ``bound(v)`` is the exception for a value out of range, or None: it sees every value
    of an iterable, and an array's largest (the kernel checks ids and lengths again)."""
    if isinstance(x, np.ndarray):
        if x.ndim != 1:
            raise ValueError(f"{what}: expected a 1-d array, got shape {x.shape}")
        if x.dtype.kind not in "iu" or x.dtype.itemsize > 8:
            raise TypeError(f"{what}: expected integer {noun}, got dtype {x.dtype}")
        err = bound(x.max()) if x.size else None
        if err is not None:
            raise err
        return np.ascontiguousarray(x, dtype=np.int64)
    out = []
    for v in x:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{what}: expected int {noun}, got {type(v).__name__}")
        err = bound(v)
        if err is not None:
            raise err
        out.append(int(v))
    return np.array(out, dtype=np.int64)
