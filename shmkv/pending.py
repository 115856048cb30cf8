"""Pending marks: which prefixes some process on the host is computing right now, so that
another process about to compute the same prefix can wait for it to be published instead
(a fleet of vLLM instances on one segment computes each new prefix once, not once per
instance).

The marks live beside the segment, in the shared-memory object ``NAME.pending``
(``/dev/shm/NAME.pending``; ``KVCache.unlink`` and ``shmkv unlink`` remove it with the
segment): a fixed open-addressing table of 4096 records ``(key, pid, start, expires)``.

* ``key`` names one block of one prefix: a 64-bit chain hash of the salt and every token up
  to the block's end (:func:`prefix_keys`), never 0.
* A mark is **owned by a process**: ``pid`` and that process's start time (``/proc/PID/stat``,
  so a reused PID is not mistaken for the owner).  A mark whose owner is dead, or whose
  ``expires`` (``CLOCK_MONOTONIC``, one clock for the whole host) has passed, is no mark:
  it is reused by the next claim.  Nothing has to clean up after a killed process.
* Every read and write happens under ``flock`` on the object's descriptor, which the
  kernel drops when its holder dies: a killed process never leaves the table locked.
* Nothing read from the table is trusted beyond its own record: a record is a mark only
  if its owner is a live process with the recorded start time and its deadline is within
  :data:`MAX_TTL` of now.  A corrupted table can make a caller wait (up to its own bound)
  or compute twice; it cannot make it read out of bounds or wait forever.
"""
from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ._shmfile import Owners, open_or_create, resolve_owners, shm_path

__all__ = ["PendingMarks", "prefix_keys", "pending_path", "unlink_pending", "MAX_TTL"]

SHM_DIR = "/dev/shm"
SLOTS = 4096
PROBES = 32                     # linear probing stops here: a crowded table marks less
MAX_TTL = 3600.0                # a deadline further away than this is garbage
_MAGIC = 0x53484B5650454E44     # "SHKVPEND"
_HEADER = 64
_REC = np.dtype([("key", "<u8"), ("pid", "<i8"), ("start", "<u8"), ("expires", "<f8")])


def pending_path(segment: str) -> str:
    """``/dev/shm/NAME.pending`` for segment ``NAME`` (a leading ``/`` is ignored)."""
    name = segment.lstrip("/")
    if not name or "/" in name:
        raise ValueError(f"segment: expected a plain name, got {segment!r}")
    return os.path.join(SHM_DIR, name + ".pending")


def unlink_pending(segment: str) -> bool:
    """Remove segment ``NAME``'s pending marks; True if there were any."""
    try:
        os.unlink(pending_path(segment))
        return True
    except (FileNotFoundError, ValueError):
        return False


def prefix_keys(tokens: np.ndarray, block_size: int, salt: str) -> np.ndarray:
    """uint64 keys of the blocks of ``tokens`` (whole blocks only): key ``i`` hashes the
    salt and tokens ``[0, (i + 1) * block_size)``; never 0."""
    ids = np.ascontiguousarray(tokens, dtype=np.int32)
    n = len(ids) // block_size
    out = np.empty(n, dtype=np.uint64)
    h = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    for i in range(n):
        h = hashlib.blake2b(h + ids[i * block_size:(i + 1) * block_size].tobytes(),
                            digest_size=8).digest()
        out[i] = int.from_bytes(h, "little") or 1
    return out


def _start_time(pid: int) -> Optional[int]:
    """The start time of process ``pid`` (clock ticks after boot), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:                        # the command name may hold spaces and parentheses
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


class PendingMarks:
    """The pending marks of one segment, for this process (module docstring)."""

    def __init__(self, segment: str, *, trusted_owners: Owners = None) -> None:
        self.path = pending_path(segment)
        self._pid = os.getpid()
        start = _start_time(self._pid)
        self._start = 0 if start is None else start
        # no link followed, a regular file of this user or a trusted one; a new table
        # takes the segment's mode and group (_shmfile)
        fd, _ = open_or_create(self.path, f"pending table of segment {segment!r}",
                               resolve_owners(trusted_owners), like=shm_path(segment))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                size = _HEADER + SLOTS * _REC.itemsize
                if os.fstat(fd).st_size == 0:          # the first process lays it out
                    os.ftruncate(fd, size)
                    os.pwrite(fd, _MAGIC.to_bytes(8, "little") +
                              SLOTS.to_bytes(4, "little"), 0)
                got = os.fstat(fd).st_size
                head = os.pread(fd, 12, 0)
                if (got != size or int.from_bytes(head[:8], "little") != _MAGIC
                        or int.from_bytes(head[8:12], "little") != SLOTS):
                    raise ValueError(f"{self.path}: not a pending-marks table (size {got}, "
                                     f"expected {size} with magic {_MAGIC:#x})")
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            self._mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._recs = np.frombuffer(self._mm, dtype=_REC, count=SLOTS, offset=_HEADER)

    def close(self) -> None:
        if self._fd >= 0:
            del self._recs
            try:
                self._mm.close()
            except BufferError:         # a caller still holds a view: unmapped with it
                pass
            os.close(self._fd)
            self._fd = -1

    # ------------------------------------------------------------------ internals
    def _live(self, rec: np.void, now: float, alive: Dict[Tuple[int, int], bool]) -> bool:
        """Whether ``rec`` is a mark (owner alive, deadline not passed and believable)."""
        exp = float(rec["expires"])
        if not (now < exp <= now + MAX_TTL):
            return False
        pid, start = int(rec["pid"]), int(rec["start"])
        if pid <= 0 or pid > 2**22:
            return False
        k = (pid, start)
        if k not in alive:
            alive[k] = _start_time(pid) == start
        return alive[k]

    def _find(self, key: int, now: float,
              alive: Dict[Tuple[int, int], bool]) -> Tuple[int, int]:
        """(slot holding ``key`` or -1, first reusable slot on its probe path or -1)."""
        free = -1
        recs = self._recs
        for j in range(PROBES):
            s = (key + j) % SLOTS
            k = int(recs[s]["key"])
            if k == key:
                return s, free
            if k == 0:
                return -1, s if free < 0 else free
            if free < 0 and not self._live(recs[s], now, alive):
                free = s
        return -1, free

    def _leading(self, keys: Sequence[int], now: float,
                 alive: Dict[Tuple[int, int], bool]) -> int:
        """How many leading ``keys`` other live processes mark (the lock is held)."""
        n = 0
        for key in keys:
            s, _ = self._find(int(key), now, alive)
            if s < 0 or self._mine(self._recs[s]) or not self._live(self._recs[s], now, alive):
                break
            n += 1
        return n

    def _mine(self, rec: np.void) -> bool:
        return int(rec["pid"]) == self._pid and int(rec["start"]) == self._start

    # ------------------------------------------------------------------ the API
    def claim(self, keys: Sequence[int], ttl: float) -> int:
        """If ``keys[0]`` is marked by another live process: the number of leading keys so
        marked, and nothing changes (the caller waits or computes).  Else 0, and every key
        not marked by another process is now marked by this one for ``ttl`` seconds."""
        if not len(keys):
            return 0
        if not 0 < ttl <= MAX_TTL:
            raise ValueError(f"ttl: expected 0 < ttl <= {MAX_TTL}, got {ttl}")
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            now = time.monotonic()
            alive: Dict[Tuple[int, int], bool] = {}
            recs = self._recs
            held = self._leading(keys, now, alive)
            if held:
                return held
            for key in keys:
                k = int(key)
                s, free = self._find(k, now, alive)
                if s >= 0 and not self._mine(recs[s]) and self._live(recs[s], now, alive):
                    continue                        # another process computes this one
                slot = s if s >= 0 else free
                if slot < 0:
                    continue                        # crowded: this key goes unmarked
                recs[slot] = (k, self._pid, self._start, now + ttl)
            return 0
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def held(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` other live processes mark (0: none; nothing changes)."""
        if not len(keys):
            return 0
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        try:
            return self._leading(keys, time.monotonic(), {})
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def release(self, keys: Sequence[int]) -> int:
        """Drop this process's marks on ``keys``; the number dropped."""
        if not len(keys):
            return 0
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            now = time.monotonic()
            alive: Dict[Tuple[int, int], bool] = {}
            n = 0
            for key in keys:
                s, _ = self._find(int(key), now, alive)
                if s >= 0 and self._mine(self._recs[s]):
                    self._recs[s]["expires"] = 0.0      # the key stays: probe paths hold
                    self._recs[s]["pid"] = 0
                    n += 1
            return n
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def marks(self) -> List[Tuple[int, int, float]]:
        """Every live mark: ``(key, pid, seconds left)`` (inspection, tests)."""
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        try:
            now = time.monotonic()
            alive: Dict[Tuple[int, int], bool] = {}
            return [(int(r["key"]), int(r["pid"]), float(r["expires"]) - now)
                    for r in self._recs if int(r["key"]) and self._live(r, now, alive)]
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
