"""The trust rule: shmkv uses a file in /dev/shm (a segment, its pending table) only if it
is a regular file (no link followed) owned by the caller's user or one the caller trusts;
root gets the same rule.  New files: O_EXCL, mode and group as asked.

The other user is real: ``nobody`` (uid 65534) creates and attaches segments in a process
that dropped root's privileges (workers/trust_workers.py), or is given root's files with
``os.chown``; so these tests need root (CI runs as root)."""
import grp
import json
import os
import socket
import stat
import subprocess
import sys

import pytest
from support import SMALL, unique_name

import shmkv
from shmkv.pending import PendingMarks, pending_path

NOBODY = 65534
SHM = "/dev/shm"
WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers",
                       "trust_workers.py")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="making another user's file needs root (CI runs as root)")


def cfg():
    return shmkv.CacheConfig(**SMALL)


def as_nobody(*args):
    """Runs workers/trust_workers.py, which becomes uid/gid 65534 (no supplementary groups)
    before its shmkv call; its JSON."""
    p = subprocess.run([sys.executable, WORKERS, *args], cwd="/tmp", capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def remove(path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    (os.rmdir if stat.S_ISDIR(st.st_mode) else os.unlink)(path)


@pytest.fixture
def names():
    """names() -> a fresh segment name; its /dev/shm entries (segment and pending table,
    whatever they are) are removed at teardown."""
    made = []

    def make():
        made.append(unique_name("trust"))
        return made[-1]

    try:
        yield make
    finally:
        for n in made:
            remove(os.path.join(SHM, n))
            remove(pending_path(n))


def other_group():
    """A group that is not root's: nogroup if there is one."""
    try:
        return grp.getgrnam("nogroup").gr_gid
    except KeyError:
        return next(g.gr_gid for g in grp.getgrall() if g.gr_gid != 0)


# ------------------------------------------------------------------ another user's segment
def test_root_refuses_a_segment_another_user_created(names):
    """Without the owner check root attached it without a word."""
    name = names()
    assert as_nobody("create", name, "666") == {"ok": True}
    st = os.stat(os.path.join(SHM, name))
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, 0o666)
    with pytest.raises(shmkv.UntrustedSegmentError) as ei:
        shmkv.KVCache.attach(name)
    msg = str(ei.value)
    assert "nobody (uid 65534)" in msg and "mode 0o666" in msg and "trusted_owners" in msg
    assert isinstance(ei.value, PermissionError) and isinstance(ei.value, shmkv.ShmkvError)
    # open() neither attaches it nor replaces it
    with pytest.raises(shmkv.UntrustedSegmentError):
        shmkv.KVCache.open(name, cfg())
    assert os.stat(os.path.join(SHM, name)).st_ino == st.st_ino


@pytest.mark.parametrize("trust", ["nobody", NOBODY, [NOBODY], "root,nobody", ("65534",)])
def test_a_trusted_owner_is_attached(names, trust):
    name = names()
    assert as_nobody("create", name, "666") == {"ok": True}
    with shmkv.KVCache.attach(name, trusted_owners=trust) as kv:
        assert kv.config == cfg()
        sid = kv.create_sequence()
        assert kv.sequences() == [sid]
    with shmkv.KVCache.open(name, cfg(), trusted_owners=trust) as kv:
        assert kv.check() == []


def test_chowned_segment_is_refused_and_trusting_another_user_does_not_help(names):
    name = names()
    shmkv.KVCache.create(name, cfg(), mode=0o640).close()
    os.chown(os.path.join(SHM, name), NOBODY, -1)
    with pytest.raises(shmkv.UntrustedSegmentError, match=r"nobody \(uid 65534\).*0o640"):
        shmkv.KVCache.attach(name)
    with pytest.raises(shmkv.UntrustedSegmentError):
        shmkv.KVCache.attach(name, trusted_owners=["daemon"])
    shmkv.KVCache.attach(name, trusted_owners="nobody").close()


def test_bad_trusted_owners_are_named(names):
    name = names()
    shmkv.KVCache.create(name, cfg()).close()
    with pytest.raises(ValueError, match="no user named 'no-such-user-x'"):
        shmkv.KVCache.attach(name, trusted_owners=["no-such-user-x"])
    with pytest.raises(TypeError, match="user names or uids"):
        shmkv.KVCache.attach(name, trusted_owners=[1.5])
    with pytest.raises(ValueError, match="uid >= 0"):
        shmkv.KVCache.attach(name, trusted_owners=-1)


def test_another_user_cannot_attach_a_private_segment(names):
    """Mode 0o600 (the default): nobody's open is refused by the system."""
    name = names()
    shmkv.KVCache.create(name, cfg()).close()
    got = as_nobody("attach", name)
    assert got["ok"] is False and got["permission"] and got["type"] == "PermissionError"
    assert "root (uid 0)" in got["msg"] and "0o600" in got["msg"]


def test_a_group_member_attaches_only_trusting_the_owner(names):
    """Group-shared: mode 0o660 and nobody's group; nobody can open it, and still
    refuses it unless it trusts its owner (root)."""
    name = names()
    shmkv.KVCache.create(name, cfg(), mode=0o660, group=NOBODY).close()
    got = as_nobody("attach", name)
    assert got["ok"] is False and got["type"] == "UntrustedSegmentError"
    assert "root (uid 0)" in got["msg"] and "0o660" in got["msg"]
    assert as_nobody("attach", name, "root") == {"ok": True}


# ------------------------------------------------------------------ not a regular file
def test_a_symlink_at_the_name_is_never_followed(names):
    real, link, dangling = names(), names(), names()
    shmkv.KVCache.create(real, cfg()).close()
    os.symlink(os.path.join(SHM, real), os.path.join(SHM, link))
    with pytest.raises(shmkv.SegmentError, match="symbolic link") as ei:
        shmkv.KVCache.attach(link)
    assert ei.value.reason == "not_a_file"
    with pytest.raises(FileExistsError):
        shmkv.KVCache.create(link, cfg())
    # a dangling link: create does not make its target
    target = os.path.join(SHM, unique_name("target"))
    os.symlink(target, os.path.join(SHM, dangling))
    with pytest.raises(FileExistsError):
        shmkv.KVCache.create(dangling, cfg())
    assert not os.path.lexists(target)


@pytest.mark.parametrize("kind", ["directory", "FIFO", "socket"])
def test_a_directory_fifo_or_socket_at_the_name_is_refused(names, kind):
    name = names()
    path = os.path.join(SHM, name)
    if kind == "directory":
        os.mkdir(path)
    elif kind == "FIFO":
        os.mkfifo(path)
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.close()
    with pytest.raises(shmkv.SegmentError, match=f"is a {kind}") as ei:
        shmkv.KVCache.attach(name)
    assert ei.value.reason == "not_a_file"
    with pytest.raises(FileExistsError):
        shmkv.KVCache.create(name, cfg())


def test_create_refuses_an_existing_name(names):
    name = names()
    shmkv.KVCache.create(name, cfg()).close()
    ino = os.stat(os.path.join(SHM, name)).st_ino
    with pytest.raises(FileExistsError, match="already exists"):
        shmkv.KVCache.create(name, cfg())
    assert os.stat(os.path.join(SHM, name)).st_ino == ino


# ------------------------------------------------------------------ mode and group
def test_mode_and_group_go_to_the_segment_and_its_pending_table(names):
    name = names()
    gid = other_group()
    with shmkv.KVCache.create(name, cfg(), mode=0o660, group=grp.getgrgid(gid).gr_name):
        st = os.stat(os.path.join(SHM, name))
        assert (stat.S_IMODE(st.st_mode), st.st_gid, st.st_uid) == (0o660, gid, 0)
        marks = PendingMarks(name)
        try:
            pt = os.stat(pending_path(name))
        finally:
            marks.close()
        assert (stat.S_IMODE(pt.st_mode), pt.st_gid) == (0o660, gid)


def test_default_mode_is_private_whatever_the_umask(names):
    name = names()
    old = os.umask(0)
    try:
        shmkv.KVCache.create(name, cfg()).close()
        PendingMarks(name).close()
    finally:
        os.umask(old)
    for p in (os.path.join(SHM, name), pending_path(name)):
        st = os.stat(p)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o600, 0)


def test_an_unknown_group_creates_nothing(names):
    name = names()
    with pytest.raises(ValueError, match="no group named 'no-such-group-x'"):
        shmkv.KVCache.create(name, cfg(), group="no-such-group-x")
    assert not os.path.lexists(os.path.join(SHM, name))


# ------------------------------------------------------------------ the pending table
def test_pending_table_of_another_user_is_refused(names):
    name = names()
    shmkv.KVCache.create(name, cfg()).close()
    PendingMarks(name).close()
    os.chown(pending_path(name), NOBODY, -1)
    with pytest.raises(shmkv.UntrustedSegmentError, match=r"nobody \(uid 65534\).*0o600"):
        PendingMarks(name)
    PendingMarks(name, trusted_owners=["nobody"]).close()


def test_pending_table_symlink_is_refused(names):
    name, other = names(), names()
    shmkv.KVCache.create(name, cfg()).close()
    PendingMarks(other).close()
    os.symlink(pending_path(other), pending_path(name))
    with pytest.raises(shmkv.SegmentError, match="symbolic link"):
        PendingMarks(name)


# ------------------------------------------------------------------ the CLI
def cli(*args):
    r = subprocess.run([sys.executable, "-m", "shmkv", *map(str, args)], cwd="/tmp",
                       capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def test_cli_create_group_and_recover_trust(names):
    name = names()
    r = cli("create", name, "--layers", 2, "--kv-heads", 2, "--head-dim", 8, "--blocks", 64,
            "--mode", "660", "--group", "nogroup")
    assert r.returncode == 0, r.stderr
    st = os.stat(os.path.join(SHM, name))
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, grp.getgrnam("nogroup").gr_gid)
    os.chown(os.path.join(SHM, name), NOBODY, -1)
    r = cli("recover", name)
    assert r.returncode == 2 and r.stdout == ""
    assert "nobody (uid 65534)" in r.stderr and "0o660" in r.stderr and "--trust" in r.stderr
    assert cli("recover", name, "--trust", "nobody").returncode == 0
    r = cli("check", name, "--trust", "no-such-user-x")
    assert r.returncode == 2 and "no user named 'no-such-user-x'" in r.stderr


def test_cli_lists_a_fifo_at_a_name_without_hanging(names):
    name = names()
    os.mkfifo(os.path.join(SHM, name))
    r = cli("info", name)
    assert r.returncode == 2 and "is a FIFO" in r.stderr
