#!/usr/bin/env python3
"""tools/fuzz_attach.py -- feed random and mutated segments to attach() and snapshot(),
and, on those that attach, every read path including cache.attention().

A few real, small segments are made first (templates: live, forked, copied-on-write,
detached and half-filled sequences; different configs).  Case i of a run is a
deterministic function of (--seed, i): random bytes, bit flips in the header, header
fields set to edge values (with and without a recomputed checksum), whole consistent
headers for another config laid over the old body, structured and raw mutations of the
shared area / block metadata / free list / process table / sequence slots / block
tables / hash index / pools, truncations, extensions, zero length, state words.  Each
case is written as a new shared-memory object, then:

  * snapshot(name)       -- the read-only inspection path: a result, or
                                        SegmentError / FileNotFoundError / ValueError
  * shmkv.KVCache.attach(name)       -- success, or SegmentError / FileNotFoundError /
                                        ValueError; any other exception is a finding
  * when attached (half of the time with recover=False, so the calls meet the corruption
    before any repair): check(), stats(), sequences(), seq_len / block_table / gather of every
    sequence, cache.attention() over them (decode and q_lens: a result, SegmentError, or
    ValueError for a length read as 0), batch_block_tables(), truncate() of one of them,
    recover(), check() again, a create + append + fork + truncate + free, a truncate of a
    surviving sequence, the vLLM connector's calls (its scheduler's match_prefix, its
    worker's save: create_sequence(tokens=) of a prefix the segment may hold, reserve(tokens=)
    of the rest, commit, free) with the templates' own token ids and with others, close()
    -- ShmkvError subclasses are fine; anything else is a finding

and unlinked.  Two kinds of case go further than one process's view of a still segment:

  * ``pending``: a ``NAME.pending`` table (shmkv.pending) with hostile records at the
    probe paths of the keys the calls use (keys 0 and 2**64-1, owners outside the token
    range, deadlines NaN, infinite, past or too far), a hostile header or size, and live
    marks of this process's two owners planted among them; then ``PendingMarks`` twice
    (a ``PendingTableError``, or held / claim_keys / marks / release from each) and the
    engine's ``EngineMarks`` (never raises).  A key one owner claims that the other does
    not see held is a finding (a lost mark: two instances would compute one prefix).
  * ``live``: a real segment attached while a forked writer puts hostile values into its
    metadata (every region but the pool mutex's bytes, ~10k writes a second): every call
    above and the connector's four times over meet torn and changing state.

Cases run in child processes (spawn), each recording the index of the case
it is on in a shared progress file: a child that dies by a signal is a CRASH at exactly
that case, a child that stops making progress is a HANG; the parent saves the case's bytes
(under --out, default /tmp/shmkv-fuzz-<pid>/), replays it alone in a fresh child to see if
it reproduces, and carries on from the next case.  Exit status 0 only with zero crashes,
zero hangs and zero findings.

Mutations of the pool mutex's own bytes are run through snapshot() only: a mutex word
that names a live-looking owner makes attach wait its full lock bound (correctly: it
cannot tell a corrupt lock from a busy one), which would turn a fuzz run into a sleep.
"""
from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import random
import re
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import uuid

import numpy as np
import posix_ipc

import shmkv
from shmkv import _core
from shmkv import pending as _pending
from shmkv._events import EventReader
from shmkv.cli import main as cli_main
from shmkv.inspect import snapshot, struct_layout

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
if TOOLS_DIR not in sys.path:
    sys.path.insert(0, TOOLS_DIR)

PAGE = 4096
# ---- what the fuzzer knows of the layout: all of it from the C structs themselves -----
_ABI = struct_layout()
_H, _S = _ABI["header"]["fields"], _ABI["shared"]["fields"]


def _flat(fields, counts=None):
    """[(offset, fmt)] of every field; array fields expanded to `counts[name]` elements."""
    out = []
    for name, (off, fmt) in fields.items():
        n = (counts or {}).get(name, 1)
        out += [(off + struct.calcsize(fmt) * i, fmt) for i in range(n)]
    return out


HDR_CHECKSUM = _H["checksum"][0]
HDR_CONFIG = _H["config"][0]                       # len(_ABI["config"]) x u32
HDR_LAYOUT = _H["layout"][0]                       # N_LAYOUT x u64
N_LAYOUT = len(_ABI["layout"])
HDR_SEGSIZE = _H["segment_size"][0]
HDR_VOLATILE = _H["creator_pid"][0]                # creator pid, time, hash seed (3 x u64)
HDR_FIELDS = ([_H[k] for k in ("magic", "layout_version", "header_size", "abi_fingerprint",
                               "segment_size")]
              + [(HDR_CONFIG + 4 * i, "I") for i in range(len(_ABI["config"]))]
              + [(HDR_LAYOUT + 8 * i, "Q") for i in range(N_LAYOUT)]
              + [_H[k] for k in ("creator_pid", "create_time_ns", "hash_seed")])
SH_STATE = _S["state"][0]
SH_MUTEX = (_S["pool_lock"][0], _S["pool_lock"][0] + _ABI["shared"]["pool_lock_size"])
SH_FIELDS = [v for k, v in _S.items() if k not in ("state", "pool_lock", "counters")]
SH_RECOVERY_NS = _S["last_recovery_ns"][0]         # last, max (2 x u64)
SH_COUNTERS = _S["counters"][0]
SEQ_SIZE, PROC_SIZE = _ABI["seq"]["size"], _ABI["proc"]["size"]
BLOCK_SIZE, INDEX_SIZE = _ABI["block"]["size"], _ABI["index"]["size"]
SEQ_F, PROC_F = _ABI["seq"]["fields"], _ABI["proc"]["fields"]
SEQ_FIELDS = _flat(SEQ_F, {"salt": 2})
PROC_FIELDS = _flat(PROC_F, {"inflight": _ABI["proc"]["inflight"],
                             "counters": _ABI["proc"]["counters"],
                             "cache_blocks": _ABI["proc"]["cache_blocks"],
                             "cache_seqs": _ABI["proc"]["cache_seqs"]})
BLOCK_FIELDS = _flat(_ABI["block"]["fields"], {"hash": 2})
INDEX_FIELDS = _flat(_ABI["index"]["fields"], {"hash": 2})
EVENT_FIELDS = _flat(_ABI["event"]["fields"], {"hash": 2, "parent": 2})
EVENT_RING = _ABI["event"]["ring_size"]             # the head line before the records
STATE_READY, STATE_INIT = 0x52454459, 0x494E4954

KINDS = ("random", "header_flip", "header_field", "header_field_sum", "config",
         "body_struct", "body_raw", "body_many", "consistent_seq", "size", "state", "mutex",
         "events", "scales", "pending", "live")
WEIGHTS = (6, 8, 6, 8, 10, 22, 10, 8, 10, 6, 3, 3, 8, 6, 4, 2)
OUTCOMES = ("cases", "snap_ok", "snap_rejected", "attached", "attach_rejected", "op_errors",
            "findings")
PROG_WORDS = 2 + len(KINDS) * len(OUTCOMES)

# ValueError: a header that validates but names a config this build cannot represent
# (e.g. dtype bfloat16 without ml_dtypes installed)
EXPECTED_ATTACH = (shmkv.SegmentError, FileNotFoundError, ValueError,
                   shmkv.LockTimeout)       # a recovery pass on attach that cannot finish
EXPECTED_SNAPSHOT = (shmkv.SegmentError, FileNotFoundError, PermissionError, ValueError)
EXPECTED_OPS = (shmkv.ShmkvError,)


def fnv1a(b):
    h = 0xCBF29CE484222325
    for x in b:
        h = ((h ^ x) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def resum(buf):
    struct.pack_into("<Q", buf, HDR_CHECKSUM, fnv1a(bytes(buf[:HDR_CHECKSUM])))


def interesting(rng, fmt, extra=()):
    if fmt == "I":
        vals = [0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 63, 64, 255, 256, 4095, 4096,
                0x7FFF, 0x8000, 0xFFFF, 0x10000, 0x7FFFFFFE, 0x7FFFFFFF, 0x80000000,
                0xFFFFFFFE, 0xFFFFFFFF]
        mask = 0xFFFFFFFF
    else:
        vals = [0, 1, 2, 8, 4096, 0xFFFFFFFF, 1 << 32, (1 << 32) + 1, 1 << 40, 1 << 47,
                (1 << 47) + 4096, 1 << 63, (1 << 64) - 1, (1 << 64) - 4096]
        mask = 0xFFFFFFFFFFFFFFFF
    r = rng.random()
    if r < 0.55:
        return rng.choice(vals)
    if r < 0.8 and extra:
        return (rng.choice(extra) + rng.choice((-1, 0, 0, 1))) & mask
    if r < 0.9:
        return rng.getrandbits(32 if fmt == "I" else 64)
    return rng.randrange(0, 64)


# --------------------------------------------------------------------------------------
# templates
# --------------------------------------------------------------------------------------
TEMPLATE_CONFIGS = [
    {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "num_blocks": 16, "block_size": 4,
         "dtype": "float16", "max_seqs": 8, "max_procs": 4, "event_capacity": 5},
    {"num_layers": 1, "num_kv_heads": 2, "head_dim": 2, "num_blocks": 8, "block_size": 1,
         "dtype": "float32", "max_seqs": 4, "max_procs": 2},
    {"num_layers": 3, "num_kv_heads": 1, "head_dim": 1, "num_blocks": 32, "block_size": 8,
         "dtype": "float16", "max_seqs": 16, "max_procs": 8, "max_seq_len": 64,
         "event_capacity": 64},
    # quantized pools: their scales are mutated too (kind "scales")
    {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "num_blocks": 16, "block_size": 4,
         "dtype": "int8", "max_seqs": 8, "max_procs": 4},
    {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "num_blocks": 16, "block_size": 4,
         "dtype": "float8_e4m3", "max_seqs": 8, "max_procs": 4},
]
# scale values a hostile segment may hold: NaN/inf/huge/tiny/negative/denormal float32
SCALE_VALUES = (float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38, 1e-45, 0.0,
                -1.0, 1e30, 1e-30)


class _FixedSeed:
    """Stands in for _core's `secrets` while templates are made: the hash seed is the one
    canonical() writes, so the block hashes, the index and the KV events of a template
    (which all follow from it) are the same in every run."""

    @staticmethod
    def randbits(k):
        return 0x5EED5EED5EED5EED


def make_templates(tag):
    """Real segments with every kind of state in them; returns [(bytes, meta)]."""
    real = _core.secrets
    _core.secrets = _FixedSeed
    try:
        return _make_templates(tag)
    finally:
        _core.secrets = real


def _make_templates(tag):
    out = []
    for i, kw in enumerate(TEMPLATE_CONFIGS):
        cfg = shmkv.CacheConfig(**kw)
        name = f"shmkv-fuzz-tmpl-{tag}-{i}"
        lay = _core.layout_of(cfg)
        f = os.path.join("/dev/shm", name)
        L, bs = cfg.num_layers, cfg.block_size

        def toks(n, base, cfg=cfg):
            shape = (cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim)
            a = (np.arange(np.prod(shape)) + base).astype(cfg.compute_dtype).reshape(shape)
            return a, -a

        c = shmkv.KVCache.create(name, cfg)
        try:
            s1 = c.create_sequence()
            c.append(s1, *toks(bs + bs // 2 + 1, 1))
            s2 = c.fork(s1)
            c.append(s2, *toks(2, 100))                    # copy-on-write
            s3 = c.create_sequence(priority=2)
            c.append(s3, *toks(2 * bs, 200))
            c.detach(s3)
            c.create_sequence()                            # empty
            if cfg.event_capacity:                         # KV events: stored, cleared
                s4 = c.create_sequence()
                c.append(s4, *toks(3 * bs + 1, 400), tokens=np.arange(3 * bs + 1))
                c.free(s4)
                c.reset_prefix_cache()
                s4 = c.create_sequence()
                c.append(s4, *toks(2 * bs, 500), tokens=np.arange(7, 7 + 2 * bs))
                c.free(s4)
            slots = c.reserve(s1, 1)
            k, v = toks(1, 300)
            for layer in range(L):
                c.write(layer, slots, k[layer], v[layer])
            with open(f, "rb") as fh:
                live = fh.read()                           # we are an ACTIVE process
            c.free(s2)
            out.append((canonical(live, cfg, lay), {"config": kw, "layout": lay, "state": "live"}))
        finally:
            c.close()
        with open(f, "rb") as fh:
            after = fh.read()                              # closed: only s3 is left
        out.append((canonical(after, cfg, lay), {"config": kw, "layout": lay, "state": "closed"}))
        posix_ipc.unlink_shared_memory("/" + name)
    # the fuzzer's idea of the layout must match the real thing
    t, meta = out[0]
    assert t[:8] == b"__SHMKV1", "magic moved"
    assert struct.unpack_from("<I", t, SH_STATE)[0] == STATE_READY, "state moved"
    assert fnv1a(t[:HDR_CHECKSUM]) == struct.unpack_from("<Q", t, HDR_CHECKSUM)[0], \
        "header checksum moved"
    assert struct.unpack_from(f"<{N_LAYOUT}Q", t, HDR_LAYOUT)[4] == meta["layout"]["off_blocks"], \
        "header layout moved"
    assert struct.unpack_from("<I", t, HDR_CONFIG + 16)[0] == meta["config"]["num_blocks"], \
        "header config moved"
    return out


def canonical(b, cfg, lay):
    """Overwrite what differs from run to run (pids, clocks, the random hash seed, the
    mutex's robust-list pointers) so a case's bytes depend only on (--seed, index)."""
    buf = bytearray(b)
    struct.pack_into("<QQQ", buf, HDR_VOLATILE, 4242, 1_700_000_000_000_000_000, 0x5EED5EED5EED5EED)
    struct.pack_into("<QQ", buf, SH_RECOVERY_NS, 0, 0)                   # last/max recovery ns
    lo, _ = SH_MUTEX
    struct.pack_into("<QQ", buf, lo + 24, 0, 0)               # __list.prev/next (unlocked)
    for p in range(cfg.max_procs):
        o = lay["off_procs"] + PROC_SIZE * p + PROC_F["pid"][0]
        if struct.unpack_from("<Q", buf, o)[0]:                  # ever used
            struct.pack_into("<QQQ", buf, o, 4242, 777, 1_700_000_000_000_000_000)
    for q in range(cfg.max_seqs):
        o = lay["off_seqs"] + SEQ_SIZE * q
        struct.pack_into("<Q", buf, o + SEQ_F["last_access_ns"][0], 1_700_000_000_000_000_000)
        struct.pack_into("<Q", buf, o + SEQ_F["created_ns"][0], 1_700_000_000_000_000_000)
    if lay["off_events"]:                                        # KV events' clocks
        t_off = _ABI["event"]["fields"]["time_ns"][0]
        for r in range(cfg.event_capacity + 1):
            o = lay["off_events"] + EVENT_RING + r * lay["event_record_bytes"] + t_off
            struct.pack_into("<Q", buf, o, 1_700_000_000_000_000_000)
    resum(buf)
    return bytes(buf)


# --------------------------------------------------------------------------------------
# one case: (kind, bytes, attach?) from (seed, index)
# --------------------------------------------------------------------------------------
def _region(lay, cfg, r):
    """Metadata region ``r`` (0-9) of a segment: (base, size, record stride, fields)."""
    nb, ns, npr = cfg["num_blocks"], cfg["max_seqs"], cfg["max_procs"]
    if r == 9 and lay["off_events"]:                     # the KV event ring's records
        rec = lay["event_record_bytes"]
        return (lay["off_events"] + EVENT_RING, (cfg["event_capacity"] + 1) * rec, rec,
                EVENT_FIELDS)
    r %= 9
    if r == 0:
        return lay["off_blocks"], lay["off_free"] - lay["off_blocks"], BLOCK_SIZE, BLOCK_FIELDS
    if r == 1:
        return lay["off_free"], nb * 4, 4, [(0, "I")]
    if r == 2:
        return lay["off_procs"], npr * PROC_SIZE, PROC_SIZE, PROC_FIELDS
    if r == 3:
        return lay["off_seqs"], ns * SEQ_SIZE, SEQ_SIZE, SEQ_FIELDS
    if r == 4:
        return lay["off_seq_free"], ns * 4, 4, [(0, "I")]
    if r == 5:
        w = lay["off_index"] - lay["off_tables"]
        return lay["off_tables"], w, 4, [(0, "I")]
    if r == 6:
        return lay["off_index"], lay["index_capacity"] * INDEX_SIZE, INDEX_SIZE, INDEX_FIELDS
    if r == 7:
        return SH_FIELDS[0][0], 0, 0, SH_FIELDS
    return SH_COUNTERS, 32 * 8, 8, [(0, "Q")]


def make_case(templates, seed, i):
    rng = random.Random(seed * 1_000_003 + i)
    kind = rng.choices(KINDS, WEIGHTS)[0]
    tbytes, meta = templates[rng.randrange(len(templates))]
    lay, cfg = meta["layout"], meta["config"]
    nb, ns, npr = cfg["num_blocks"], cfg["max_seqs"], cfg["max_procs"]
    extra = (nb, ns, npr, cfg["block_size"], lay["segment_size"], lay["off_kpool"],
             lay["segment_size"] // 2)
    buf = bytearray(tbytes)
    attach = True

    def mutate_field(base, fields, count=1):
        for _ in range(count):
            off, fmt = rng.choice(fields)
            struct.pack_into("<" + fmt, buf, base + off, interesting(rng, fmt, extra))

    def region():
        return _region(lay, cfg, rng.randrange(10))

    if kind == "random":
        n = rng.choice((0, 1, 7, 511, 512, 4095, 4096, 4097, 8192, len(buf),
                        rng.randrange(0, 3 * PAGE)))
        data = bytearray(rng.getrandbits(8 * n).to_bytes(n, "little")) if n else bytearray()
        if n >= 8 and rng.random() < 0.5:
            data[:8] = b"__SHMKV1"                      # get past the magic
            if n >= 16 and rng.random() < 0.5:
                data[8:16] = tbytes[8:16]
        buf = data
    elif kind == "header_flip":
        for _ in range(rng.randint(1, 8)):
            bit = rng.randrange(8 * 512)
            buf[bit // 8] ^= 1 << (bit % 8)
    elif kind in ("header_field", "header_field_sum"):
        mutate_field(0, HDR_FIELDS, rng.randint(1, 3))
        if kind == "header_field_sum":
            resum(buf)
    elif kind == "config":
        # a whole consistent header for another config over the old body: bind passes,
        # then every table is read with the new config's idea of where things are
        c = dict(cfg)
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(("num_layers", "num_kv_heads", "head_dim", "num_blocks",
                              "block_size", "max_seqs", "max_procs"))
            c[key] = max(1, rng.choice((1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 64, c[key] + 1,
                                        max(1, c[key] - 1), c[key] * 2)))
        c.pop("max_seq_len", None)
        try:
            newcfg = shmkv.CacheConfig(**c)
            nl = _core.layout_of(newcfg)
        except (ValueError, TypeError):
            newcfg = None
        if newcfg is not None and nl["segment_size"] <= (4 << 20):
            raw = struct.unpack_from("<12I", buf, HDR_CONFIG)
            raw = list(raw)
            raw[0], raw[1], raw[2] = newcfg.num_layers, newcfg.num_kv_heads, newcfg.head_dim
            raw[3], raw[4], raw[5] = newcfg.block_size, newcfg.num_blocks, newcfg.max_seqs
            raw[6] = newcfg.max_blocks_per_seq
            raw[7] = newcfg.max_procs
            struct.pack_into("<12I", buf, HDR_CONFIG, *raw)
            keys = _ABI["layout"]
            struct.pack_into(f"<{N_LAYOUT}Q", buf, HDR_LAYOUT, *(nl[k] for k in keys))
            struct.pack_into("<Q", buf, HDR_SEGSIZE, nl["segment_size"])
            size = nl["segment_size"]
            if len(buf) < size:
                fill = rng.choice((b"\0", b"\xff", None))
                pad = size - len(buf)
                buf += (fill * pad) if fill else bytearray(
                    rng.getrandbits(8 * pad).to_bytes(pad, "little"))
            else:
                del buf[size:]
            if rng.random() < 0.3:
                mutate_field(0, HDR_FIELDS)
            resum(buf)
        else:
            mutate_field(HDR_CONFIG, [(4 * k, "I") for k in range(12)])
            resum(buf)
    elif kind == "body_struct":
        for _ in range(rng.randint(1, 4)):
            base, size, stride, fields = region()
            if stride == 0:
                mutate_field(0, fields)
            else:
                n = max(1, size // stride)
                mutate_field(base + stride * rng.randrange(n), fields)
    elif kind == "body_raw":
        lo, hi = 640, lay["segment_size"]
        for _ in range(rng.randint(1, 16)):
            if rng.random() < 0.7:
                lo2, hi2 = lo, min(hi, lay["off_kpool"])
            else:
                lo2, hi2 = lo, hi
            o = rng.randrange(lo2, hi2)
            if rng.random() < 0.5:
                buf[o] ^= 1 << rng.randrange(8)
            else:
                buf[o] = rng.randrange(256)
    elif kind == "body_many":
        # a whole metadata region overwritten with garbage or one repeated value
        base, size, stride, fields = region()
        if size == 0:
            base, size = 640, 72
        r = rng.random()
        if r < 0.4:
            buf[base:base + size] = rng.getrandbits(8 * size).to_bytes(size, "little")
        elif r < 0.7:
            buf[base:base + size] = bytes([rng.choice((0, 0xFF))]) * size
        else:
            v = interesting(rng, "I", extra)
            buf[base:base + size] = struct.pack("<I", v) * (size // 4) + b"\0" * (size % 4)
    elif kind == "consistent_seq":
        # a LIVE sequence that looks plausible: tables, length and owner that recovery
        # and gather will believe (or must reject)
        s = rng.randrange(ns)
        q = lay["off_seqs"] + SEQ_SIZE * s
        mbps_off = HDR_CONFIG + 4 * _ABI["config"].index("max_blocks_per_seq")
        mbps = struct.unpack_from("<I", buf, mbps_off)[0]
        nbl = rng.randint(0, min(mbps, 8))
        struct.pack_into("<IIQQIIII", buf, q, 2, rng.randint(1, 5),
                         rng.choice((0, 0, (1 << 32) | 1, rng.getrandbits(64))),
                         rng.choice((0, 0, 0, (1 << 32) | 1, rng.getrandbits(64))),
                         rng.choice((nbl * cfg["block_size"], max(0, nbl * cfg["block_size"] - 1),
                                     nbl * cfg["block_size"] + 1, rng.getrandbits(32))),
                         rng.choice((nbl, nbl, nbl + 1, rng.getrandbits(32))),
                         rng.choice((0, nbl, nbl + 1)), 0)
        t = lay["off_tables"] + 4 * mbps * s
        for j in range(nbl):
            b = rng.choice((rng.randrange(nb), rng.randrange(nb), nb, -1, 0x7FFFFFFF))
            struct.pack_into("<i", buf, t + 4 * j, b)
        if rng.random() < 0.5:
            mutate_field(lay["off_blocks"] + BLOCK_SIZE * rng.randrange(nb), BLOCK_FIELDS)
        if rng.random() < 0.3:
            mutate_field(0, SH_FIELDS)
    elif kind == "scales":
        # a quantized pool's scales (int8: per token and head; float8: per layer and
        # head) set to NaN / inf / huge / negative / denormal, and raw bytes of the
        # codes: NaN outputs are fine, a crash or a read out of bounds is not
        if lay.get("off_kscale"):
            lo, hi = lay["off_kscale"], lay["off_vscale"] + (lay["off_vscale"] - lay["off_kscale"])
        elif lay.get("off_hscale"):
            lo, hi = lay["off_hscale"], lay["off_hscale"] + 8 * cfg["num_layers"] * cfg["num_kv_heads"]
        else:
            lo, hi = lay["off_kpool"], lay["segment_size"]
        hi = min(hi, len(buf))
        for _ in range(rng.randint(1, 24)):
            o = lo + 4 * rng.randrange(max(1, (hi - lo) // 4))
            if o + 4 <= len(buf):
                struct.pack_into("<f", buf, o, rng.choice(SCALE_VALUES))
        for _ in range(rng.randint(0, 8)):          # and some codes
            o = rng.randrange(lay["off_kpool"], lay["off_kscale"] or lay["off_hscale"] or hi)
            if o < len(buf):
                buf[o] = rng.randrange(256)
    elif kind == "size":
        r = rng.random()
        if r < 0.45:
            del buf[rng.randrange(0, len(buf) + 1):]
        elif r < 0.8:
            n = rng.choice((1, 4095, 4096, 8192, rng.randrange(1, 3 * PAGE)))
            buf += b"\0" * n
        else:
            # header says a different size, consistently checksummed
            struct.pack_into("<Q", buf, HDR_SEGSIZE, interesting(rng, "Q", extra))
            resum(buf)
    elif kind == "state":
        struct.pack_into("<I", buf, SH_STATE, rng.choice(
            (0, STATE_INIT, STATE_READY ^ 1, 0xFFFFFFFF, rng.getrandbits(32))))
        if rng.random() < 0.3:
            buf[0:8] = b"\0" * 8
    elif kind == "events":
        # the KV event ring: its head, and records made plausible (their stamp matches a
        # seq in the window the head implies) with hostile fields, or raw garbage
        if not lay["off_events"]:
            mutate_field(0, SH_FIELDS)
        else:
            ring, rec = lay["off_events"], lay["event_record_bytes"]
            cap = cfg["event_capacity"]
            head = struct.unpack_from("<Q", buf, ring)[0]
            if rng.random() < 0.5:
                head = interesting(rng, "Q", extra + (cap, cap + 1, 2 * cap))
                struct.pack_into("<Q", buf, ring, head)
            for _ in range(rng.randint(1, 6)):
                seq = max(0, head - 1 - rng.randrange(cap + 2))
                o = ring + EVENT_RING + (seq % (cap + 1)) * rec
                r = rng.random()
                if r < 0.6:
                    struct.pack_into("<Q", buf, o, (seq + 1) & 0xFFFFFFFFFFFFFFFF)
                    mutate_field(o, EVENT_FIELDS[1:], rng.randint(1, 3))
                elif r < 0.8:
                    mutate_field(o, EVENT_FIELDS, rng.randint(1, 4))
                else:
                    buf[o:o + rec] = rng.getrandbits(8 * rec).to_bytes(rec, "little")
    elif kind == "pending":
        buf = bytearray(pending_table(rng))
    elif kind == "live":
        pass        # the template as it is: a writer mutates it while the calls run
    elif kind == "mutex":
        lo, hi = SH_MUTEX
        for _ in range(rng.randint(1, 6)):
            o = rng.randrange(lo, hi)
            buf[o] = rng.randrange(256) if rng.random() < 0.5 else buf[o] ^ (1 << rng.randrange(8))
        attach = False
    return kind, bytes(buf), attach


# --------------------------------------------------------------------------------------
# the pending table (shmkv.pending): NAME.pending, mutated
# --------------------------------------------------------------------------------------
PENDING_KEYS = tuple(range(101, 141))        # the keys a case's calls use (never 0)


def pending_table(rng):
    """A NAME.pending table's bytes: records at the case keys' probe paths (and anywhere)
    with hostile keys, owners and deadlines (``expires`` is CLOCK_MONOTONIC seconds: now
    is this process's), then, sometimes, a hostile header or size."""
    P = _pending
    now = time.monotonic()
    recs = np.zeros(P.SLOTS, P._REC)
    for _ in range(rng.randint(0, 48)):
        if rng.random() < 0.7:
            slot = (rng.choice(PENDING_KEYS) + rng.randrange(P.PROBES + 2)) % P.SLOTS
        else:
            slot = rng.randrange(P.SLOTS)
        recs[slot] = (
            rng.choice(PENDING_KEYS + (0, 1, (1 << 63), (1 << 64) - 1, rng.getrandbits(64))),
            rng.choice((0, -1, 1, (1 << 40) - 1, 1 << 40, 1 << 62, -(1 << 63), (1 << 63) - 1,
                        rng.getrandbits(40), rng.getrandbits(63))),
            rng.getrandbits(64),
            rng.choice((float("nan"), float("inf"), float("-inf"), -1e300, 0.0, 5e-324,
                        now - 1, now + 0.5, now + 100, now + P.MAX_TTL - 1,
                        now + P.MAX_TTL + 10, 1e300)))
    head = bytearray(P._header() + b"\0" * (P._HEADER - len(P._header())))
    r = rng.random()
    if r < 0.08:
        struct.pack_into("<Q", head, 0, rng.getrandbits(64))             # magic
    elif r < 0.16:
        struct.pack_into("<I", head, 8, interesting(rng, "I", (P.SLOTS,)))    # slots
    elif r < 0.24:
        struct.pack_into("<I", head, 12, rng.choice((0, 1, P.VERSION + 1, 0xFFFFFFFF)))
    elif r < 0.3:
        o = rng.randrange(P._HEADER)
        head[o] = rng.randrange(256)
    data = bytes(head) + recs.tobytes()
    r = rng.random()
    if r < 0.05:
        data = data[:rng.randrange(len(data))]
    elif r < 0.08:
        data += b"\0" * rng.choice((1, 4096))
    elif r < 0.1:
        data = rng.getrandbits(8 * len(data)).to_bytes(len(data), "little")
    return data


def run_pending_case(name, data, rng, finding):
    """Open the table twice (two owners of this process), plant live marks of theirs at
    random, then every call of the scheduler's: held, claim, release, marks, and the
    engine's wrapper (EngineMarks: never raises).  A mark one owner claims must be held
    for the other (a lost mark is a finding).  Returns (opened, errors)."""
    P = _pending
    path = P.pending_path(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    errors, owners = 0, []
    try:
        for _ in range(2):
            try:
                owners.append(P.PendingMarks(name, timeout=0.05, open_timeout=0.05))
            except P.PendingTableError:
                errors += 1
            except Exception as e:  # noqa: BLE001
                finding("pending open", e)
        if len(owners) == 2 and rng.random() < 0.6:
            # the records of live owners (ours), with whatever keys and deadlines are there
            with open(path, "r+b") as f, mmap.mmap(f.fileno(), P._SIZE) as mm:
                recs = np.frombuffer(mm, P._REC, P.SLOTS, P._HEADER)
                for _ in range(rng.randint(1, 16)):
                    slot = (rng.choice(PENDING_KEYS) + rng.randrange(4)) % P.SLOTS
                    recs[slot]["owner"] = rng.choice(owners).token
                del recs
        keys = rng.sample(PENDING_KEYS, rng.randint(1, 8))
        pairs = ([(owners[0], owners[1]), (owners[1], owners[0])] if len(owners) == 2
                 else [(o, None) for o in owners])
        for me, other in pairs:
            try:
                me.held(keys)
                held, mine = me.claim_keys(keys, rng.choice((1.0, 60.0, P.MAX_TTL)))
                if other is not None and mine:
                    t0 = other.timeouts
                    lost = [k for k in mine if other.held([k]) != 1]
                    if lost and other.timeouts == t0:
                        finding("pending claim", AssertionError(
                            f"keys {lost} claimed by one owner are not held for another"))
                me.marks()
                me.release(keys[:rng.randint(0, len(keys))])
            except Exception as e:  # noqa: BLE001
                finding("pending calls", e)
        em = None
        try:
            em = P.EngineMarks(name, _QUIET, timeout=0.05, open_timeout=0.05)
            em.claim(keys, 1.0, holder="a")
            em.claim(keys[:2], 1.0, holder="b")
            em.held(keys)
            em.release(holder="a")
            em.release(holder="b")
        except Exception as e:  # noqa: BLE001 -- an engine's marks never raise
            finding("engine marks", e)
        finally:
            if em is not None:
                em.close()
        return bool(owners), errors
    finally:
        for o in owners:
            o.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


_QUIET = logging.getLogger("shmkv.fuzz.pending")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


# --------------------------------------------------------------------------------------
# a live segment: a writer mutates it while the calls run
# --------------------------------------------------------------------------------------
def start_mutator(name, meta, seed):
    """Fork a process that writes hostile values into the segment's metadata (every
    region but the pool mutex's bytes, at ~10k writes a second) until it is killed or its
    parent is gone: a crashed, buggy or hostile peer writing while this process reads.
    Its pid."""
    pid = os.fork()
    if pid:
        return pid
    try:
        rng = random.Random(seed)
        lay, cfg = meta["layout"], meta["config"]
        extra = (cfg["num_blocks"], cfg["max_seqs"], cfg["max_procs"], cfg["block_size"],
                 lay["segment_size"], lay["off_kpool"], lay["segment_size"] // 2)
        fd = os.open(os.path.join("/dev/shm", name), os.O_RDWR)
        mm = mmap.mmap(fd, os.fstat(fd).st_size)
        ppid, lo, hi = os.getppid(), SH_MUTEX[0] - 8, SH_MUTEX[1]
        n = 0
        while True:
            base, size, stride, fields = _region(lay, cfg, rng.randrange(10))
            if stride:
                base += stride * rng.randrange(max(1, size // stride))
            off, fmt = rng.choice(fields)
            o = base + off
            if o + struct.calcsize(fmt) <= len(mm) and not lo < o < hi:
                struct.pack_into("<" + fmt, mm, o, interesting(rng, fmt, extra))
            n += 1
            if n % 8 == 0:
                if os.getppid() != ppid:
                    break
                time.sleep(0.001)
    finally:
        os._exit(0)


def run_live_case(name, data, meta, rng, seed, finding):
    """Attach a real segment and run every call (exercise, and the connector's calls four
    more times) while a forked writer mutates it.  Returns (attached, errors)."""
    write_segment(name, data)
    pid = start_mutator(name, meta, seed)
    try:
        return attach_and_exercise(name, rng, finding, connector_rounds=4)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        unlink(name)


# --------------------------------------------------------------------------------------
# running one case (in a child)
# --------------------------------------------------------------------------------------
class Finding(Exception):
    pass


def write_segment(name, data):
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600)
    try:
        if data:
            os.ftruncate(shm.fd, len(data))
            os.pwrite(shm.fd, data, 0)
    finally:
        shm.close_fd()


def unlink(name):
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass


def run_case(name, data, attach, rng, finding):
    """Returns (snap_ok, attached, op_errors).  finding(where, exc) records a finding."""
    write_segment(name, data)
    try:
        snap_ok = False
        try:
            s = snapshot(name, tables=rng.random() < 0.8)
            snap_ok = True
            # touch what the snapshot returned (lazy garbage would show here)
            for q in s["sequences"][:16]:
                if "table" in q:
                    int(q["table"].sum())
            int(s["ref_cnt"].sum())
        except EXPECTED_SNAPSHOT:
            pass
        except Exception as e:  # noqa: BLE001 -- anything else is what we look for
            finding("snapshot", e)
        try:                                         # the CLI's read-only event reader
            with EventReader(name) as r:
                r.read(0)
                r.read(rng.randrange(1 << 20), max_events=rng.choice((None, 1, 7)))
        except EXPECTED_SNAPSHOT:
            pass
        except Exception as e:  # noqa: BLE001
            finding("event_reader", e)
        if not attach:
            return snap_ok, False, 0
        return (snap_ok, *attach_and_exercise(name, rng, finding))
    finally:
        unlink(name)


def attach_and_exercise(name, rng, finding, connector_rounds=0):
    """(attached, op errors): attach ``name`` and run every call on it (exercise)."""
    try:
        # half without the recovery on attach: the calls then meet the corruption raw
        c = shmkv.KVCache.attach(name, prefault=rng.random() < 0.2, timeout=0.01,
                                 recover=rng.random() < 0.5)
    except EXPECTED_ATTACH:
        return False, 0
    except Exception as e:  # noqa: BLE001
        finding("attach", e)
        return False, 0
    errors = 0
    try:
        c.lock_timeout = 0.05
        errors += exercise(c, rng, finding, connector_rounds)
    finally:
        try:
            c.close()
        except EXPECTED_OPS:
            errors += 1
        except Exception as e:  # noqa: BLE001
            finding("close", e)
    return True, errors


def exercise(c, rng, finding, connector_rounds=0):
    errors = 0

    def op(what, fn, *a, expected=EXPECTED_OPS, **kw):
        nonlocal errors
        try:
            return fn(*a, **kw)
        except expected:
            errors += 1
        except Exception as e:  # noqa: BLE001
            finding(what, e)
        return None

    op("check", c.check)
    op("stats", c.stats)
    sids = op("sequences", c.sequences) or []
    cfg = c.config
    lens = {}
    for sid in sids[:8]:
        lens[sid] = op("seq_len", c.seq_len, sid)
        op("block_table", c.block_table, sid)
        op("owner_pid", c.owner_pid, sid)
        op("gather", c.gather, sid)
    # paged attention over whatever tables and lengths the mutation left: a result or
    # SegmentError, never a crash or a read out of bounds (ValueError: a length that reads
    # as 0, or shrank under q_lens, which the contract allows)
    live = [s for s in sids[:8] if isinstance(lens.get(s), int) and lens[s] > 0]
    if live:
        layer = rng.randrange(cfg.num_layers)
        hq = cfg.num_kv_heads * rng.choice([1, 2])
        qrng = np.random.default_rng(rng.randrange(1 << 32))
        q = qrng.standard_normal((len(live), hq, cfg.head_dim)).astype(np.float32)
        op("attention", c.attention, layer, q, live, expected=(shmkv.ShmkvError, ValueError))
        ql = [rng.randint(1, min(lens[s], 5)) for s in live]
        q = qrng.standard_normal((sum(ql), hq, cfg.head_dim)).astype(np.float32)
        op("attention", c.attention, layer, q, live, q_lens=ql,
           expected=(shmkv.ShmkvError, ValueError))
    if sids:
        op("batch_block_tables", c.batch_block_tables, sids[:8])
    # truncate meets the corruption too (before any repair half of the time): every
    # length, block id, refcount and cache entry it reads is checked before it writes
    if live and rng.random() < 0.5:
        sid = rng.choice(live)
        op("truncate", c.truncate, sid, rng.randint(0, lens[sid]),
           expected=(shmkv.ShmkvError, ValueError))
    # the KV event ring, whatever the mutation left in it: events, never a crash; and the
    # CLI over it (exit 0, or 2 for a segment it cannot read)
    op("events", c.events, 0)
    op("events", c.events, rng.choice((1, 5, 1 << 20, (1 << 63) - 1)),
       max_events=rng.choice((None, 1, 3)))
    if rng.random() < 0.3:
        with open(os.devnull, "w") as devnull:
            old_out, sys.stdout = sys.stdout, devnull
            old_err, sys.stderr = sys.stderr, devnull
            try:
                rc = op("cli events", cli_main, ["events", c.name, "--json"])
            finally:
                sys.stdout, sys.stderr = old_out, old_err
        if rc not in (None, 0, 2):
            finding("cli events", RuntimeError(f"shmkv events exited {rc}"))
    op("recover", c.recover)
    op("check", c.check)
    if rng.random() < 0.5:
        s = op("create_sequence", c.create_sequence)
        if s is not None:
            a = np.ones((cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim), cfg.compute_dtype)
            op("append", c.append, s, a, a)
            ch = op("fork", c.fork, s)
            if ch is not None:
                if op("seq_len", c.seq_len, ch):           # (the append may have failed)
                    op("truncate", c.truncate, ch, 1)      # into the shared block
                op("append", c.append, ch, a[:, :1], a[:, :1])
                op("gather", c.gather, ch)
                op("free", c.free, ch)
            op("free", c.free, s)
        if sids:
            sid = rng.choice(sids)
            ch = op("fork", c.fork, sid)
            if ch is not None:
                op("free", c.free, ch)
            op("detach", c.detach, sid)
            op("adopt", c.adopt, sid)
            n = op("seq_len", c.seq_len, sid)
            if isinstance(n, int) and n:
                op("truncate", c.truncate, sid, rng.randint(0, n))
        op("check", c.check)
    if rng.random() < 0.5:
        connector_calls(c, rng, op)
    for _ in range(connector_rounds):
        connector_calls(c, rng, op)
    return errors


def connector_calls(c, rng, op):
    """What the vLLM connector calls on a segment, on whatever the mutation left: the
    scheduler's lookup (match_prefix) and the worker's save of a prefix (create_sequence
    with its tokens pins what is published, reserve(tokens=) the rest, commit, free).  The
    token ids are the templates' published ones (the hash index and its blocks are met)
    or others; the salt the templates' (none) or another."""
    bs = c.config.block_size
    n = rng.randint(1, 4) * bs
    start = rng.choice((0, 7, 1000))
    ids = np.append(np.arange(start, start + n, dtype=np.int32), np.int32(0))
    salt = rng.choice((None, "vllm\x00model\x00\x00"))
    op("match_prefix", c.match_prefix, ids, salt)
    s = op("create_sequence", c.create_sequence, tokens=ids, salt=salt)
    if s is None:
        return
    have = op("seq_len", c.seq_len, s)
    if isinstance(have, int) and 0 <= have < n:
        if op("reserve", c.reserve, s, n - have, tokens=ids[have:n]) is not None:
            op("commit", c.commit, s)
            op("match_prefix", c.match_prefix, ids, salt)
    op("free", c.free, s)


def child_main(opts):
    """Runs cases [start, end); records progress before each case."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    templates = []
    for path, meta in opts["templates"]:
        with open(path, "rb") as f:
            templates.append((f.read(), meta))
    fd = os.open(opts["progress"], os.O_RDWR)
    mm = mmap.mmap(fd, 8 * PROG_WORDS * opts["jobs"])
    prog = np.frombuffer(mm, np.int64, PROG_WORDS, 8 * PROG_WORDS * opts["job"])
    counts = prog[2:].reshape(len(KINDS), len(OUTCOMES))
    ffd = os.open(opts["findings"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    name = f"shmkv-fuzz-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    seed = opts["seed"]
    try:     # the first bfloat16 case would import it: a start's cost, not a case's
        import ml_dtypes  # noqa: F401
    except ImportError:
        pass
    time.sleep(opts.get("self_test_slow_start") or 0)  # a loaded host's slow start
    prog[1] = 0                  # started: the parent's per-case hang clock runs from here
    for i in range(opts["start"], opts["end"]):
        prog[0] = i
        kind, data, attach = make_case(templates, seed, i)
        k = KINDS.index(kind)
        rng = random.Random(seed * 7_000_003 + i)

        def finding(where, e, i=i, kind=kind, k=k):
            counts[k, OUTCOMES.index("findings")] += 1
            line = {"case": i, "kind": kind, "where": where, "exc": type(e).__name__,
                        "msg": str(e)[:300], "tb": traceback.format_exc()[-1500:]}
            os.write(ffd, (json.dumps(line) + "\n").encode())

        if i == opts.get("self_test_crash"):
            # prove a crash is caught: SIGSEGV's default action (under make sanitize, the
            # ASan runtime's handler would turn this deliberate one into a report)
            signal.signal(signal.SIGSEGV, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGSEGV)
        if i == opts.get("self_test_hang"):
            time.sleep(3600)                               # prove a hang is caught
        if kind == "pending":       # the table opened or refused; the calls ran on it
            snap_ok, errs = run_pending_case(name, data, rng, finding)
            attached = snap_ok
        elif kind == "live":
            meta = next(m for t, m in templates if t == data)
            attached, errs = run_live_case(name, data, meta, rng, seed * 7_000_003 + i,
                                           finding)
            snap_ok = True
        else:
            snap_ok, attached, errs = run_case(name, data, attach, rng, finding)
        counts[k, 0] += 1
        counts[k, 1 if snap_ok else 2] += 1
        if attach:
            counts[k, 3 if attached else 4] += 1
        counts[k, 5] += errs
        prog[1] += 1
    prog[0] = opts["end"]
    os._exit(0)


# --------------------------------------------------------------------------------------
# the parent: children, crash and hang detection, replay
# --------------------------------------------------------------------------------------
def start_bound(hang):
    """How long a child may take to start (spawn, import numpy and shmkv, read the
    templates) before its first case: not a case's time, and much longer on a loaded
    2-core host than any case."""
    return max(120.0, 4 * hang)


def replay(ctx, opts, i, timeout):
    """Run case i alone in a fresh child: does it crash / hang again?"""
    o = dict(opts, start=i, end=i + 1, job=0, jobs=1,
             progress=opts["progress"] + f".replay{i}")
    with open(o["progress"], "wb") as f:
        f.write(struct.pack("<qq", i, -1) + b"\0" * 8 * (PROG_WORDS - 2))
    p = ctx.Process(target=child_main, args=(o,), daemon=True)
    p.start()
    _CHILD_PIDS.add(p.pid)
    deadline = time.monotonic() + start_bound(timeout)
    while p.exitcode is None and time.monotonic() < deadline:     # wait for it to start
        with open(o["progress"], "rb") as f:
            if struct.unpack("<qq", f.read(16))[1] >= 0:
                break
        time.sleep(0.05)
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        p.join(5)
        return "hangs again"
    return f"exit status {p.exitcode}" if p.exitcode else "does not reproduce alone"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=2, help="child processes at a time")
    ap.add_argument("--batch", type=int, default=5000, help="cases per child")
    ap.add_argument("--hang", type=float, default=30.0,
                    help="seconds a child may spend on one case")
    ap.add_argument("--out", default=None, help="where crashing inputs are saved")
    ap.add_argument("--json", default=None)
    ap.add_argument("--self-test-crash", type=int, default=None, metavar="I",
                    help="the child SIGSEGVs itself at case I (checks crash detection)")
    ap.add_argument("--self-test-hang", type=int, default=None, metavar="I",
                    help="the child sleeps forever at case I (checks hang detection)")
    ap.add_argument("--self-test-slow-start", type=float, default=None, metavar="S",
                    help="each child sleeps S seconds before its first case (checks that "
                         "a slow start is not taken for a hang)")
    ap.add_argument("--show", type=int, default=None, metavar="I",
                    help="write case I's bytes to --out and exit (reproduce a finding)")
    args = ap.parse_args(argv)
    if args.seed is None:
        args.seed = random.SystemRandom().getrandbits(32)
    out_dir = args.out or os.path.join(tempfile.gettempdir(), f"shmkv-fuzz-{os.getpid()}")
    work = tempfile.mkdtemp(prefix="shmkv-fuzz-work-")
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    t0 = time.monotonic()
    try:
        templates = make_templates(f"{os.getpid()}")
        tpaths = []
        for j, (b, meta) in enumerate(templates):
            path = os.path.join(work, f"template{j}.bin")
            with open(path, "wb") as f:
                f.write(b)
            tpaths.append((path, meta))
        if args.show is not None:
            kind, data, attach = make_case(templates, args.seed, args.show)
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, f"case-{args.seed}-{args.show}-{kind}.bin")
            with open(path, "wb") as f:
                f.write(data)
            print(f"case {args.show} (seed {args.seed}, {kind}, attach={attach}): "
                  f"{len(data)} bytes -> {path}")
            return 0
        print(f"shmkv attach fuzzer: seed {args.seed}, {args.count} cases, {args.jobs} "
              f"children, templates {[len(b) for b, _ in templates]} bytes", flush=True)
        progress = os.path.join(work, "progress")
        with open(progress, "wb") as f:
            f.write(b"\0" * 8 * PROG_WORDS * args.jobs)
        fd = os.open(progress, os.O_RDWR)
        mm = mmap.mmap(fd, 8 * PROG_WORDS * args.jobs)
        prog = np.frombuffer(mm, np.int64, PROG_WORDS * args.jobs).reshape(args.jobs, PROG_WORDS)
        findings_path = os.path.join(work, "findings.jsonl")
        opts = {"templates": tpaths, "progress": progress, "findings": findings_path,
                    "seed": args.seed, "jobs": args.jobs, "self_test_crash": args.self_test_crash,
                    "self_test_hang": args.self_test_hang,
                    "self_test_slow_start": args.self_test_slow_start}
        todo = [(a, min(a + args.batch, args.count)) for a in range(0, args.count, args.batch)]
        todo.reverse()
        running = {}    # job -> [proc, start, end, last_index, last_change, started]
        crashes, hangs = [], []
        counts = np.zeros((len(KINDS), len(OUTCOMES)), np.int64)
        next_report = time.monotonic() + 10

        def launch(job, start, end):
            prog[job, :] = 0
            prog[job, 0] = start
            prog[job, 1] = -1                    # the child sets 0 once it has started
            o = dict(opts, start=start, end=end, job=job)
            p = ctx.Process(target=child_main, args=(o,), daemon=True)
            p.start()
            _CHILD_PIDS.add(p.pid)
            running[job] = [p, start, end, start, time.monotonic(), False]

        def harvest(job):
            counts[:] += prog[job, 2:].reshape(len(KINDS), len(OUTCOMES))
            prog[job, 2:] = 0

        def save(i, why):
            kind, data, _ = make_case(templates, args.seed, i)
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, f"{why}-{args.seed}-{i}-{kind}.bin")
            with open(path, "wb") as f:
                f.write(data)
            return kind, path

        while todo or running:
            for job in range(args.jobs):
                if job not in running and todo:
                    launch(job, *todo.pop())
            time.sleep(0.05)
            now = time.monotonic()
            for job, st in list(running.items()):
                p, _, end, last_i, last_t, started = st
                cur = int(prog[job, 0])
                if p.exitcode is not None:
                    harvest(job)
                    del running[job]
                    if p.exitcode != 0:
                        kind, path = save(cur, "crash")
                        again = replay(ctx, opts, cur, args.hang)
                        crashes.append({"case": cur, "kind": kind, "exit": p.exitcode,
                                        "input": path, "replay": again})
                        print(f"  CRASH: case {cur} ({kind}) killed the child (exit status "
                              f"{p.exitcode}); input saved to {path}; replay: {again}",
                              flush=True)
                        if cur + 1 < end:
                            todo.append((cur + 1, end))
                    continue
                if not started:
                    if prog[job, 1] >= 0:              # started now: case clock from here
                        st[4], st[5] = now, True
                        continue
                    limit = start_bound(args.hang)
                else:
                    limit = args.hang
                if cur != last_i:
                    st[3], st[4] = cur, now
                elif now - last_t > limit:
                    p.kill()
                    p.join(5)
                    harvest(job)
                    del running[job]
                    kind, path = save(cur, "hang")
                    hangs.append({"case": cur, "kind": kind, "input": path,
                                  "started": started})
                    what = (f"made no progress for {args.hang} s" if started else
                            f"did not start within {limit:.0f} s")
                    print(f"  HANG: case {cur} ({kind}) {what}; "
                          f"input saved to {path}", flush=True)
                    if cur + 1 < end:
                        todo.append((cur + 1, end))
            if now >= next_report:
                live = sum(prog[j, 2:].reshape(len(KINDS), len(OUTCOMES))[:, 0].sum()
                           for j in running)
                done = int(counts[:, 0].sum() + live)
                print(f"  [{now - t0:6.1f}s] {done} cases", flush=True)
                next_report = now + 10
        elapsed = time.monotonic() - t0
        findings = []
        if os.path.exists(findings_path):
            with open(findings_path) as f:
                findings = [json.loads(x) for x in f if x.strip()]
        uniq = {}
        for fd_ in findings:      # distinct: same call, exception and message but numbers
            key = (fd_["where"], fd_["exc"], re.sub(r"\d+(\.\d+)?", "N", fd_["msg"])[:80])
            uniq.setdefault(key, []).append(fd_)
        total = int(counts[:, 0].sum())
        res = {"seed": args.seed, "cases": total, "elapsed_s": round(elapsed, 1),
                   "cases_per_s": round(total / elapsed, 1), "crashes": crashes, "hangs": hangs,
                   "findings": len(findings), "unique_findings": len(uniq),
                   "per_kind": {KINDS[k]: dict(zip(OUTCOMES, map(int, counts[k])))
                             for k in range(len(KINDS))}}
        res["attached"] = int(counts[:, OUTCOMES.index("attached")].sum())
        res["snapshots_ok"] = int(counts[:, OUTCOMES.index("snap_ok")].sum())
        res["ok"] = not crashes and not hangs and not findings and total == args.count
        print()
        print(f"{'kind':<18}" + "".join(f"{o:>16}" for o in OUTCOMES))
        for k in range(len(KINDS)):
            print(f"{KINDS[k]:<18}" + "".join(f"{int(x):>16}" for x in counts[k]))
        print(f"{'total':<18}" + "".join(f"{int(x):>16}" for x in counts.sum(axis=0)))
        print()
        print(f"cases {total} in {elapsed:.1f} s ({res['cases_per_s']}/s); attached "
              f"{res['attached']}; snapshots that parsed {res['snapshots_ok']}; crashes "
              f"{len(crashes)}; hangs {len(hangs)}; findings {len(findings)} "
              f"({len(uniq)} distinct)")
        for (where, exc, msg), lst in list(uniq.items())[:20]:
            print(f"  FINDING x{len(lst)}: {where}: {exc}: {msg} (case {lst[0]['case']}, "
                  f"{lst[0]['kind']}; reproduce: --seed {args.seed} --show {lst[0]['case']})")
            where_lines = [x.strip() for x in lst[0]["tb"].splitlines() if 'File "' in x]
            if where_lines:
                print("    at " + where_lines[-1])
        res["finding_samples"] = [dict(v[0], count=len(v)) for v in uniq.values()][:50]
        print("result: " + ("PASS" if res["ok"] else "FAIL"), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0 if res["ok"] else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
        _cleanup_segments()


_CHILD_PIDS = set()


def _cleanup_segments():
    """A child killed mid-case leaves that case's segment; templates are ours too."""
    if not os.path.isdir("/dev/shm"):
        return
    mine = tuple(f"shmkv-fuzz-{pid}-" for pid in _CHILD_PIDS) + \
        (f"shmkv-fuzz-tmpl-{os.getpid()}-",)
    for n in os.listdir("/dev/shm"):
        if n.startswith(mine):
            unlink(n)


if __name__ == "__main__":
    sys.exit(main())
