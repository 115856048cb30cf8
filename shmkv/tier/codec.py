"""The tier's keys and values.

Key: ``shmkv:{fingerprint hex}:{block hash hex}``.  The fingerprint (16 bytes) is a
blake2b of the layout: model dims, dtype, block size, block-hash function and seed; two
segments share tier entries exactly when they would compute the same block hashes for
the same bytes.

Value (little-endian), one per full block::

    offset  size  field
         0     8  magic b"SHMKVTR1"
         8     4  format version (1)
        12     4  header bytes (64)
        16    16  layout fingerprint
        32    16  block hash (h0, h1: the prefix cache's 128-bit hash)
        48     8  payload bytes (token ids + K + V)
        56     8  checksum: shmkv._prefix.tier_checksum(payload, seed=checksum of bytes 0..55)
        64        token ids int32 [block_size]
                  K [num_layers, block_size, num_kv_heads, head_dim] (the pool's dtype)
                  V likewise

The checksum is shmkv's own 64-bit four-lane multiply-rotate sum (C, ~10 GB/s, GIL
released: zlib.crc32 runs ~1 GB/s here and blake2b slower).  A value of any other size,
magic, version, fingerprint, block hash, token ids or checksum is a miss, never data.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Any, Dict, Optional

import numpy as np

from .._prefix import tier_checksum

__all__ = ["Layout", "MAGIC", "VERSION", "HEADER"]

MAGIC = b"SHMKVTR1"
VERSION = 1
HEADER = 64
_HDR = struct.Struct("<8sII16s16sQ")       # through the payload size: 56 bytes
_CK = struct.Struct("<Q")


class Layout:
    """Keys, sizes and the codec of one segment's layout."""

    def __init__(self, info: Dict[str, int], numpy_dtype: Any) -> None:
        self.info = dict(info)
        self.block_size = info["block_size"]
        self.shape = (info["num_layers"], info["block_size"], info["num_kv_heads"],
                      info["head_dim"])
        self.dtype = np.dtype(numpy_dtype)
        self.kv_bytes = int(np.prod(self.shape)) * info["itemsize"]
        self.tok_bytes = 4 * self.block_size
        self.payload = self.tok_bytes + 2 * self.kv_bytes
        self.size = HEADER + self.payload
        desc = ("shmkv-tier/v1 layers={num_layers} kv_heads={num_kv_heads} "
                "head_dim={head_dim} block_size={block_size} dtype={dtype} "
                "itemsize={itemsize} hash={hash_algo} seed={hash_seed:x}").format(**info)
        self.fingerprint = hashlib.blake2b(desc.encode(), digest_size=16).digest()
        self.prefix = b"shmkv:" + self.fingerprint.hex().encode() + b":"

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
