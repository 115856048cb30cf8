"""Digests of the attention kernel's default-precision results, bit for bit.

The opt-in reduced-precision mode must leave the default mode exactly as it was.  The cases
below are deterministic (seeded inputs, fixed thread counts); `digests()` runs each on every
vector and scalar path this CPU can force and hashes the float32 output bytes.
`tests/data/attention_default.json` holds the digests the kernel gave before the opt-in
existed; `test_attention_precision.py` recomputes and compares them.  A deliberate change to
the default arithmetic regenerates the file (`python tools/attention_golden.py`) and says so
in its commit.

Every path here is deterministic across CPUs of one ISA: IEEE-754 vector operations in a
fixed order, glibc's expf (the FMA variant on every machine this project meets).  The AMX
path is not recorded (its tiles' accumulation order is the hardware's).  So a digest is
keyed by the build (`_attention._build()`: compiler and optimisation) and the forced ISA,
and by nothing else: the inputs are made here bit for bit (seeded numpy, float32 IEEE
casts, `pool_input`'s own bfloat16 rounding), never by a dependency's conversion whose
rounding may change in a release.
"""
import hashlib
import os
import uuid

import numpy as np

import shmkv
from shmkv import _attention

RECORDED_ISAS = ("scalar", "avx2", "avx512")

# (name, pool dtype, hkv, hq, d, block, lengths, q_lens or None, q dtype)
CASES = [
    ("decode-f32", "float32", 2, 8, 64, 16, [37, 300, 1000], None, "float32"),
    ("decode-f16", "float16", 2, 8, 64, 16, [37, 300, 1000], None, "float16"),
    ("decode-bf16", "bfloat16", 2, 8, 64, 16, [37, 300, 1000], None, "bfloat16"),
    ("decode-bf16-qf32", "bfloat16", 2, 8, 128, 16, [1, 700], None, "float32"),
    ("decode-i8", "int8", 2, 8, 64, 16, [37, 300, 1000], None, "float32"),
    ("decode-e4m3", "float8_e4m3", 2, 8, 64, 16, [37, 300, 1000], None, "float16"),
    ("decode-mha-d32", "float16", 4, 4, 32, 8, [3000], None, "float32"),
    ("prefill-f32", "float32", 2, 8, 64, 16, [300, 90], [64, 40], "float32"),
    ("prefill-f16", "float16", 2, 8, 64, 16, [300, 90], [64, 40], "float16"),
    ("prefill-bf16", "bfloat16", 2, 8, 64, 16, [300, 90], [64, 40], "bfloat16"),
    ("prefill-i8", "int8", 2, 8, 64, 16, [300, 90], [64, 40], "float32"),
    ("prefill-e4m3", "float8_e4m3", 2, 8, 64, 16, [300, 90], [64, 40], "float32"),
    ("prefill-long-bf16", "bfloat16", 1, 4, 128, 16, [1500], [200], "float32"),
]
THREADS = (1, 2)


def run_case(case, threads, name_tag="golden", precision=None):
    """The output of one case on `threads` threads, on the ISA path forced now."""
    name, dtype, hkv, hq, d, bs, lengths, q_lens, qdt = case
    rng = np.random.default_rng(_seed(name))
    nb = sum(-(-n // bs) for n in lengths) + 4
    cfg = shmkv.CacheConfig(num_layers=1, num_kv_heads=hkv, head_dim=d, num_blocks=nb,
                            block_size=bs, dtype=dtype, max_seqs=8)
    seg = f"shmkv-{name_tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cache = shmkv.KVCache.create(seg, cfg)
    try:
        sids = []
        for n in lengths:
            sid = cache.create_sequence()
            shape = (1, n, hkv, d)
            k = pool_input(rng.standard_normal(shape) * 0.7, cfg.compute_dtype)
            v = pool_input(rng.standard_normal(shape), cfg.compute_dtype)
            cache.append(sid, k, v)
            sids.append(sid)
        rows = len(lengths) if q_lens is None else sum(q_lens)
        q = rng.standard_normal((rows, hq, d)).astype(np.float32)
        q = pool_input(q, cache.config.numpy_dtype if qdt == "bfloat16" else np.dtype(qdt))
        before = _attention.get_num_threads()
        _attention.set_num_threads(threads)
        try:
            kw = {} if precision is None else {"precision": precision}
            return cache.attention(0, q, sids, q_lens=q_lens, **kw)
        finally:
            _attention.set_num_threads(before)
    finally:
        cache.close()
        cache.unlink()


def pool_input(x, dtype):
    """float64 or float32 `x` as `dtype`, with bfloat16 made here rather than by ml_dtypes:
    float64 -> float32 (IEEE, round to nearest even), then float32 -> bfloat16 (round to
    nearest even on the bits).  ml_dtypes 0.7 casts float64 straight to bfloat16 (one
    rounding) where 0.6 and older went through float32 (two), which changes ~1 element in
    2**17 of these inputs and so every bfloat16 digest; the digests were recorded from the
    two-rounding inputs, which this reproduces under any ml_dtypes."""
    dtype = np.dtype(dtype)
    if dtype.name != "bfloat16":
        return x.astype(dtype)
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16).view(dtype)


def _seed(name):
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def digest(out):
    return hashlib.sha256(np.ascontiguousarray(out, np.float32).tobytes()).hexdigest()[:32]


def digests(isas=None):
    """{isa: {"case/threads": digest}} for the recorded ISAs this CPU runs (or `isas`)."""
    order = ["scalar", "avx2", "avx512", "amx"]
    can = [n for n in RECORDED_ISAS if order.index(n) <= order.index(_attention.cpu_isa())]
    before = _attention.isa()
    result = {}
    try:
        for isa in (isas or can):
            _attention._force_isa(isa)
            result[isa] = {f"{c[0]}/{t}": digest(run_case(c, t)) for c in CASES
                           for t in THREADS}
    finally:
        _attention._force_isa(before)
    return result
