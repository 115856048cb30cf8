"""shmkv.tier.redis: RedisTier, a remote tier on Redis Cluster shared by hosts (extra
``shmkv[redis]``); imported from ``shmkv.tier`` (or ``shmkv.RedisTier``).

::

    tier = shmkv.RedisTier("redis://127.0.0.1:7000", cluster=True)  # any node of the cluster
    cache.set_tier(tier)          # write published blocks through, extend prefix hits
    cache.flush_tier(timeout=10)  # wait until queued writes are stored; -> blocks written
    cache.set_tier(None)          # off

**Write-through.** When ``append(..., tokens=)`` or ``commit()`` publishes full blocks,
the handle puts their 128-bit hashes on this tier's bounded queue (no copy, no network on
the caller's thread; a full queue drops the write, counted).  A background thread takes
batches off the queue, pins the blocks by hash (a sequence holding them, as a prefix hit
does, so none is reused while it reads), gathers each block's K, V and token ids into a
value (see codec.py), drops the pin and stores the batch with pipelined ``SET``s.

**Reads.** ``create_sequence(tokens=)`` and ``match_prefix(tokens)`` ask the tier for the
blocks after the local hit, a window at a time (4, 8, 16 pipelined ``GET``s; the next
window is asked for while the current one is checked and landed), stop
at the first block it lacks, check each value whole (size, magic, fingerprint, block
hash, token ids, checksum) before any of it lands, and append it to the sequence with
its token ids: the block is published locally, for every process of the host.  A
quantized pool's value carries the codes (and an int8 pool's scale rows; a float8 pool's
scale table is in the fingerprint) and lands as its dequantized float32 values, which the
pool's quantizer turns back into exactly those codes and scales.
``match_prefix`` loads into a temporary sequence it frees again (the blocks stay cached).
A full pool stops the load: the call keeps the whole blocks it got, nothing leaks.

**Faults.** Every network call is bounded (connect and socket timeouts), and so is a
whole lookup: past ``deadline`` (1 s) no further window is asked for, and the blocks
landed so far are the hit (a slow link costs a lookup the deadline and one round trip,
not one round trip per window).  A refused or closed connection or a reply that says the
cluster's map moved (a failover, a reshard) is retried once at once, on the topology read
anew from every node known; what still fails is counted (``tier_errors``) and opens a
circuit breaker -- one for reads, one for writes: a failed lookup does not drop the
writes -- local-only for a back-off (0.5 s, doubling to 5 s), then one try.  The writer
holds a batch that failed through the back-off and tries it again (twice), so an idle
host's first writes after a failover are stored, not dropped.  Nothing in this path raises
into the caller (but KeyboardInterrupt and friends).

Counters are the segment's (``stats()``, ``shmkv info``, ``shmkv metrics``), summed over
every process of the host that has a tier set: ``tier_hits`` (blocks loaded),
``tier_misses`` (lookups that ended on an absent, corrupt, truncated or foreign value),
``tier_errors``, ``tier_bytes_in``, ``tier_bytes_out``.  ``RedisTier.stats()`` has this
process's detail (why values were refused, writes dropped, ...).
"""
from __future__ import annotations

import collections
import os
import queue
import threading
import time
import weakref
from typing import Any, Dict, List, Optional

import numpy as np

from ..errors import CacheFullError
from .client import TierIOError, Transport, _seeds
from .codec import Layout, scale_table

__all__ = ["RedisTier"]

_PAGE = 4096
_WRITE_RETRIES = 2          # a write batch that failed is tried this many times more


def _value_buffer(layout: Layout) -> np.ndarray:
    """A value-sized uint8 array whose K part starts on a page boundary (the pool's
    alignment: gather copies run clear of 4K aliasing)."""
    lead = 64 + layout.tok_bytes
    raw = np.empty(layout.size + _PAGE, np.uint8)
    off = (-(raw.ctypes.data + lead)) % _PAGE
    return raw[off:off + layout.size]


class _Breaker:
    """After a failure, local-only for a back-off that doubles up to a cap."""

    def __init__(self, base: float, cap: float) -> None:
        self.base, self.cap = base, cap
        self.delay = base
        self.until = 0.0

    def open(self) -> bool:
        return time.monotonic() < self.until

    def fail(self) -> None:
        self.until = time.monotonic() + self.delay
        self.delay = min(self.delay * 2, self.cap)

    def ok(self) -> None:
        self.delay = self.base


class RedisTier:
    """A remote tier on a Redis Cluster (or, with ``cluster=False``, one Redis server).

    Parameters
    ----------
    url : str
        ``redis://host:port`` of any node of the cluster, or of several
        (``redis://h1:p1,h2:p2``): the first that answers gives the cluster's map, so a
        client starting while one of them is down still finds the others.
    cluster : bool
        The server is a Redis Cluster (default).
    timeout : float
        Socket timeout of every call, seconds (default 1.0).
    connect_timeout : float
        Seconds (default 0.5).
    ttl : int, optional
        Seconds each stored block lives (``SET ... EX``); default: until the server's
        ``maxmemory`` policy evicts it (configure ``allkeys-lru``).
    max_queue : int
        Publish events the write-through queue holds; past it writes are dropped
        (counted in ``tier_errors``): the decode loop never waits (default 4096).
    batch_blocks : int
        Blocks per write batch (pipelined, pinned at once; default 16).
    max_window : int
        Most blocks asked for in one read round trip (default 16; two windows of value
        buffers are kept per handle: the next window is asked for while one is landed).
    backoff : (float, float)
        The circuit breaker's first and longest back-off, seconds (default 0.5, 5.0).
    close_timeout : float
        What ``set_tier(None)`` and ``close()`` give queued writes (default 5.0 s).
    deadline : float
        Seconds a lookup asks for new windows (default 1.0): a lookup takes at most this
        and one round trip (``timeout`` at worst); what it landed by then is the hit.

    Notes
    -----
    Connects lazily: a cluster that is down now is a counted error later, not an
    exception here.  One object may serve several handles (each gets its own queue,
    writer thread and connections).
    """

    def __init__(self, url: str = "redis://127.0.0.1:7000", *, cluster: bool = True,
                 timeout: float = 1.0, connect_timeout: float = 0.5,
                 ttl: Optional[int] = None, max_queue: int = 4096, batch_blocks: int = 16,
                 max_window: int = 16, backoff: tuple[float, float] = (0.5, 5.0),
                 close_timeout: float = 5.0, deadline: float = 1.0) -> None:
        # redis-py is the topology client: fail here, not in a hook (ImportError naming the
        # extra), and warn once for a version outside the tested range
        from .._compat import check

        check("redis", what="shmkv.RedisTier")
        if not (timeout > 0 and connect_timeout > 0 and deadline > 0):
            raise ValueError(f"timeout, connect_timeout, deadline: expected > 0, got "
                             f"{timeout}, {connect_timeout}, {deadline}")
        if max_queue < 1 or batch_blocks < 1 or max_window < 1:
            raise ValueError("max_queue, batch_blocks, max_window: expected >= 1")
        _seeds(url)                           # ValueError now for a malformed URL
        self.url = url
        self.cluster = cluster
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.ttl = ttl
        self.max_queue = max_queue
        self.batch_blocks = batch_blocks
        self.max_window = max_window
        self.backoff = backoff
        self.close_timeout = close_timeout
        self.deadline = deadline
        self._stats: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._idle: List[Transport] = []      # readers of closed bindings, kept warm
        self._pid = os.getpid()

    def transport(self) -> Transport:
        return Transport(self.url, cluster=self.cluster, timeout=self.timeout,
                         connect_timeout=self.connect_timeout)

    def _take_reader(self) -> Transport:
        """A reader transport: a warm one a closed binding gave back (its topology,
        sockets and value buffers), else a new one."""
        with self._lock:
            if self._pid != os.getpid():          # a forked child: none of these is ours
                self._idle, self._pid = [], os.getpid()
            if self._idle:
                return self._idle.pop()
        return self.transport()

    def _give_reader(self, t: Transport) -> None:
        with self._lock:
            if self._pid == os.getpid() and len(self._idle) < 4:
                self._idle.append(t)
                return
        t.close()

    def close(self) -> None:
        """Closes the connections kept warm (the handles using the tier keep theirs)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for t in idle:
            t.close()

    def _bind(self, cache: Any, port: Any, read: bool = True,
              write: bool = True) -> "_Binding":
        """What ``cache.set_tier(self)`` calls: ``port`` (shmkv._prefix.TierPort) is all
        the tier does to the cache beyond its public API."""
        return _Binding(self, cache, port, read, write)

    def _count(self, **kw: int) -> None:
        with self._lock:
            self._stats.update(kw)

    def stats(self) -> Dict[str, int]:
        """This process's detail: hits, misses (and why: absent, size, magic, foreign,
        hash, tokens, checksum, nonfinite: a quantized value's codes or scales that are
        NaN or inf), errors, bytes_in/out, written, dropped (writes not
        made: queue full, a batch that failed three times, block gone before the writer
        pinned it), retried (calls tried again on a topology read anew), pool_full
        (loads stopped by a full pool), skipped (lookups while the read breaker was
        open), deadline (lookups cut short by ``deadline``)."""
        with self._lock:
            return dict(self._stats)

    def __repr__(self) -> str:
        return f"RedisTier({self.url!r}, cluster={self.cluster})"


class _Binding:
    """One handle's use of a tier: its layout, queue, writer thread, connections."""

    def __init__(self, tier: RedisTier, cache: Any, port: Any, read: bool = True,
                 write: bool = True) -> None:
        self.tier = tier
        self.port = port              # pin, count, hashes, layout (shmkv._prefix.TierPort)
        self.read = read              # the handle's hits extend from the tier
        self.write = write            # what the handle publishes is written through
        self.layout = Layout.of(cache, port)
        self.fbufs: Optional[tuple[np.ndarray, np.ndarray]] = None   # quantized loads
        self.cache_ref = weakref.ref(cache)
        self.rbreaker = _Breaker(*tier.backoff)    # reads and writes fail apart: a
        self.wbreaker = _Breaker(*tier.backoff)    # failed lookup drops no write
        self.reader = tier._take_reader()
        self.rlock = threading.Lock()
        self.rbufs: List[np.ndarray] = self.reader.bufs.setdefault(self.layout.size, [])
        self.rbufs2: List[np.ndarray] = self.reader.bufs.setdefault(-self.layout.size, [])
        self.q: queue.Queue[Optional[np.ndarray]] = queue.Queue(tier.max_queue)
        self.cond = threading.Condition()
        self.enqueued = 0
        self.done = 0
        self.written = 0
        self.seen: Dict[bytes, None] = {}
        self.seen_max = 1 << 16
        self.seen_lock = threading.Lock()
        self.thread: Optional[threading.Thread] = None
        self.pid = os.getpid()
        self.closed = False
        self.local = threading.local()       # .loading: this thread is landing tier blocks

    # ---- bookkeeping ---------------------------------------------------------------
    def _count(self, cache: Any, *, hits: int = 0, misses: int = 0, errors: int = 0,
               bytes_in: int = 0, bytes_out: int = 0, **detail: int) -> None:
        try:
            self.port.count(hits, misses, errors, bytes_in, bytes_out)
        except Exception:
            pass
        self.tier._count(hits=hits, misses=misses, errors=errors, bytes_in=bytes_in,
                         bytes_out=bytes_out, **detail)

    def _current(self, cache: Any) -> Layout:
        """The layout now: a float8 pool's scale table is part of its fingerprint, and
        set_kv_scales may change it after set_tier (the keys follow it)."""
        lay = self.layout
        if lay.float8:
            table = scale_table(cache)
            if table is not None and (lay.table is None
                                      or not np.array_equal(table, lay.table)):
                lay = self.layout = Layout(lay.info, lay.dtype, table)
        return lay

    def _seen(self, key: bytes) -> bool:
        return key in self.seen

    def _mark(self, key: bytes) -> None:
        with self.seen_lock:
            self.seen[key] = None
            if len(self.seen) > self.seen_max:
                del self.seen[next(iter(self.seen))]

    def _forked(self) -> None:
        """In a child after os.fork(): no writer thread, sockets not ours."""
        self.pid = os.getpid()
        self.thread = None
        self.q = queue.Queue(self.tier.max_queue)
        self.cond = threading.Condition()
        self.enqueued = self.done = 0
        self.rlock = threading.Lock()
        self.reader = self.tier.transport()
        self.rbufs = []
        self.rbufs2 = []

    # ---- write-through: the caller's side -------------------------------------------
    def enqueue(self, hashes: np.ndarray) -> None:
        """Called by the handle (append / commit) with the hashes of blocks it just
        published, under that sequence's lock: a queue put, nothing more."""
        try:
            if self.closed or getattr(self.local, "loading", False):
                return                        # (blocks the tier itself just gave us)
            if self.pid != os.getpid():
                self._forked()
            self.q.put_nowait(hashes)
            with self.cond:
                self.enqueued += 1
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="shmkv-tier-writer",
                                               daemon=True)
                self.thread.start()
        except queue.Full:
            cache = self.cache_ref()
            if cache is not None:
                self._count(cache, errors=1, dropped=len(hashes))
        except Exception:
            pass

    def flush(self, timeout: float = 10.0) -> int:
        """Waits until every write queued before the call is done (stored, or dropped
        and counted), at most ``timeout`` s.  Returns the blocks written so far."""
        if self.pid != os.getpid():
            self._forked()
        deadline = time.monotonic() + max(0.0, float(timeout))
        with self.cond:
            target = self.enqueued
            while self.done < target and self.thread is not None and self.thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(min(left, 0.05))
            return self.written

    def close(self) -> None:
        """Flushes (for the tier's close_timeout), stops the writer, closes sockets."""
        if self.closed:
            return
        try:
            self.flush(self.tier.close_timeout)
        finally:
            self.closed = True
            if self.thread is not None and self.pid == os.getpid():
                try:
                    self.q.put_nowait(None)
                except queue.Full:
                    pass
                self.thread.join(timeout=self.tier.timeout * 4 + 1)
            self.thread = None
            if self.pid == os.getpid():
                self.tier._give_reader(self.reader)
            else:
                self.reader.close()

    # ---- write-through: the writer thread -------------------------------------------
    def _run(self) -> None:
        wt = self.tier.transport()
        bufs: List[np.ndarray] = []
        try:
            while True:
                item = self.q.get()
                items = [] if item is None else [item]
                stop = item is None
                while not stop and len(items) < 256:
                    try:
                        nxt = self.q.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        stop = True
                    else:
                        items.append(nxt)
                try:
                    if items:
                        self._write(wt, bufs, items)
                except Exception:
                    cache = self.cache_ref()
                    if cache is not None:
                        self._count(cache, errors=1)
                finally:
                    with self.cond:
                        self.done += len(items)
                        self.cond.notify_all()
                if stop:
                    return
        finally:
            wt.close()

    def _write(self, wt: Transport, bufs: List[np.ndarray], items: List[np.ndarray]) -> None:
        cache = self.cache_ref()
        if cache is None or cache.closed:
            return
        lay = self._current(cache)
        bs = lay.block_size
        todo = []
        batch: set[bytes] = set()
        for h in np.concatenate(items):
            key = lay.key(int(h[0]), int(h[1]))
            if not self._seen(key) and key not in batch:
                batch.add(key)
                todo.append((h, key))
        if not todo:
            return
        failures = 0
        while todo:
            if not self._wait_breaker():
                self._count(cache, dropped=len(todo))      # closing: what is left
                return
            chunk = todo[:self.tier.batch_blocks]
            arr = np.ascontiguousarray(np.array([h for h, _ in chunk], np.uint64))
            sid, n = self.port.pin(arr)
            if sid < 0:                           # no sequence slot for the pin right now
                self._count(cache, dropped=len(todo))
                return
            keys, vals = [], []
            try:
                while len(bufs) < n:
                    bufs.append(_value_buffer(lay))
                for j in range(n):
                    buf = bufs[j]
                    toks, k, v = lay.views(buf)
                    if lay.quantized:             # codes (+ int8 scale rows), as stored
                        lay.fill(buf, cache.gather(sid, j * bs, (j + 1) * bs, raw=True))
                    else:
                        cache.gather(sid, j * bs, (j + 1) * bs, out=(k, v))
                    toks[:] = cache.token_ids(sid, j * bs, (j + 1) * bs)
                    h0, h1 = int(chunk[j][0][0]), int(chunk[j][0][1])
                    lay.seal(buf, h0, h1)
                    keys.append(chunk[j][1])
                    vals.append(buf)
            finally:
                cache.free(sid)
            sent = chunk[:n]
            if n < len(chunk):                    # block n was reused before we pinned it
                self._count(cache, dropped=1)
                todo = todo[n + 1:]
            else:
                todo = todo[n:]
            if not keys:
                continue
            retries = wt.retries
            try:
                stored = wt.set_many(keys, vals, self.tier.ttl)
            except TierIOError:
                self.wbreaker.fail()
                failures += 1
                self._count(cache, errors=1)
                if failures > _WRITE_RETRIES:
                    self._count(cache, dropped=len(keys) + len(todo))
                    return
                todo = sent + todo                # again once the back-off is over
                continue
            self.wbreaker.ok()
            if wt.retries > retries:
                self.tier._count(retried=wt.retries - retries)
            for key in keys:
                self._mark(key)
            self._count(cache, bytes_out=stored * lay.size, written=stored)
            with self.cond:
                self.written += stored

    def _wait_breaker(self) -> bool:
        """Waits (the writer thread) until the write breaker lets a try through; False
        when the binding closes meanwhile."""
        while self.wbreaker.open():
            if self.closed:
                return False
            time.sleep(min(0.05, max(0.0, self.wbreaker.until - time.monotonic())))
        return True

    # ---- reads -----------------------------------------------------------------------
    def _ask(self, lay: Layout, hashes: np.ndarray, first: int, n: int,
             bufs: List[np.ndarray]) -> tuple[int, int, List[bytes], Any]:
        """Sends the GETs of blocks [first, first + n) (replies into bufs later)."""
        n = min(n, self.tier.max_window)
        while len(bufs) < n:
            bufs.append(_value_buffer(lay))
        keys = [lay.key(int(hashes[first + j, 0]), int(hashes[first + j, 1]))
                for j in range(n)]
        return first, n, keys, self.reader.get_send(keys)

    def extend(self, cache: Any, sid: Optional[int], ids: np.ndarray, salt: Any,
               hashes: np.ndarray, hits: int) -> int:
        """Extends a local hit of ``hits`` blocks (of ``len(hashes)`` full blocks of
        ``ids``) with the tier's consecutive blocks: appended to ``sid``, or, for
        match_prefix (sid None), to a temporary sequence freed afterwards.  Returns the
        blocks findable now.  Never raises an Exception."""
        try:
            if self.closed or self.rbreaker.open():
                self.tier._count(skipped=1)
                return hits
            if self.pid != os.getpid():
                self._forked()
            with self.rlock:
                self.local.loading = True
                try:
                    return self._extend(cache, sid, ids, salt, hashes, hits)
                finally:
                    self.local.loading = False
        except Exception:
            self._count(cache, errors=1)
            return hits

    def _extend(self, cache: Any, sid: Optional[int], ids: np.ndarray, salt: Any,
                hashes: np.ndarray, hits: int) -> int:
        lay = self._current(cache)
        bs = lay.block_size
        nfull = len(hashes)
        if lay.quantized and (self.fbufs is None or self.fbufs[0].shape != lay.shape):
            self.fbufs = (np.empty(lay.shape, np.float32), np.empty(lay.shape, np.float32))
        tmp = None
        if sid is None:
            # (nfull of these tokens is exactly hits: no tier lookup inside)
            tmp = cache.create_sequence(tokens=ids[:hits * bs + 1], salt=salt)
            target = tmp
            start = int(cache.seq_len(tmp)) // bs
        else:
            target = sid
            start = int(hits)
        i: int = start
        sets: List[List[np.ndarray]] = [self.rbufs, self.rbufs2]
        pending = None                        # (first block, n, keys, request) sent ahead
        until = time.monotonic() + self.tier.deadline
        retried = False
        try:
            window = 4
            while i < nfull:
                try:
                    if pending is None:
                        if i > start and time.monotonic() > until:
                            self.tier._count(deadline=1)
                            return i          # the rest: a miss (computed by the caller)
                        pending = self._ask(lay, hashes, i, min(window, nfull - i), sets[0])
                    first, n, keys, req = pending
                    pending = None
                    bufs = sets[0][:n]
                    kinds = self.reader.get_recv(req, [b.data for b in bufs])
                    if not retried and Transport.moved(kinds):
                        raise TierIOError("a node said the cluster's map moved")
                    window *= 2
                    nxt = first + n
                    if (nxt < nfull and all(k == "bulk" for k in kinds)
                            and time.monotonic() <= until):
                        # the next window goes out now: the servers answer while the
                        # values of this one are checked and landed (double buffering)
                        pending = self._ask(lay, hashes, nxt, min(window, nfull - nxt),
                                            sets[1])
                except TierIOError as e:
                    if e.retry and not retried:
                        # once, at once, on the topology read anew (the failure closed
                        # every socket: nothing is in flight): a failover, a reshard
                        retried = True
                        pending = None
                        self.tier._count(retried=1)
                        continue
                    self.rbreaker.fail()
                    self._count(cache, errors=1)
                    return i
                self.rbreaker.ok()
                got = sum(lay.size for k in kinds if k == "bulk")
                loaded = 0
                stop = None
                for j in range(n):
                    h0, h1 = int(hashes[i, 0]), int(hashes[i, 1])
                    toks = ids[i * bs:(i + 1) * bs]
                    if kinds[j] != "bulk":
                        stop = {"nil": "absent", "size": "size"}.get(kinds[j], "server_error")
                        break
                    why = lay.check(bufs[j], h0, h1, toks)
                    if why is not None:
                        stop = why
                        break
                    _, k, v = lay.views(bufs[j])
                    if self.fbufs is not None and lay.quantized:
                        # code * scale: append quantizes it back to the same codes and
                        # scales (a NaN/inf there is a ValueError before anything lands)
                        lay.dequantize(bufs[j], self.fbufs)
                        k, v = self.fbufs
                    try:
                        cache.append(target, k, v, tokens=toks)
                    except CacheFullError:
                        stop = "pool_full"
                        break
                    except ValueError:
                        if not lay.quantized:         # (a bug, not a value: counted error)
                            raise
                        stop = "nonfinite"
                        break
                    self._mark(keys[j])
                    loaded += 1
                    i += 1
                if loaded:
                    self._count(cache, hits=loaded, bytes_in=got)
                elif got:
                    self._count(cache, bytes_in=got)
                if stop is not None:
                    if pending is not None:           # drain what was asked ahead
                        try:
                            self.reader.get_recv(pending[3],
                                                 [b.data for b in sets[1][:pending[1]]])
                        except TierIOError:
                            self.rbreaker.fail()
                        pending = None
                    if stop == "pool_full":
                        self.tier._count(pool_full=1)
                    elif stop == "server_error":
                        self._count(cache, errors=1)
                    else:
                        self._count(cache, misses=1, **{stop: 1})
                    return i
                sets.reverse()
            return i
        finally:
            if tmp is not None:
                cache.free(tmp)
