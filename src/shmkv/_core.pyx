# cython: language_level=3, binding=False
# binding=False: the methods of the cdef classes are method descriptors, which check
# self; Cython 3's cyfunctions do not (KVCache.unlink("name") crashed the interpreter).
"""shmkv._core: the handle's base -- the mapping, this process's attachment, the Segment
class that the method chain starts from -- and what every other module shares: the one
status -> exception translator, the crash-point and planted-bug switches, the C API of
_core.pxd.

Owns: the create/attach protocol (writes the whole segment once, in shmkv_seg_init, before
READY), process registration (writes proc slots, under pool_lock, through the kernels),
the process-local debug switches.  Every other shared field is written by the modules of
the method chain (_inspect, _prefix, _sequences, _kvdata), through the kernels.
KVCache (cache.py) subclasses the last of them.
"""
import os
import secrets
import threading
import time

import numpy as np

cimport numpy as cnp
from cpython.buffer cimport PyBUF_WRITABLE
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t
from libc.string cimport memset
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED

from shmkv._sizes cimport config_struct

from .config import CacheConfig
from ._sizes import DTYPES, HASHES, layout_of
from ._shmfile import create_file, open_file, resolve_group, resolve_owners, shm_path
from .errors import (CacheFullError, LockTimeout, SegmentError, SequenceNotFound,
                     ShmkvError)

cnp.import_array()

cdef extern from "<sys/mman.h>" nogil:
    int MAP_POPULATE

LAYOUT_VERSION = SHMKV_LAYOUT_VERSION
MAGIC = SHMKV_MAGIC
ABI_FINGERPRINT = shmkv_abi_fingerprint()
PAGE_SIZE = SHMKV_PAGE
CRASH_POINTS = tuple(SHMKV_CRASH_NAMES[i].decode() for i in range(1, SHMKV_NCRASH))
COUNTER_NAMES = tuple(SHMKV_COUNTER_NAMES[i].decode() for i in range(SHMKV_NCOUNTERS))

_DTYPE_NAMES = {code: name for name, (code, _) in DTYPES.items()}
_HASH_NAMES = {code: name for name, code in HASHES.items()}


# --------------------------------------------------------------------------------------
# status -> exception: the one translator
# --------------------------------------------------------------------------------------
_STATUS = {
    SHMKV_EFULL: (CacheFullError, "the block pool is exhausted"),
    SHMKV_ESEQFULL: (CacheFullError, "every sequence slot is taken"),
    SHMKV_ENOSEQ: (SequenceNotFound, "unknown or freed sequence"),
    SHMKV_ECORRUPT: (SegmentError, "the segment is corrupt"),
    SHMKV_ETIMEDOUT: (LockTimeout, "a lock stayed held past the wait bound"),
    SHMKV_ERANGE: (IndexError, "out of range"),
    SHMKV_ETOOLONG: (CacheFullError, "the sequence would exceed max_seq_len"),
    SHMKV_EPROCFULL: (CacheFullError, "the process table is full (max_procs)"),
    SHMKV_EINVAL: (ValueError, "invalid argument"),
    SHMKV_ENOTREADY: (SegmentError, "the segment is not ready (its creator may have died)"),
    SHMKV_EVERSION: (SegmentError, "incompatible layout version or ABI"),
    SHMKV_EBADMAGIC: (SegmentError, "not a shmkv segment (bad magic)"),
    SHMKV_ENOTOWNER: (ShmkvError, "owned by another live process"),
    SHMKV_EAGAIN: (ShmkvError, "busy"),
}


_SEGMENT_REASONS = {SHMKV_EBADMAGIC: "bad_magic", SHMKV_EVERSION: "incompatible",
                    SHMKV_ECORRUPT: "corrupt", SHMKV_ENOTREADY: "not_ready"}


cdef int raise_status(int st, str what) except -1:
    """The one translator: a kernel status -> the exception of the API contract."""
    if st in _SEGMENT_REASONS:
        raise SegmentError(f"{what}: {_STATUS[st][1]}", reason=_SEGMENT_REASONS[st])
    if st == SHMKV_ESYS:
        e = OSError(os.strerror(_errno()) if _errno() else "system call failed")
        raise OSError(f"{what}: {e}")
    exc, text = _STATUS.get(st, (ShmkvError, f"status {st}"))
    raise exc(f"{what}: {text}")


cdef extern from "<errno.h>":
    int errno
cdef inline int _errno():
    return errno


cdef int64_t sid_arg(object sid) except? -2:
    """A sequence id argument (any int, numpy integer) as int64; TypeError for another
    type, SequenceNotFound for one that no int64 holds (as_sid's slow path)."""
    if type(sid) is not int:
        if isinstance(sid, bool) or not isinstance(sid, (int, np.integer)):
            raise TypeError(f"sid: expected int, got {type(sid).__name__}")
        sid = int(sid)
    try:
        return <int64_t>sid
    except OverflowError:
        raise SequenceNotFound(f"sequence {sid}: unknown or freed sequence") from None


def _norm_name(name):
    """'llama' or '/llama' -> '/llama'; anything else is a ValueError/TypeError."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected str, got {type(name).__name__}")
    bare = name[1:] if name.startswith("/") else name
    if not bare or "/" in bare or "\0" in bare or len(bare.encode()) > 250:
        raise ValueError(
            "name: expected 1..250 bytes without '/' (a leading '/' is allowed), "
            f"got {name!r}")
    return "/" + bare


# --------------------------------------------------------------------------------------
# config <-> segment
# --------------------------------------------------------------------------------------
cdef object cfg_object(const shmkv_config_t *c):
    return CacheConfig(
        num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        num_blocks=c.num_blocks, block_size=c.block_size, dtype=_DTYPE_NAMES[c.dtype],
        max_seqs=c.max_seqs, max_seq_len=c.max_blocks_per_seq * c.block_size,
        max_procs=c.max_procs, hash=_HASH_NAMES[c.hash_algo],
        event_capacity=c.event_capacity)


def _open_existing(name, read_only, trusted=None):
    """A private fd of an existing segment (_shmfile.open_file: no link followed, a regular
    file, owned by this user or one in ``trusted``; None, _shmfile.ANY_OWNER: no owner
    rule, for the read-only inspectors).
    FileNotFoundError, PermissionError, UntrustedSegmentError or SegmentError."""
    fd, _ = open_file(shm_path(name), f"segment {name[1:]!r}", write=not read_only,
                      trusted=trusted)
    return fd


def _map_readonly(fd, name):
    """A read-only mapping of the whole segment behind fd (the readers that never attach:
    snapshot(), EventReader); SegmentError if it cannot hold even the header page."""
    size = os.fstat(fd).st_size
    if size < SHMKV_PAGE:
        raise SegmentError(f"{name}: {size} bytes, too small for a shmkv segment",
                           reason="not_ready" if size == 0 else "corrupt")
    return _Mapping.map(fd, size, False, False)


def _proc_start_time(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


# --------------------------------------------------------------------------------------
# the mapping: owns the address range; numpy views keep it alive
# --------------------------------------------------------------------------------------
cdef class _Mapping:
    def __cinit__(self):
        self.base = NULL
        self.size = 0

    @staticmethod
    cdef _Mapping map(int fd, uint64_t size, bint writable, bint populate):
        cdef _Mapping m = _Mapping.__new__(_Mapping)
        cdef int prot = PROT_READ | (PROT_WRITE if writable else 0)
        cdef int flags = MAP_SHARED | (MAP_POPULATE if populate else 0)
        cdef void *p
        with nogil:
            p = mmap(NULL, size, prot, flags, fd, 0)
        if p == MAP_FAILED:
            raise OSError(_errno(), f"mmap of {size} bytes failed: {os.strerror(_errno())}")
        m.base = <uint8_t *>p
        m.size = size
        m.writable = writable
        return m

    def __getbuffer__(self, Py_buffer *buf, int flags):
        if (flags & PyBUF_WRITABLE) and not self.writable:
            raise BufferError("read-only mapping")
        self.shape[0] = <Py_ssize_t>self.size
        self.strides[0] = 1
        buf.buf = self.base
        buf.obj = self
        buf.len = <Py_ssize_t>self.size
        buf.readonly = 0 if self.writable else 1
        buf.itemsize = 1
        buf.format = "B"
        buf.ndim = 1
        buf.shape = self.shape
        buf.strides = self.strides
        buf.suboffsets = NULL
        buf.internal = NULL

    def __releasebuffer__(self, Py_buffer *buf):
        pass

    def __dealloc__(self):
        if self.base != NULL:
            munmap(self.base, self.size)
            self.base = NULL


# --------------------------------------------------------------------------------------
# the attachment: one per (segment, process); handles share it
# --------------------------------------------------------------------------------------
cdef dict _attachments = {}          # (st_dev, st_ino) -> _Attachment, this process
_attach_lock = threading.RLock()


cdef class _Attachment:
    def __cinit__(self):
        self.fd = -1
        self.ctx.lock_fd = -1

    cdef int register(self) except -1:
        """Takes a process slot (and its liveness lock) for this process."""
        cdef shmkv_ctx_t *c = &self.ctx
        cdef int st
        cdef shmkv_recovery_t r
        pid = os.getpid()
        if c.lock_fd < 0:
            c.lock_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)
        pool_lock(c)
        try:
            st = shmkv_proc_register_locked(c, pid, _proc_start_time(pid))
            if st == SHMKV_EPROCFULL:
                st = shmkv_recover_dead_locked(c, &r)      # dead processes' slots back
                if st == SHMKV_OK:
                    st = shmkv_proc_register_locked(c, pid, _proc_start_time(pid))
        finally:
            shmkv_pool_unlock(c)
        if st != SHMKV_OK:
            raise_status(st, f"attach {self.name}")
        self.pid = pid
        return 0

    cdef int release(self) except -1:
        """The last handle of this process closed: leave the process table; our
        sequences that were not detached are freed now.  Nothing of any other process
        is touched (no recovery pass)."""
        cdef shmkv_ctx_t *c = &self.ctx
        with _attach_lock:
            if _attachments.get(self.key) is self:
                del _attachments[self.key]
        try:
            if c.proc_token != 0 and self.pid == os.getpid():
                pool_lock(c)
                try:
                    shmkv_proc_unregister_locked(c)
                finally:
                    shmkv_pool_unlock(c)
        finally:
            if c.lock_fd >= 0:
                os.close(c.lock_fd)
                c.lock_fd = -1
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
        return 0

    cdef void after_fork_child(self):
        # The liveness lock belongs to the parent's open file description: drop our copy
        # of the fd so the parent's death is seen, and register afresh on first use.
        if self.ctx.lock_fd >= 0:
            try:
                os.close(self.ctx.lock_fd)
            except OSError:
                pass
        self.ctx.lock_fd = -1
        self.ctx.proc_slot = SHMKV_NIL
        self.ctx.proc_token = 0
        self.pid = None


def _after_fork_child():
    for att in list(_attachments.values()):
        (<_Attachment>att).after_fork_child()

os.register_at_fork(after_in_child=_after_fork_child)


cdef uint64_t _create_seed(object hash_seed) except? 0:
    """The block-hash seed of a new segment: ``hash_seed``, else $SHMKV_HASH_SEED, else
    random.  Hosts that share a remote tier need one seed (it is in the tier's keys)."""
    if hash_seed is None:
        env = os.environ.get("SHMKV_HASH_SEED")
        if env:
            try:
                hash_seed = int(env, 0)
            except ValueError:
                raise ValueError(f"SHMKV_HASH_SEED: expected an int, got {env!r}") from None
    if hash_seed is None:
        return secrets.randbits(64) | 1
    if isinstance(hash_seed, bool) or not isinstance(hash_seed, int) \
            or not 0 < hash_seed < (1 << 64):
        raise ValueError(f"hash_seed: expected an int in [1, 2**64), got {hash_seed!r}")
    return <uint64_t>hash_seed


cdef _Attachment _open(str name, bint create, object cfg, int mode, bint populate,
                       double timeout, bint recover=True, object hash_seed=None,
                       object gid=None, object trusted=frozenset()):
    """Opens (or creates) the named segment and returns this process's attachment."""
    cdef shmkv_config_t ccfg
    cdef shmkv_layout_t lay
    cdef int st
    cdef uint64_t size
    cdef _Attachment att
    cdef _Mapping m
    cdef shmkv_recovery_t r
    if create:
        seed = _create_seed(hash_seed)
        ccfg = config_struct(cfg)
        if shmkv_layout_compute(&ccfg, &lay) != SHMKV_OK:
            raise ValueError(f"config: the segment would be too large: {cfg!r}")
        # O_EXCL, no link followed; the group, then exactly the mode (whatever the umask)
        fd = create_file(shm_path(name), f"segment {name[1:]!r}", mode, gid)
        try:
            os.ftruncate(fd, lay.segment_size)
            try:
                os.posix_fallocate(fd, 0, lay.segment_size)   # no SIGBUS later
            except OSError as e:
                raise OSError(e.errno, f"cannot reserve {lay.segment_size} bytes for "
                              f"{name!r} in /dev/shm: {e.strerror}") from None
            # tmpfs zero-fills fallocated pages at first touch: populating here pays
            # that once, at create, instead of on the first decode steps
            m = _Mapping.map(fd, lay.segment_size, True, populate)
            st = shmkv_seg_init(m.base, &ccfg, os.getpid(), time.time_ns(), seed)
            if st != SHMKV_OK:
                raise_status(st, f"create {name}")
        except BaseException:
            os.close(fd)
            try:
                os.unlink(shm_path(name))
            except OSError:
                pass
            raise
    else:
        fd = _open_existing(name, False, trusted)
        m = None
    try:
        stt = os.fstat(fd)
        key = (stt.st_dev, stt.st_ino)
        with _attach_lock:
            att = _attachments.get(key)
            if att is not None and att.fd >= 0:
                os.close(fd)
                att.refs += 1
                return att
        deadline = time.monotonic() + timeout
        while True:
            size = os.fstat(fd).st_size
            if m is None and size >= SHMKV_PAGE:
                m = _Mapping.map(fd, size, True, populate)
            if m is not None:
                att = _Attachment.__new__(_Attachment)
                st = shmkv_ctx_bind(&att.ctx, m.base, m.size, 0)
                if st == SHMKV_OK:
                    break
                if st != SHMKV_ENOTREADY:
                    raise_status(st, f"attach {name}")
                m = None
            else:
                st = SHMKV_ENOTREADY
            if time.monotonic() > deadline:
                raise SegmentError(
                    f"attach {name}: the segment is not ready after {timeout:g} s "
                    f"(size {size} bytes; its creator may have died while building it)",
                    reason="not_ready")
            time.sleep(0.005)
        att.mapping = m
        att.fd = fd
        att.key = key
        att.name = name
        att.refs = 1
        att.register()
        with _attach_lock:
            _attachments[key] = att
        if recover:
            # recovery on attach: whatever dead processes left behind is reclaimed now.
            # Its lock waits are bounded by `timeout` too.  A pass that fails (a lock not
            # had in time: LockTimeout; no memory: OSError; SegmentError) fails the
            # attach: this process leaves the table again, nothing stays attached, and the
            # caller knows the derived state was not rebuilt (recover=False skips the pass)
            saved = att.ctx.timeout_ns
            if timeout * 1e9 < saved:
                att.ctx.timeout_ns = <int64_t>(max(timeout, 0.001) * 1e9)
            try:
                pool_lock(&att.ctx)
                try:
                    st = shmkv_recover_locked(&att.ctx, &r)
                finally:
                    shmkv_pool_unlock(&att.ctx)
                if st != SHMKV_OK:
                    raise_status(st, f"attach {name}: the recovery pass failed")
            except BaseException:
                fd = -1                 # the attachment's now: release() closes it
                att.release()
                raise
            finally:
                att.ctx.timeout_ns = saved
        return att
    except BaseException:
        if fd >= 0 and (m is None or not (att is not None and att.fd == fd)):
            try:
                os.close(fd)
            except OSError:
                pass
        raise


# --------------------------------------------------------------------------------------
# Segment: the base of the handle's method chain (see _core.pxd); KVCache ends it
# --------------------------------------------------------------------------------------
cdef class Segment:
    def __cinit__(self):
        self._closed = True
        self.ctx = NULL

    cdef _bind(self, _Attachment att):
        self._att = att
        self.ctx = &att.ctx
        # the name as users write it and the CLI shows it ("llama-cache"): the leading "/"
        # of the POSIX name is the system's spelling (shm_open), kept in att.name
        self.name = att.name[1:]
        self.config = cfg_object(&att.ctx.cfg)
        self._dtype = self.config.numpy_dtype
        self._descr = self._dtype
        self._tokw = <int64_t>att.ctx.cfg.num_kv_heads * att.ctx.cfg.head_dim
        self._closed = False

    @classmethod
    def _create(cls, name, cfg, int mode=0o600, bint populate=True, double timeout=10.0,
                hash_seed=None, group=None):
        if not isinstance(cfg, CacheConfig):
            raise TypeError(f"config: expected CacheConfig, got {type(cfg).__name__}")
        if mode < 0 or mode > 0o777:
            raise ValueError(f"mode: expected 0 <= mode <= 0o777, got {oct(mode)}")
        gid = resolve_group(group)
        cdef Segment self = cls.__new__(cls)
        self._bind(_open(_norm_name(name), True, cfg, mode, populate, timeout, True,
                         hash_seed, gid))
        return self

    @classmethod
    def _attach(cls, name, bint populate=True, double timeout=10.0, bint recover=True,
                trusted_owners=None):
        trusted = resolve_owners(trusted_owners)
        cdef Segment self = cls.__new__(cls)
        self._bind(_open(_norm_name(name), False, None, 0, populate, timeout, recover,
                         None, None, trusted))
        return self

    cdef int _reopen(self) except -1:
        """ctx_of()'s slow path: a closed handle, or the first use after os.fork()."""
        if self._closed:
            raise ValueError(f"operation on a closed KVCache ({self.name})")
        if self.ctx.proc_token == 0:
            self._att.register()
        return 0

    # ---- lifetime ---------------------------------------------------------------------
    def close(self):
        """Detach this handle; idempotent.  The last handle of the process leaves the
        process table; the segment stays."""
        if self._closed:
            return
        self._closed = True
        att = self._att
        att.refs -= 1
        if att.refs == 0:
            att.release()

    def unlink(self):
        """Remove the segment's name.  Attached processes keep working.  A name that is
        gone, or that now names another segment, is left alone."""
        path = shm_path(self._att.name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) != self._att.key:
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        from .pending import unlink_pending     # the segment's pending marks go with it

        unlink_pending(self.name)

    @property
    def closed(self):
        return self._closed

    @property
    def lock_timeout(self):
        """Bound, in seconds, on every wait for a lock."""
        return self.ctx.timeout_ns / 1e9

    @lock_timeout.setter
    def lock_timeout(self, double seconds):
        if not seconds > 0:
            raise ValueError(f"lock_timeout: expected > 0 seconds, got {seconds}")
        self.ctx.timeout_ns = <int64_t>(seconds * 1e9)

    @property
    def lock_backoff(self):
        """Seconds this process waits for the pool lock no more after a wait for it ran
        out (``lock_timeout``): in that pause a call takes the lock if it is free and
        raises LockTimeout at once if it is still held.  0 (the default): every call waits
        up to ``lock_timeout``.  Process-wide for the segment (every handle of it here)."""
        return self.ctx.backoff_ns / 1e9

    @lock_backoff.setter
    def lock_backoff(self, double seconds):
        if not 0 <= seconds <= 3600:
            raise ValueError(f"lock_backoff: expected 0 <= seconds <= 3600, got {seconds}")
        self.ctx.backoff_until_ns = 0
        self.ctx.backoff_ns = <int64_t>(seconds * 1e9)

    @property
    def lock_timeouts(self):
        """Pool-lock waits of this process that ran out, or were refused in a
        ``lock_backoff`` pause (each a LockTimeout), since it attached the segment."""
        return self.ctx.lock_timeouts

    def __dealloc__(self):
        if not self._closed and self._att is not None:
            self._closed = True
            self._att.refs -= 1
            if self._att.refs == 0:
                try:
                    self._att.release()
                except BaseException:
                    pass



# --------------------------------------------------------------------------------------
# crash points and planted bugs: the switches live here, in shmkv_dbg_local of this
# module's copy of the kernels; every other module that compiles the kernels points its
# shmkv_dbg at them when it is imported (bind_debug_state(), _core.pxd)
# --------------------------------------------------------------------------------------
cdef shmkv_dbg_t *debug_state() noexcept:
    return &shmkv_dbg_local


def set_crash_point(name, long countdown=1, bint stop=False):
    """Arm a crash point in this process: the `countdown`-th time execution passes the
    named point, the process calls _exit(86) right there -- or, with `stop`, stops itself
    there (SIGSTOP: a holder of that point's locks that is alive but not running; after
    SIGCONT it goes on, disarmed).  None disarms.  For the chaos harness and the bounded
    waits' tests; see CRASH_POINTS.  Also armed from the environment at import:
    SHMKV_CRASH_POINT=name[:countdown]."""
    cdef int i = _switch(name, CRASH_POINTS, "crash point")
    if i and countdown < 1:
        raise ValueError(f"countdown: expected >= 1, got {countdown}")
    if i:
        debug_state().crash_countdown = countdown
    debug_state().crash_stop = stop
    debug_state().crash_id = i


PLANTED_BUGS = ("no_recovery", "early_publish", "no_cow", "leak_on_free", "torn_event")


def plant_bug(name):
    """Plant a known bug in this process, to prove the chaos harness catches it:
    'no_recovery' (recovery does nothing), 'early_publish' (append publishes the length
    before the data is copied), 'no_cow' (a shared partial block is written in place),
    'leak_on_free' (free keeps one block).  None removes it.  Also read from the
    environment at import: SHMKV_PLANT=name."""
    debug_state().plant = _switch(name, PLANTED_BUGS, "planted bug")


cdef int _switch(object name, tuple names, str what) except -1:
    """A switch's value: 0 for None, 1 + the index of a known name; ValueError else."""
    if name is None:
        return 0
    if name not in names:
        raise ValueError(f"{what}: expected one of {names}, got {name!r}")
    return names.index(name) + 1


def _arm_from_env():
    spec = os.environ.get("SHMKV_CRASH_POINT")
    if spec:
        name, _, n = spec.partition(":")
        set_crash_point(name, int(n) if n else 1)
    if os.environ.get("SHMKV_PLANT"):
        plant_bug(os.environ["SHMKV_PLANT"])

_arm_from_env()


# --------------------------------------------------------------------------------------
# The C API of _core for sibling extension modules (declared in _core.pxd)
# --------------------------------------------------------------------------------------
cdef shmkv_ctx_t *segment_ctx(object seg) except NULL:
    """The context of an open Segment (registering this process on first use)."""
    if not isinstance(seg, Segment):
        raise TypeError(f"cache: expected a KVCache, got {type(seg).__name__}")
    return ctx_of(<Segment>seg)


cdef int lock_seqs(shmkv_ctx_t *c, const int64_t *sids, Py_ssize_t n,
                   uint32_t *slots, uint32_t *lens) except -1:
    """Takes the sequence lock of each of sids[0..n) -- DISTINCT ids, sorted by the caller
    in ascending slot order (sid % max_seqs), the one lock order of batch readers -- and
    reads each length (checked against the table: never trust the segment).  On any error
    every lock taken is released and the error raised; nothing else changes."""
    cdef Py_ssize_t i = 0, j
    try:
        while i < n:
            seq_lock(c, sids[i], &slots[i])
            i += 1
            lens[i - 1] = <uint32_t>valid_len(c, slots[i - 1], sids[i - 1])
    except BaseException:
        for j in range(i):
            shmkv_seq_unlock(c, slots[j])
        raise
    return 0


cdef void unlock_seqs(shmkv_ctx_t *c, const uint32_t *slots, Py_ssize_t n) noexcept:
    cdef Py_ssize_t i
    for i in range(n):
        shmkv_seq_touch(c, slots[i])
        shmkv_seq_unlock(c, slots[i])
