"""The tier's keys and values.

Key: ``shmkv:{fingerprint hex}:{block hash hex}``.  The fingerprint (16 bytes) is a
blake2b of the layout: model dims, dtype, block size, block-hash function and seed, and
for a float8_e4m3 pool its per-(layer, kv head) scale table (``set_kv_scales``): two
segments share tier entries exactly when they would compute the same block hashes for
the same bytes and read the same codes as the same numbers.

Value (little-endian), one per full block::

    offset  size  field
         0     8  magic b"SHMKVTR1"
         8     4  format version (1)
        12     4  header bytes (64)
        16    16  layout fingerprint
        32    16  block hash (h0, h1: the prefix cache's 128-bit hash)
        48     8  payload bytes (token ids + K + V)
        56     8  checksum: shmkv._checksum.tier_checksum(payload, seed=checksum of bytes 0..55)
        64        token ids int32 [block_size]
                  K [num_layers, block_size, num_kv_heads, head_dim] (the pool's dtype)
                  V likewise
                  int8 pools only: K scales float32 [num_layers, block_size, num_kv_heads],
                  V scales likewise (the scale of every token and kv head, each layer)

A float8 pool's values hold codes only (their scales are the table in the fingerprint).
K + V (+ scales) is ``cfg.bytes_per_block``.  A quantized block is loaded by appending
its dequantized float32 values (code * scale): the pool's quantizer gives back exactly
the codes and scales a host wrote (tests/test_quant.py checks it); a value whose codes or
scales dequantize to NaN or inf is a miss (append refuses it, nothing lands).

The checksum is shmkv's own 64-bit four-lane multiply-rotate sum (C, ~10 GB/s, GIL
released: zlib.crc32 runs ~1 GB/s here and blake2b slower).  A value of any other size,
magic, version, fingerprint, block hash, token ids or checksum is a miss, never data.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Any, Dict, Optional

import numpy as np

from .._checksum import tier_checksum

__all__ = ["Layout", "MAGIC", "VERSION", "HEADER", "scale_table"]

MAGIC = b"SHMKVTR1"
VERSION = 1
HEADER = 64
_HDR = struct.Struct("<8sII16s16sQ")       # through the payload size: 56 bytes
_CK = struct.Struct("<Q")


def scale_table(cache: Any) -> Optional[np.ndarray]:
    """A float8_e4m3 pool's scale table, float32 [2, num_layers, num_kv_heads] (K, V);
    None for other pools."""
    if cache.config.dtype != "float8_e4m3":
        return None
    per = [cache.kv_scales(layer) for layer in range(cache.config.num_layers)]
    return np.array([[p[0] for p in per], [p[1] for p in per]], np.float32)


class Layout:
    """Keys, sizes and the codec of one segment's layout."""

    def __init__(self, info: Dict[str, int], numpy_dtype: Any,
                 table: Optional[np.ndarray] = None) -> None:
        """``table``: a float8_e4m3 pool's scales, float32 [2, num_layers, num_kv_heads]
        (K, V), as ``kv_scales`` reads them."""
        self.info = dict(info)
        self.block_size = info["block_size"]
        self.shape = (info["num_layers"], info["block_size"], info["num_kv_heads"],
                      info["head_dim"])
        self.dtype = np.dtype(numpy_dtype)
        self.kv_bytes = int(np.prod(self.shape)) * info["itemsize"]
        self.tok_bytes = 4 * self.block_size
        self.int8 = self.dtype == np.int8
        self.float8 = self.dtype.name.startswith("float8")
        self.quantized = self.int8 or self.float8
        self.sc_shape = self.shape[:3]
        self.sc_bytes = 4 * int(np.prod(self.sc_shape)) if self.int8 else 0
        self.payload = self.tok_bytes + 2 * self.kv_bytes + 2 * self.sc_bytes
        self.size = HEADER + self.payload
        desc = ("shmkv-tier/v1 layers={num_layers} kv_heads={num_kv_heads} "
                "head_dim={head_dim} block_size={block_size} dtype={dtype} "
                "itemsize={itemsize} hash={hash_algo} seed={hash_seed:x}").format(**info)
        fp = hashlib.blake2b(desc.encode(), digest_size=16)
        self.table: Optional[np.ndarray] = None
        if self.float8:
            if table is None:
                raise ValueError("a float8_e4m3 layout needs its scale table")
            self.table = np.ascontiguousarray(table, np.float32).reshape(
                2, info["num_layers"], info["num_kv_heads"])
            fp.update(b" e4m3-scales:" + self.table.tobytes())
        elif self.int8:
            fp.update(b" int8-scales:f32[layers,block_size,kv_heads]")
        self.fingerprint = fp.digest()
        self.prefix = b"shmkv:" + self.fingerprint.hex().encode() + b":"

    @classmethod
    def of(cls, cache: Any, port: Any) -> "Layout":
        """The layout of a cache's segment, from the tier port ``set_tier`` gave (with
        its scale table now, for float8)."""
        return cls(port.layout(), cache.config.numpy_dtype, scale_table(cache))

    def key(self, h0: int, h1: int) -> bytes:
        return self.prefix + b"%016x%016x" % (h0, h1)

    def views(self, buf: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token ids, K, V) numpy views into one value buffer."""
        toks = np.frombuffer(buf, np.int32, self.block_size, HEADER)
        k = np.frombuffer(buf, self.dtype, int(np.prod(self.shape)),
                          HEADER + self.tok_bytes).reshape(self.shape)
        v = np.frombuffer(buf, self.dtype, int(np.prod(self.shape)),
                          HEADER + self.tok_bytes + self.kv_bytes).reshape(self.shape)
        return toks, k, v

    def scale_views(self, buf: Any) -> tuple[np.ndarray, np.ndarray]:
        """An int8 layout's (K scales, V scales) views into one value buffer."""
        off = HEADER + self.tok_bytes + 2 * self.kv_bytes
        n = int(np.prod(self.sc_shape))
        return (np.frombuffer(buf, np.float32, n, off).reshape(self.sc_shape),
                np.frombuffer(buf, np.float32, n, off + self.sc_bytes).reshape(self.sc_shape))

    def fill(self, buf: Any, raw: tuple[np.ndarray, ...]) -> None:
        """Copies ``gather(..., raw=True)`` of one block (codes, and an int8 pool's
        scales) into a value buffer."""
        _, k, v = self.views(buf)
        k[...] = raw[0]
        v[...] = raw[1]
        if self.int8:
            ks, vs = self.scale_views(buf)
            ks[...] = raw[2]
            vs[...] = raw[3]

    def dequantize(self, buf: Any, out: tuple[np.ndarray, np.ndarray]) -> None:
        """A quantized value's K and V as float32 (code * scale) into ``out``: what
        ``append`` quantizes back to the same codes and scales.  NaN/inf where the value
        holds NaN codes or scales that are not finite (append then refuses it)."""
        _, k, v = self.views(buf)
        if self.int8:
            sc = self.scale_views(buf)
        else:
            assert self.table is not None
            sc = (self.table[0][:, None, :], self.table[1][:, None, :])
        with np.errstate(over="ignore", invalid="ignore"):
            for codes, s, o in zip((k, v), sc, out):
                o[...] = codes
                o *= s[..., None]

    def seal(self, buf: Any, h0: int, h1: int) -> None:
        """Writes the header of a value whose payload is in place."""
        mv = memoryview(buf)
        _HDR.pack_into(buf, 0, MAGIC, VERSION, HEADER, self.fingerprint,
                       struct.pack("<QQ", h0, h1), self.payload)
        seed = tier_checksum(mv[:56])
        _CK.pack_into(buf, 56, tier_checksum(mv[HEADER:self.size], seed))

    def check(self, buf: Any, h0: int, h1: int, tokens: Optional[np.ndarray]) -> Optional[str]:
        """None if buf is a whole, intact value of this layout for this block (with
        these token ids), else why not: "size", "magic", "foreign", "hash", "tokens",
        "checksum"."""
        mv = memoryview(buf).cast("B")
        if len(mv) != self.size:
            return "size"
        magic, ver, hl, fp, bh, nb = _HDR.unpack_from(mv, 0)
        if magic != MAGIC or ver != VERSION or hl != HEADER or nb != self.payload:
            return "magic"
        if fp != self.fingerprint:
            return "foreign"
        if bh != struct.pack("<QQ", h0, h1):
            return "hash"
        seed = tier_checksum(mv[:56])
        if _CK.unpack_from(mv, 56)[0] != tier_checksum(mv[HEADER:], seed):
            return "checksum"
        if tokens is not None and not np.array_equal(
                np.frombuffer(mv, np.int32, self.block_size, HEADER), tokens):
            return "tokens"
        return None
