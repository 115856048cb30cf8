# cython: language_level=3
"""shmkv._core: the mapped segment, its locks, and the Python-facing kernels.

The C kernels (kernels/kernels.h) do every critical section; this module checks arguments,
takes locks (trying first with the GIL, blocking only without it), releases the GIL
around every byte copy, and translates status codes into the exceptions of
shared/API.md.  KVCache (cache.py) subclasses Segment and adds the constructors.
"""
import hashlib
import os
import secrets
import threading
import time

import numpy as np
import posix_ipc

cimport numpy as cnp
from cpython.buffer cimport PyBUF_WRITABLE
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t, INT64_MAX
from libc.stdlib cimport malloc, free
from libc.string cimport memset, memcpy
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED

from .config import CacheConfig, DTYPES, HASHES
from .errors import (CacheFullError, LockTimeout, SegmentError, SequenceNotFound,
                     ShmkvError)

cnp.import_array()

cdef extern from "<sys/mman.h>" nogil:
    int MAP_POPULATE

cdef extern from "<time.h>" nogil:
    int CLOCK_REALTIME
    int CLOCK_MONOTONIC

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


cdef int _raise(int st, str what) except -1:
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


cdef inline int _pool_lock(shmkv_ctx_t *c) except -1:
    """Takes the pool lock: one try with the GIL, then a bounded wait without it."""
    cdef int st = shmkv_pool_trylock(c)
    if st == SHMKV_EAGAIN:
        with nogil:
            st = shmkv_pool_lock(c)
    if st != SHMKV_OK:
        _raise(st, "pool lock")
    return 0


cdef inline int _seq_lock(shmkv_ctx_t *c, int64_t sid, uint32_t *slot) except -1:
    cdef int st = shmkv_seq_trylock(c, sid, slot)
    if st == SHMKV_EAGAIN:
        with nogil:
            st = shmkv_seq_lock(c, sid, slot)
    if st != SHMKV_OK:
        _raise(st, f"sequence {sid}")
    return 0


cdef inline int64_t _as_sid(object sid) except? -2:
    if type(sid) is not int:
        if isinstance(sid, bool) or not isinstance(sid, (int, np.integer)):
            raise TypeError(f"sid: expected int, got {type(sid).__name__}")
        sid = int(sid)
    try:
        return <int64_t>sid
    except OverflowError:
        raise SequenceNotFound(f"sequence {sid}: unknown or freed sequence") from None


_POLICIES = {"lru": SHMKV_C_EVICT_LRU, "lfu": SHMKV_C_EVICT_LRU + 1,
             "longest": SHMKV_C_EVICT_LRU + 2, "priority": SHMKV_C_EVICT_LRU + 3}


cdef cnp.ndarray _as_ids(object tokens, int64_t n):
    """Token ids as a contiguous int32 array (of length n when n >= 0)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-d sequence of ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"tokens: expected integer token ids, got dtype {arr.dtype}")
    if n >= 0 and arr.shape[0] != n:
        raise ValueError(f"tokens: expected {n} ids (one per token added), got {arr.shape[0]}")
    if arr.size and (arr.min() < 0 or arr.max() > 0x7fffffff):
        raise ValueError(f"tokens: expected ids in [0, 2**31), got [{arr.min()}, {arr.max()}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


cdef int _salt_digest(object salt, uint64_t *out) except -1:
    out[0] = out[1] = 0
    if salt is None:
        return 0
    if isinstance(salt, str):
        salt = salt.encode()
    if not isinstance(salt, bytes):
        raise TypeError(f"salt: expected str or bytes, got {type(salt).__name__}")
    d = hashlib.blake2b(salt, digest_size=16, person=b"shmkv-salt").digest()
    out[0] = int.from_bytes(d[:8], "little")
    out[1] = int.from_bytes(d[8:], "little") | 2      # never the index's reserved keys
    return 0


cdef bytes _pack2(object h):
    return int(h[0]).to_bytes(8, "little") + int(h[1]).to_bytes(8, "little")


cdef tuple _sha_block(uint64_t seed, bytes parent, const uint64_t *extra, bytes toks):
    """The sha256 block hash: sha256(seed | parent hash | salt digest (block 0) | ids),
    truncated to 128 bits."""
    m = hashlib.sha256(seed.to_bytes(8, "little"))
    m.update(parent)
    if extra != NULL:
        m.update(_pack2((extra[0], extra[1])))
    m.update(toks)
    d = m.digest()
    h0 = int.from_bytes(d[:8], "little")
    h1 = int.from_bytes(d[8:16], "little")
    if h0 == 0 and h1 <= 1:
        h1 = 2
    return (h0, h1)


cdef int64_t _count_arg(object x, str what) except -1:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{what}: expected int, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{what}: expected >= 0, got {x}")
    return <int64_t>min(x, 1 << 40)


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
cdef shmkv_config_t _cfg_struct(cfg) except *:
    cdef shmkv_config_t c
    memset(&c, 0, sizeof(c))
    c.num_layers = cfg.num_layers
    c.num_kv_heads = cfg.num_kv_heads
    c.head_dim = cfg.head_dim
    c.block_size = cfg.block_size
    c.num_blocks = cfg.num_blocks
    c.max_seqs = cfg.max_seqs
    c.max_blocks_per_seq = cfg.max_seq_len // cfg.block_size
    c.max_procs = cfg.max_procs
    c.dtype, c.itemsize = DTYPES[cfg.dtype]
    c.hash_algo = HASHES[cfg.hash]
    return c


cdef object _cfg_object(const shmkv_config_t *c):
    return CacheConfig(
        num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        num_blocks=c.num_blocks, block_size=c.block_size, dtype=_DTYPE_NAMES[c.dtype],
        max_seqs=c.max_seqs, max_seq_len=c.max_blocks_per_seq * c.block_size,
        max_procs=c.max_procs, hash=_HASH_NAMES[c.hash_algo])


def _open_existing(name, read_only):
    """A private fd of an existing segment; FileNotFoundError or PermissionError."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=read_only)
    except posix_ipc.ExistentialError:
        raise FileNotFoundError(f"segment {name!r} does not exist") from None
    except posix_ipc.PermissionsError as e:
        raise PermissionError(f"segment {name!r}: {e}") from None
    fd = os.dup(shm.fd)
    shm.close_fd()
    return fd


cdef dict _layout_dict(const shmkv_layout_t *l):
    return dict(token_bytes=l.token_bytes, block_bytes=l.block_bytes,
                layer_stride=l.layer_stride, index_capacity=l.index_capacity,
                off_blocks=l.off_blocks, off_free=l.off_free, off_procs=l.off_procs,
                off_seqs=l.off_seqs, off_seq_free=l.off_seq_free, off_tables=l.off_tables,
                off_tokens=l.off_tokens, off_index=l.off_index, off_kpool=l.off_kpool, off_vpool=l.off_vpool,
                segment_size=l.segment_size)


def layout_of(cfg):
    """The region layout (sizes and offsets, in bytes) a config gives; ValueError if the
    C layout rejects it."""
    cdef shmkv_config_t c = _cfg_struct(cfg)
    cdef shmkv_layout_t l
    if shmkv_layout_compute(&c, &l) != SHMKV_OK:
        raise ValueError(
            "config: the segment would be too large (over 2^48 bytes) or a field is out "
            f"of range: {cfg!r}")
    return _layout_dict(&l)


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
    cdef uint8_t *base
    cdef uint64_t size
    cdef bint writable
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

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
    cdef shmkv_ctx_t ctx
    cdef _Mapping mapping
    cdef object key
    cdef object name
    cdef int fd
    cdef int refs
    cdef object pid

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
        _pool_lock(c)
        try:
            st = shmkv_proc_register_locked(c, pid, _proc_start_time(pid))
            if st == SHMKV_EPROCFULL:
                st = shmkv_recover_locked(c, &r)
                if st == SHMKV_OK:
                    st = shmkv_proc_register_locked(c, pid, _proc_start_time(pid))
        finally:
            shmkv_pool_unlock(c)
        if st != SHMKV_OK:
            _raise(st, f"attach {self.name}")
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
                _pool_lock(c)
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


cdef _Attachment _open(str name, bint create, object cfg, int mode, bint populate,
                       double timeout, bint recover=True):
    """Opens (or creates) the named segment and returns this process's attachment."""
    cdef shmkv_config_t ccfg
    cdef shmkv_layout_t lay
    cdef int st
    cdef uint64_t size
    cdef _Attachment att
    cdef _Mapping m
    cdef shmkv_recovery_t r
    if create:
        ccfg = _cfg_struct(cfg)
        if shmkv_layout_compute(&ccfg, &lay) != SHMKV_OK:
            raise ValueError(f"config: the segment would be too large: {cfg!r}")
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode)
        except posix_ipc.ExistentialError:
            raise FileExistsError(f"segment {name!r} already exists") from None
        fd = os.dup(shm.fd)
        shm.close_fd()
        try:
            os.fchmod(fd, mode)                         # exact, whatever the umask
            os.ftruncate(fd, lay.segment_size)
            try:
                os.posix_fallocate(fd, 0, lay.segment_size)   # no SIGBUS later
            except OSError as e:
                raise OSError(e.errno, f"cannot reserve {lay.segment_size} bytes for "
                              f"{name!r} in /dev/shm: {e.strerror}") from None
            # tmpfs zero-fills fallocated pages at first touch: populating here pays
            # that once, at create, instead of on the first decode steps
            m = _Mapping.map(fd, lay.segment_size, True, populate)
            st = shmkv_seg_init(m.base, &ccfg, os.getpid(), time.time_ns(),
                                secrets.randbits(64))
            if st != SHMKV_OK:
                _raise(st, f"create {name}")
        except BaseException:
            os.close(fd)
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass
            raise
    else:
        fd = _open_existing(name, False)
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
                    _raise(st, f"attach {name}")
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
            # recovery on attach: whatever dead processes left behind is reclaimed now
            _pool_lock(&att.ctx)
            try:
                st = shmkv_recover_locked(&att.ctx, &r)
            finally:
                shmkv_pool_unlock(&att.ctx)
        return att
    except BaseException:
        if m is None or not (att is not None and att.fd == fd):
            try:
                os.close(fd)
            except OSError:
                pass
        raise


# --------------------------------------------------------------------------------------
# Segment: the handle.  KVCache (cache.py) subclasses it.
# --------------------------------------------------------------------------------------
cdef class Segment:
    cdef _Attachment _att
    cdef shmkv_ctx_t *ctx
    cdef readonly object name
    cdef readonly object config
    cdef object _dtype
    cdef cnp.dtype _descr
    cdef bint _closed
    cdef int64_t _tokw           # heads * dim elements of one token (one layer)
    cdef object __weakref__

    def __cinit__(self):
        self._closed = True
        self.ctx = NULL

    cdef _bind(self, _Attachment att):
        self._att = att
        self.ctx = &att.ctx
        self.name = att.name
        self.config = _cfg_object(&att.ctx.cfg)
        self._dtype = self.config.numpy_dtype
        self._descr = self._dtype
        self._tokw = <int64_t>att.ctx.cfg.num_kv_heads * att.ctx.cfg.head_dim
        self._closed = False

    @classmethod
    def _create(cls, name, cfg, int mode=0o600, bint populate=True, double timeout=10.0):
        if not isinstance(cfg, CacheConfig):
            raise TypeError(f"config: expected CacheConfig, got {type(cfg).__name__}")
        if mode < 0 or mode > 0o777:
            raise ValueError(f"mode: expected 0 <= mode <= 0o777, got {oct(mode)}")
        cdef Segment self = cls.__new__(cls)
        self._bind(_open(_norm_name(name), True, cfg, mode, populate, timeout))
        return self

    @classmethod
    def _attach(cls, name, bint populate=True, double timeout=10.0, bint recover=True):
        cdef Segment self = cls.__new__(cls)
        self._bind(_open(_norm_name(name), False, None, 0, populate, timeout, recover))
        return self

    cdef inline shmkv_ctx_t *_c(self) except NULL:
        if self._closed:
            raise ValueError(f"operation on a closed KVCache ({self.name})")
        if self.ctx.proc_token == 0:          # first use after os.fork()
            self._att.register()
        return self.ctx

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
        try:
            shm = posix_ipc.SharedMemory(self.name)
        except posix_ipc.ExistentialError:
            return
        try:
            st = os.fstat(shm.fd)
        finally:
            shm.close_fd()
        if (st.st_dev, st.st_ino) != self._att.key:
            return
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass

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

    def __dealloc__(self):
        if not self._closed and self._att is not None:
            self._closed = True
            self._att.refs -= 1
            if self._att.refs == 0:
                try:
                    self._att.release()
                except BaseException:
                    pass

    # ---- argument checks ------------------------------------------------------------
    cdef cnp.ndarray _array(self, object a, str what, int ndim):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"{what}: expected numpy.ndarray, got {type(a).__name__}")
        cdef cnp.ndarray arr = <cnp.ndarray>a
        if <void *>cnp.PyArray_DESCR(arr) != <void *>self._descr:
            if arr.dtype != self._dtype or not arr.dtype.isnative:
                raise TypeError(f"{what}: expected dtype {self._dtype}, got {arr.dtype}")
        if cnp.PyArray_NDIM(arr) != ndim:
            raise ValueError(f"{what}: expected a {ndim}-d array, got shape {(<object>arr).shape}")
        if not cnp.PyArray_IS_C_CONTIGUOUS(arr):
            arr = np.ascontiguousarray(arr)
        return arr

    cdef int _check_tokens(self, cnp.ndarray k, cnp.ndarray v) except -1:
        """k, v: [num_layers, n, heads, dim], n >= 1."""
        cdef shmkv_config_t *cf = &self.ctx.cfg
        cdef cnp.npy_intp *s = cnp.PyArray_DIMS(k)
        if (s[0] != cf.num_layers or s[2] != cf.num_kv_heads or s[3] != cf.head_dim
                or s[1] < 1):
            raise ValueError(
                f"k: expected shape ({cf.num_layers}, n >= 1, {cf.num_kv_heads}, "
                f"{cf.head_dim}), got {(<object>k).shape}")
        if (<object>k).shape != (<object>v).shape:
            raise ValueError(f"v: expected shape {(<object>k).shape} (as k), got {(<object>v).shape}")
        return 0

    # ---- growing a sequence: shared by append and reserve ------------------------------
    cdef int _lock_and_grow(self, shmkv_ctx_t *c, int64_t s, uint64_t n, uint32_t *slot,
                            shmkv_grow_plan_t *pl) except -1:
        """Takes the sequence lock and makes room for n more tokens.  Returns holding
        the lock; on an error the lock is released and nothing was published."""
        cdef int st
        _seq_lock(c, s, slot)
        try:
            st = shmkv_seq_plan(c, slot[0], n, pl)
            if st != SHMKV_OK:
                self._plan_error(st, s, n)
            if pl.new_blocks or pl.cow:
                self._grow(c, slot[0], n, pl, s)
            st = shmkv_seq_check_span(c, slot[0], pl.len, n)
            if st != SHMKV_OK:
                _raise(st, f"sequence {s}")
        except BaseException:
            shmkv_seq_unlock(c, slot[0])
            raise
        return 0

    cdef int _grow(self, shmkv_ctx_t *c, uint32_t slot, uint64_t n,
                   shmkv_grow_plan_t *pl, int64_t sid) except -1:
        """Caller holds the sequence lock.  Makes room for n tokens after pl.len: new
        blocks into the table, and a private copy of a shared partial last block.  On
        return the table holds every block the n tokens go to; nothing is published."""
        cdef int st
        cdef uint32_t target = SHMKV_NIL, src
        cdef shmkv_recovery_t r
        cdef int tries = 0
        cdef uint64_t free_now = 0
        if not pl.cow:
            st = shmkv_pcache_grow(c, slot, pl)       # from this process's own cache
            if st == SHMKV_OK:
                return 0
            if st != SHMKV_EAGAIN:
                _raise(st, f"sequence {sid}")
        while True:
            _pool_lock(c)
            st = shmkv_seq_grow_locked(c, slot, pl, &target)
            if st == SHMKV_EFULL and shmkv_pcache_drain_all_locked(c) == SHMKV_OK:
                # blocks other processes keep in their caches are free, not "full"
                st = shmkv_seq_grow_locked(c, slot, pl, &target)
            if st == SHMKV_EFULL:
                # recovery before raising CacheFullError: dead processes' blocks return
                # (a full pass only when someone is dead: a saturated pool stays cheap)
                if (shmkv_any_dead_locked(c) and shmkv_recover_locked(c, &r) == SHMKV_OK
                        and (r.blocks or r.sequences)):
                    st = shmkv_seq_plan(c, slot, n, pl)
                    if st == SHMKV_OK:
                        st = shmkv_seq_grow_locked(c, slot, pl, &target)
            if st == SHMKV_EFULL:
                shmkv_counts(c, &free_now, NULL, NULL)
            elif st == SHMKV_OK:
                shmkv_pcache_balance_locked(c)     # refill our cache while we are here
            shmkv_pool_unlock(c)
            if st == SHMKV_EAGAIN and tries < 10000:     # in-flight records all busy
                tries += 1
                time.sleep(0.0005)
                continue
            break
        if st == SHMKV_EFULL:
            raise CacheFullError(
                f"sequence {sid}: the block pool is exhausted: {n} more tokens need "
                f"{pl.new_blocks + pl.cow} blocks, {free_now} free")
        if st != SHMKV_OK:
            _raise(st, f"sequence {sid}")
        if not pl.cow:
            return 0
        src = <uint32_t>shmkv_table(c, slot)[pl.cow_index]
        try:
            with nogil:
                shmkv_block_copy(c, src, target, pl.len % c.cfg.block_size)
            shmkv_crash(SHMKV_CP_COW_AFTER_COPY)
            _pool_lock(c)
            st = shmkv_seq_cow_commit_locked(c, slot, pl.cow_index, target)
            shmkv_pool_unlock(c)
            if st != SHMKV_OK:
                _raise(st, f"sequence {sid}")
            target = SHMKV_NIL
        finally:
            if target != SHMKV_NIL:             # interrupted: give the copy back
                if shmkv_pool_lock(c) == SHMKV_OK:
                    shmkv_inflight_release_locked(c, target)
                    shmkv_pool_unlock(c)
        return 0

    # ---- sequences ---------------------------------------------------------------------
    def create_sequence(self, tokens=None, salt=None, *, int priority=0):
        """Create a sequence owned by this process.

        Parameters
        ----------
        tokens : array-like of int, optional
            The prompt's token ids.  The sequence starts out sharing the longest run of
            full blocks of ``tokens`` that any process has published (never the last
            token: it must be computed); ``seq_len(sid)`` says how many tokens are
            already there.  Append the rest with ``append(..., tokens=...)``.
        salt : str or bytes, optional
            Cache salt (tenant isolation): only sequences with the same salt share.
        priority : int
            For ``evict("priority")``: lower priorities are evicted first.

        Returns
        -------
        int
            Its id, unique among the live sequences of the segment.

        Raises
        ------
        CacheFullError
            Every sequence slot is taken.
        """
        cdef shmkv_ctx_t *c = self._c()
        cdef int64_t sid = -1
        cdef int st
        cdef uint32_t slot, nfull = 0, hits = 0
        cdef shmkv_recovery_t r
        cdef cnp.ndarray ids = None, hashes = None
        cdef uint64_t sd[2]
        if priority < 0:
            raise ValueError(f"priority: expected >= 0, got {priority}")
        _salt_digest(salt, sd)
        if tokens is not None:
            ids = _as_ids(tokens, -1)
            if ids.shape[0] > 1:
                nfull = min((ids.shape[0] - 1) // c.cfg.block_size, c.cfg.max_blocks_per_seq)
            if nfull:
                hashes = self._chain(ids, nfull, sd)
        if ids is None:
            st = shmkv_pcache_create(c, <uint32_t>priority, &sid)   # no shared line
            if st == SHMKV_OK:
                slot = <uint32_t>(sid % c.cfg.max_seqs)
                c.seqs[slot].salt[0] = sd[0]
                c.seqs[slot].salt[1] = sd[1]
                return sid
            if st != SHMKV_EAGAIN:
                _raise(st, "create_sequence")
        _pool_lock(c)
        st = shmkv_seq_create_locked(c, <uint32_t>priority, &sid)
        if st == SHMKV_ESEQFULL and shmkv_pcache_drain_all_locked(c) == SHMKV_OK:
            st = shmkv_seq_create_locked(c, <uint32_t>priority, &sid)
        if (st == SHMKV_ESEQFULL and shmkv_any_dead_locked(c)
                and shmkv_recover_locked(c, &r) == SHMKV_OK and r.sequences):
            st = shmkv_seq_create_locked(c, <uint32_t>priority, &sid)
        if st == SHMKV_OK:
            shmkv_pcache_balance_locked(c)
            slot = <uint32_t>(sid % c.cfg.max_seqs)
            c.seqs[slot].salt[0] = sd[0]
            c.seqs[slot].salt[1] = sd[1]
            if ids is not None:
                if nfull:
                    hits = shmkv_prefix_take_locked(
                        c, slot, <const uint64_t *>cnp.PyArray_DATA(hashes), nfull)
                shmkv_count(c, SHMKV_C_PREFIX_QUERIES, ids.shape[0])
                shmkv_count(c, SHMKV_C_PREFIX_HITS, hits * c.cfg.block_size)
        shmkv_pool_unlock(c)
        if st != SHMKV_OK:
            if st == SHMKV_ESEQFULL:
                raise CacheFullError(
                    f"create_sequence: all {c.cfg.max_seqs} sequence slots are taken")
            _raise(st, "create_sequence")
        return sid

    def match_prefix(self, tokens, salt=None):
        """Tokens that ``create_sequence(tokens, salt)`` would share right now (full
        blocks only, never the last token), without taking them."""
        cdef shmkv_ctx_t *c = self._c()
        cdef cnp.ndarray ids = _as_ids(tokens, -1)
        cdef uint64_t sd[2]
        cdef uint32_t nfull = 0, hits = 0
        _salt_digest(salt, sd)
        if ids.shape[0] > 1:
            nfull = min((ids.shape[0] - 1) // c.cfg.block_size, c.cfg.max_blocks_per_seq)
        if nfull == 0:
            return 0
        hashes = self._chain(ids, nfull, sd)
        _pool_lock(c)
        hits = shmkv_prefix_match_locked(c, <const uint64_t *>cnp.PyArray_DATA(hashes), nfull)
        shmkv_pool_unlock(c)
        return hits * c.cfg.block_size

    cdef cnp.ndarray _chain(self, cnp.ndarray ids, uint32_t nfull, uint64_t *salt):
        """Block hashes [nfull, 2] of the first nfull full blocks of ids (int32)."""
        cdef shmkv_ctx_t *c = self.ctx
        cdef cnp.npy_intp dims[2]
        dims[0] = nfull
        dims[1] = 2
        cdef cnp.ndarray out = cnp.PyArray_EMPTY(2, dims, cnp.NPY_UINT64, 0)
        cdef uint64_t *h = <uint64_t *>cnp.PyArray_DATA(out)
        cdef const int32_t *tp = <const int32_t *>cnp.PyArray_DATA(ids)
        cdef uint64_t zero[2]
        cdef uint32_t i, bs = c.cfg.block_size
        zero[0] = zero[1] = 0
        if c.cfg.hash_algo == SHMKV_HASH_XXH:
            for i in range(nfull):
                shmkv_hash_fast(c.hdr.hash_seed, h + 2 * (i - 1) if i else zero,
                                tp + i * bs, bs, salt if i == 0 else NULL, h + 2 * i)
        else:
            parent = bytes(16)
            for i in range(nfull):
                d = _sha_block(c.hdr.hash_seed, parent, salt if i == 0 else NULL,
                               (<object>ids)[i * bs:(i + 1) * bs].tobytes())
                h[2 * i], h[2 * i + 1] = d
                parent = _pack2(d)
        return out

    cdef int _hash_blocks(self, shmkv_ctx_t *c, uint32_t slot, uint64_t upto) except -1:
        """Computes the hash of every block that [0, upto) fills completely and that has
        none yet (in order: each hash chains on the previous).  Sequence-lock holder."""
        cdef shmkv_seq_t *q = &c.seqs[slot]
        cdef uint32_t i, full = <uint32_t>(upto // c.cfg.block_size)
        cdef const int32_t *t
        cdef uint32_t b, bs = c.cfg.block_size
        if q.flags & SHMKV_SEQF_UNTRACKED:
            return 0
        t = shmkv_table(c, slot)
        for i in range(q.hash_ready, full):
            if c.cfg.hash_algo == SHMKV_HASH_XXH:
                shmkv_seq_block_hash_fast(c, slot, i)
            else:
                b = <uint32_t>t[i]
                parent = bytes(16) if i == 0 else _pack2(
                    (c.blocks[t[i - 1]].hash[0], c.blocks[t[i - 1]].hash[1]))
                toks = (<char *>(c.tokens + <uint64_t>b * bs))[:bs * 4]
                d = _sha_block(c.hdr.hash_seed, parent, q.salt if i == 0 else NULL, toks)
                c.blocks[b].hash[0], c.blocks[b].hash[1] = d
                c.blocks[b].num_tokens = bs
            q.hash_ready = i + 1
        return 0

    def commit(self, sid):
        """Publish the full blocks that reserve(..., tokens=...) filled: call after
        write() has written every layer.  Returns how many blocks became findable."""
        cdef shmkv_ctx_t *c = self._c()
        cdef int64_t s = _as_sid(sid)
        cdef uint32_t slot, before
        _seq_lock(c, s, &slot)
        try:
            before = c.seqs[slot].hashed
            if c.seqs[slot].hash_ready > before:
                _pool_lock(c)
                shmkv_seq_publish_locked(c, slot)
                shmkv_pool_unlock(c)
            return c.seqs[slot].hashed - before
        finally:
            shmkv_seq_unlock(c, slot)

    def set_priority(self, sid, int priority):
        """Set a sequence's priority for evict("priority") (lower is evicted first)."""
        cdef shmkv_ctx_t *c = self._c()
        cdef int64_t s = _as_sid(sid)
        cdef uint32_t slot
        if priority < 0:
            raise ValueError(f"priority: expected >= 0, got {priority}")
        _seq_lock(c, s, &slot)       # (a free and re-create of the slot cannot slip in)
        c.seqs[slot].priority = <uint32_t>priority
        shmkv_seq_unlock(c, slot)

    def evict(self, policy, blocks_needed, *, exclude=()):
        """Free whole sequences until ``blocks_needed`` blocks are free.

        Parameters
        ----------
        policy : {"lru", "lfu", "longest", "priority"}
            Which go first: least recently used, least frequently used, the longest,
            or the lowest priority (ties: least recently used).
        blocks_needed : int
            Target for ``stats()["free_blocks"]`` (cached blocks count as free).
        exclude : iterable of int
            Sequence ids never to evict (the batch being scheduled).

        Only sequences this process owns, detached ones and those of dead processes
        are candidates: another live process may be between reserve() and write() on
        its own sequences, and freeing those under it would let its write land in
        blocks that now hold someone else's data.

        Returns
        -------
        list of int
            The evicted sequence ids, in eviction order (empty if enough was free).
            A candidate being used at this moment is skipped; if the target cannot be
            met, every candidate is evicted.
        """
        cdef shmkv_ctx_t *c = self._c()
        cdef uint32_t s
        cdef shmkv_seq_t *q
        cdef uint64_t me = c.proc_token
        cdef uint64_t nfree
        if policy not in _POLICIES:
            raise ValueError(f"policy: expected one of {tuple(_POLICIES)}, got {policy!r}")
        if isinstance(blocks_needed, bool) or not isinstance(blocks_needed, (int, np.integer)):
            raise TypeError(f"blocks_needed: expected int, got {type(blocks_needed).__name__}")
        if not 0 <= blocks_needed <= c.cfg.num_blocks:
            raise ValueError(f"blocks_needed: expected 0 <= n <= {c.cfg.num_blocks}, "
                             f"got {blocks_needed}")
        keep = {_as_sid(x) for x in exclude}
        counter = _POLICIES[policy]
        evicted = []
        _pool_lock(c)
        try:
            shmkv_counts(c, &nfree, NULL, NULL)
            if nfree >= blocks_needed:
                return evicted
            cands = []
            for s in range(c.cfg.max_seqs):
                q = &c.seqs[s]
                if q.state != SHMKV_SEQ_LIVE or q.trim_d != 0:
                    continue
                if q.owner != 0 and q.owner != me and shmkv_proc_alive(c, q.owner):
                    continue                      # another live process's sequence
                sid = shmkv_slot_sid(c, s)
                if sid in keep:
                    continue
                if policy == "lru":
                    key = (q.last_access_ns,)
                elif policy == "lfu":
                    key = (q.access_count, q.last_access_ns)
                elif policy == "longest":
                    key = (-<int64_t>q.len, q.last_access_ns)
                else:
                    key = (q.priority, q.last_access_ns)
                cands.append((key, s))
            cands.sort()
            for key, s in cands:
                shmkv_counts(c, &nfree, NULL, NULL)
                if nfree >= blocks_needed:
                    break
                q = &c.seqs[s]
                if not shmkv_atomic_cas_u64(&q.writer, 0, me):
                    continue                      # in use right now: not a victim
                sid = shmkv_slot_sid(c, s)
                if q.state != SHMKV_SEQ_LIVE or shmkv_seq_free_locked(c, s) != SHMKV_OK:
                    shmkv_seq_unlock(c, s)
                    continue
                shmkv_count(c, counter, 1)
                evicted.append(sid)
        finally:
            shmkv_pool_unlock(c)
        return evicted

    def trim_streaming(self, sid, sink_tokens, window_tokens):
        """StreamingLLM: keep the attention-sink prefix and the recent window, drop the
        whole blocks in between.

        Keeps the first ``sink_tokens`` tokens (rounded up to whole blocks) and at least
        the last ``window_tokens`` (the blocks that hold them); frees the middle blocks.
        Positions are renumbered: afterwards token i of the sequence is its i-th kept
        token, ``seq_len`` is the kept count and ``trimmed(sid)`` the tokens dropped so
        far (add it to recover original positions).  The sequence stops being hashed
        for the prefix cache (its chain no longer describes a prompt).

        Returns
        -------
        int
            Tokens dropped by this call (0 if the two ends overlap).
        """
        cdef shmkv_ctx_t *c = self._c()
        cdef int64_t s = _as_sid(sid)
        cdef int64_t sink = _count_arg(sink_tokens, "sink_tokens")
        cdef int64_t win = _count_arg(window_tokens, "window_tokens")
        cdef uint32_t slot, S, D, nb, ln, first_kept, bs = c.cfg.block_size
        cdef uint32_t *dropped = NULL
        cdef int st = SHMKV_OK
        cdef shmkv_seq_t *q
        _seq_lock(c, s, &slot)
        try:
            q = &c.seqs[slot]
            ln = q.len
            nb = shmkv_blocks_for(c, ln)
            S = <uint32_t>min((sink + bs - 1) // bs, nb)
            first_kept = <uint32_t>((ln - win) // bs) if win < ln else 0
            if first_kept <= S:
                return 0
            D = first_kept - S
            dropped = <uint32_t *>malloc(sizeof(uint32_t) * (D + 1))
            if dropped == NULL:
                raise MemoryError()
            _pool_lock(c)
            if q.nblocks > nb:                  # an unpublished tail a dead writer left
                st = SHMKV_ECORRUPT if shmkv_seq_valid(c, slot) != SHMKV_OK else SHMKV_OK
                while st == SHMKV_OK and q.nblocks > nb:
                    q.nblocks -= 1
                    shmkv_block_decref_locked(c, <uint32_t>shmkv_table(c, slot)[q.nblocks])
            if st == SHMKV_OK:
                st = shmkv_seq_valid(c, slot)
            if st == SHMKV_OK:
                st = shmkv_seq_trim_locked(c, slot, S, D, dropped)
            shmkv_pool_unlock(c)
            if st != SHMKV_OK:
                _raise(st, f"trim_streaming({s})")
            return D * bs
        finally:
            free(dropped)
            shmkv_seq_unlock(c, slot)

    def trimmed(self, sid):
        """Tokens trim_streaming dropped from this sequence so far."""
        cdef shmkv_ctx_t *c = self._c()
        cdef uint32_t slot
        cdef int64_t s = _as_sid(sid)
        st = shmkv_sid_slot(c, s, &slot)
        if st != SHMKV_OK:
            _raise(st, f"sequence {s}")
        return c.seqs[slot].trimmed

    def token_ids(self, sid, start=None, stop=None):
        """The token ids recorded for tokens [start, stop) (int32; meaningful where they
        were given with tokens=, or shared from the prefix cache)."""
        cdef shmkv_ctx_t *c = self._c()
        cdef int64_t s = _as_sid(sid)
        cdef uint32_t slot
        cdef int64_t a, b
        cdef cnp.ndarray out
        cdef cnp.npy_intp dims[1]
        _seq_lock(c, s, &slot)
        try:
            _token_range(start, stop, _valid_len(c, slot, s), s, &a, &b)
            dims[0] = b - a
            out = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT32, 0)
            if shmkv_seq_check_span(c, slot, a, b - a) != SHMKV_OK:
                _raise(SHMKV_ECORRUPT, f"sequence {s}")
            shmkv_seq_tokens(c, slot, a, b - a, <int32_t *>cnp.PyArray_DATA(out), 0)
            return out
        finally:
            shmkv_seq_unlock(c, slot)

    def fork(self, sid):
        """A new sequence sharing every block of `sid` copy-on-write.

        The child is owned by this process.  Appends to either sequence never change
        what the other gathers: a shared partial last block is copied before it is
        written.
        """
        cdef shmkv_ctx_t *c = self._c()
        cdef int64_t s = _as_sid(sid), child = -1
        cdef int st
        cdef uint32_t slot
        cdef shmkv_recovery_t r
        # the parent's lock: its free may run on its owner's fast path (no pool lock)
        _seq_lock(c, s, &slot)
        try:
            _pool_lock(c)
        except BaseException:
            shmkv_seq_unlock(c, slot)
            raise
        st = shmkv_seq_fork_locked(c, s, &child)
        if st == SHMKV_ESEQFULL and shmkv_pcache_drain_all_locked(c) == SHMKV_OK:
            st = shmkv_seq_fork_locked(c, s, &child)
        if (st == SHMKV_ESEQFULL and shmkv_any_dead_locked(c)
                and shmkv_recover_locked(c, &r) == SHMKV_OK and r.sequences):
            st = shmkv_seq_fork_locked(c, s, &child)
        shmkv_pool_unlock(c)
        shmkv_seq_unlock(c, slot)
        if st != SHMKV_OK:
            if st == SHMKV_ESEQFULL:
                raise CacheFullError(
                    f"fork({s}): all {c.cfg.max_seqs} sequence slots are taken")
            _raise(st, f"fork({s})")
        return child

    def append(self, sid, k, v, tokens=None):
        """Append n tokens to a sequence, every layer at once.

        Parameters
        ----------
        sid : int
        k, v : ndarray
            ``[num_layers, n, num_kv_heads, head_dim]`` of the cache's dtype, n >= 1.
        tokens : array-like of n ints, optional
            The token ids of these n tokens.  Every block they fill is hashed and, when
            the call returns, findable by every process (prefix cache).  A sequence
            appended to without tokens stops being hashed.

        The tokens become visible to gather (in every process) all together, when the
        call returns.  Raises CacheFullError with no effect when the pool is short.
        """
        cdef shmkv_ctx_t *c = self._c()
        cdef int64_t s = _as_sid(sid)
        cdef cnp.ndarray ka = self._array(k, "k", 4)
        cdef cnp.ndarray va = self._array(v, "v", 4)
        self._check_tokens(ka, va)
        cdef uint64_t n = <uint64_t>cnp.PyArray_DIMS(ka)[1]
        cdef uint32_t slot
        cdef shmkv_grow_plan_t pl
        cdef uint8_t *kb = <uint8_t *>cnp.PyArray_DATA(ka)
        cdef uint8_t *vb = <uint8_t *>cnp.PyArray_DATA(va)
        cdef cnp.ndarray ids = None if tokens is None else _as_ids(tokens, n)
        self._lock_and_grow(c, s, n, &slot, &pl)
        try:
            if ids is None:
                c.seqs[slot].flags |= SHMKV_SEQF_UNTRACKED
            else:
                shmkv_seq_tokens(c, slot, pl.len, n, <int32_t *>cnp.PyArray_DATA(ids), 1)
            if shmkv_plant == SHMKV_PLANT_EARLY_PUBLISH:     # planted bug, see plant_bug()
                shmkv_atomic_store_u32_release(&c.seqs[slot].len, <uint32_t>(pl.len + n))
            with nogil:
                shmkv_seq_copy(c, slot, pl.len, n, c.kpool, kb, 1)
                shmkv_seq_copy(c, slot, pl.len, n, c.vpool, vb, 1)
            if ids is not None:
                self._hash_blocks(c, slot, pl.len + n)
            shmkv_crash(SHMKV_CP_APPEND_BEFORE_PUBLISH)
            shmkv_atomic_store_u32_release(&c.seqs[slot].len, <uint32_t>(pl.len + n))
            shmkv_crash(SHMKV_CP_APPEND_AFTER_PUBLISH)
            shmkv_seq_touch(c, slot)
            shmkv_count_proc(c, SHMKV_PC_APPENDED, n)
            if c.seqs[slot].hash_ready > c.seqs[slot].hashed:
                _pool_lock(c)
                shmkv_seq_publish_locked(c, slot)
                shmkv_pool_unlock(c)
        finally:
            shmkv_seq_unlock(c, slot)

    cdef int _plan_error(self, int st, int64_t s, uint64_t n) except -1:
        if st == SHMKV_ETOOLONG:
            raise CacheFullError(
                f"sequence {s}: {n} more tokens would exceed max_seq_len "
                f"({self.ctx.cfg.max_blocks_per_seq * self.ctx.cfg.block_size} tokens)")
        _raise(st, f"sequence {s}")

    def reserve(self, sid, n, tokens=None):
        """Grow a sequence by n tokens and return their slot ids.

        With ``tokens`` (n token ids) the blocks these tokens fill are hashed; they
        become findable by other processes at ``commit(sid)``, which the caller calls
        once write() has written every layer.

        Returns
        -------
        ndarray of int64, shape [n]
            ``slot = block_id * block_size + offset`` of each new token, for
            :meth:`write`.  The new length is visible at once; the data is whatever the
            caller writes into the slots.
        """
        cdef shmkv_ctx_t *c = self._c()
        cdef int64_t s = _as_sid(sid)
        if type(n) is not int and (isinstance(n, bool) or not isinstance(n, (int, np.integer))):
            raise TypeError(f"n: expected int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"n: expected n >= 1, got {n}")
        if n > <int64_t>c.cfg.max_blocks_per_seq * c.cfg.block_size:
            raise CacheFullError(
                f"sequence {s}: {n} more tokens would exceed max_seq_len "
                f"({c.cfg.max_blocks_per_seq * c.cfg.block_size} tokens)")
        cdef uint64_t nn = <uint64_t>n
        cdef uint32_t slot
        cdef shmkv_grow_plan_t pl
        cdef cnp.npy_intp dims[1]
        dims[0] = <cnp.npy_intp>nn
        cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT64, 0)
        cdef cnp.ndarray ids = None if tokens is None else _as_ids(tokens, nn)
        self._lock_and_grow(c, s, nn, &slot, &pl)
        try:
            shmkv_seq_slots(c, slot, pl.len, nn, <int64_t *>cnp.PyArray_DATA(out))
            if ids is None:
                c.seqs[slot].flags |= SHMKV_SEQF_UNTRACKED
            else:
                shmkv_seq_tokens(c, slot, pl.len, nn, <int32_t *>cnp.PyArray_DATA(ids), 1)
                self._hash_blocks(c, slot, pl.len + nn)
            shmkv_atomic_store_u32_release(&c.seqs[slot].len, <uint32_t>(pl.len + nn))
            shmkv_seq_touch(c, slot)
            shmkv_count_proc(c, SHMKV_PC_APPENDED, nn)
        finally:
            shmkv_seq_unlock(c, slot)
        return out

    def write(self, layer, slots, k, v):
        """Scatter tokens of one layer into slots (vLLM's reshape_and_cache).

        Parameters
        ----------
        layer : int
        slots : ndarray of int64, shape [n]   (from :meth:`reserve`)
        k, v : ndarray [n, num_kv_heads, head_dim] of the cache's dtype
        """
        cdef shmkv_ctx_t *c = self._c()
        cdef int64_t lyr = self._layer(layer)
        if not isinstance(slots, np.ndarray):
            raise TypeError(f"slots: expected numpy.ndarray of int64, got {type(slots).__name__}")
        if slots.dtype.kind not in "iu":
            raise TypeError(f"slots: expected an integer dtype, got {slots.dtype}")
        if slots.ndim != 1:
            raise ValueError(f"slots: expected a 1-d array, got shape {slots.shape}")
        cdef cnp.ndarray sa = np.ascontiguousarray(slots, dtype=np.int64)
        cdef cnp.ndarray ka = self._array(k, "k", 3)
        cdef cnp.ndarray va = self._array(v, "v", 3)
        cdef uint64_t n = <uint64_t>cnp.PyArray_DIMS(sa)[0]
        cdef shmkv_config_t *cf = &c.cfg
        if n < 1:
            raise ValueError("slots: expected n >= 1 slots, got 0")
        kshape, vshape = (<object>ka).shape, (<object>va).shape
        if kshape != (n, cf.num_kv_heads, cf.head_dim):
            raise ValueError(
                f"k: expected shape ({n}, {cf.num_kv_heads}, {cf.head_dim}), got {kshape}")
        if vshape != kshape:
            raise ValueError(f"v: expected shape {kshape} (as k), got {vshape}")
        cdef int64_t bad = -1
        cdef int st
        cdef const int64_t *sp = <const int64_t *>cnp.PyArray_DATA(sa)
        cdef const uint8_t *kb = <const uint8_t *>cnp.PyArray_DATA(ka)
        cdef const uint8_t *vb = <const uint8_t *>cnp.PyArray_DATA(va)
        with nogil:
            st = shmkv_write_slots(c, <uint32_t>lyr, sp, n, kb, vb, &bad)
        if st == SHMKV_ERANGE:
            raise IndexError(
                f"slots[{bad}]: expected 0 <= slot < {cf.num_blocks * cf.block_size}, "
                f"got {sa[bad]}")
        if st != SHMKV_OK:
            _raise(st, "write")

    cdef int64_t _layer(self, object layer) except -1:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"layer: expected int, got {type(layer).__name__}")
        if not 0 <= layer < self.ctx.cfg.num_layers:
            raise IndexError(
                f"layer: expected 0 <= layer < {self.ctx.cfg.num_layers}, got {layer}")
        return <int64_t>layer

    def gather(self, sid, start=None, stop=None, *, out=None):
        """Read tokens [start, stop) of a sequence, every layer.

        Returns
        -------
        (k, v) : ndarrays [num_layers, stop - start, num_kv_heads, head_dim]
            New C-contiguous arrays, or the two arrays of ``out`` (which must be
            C-contiguous, writable, of that shape and the cache's dtype).
        """
        cdef shmkv_ctx_t *c = self._c()
        cdef int64_t s = _as_sid(sid)
        cdef uint32_t slot
        cdef int64_t a, b
        cdef int st
        cdef cnp.ndarray ko, vo
        cdef uint8_t *kb
        cdef uint8_t *vb
        _seq_lock(c, s, &slot)
        try:
            _token_range(start, stop, _valid_len(c, slot, s), s, &a, &b)
            shape = (c.cfg.num_layers, b - a, c.cfg.num_kv_heads, c.cfg.head_dim)
            if out is None:
                ko = _aligned_empty(shape, self._dtype)
                vo = _aligned_empty(shape, self._dtype)
            else:
                ko, vo = self._check_out(out, shape)
            st = shmkv_seq_check_span(c, slot, a, b - a)
            if st != SHMKV_OK:
                _raise(st, f"sequence {s}")
            kb = <uint8_t *>cnp.PyArray_DATA(ko)
            vb = <uint8_t *>cnp.PyArray_DATA(vo)
            with nogil:
                shmkv_seq_copy(c, slot, a, b - a, c.kpool, kb, 0)
                shmkv_seq_copy(c, slot, a, b - a, c.vpool, vb, 0)
            shmkv_seq_touch(c, slot)
            shmkv_count_proc(c, SHMKV_PC_GATHERED, b - a)
        finally:
            shmkv_seq_unlock(c, slot)
        if out is not None:
            return out
        return ko, vo

    cdef tuple _check_out(self, object out, tuple shape):
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"out: expected a tuple (k_out, v_out), got {type(out).__name__}")
        res = []
        for name, a in zip(("out[0]", "out[1]"), out):
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{name}: expected numpy.ndarray, got {type(a).__name__}")
            if a.dtype != self._dtype or not a.dtype.isnative:
                raise TypeError(f"{name}: expected dtype {self._dtype}, got {a.dtype}")
            if a.shape != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {a.shape}")
            if not a.flags.c_contiguous:
                raise ValueError(f"{name}: expected a C-contiguous array")
            if not a.flags.writeable:
                raise ValueError(f"{name}: expected a writable array")
            res.append(a)
        if np.shares_memory(res[0], res[1]):
            raise ValueError("out: k_out and v_out must not overlap")
        return tuple(res)

    def seq_len(self, sid):
        """Tokens in the sequence."""
        cdef shmkv_ctx_t *c = self._c()
        cdef uint32_t slot
        cdef int64_t s = _as_sid(sid)
        cdef int st = shmkv_sid_slot(c, s, &slot)
        cdef uint32_t n
        if st == SHMKV_OK:
            n = shmkv_atomic_load_u32_acquire(&c.seqs[slot].len)
            st = shmkv_sid_slot(c, s, &slot)      # freed meanwhile? (no lock taken)
        if st != SHMKV_OK:
            _raise(st, f"sequence {s}")
        return n

    def block_table(self, sid):
        """int32 ndarray of the physical block ids of a sequence, in logical order."""
        return self.batch_block_tables(np.array([_as_sid(sid)], np.int64))[0][0]

    def batch_block_tables(self, sids):
        """Block tables of a batch, padded with -1.

        Returns
        -------
        tables : int32 ndarray [batch, W], W the longest table of the batch
        lens : int32 ndarray [batch], each sequence's length in tokens
        """
        cdef shmkv_ctx_t *c = self._c()
        cdef cnp.ndarray sa
        if (cnp.PyArray_CheckExact(sids) and cnp.PyArray_TYPE(<cnp.ndarray>sids) == cnp.NPY_INT64
                and cnp.PyArray_NDIM(<cnp.ndarray>sids) == 1
                and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>sids)
                and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>sids)):
            sa = <cnp.ndarray>sids                  # fast path: a native int64 vector
        elif isinstance(sids, np.ndarray):
            if sids.ndim != 1:
                raise ValueError(f"sids: expected a 1-d array, got shape {sids.shape}")
            if sids.dtype.kind not in "iu" or sids.dtype.itemsize > 8:
                raise TypeError(f"sids: expected integer ids, got dtype {sids.dtype}")
            if sids.dtype.kind == "u" and sids.size and sids.max() > INT64_MAX:
                raise SequenceNotFound(
                    f"sequence {sids.max()}: unknown or freed sequence")
            sa = np.ascontiguousarray(sids, dtype=np.int64)
        else:
            # every id checked as any other call checks one (no float/str/bool coercion)
            items = list(sids)
            if items and all(isinstance(x, (list, tuple, np.ndarray)) for x in items):
                raise ValueError(f"sids: expected a 1-d sequence of ids, got shape "
                                 f"{np.shape(items)}")
            sa = np.array([_as_sid(x) for x in items], dtype=np.int64)
        cdef size_t B = <size_t>sa.shape[0]
        cdef const int64_t *sp = <const int64_t *>cnp.PyArray_DATA(sa)
        cdef cnp.npy_intp dims[2]
        dims[0] = <cnp.npy_intp>B
        cdef cnp.ndarray lens = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT32, 0)
        cdef uint32_t slots_small[512]
        cdef uint32_t *slots = slots_small
        cdef uint32_t W = 0
        cdef int st = SHMKV_OK
        cdef int64_t bad = 0
        cdef cnp.ndarray tables = None
        if B > 512:
            slots = <uint32_t *>malloc(sizeof(uint32_t) * B)
            if slots == NULL:
                raise MemoryError()
        try:
            _pool_lock(c)
            try:
                st = shmkv_batch_sizes_locked(c, sp, B, slots,
                                              <int32_t *>cnp.PyArray_DATA(lens), &W, &bad)
                if st == SHMKV_OK:
                    dims[1] = W
                    tables = cnp.PyArray_EMPTY(2, dims, cnp.NPY_INT32, 0)
                    st = shmkv_batch_copy_locked(c, sp, B, slots,
                                                 <const int32_t *>cnp.PyArray_DATA(lens), W,
                                                 <int32_t *>cnp.PyArray_DATA(tables), &bad)
            finally:
                shmkv_pool_unlock(c)
        finally:
            if slots != slots_small:
                free(slots)
        if st == SHMKV_ENOSEQ:
            raise SequenceNotFound(f"sequence {bad}: unknown or freed sequence")
        if st != SHMKV_OK:
            _raise(st, f"sequence {bad}")
        return tables, lens

    def free(self, sid):
        """Drop a sequence; blocks whose refcount reaches 0 return to the pool."""
        cdef shmkv_ctx_t *c = self._c()
        cdef int64_t s = _as_sid(sid)
        cdef uint32_t slot
        cdef int st
        _seq_lock(c, s, &slot)
        st = shmkv_pcache_free(c, slot)            # exclusive blocks: into our cache
        if st == SHMKV_OK:
            return
        if st != SHMKV_EAGAIN:
            shmkv_seq_unlock(c, slot)
            _raise(st, f"free({s})")
        try:
            _pool_lock(c)
        except BaseException:
            shmkv_seq_unlock(c, slot)
            raise
        st = shmkv_seq_free_locked(c, slot)        # releases the sequence lock on OK
        if st == SHMKV_OK:
            shmkv_pcache_balance_locked(c)
        shmkv_pool_unlock(c)
        if st != SHMKV_OK:
            shmkv_seq_unlock(c, slot)
            _raise(st, f"free({s})")

    def sequences(self):
        """Ids of the live sequences, in slot order."""
        cdef shmkv_ctx_t *c = self._c()
        cdef uint32_t i
        res = []
        _pool_lock(c)
        try:
            for i in range(c.cfg.max_seqs):
                if c.seqs[i].state == SHMKV_SEQ_LIVE:
                    res.append(shmkv_slot_sid(c, i))
        finally:
            shmkv_pool_unlock(c)
        return res

    # ---- ownership ----------------------------------------------------------------------
    cdef int _set_owner(self, object sid, uint64_t owner) except -1:
        cdef shmkv_ctx_t *c = self._c()
        cdef int64_t s = _as_sid(sid)
        cdef uint32_t slot
        _seq_lock(c, s, &slot)       # (a free and re-create of the slot cannot slip in)
        try:
            _pool_lock(c)
        except BaseException:
            shmkv_seq_unlock(c, slot)
            raise
        c.seqs[slot].owner = owner if owner != 1 else c.proc_token
        shmkv_pool_unlock(c)
        shmkv_seq_unlock(c, slot)
        return 0

    def detach(self, sid):
        """Make a sequence owned by no process: it survives its creator, and recovery
        never frees it, until some process adopts it."""
        self._set_owner(sid, 0)

    def adopt(self, sid):
        """This process becomes the owner of the sequence."""
        self._set_owner(sid, 1)

    def owner_pid(self, sid):
        """PID of the owning process, or None for a detached sequence."""
        cdef shmkv_ctx_t *c = self._c()
        cdef uint32_t slot
        cdef int64_t s = _as_sid(sid)
        cdef uint64_t tok
        _pool_lock(c)
        st = shmkv_sid_slot(c, s, &slot)
        tok = c.seqs[slot].owner if st == SHMKV_OK else 0
        pid = None
        if tok != 0 and (tok & 0xffffffff) - 1 < c.cfg.max_procs:
            pid = c.procs[(tok & 0xffffffff) - 1].pid
        if st == SHMKV_OK:
            st = shmkv_sid_slot(c, s, &slot)      # freed meanwhile (no pool lock)?
        shmkv_pool_unlock(c)
        if st != SHMKV_OK:
            _raise(st, f"sequence {s}")
        return pid

    def recover(self):
        """Reclaim what dead processes held.

        Returns
        -------
        dict
            ``sequences`` and ``blocks`` reclaimed, ``processes`` found dead, ``locks``
            taken from dead holders, unpublished ``tail_blocks`` trimmed,
            ``refcounts_fixed``, ``corrupt_sequences`` dropped, ``duration_s``.
        """
        cdef shmkv_ctx_t *c = self._c()
        cdef shmkv_recovery_t r
        cdef int st
        _pool_lock(c)
        st = shmkv_recover_locked(c, &r)
        shmkv_pool_unlock(c)
        if st != SHMKV_OK:
            _raise(st, "recover")
        return dict(sequences=r.sequences, blocks=r.blocks, processes=r.processes,
                    locks=r.locks, tail_blocks=r.tails, refcounts_fixed=r.refcounts_fixed,
                    corrupt_sequences=r.corrupt, duration_s=r.duration_ns / 1e9)

    # ---- zero-copy pools ----------------------------------------------------------------
    cdef object _pool_view(self, object layer, bint is_k):
        cdef shmkv_ctx_t *c = self._c()
        cdef int64_t lyr = self._layer(layer)
        off = (c.lay.off_kpool if is_k else c.lay.off_vpool) + lyr * c.lay.layer_stride
        count = <int64_t>c.cfg.num_blocks * c.cfg.block_size * self._tokw
        arr = np.frombuffer(self._att.mapping, dtype=self._dtype, count=count, offset=off)
        return arr.reshape(c.cfg.num_blocks, c.cfg.block_size, c.cfg.num_kv_heads,
                           c.cfg.head_dim)

    def key_cache(self, layer):
        """Zero-copy view [num_blocks, block_size, num_kv_heads, head_dim] of one layer's
        K pool; writes through it land in shared memory."""
        return self._pool_view(layer, True)

    def value_cache(self, layer):
        """Zero-copy view of one layer's V pool (see key_cache)."""
        return self._pool_view(layer, False)

    # ---- observability ------------------------------------------------------------------
    def stats(self):
        """Counters and gauges of the whole segment (every process).

        ``free_blocks + used_blocks == num_blocks``; a block is used iff its refcount is
        positive.  ``cached_blocks`` (free, still findable by hash) count as free, and so
        do the few free blocks each process keeps in its own cache.
        ``peak_used_blocks`` is sampled whenever a process touches the shared pool and at
        every stats() call: a peak reached and left entirely through the processes' own
        caches (at most 20 blocks each) between two samples is not seen.
        """
        cdef shmkv_ctx_t *c = self._c()
        cdef shmkv_shared_t *sh = c.sh
        cdef uint64_t counters[32]
        cdef uint64_t nfree, cached, num_seqs
        cdef int i
        _pool_lock(c)
        shmkv_counts(c, &nfree, &cached, &num_seqs)
        if c.cfg.num_blocks - nfree > sh.peak_used:    # a sample point of the peak too
            sh.peak_used = <uint32_t>(c.cfg.num_blocks - nfree)
        num_procs, peak = sh.num_procs, sh.peak_used
        last_rec, max_rec = sh.last_recovery_ns, sh.max_recovery_ns
        idx_used = sh.index_used
        shmkv_pool_unlock(c)
        shmkv_counters_total(c, counters)
        d = dict(num_blocks=c.cfg.num_blocks, free_blocks=nfree,
                 used_blocks=c.cfg.num_blocks - nfree, cached_blocks=cached,
                 num_sequences=num_seqs, max_seqs=c.cfg.max_seqs, num_processes=num_procs,
                 peak_used_blocks=peak, index_entries=idx_used,
                 last_recovery_s=last_rec / 1e9, max_recovery_s=max_rec / 1e9)
        for i in range(SHMKV_NCOUNTERS):
            d[COUNTER_NAMES[i]] = counters[i]
        return d

    def check(self):
        """Verify every invariant of the segment.

        Returns
        -------
        list of str
            One line per violation; ``[]`` means consistent.  Sequences being changed
            by another process right now get the checks that hold mid-operation.
        """
        cdef shmkv_ctx_t *c = self._c()
        cdef int st
        cdef shmkv_recovery_t r
        _pool_lock(c)
        try:
            st = shmkv_quiesce_locked(c)      # every process's cache at rest
            if st == SHMKV_EDEADHOLDER:
                # a process died inside a fast path: what it left half-done is recovery's
                # to finish, as for a pool lock that comes back EOWNERDEAD
                shmkv_unquiesce_locked(c)
                st = shmkv_recover_locked(c, &r)
                if st == SHMKV_OK:
                    st = shmkv_quiesce_locked(c)
                    if st == SHMKV_EDEADHOLDER:
                        st = SHMKV_OK           # died again just now: report what we see
            if st != SHMKV_OK:
                _raise(st, "check")
            try:
                return _check_locked(c)
            finally:
                shmkv_unquiesce_locked(c)
        finally:
            shmkv_pool_unlock(c)

    # ---- internals for tests and tools --------------------------------------------------
    def _debug_info(self):
        cdef shmkv_ctx_t *c = self._c()
        return dict(proc_slot=c.proc_slot, proc_token=c.proc_token,
                    layout=_layout_dict(&c.lay), hash_seed=c.hdr.hash_seed,
                    creator_pid=c.hdr.creator_pid, create_time_ns=c.hdr.create_time_ns)


cdef object _aligned_empty(tuple shape, object dtype):
    """np.empty with its data on a page boundary, like the pools: block copies then run
    at the same page offset on both sides, clear of 4K aliasing (a destination a few
    bytes past the source's page offset stalls every load behind the stores; malloc's
    page+16 pointers cost gather 1.4x the floor, page-aligned ones 0.8x)."""
    cdef Py_ssize_t n = dtype.itemsize
    for d in shape:
        n *= d
    raw = np.empty(n + 4096, np.uint8)
    cdef size_t addr = <size_t>cnp.PyArray_DATA(raw)
    cdef Py_ssize_t off = (4096 - <Py_ssize_t>(addr % 4096)) % 4096
    return raw[off:off + n].view(dtype).reshape(shape)


def empty_gather_buffers(cache, Py_ssize_t n_tokens):
    """A (k_out, v_out) pair for ``gather(..., out=)`` of n_tokens tokens, page-aligned
    like the pools (the fastest destination: see _aligned_empty)."""
    cfg = cache.config
    shape = (cfg.num_layers, n_tokens, cfg.num_kv_heads, cfg.head_dim)
    return _aligned_empty(shape, cfg.numpy_dtype), _aligned_empty(shape, cfg.numpy_dtype)


cdef int64_t _valid_len(shmkv_ctx_t *c, uint32_t slot, int64_t s) except -1:
    """A locked sequence's length, checked against its table before anything is sized
    from it (never trust the segment)."""
    cdef uint32_t nb = c.seqs[slot].nblocks, ln = c.seqs[slot].len
    if nb > c.cfg.max_blocks_per_seq or <uint64_t>ln > <uint64_t>nb * c.cfg.block_size:
        _raise(SHMKV_ECORRUPT, f"sequence {s}: length {ln} does not fit its {nb} blocks")
    return ln


cdef int _token_range(object start, object stop, int64_t L, int64_t s, int64_t *a,
                      int64_t *b) except -1:
    """[start, stop) of a sequence of length L, None meaning its ends."""
    a[0] = 0 if start is None else _token_index(start, "start")
    b[0] = L if stop is None else _token_index(stop, "stop")
    if not (0 <= a[0] <= b[0] <= L):
        raise IndexError(
            f"token range: expected 0 <= start <= stop <= {L} (sequence {s} length), "
            f"got [{a[0]}, {b[0]})")
    return 0


cdef int64_t _token_index(object x, str what) except? -1:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{what}: expected int, got {type(x).__name__}")
    if x < 0 or x > 0xffffffff:
        raise IndexError(f"{what}: expected a token index >= 0, got {x}")
    return <int64_t>x


cdef list _check_ids(list bad, str what, const uint32_t *ids, uint32_t n, uint32_t cap,
                     uint32_t limit, uint8_t *mark):
    """A list of ids in the segment (a free stack, a process's cache): its count against
    its capacity, every id against `limit`, repeats (here or on a list checked before,
    through `mark`).  Marks and returns the valid ids."""
    cdef uint32_t i, x
    if n > cap:
        bad.append(f"{what}: {n} entries > capacity {cap}")
        return []
    out = []
    for i in range(n):
        x = ids[i]
        if x >= limit:
            bad.append(f"{what}[{i}] = {x} is out of range (< {limit})")
        elif mark[x]:
            bad.append(f"{what}: {x} appears twice, or also on another free list")
        else:
            mark[x] = 1
            out.append(x)
    return out


cdef list _check_locked(shmkv_ctx_t *c):
    """All invariants; the pool lock is held.  Bounded work, bounded output."""
    cdef list bad = []
    cdef uint32_t NB = c.cfg.num_blocks, NS = c.cfg.max_seqs, NP = c.cfg.max_procs
    cdef uint32_t i, j, b, s, nb, ln, want, top, cc, live = 0, nfree_slots, nprocs = 0
    cdef uint32_t ncache = 0
    cdef uint64_t tok
    cdef uint32_t *cnt = <uint32_t *>malloc(sizeof(uint32_t) * NB + 4)
    cdef uint8_t *mark = <uint8_t *>malloc(NB + 1)
    cdef uint8_t *smark = <uint8_t *>malloc(NS + 1)
    cdef shmkv_seq_t *q
    cdef const int32_t *t
    cdef bint locked
    cdef uint64_t me = c.proc_token if c.proc_token else 1
    if cnt == NULL or mark == NULL or smark == NULL:
        free(cnt); free(mark); free(smark)
        raise MemoryError()
    memset(cnt, 0, sizeof(uint32_t) * NB)
    memset(mark, 0, NB)
    memset(smark, 0, NS)
    try:
        for s in range(NS):
            q = &c.seqs[s]
            if q.state == SHMKV_SEQ_FREE:
                continue
            if q.state != SHMKV_SEQ_LIVE:
                bad.append(f"sequence slot {s}: state {q.state} outside a critical section")
                continue
            live += 1
            sid = shmkv_slot_sid(c, s)
            nb = q.nblocks
            ln = shmkv_atomic_load_u32_acquire(&q.len)
            if nb > c.cfg.max_blocks_per_seq:
                bad.append(f"sequence {sid}: {nb} blocks exceed max_blocks_per_seq "
                           f"{c.cfg.max_blocks_per_seq}")
                continue
            t = shmkv_table(c, s)
            for i in range(nb):
                if not shmkv_block_ok(c, t[i]):
                    bad.append(f"sequence {sid}: table[{i}] = {t[i]} is not a block id")
                else:
                    cnt[t[i]] += 1
            want = shmkv_blocks_for(c, ln)
            if want > nb:
                bad.append(f"sequence {sid}: length {ln} needs {want} blocks, has {nb}")
            # strict checks only when nobody is mid-operation on it (never wait here)
            locked = shmkv_atomic_cas_u64(&q.writer, 0, me)
            if locked:
                ln = q.len
                want = shmkv_blocks_for(c, ln)
                if want != nb:
                    bad.append(f"sequence {sid}: length {ln} needs {want} blocks, table "
                               f"holds {nb} (unpublished tail with no writer)")
                shmkv_seq_unlock(c, s)
            tok = q.owner
            if tok != 0 and ((tok & 0xffffffff) == 0 or (tok & 0xffffffff) - 1 >= NP):
                bad.append(f"sequence {sid}: owner token {tok:#x} names no process slot")
        for s in range(NP):
            if c.procs[s].state == SHMKV_PROC_ACTIVE:
                nprocs += 1
                for j in range(SHMKV_INFLIGHT_PER_PROC):
                    b = c.procs[s].inflight[j]
                    if b == SHMKV_NIL:
                        continue
                    if b >= NB:
                        bad.append(f"process slot {s}: in-flight entry {b} is not a block id")
                    else:
                        cnt[b] += 1
            elif c.procs[s].state != SHMKV_PROC_FREE:
                bad.append(f"process slot {s}: unknown state {c.procs[s].state}")
        nused = 0
        for b in range(NB):
            rc = shmkv_atomic_load_u32(&c.blocks[b].ref_cnt)
            if rc != cnt[b]:
                bad.append(f"block {b}: ref_cnt {rc}, but {cnt[b]} references "
                           "(table entries + in-flight)")
            if rc > 0:
                nused += 1
        cc = c.sh.cached_count
        valid = _check_ids(bad, "free list", c.free_stack, c.sh.free_top, NB, NB, mark)
        top = len(valid)
        for b in valid:
            if c.blocks[b].ref_cnt != 0:
                bad.append(f"free list: block {b} has ref_cnt {c.blocks[b].ref_cnt}")
            if c.blocks[b].flags & SHMKV_BLOCK_HASHED:
                bad.append(f"free list: block {b} carries a hash (belongs on the LRU list)")
        # the LRU list of cached blocks, walked with a bound
        i = 0
        b = c.sh.lru_head
        prev = SHMKV_NIL
        while b != SHMKV_NIL and i <= NB:
            if b >= NB:
                bad.append(f"LRU list: entry {b} is not a block id")
                break
            if mark[b]:
                bad.append(f"LRU list: block {b} appears twice or also on the free list")
                break
            mark[b] = 2
            if c.blocks[b].ref_cnt != 0:
                bad.append(f"LRU list: block {b} has ref_cnt {c.blocks[b].ref_cnt}")
            if not (c.blocks[b].flags & SHMKV_BLOCK_HASHED):
                bad.append(f"LRU list: block {b} has no hash")
            if c.blocks[b].lru_prev != prev:
                bad.append(f"LRU list: block {b} has a wrong back link")
            prev = b
            b = c.blocks[b].lru_next
            i += 1
        if i != cc:
            bad.append(f"LRU list: {i} blocks linked, cached_count says {cc}")
        if prev != c.sh.lru_tail:
            bad.append("LRU list: tail does not match the last linked block")
        # the processes' own caches of free blocks
        for s in range(NP):
            if c.procs[s].state != SHMKV_PROC_ACTIVE:
                continue
            for b in _check_ids(bad, f"process slot {s}: cached blocks", c.procs[s].cache_blocks,
                                c.procs[s].cache_nblocks, SHMKV_PCACHE_BLOCKS, NB, mark):
                ncache += 1
                if c.blocks[b].ref_cnt != 0:
                    bad.append(f"process slot {s}: cached block {b} has ref_cnt "
                               f"{c.blocks[b].ref_cnt}")
                if c.blocks[b].flags & SHMKV_BLOCK_HASHED:
                    bad.append(f"process slot {s}: cached block {b} carries a hash")
        for b in range(NB):
            if c.blocks[b].ref_cnt == 0 and not mark[b]:
                bad.append(f"block {b}: ref_cnt 0 but on no free list, LRU list or process "
                           "cache (leaked)")
        if top + cc + ncache + nused != NB:
            bad.append(f"counts: free {top} + cached {cc} + in process caches {ncache} + "
                       f"used {nused} != num_blocks {NB}")
        # sequence slots
        valid = _check_ids(bad, "sequence free stack", c.seq_free, c.sh.seq_free_top, NS,
                           NS, smark)
        nfree_slots = len(valid)
        for s in valid:
            if c.seqs[s].state != SHMKV_SEQ_FREE:
                bad.append(f"sequence free stack: slot {s} is not free")
        for s in range(NP):
            if c.procs[s].state != SHMKV_PROC_ACTIVE:
                continue
            for j in _check_ids(bad, f"process slot {s}: cached sequence slots",
                                c.procs[s].cache_seqs, c.procs[s].cache_nseqs,
                                SHMKV_PCACHE_SEQS, NS, smark):
                nfree_slots += 1
                if c.seqs[j].state != SHMKV_SEQ_FREE:
                    bad.append(f"process slot {s}: cached sequence slot {j} is not free")
        if nfree_slots + live != NS:
            bad.append(f"sequence slots: {nfree_slots} free (stack and process caches) + "
                       f"{live} live != max_seqs {NS}")
        if c.sh.num_procs != nprocs:
            bad.append(f"num_processes {c.sh.num_procs} != {nprocs} active slots")
        # the index: every entry names a hashed block with that hash
        n_idx = 0
        for i in range(c.lay.index_capacity):
            e = &c.index[i]
            if (e.hash[0] == 0 and (e.hash[1] == 0 or e.hash[1] == 1)):
                continue
            n_idx += 1
            b = e.block
            if b >= NB:
                bad.append(f"index[{i}]: block {b} is not a block id")
            elif not (c.blocks[b].flags & SHMKV_BLOCK_HASHED) or \
                    c.blocks[b].hash[0] != e.hash[0] or c.blocks[b].hash[1] != e.hash[1]:
                bad.append(f"index[{i}]: block {b} does not carry this hash")
        if n_idx != c.sh.index_used:
            bad.append(f"index: {n_idx} entries, index_used says {c.sh.index_used}")
    finally:
        free(cnt)
        free(mark)
        free(smark)
    if len(bad) > 200:
        bad = bad[:200] + [f"... and {len(bad) - 200} more"]
    return bad


# --------------------------------------------------------------------------------------
# read-only inspection: no lock, no registration, bounded reads, torn values tolerated
# --------------------------------------------------------------------------------------
def snapshot(name, *, bint tables=True):
    """Copy out everything an operator may want to see of a segment, read-only.

    Maps the segment PROT_READ, takes no lock and registers nothing, so it works on a
    segment whose processes are all dead and never changes one.  Values another process
    is changing may be torn; every index is clamped before use, so a corrupt or hostile
    segment gives SegmentError or odd numbers, never a crash.

    Raises FileNotFoundError, PermissionError or SegmentError.
    """
    name = _norm_name(name)
    fd = _open_existing(name, True)
    try:
        size = os.fstat(fd).st_size
        if size < SHMKV_PAGE:
            raise SegmentError(f"{name}: {size} bytes, too small for a shmkv segment",
                               reason="not_ready" if size == 0 else "corrupt")
        m = _Mapping.map(fd, size, False, False)
        return _snapshot(name, m, fd, tables)
    finally:
        os.close(fd)


cdef dict _snapshot(str name, _Mapping m, int fd, bint want_tables):
    cdef shmkv_ctx_t ctx
    cdef shmkv_ctx_t *c = &ctx
    cdef int st = shmkv_ctx_bind(c, m.base, m.size, 1)
    if st != SHMKV_OK:
        _raise(st, name)
    c.lock_fd = fd
    cdef shmkv_shared_t *sh = c.sh
    cdef uint32_t NB = c.cfg.num_blocks, NS = c.cfg.max_seqs, NP = c.cfg.max_procs
    cdef uint32_t s, b, nb
    cdef uint64_t tok, owner_slot
    cdef shmkv_seq_t q
    cdef shmkv_proc_t p
    cdef cnp.npy_intp dims[1]
    cfg = _cfg_object(&c.cfg)
    procs = []
    alive_tokens = {}
    for s in range(NP):
        memcpy(&p, &c.procs[s], sizeof(shmkv_proc_t))
        if p.state == SHMKV_PROC_FREE:
            continue
        tok = (<uint64_t>p.gen << 32) | (s + 1)
        alive = p.state == SHMKV_PROC_ACTIVE and shmkv_ofd_probe(fd, s) == 1
        alive_tokens[tok] = alive
        procs.append(dict(slot=s, pid=p.pid, pid_start=p.pid_start, gen=p.gen,
                          attach_time_ns=p.attach_time_ns, alive=alive,
                          inflight=[x for x in p.inflight[:SHMKV_INFLIGHT_PER_PROC]
                                    if x != SHMKV_NIL],
                          cached_blocks=p.cache_nblocks if p.cache_nblocks <= SHMKV_PCACHE_BLOCKS else 0,
                          cached_seq_slots=p.cache_nseqs if p.cache_nseqs <= SHMKV_PCACHE_SEQS else 0))
    dims[0] = NB
    refcnt = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT32, 0)
    flags = cnp.PyArray_EMPTY(1, dims, cnp.NPY_UINT32, 0)
    cdef uint32_t[:] rv = refcnt
    cdef uint32_t[:] fv = flags
    for b in range(NB):
        rv[b] = shmkv_atomic_load_u32_relaxed(&c.blocks[b].ref_cnt)
        fv[b] = c.blocks[b].flags
    seqs = []
    for s in range(NS):
        memcpy(&q, &c.seqs[s], sizeof(shmkv_seq_t))
        if q.state != SHMKV_SEQ_LIVE:
            continue
        nb = min(q.nblocks, c.cfg.max_blocks_per_seq)
        ln = min(q.len, nb * c.cfg.block_size)
        owner_pid = None
        if q.owner & 0xffffffff:                 # slot half 0 names no slot (hostile)
            owner_slot = (q.owner & 0xffffffff) - 1
            if owner_slot < NP:
                owner_pid = c.procs[owner_slot].pid
        d = dict(sid=<int64_t>q.gen * NS + s, slot=s, len=q.len, nblocks=q.nblocks,
                 owner_token=q.owner, owner_pid=owner_pid, detached=q.owner == 0,
                 owner_alive=alive_tokens.get(q.owner, False) if q.owner else None,
                 writer_token=q.writer,
                 writer_alive=alive_tokens.get(q.writer, False) if q.writer else None,
                 priority=q.priority, hashed=q.hashed, created_ns=q.created_ns,
                 last_access_ns=q.last_access_ns, access_count=q.access_count,
                 consistent=q.len <= nb * c.cfg.block_size and q.nblocks <= c.cfg.max_blocks_per_seq)
        if want_tables:
            dims[0] = nb
            t = cnp.PyArray_EMPTY(1, dims, cnp.NPY_INT32, 0)
            if nb:
                memcpy(cnp.PyArray_DATA(t), shmkv_table(c, s), nb * sizeof(int32_t))
            d["table"] = t
        seqs.append(d)
    cdef uint64_t ctr[32]
    shmkv_counters_total(c, ctr)
    counters = {COUNTER_NAMES[j]: ctr[j] for j in range(SHMKV_NCOUNTERS)}
    cdef uint64_t nfree, cached
    shmkv_counts(c, &nfree, &cached, NULL)
    return dict(
        name=name, segment_size=c.size, layout_version=c.hdr.layout_version,
        abi_fingerprint=c.hdr.abi_fingerprint, creator_pid=c.hdr.creator_pid,
        create_time_ns=c.hdr.create_time_ns, hash_seed=c.hdr.hash_seed,
        config=cfg, layout=_layout_dict(&c.lay),
        free_blocks=nfree, cached_blocks=cached, used_blocks=NB - nfree,
        num_sequences=len(seqs), num_processes=sh.num_procs, peak_used_blocks=sh.peak_used,
        index_entries=sh.index_used, last_recovery_s=sh.last_recovery_ns / 1e9,
        max_recovery_s=sh.max_recovery_ns / 1e9, counters=counters,
        processes=procs, sequences=seqs, ref_cnt=refcnt, block_flags=flags)


# --------------------------------------------------------------------------------------
# test and benchmark hooks
# --------------------------------------------------------------------------------------
def set_crash_point(name, long countdown=1):
    """Arm a crash point in this process: the `countdown`-th time execution passes the
    named point, the process calls _exit(86) right there.  None disarms.  For the chaos
    harness; see CRASH_POINTS.  Also armed from the environment at import:
    SHMKV_CRASH_POINT=name[:countdown]."""
    global shmkv_crash_id, shmkv_crash_countdown
    if name is None:
        shmkv_crash_id = 0
        return
    if name not in CRASH_POINTS:
        raise ValueError(f"crash point: expected one of {CRASH_POINTS}, got {name!r}")
    if countdown < 1:
        raise ValueError(f"countdown: expected >= 1, got {countdown}")
    shmkv_crash_countdown = countdown
    shmkv_crash_id = CRASH_POINTS.index(name) + 1


PLANTED_BUGS = ("no_recovery", "early_publish", "no_cow", "leak_on_free")


def plant_bug(name):
    """Plant a known bug in this process, to prove the chaos harness catches it:
    'no_recovery' (recovery does nothing), 'early_publish' (append publishes the length
    before the data is copied), 'no_cow' (a shared partial block is written in place),
    'leak_on_free' (free keeps one block).  None removes it.  Also read from the
    environment at import: SHMKV_PLANT=name."""
    global shmkv_plant
    if name is None:
        shmkv_plant = 0
        return
    if name not in PLANTED_BUGS:
        raise ValueError(f"planted bug: expected one of {PLANTED_BUGS}, got {name!r}")
    shmkv_plant = PLANTED_BUGS.index(name) + 1


def _arm_from_env():
    spec = os.environ.get("SHMKV_CRASH_POINT")
    if spec:
        name, _, n = spec.partition(":")
        set_crash_point(name, int(n) if n else 1)
    if os.environ.get("SHMKV_PLANT"):
        plant_bug(os.environ["SHMKV_PLANT"])

_arm_from_env()


cdef extern from *:
    """
    /* a compiler barrier: the buffer behind p counts as read, its writes must happen */
    static inline void shmkv__keep(void *p) { __asm__ __volatile__("" :: "r"(p) : "memory"); }
    """
    void _keep "shmkv__keep"(void *p) nogil


def bench_alloc_free(Segment cache, uint64_t iters=1000000, bint shared=False):
    """Kernel-only ns per block alloc+free, no Python in the loop.  By default through
    the path reserve()/free() take (this process's own block cache); shared=True: the
    shared free stack under the pool lock."""
    cdef shmkv_ctx_t *c = cache._c()
    cdef double r
    cdef int sh = shared
    with nogil:
        r = shmkv_bench_alloc_free(c, iters, sh)
    if r < 0:
        raise CacheFullError("bench_alloc_free: no free block")
    return r


def bench_memcpy(uint64_t nbytes, uint64_t iters=1000, uint64_t span=0, bint streaming=False):
    """ns per plain memcpy of nbytes (the physical floor), src/dst walking `span` bytes
    (default nbytes: hot; larger than the last-level cache: cold).  streaming=True: the
    copy with streaming (non-temporal) stores that big appends and gathers use."""
    if span < nbytes:
        span = nbytes
    cdef uint8_t *src = <uint8_t *>malloc(span + 64)
    cdef uint8_t *dst = <uint8_t *>malloc(span + 64)
    cdef double r
    if src == NULL or dst == NULL:
        free(src); free(dst)
        raise MemoryError()
    memset(src, 1, span)
    memset(dst, 2, span)
    _keep(dst)      # or the compiler drops the memset and the timed loop pays the faults
    with nogil:
        r = shmkv_bench_memcpy(dst, src, nbytes, span, iters, streaming)
    free(src); free(dst)
    return r


def bench_append_rows(Segment cache, k, v, slots, uint64_t iters=1000):
    """ns per write of one token into every layer's K and V pool at the rows where the
    paged layout puts ``slots[i % len(slots)]`` -- the layout-matched floor of a decode
    append (the same 2 * num_layers rows in one strided C copy, no lock, no table).
    k, v: C-contiguous [num_layers, 1, heads, dim] of the pool's dtype; slots: slot ids the
    caller owns (e.g. from reserve), written over."""
    cdef shmkv_ctx_t *c = cache._c()
    shape = (c.cfg.num_layers, 1, c.cfg.num_kv_heads, c.cfg.head_dim)
    cdef cnp.ndarray ka = cache._array(k, "k", 4), va = cache._array(v, "v", 4)
    got = ((<object>ka).shape, (<object>va).shape)
    if got != (shape, shape):
        raise ValueError(f"k, v: expected shape {shape}, got {got[0]}, {got[1]}")
    cdef cnp.ndarray sl = np.ascontiguousarray(slots, dtype=np.int64)
    cdef int64_t nslots = <int64_t>c.cfg.num_blocks * c.cfg.block_size
    if sl.ndim != 1 or sl.shape[0] == 0 or sl.min() < 0 or sl.max() >= nslots:
        raise ValueError(f"slots: expected a non-empty 1-d array of slot ids in [0, {nslots})")
    if iters == 0:
        raise ValueError("iters: expected >= 1, got 0")
    cdef double r
    cdef const uint8_t *kp = <const uint8_t *>cnp.PyArray_DATA(ka)
    cdef const uint8_t *vp = <const uint8_t *>cnp.PyArray_DATA(va)
    cdef const int64_t *sp = <const int64_t *>cnp.PyArray_DATA(sl)
    cdef uint64_t n = <uint64_t>sl.shape[0]
    with nogil:
        r = shmkv_bench_rows(c, kp, vp, sp, n, iters)
    return r


# --------------------------------------------------------------------------------------
# the ABI, for tools that read raw segment bytes (fuzzers, debuggers): sizes and field
# offsets straight from the C structs, so no Python constant can drift from _layout.h
# --------------------------------------------------------------------------------------
cdef dict _fields(const char *base, list spec):
    cdef size_t b0 = <size_t>base
    return {name: (addr - b0, fmt) for name, addr, fmt in spec}


def struct_layout():
    """Sizes and field offsets of the segment's C structs.

    Returns a dict: ``header`` (offsets from the segment start), ``shared`` (offsets
    from the segment start too), ``seq``, ``proc``, ``block``, ``index`` (offsets inside
    one element), each ``{"size": bytes, "fields": {name: (offset, struct format)}}``;
    array fields give the offset of element 0.  ``config`` and ``layout`` name the
    header sub-structs' fields in order.
    """
    cdef shmkv_header_t h
    cdef shmkv_shared_t sh
    cdef shmkv_seq_t q
    cdef shmkv_proc_t p
    cdef shmkv_block_t b
    cdef shmkv_index_t e
    cdef const char *hb = <const char *>&h
    cdef size_t shoff = SHMKV_SHARED_OFFSET
    cfg_names = ["num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks",
                 "max_seqs", "max_blocks_per_seq", "max_procs", "dtype", "itemsize",
                 "hash_algo", "_reserved"]
    lay_names = ["token_bytes", "block_bytes", "layer_stride", "index_capacity",
                 "off_blocks", "off_free", "off_procs", "off_seqs", "off_seq_free",
                 "off_tables", "off_tokens", "off_index", "off_kpool", "off_vpool",
                 "segment_size"]
    header = _fields(hb, [
        ("magic", <size_t>&h.magic, "Q"), ("layout_version", <size_t>&h.layout_version, "I"),
        ("header_size", <size_t>&h.header_size, "I"),
        ("abi_fingerprint", <size_t>&h.abi_fingerprint, "Q"),
        ("segment_size", <size_t>&h.segment_size, "Q"), ("config", <size_t>&h.config, "I"),
        ("layout", <size_t>&h.layout, "Q"), ("creator_pid", <size_t>&h.creator_pid, "Q"),
        ("create_time_ns", <size_t>&h.create_time_ns, "Q"),
        ("hash_seed", <size_t>&h.hash_seed, "Q"), ("checksum", <size_t>&h.checksum, "Q")])
    shared = {k: (v[0] + shoff, v[1]) for k, v in _fields(<const char *>&sh, [
        ("state", <size_t>&sh.state, "I"), ("pool_lock", <size_t>&sh.pool_lock, "B"),
        ("free_top", <size_t>&sh.free_top, "I"), ("cached_count", <size_t>&sh.cached_count, "I"),
        ("lru_head", <size_t>&sh.lru_head, "I"), ("lru_tail", <size_t>&sh.lru_tail, "I"),
        ("seq_free_top", <size_t>&sh.seq_free_top, "I"),
        ("num_procs", <size_t>&sh.num_procs, "I"), ("peak_used", <size_t>&sh.peak_used, "I"),
        ("index_used", <size_t>&sh.index_used, "I"), ("index_tombs", <size_t>&sh.index_tombs, "I"),
        ("lru_clock", <size_t>&sh.lru_clock, "Q"),
        ("last_recovery_ns", <size_t>&sh.last_recovery_ns, "Q"),
        ("max_recovery_ns", <size_t>&sh.max_recovery_ns, "Q"),
        ("counters", <size_t>&sh.counters[0], "Q")]).items()}
    seq = _fields(<const char *>&q, [
        ("state", <size_t>&q.state, "I"), ("gen", <size_t>&q.gen, "I"),
        ("owner", <size_t>&q.owner, "Q"), ("writer", <size_t>&q.writer, "Q"),
        ("len", <size_t>&q.len, "I"), ("nblocks", <size_t>&q.nblocks, "I"),
        ("hashed", <size_t>&q.hashed, "I"), ("priority", <size_t>&q.priority, "I"),
        ("last_access_ns", <size_t>&q.last_access_ns, "Q"),
        ("access_count", <size_t>&q.access_count, "Q"), ("created_ns", <size_t>&q.created_ns, "Q"),
        ("flags", <size_t>&q.flags, "I"), ("hash_ready", <size_t>&q.hash_ready, "I"),
        ("salt", <size_t>&q.salt[0], "Q"), ("trimmed", <size_t>&q.trimmed, "I"),
        ("trim_s", <size_t>&q.trim_s, "I"), ("trim_d", <size_t>&q.trim_d, "I"),
        ("trim_k", <size_t>&q.trim_k, "I"), ("trim_chunk", <size_t>&q.trim_chunk, "I"),
        ("trim_len", <size_t>&q.trim_len, "I"), ("trim_trimmed", <size_t>&q.trim_trimmed, "I")])
    proc = _fields(<const char *>&p, [
        ("state", <size_t>&p.state, "I"), ("gen", <size_t>&p.gen, "I"),
        ("pid", <size_t>&p.pid, "Q"), ("pid_start", <size_t>&p.pid_start, "Q"),
        ("attach_time_ns", <size_t>&p.attach_time_ns, "Q"),
        ("inflight", <size_t>&p.inflight[0], "I"), ("counters", <size_t>&p.counters[0], "Q"),
        ("cache_lock", <size_t>&p.cache_lock, "Q"),
        ("cache_nblocks", <size_t>&p.cache_nblocks, "I"),
        ("cache_nseqs", <size_t>&p.cache_nseqs, "I"),
        ("cache_blocks", <size_t>&p.cache_blocks[0], "I"),
        ("cache_seqs", <size_t>&p.cache_seqs[0], "I")])
    block = _fields(<const char *>&b, [
        ("ref_cnt", <size_t>&b.ref_cnt, "I"), ("flags", <size_t>&b.flags, "I"),
        ("lru_prev", <size_t>&b.lru_prev, "I"), ("lru_next", <size_t>&b.lru_next, "I"),
        ("hash", <size_t>&b.hash[0], "Q"), ("last_access", <size_t>&b.last_access, "Q"),
        ("num_tokens", <size_t>&b.num_tokens, "I")])
    index = _fields(<const char *>&e, [
        ("hash", <size_t>&e.hash[0], "Q"), ("block", <size_t>&e.block, "I")])
    return dict(
        header=dict(size=sizeof(shmkv_header_t), fields=header),
        shared=dict(size=sizeof(shmkv_shared_t), fields=shared,
                    pool_lock_size=sizeof(sh.pool_lock), counters=32),
        seq=dict(size=sizeof(shmkv_seq_t), fields=seq),
        proc=dict(size=sizeof(shmkv_proc_t), fields=proc, inflight=SHMKV_INFLIGHT_PER_PROC,
                  counters=SHMKV_PROC_COUNTERS, cache_blocks=SHMKV_PCACHE_BLOCKS,
                  cache_seqs=SHMKV_PCACHE_SEQS),
        block=dict(size=sizeof(shmkv_block_t), fields=block),
        index=dict(size=sizeof(shmkv_index_t), fields=index),
        config=cfg_names, layout=lay_names)


# --------------------------------------------------------------------------------------
# The C API of _core for sibling extension modules (declared in _core.pxd)
# --------------------------------------------------------------------------------------
cdef shmkv_ctx_t *segment_ctx(object seg) except NULL:
    """The context of an open Segment (registering this process on first use)."""
    if not isinstance(seg, Segment):
        raise TypeError(f"cache: expected a KVCache, got {type(seg).__name__}")
    return (<Segment>seg)._c()


cdef int raise_status(int st, str what) except -1:
    return _raise(st, what)


cdef int lock_seqs(shmkv_ctx_t *c, const int64_t *sids, Py_ssize_t n,
                   uint32_t *slots, uint32_t *lens) except -1:
    """Takes the sequence lock of each of sids[0..n) -- DISTINCT ids, sorted by the caller
    in ascending slot order (sid % max_seqs), the one lock order of batch readers -- and
    reads each length (checked against the table: never trust the segment).  On any error
    every lock taken is released and the error raised; nothing else changes."""
    cdef Py_ssize_t i = 0, j
    try:
        while i < n:
            _seq_lock(c, sids[i], &slots[i])
            i += 1
            lens[i - 1] = <uint32_t>_valid_len(c, slots[i - 1], sids[i - 1])
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
