"""Reading segments: name parsing, the read-only snapshot (``load``), what a failed
read means (``classify_error``), ``analyze`` (everything the commands show, derived from one
snapshot), the /dev/shm scan behind ``ls``, and the attach helpers the repairing commands
share (``attach``, ``liveness``).  No output here: callers render."""
from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import os
import stat
import struct

import numpy as np

from .. import _core
from .. import inspect as shmkv_inspect
from .._shmfile import ofd_lock
from ..errors import LockTimeout, SegmentError, ShmkvError
from .common import (
    CACHED,
    DEAD,
    FREE,
    MAGIC_BYTES,
    OWNED,
    SHARED,
    SHM_DIR,
    CLIError,
    held_by_dead,
    model_str,
    plural,
    shmkv_version,
)


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
    FileNotFoundError / PermissionError.  Never follows a link and never blocks on a FIFO:
    anything but a regular file is not a segment."""
    fd = os.open(seg_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False, None
        head = os.pread(fd, 16, 0)
    finally:
        os.close(fd)
    if len(head) < 8 or head[:8] != MAGIC_BYTES:
        return False, None
    version = struct.unpack_from("<I", head, 8)[0] if len(head) >= 12 else None
    return True, version


def classify_error(name, exc):
    """(state, one-line reason) for a SegmentError of `name`: 'not-shmkv', 'incompatible',
    'not-ready' or 'corrupt'."""
    text = str(exc)
    if getattr(exc, "reason", None) == "not_a_file":       # a link, a directory, a FIFO...
        return "not-shmkv", text.split(": ", 1)[1] if ": " in text else text
    try:
        magic_ok, version = read_prefix(name)
    except OSError:
        magic_ok, version = True, None
    if not magic_ok:
        return "not-shmkv", "not a shmkv segment (no shmkv magic in its first bytes)"
    if version is not None and version != _core.LAYOUT_VERSION:
        return "incompatible", (f"incompatible segment: layout version {version}, this "
                                f"shmkv {shmkv_version()} reads layout version "
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


def _mapped(exc, name, missing, denied):
    """The CLIError (exit 2) for an exception reading or attaching `name`, or None when
    the caller handles `exc` itself.  `missing` and `denied` say what to do next."""
    if isinstance(exc, FileNotFoundError):
        return CLIError(f"{name}: no such segment{missing}")
    if isinstance(exc, PermissionError):
        return CLIError(f"{name}: permission denied{denied}")
    if isinstance(exc, SegmentError):
        return CLIError(f"{name}: {classify_error(name, exc)[1]}")
    return None


def load(name, tables=True):
    """snapshot(name), or CLIError(exit 2) with one clear line."""
    try:
        return shmkv_inspect.snapshot(name, tables=tables)
    except OSError as e:
        err = _mapped(e, name, f" ({seg_path(name)} does not exist; `shmkv ls` lists "
                      "segments)", " (the segment belongs to another user; run as that user "
                      "or root)")
        raise (err or CLIError(f"{name}: cannot read the segment: {e.strerror or e}")) from None
    except SegmentError as e:
        raise _mapped(e, name, "", "") from None


def load_view(name):
    """(snapshot with the block tables, analyze() of it) of `name`; CLIError as load()."""
    snap = load(name, tables=True)
    return snap, analyze(snap)


def lock_holders(name):
    """True when some process holds a byte-range lock on the segment file (every attached
    shmkv process holds one, whatever its layout), False when none, None if unknown."""
    F_OFD_GETLK = getattr(__import__("fcntl"), "F_OFD_GETLK", None)
    if F_OFD_GETLK is None:
        return None
    import fcntl

    try:
        # never a link; a FIFO planted at the name must not block the open
        fd = os.open(seg_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return ofd_lock(fd, F_OFD_GETLK) != fcntl.F_UNLCK
    except OSError:
        return None
    finally:
        os.close(fd)


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
    return (f"{plural(dead['sequences'], 'sequence')} / {plural(dead['blocks'], 'block')} "
            f"{held_by_dead(dead['pids'])} - run `shmkv recover {name}` to reclaim them")


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
            snap = shmkv_inspect.snapshot(e.name, tables=True)
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


def attach(name, timeout, trust=None):
    """Attach (registering this process) without running recovery; ``trust``: the
    users (--trust) whose segment this may attach besides the caller's own."""
    from ..cache import KVCache
    from ..errors import UntrustedSegmentError

    load(name, tables=False)            # fail fast, with the right message, on a bad segment
    try:
        cache = KVCache.attach(name, prefault=False, timeout=timeout, recover=False,
                               trusted_owners=trust)
    except UntrustedSegmentError as e:
        raise CLIError(f"{name}: {e} (the CLI: --trust USER)") from None
    except (TypeError, ValueError) as e:            # an unknown --trust user
        raise CLIError(f"{name}: {e}") from None
    except LockTimeout:
        raise CLIError(f"{name}: timed out after {timeout}s waiting for the segment's lock "
                       "(a live process holds it)") from None
    except (FileNotFoundError, PermissionError, ShmkvError) as e:
        err = _mapped(e, name, "", " (attaching needs read-write access; run as the "
                      "segment's owner)")
        raise (err or CLIError(f"{name}: cannot attach: {e}")) from None
    cache.lock_timeout = timeout
    return cache


def liveness(name):
    """(live pids or None, state) of a segment, whatever its state; raises CLIError for a
    missing file."""
    try:
        snap = shmkv_inspect.snapshot(name, tables=False)
    except SegmentError as e:
        state, _ = classify_error(name, e)
        return None, state
    except (FileNotFoundError, PermissionError) as e:
        raise _mapped(e, name, "", "") from None
    return [p["pid"] for p in snap["processes"] if p["alive"]], "readable"
