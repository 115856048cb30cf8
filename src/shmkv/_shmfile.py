"""The files shmkv keeps in ``/dev/shm`` (a segment ``NAME``, its ``NAME.pending`` table):
how they are created and opened, and whose files shmkv agrees to use.

**Opening** is ``os.open("/dev/shm/NAME")`` (what glibc's ``shm_open`` does) with
``O_NOFOLLOW`` (a symbolic link at the name is refused, never followed), ``O_NONBLOCK`` (a
FIFO planted at the name cannot hang the open) and ``O_CLOEXEC``, then ``fstat`` of the
descriptor: it must be a regular file, owned by this process's effective uid or by a uid
the caller trusts.  The check is on the open file, not on the name, so nothing can be
swapped in between the check and the use.  Being root is no reason to trust another
user's file: root gets the same rule.

**Creating** is ``O_CREAT | O_EXCL | O_NOFOLLOW`` with mode 0o600 (an existing name, a
link included, is ``FileExistsError``), then ``fchown`` to the group asked for, then
``fchmod`` to the mode asked for (exact whatever the umask): the file is never open to a
group or a mode it was not meant for, not even for a moment.

The owner rule is the whole rule: the mode of a file I own (or a trusted user owns) is its
owner's choice, and another user cannot change it (``chmod`` is the owner's or root's).
"""
from __future__ import annotations

import errno
import fcntl
import grp
import os
import pwd
import stat
import struct
from typing import Iterable, Optional, Tuple, Union

from .errors import SegmentError, UntrustedSegmentError

__all__ = ["SHM_DIR", "ANY_OWNER", "shm_path", "resolve_owners", "resolve_group",
           "owner_str", "open_file", "create_file", "open_or_create", "check_owner",
           "ofd_lock"]

SHM_DIR = "/dev/shm"
ANY_OWNER = None        # ``trusted=ANY_OWNER``: read-only inspection, no owner rule

Owners = Union[None, int, str, Iterable[Union[int, str]]]


# struct flock: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid
# (x86-64 and aarch64 Linux)
_FLOCK = struct.Struct("hhqqi4x")


def ofd_lock(fd: int, cmd: int, start: int = 0, length: int = 0) -> int:
    """``fcntl(fd, cmd)`` with an open-file-description write lock on bytes ``[start,
    start + length)`` (``length`` 0: to the end of any file); ``cmd`` is ``F_OFD_SETLK`` or
    ``F_OFD_GETLK``.  Returns the ``l_type`` the kernel answers (for GETLK, ``F_UNLCK``:
    nobody else holds a lock there).  OFD locks belong to the open file, not the process:
    they hold across PID namespaces and threads, and go when the last descriptor of that
    open closes (the process's death included)."""
    arg = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
    return _FLOCK.unpack(fcntl.fcntl(fd, cmd, arg))[0]


def shm_path(name: str) -> str:
    """``/dev/shm/NAME`` for ``NAME`` or ``/NAME`` (checked by the caller)."""
    return os.path.join(SHM_DIR, name.lstrip("/"))


def _uid_of(x: Union[int, str]) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, str)):
        raise TypeError(f"trusted_owners: expected user names or uids, got {x!r}")
    if isinstance(x, str):
        x = x.strip()
        if x.isdigit():
            x = int(x)
        else:
            try:
                return pwd.getpwnam(x).pw_uid
            except KeyError:
                raise ValueError(f"trusted_owners: no user named {x!r} on this host") from None
    if x < 0:
        raise ValueError(f"trusted_owners: expected a uid >= 0, got {x}")
    return x


def resolve_owners(owners: Owners) -> frozenset:
    """The uids of ``owners``: None (nobody else), a user name or uid, an iterable of
    them, or a string of them separated by commas (``"alice,1001"``)."""
    if owners is None:
        return frozenset()
    if isinstance(owners, str):
        owners = [p for p in owners.split(",") if p.strip()]
    elif isinstance(owners, int):
        owners = [owners]
    return frozenset(_uid_of(x) for x in owners)


def resolve_group(group: Union[None, int, str]) -> Optional[int]:
    """The gid of ``group`` (a group name or gid), None for none."""
    if group is None:
        return None
    if isinstance(group, bool) or not isinstance(group, (int, str)):
        raise TypeError(f"group: expected a group name or gid, got {group!r}")
    if isinstance(group, str):
        if not group.strip().isdigit():
            try:
                return grp.getgrnam(group.strip()).gr_gid
            except KeyError:
                raise ValueError(f"group: no group named {group!r} on this host") from None
        group = int(group)
    if group < 0:
        raise ValueError(f"group: expected a gid >= 0, got {group}")
    return group


def owner_str(uid: int) -> str:
    """``"nobody (uid 65534)"``, or ``"uid 1234"`` for a uid without a name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a regular file"


def _not_a_file(path: str, label: str, mode: int) -> SegmentError:
    return SegmentError(f"{label}: {path} is {_kind(mode)}, not a regular file (shmkv "
                        "opens only regular files and never follows a link)",
                        reason="not_a_file")


def check_owner(st: os.stat_result, path: str, label: str,
                trusted: Optional[frozenset]) -> None:
    """UntrustedSegmentError unless the file's owner is this process's euid or in
    ``trusted`` (``ANY_OWNER``: no rule)."""
    if trusted is ANY_OWNER or st.st_uid == os.geteuid() or st.st_uid in trusted:
        return
    raise UntrustedSegmentError(
        f"{label}: {path} is owned by {owner_str(st.st_uid)}, not by this process's user "
        f"{owner_str(os.geteuid())} (mode {stat.S_IMODE(st.st_mode):#o}); shmkv uses "
        f"another user's file only if told to trust that user "
        f"(trusted_owners=[{pwd_name(st.st_uid)!r}], connector key \"trusted_owners\"); "
        f"else remove it or pick another name")


def pwd_name(uid: int) -> Union[str, int]:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return uid


def open_file(path: str, label: str, *, write: bool = True,
              trusted: Optional[frozenset] = frozenset()) -> Tuple[int, os.stat_result]:
    """(fd, fstat) of the existing shmkv file ``path``, checked (module docstring).

    FileNotFoundError if absent; SegmentError (reason "not_a_file") for a link, a directory,
    a FIFO...; UntrustedSegmentError for another user's file; PermissionError (naming the
    owner and the mode) if the system refuses the open."""
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK \
        | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileNotFoundError(f"{label} does not exist ({path})") from None
    except OSError as e:
        try:
            lst = os.lstat(path)
        except OSError:
            raise e from None
        if not stat.S_ISREG(lst.st_mode):
            raise _not_a_file(path, label, lst.st_mode) from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise PermissionError(
                f"{label}: permission denied: {path} is owned by "
                f"{owner_str(lst.st_uid)}, group {lst.st_gid}, mode "
                f"{stat.S_IMODE(lst.st_mode):#o} ({'read-write' if write else 'read'} "
                f"access needed)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_a_file(path, label, st.st_mode)
        check_owner(st, path, label, trusted)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def create_file(path: str, label: str, mode: int = 0o600, gid: Optional[int] = None) -> int:
    """A new file at ``path`` (O_EXCL: FileExistsError if the name exists, as anything),
    given group ``gid`` (if not None) and then exactly ``mode``."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except FileExistsError:
        raise FileExistsError(f"{label} already exists ({path})") from None
    try:
        if gid is not None:
            try:
                os.fchown(fd, -1, gid)
            except PermissionError:
                raise PermissionError(
                    f"{label}: cannot give {path} to group {gid}: this process's user "
                    "is not a member of it") from None
        os.fchmod(fd, mode)                     # exact, whatever the umask
    except BaseException:
        os.close(fd)
        _unlink_quiet(path)
        raise
    return fd


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def open_or_create(path: str, label: str, trusted: frozenset, *,
                   like: Optional[str] = None) -> Tuple[int, bool]:
    """(fd, created) of the file at ``path``: opened (checked as :func:`open_file`), or
    created when absent.  A new file takes the mode and group of the file ``like`` (the
    segment, for its pending table) when that one is a regular file of a trusted owner,
    else mode 0o600."""
    for _ in range(8):              # each turn lost a create/unlink race with another process
        try:
            fd, _st = open_file(path, label, trusted=trusted)
            return fd, False
        except FileNotFoundError:
            pass
        mode, gid = 0o600, None
        if like is not None:
            try:
                ref = os.lstat(like)
            except OSError:
                ref = None
            if ref is not None and stat.S_ISREG(ref.st_mode) and (
                    ref.st_uid == os.geteuid() or ref.st_uid in trusted):
                mode = stat.S_IMODE(ref.st_mode)
                gid = ref.st_gid if mode & 0o070 and ref.st_gid != os.getegid() else None
        try:
            return create_file(path, label, mode, gid), True
        except FileExistsError:
            continue
    raise OSError(errno.EAGAIN, f"{label}: {path} kept appearing and vanishing", path)
