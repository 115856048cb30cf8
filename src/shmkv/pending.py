"""Pending marks: which prefixes some process on the host is computing right now, so that
another process about to compute the same prefix can wait for it to be published instead
(a fleet of vLLM instances on one segment computes each new prefix once, not once per
instance).

The marks live beside the segment, in the shared-memory object ``NAME.pending``
(``/dev/shm/NAME.pending``; ``KVCache.unlink`` and ``shmkv rm`` remove it with the
segment): a fixed open-addressing table of 4096 records ``(key, owner, eta, expires)``.

* ``key`` names one block of one prefix: a 64-bit chain hash of the salt and every token up
  to the block's end (:func:`prefix_keys`), never 0.
* A mark is **owned by an opener** of the table (a :class:`PendingMarks`: one per engine):
  a random 40-bit token, which its opener holds as an open-file-description lock
  (``F_OFD_SETLK``) on one byte of the table file past its end.  A mark whose owner's
  lock is gone (the kernel drops it when the owner's process dies, in whatever PID
  namespace: containers sharing ``/dev/shm`` see each other's owners alive; pids mean
  nothing there), or whose ``expires`` (``CLOCK_MONOTONIC``, one clock for the whole
  host) has passed, is no mark: it is reused by the next claim.  Nothing has to clean up
  after a killed process.
* ``eta`` is the owner's own estimate of when it will have published the block
  (``CLOCK_MONOTONIC`` in whole microseconds; 0: no estimate), from the prefill rate it
  measured: a waiter that sees no new block for a while keeps waiting while a live owner
  says it is still computing (:meth:`PendingMarks.eta`), up to its own bound.  Tables
  written before the field existed hold 0 there: no estimate.
* Every read and write happens under ``flock`` on the object's descriptor, which the
  kernel drops when its holder dies: a killed process never leaves the table locked.  A
  *stopped* one (Ctrl-Z, a debugger, ``docker pause``) can, so no wait for the lock is
  unbounded: an operation that does not get it within ``timeout`` (default
  :data:`LOCK_TIMEOUT`, 50 ms, on ``time.monotonic``) answers "no marks" -- a miss: the
  caller computes -- and is counted (:attr:`PendingMarks.timeouts`).
* The creator makes the file with ``O_EXCL``, reserves its memory (``posix_fallocate``:
  a full ``/dev/shm`` is an error at open, never a SIGBUS at a later store) and writes the
  header (magic, slots, format :data:`VERSION`) last; nobody follows a symbolic link.  A
  file without a header is finished by whoever opens it first; one that is not a table
  (a symlink, not a regular file, the wrong size, no magic, another version) raises
  :class:`PendingTableError`, and :class:`EngineMarks` turns the marks off with one
  warning on it while the engine serves on.
* :meth:`PendingMarks.claim` decides in one critical section: either the prefix's first
  block is another owner's (the caller waits: it lost) or every free key is now the
  caller's.  Within one owner, :class:`EngineMarks` counts the requests that claimed a
  key: a mark is dropped when the last of them finishes or is preempted.
* Nothing read from the table is trusted beyond its own record: a record is a mark only
  if its owner's lock is held and its deadline is within :data:`MAX_TTL` of now.  A
  corrupted table can make a caller wait (up to its own bound) or compute twice; it
  cannot make it read out of bounds or wait forever.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import secrets
import stat
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ._shmfile import Owners, check_owner, create_file, ofd_lock, resolve_owners, shm_path
from .errors import SegmentError

__all__ = ["PendingMarks", "PendingTableError", "EngineMarks", "prefix_keys", "pending_path",
           "unlink_pending", "MAX_TTL", "LOCK_TIMEOUT", "OPEN_TIMEOUT", "VERSION"]

SHM_DIR = "/dev/shm"
SLOTS = 4096
PROBES = 32                     # linear probing stops here: a crowded table marks less
MAX_TTL = 3600.0                # a deadline further away than this is garbage
LOCK_TIMEOUT = 0.05             # s: the longest a mark operation waits for the table's lock
OPEN_TIMEOUT = 1.0              # s: the longest opening waits for a table being laid out
VERSION = 2                     # the table's format (header and records)
_MAGIC = 0x53484B5650454E44     # "SHKVPEND"
_HEADER = 64                    # magic u64, slots u32, version u32, then zeros
_REC = np.dtype([("key", "<u8"), ("owner", "<i8"), ("eta", "<u8"), ("expires", "<f8")])
_SIZE = _HEADER + SLOTS * _REC.itemsize
# an owner's token t (1 <= t < 2**40) is its OFD write lock on byte _OWNER_BASE + t of the
# file: far past the table's bytes (a lock needs no bytes behind it)
_OWNER_BITS = 40
_OWNER_BASE = 1 << 41


def _header() -> bytes:
    return (_MAGIC.to_bytes(8, "little") + SLOTS.to_bytes(4, "little")
            + VERSION.to_bytes(4, "little"))


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


def _owner_lock(fd: int, token: int, cmd: int) -> int:
    """``fcntl(fd, cmd)`` (F_OFD_SETLK or F_OFD_GETLK) for a write lock on owner
    ``token``'s byte; the l_type the kernel answers (F_UNLCK: nobody else holds it)."""
    return ofd_lock(fd, cmd, _OWNER_BASE + token, 1)


class PendingTableError(SegmentError, ValueError):
    """``NAME.pending`` cannot serve as this segment's pending marks.

    ``path`` is the file; ``reason`` says why, for tools and logs: ``"symlink"``,
    ``"not_regular"`` (a directory, a FIFO, ...), ``"size"`` (not the table's size),
    ``"garbage"`` (no table's magic), ``"version"`` (another table format), ``"no_space"``
    (the table's memory could not be reserved: a full ``/dev/shm``), ``"busy"`` (a process
    held its lock past the bound while it was being laid out) or ``"os"`` (another
    ``OSError``); ``fix`` is what to do about it, in words.  A serving engine turns its
    pending marks off on this error (:class:`EngineMarks`) and serves on.
    """

    def __init__(self, path: str, reason: str, cause: str, fix: Optional[str] = None) -> None:
        self.path, self.reason, self.cause = path, reason, cause
        self.fix = fix or (f"remove it (rm {path}): processes that have it open keep theirs, "
                           "the next one to start lays out a fresh table")
        super().__init__(f"{path}: not a pending-marks table: {cause}; {self.fix}",
                         reason=reason)


def _lock_nb(fd: int, op: int, timeout: float) -> bool:
    """``flock(fd, op)``, waiting at most ``timeout`` seconds (``time.monotonic``): a
    non-blocking attempt, then attempts between short sleeps (0.1 ms doubling to 5 ms).
    False if the lock was not had in time (nothing held)."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    deadline = time.monotonic() + timeout
    nap = 1e-4
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(nap, left))
        nap = min(nap * 2, 5e-3)
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass


class PendingMarks:
    """The pending marks of one segment, for this process (module docstring).

    ``timeout`` bounds every wait for the table's lock in :meth:`claim`, :meth:`held`,
    :meth:`release` and :meth:`marks` (seconds, ``time.monotonic``; default
    :data:`LOCK_TIMEOUT`): a lock not had in time answers as if there were no marks (a
    miss: the caller computes) and adds one to :attr:`timeouts`.  ``open_timeout`` bounds
    the wait for the lock while the table is laid out (default :data:`OPEN_TIMEOUT`).
    A file that is not a table raises :class:`PendingTableError`.

    The table follows the trust rule of ``KVCache.attach``: another user's file is refused
    (``UntrustedSegmentError``) unless its owner is in ``trusted_owners``; a new table takes
    the segment's mode and group."""

    def __init__(self, segment: str, timeout: float = LOCK_TIMEOUT,
                 open_timeout: float = OPEN_TIMEOUT, *, trusted_owners: Owners = None) -> None:
        if not (0 <= timeout <= 60 and 0 <= open_timeout <= 60):
            raise ValueError(f"timeout, open_timeout: expected seconds in [0, 60], got "
                             f"{timeout}, {open_timeout}")
        self.path = pending_path(segment)
        self._segment = segment
        self._trusted = resolve_owners(trusted_owners)
        self.timeout = float(timeout)
        self.timeouts = 0               # lock waits that ran past the bound (no marks)
        self._pid = os.getpid()
        fd = self._open(float(open_timeout))
        try:
            self._mm = mmap.mmap(fd, _SIZE)
            self._ino = os.fstat(fd).st_ino
            self._token = self._take_token(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._recs = np.frombuffer(self._mm, dtype=_REC, count=SLOTS, offset=_HEADER)

    # ------------------------------------------------------------------ opening
    def _error(self, reason: str, cause: str, fix: Optional[str] = None) -> PendingTableError:
        return PendingTableError(self.path, reason, cause, fix)

    def _open(self, bound: float) -> int:
        """A descriptor of the table, laid out and checked (the file is made if missing)."""
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        made = False
        fd = -1
        for _ in range(8):              # made and removed by others meanwhile: try again
            try:
                fd = os.open(self.path, flags)
                break
            except FileNotFoundError:
                pass
            except OSError as e:
                raise self._os_error(e) from None
            try:                        # the creator: the file is ours to lay out
                mode, gid = self._new_mode()
                fd = create_file(self.path, self._label(), mode, gid)   # O_EXCL, O_NOFOLLOW
                made = True
                break
            except FileExistsError:
                continue
            except OSError as e:
                raise self._os_error(e) from None
        if fd < 0:
            raise self._error("os", "it was made and removed again eight times while this "
                              "process opened it", "try again")
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                # another user's table: UntrustedSegmentError unless trusted (_shmfile)
                check_owner(st, self.path, self._label(), self._trusted)
            self._check(fd, made, bound)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _take_token(self, fd: int) -> int:
        """A token no other opener holds, locked (OFD) on ``fd``: this opener's identity
        for as long as ``fd``'s open file description lives."""
        for _ in range(64):
            token = secrets.randbits(_OWNER_BITS) or 1
            try:
                _owner_lock(fd, token, fcntl.F_OFD_SETLK)
                return token
            except (BlockingIOError, PermissionError):
                continue                # held by another opener: 1 in 2**40 per opener
            except OSError as e:
                raise self._error("os", f"open-file-description locks failed on it "
                                  f"({type(e).__name__}: {e})",
                                  "run on Linux >= 3.15, or set \"pending\": false") from None
        raise self._error("os", "64 random owner tokens were all taken",
                          "remove the file (rm " + self.path + ")")

    def _after_fork(self) -> None:
        """A forked child is another owner: its own descriptor (the inherited one's
        description, its flock and its owner lock, are the parent's) and its own token."""
        fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            if os.fstat(fd).st_ino != self._ino:
                raise self._error("os", "the file was replaced since this object opened it "
                                  "(before a fork)", "open the pending marks again")
            token = self._take_token(fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(self._fd)              # the parent's description stays open in the parent
        self._fd, self._token, self._pid = fd, token, os.getpid()

    def _label(self) -> str:
        return f"pending table of segment {self._segment!r}"

    def _new_mode(self) -> Tuple[int, Optional[int]]:
        """(mode, group) of a new table: the segment's, when the segment is a regular file
        of a trusted owner (a group-shared fleet's table is shared the same way), else
        (0o600, None)."""
        try:
            ref = os.lstat(shm_path(self._segment))
        except OSError:
            return 0o600, None
        if not stat.S_ISREG(ref.st_mode) or (ref.st_uid != os.geteuid()
                                             and ref.st_uid not in self._trusted):
            return 0o600, None
        mode = stat.S_IMODE(ref.st_mode) & 0o666
        gid = ref.st_gid if mode & 0o070 and ref.st_gid != os.getegid() else None
        return mode, gid

    def _os_error(self, e: OSError) -> PendingTableError:
        if e.errno == errno.ELOOP:
            return self._error("symlink", "it is a symbolic link (never followed)")
        if e.errno == errno.EISDIR:
            return self._error("not_regular", "it is a directory")
        return self._error("os", f"{type(e).__name__}: {e}",
                           f"check {SHM_DIR}'s permissions, or remove {self.path}")

    def _check(self, fd: int, made: bool, bound: float) -> None:
        """Lay the table out if it has no header yet (under its lock), then check it.  The
        header (magic, slots, version) is written last, after the file has its size and its
        memory (``posix_fallocate``): a file without one was never finished -- its
        creator died, or is still at it -- and is finished here, under the lock, by
        whoever gets the lock first (laying out is idempotent)."""
        if self._checked(fd, os.fstat(fd), final=False):
            return                      # a finished table: the common case, no lock
        if not _lock_nb(fd, fcntl.LOCK_EX, bound):
            raise self._error("busy", f"a process held its lock for over {bound:g} s while "
                              "it was being laid out (a stopped process?)",
                              "resume or end that process, or remove the file")
        try:
            st = os.fstat(fd)
            if st.st_size in (0, _SIZE) and stat.S_ISREG(st.st_mode) and not any(
                    os.pread(fd, _HEADER, 0)):
                try:
                    os.posix_fallocate(fd, 0, _SIZE)    # no SIGBUS at a first store later
                except OSError as e:
                    if made:
                        os.unlink(self.path)            # ours: the next start tries again
                    if e.errno == errno.ENOSPC:
                        raise self._error(
                            "no_space", f"no room for its {_SIZE} bytes in {SHM_DIR} "
                            "(ENOSPC)", f"free or enlarge {SHM_DIR} (df -h {SHM_DIR})"
                        ) from None
                    raise self._os_error(e) from None
                os.pwrite(fd, _header(), 0)
                st = os.fstat(fd)
            self._checked(fd, st, final=True)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _checked(self, fd: int, st: os.stat_result, final: bool) -> bool:
        """Whether ``fd`` is a finished table; with ``final``, a PendingTableError if not."""
        if not stat.S_ISREG(st.st_mode):
            raise self._error("not_regular", f"not a regular file (mode {st.st_mode:#o})")
        if st.st_size != _SIZE:
            if not final:
                return False
            raise self._error("size", f"{st.st_size} bytes, expected {_SIZE}")
        head = os.pread(fd, _HEADER, 0)
        magic = int.from_bytes(head[0:8], "little")
        slots = int.from_bytes(head[8:12], "little")
        version = int.from_bytes(head[12:16], "little")
        if magic == _MAGIC and slots == SLOTS and version == VERSION:
            return True
        if not final:
            return False
        if magic != _MAGIC:
            raise self._error("garbage", f"magic {magic:#x}, expected {_MAGIC:#x}")
        raise self._error("version", f"format version {version} with {slots} slots, this "
                          f"shmkv reads version {VERSION} with {SLOTS} slots (another shmkv "
                          "version's table)",
                          "run one shmkv version per segment, or remove the file once the "
                          "other version's processes are gone")

    # ------------------------------------------------------------------ internals
    def _live(self, rec: np.void, now: float, alive: Dict[int, bool]) -> bool:
        """Whether ``rec`` is a mark (owner's lock held, deadline not passed and
        believable).  ``alive`` caches owners' answers for one operation."""
        exp = float(rec["expires"])
        if not (now < exp <= now + MAX_TTL):
            return False
        owner = int(rec["owner"])
        if owner == self._token:
            return True                 # our own lock: GETLK on our description sees none
        if not 0 < owner < 1 << _OWNER_BITS:
            return False
        if owner not in alive:
            alive[owner] = _owner_lock(self._fd, owner, fcntl.F_OFD_GETLK) != fcntl.F_UNLCK
        return alive[owner]

    def _find(self, key: int, now: float,
              alive: Dict[int, bool]) -> Tuple[int, int]:
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
                 alive: Dict[int, bool]) -> int:
        """How many leading ``keys`` other live owners mark (the lock is held)."""
        n = 0
        for key in keys:
            s, _ = self._find(int(key), now, alive)
            if s < 0 or self._mine(self._recs[s]) or not self._live(self._recs[s], now, alive):
                break
            n += 1
        return n

    @property
    def token(self) -> int:
        """This opener's owner token (the ``owner`` of its marks)."""
        return self._token

    def _mine(self, rec: np.void) -> bool:
        return int(rec["owner"]) == self._token

    # ------------------------------------------------------------------ the API
    def close(self) -> None:
        if self._fd >= 0:
            del self._recs
            try:
                self._mm.close()
            except BufferError:         # a caller still holds a view: unmapped with it
                pass
            os.close(self._fd)
            self._fd = -1

    def _lock(self, op: int) -> bool:
        """The table's lock within :attr:`timeout`; False (counted) if not had in time."""
        if self._fd < 0:
            raise ValueError(f"{self.path}: the pending marks are closed")
        if os.getpid() != self._pid:
            self._after_fork()
        if _lock_nb(self._fd, op, self.timeout):
            return True
        self.timeouts += 1
        return False

    def claim(self, keys: Sequence[int], ttl: float, eta: float = 0.0) -> int:
        """If ``keys[0]`` is marked by another live owner: the number of leading keys so
        marked, and nothing changes (the caller waits or computes).  Else 0, and every key
        not marked by another owner is now marked by this one for at least ``ttl`` seconds
        (one critical section: of several claims of one new prefix, exactly one gets 0) --
        unless the table's lock was not had within :attr:`timeout`: then 0 too (a miss:
        the caller computes), nothing is marked, and :attr:`timeouts` counts it.  ``eta``
        (``time.monotonic`` seconds; 0: none) is when this owner expects to have published
        the keys: written on every key it marks (a later estimate replaces an earlier one;
        0 leaves it), read by waiters through :meth:`eta`."""
        return self.claim_keys(keys, ttl, eta)[0]

    def claim_keys(self, keys: Sequence[int], ttl: float,
                   eta: float = 0.0) -> Tuple[int, List[int]]:
        """As :meth:`claim`: ``(held, the keys this owner marks now)``."""
        if not len(keys):
            return 0, []
        if not 0 < ttl <= MAX_TTL:
            raise ValueError(f"ttl: expected 0 < ttl <= {MAX_TTL}, got {ttl}")
        if not (eta == 0 or 0 < eta < 2 ** 40):     # seconds since boot; NaN fails both
            raise ValueError(f"eta: expected 0 or a time.monotonic() time, got {eta}")
        eta_us = int(eta * 1e6)
        if not self._lock(fcntl.LOCK_EX):
            return 0, []
        try:
            now = time.monotonic()
            alive: Dict[int, bool] = {}
            recs = self._recs
            held = self._leading(keys, now, alive)
            if held:
                return held, []
            mine: List[int] = []
            for key in keys:
                k = int(key)
                s, free = self._find(k, now, alive)
                if s >= 0 and self._live(recs[s], now, alive):
                    if not self._mine(recs[s]):
                        continue                    # another owner computes this one
                    # ours already (another request): keep the longer deadline
                    recs[s]["expires"] = max(float(recs[s]["expires"]), now + ttl)
                    if eta_us:
                        recs[s]["eta"] = eta_us
                    mine.append(k)
                    continue
                slot = s if s >= 0 else free
                if slot < 0:
                    continue                        # crowded: this key goes unmarked
                recs[slot] = (k, self._token, eta_us, now + ttl)
                mine.append(k)
            return 0, mine
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def held(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` other live owners mark (0: none; nothing changes).
        0 as well if the table's lock was not had within :attr:`timeout` (counted)."""
        if not len(keys):
            return 0
        if not self._lock(fcntl.LOCK_SH):
            return 0
        try:
            return self._leading(keys, time.monotonic(), {})
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def eta(self, keys: Sequence[int]) -> float:
        """When the owner of ``keys[0]``, if another live owner marks it, expects to have
        published it (``time.monotonic`` seconds), as that owner wrote it; 0.0 if it is
        not so marked, the owner gave no estimate, the estimate is not believable
        (more than :data:`MAX_TTL` away from now) or the lock was not had within
        :attr:`timeout` (counted).  A waiter's hint, never a promise: it bounds the wait
        by its own rules."""
        if not len(keys):
            return 0.0
        if not self._lock(fcntl.LOCK_SH):
            return 0.0
        try:
            now = time.monotonic()
            alive: Dict[int, bool] = {}
            s, _ = self._find(int(keys[0]), now, alive)
            rec = self._recs[s] if s >= 0 else None
            if rec is None or self._mine(rec) or not self._live(rec, now, alive):
                return 0.0
            eta = int(rec["eta"]) / 1e6
            return eta if abs(eta - now) <= MAX_TTL else 0.0
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def release(self, keys: Sequence[int]) -> int:
        """Drop this owner's marks on ``keys``; the number dropped (0 if the lock was not
        had within :attr:`timeout`, counted: the marks then expire at their deadline)."""
        if not len(keys):
            return 0
        if not self._lock(fcntl.LOCK_EX):
            return 0
        try:
            now = time.monotonic()
            alive: Dict[int, bool] = {}
            n = 0
            for key in keys:
                s, _ = self._find(int(key), now, alive)
                if s >= 0 and self._mine(self._recs[s]):
                    self._recs[s]["expires"] = 0.0      # the key stays: probe paths hold
                    self._recs[s]["owner"] = 0
                    n += 1
            return n
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def marks(self) -> List[Tuple[int, int, float]]:
        """Every live mark: ``(key, owner token, seconds left)`` (inspection, tests; this
        opener's token is :attr:`token`); empty if the
        lock was not had within :attr:`timeout` (counted)."""
        if not self._lock(fcntl.LOCK_SH):
            return []
        try:
            now = time.monotonic()
            alive: Dict[int, bool] = {}
            return [(int(r["key"]), int(r["owner"]), float(r["expires"]) - now)
                    for r in self._recs if int(r["key"]) and self._live(r, now, alive)]
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


class EngineMarks:
    """Pending marks for a serving engine (the vLLM connector's scheduler): nothing here
    raises or blocks past the bound.  A table that cannot be opened
    (:class:`PendingTableError`, ``OSError``) or an operation that fails turns the marks
    off with ONE warning on ``log`` naming the file, the cause and the fix; from then on
    (:attr:`on` false) every operation answers "no marks" -- the engine computes what it
    would have waited for, as without marks, and the rest of the cache stays on.  A lock
    not had within ``timeout`` answers "no marks" for that call only
    (:attr:`lock_timeouts`).

    The engine's requests share its marks: :meth:`claim` with a ``holder`` (a request id)
    counts the holders of each key, and :meth:`release` of a holder drops only the keys
    no other holder of this engine still claims (two local requests on one prefix: the
    first to finish leaves the other's marks)."""

    def __init__(self, segment: str, log: logging.Logger, timeout: float = LOCK_TIMEOUT,
                 open_timeout: float = OPEN_TIMEOUT, *, trusted_owners: Owners = None) -> None:
        self._log = log
        self._timeouts_at_off = 0
        self.marks: Optional[PendingMarks] = None
        self.off_reason: Optional[str] = None
        self._claims: Dict[object, set] = {}    # holder -> the keys it claimed
        self._holders: Dict[int, int] = {}      # key -> how many holders claim it
        try:
            self.marks = PendingMarks(segment, timeout=timeout, open_timeout=open_timeout,
                                      trusted_owners=trusted_owners)
        except PendingTableError as e:
            self._off(f"{e.path}: {e.cause}", e.fix)
        except (OSError, ValueError) as e:
            self._off(f"{_path_or(segment)}: {type(e).__name__}: {e}",
                      f"check that {SHM_DIR} is writable, or remove the file")

    @property
    def on(self) -> bool:
        return self.marks is not None

    @property
    def lock_timeouts(self) -> int:
        """Operations that answered "no marks" because the table's lock stayed held."""
        return self.marks.timeouts if self.marks is not None else self._timeouts_at_off

    def _off(self, cause: str, fix: str) -> None:
        self.off_reason = cause
        self._log.warning("shmkv: pending marks are OFF for this engine (%s); fix: %s.  The "
                          "shared cache stays on; a prefix another instance is computing is "
                          "computed here too", cause, fix)
        if self.marks is not None:
            self._timeouts_at_off = self.marks.timeouts
            m, self.marks = self.marks, None
            try:
                m.close()
            except Exception:           # closing a broken table: nothing more to lose
                pass

    def _failed(self, what: str, e: BaseException) -> None:
        path = self.marks.path if self.marks is not None else "the pending table"
        self._off(f"{path}: {what} failed ({type(e).__name__}: {e})",
                  f"remove {path} if it persists (new processes lay out a fresh one)")

    def held(self, keys: Sequence[int]) -> int:
        if self.marks is not None:
            try:
                return self.marks.held(keys)
            except Exception as e:
                self._failed("reading the marks", e)
        return 0

    def eta(self, keys: Sequence[int]) -> float:
        """As :meth:`PendingMarks.eta`; off: 0.0."""
        if self.marks is not None:
            try:
                return self.marks.eta(keys)
            except Exception as e:
                self._failed("reading the marks", e)
        return 0.0

    def claim(self, keys: Sequence[int], ttl: float, holder: object = None,
              eta: float = 0.0) -> int:
        """As :meth:`PendingMarks.claim`; off: 0, nothing marked.  With ``holder``, the
        keys marked are counted as that holder's (see the class docstring)."""
        if self.marks is not None:
            try:
                held, mine = self.marks.claim_keys(keys, ttl, eta)
            except Exception as e:
                self._failed("marking", e)
                return 0
            if holder is not None and mine:
                have = self._claims.setdefault(holder, set())
                for k in mine:
                    if k not in have:
                        have.add(k)
                        self._holders[k] = self._holders.get(k, 0) + 1
            return held
        return 0

    def claimed(self, holder: object) -> int:
        """How many keys ``holder`` claims."""
        return len(self._claims.get(holder, ()))

    def release(self, keys: Optional[Sequence[int]] = None, holder: object = None) -> int:
        """Drop marks: ``keys`` (this engine's, whoever claimed them), or with ``holder``
        every key that holder claimed and no other holder still does.  The number
        dropped; off: 0."""
        if holder is not None:
            drop = []
            for k in self._claims.pop(holder, ()):
                n = self._holders.get(k, 0) - 1
                if n > 0:
                    self._holders[k] = n
                else:
                    self._holders.pop(k, None)
                    drop.append(k)
            keys = drop if keys is None else list(keys) + drop
        if self.marks is not None and keys is not None and len(keys):
            try:
                return self.marks.release(keys)
            except Exception as e:
                self._failed("dropping marks", e)
        return 0

    def close(self) -> None:
        if self.marks is not None:
            m, self.marks = self.marks, None
            m.close()


def _path_or(segment: str) -> str:
    try:
        return pending_path(segment)
    except ValueError:
        return f"the pending table of {segment!r}"
