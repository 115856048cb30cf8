# cython: language_level=3, binding=False
# binding=False: the methods of the cdef classes are method descriptors, which check
# self; Cython 3's cyfunctions do not (KVCache.unlink("name") crashed the interpreter).
"""shmkv._events: the KV event ring, read lock-free, and the prefix-index reset.

Owns: ``read(cache, since, max_events)`` behind ``KVCache.events``, ``EventReader`` (the
same read over a read-only mapping of a segment by name, for the CLI: no attach, no
lock, nothing written), ``reset_prefix_cache(cache)`` behind
``KVCache.reset_prefix_cache`` and ``ring_info`` (head, capacity) for ``shmkv info``.

Writes: nothing but through ``reset_prefix_cache`` (under pool_lock: the "cleared" event,
the hash index, the LRU list and block hash flags, see kernels/events.h).  The ring's
records are written by the kernels of the other modules (publish, LRU reuse, recovery).

Every record is copied out under the seqlock protocol of _layout.h ("KV events") before
anything in it is used, and every field of the copy is checked (kind, token count)
against the trusted config: a corrupt or hostile ring gives lost events, never a crash.
"""
import os

from libc.stdint cimport uint8_t, uint32_t, uint64_t, int32_t, int64_t
from libc.stdlib cimport malloc, free

from shmkv._core cimport *

from ._core import _map_readonly, _norm_name, _open_existing
from .events import Event, EventBatch

bind_debug_state()     # it compiles the kernels too: their switches are _core's

cdef tuple _KINDS = (None, "stored", "removed", "cleared")
# one read returns at most this many events (the caller asks again from next_seq)
DEFAULT_MAX_EVENTS = 65536


cdef int64_t _since_arg(object since) except -1:
    if isinstance(since, bool) or not isinstance(since, int):
        try:
            import numpy as np
            if isinstance(since, np.integer):
                since = int(since)
            else:
                raise TypeError
        except TypeError:
            raise TypeError(f"since: expected int, got {type(since).__name__}") from None
    if since < 0 or since >= 1 << 63:
        raise ValueError(f"since: expected a sequence number >= 0, got {since}")
    return <int64_t>since


cdef object _read(const shmkv_ctx_t *c, object since_obj, object max_events):
    """Events [since, head) of the ring, at most max_events; -> EventBatch."""
    cdef uint64_t since = <uint64_t>_since_arg(since_obj)
    cdef uint64_t limit = DEFAULT_MAX_EVENTS
    cdef uint64_t head, lo, seq, lost = 0, cap = c.cfg.event_capacity
    cdef uint64_t stop
    cdef uint32_t bs = c.cfg.block_size, ntok, i
    cdef uint8_t *buf
    cdef shmkv_event_t *e
    cdef const int32_t *tok
    if max_events is not None:
        if isinstance(max_events, bool) or not isinstance(max_events, int):
            raise TypeError(f"max_events: expected int or None, got {type(max_events).__name__}")
        if max_events < 1:
            raise ValueError(f"max_events: expected >= 1, got {max_events}")
        limit = <uint64_t>min(max_events, 1 << 40)
    if c.events == NULL:
        return EventBatch([], 0, 0)
    head = shmkv_event_head(c)
    if since >= head:
        return EventBatch([], head, 0)      # nothing yet (a cursor past head comes back)
    lo = head - cap if head > cap else 0
    if since < lo:
        lost = lo - since
        since = lo
    stop = head if head - since <= limit else since + limit
    out = []
    buf = <uint8_t *>malloc(c.lay.event_record_bytes)
    if buf == NULL:
        raise MemoryError()
    try:
        e = <shmkv_event_t *>buf
        tok = <const int32_t *>(buf + sizeof(shmkv_event_t))
        for seq in range(since, stop):
            if not shmkv_event_read(c, seq, buf) or e.kind < SHMKV_EV_STORED \
                    or e.kind > SHMKV_EV_CLEARED:
                # overwritten while we read (writers lapped us), or not an event: the
                # ones before it are overwritten by now too -- count them lost, so that
                # what we return stays contiguous (events[i].seq == since + lost + i)
                lost += len(out) + 1
                out = []
                continue
            if e.kind == SHMKV_EV_CLEARED:
                out.append(Event(seq, "cleared", [], None, [], bs, e.time_ns, -1))
                continue
            ntok = e.num_tokens if e.kind == SHMKV_EV_STORED else 0
            if ntok > bs:
                ntok = bs
            out.append(Event(
                seq, _KINDS[e.kind], [e.hash[0]],
                e.parent[0] if e.flags & SHMKV_EVF_PARENT else None,
                [tok[i] for i in range(ntok)], bs, e.time_ns,
                e.block if e.block < c.cfg.num_blocks else -1))
    finally:
        free(buf)
    return EventBatch(out, stop, lost)


def read(Segment cache, since=0, max_events=None):
    """``KVCache.events``: see its docstring."""
    return _read(ctx_of(cache), since, max_events)


def ring_info(Segment cache):
    """(head, capacity) of a handle's ring: events written so far and kept at most."""
    cdef shmkv_ctx_t *c = ctx_of(cache)
    return shmkv_event_head(c), c.cfg.event_capacity


def reset_prefix_cache(Segment cache):
    """``KVCache.reset_prefix_cache``: see its docstring."""
    cdef shmkv_ctx_t *c = ctx_of(cache)
    cdef uint64_t n
    pool_lock(c)
    n = shmkv_prefix_reset_locked(c)
    shmkv_pool_unlock(c)
    return n


cdef class EventReader:
    """The event ring of a segment, by name, over a read-only mapping: no attach, no
    lock, nothing written (the CLI's reader; it works after every process died).

    ``EventReader(name)``; ``.read(since, max_events)`` as ``KVCache.events``;
    ``.head``, ``.capacity``, ``.block_size``; ``close()``.

    Raises FileNotFoundError, PermissionError or SegmentError.
    """
    cdef shmkv_ctx_t ctx
    cdef _Mapping mapping
    cdef readonly object name

    def __init__(self, name):
        cdef _Mapping m
        name = _norm_name(name)
        fd = _open_existing(name, True)
        try:
            m = _map_readonly(fd, name)
        finally:
            os.close(fd)
        st = shmkv_ctx_bind(&self.ctx, m.base, m.size, 1)
        if st != SHMKV_OK:
            raise_status(st, name)
        self.mapping = m
        self.name = name

    cdef shmkv_ctx_t *_c(self) except NULL:
        if self.mapping is None:
            raise ValueError("EventReader is closed")
        return &self.ctx

    def read(self, since=0, max_events=None):
        return _read(self._c(), since, max_events)

    @property
    def head(self):
        return shmkv_event_head(self._c())

    @property
    def capacity(self):
        return self._c().cfg.event_capacity

    @property
    def block_size(self):
        return self._c().cfg.block_size

    def close(self):
        self.mapping = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
