"""shmkv admin CLI: find segments, see who holds what, repair, watch live, export metrics.

Every inspection command (ls, info, seqs, blocks, procs, top, metrics) reads the segment
through ``_core.snapshot``: a read-only mapping, no lock, no registration in the process
table, every index clamped.  So it works on a segment whose processes all died, never
changes one, and cannot be blocked by a process that holds a lock.  Only ``check``,
``recover``, ``create`` and ``rm`` change anything, and they say so in their help.

Human output by default (aligned tables; colour only on a terminal), ``--json`` for
scripts: one JSON document on stdout.  Exit codes: 0 success, 1 a check found problems
(or ``rm`` refused), 2 usage or a segment that cannot be read.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import fnmatch
import json
import math
import os
import signal
import struct
import sys
import threading
import time

import numpy as np

from . import _core
from .config import DTYPES, HASHES, CacheConfig
from .errors import LockTimeout, SegmentError, ShmkvError

__all__ = ["main"]

SHM_DIR = "/dev/shm"
# First 8 bytes of every shmkv segment (SHMKV_MAGIC of _layout.h: "__SHMKV1" read as a
# little-endian u64).  Used only to decide which files in /dev/shm `ls` reports.
MAGIC = _core.MAGIC
MAGIC_BYTES = struct.pack("<Q", MAGIC)

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2

# Block states, in increasing severity (the PNG and the ASCII map use them).
FREE, CACHED, OWNED, SHARED, DEAD = 0, 1, 2, 3, 4
STATE_NAMES = ("free", "cached", "owned", "shared", "dead")

PRESETS = {
    # name: (config fields, help); num_blocks comes from --blocks / --memory unless given
    "tiny": (dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64,
                  max_seqs=32, dtype="float16"),
             "2 layers, 2 kv heads, head_dim 8, float16, block 4, 64 blocks (for tests)"),
    "llama3-8b": (dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                       dtype="float16"),
                  "Llama 3 8B: 32 layers, 8 kv heads, head_dim 128, float16, block 16"),
    "llama3-70b": (dict(num_layers=80, num_kv_heads=8, head_dim=128, block_size=16,
                        dtype="float16"),
                   "Llama 3 70B: 80 layers, 8 kv heads, head_dim 128, float16, block 16"),
    "llama2-7b": (dict(num_layers=32, num_kv_heads=32, head_dim=128, block_size=16,
                       dtype="float16"),
                  "Llama 2 7B: 32 layers, 32 kv heads, head_dim 128, float16, block 16"),
    "mistral-7b": (dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                        dtype="float16"),
                   "Mistral 7B: 32 layers, 8 kv heads, head_dim 128, float16, block 16"),
}


class CLIError(Exception):
    """An expected failure: one line on stderr, then exit with ``code``."""

    def __init__(self, message, code=EXIT_USAGE):
        super().__init__(message)
        self.code = code


# ======================================================================================
# output helpers
# ======================================================================================
_STYLES = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33",
           "blue": "34", "magenta": "35", "cyan": "36", "bold red": "1;31"}
_color = False


def paint(text, style):
    """`text` in `style` when colour is on (a terminal, or --color always)."""
    if not _color or not style:
        return str(text)
    return f"\x1b[{_STYLES[style]}m{text}\x1b[0m"


def _cell(c):
    return c if isinstance(c, tuple) else (str(c), None)


def table(headers, rows, align="", indent=""):
    """Aligned columns.  A cell is a value or (text, style); `align` has one 'l' or 'r'
    per column (default: left)."""
    rows = [[_cell(c) for c in r] for r in rows]
    n = len(headers)
    widths = [len(h) for h in headers]
    for r in rows:
        for i, (t, _) in enumerate(r):
            widths[i] = max(widths[i], len(t))
    align = (align + "l" * n)[:n]

    def fmt(cells, header=False):
        out = []
        for i, (t, style) in enumerate(cells):
            pad = widths[i] - len(t)
            if i == n - 1 and align[i] == "l":
                pad = 0                     # no trailing blanks
            text = (" " * pad + t) if align[i] == "r" else (t + " " * pad)
            out.append(paint(text, "bold" if header else style))
        return indent + "  ".join(out)

    lines = [fmt([(h, None) for h in headers], header=True)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def fmt_bytes(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def fmt_pct(x):
    return f"{100.0 * x:.1f}%"


def fmt_time_ns(ns):
    if not ns:
        return "-"
    try:
        return _dt.datetime.fromtimestamp(ns / 1e9).astimezone().isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return f"{ns} ns"


def fmt_age(ns):
    if not ns:
        return "-"
    s = time.time() - ns / 1e9
    if s < 0:
        return "0s"
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"


def fmt_duration(s):
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def model_str(cfg):
    return (f"{cfg.num_layers}L {cfg.num_kv_heads}H {cfg.head_dim}D "
            f"{cfg.dtype} bs{cfg.block_size}")


def emit_json(doc):
    sys.stdout.write(json.dumps(doc, indent=2, default=_json_default) + "\n")


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, CacheConfig):
        return dataclasses.asdict(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024 ** 2,
               "mb": 1000 ** 2, "mib": 1024 ** 2, "g": 1024 ** 3, "gb": 1000 ** 3,
               "gib": 1024 ** 3, "t": 1024 ** 4, "tb": 1000 ** 4, "tib": 1024 ** 4}


def parse_size(text):
    """'8GiB', '512M', '1.5GB', '1048576' -> bytes (K/M/G/T and KiB.. are powers of 1024;
    KB/MB/GB/TB powers of 1000)."""
    s = text.strip().replace("_", "")
    i = len(s)
    while i and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    num, unit = s[:i], s[i:].strip().lower()
    if unit not in _SIZE_UNITS or not num:
        raise argparse.ArgumentTypeError(
            f"expected a size like 8GiB, 512MiB, 1.5GB or a number of bytes, got {text!r}")
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return int(value * _SIZE_UNITS[unit])


# ======================================================================================
# reading segments
# ======================================================================================
def seg_name(text):
    """'llama', '/llama' or '/dev/shm/llama' -> 'llama' (argparse type)."""
    s = text
    if s.startswith(SHM_DIR + "/"):
        s = s[len(SHM_DIR) + 1:]
    try:
        return _core._norm_name(s)[1:]
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seg_path(name):
    return os.path.join(SHM_DIR, name)


def read_prefix(name):
    """(magic_ok, layout_version or None) from the first bytes of the file, or raise
    FileNotFoundError / PermissionError."""
    with open(seg_path(name), "rb") as f:
        head = f.read(16)
    if len(head) < 8 or head[:8] != MAGIC_BYTES:
        return False, None
    version = struct.unpack_from("<I", head, 8)[0] if len(head) >= 12 else None
    return True, version


def classify_error(name, exc):
    """(state, one-line reason) for a SegmentError of `name`: 'not-shmkv', 'incompatible',
    'not-ready' or 'corrupt'."""
    text = str(exc)
    try:
        magic_ok, version = read_prefix(name)
    except OSError:
        magic_ok, version = True, None
    if not magic_ok:
        return "not-shmkv", "not a shmkv segment (no shmkv magic in its first bytes)"
    if version is not None and version != _core.LAYOUT_VERSION:
        return "incompatible", (f"incompatible segment: layout version {version}, this "
                                f"shmkv {_version()} reads layout version "
                                f"{_core.LAYOUT_VERSION}")
    reason = getattr(exc, "reason", None)
    if reason == "incompatible":
        return "incompatible", ("incompatible segment: made by a shmkv build with another "
                                "ABI (same layout version, different struct sizes)")
    if reason == "not_ready":
        return "not-ready", ("segment not ready: its creator is still initialising it, "
                             "or died doing so")
    reason = text.split(": ", 1)[1] if ": " in text else text
    if "segment is corrupt" in reason:
        reason = ("its header checksum, recorded size or state does not match "
                  "(truncated or overwritten?)")
    return "corrupt", f"corrupt segment: {reason}"


def load(name, tables=True):
    """snapshot(name), or CLIError(exit 2) with one clear line."""
    try:
        return _core.snapshot(name, tables=tables)
    except FileNotFoundError:
        raise CLIError(f"{name}: no such segment ({seg_path(name)} does not exist; "
                       "`shmkv ls` lists segments)") from None
    except PermissionError:
        raise CLIError(f"{name}: permission denied (the segment belongs to another "
                       "user; run as that user or root)") from None
    except SegmentError as e:
        raise CLIError(f"{name}: {classify_error(name, e)[1]}") from None
    except OSError as e:
        raise CLIError(f"{name}: cannot read the segment: {e.strerror or e}") from None


def _version():
    from . import __version__

    return __version__


def lock_holders(name):
    """True when some process holds a byte-range lock on the segment file (every attached
    shmkv process holds one, whatever its layout), False when none, None if unknown."""
    F_OFD_GETLK = getattr(__import__("fcntl"), "F_OFD_GETLK", None)
    if F_OFD_GETLK is None:
        return None
    import fcntl

    try:
        fd = os.open(seg_path(name), os.O_RDONLY)
    except OSError:
        return None
    try:
        # struct flock: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t
        req = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        res = fcntl.fcntl(fd, F_OFD_GETLK, req)
        return struct.unpack("hhqqi4x", res)[0] != fcntl.F_UNLCK
    except OSError:
        return None
    finally:
        os.close(fd)


# ======================================================================================
# analysis: everything derived from one snapshot
# ======================================================================================
def analyze(snap):
    """Derive what the commands show from a snapshot.  Every value read from the segment
    is clamped, so torn or corrupt values give odd numbers, never an exception."""
    cfg = snap["config"]
    NB, bs = cfg.num_blocks, cfg.block_size
    rc = np.asarray(snap["ref_cnt"], dtype=np.int64)
    hashed = (np.asarray(snap["block_flags"]) & 1) != 0

    procs, by_token = [], {}
    for p in snap["processes"]:
        d = dict(pid=int(p["pid"]), slot=int(p["slot"]), alive=bool(p["alive"]),
                 attach_time_ns=int(p["attach_time_ns"]),
                 inflight=[int(b) for b in p["inflight"] if 0 <= b < NB],
                 cached_blocks=int(p.get("cached_blocks", 0)),
                 cached_seq_slots=int(p.get("cached_seq_slots", 0)),
                 sequences=0, tokens=0, blocks=0, exclusive_blocks=0, _tables=[])
        procs.append(d)
        by_token[(int(p["gen"]) << 32) | (int(p["slot"]) + 1)] = d

    empty = np.zeros(0, dtype=np.int64)
    seqs, tabs, toks, dead_tabs, live_tabs = [], [], [], [], []
    for s in snap["sequences"]:
        t = np.asarray(s.get("table", empty), dtype=np.int64)
        t = t[(t >= 0) & (t < NB)]
        n = len(t)
        length = int(min(s["len"], n * bs))
        if s["detached"]:
            owner = "detached"
        elif s["owner_alive"]:
            owner = "alive"
        else:
            owner = "dead"
        proc = by_token.get(s["owner_token"])
        pid = proc["pid"] if proc is not None else s["owner_pid"]
        seqs.append(dict(sid=int(s["sid"]), owner_pid=None if s["detached"] else pid,
                         owner=owner, len=int(s["len"]), blocks=n,
                         shared_blocks=int((rc[t] > 1).sum()), priority=int(s["priority"]),
                         created_ns=int(s["created_ns"]),
                         last_access_ns=int(s["last_access_ns"]),
                         consistent=bool(s["consistent"])))
        tabs.append(t)
        # tokens held in each table entry: full blocks, then the partial last one
        toks.append(np.clip(length - np.arange(n, dtype=np.int64) * bs, 0, bs))
        (dead_tabs if owner == "dead" else live_tabs).append(t)
        if proc is not None and owner != "detached":
            proc["sequences"] += 1
            proc["tokens"] += int(s["len"])
            proc["_tables"].append(t)

    all_t = np.concatenate(tabs) if tabs else empty
    all_tok = np.concatenate(toks) if toks else empty
    refs = np.bincount(all_t, minlength=NB)
    live_refs = np.bincount(np.concatenate(live_tabs) if live_tabs else empty, minlength=NB)
    dead_extra = [b for p in procs if not p["alive"] for b in p["inflight"]]
    live_extra = [b for p in procs if p["alive"] for b in p["inflight"]]
    dead_refs = np.bincount(np.concatenate(dead_tabs + [np.array(dead_extra, np.int64)])
                            if dead_tabs or dead_extra else empty, minlength=NB)
    if live_extra:
        live_refs = live_refs + np.bincount(np.array(live_extra, np.int64), minlength=NB)
    dead_only = (rc > 0) & (dead_refs > 0) & (live_refs == 0)

    for p in procs:
        held = np.concatenate(p["_tables"] + [np.array(p["inflight"], np.int64)])
        u, cnt = np.unique(held, return_counts=True)
        p["blocks"] = len(u)
        # exclusive: every table reference to the block comes from this process
        table_cnt = cnt - np.isin(u, p["inflight"])
        p["exclusive_blocks"] = int((refs[u] == table_cnt).sum()) if len(u) else 0
        del p["_tables"]

    state = np.full(NB, FREE, dtype=np.int8)
    state[(rc == 0) & hashed] = CACHED
    state[rc == 1] = OWNED
    state[rc > 1] = SHARED
    state[dead_only] = DEAD

    fill = np.zeros(NB, dtype=np.int64)
    if len(all_t):
        np.maximum.at(fill, all_t, all_tok)
    used = rc > 0
    referenced = used & (refs > 0)
    n_used = int(used.sum())
    free_mask = rc == 0
    runs = _runs(free_mask)
    partial = set()
    for s, t in zip(seqs, tabs):
        if len(t) and min(s["len"], len(t) * bs) % bs:
            partial.add(int(t[-1]))
    values, counts = np.unique(rc, return_counts=True)
    blocks = dict(
        num_blocks=NB, block_size=bs,
        free=int((state == FREE).sum()), cached=int((state == CACHED).sum()),
        owned=int((rc == 1).sum()), shared=int((rc > 1).sum()), used=n_used,
        held_by_dead=int(dead_only.sum()),
        in_flight=int((used & (refs == 0)).sum()),
        refcount_histogram={str(int(v)): int(c) for v, c in zip(values, counts)},
        fragmentation=dict(
            partial_last_blocks=len(partial),
            wasted_token_slots=int((bs - fill[referenced]).sum()),
            largest_free_run=max(runs) if runs else 0,
            free_runs=len(runs),
            tokens_per_used_block=(float(fill[used].sum()) / n_used) if n_used else 0.0,
            stored_tokens=int(fill.sum()),
            logical_tokens=int(sum(min(s["len"], s["blocks"] * bs) for s in seqs)),
            blocks_saved_by_sharing=int(len(all_t) - int((refs > 0).sum())),
        ))
    dead_seqs = [s for s in seqs if s["owner"] == "dead"]
    dead = dict(processes=sum(1 for p in procs if not p["alive"]),
                pids=sorted({p["pid"] for p in procs if not p["alive"]}),
                sequences=len(dead_seqs), blocks=int(dead_only.sum()),
                tokens=sum(s["len"] for s in dead_seqs))
    return dict(cfg=cfg, procs=procs, seqs=seqs, blocks=blocks, state=state, dead=dead,
                alive=sum(1 for p in procs if p["alive"]))


def _runs(mask):
    """Lengths of the runs of True in a bool array."""
    if not mask.any():
        return []
    m = np.concatenate(([False], mask, [False])).astype(np.int8)
    d = np.diff(m)
    starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    return (ends - starts).tolist()


def seg_state(snap, view):
    return "ok" if view["alive"] else "stale"


def dead_hint(name, dead):
    if not dead["sequences"] and not dead["processes"]:
        return None
    pids = ", ".join(map(str, dead["pids"])) or "?"
    return (f"{dead['sequences']} sequences / {dead['blocks']} blocks held by dead "
            f"processes (pid {pids}) - run `shmkv recover {name}` to reclaim them")


# ======================================================================================
# commands
# ======================================================================================
def scan(patterns=(), include_all=False):
    """Every shmkv segment in /dev/shm (see `shmkv ls --help` for the rule)."""
    try:
        entries = sorted(os.scandir(SHM_DIR), key=lambda e: e.name)
    except OSError as e:
        raise CLIError(f"cannot list {SHM_DIR}: {e.strerror}") from None
    out = []
    for e in entries:
        if patterns and not any(fnmatch.fnmatchcase(e.name, p) for p in patterns):
            continue
        try:
            if not e.is_file(follow_symlinks=False) or e.name.startswith("sem."):
                continue
            size = e.stat(follow_symlinks=False).st_size
            magic_ok, _ = read_prefix(e.name)
        except FileNotFoundError:
            continue
        except PermissionError:
            if include_all:
                out.append(dict(name=e.name, path=e.path, size_bytes=None,
                                state="unreadable", detail="permission denied"))
            continue
        except OSError as err:
            if include_all:
                out.append(dict(name=e.name, path=e.path, size_bytes=None,
                                state="unreadable", detail=err.strerror))
            continue
        if not magic_ok:
            if include_all:
                out.append(dict(name=e.name, path=e.path, size_bytes=size,
                                state="not-shmkv", detail="no shmkv magic"))
            continue
        row = dict(name=e.name, path=e.path, size_bytes=size)
        try:
            snap = _core.snapshot(e.name, tables=True)
        except FileNotFoundError:
            continue
        except PermissionError:
            row.update(state="unreadable", detail="permission denied")
            out.append(row)
            continue
        except SegmentError as err:
            row["state"], row["detail"] = classify_error(e.name, err)
            out.append(row)
            continue
        view = analyze(snap)
        cfg = snap["config"]
        row.update(
            state=seg_state(snap, view), detail=None, config=dataclasses.asdict(cfg),
            model=model_str(cfg), num_blocks=cfg.num_blocks, used_blocks=snap["used_blocks"],
            used_pct=round(100.0 * snap["used_blocks"] / cfg.num_blocks, 2),
            num_sequences=len(view["seqs"]), processes_alive=view["alive"],
            processes_dead=view["dead"]["processes"],
            dead_sequences=view["dead"]["sequences"], dead_blocks=view["dead"]["blocks"],
            creator_pid=snap["creator_pid"], create_time_ns=snap["create_time_ns"])
        out.append(row)
    return out


_STATE_STYLE = {"ok": "green", "stale": "yellow", "corrupt": "bold red",
                "incompatible": "magenta", "not-ready": "yellow", "not-shmkv": "dim",
                "unreadable": "red"}


def cmd_ls(args):
    rows = scan(args.pattern, args.all)
    if args.json:
        emit_json(rows)
        return EXIT_OK
    if not rows:
        print(f"no shmkv segments in {SHM_DIR}" + (" matching " + " ".join(args.pattern)
                                                   if args.pattern else ""))
        return EXIT_OK
    body, notes = [], []
    for r in rows:
        st = (r["state"], _STATE_STYLE.get(r["state"]))
        size = fmt_bytes(r["size_bytes"]) if r["size_bytes"] is not None else "-"
        if "model" in r:
            dead = r["processes_dead"]
            body.append([r["name"], size, r["model"], r["num_blocks"], f"{r['used_pct']:.1f}%",
                         r["num_sequences"], r["processes_alive"],
                         (str(dead), "bold red") if dead else "0", st])
            if r["dead_sequences"] or dead:
                notes.append(f"{r['name']}: {r['dead_sequences']} sequences / "
                             f"{r['dead_blocks']} blocks held by {dead} dead process(es) - "
                             f"`shmkv recover {r['name']}`")
        else:
            body.append([r["name"], size, "-", "-", "-", "-", "-", "-", st])
            notes.append(f"{r['name']}: {r['detail']}")
    print(table(["NAME", "SIZE", "MODEL", "BLOCKS", "USED", "SEQS", "PROCS", "DEAD", "STATE"],
                body, align="lrlrrrrrl"))
    for n in notes:
        print(paint(n, "yellow"))
    return EXIT_OK


def cmd_info(args):
    snap = load(args.name, tables=True)
    view = analyze(snap)
    cfg = snap["config"]
    lay = snap["layout"]
    pool = lay["off_vpool"] - lay["off_kpool"]
    doc = dict(
        name=args.name, path=seg_path(args.name), state=seg_state(snap, view),
        layout_version=snap["layout_version"], supported_layout_version=_core.LAYOUT_VERSION,
        abi_fingerprint=f"{snap['abi_fingerprint']:#018x}",
        creator_pid=snap["creator_pid"], create_time_ns=snap["create_time_ns"],
        create_time=fmt_time_ns(snap["create_time_ns"]), hash_seed=f"{snap['hash_seed']:#018x}",
        config=dataclasses.asdict(cfg),
        sizes=dict(segment_bytes=snap["segment_size"], kv_pool_bytes=2 * pool,
                   metadata_bytes=lay["off_kpool"], bytes_per_token=cfg.bytes_per_token,
                   bytes_per_block=cfg.bytes_per_block,
                   max_blocks_per_seq=cfg.max_blocks_per_seq,
                   token_capacity=cfg.num_blocks * cfg.block_size),
        usage=dict(num_blocks=cfg.num_blocks, used_blocks=snap["used_blocks"],
                   free_blocks=snap["free_blocks"], cached_blocks=snap["cached_blocks"],
                   peak_used_blocks=snap["peak_used_blocks"],
                   num_sequences=snap["num_sequences"], max_seqs=cfg.max_seqs,
                   processes_alive=view["alive"], processes_dead=view["dead"]["processes"],
                   max_procs=cfg.max_procs, index_entries=snap["index_entries"],
                   last_recovery_s=snap["last_recovery_s"],
                   max_recovery_s=snap["max_recovery_s"]),
        dead=view["dead"], counters=dict(snap["counters"]), layout=dict(lay))
    if args.json:
        emit_json(doc)
        return EXIT_OK
    u, sz = doc["usage"], doc["sizes"]

    def kv(key, value):
        print(f"  {key:<22} {value}")

    print(paint(f"segment {args.name}", "bold") + f"  ({doc['path']})")
    kv("state", paint(doc["state"], _STATE_STYLE[doc["state"]])
       + f"  ({u['processes_alive']} live, {u['processes_dead']} dead processes)")
    kv("layout version", f"{doc['layout_version']} (this shmkv reads "
       f"{doc['supported_layout_version']}), ABI {doc['abi_fingerprint']}")
    kv("created", f"{doc['create_time']} by pid {doc['creator_pid']}")
    kv("size", f"{fmt_bytes(sz['segment_bytes'])} = KV pool {fmt_bytes(sz['kv_pool_bytes'])}"
       f" + metadata {fmt_bytes(sz['metadata_bytes'])}")
    print(paint("config", "bold"))
    for k, v in doc["config"].items():
        kv(k, v)
    print(paint("derived", "bold"))
    kv("bytes_per_token", f"{sz['bytes_per_token']} ({fmt_bytes(sz['bytes_per_token'])})")
    kv("bytes_per_block", f"{sz['bytes_per_block']} ({fmt_bytes(sz['bytes_per_block'])})")
    kv("max_blocks_per_seq", sz["max_blocks_per_seq"])
    kv("token capacity", sz["token_capacity"])
    print(paint("usage", "bold"))
    kv("blocks", f"{u['used_blocks']} used / {u['num_blocks']} "
       f"({fmt_pct(u['used_blocks'] / u['num_blocks'])}), {u['free_blocks']} free "
       f"({u['cached_blocks']} of them cached), peak {u['peak_used_blocks']}")
    kv("sequences", f"{u['num_sequences']} / {u['max_seqs']}")
    kv("processes", f"{u['processes_alive']} live + {u['processes_dead']} dead / "
       f"{u['max_procs']}")
    kv("prefix index entries", u["index_entries"])
    kv("recovery", f"last {fmt_duration(u['last_recovery_s'])}, "
       f"max {fmt_duration(u['max_recovery_s'])}")
    print(paint("counters", "bold"))
    for k, v in doc["counters"].items():
        kv(k, v)
    hint = dead_hint(args.name, view["dead"])
    if hint:
        print(paint(hint, "yellow"))
    return EXIT_OK


def _owner_cell(s):
    if s["owner"] == "dead":
        return ("DEAD", "bold red")
    if s["owner"] == "detached":
        return ("detached", "cyan")
    return ("alive", "green")


def cmd_seqs(args):
    snap = load(args.name, tables=True)
    view = analyze(snap)
    seqs = view["seqs"]
    if args.dead:
        seqs = [s for s in seqs if s["owner"] == "dead"]
    if args.pid is not None:
        seqs = [s for s in seqs if s["owner_pid"] == args.pid]
    key = {"sid": lambda s: s["sid"], "len": lambda s: -s["len"],
           "blocks": lambda s: -s["blocks"], "shared": lambda s: -s["shared_blocks"],
           "age": lambda s: s["created_ns"]}[args.sort]
    seqs = sorted(seqs, key=key)
    total = len(seqs)
    if args.limit:
        seqs = seqs[:args.limit]
    if args.json:
        emit_json(seqs)
        return EXIT_OK
    if not seqs:
        print(f"{args.name}: no sequences" + (" matching the filter" if
                                               (args.dead or args.pid is not None) else ""))
    else:
        rows = [[s["sid"], s["owner_pid"] if s["owner_pid"] is not None else "-",
                 _owner_cell(s), s["len"], s["blocks"], s["shared_blocks"], s["priority"],
                 fmt_age(s["created_ns"]), fmt_age(s["last_access_ns"])]
                for s in seqs]
        print(table(["SID", "OWNER", "STATE", "LEN", "BLOCKS", "SHARED", "PRIO", "AGE", "IDLE"],
                    rows, align="rrlrrrrrr"))
        if total > len(seqs):
            print(paint(f"... {total - len(seqs)} more (use --limit 0 for all)", "dim"))
    d = view["dead"]
    print(f"{len(view['seqs'])} sequences, "
          f"{sum(s['len'] for s in view['seqs'])} tokens in {view['blocks']['used']} blocks; "
          f"{sum(1 for s in view['seqs'] if s['owner'] == 'detached')} detached")
    hint = dead_hint(args.name, d)
    if hint:
        print(paint(hint, "bold red"))
    return EXIT_OK


def cmd_procs(args):
    snap = load(args.name, tables=True)
    view = analyze(snap)
    procs = view["procs"]
    if args.json:
        emit_json(procs)
        return EXIT_OK
    if not procs:
        print(f"{args.name}: no process attached")
    else:
        rows = [[p["pid"], p["slot"], ("alive", "green") if p["alive"] else ("DEAD", "bold red"),
                 fmt_age(p["attach_time_ns"]), p["sequences"], p["tokens"], p["blocks"],
                 p["exclusive_blocks"], len(p["inflight"]),
                 f"{p['cached_blocks']}/{p['cached_seq_slots']}"] for p in procs]
        print(table(["PID", "SLOT", "STATE", "ATTACHED", "SEQS", "TOKENS", "BLOCKS", "EXCLUSIVE",
                     "INFLIGHT", "CACHE"], rows, align="rrlrrrrrrr"))
    print(f"{view['alive']} live, {view['dead']['processes']} dead processes "
          f"(max {view['cfg'].max_procs}); BLOCKS: blocks its sequences reference, "
          "EXCLUSIVE: referenced by no other process, CACHE: free blocks / sequence "
          "slots it keeps for itself (counted as free)")
    hint = dead_hint(args.name, view["dead"])
    if hint:
        print(paint(hint, "bold red"))
    return EXIT_OK


def cmd_blocks(args):
    snap = load(args.name, tables=True)
    view = analyze(snap)
    b = view["blocks"]
    doc = dict(name=args.name, **b)
    if args.png:
        draw_png(args.png, args.name, view)
        doc["png"] = os.path.abspath(args.png)
    if args.json:
        emit_json(doc)
        return EXIT_OK
    nb = b["num_blocks"]
    fr = b["fragmentation"]
    print(paint(f"pool of {args.name}: {nb} blocks x {b['block_size']} tokens", "bold"))
    rows = [["free", b["free"], fmt_pct(b["free"] / nb), "refcount 0, empty"],
            ["cached", b["cached"], fmt_pct(b["cached"] / nb),
             "refcount 0, holds a prefix-cache hit; reusable"],
            ["owned", b["owned"], fmt_pct(b["owned"] / nb), "refcount 1"],
            ["shared", b["shared"], fmt_pct(b["shared"] / nb), "refcount > 1 (copy-on-write)"],
            [("held by dead", "red" if b["held_by_dead"] else None), b["held_by_dead"],
             fmt_pct(b["held_by_dead"] / nb),
             "of the owned/shared: used only by dead processes (recover frees them)"]]
    print(table(["STATE", "BLOCKS", "%", "MEANING"], rows, align="lrrl", indent="  "))
    print(paint("refcount histogram", "bold"))
    hist = sorted(((int(k), v) for k, v in b["refcount_histogram"].items()))
    print(table(["REFCOUNT", "BLOCKS"], hist, align="rr", indent="  "))
    print(paint("fragmentation", "bold"))
    print(f"  partially filled last blocks  {fr['partial_last_blocks']}")
    print(f"  wasted token slots            {fr['wasted_token_slots']} "
          f"(of {b['used'] * b['block_size']} in used blocks)")
    print(f"  largest free run              {fr['largest_free_run']} blocks "
          f"({fr['free_runs']} free runs)")
    print(f"  tokens per used block         {fr['tokens_per_used_block']:.2f} "
          f"of {b['block_size']}")
    print(f"  stored / logical tokens       {fr['stored_tokens']} / {fr['logical_tokens']} "
          f"(sharing saves {fr['blocks_saved_by_sharing']} blocks)")
    if b["in_flight"]:
        print(f"  in flight (no table yet)      {b['in_flight']}")
    if args.map or (args.map is None and nb <= 1024):
        print(paint("map", "bold") + "  . free  c cached  o owned  S shared  X dead")
        chars = np.array(list(".coSX"))[view["state"]]
        width = 64
        for i in range(0, nb, width):
            line = "".join(chars[i:i + width])
            if _color:
                line = "".join(paint(ch, {"c": "blue", "o": "green", "S": "yellow",
                                          "X": "bold red"}.get(ch, "dim")) for ch in line)
            print(f"  {i:>8} {line}")
    if args.png:
        print(f"picture written to {doc['png']}")
    hint = dead_hint(args.name, view["dead"])
    if hint:
        print(paint(hint, "bold red"))
    return EXIT_OK


_PNG_COLORS = {FREE: (230, 230, 230), CACHED: (158, 202, 225), OWNED: (49, 163, 84),
               SHARED: (253, 141, 60), DEAD: (214, 39, 40)}
_PNG_LABELS = {FREE: "free", CACHED: "cached (refcount 0, prefix-reusable)",
               OWNED: "owned (refcount 1)", SHARED: "shared (refcount > 1)",
               DEAD: "held only by dead processes"}


def draw_png(path, name, view):
    """One cell per block (or per group of blocks in huge pools: the most severe state of
    the group), coloured by state, with a title and a legend."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise CLIError("--png needs Pillow (pip install 'shmkv[cli]')") from None
    state = view["state"]
    nb = len(state)
    group = max(1, math.ceil(nb / (1 << 20)))
    if group > 1:
        pad = (-nb) % group
        state = np.concatenate([state, np.zeros(pad, np.int8)]).reshape(-1, group).max(axis=1)
    cells = len(state)
    cols = max(1, min(cells, 64 if cells <= 4096 else math.ceil(math.sqrt(cells * 2))))
    rows = math.ceil(cells / cols)
    cell = max(1, min(24, 1200 // cols, 900 // max(rows, 1)))
    gap = 1 if cell >= 6 else 0
    grid = np.full(rows * cols, 255, dtype=np.int16)   # 255: past the last block
    grid[:cells] = state
    rgb = np.full((rows * cols, 3), 255, dtype=np.uint8)
    for st, col in _PNG_COLORS.items():
        rgb[grid == st] = col
    img_grid = rgb.reshape(rows, cols, 3).repeat(cell, axis=0).repeat(cell, axis=1)
    if gap:
        img_grid[cell - 1::cell, :, :] = 255
        img_grid[:, cell - 1::cell, :] = 255
    try:
        font = ImageFont.load_default(size=14)
    except TypeError:  # Pillow < 10.1
        font = ImageFont.load_default()
    margin, title_h, line_h = 12, 44, 20
    legend_h = line_h * len(_PNG_COLORS) + 8
    gw, gh = img_grid.shape[1], img_grid.shape[0]
    width = max(gw + 2 * margin, 520)
    height = title_h + gh + legend_h + 2 * margin
    img = Image.new("RGB", (width, height), (255, 255, 255))
    img.paste(Image.fromarray(img_grid, "RGB"), (margin, title_h))
    d = ImageDraw.Draw(img)
    b = view["blocks"]
    d.text((margin, 6), f"shmkv {name}: {nb} blocks x {b['block_size']} tokens", fill=(0, 0, 0),
           font=font)
    per = f"1 cell = {group} blocks (the most severe state)" if group > 1 else "1 cell = 1 block"
    counts = {st: int((view["state"] == st).sum()) for st in _PNG_COLORS}
    d.text((margin, 24), f"used {b['used']} ({fmt_pct(b['used'] / nb)}) = owned "
           f"{counts[OWNED]} + shared {counts[SHARED]} + dead {counts[DEAD]};  {per}",
           fill=(60, 60, 60), font=font)
    y = title_h + gh + margin
    for st, col in _PNG_COLORS.items():
        d.rectangle([margin, y + 2, margin + 14, y + 16], fill=col, outline=(90, 90, 90))
        d.text((margin + 22, y + 1), f"{_PNG_LABELS[st]}: {counts[st]}", fill=(0, 0, 0),
               font=font)
        y += line_h
    try:
        img.save(path, format="PNG")
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e.strerror or e}") from None


def _attach(name, timeout):
    """Attach (registering this process) without running recovery."""
    from .cache import KVCache

    load(name, tables=False)            # fail fast, with the right message, on a bad segment
    try:
        cache = KVCache.attach(name, prefault=False, timeout=timeout, recover=False)
    except FileNotFoundError:
        raise CLIError(f"{name}: no such segment") from None
    except PermissionError:
        raise CLIError(f"{name}: permission denied (attaching needs read-write access; "
                       "run as the segment's owner)") from None
    except LockTimeout:
        raise CLIError(f"{name}: timed out after {timeout}s waiting for the segment's lock "
                       "(a live process holds it)") from None
    except SegmentError as e:
        raise CLIError(f"{name}: {classify_error(name, e)[1]}") from None
    except ShmkvError as e:
        raise CLIError(f"{name}: cannot attach: {e}") from None
    cache.lock_timeout = timeout
    return cache


def _recover_line(name, r):
    if not (r["sequences"] or r["blocks"] or r["processes"] or r["locks"] or r["tail_blocks"]
            or r["corrupt_sequences"]):
        return f"{name}: nothing to reclaim (recovery pass took {fmt_duration(r['duration_s'])})"
    return (f"{name}: reclaimed {r['sequences']} sequences and {r['blocks']} blocks from "
            f"{r['processes']} dead processes ({r['locks']} locks released, "
            f"{r['tail_blocks']} unpublished tail blocks trimmed, {r['refcounts_fixed']} "
            f"inconsistent refcounts repaired, {r['corrupt_sequences']} corrupt sequences "
            f"dropped) in "
            f"{fmt_duration(r['duration_s'])}")


def cmd_recover(args):
    before = analyze(load(args.name))["dead"]
    cache = _attach(args.name, args.timeout)
    try:
        r = cache.recover()
    except LockTimeout:
        raise CLIError(f"{args.name}: timed out waiting for the pool lock") from None
    finally:
        cache.close()
    doc = dict(name=args.name, **r, dead_pids=before["pids"])
    if args.json:
        emit_json(doc)
    else:
        print(_recover_line(args.name, r))
        if before["pids"]:
            print(f"dead processes: pid {', '.join(map(str, before['pids']))}")
    return EXIT_OK


def cmd_check(args):
    before = load(args.name, tables=True)
    dead_before = analyze(before)["dead"]
    cache = _attach(args.name, args.timeout)
    repair = None
    try:
        if args.repair:
            repair = cache.recover()
        problems = list(cache.check())
    except LockTimeout:
        raise CLIError(f"{args.name}: timed out waiting for the pool lock") from None
    finally:
        cache.close()
    view = analyze(load(args.name, tables=True))
    if args.strict and not args.repair and (dead_before["sequences"] or dead_before["blocks"]):
        problems.append(f"{dead_before['sequences']} sequences / {dead_before['blocks']} "
                        f"blocks were held by dead processes "
                        f"(pid {', '.join(map(str, dead_before['pids']))})")
    ok = not problems
    if args.json:
        emit_json(dict(name=args.name, consistent=ok, problems=problems, repair=repair,
                       dead_before=dead_before, dead_after=view["dead"]))
        return EXIT_OK if ok else EXIT_PROBLEMS
    if repair is not None:
        print(_recover_line(args.name, repair))
    if ok:
        print(paint(f"{args.name}: consistent", "green") +
              f" ({view['cfg'].num_blocks} blocks, {len(view['seqs'])} sequences, "
              f"{len(view['procs'])} processes)")
    else:
        print(paint(f"{args.name}: {len(problems)} problem(s)", "bold red"))
        for p in problems:
            print(f"  - {p}")
        if not args.repair:
            print(f"`shmkv check --repair {args.name}` runs recovery first")
    if not args.repair and not args.strict and (dead_before["sequences"]
                                                or dead_before["processes"]):
        print(paint(f"note: {dead_before['sequences']} sequences / {dead_before['blocks']} "
                    f"blocks were held by dead processes (pid "
                    f"{', '.join(map(str, dead_before['pids']))}): a leak, not an "
                    "inconsistency", "yellow"))
    return EXIT_OK if ok else EXIT_PROBLEMS


def cmd_create(args):
    from .cache import KVCache

    fields = {}
    if args.preset:
        fields.update(PRESETS[args.preset][0])
    for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "max_seqs",
              "max_seq_len", "max_procs", "hash", "num_blocks"):
        v = getattr(args, f)
        if v is not None:
            fields[f] = v
    missing = [f for f in ("num_layers", "num_kv_heads", "head_dim") if f not in fields]
    if missing:
        raise CLIError("create: give a --preset or every one of --layers, --kv-heads, "
                       f"--head-dim (missing: {', '.join(missing)})")
    if args.memory is not None:
        if args.num_blocks is not None:
            raise CLIError("create: give --blocks or --memory, not both")
        probe = CacheConfig(**{**fields, "num_blocks": 1, "max_seq_len": None})
        nblocks = args.memory // probe.bytes_per_block
        if nblocks < 1:
            raise CLIError(f"create: --memory {fmt_bytes(args.memory)} holds no block of "
                           f"{fmt_bytes(probe.bytes_per_block)}")
        fields["num_blocks"] = nblocks
    if "num_blocks" not in fields:
        raise CLIError("create: give --blocks N or --memory SIZE (e.g. --memory 8GiB)")
    try:
        cfg = CacheConfig(**fields)
    except ValueError as e:
        raise CLIError(f"create: {e}") from None
    try:
        cache = KVCache.create(args.name, cfg, mode=args.mode, prefault=args.prefault)
    except FileExistsError:
        raise CLIError(f"{args.name}: a segment with that name exists already "
                       f"(`shmkv info {args.name}`, or `shmkv rm {args.name}` first)") from None
    except PermissionError as e:
        raise CLIError(f"{args.name}: permission denied: {e}") from None
    except OSError as e:
        raise CLIError(f"{args.name}: cannot create ({fmt_bytes(cfg.segment_size())}): "
                       f"{e.strerror or e}") from None
    cache.close()       # the segment outlives this process; it holds no sequence
    snap = load(args.name, tables=False)
    doc = dict(name=args.name, path=seg_path(args.name), config=dataclasses.asdict(cfg),
               segment_bytes=snap["segment_size"], bytes_per_block=cfg.bytes_per_block,
               token_capacity=cfg.num_blocks * cfg.block_size, mode=f"{args.mode:#o}")
    if args.json:
        emit_json(doc)
    else:
        print(f"created {args.name} ({seg_path(args.name)}, mode {args.mode:#o}): "
              f"{model_str(cfg)}, {cfg.num_blocks} blocks = {doc['token_capacity']} tokens, "
              f"segment {fmt_bytes(snap['segment_size'])}")
    return EXIT_OK


def _unlink(name):
    import posix_ipc

    try:
        posix_ipc.unlink_shared_memory("/" + name)
        return True
    except posix_ipc.ExistentialError:
        return False
    except posix_ipc.PermissionsError as e:
        raise CLIError(f"{name}: cannot remove: {e}") from None


def _liveness(name):
    """(live pids or None, state) of a segment, whatever its state; raises CLIError for a
    missing file."""
    try:
        snap = _core.snapshot(name, tables=False)
    except FileNotFoundError:
        raise CLIError(f"{name}: no such segment") from None
    except PermissionError:
        raise CLIError(f"{name}: permission denied") from None
    except SegmentError as e:
        state, _ = classify_error(name, e)
        return None, state
    return [p["pid"] for p in snap["processes"] if p["alive"]], "readable"


def cmd_rm(args):
    if args.stale:
        return _rm_stale(args)
    if not args.names:
        raise CLIError("rm: give NAME... or --stale")
    results, refused = [], False
    for name in args.names:
        pids, state = _liveness(name)
        reason = None
        if state == "not-shmkv" and not args.force:
            reason = "not a shmkv segment (--force removes it anyway)"
        elif pids and not args.force:
            reason = (f"{len(pids)} live process(es) attached (pid "
                      f"{', '.join(map(str, pids))}); stop them or use --force")
        elif pids is None and lock_holders(name) and not args.force:
            reason = f"{state} segment still in use by a live process; use --force"
        if reason:
            refused = True
            results.append(dict(name=name, removed=False, reason=reason))
            print(f"shmkv: refusing to remove {name}: {reason}", file=sys.stderr)
            continue
        removed = _unlink(name)
        results.append(dict(name=name, removed=removed, reason=None if removed else "gone"))
        if not args.json:
            print(f"removed {name}" + (" (live processes keep their mapping until they exit)"
                                       if pids else ""))
    if args.json:
        emit_json(results)
    return EXIT_PROBLEMS if refused else EXIT_OK


def _rm_stale(args):
    if args.names and not args.pattern:
        args.pattern = args.names
    out = []
    for r in scan(args.pattern or (), False):
        state = r["state"]
        if state == "ok" or state == "not-ready":
            continue                     # live processes; or a creator may be building it
        if state in ("corrupt", "incompatible") and lock_holders(r["name"]) is not False:
            continue                     # cannot tell who uses it: leave it
        if state == "unreadable":
            continue
        removed = False if args.dry_run else _unlink(r["name"])
        out.append(dict(name=r["name"], state=state, removed=removed,
                        processes_dead=r.get("processes_dead"),
                        num_sequences=r.get("num_sequences")))
    if args.json:
        emit_json(out)
        return EXIT_OK
    if not out:
        print("no stale segments")
    for r in out:
        verb = "would remove" if args.dry_run else ("removed" if r["removed"] else "gone:")
        extra = (f" ({r['processes_dead']} dead processes, {r['num_sequences']} sequences)"
                 if r["processes_dead"] is not None else "")
        print(f"{verb} {r['name']}: {r['state']}{extra}")
    return EXIT_OK


# --------------------------------------------------------------------------------------
# top
# --------------------------------------------------------------------------------------
RATE_KEYS = (("allocations", "allocs"), ("frees", "frees"), ("appended_tokens", "append tok"),
             ("forks", "forks"), ("cow_copies", "COW"), ("recoveries", "recoveries"),
             ("gathered_tokens", "gather tok"), ("reclaimed_blocks", "reclaimed blk"))


def top_frame(name, snap, prev, dt, n_top):
    view = analyze(snap)
    cfg = snap["config"]
    c = snap["counters"]
    rates = {k: (max(0, c[k] - prev[k]) / dt if prev is not None and dt > 0 else None)
             for k, _ in RATE_KEYS}
    top = sorted(view["seqs"], key=lambda s: (-s["blocks"], -s["len"], s["sid"]))[:n_top]
    return dict(time=time.time(), name=name, num_blocks=cfg.num_blocks,
                used_blocks=snap["used_blocks"], cached_blocks=snap["cached_blocks"],
                peak_used_blocks=snap["peak_used_blocks"],
                used_pct=round(100.0 * snap["used_blocks"] / cfg.num_blocks, 2),
                num_sequences=len(view["seqs"]), max_seqs=cfg.max_seqs,
                tokens=sum(s["len"] for s in view["seqs"]),
                processes_alive=view["alive"], processes_dead=view["dead"]["processes"],
                dead=view["dead"], rates=rates, counters=dict(c), top_sequences=top,
                processes=view["procs"])


def render_frame(f, interval):
    width = 30
    filled = round(width * f["used_blocks"] / f["num_blocks"])
    bar = paint("#" * filled, "green" if f["used_pct"] < 90 else "red") + \
        paint("." * (width - filled), "dim")
    stamp = time.strftime("%H:%M:%S", time.localtime(f["time"]))
    out = [paint(f"shmkv top {f['name']}", "bold") + f"   {stamp}   every {interval:g}s",
           (f"util   [{bar}] {f['used_pct']:5.1f}%  {f['used_blocks']}/{f['num_blocks']} used"
            f", {f['cached_blocks']} cached, peak {f['peak_used_blocks']}"),
           (f"seqs   {f['num_sequences']}/{f['max_seqs']}  tokens {f['tokens']}   "
            f"procs {f['processes_alive']} live")
           + (paint(f", {f['processes_dead']} DEAD", "bold red") if f["processes_dead"] else "")]
    parts = []
    for k, label in RATE_KEYS:
        r = f["rates"][k]
        parts.append(f"{label} {r:,.1f}" if r is not None else f"{label} -")
    half = len(parts) // 2
    out.append("rate/s " + "  ".join(parts[:half]))
    out.append("       " + "  ".join(parts[half:]))
    out.append("")
    if f["top_sequences"]:
        rows = [[s["sid"], s["owner_pid"] if s["owner_pid"] is not None else "-",
                 _owner_cell(s), s["len"], s["blocks"], s["shared_blocks"]]
                for s in f["top_sequences"]]
        out.append(paint("top sequences", "bold"))
        out.append(table(["SID", "OWNER", "STATE", "LEN", "BLOCKS", "SHARED"], rows,
                         align="rrlrrr", indent="  "))
    else:
        out.append("no sequences")
    if f["processes"]:
        rows = [[p["pid"], ("alive", "green") if p["alive"] else ("DEAD", "bold red"),
                 p["sequences"], p["tokens"], p["blocks"]] for p in f["processes"]]
        out.append(paint("processes", "bold"))
        out.append(table(["PID", "STATE", "SEQS", "TOKENS", "BLOCKS"], rows, align="rlrrr",
                         indent="  "))
    else:
        out.append("no process attached")
    return "\n".join(out)


def cmd_top(args):
    if args.interval <= 0:
        raise CLIError("top: --interval must be > 0")
    if args.json and not args.iterations:
        raise CLIError("top: --json needs --iterations N (it prints one JSON list of frames)")
    prev = load(args.name, tables=False)["counters"]
    t_prev = time.monotonic()
    frames = []
    live = None
    if not args.json and sys.stdout.isatty() and not args.plain:
        try:
            from rich.console import Console
            from rich.live import Live
            from rich.text import Text

            console = Console()
            live = Live(Text("shmkv top: first sample in "
                             f"{args.interval:g}s ..."), console=console, auto_refresh=False,
                        screen=False)
            live.start()
        except ImportError:
            live = None
    n = 0
    try:
        while not args.iterations or n < args.iterations:
            time.sleep(args.interval)
            snap = load(args.name, tables=True)
            now = time.monotonic()
            f = top_frame(args.name, snap, prev, now - t_prev, args.top)
            prev, t_prev = snap["counters"], now
            n += 1
            if args.json:
                frames.append(f)
            elif live is not None:
                live.update(Text.from_ansi(render_frame(f, args.interval)), refresh=True)
            else:
                print(render_frame(f, args.interval))
                print(flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
    if args.json:
        emit_json(frames)
    return EXIT_OK


# --------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------
_COUNTER_HELP = {
    "allocations": "Blocks taken from the pool.",
    "frees": "Blocks returned to the pool.",
    "forks": "Sequences forked (copy-on-write).",
    "cow_copies": "Partial blocks copied before a write (copy-on-write).",
    "sequences_created": "Sequences created.",
    "sequences_freed": "Sequences freed.",
    "appended_tokens": "Tokens appended (append and reserve).",
    "gathered_tokens": "Tokens gathered.",
    "recoveries": "Recovery passes run.",
    "reclaimed_sequences": "Sequences reclaimed from dead processes.",
    "reclaimed_blocks": "Blocks reclaimed from dead processes.",
    "lock_owner_dead": "Times the pool lock was found held by a dead process.",
    "lock_waits": "Times a lock was busy and a process waited.",
    "prefix_queries": "Tokens looked up in the prefix cache.",
    "prefix_hits": "Tokens found in the prefix cache.",
    "cached_blocks_reused": "Cached blocks taken by a prefix hit.",
    "cached_blocks_evicted": "Cached blocks reused for new data.",
    "trimmed_blocks": "Blocks trimmed from sequences.",
    "processes_attached": "Process attachments.",
}


def _esc(v):
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_value(v):
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def exposition(names):
    """Prometheus text exposition (format 0.0.4) of every segment in `names`."""
    fams = {}      # name -> (type, help, [(labels dict, value)])

    def add(metric, mtype, help_, labels, value):
        fams.setdefault(metric, (mtype, help_, []))[2].append((labels, value))

    for name in names:
        base = {"segment": name}
        try:
            snap = _core.snapshot(name, tables=True)
        except (OSError, SegmentError):
            add("shmkv_up", "gauge", "1 if the segment could be read, else 0.", base, 0)
            continue
        view = analyze(snap)
        cfg = snap["config"]
        b = view["blocks"]
        add("shmkv_up", "gauge", "1 if the segment could be read, else 0.", base, 1)
        add("shmkv_info", "gauge", "Configuration of the segment (value 1).",
            {**base, "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads,
             "head_dim": cfg.head_dim, "block_size": cfg.block_size, "dtype": cfg.dtype,
             "layout_version": snap["layout_version"]}, 1)
        gauges = [
            ("shmkv_segment_size_bytes", "Size of the shared-memory segment.",
             snap["segment_size"]),
            ("shmkv_block_size_tokens", "Tokens per block.", cfg.block_size),
            ("shmkv_bytes_per_block", "K+V bytes of one block over all layers.",
             cfg.bytes_per_block),
            ("shmkv_blocks_capacity", "Physical blocks in the pool.", cfg.num_blocks),
            ("shmkv_blocks_used", "Blocks with refcount > 0.", snap["used_blocks"]),
            ("shmkv_blocks_free", "Blocks with refcount 0 (cached ones included).",
             snap["free_blocks"]),
            ("shmkv_blocks_cached", "Free blocks still holding a prefix-cache entry.",
             snap["cached_blocks"]),
            ("shmkv_blocks_shared", "Blocks with refcount > 1.", b["shared"]),
            ("shmkv_blocks_used_peak", "High-water mark of used blocks.",
             snap["peak_used_blocks"]),
            ("shmkv_blocks_dead", "Blocks used only by sequences of dead processes.",
             b["held_by_dead"]),
            ("shmkv_tokens", "Tokens in all live sequences.",
             sum(s["len"] for s in view["seqs"])),
            ("shmkv_wasted_token_slots", "Empty token slots in used blocks.",
             b["fragmentation"]["wasted_token_slots"]),
            ("shmkv_sequences", "Live sequences.", len(view["seqs"])),
            ("shmkv_sequences_capacity", "Sequence slots.", cfg.max_seqs),
            ("shmkv_sequences_dead", "Sequences owned by dead processes (reclaimable).",
             view["dead"]["sequences"]),
            ("shmkv_processes", "Live attached processes.", view["alive"]),
            ("shmkv_processes_dead", "Dead processes still in the process table.",
             view["dead"]["processes"]),
            ("shmkv_processes_capacity", "Process-table slots.", cfg.max_procs),
            ("shmkv_index_entries", "Entries in the prefix-cache hash index.",
             snap["index_entries"]),
            ("shmkv_recovery_last_seconds", "Duration of the last recovery pass.",
             snap["last_recovery_s"]),
            ("shmkv_recovery_max_seconds", "Longest recovery pass.", snap["max_recovery_s"]),
        ]
        for metric, help_, value in gauges:
            add(metric, "gauge", help_, base, value)
        for key, value in snap["counters"].items():
            if key.startswith("evictions_"):
                add("shmkv_evictions_total", "counter", "Cached blocks evicted, by policy.",
                    {**base, "policy": key[len("evictions_"):]}, value)
                continue
            add(f"shmkv_{key}_total", "counter",
                _COUNTER_HELP.get(key, f"Counter {key} of the segment."), base, value)
    out = []
    for metric, (mtype, help_, samples) in fams.items():
        out.append(f"# HELP {metric} {help_}")
        out.append(f"# TYPE {metric} {mtype}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
            out.append(f"{metric}{{{lab}}} {_fmt_value(value)}")
    return "\n".join(out) + "\n"


def parse_listen(text):
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 127.0.0.1:9464), got {text!r}")
    host = host.strip("[]")
    if not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a host, got {text!r}")
    return host, int(port)


def cmd_metrics(args):
    for name in args.names:
        load(name, tables=False)          # a bad name fails now, not at the first scrape
    if args.listen is None:
        text = exposition(args.names)
        if args.json:
            emit_json(dict(format="prometheus-0.0.4", text=text))
        else:
            sys.stdout.write(text)
        return EXIT_OK
    import socket
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from socketserver import ThreadingMixIn

    names = list(args.names)
    scrapes = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body = exposition(names).encode()
                ctype = "text/plain; version=0.0.4; charset=utf-8"
                code = 200
            elif path == "/":
                body = ("<html><body><h1>shmkv metrics</h1><p><a href=\"/metrics\">/metrics"
                        "</a> for " + ", ".join(names) + "</p></body></html>\n").encode()
                ctype, code = "text/html; charset=utf-8", 200
            else:
                body, ctype, code = b"not found; try /metrics\n", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            if path == "/metrics":
                scrapes.append(time.monotonic())

        def log_message(self, fmt, *a):
            if args.verbose:
                sys.stderr.write(f"shmkv metrics: {self.address_string()} {fmt % a}\n")

    class Server(ThreadingMixIn, HTTPServer):
        daemon_threads = True
        allow_reuse_address = True
        address_family = socket.AF_INET6 if ":" in args.listen[0] else socket.AF_INET

    try:
        server = Server(args.listen, Handler)
    except OSError as e:
        raise CLIError(f"metrics: cannot listen on {args.listen[0]}:{args.listen[1]}: "
                       f"{e.strerror or e}") from None
    host, port = server.server_address[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"shmkv metrics: serving http://{shown}:{port}/metrics", file=sys.stderr, flush=True)

    stopping = threading.Event()
    old = signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    deadline = time.monotonic() + args.duration if args.duration else None
    server.timeout = 0.2
    try:
        while not stopping.is_set():
            server.handle_request()
            if args.once and scrapes:
                break
            if deadline and time.monotonic() >= deadline:
                break
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, old)
        server.server_close()
    return EXIT_OK


def cmd_demo(argv):
    import importlib
    import importlib.util

    if importlib.util.find_spec(__package__ + ".demo") is None:
        raise CLIError("demo: not available in this installation of shmkv")
    demo = importlib.import_module(__package__ + ".demo")
    rc = demo.main(argv)
    return rc if isinstance(rc, int) else EXIT_OK


# ======================================================================================
# argument parsing
# ======================================================================================
DESCRIPTION = """\
Inspect, repair and watch shmkv segments: paged KV caches that live in one POSIX
shared-memory segment (/dev/shm/NAME) shared by several inference processes."""

EPILOG = """\
typical session:
  shmkv ls                       find the segments on this host and their state
  shmkv info NAME                config, sizes, counters of one segment
  shmkv procs NAME               who is attached, alive or DEAD, what each holds
  shmkv seqs NAME                every sequence: owner, alive/DEAD/detached, length, blocks
  shmkv seqs NAME --dead         only the sequences a dead worker leaked
  shmkv recover NAME             reclaim what dead processes held (prints what it freed)
  shmkv check NAME               verify every invariant (check --repair: recover first)
  shmkv top NAME                 live view, refreshed every second (Ctrl-C quits)
  shmkv blocks NAME --png p.png  the block pool, drawn
  shmkv metrics NAME --listen 127.0.0.1:9464   Prometheus endpoint /metrics
  shmkv create NAME --preset llama3-8b --memory 8GiB
  shmkv rm NAME | shmkv rm --stale

A worker that died (SIGKILL, OOM) leaves its sequences and blocks allocated until the next
recovery: `procs` and `seqs` mark it DEAD and print the leak; `recover` reclaims it.

Inspection (ls, info, seqs, blocks, procs, top, metrics) maps the segment read-only, takes
no lock and changes nothing; it works while workers run and after they all died.
check only attaches to run the invariants and changes nothing; check --repair, recover,
create and rm change the segment or its name.

every command: --help; --json prints one JSON document on stdout (a list for ls, seqs,
procs; an object for info, blocks, check, recover, create); --color auto|always|never.
exit codes: 0 success; 1 a check found problems, or rm refused; 2 usage error, or a
segment that cannot be read (missing, not shmkv, corrupt, incompatible, no permission)."""


class _Fmt(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=30)


def build_parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON document on stdout instead of text")
    common.add_argument("--color", choices=("auto", "always", "never"),
                        default=argparse.SUPPRESS,
                        help="colour: auto (only on a terminal; NO_COLOR disables), always, "
                             "never")

    p = argparse.ArgumentParser(prog="shmkv", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=_Fmt)
    p.add_argument("--version", action="version", version=f"shmkv {_version()} (layout "
                   f"version {_core.LAYOUT_VERSION})")
    p.add_argument("--json", action="store_true", default=False,
                   help="print one JSON document on stdout instead of text")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour: auto (only on a terminal), always, never")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    def cmd(name, help_, desc, func, epilog=None):
        sp = sub.add_parser(name, help=help_, description=desc, epilog=epilog,
                            parents=[common], formatter_class=_Fmt)
        sp.set_defaults(func=func)
        return sp

    def name_arg(sp):
        sp.add_argument("name", metavar="NAME", type=seg_name,
                        help="segment name as `shmkv ls` shows it (/NAME and "
                             "/dev/shm/NAME work too)")

    sp = cmd("ls", "list every shmkv segment on this host",
             "List every shmkv segment in /dev/shm: name, size, model shape, blocks, used %,\n"
             "sequences, live and dead attached processes, state.",
             cmd_ls, epilog="""\
states:
  ok            at least one live process is attached
  stale         no live process is attached (an idle segment made by `shmkv create`, or
                what dead workers left); `shmkv rm --stale` removes these
  corrupt       the header or sizes contradict themselves (e.g. a truncated file)
  incompatible  made by another layout version / ABI of shmkv
  not-ready     its creator is still initialising it, or died doing so
which files count: regular files in /dev/shm whose first 8 bytes are shmkv's magic
"__SHMKV1"; other shared-memory files (other programs, semaphores) are not shown unless
--all, where they appear as not-shmkv.  DEAD > 0 means a worker died holding blocks:
run `shmkv recover NAME`.""")
    sp.add_argument("pattern", nargs="*", metavar="PATTERN",
                    help="only names matching these shell patterns (e.g. 'llama*')")
    sp.add_argument("--all", action="store_true",
                    help="also list /dev/shm files that are not shmkv segments")

    sp = cmd("info", "header, config, sizes and every counter of a segment",
             "Show a segment's header (layout version, ABI, creator pid, creation time),\n"
             "its config, sizes, usage and all counters.", cmd_info)
    name_arg(sp)

    sp = cmd("seqs", "the sequence table: owner, alive/DEAD/detached, length, blocks",
             "List the live sequences: id, owner pid and whether the owner is alive (DEAD:\n"
             "its process died; the sequence leaks until `shmkv recover`), detached ones\n"
             "(owned by no process, kept on purpose), length in tokens, blocks, and blocks\n"
             "shared with other sequences (copy-on-write after fork).", cmd_seqs)
    name_arg(sp)
    sp.add_argument("--dead", action="store_true",
                    help="only sequences whose owner died (what recovery would reclaim)")
    sp.add_argument("--pid", type=int, help="only sequences owned by this pid")
    sp.add_argument("--sort", choices=("sid", "len", "blocks", "shared", "age"), default="sid",
                    help="order (default: sid; len/blocks/shared: largest first)")
    sp.add_argument("--limit", type=int, default=0, help="show at most N (default: all)")

    sp = cmd("blocks", "the block pool: free/cached/owned/shared, refcounts, fragmentation",
             "Map the block pool: free / cached / owned (refcount 1) / shared (refcount > 1)\n"
             "blocks, blocks held only by dead processes, the refcount histogram and\n"
             "fragmentation (partially filled last blocks, wasted token slots, largest free\n"
             "run, tokens per used block).", cmd_blocks)
    name_arg(sp)
    sp.add_argument("--png", metavar="FILE",
                    help="also draw the pool into a PNG: one cell per block, coloured by state")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--map", dest="map", action="store_true", default=None,
                   help="print an ASCII map of every block (default: pools <= 1024 blocks)")
    g.add_argument("--no-map", dest="map", action="store_false", help="no ASCII map")

    sp = cmd("procs", "attached processes: pid, alive or DEAD, what each holds",
             "List the processes in the segment's process table: pid, alive or DEAD (it died\n"
             "without detaching: its sequences leak until `shmkv recover`), when it attached,\n"
             "the sequences, tokens and blocks it holds, blocks only it references, and blocks\n"
             "it is filling right now (in flight).", cmd_procs)
    name_arg(sp)

    sp = cmd("check", "verify every invariant; exit 1 on problems (--repair: recover first)",
             "Verify every invariant of the segment (refcounts against block tables, free\n"
             "list, sequence slots, ...).  Exit 0 when consistent, 1 when a problem was\n"
             "found.  Blocks leaked by dead processes are a note, not a problem, unless\n"
             "--strict.  check attaches the segment for its duration; a process that\n"
             "detaches runs shmkv's recovery pass, so what dead processes held is reclaimed\n"
             "as check exits even without --repair (the output says how much).",
             cmd_check)
    name_arg(sp)
    sp.add_argument("--repair", action="store_true",
                    help="run recovery first (reclaims what dead processes held, rebuilds "
                         "refcounts), then check")
    sp.add_argument("--strict", action="store_true",
                    help="count sequences/blocks held by dead processes as problems")
    sp.add_argument("--timeout", type=float, default=10.0,
                    help="seconds to wait for a lock held by a live process (default 10)")

    sp = cmd("recover", "reclaim what dead processes held; print what was reclaimed",
             "Run a recovery pass: free the sequences and blocks of processes that died,\n"
             "release locks they held, trim unpublished tails, fix refcounts.  Detached\n"
             "sequences and live processes are never touched.  Safe while workers run.",
             cmd_recover)
    name_arg(sp)
    sp.add_argument("--timeout", type=float, default=10.0,
                    help="seconds to wait for a lock held by a live process (default 10)")

    presets = "\n".join(f"  {k:<12} {v[1]}" for k, v in PRESETS.items())
    sp = cmd("create", "create a segment from flags or a preset",
             "Create a segment.  The shape comes from --preset and/or the flags (flags win);\n"
             "the pool size from --blocks N or --memory SIZE (num_blocks = SIZE //\n"
             "bytes_per_block; SIZE counts the K+V pool only, metadata comes on top).\n"
             "The segment outlives this command; nobody is attached until workers attach.",
             cmd_create, epilog="presets:\n" + presets + "\n\nexamples:\n"
             "  shmkv create llama-cache --preset llama3-8b --memory 8GiB\n"
             "  shmkv create small --layers 4 --kv-heads 2 --head-dim 64 --blocks 1024")
    name_arg(sp)
    sp.add_argument("--preset", choices=sorted(PRESETS), help="a model shape (see below)")
    sp.add_argument("--memory", type=parse_size, metavar="SIZE",
                    help="K+V pool size, e.g. 8GiB, 512MiB, 2GB; sets num_blocks")
    sp.add_argument("--blocks", dest="num_blocks", type=int, metavar="N",
                    help="num_blocks: physical blocks in the pool")
    sp.add_argument("--layers", dest="num_layers", type=int, metavar="N", help="num_layers")
    sp.add_argument("--kv-heads", dest="num_kv_heads", type=int, metavar="N",
                    help="num_kv_heads")
    sp.add_argument("--head-dim", dest="head_dim", type=int, metavar="N", help="head_dim")
    sp.add_argument("--block-size", dest="block_size", type=int, metavar="N",
                    help="tokens per block (default 16)")
    sp.add_argument("--dtype", choices=sorted(DTYPES), help="element type (default float16)")
    sp.add_argument("--max-seqs", dest="max_seqs", type=int, metavar="N",
                    help="sequence slots (default 1024)")
    sp.add_argument("--max-seq-len", dest="max_seq_len", type=int, metavar="N",
                    help="longest sequence in tokens (default: the whole pool)")
    sp.add_argument("--max-procs", dest="max_procs", type=int, metavar="N",
                    help="processes attached at once (default 64)")
    sp.add_argument("--hash", choices=sorted(HASHES), help="prefix-cache block hash "
                    "(default fast)")
    sp.add_argument("--mode", type=lambda s: int(s, 8), default=0o600,
                    help="permission bits in octal (default 600; 660 lets the group attach)")
    sp.add_argument("--prefault", action="store_true",
                    help="touch every page now, so /dev/shm must hold it all at once")

    sp = cmd("rm", "remove a segment's name (refuses while live processes are attached)",
             "Unlink segments from /dev/shm.  Processes that still map it keep working; the\n"
             "memory is freed when the last one exits.  Refuses (exit 1) while a live process\n"
             "is attached, unless --force.  --stale removes every segment with no live\n"
             "process (state stale, or corrupt/incompatible with no process holding it);\n"
             "PATTERNs narrow it down.", cmd_rm)
    sp.add_argument("names", nargs="*", metavar="NAME",
                    help="segments to remove (with --stale: shell patterns)")
    sp.add_argument("--force", action="store_true",
                    help="remove even with live processes attached, or a non-shmkv file")
    sp.add_argument("--stale", action="store_true",
                    help="remove every segment that no live process is attached to")
    sp.add_argument("--dry-run", action="store_true", help="with --stale: only list them")
    sp.set_defaults(pattern=None)

    sp = cmd("top", "live view: utilization, rates, top sequences, processes",
             "Refresh a live view every --interval seconds: pool utilization, allocations /\n"
             "frees / appended tokens / forks / COW copies / recoveries per second (from\n"
             "counter deltas), the largest sequences and the processes.  Ctrl-C quits.\n"
             "On a terminal it redraws in place; otherwise it prints one text frame per\n"
             "refresh (--json: a list of frames, needs --iterations).", cmd_top)
    name_arg(sp)
    sp.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    sp.add_argument("--iterations", "-n", type=int, default=0,
                    help="stop after N refreshes (default: until Ctrl-C)")
    sp.add_argument("--top", type=int, default=10, help="sequences to show (default 10)")
    sp.add_argument("--plain", action="store_true",
                    help="print frames one after the other even on a terminal")

    sp = cmd("metrics", "Prometheus metrics of segments, over HTTP or on stdout",
             "Expose the counters and gauges in the Prometheus text format 0.0.4 (labels:\n"
             "segment=NAME): counters end in _total (shmkv_allocations_total,\n"
             "shmkv_forks_total, ...), gauges are shmkv_blocks_used, shmkv_blocks_free,\n"
             "shmkv_sequences, shmkv_processes, ...  Without --listen, print once on stdout\n"
             "(for node_exporter's textfile collector).  With --listen HOST:PORT serve\n"
             "http://HOST:PORT/metrics until Ctrl-C / SIGTERM; PORT 0 picks a free port; the\n"
             "bound address is printed on stderr.  Binds only to the HOST you give.",
             cmd_metrics)
    sp.add_argument("names", nargs="+", metavar="NAME", type=seg_name,
                    help="one or more segments")
    sp.add_argument("--listen", type=parse_listen, metavar="HOST:PORT",
                    help="serve over HTTP here (e.g. 127.0.0.1:9464)")
    sp.add_argument("--once", action="store_true", help="exit after the first /metrics scrape")
    sp.add_argument("--duration", type=float, default=0,
                    help="exit after this many seconds (default: run until stopped)")
    sp.add_argument("--verbose", action="store_true", help="log every request on stderr")

    sub.add_parser("demo", help="run the shmkv demo (shmkv demo --help for its options)",
                   add_help=False)
    return p


def _command_index(argv):
    """Index of the command word in argv (after the global options), or None."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--color":
            i += 2
        elif a.startswith("-"):
            i += 1
        else:
            return i
    return None


def main(argv=None):
    """Entry point of the `shmkv` console script and `python -m shmkv`; returns the exit
    code."""
    global _color
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        i = _command_index(argv)
        if i is not None and argv[i] == "demo":     # everything after it is the demo's
            return cmd_demo(argv[i + 1:])
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:         # --help, --version, usage errors
            return e.code if isinstance(e.code, int) else EXIT_USAGE
        if not getattr(args, "command", None):
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        _color = (args.color == "always" or
                  (args.color == "auto" and sys.stdout.isatty()
                   and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"))
        return args.func(args)
    except CLIError as e:
        sys.stderr.write(f"shmkv: {e}\n")
        return e.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `shmkv ls | head`: the reader went away; exit quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_OK
