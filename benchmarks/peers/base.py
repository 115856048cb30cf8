"""What the peers share: argument checks and the token-major block layout of the
key-value-store peers."""
from __future__ import annotations

import numpy as np


class PeerError(KeyError):
    """Unknown or freed sequence id (the peers' SequenceNotFound)."""


class PeerFull(MemoryError):
    """Block pool or sequence slots exhausted (the peers' CacheFullError)."""


def check_tokens(cfg, k, v):
    """k, v: [num_layers, n >= 1, heads, dim] of the config's dtype; returns n."""
    want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    for name, a in (("k", k), ("v", v)):
        if not isinstance(a, np.ndarray) or a.dtype != cfg.numpy_dtype:
            raise TypeError(f"{name}: expected ndarray of {cfg.numpy_dtype}")
        if a.ndim != 4 or (a.shape[0], a.shape[2], a.shape[3]) != want or a.shape[1] < 1:
            raise ValueError(f"{name}: expected shape ({want[0]}, n, {want[1]}, {want[2]}), "
                             f"got {a.shape}")
    if k.shape != v.shape:
        raise ValueError("v: expected the shape of k")
    return k.shape[1]


def out_arrays(cfg, n, out):
    """The (k, v) destination of a gather of n tokens: `out` checked, or new arrays."""
    shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
    if out is None:
        return np.empty(shape, cfg.numpy_dtype), np.empty(shape, cfg.numpy_dtype)
    ko, vo = out
    for a in (ko, vo):
        if a.shape != shape or a.dtype != cfg.numpy_dtype or not a.flags.c_contiguous:
            raise ValueError(f"out: expected C-contiguous {shape} {cfg.numpy_dtype}")
    return ko, vo


def token_range(length, start, stop):
    a = 0 if start is None else int(start)
    b = length if stop is None else int(stop)
    if not 0 <= a <= b <= length:
        raise IndexError(f"token range: expected 0 <= start <= stop <= {length}, got [{a}, {b})")
    return a, b


# ---- token-major layout of a block value (LMDB, Redis) --------------------------------
# A block value holds its tokens one after another; one token is [2 (K, V)][layers][heads *
# dim].  So an append of one token is one contiguous write at offset off * bytes_per_token
# (Redis SETRANGE; an LMDB value grows by one token), and a value only ever holds the tokens
# written so far.

def to_token_major(k, v):
    """[L, n, H, D] x 2 -> contiguous [n, 2, L, H, D] (one copy)."""
    return np.ascontiguousarray(np.stack((k, v)).transpose(2, 0, 1, 3, 4))


def block_view(cfg, buf, ntok):
    """A block value (bytes-like) -> ndarray [ntok, 2, L, H, D] without a copy."""
    return np.frombuffer(buf, dtype=cfg.numpy_dtype,
                         count=ntok * cfg.bytes_per_token // cfg.itemsize).reshape(
        ntok, 2, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


def copy_tokens_out(blk, a, cnt, ko, vo, o):
    """Tokens [a, a+cnt) of a token-major block view into ko/vo[:, o:o+cnt]."""
    ko[:, o:o + cnt] = blk[a:a + cnt, 0].transpose(1, 0, 2, 3)
    vo[:, o:o + cnt] = blk[a:a + cnt, 1].transpose(1, 0, 2, 3)


def pad_tables(tables, lens):
    """Block-id lists -> (int32 [B, W] padded with -1, int32 [B])."""
    W = max((len(t) for t in tables), default=0)
    out = np.full((len(tables), W), -1, np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out, np.asarray(lens, np.int32)
