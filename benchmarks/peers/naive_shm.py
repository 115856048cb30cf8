"""The naive shared cache a Python programmer builds from the standard library.

Blocks live in one ``multiprocessing.shared_memory.SharedMemory`` (a numpy view
[2, layers, num_blocks * block_size, heads, dim]); ref counts, the free-block stack and
the sequence counter in a second one; every operation holds one ``multiprocessing.Lock``;
block tables and lengths live in a ``Manager().dict()`` (sid -> (length, block ids)), so
every table read or write is a round trip to the manager process.  Any process that has
the names, the lock and the manager proxy can share it.
"""
from __future__ import annotations

import multiprocessing as mp
from multiprocessing import shared_memory

import numpy as np

from .base import PeerError, PeerFull, check_tokens, out_arrays, pad_tables, token_range


class NaiveShmCache:
    name = "naive shm+Lock+Manager"

    def __init__(self, cfg, ctx=None):
        ctx = ctx or mp.get_context("spawn")
        self.cfg = cfg
        self.bs = cfg.block_size
        NB = cfg.num_blocks
        self._shm = []
        try:
            per = cfg.num_layers * NB * cfg.block_size * cfg.num_kv_heads * cfg.head_dim
            data = shared_memory.SharedMemory(create=True, size=2 * per * cfg.itemsize)
            self._shm.append(data)
            meta = shared_memory.SharedMemory(create=True, size=8 * (2 + 2 * NB))
            self._shm.append(meta)
            self.pool = np.ndarray((2, cfg.num_layers, NB * cfg.block_size,
                                    cfg.num_kv_heads, cfg.head_dim), cfg.numpy_dtype,
                                   buffer=data.buf)
            m = np.ndarray((2 + 2 * NB,), np.int64, buffer=meta.buf)
            self.hdr = m[:2]              # [next_sid, free_top]
            self.ref = m[2:2 + NB]
            self.stack = m[2 + NB:]
            self.stack[:] = np.arange(NB - 1, -1, -1)
            self.ref[:] = 0
            self.hdr[0] = 1
            self.hdr[1] = NB
            self.lock = ctx.Lock()
            self.manager = ctx.Manager()
            self.tables = self.manager.dict()
        except BaseException:
            self._release_shm()
            raise

    def _release_shm(self):
        self.pool = self.hdr = self.ref = self.stack = None
        for s in self._shm:
            try:
                s.close()
            finally:
                try:
                    s.unlink()
                except FileNotFoundError:
                    pass
        self._shm = []

    def close(self):
        try:
            self.tables = None
            mgr = getattr(self, "manager", None)
            if mgr is not None:
                proc = mgr._process
                mgr.shutdown()
                proc.join(5)
                if proc.is_alive():         # ended by its PID, never by name
                    proc.kill()
                    proc.join(5)
                self.manager = None
        finally:
            self._release_shm()

    # ---- helpers: caller holds self.lock -----------------------------------------------
    def _alloc(self, n):
        top = int(self.hdr[1])
        if n > top:
            raise PeerFull(f"{n} blocks wanted, {top} free")
        got = self.stack[top - n:top][::-1].tolist()
        self.hdr[1] = top - n
        self.ref[got] = 1
        return got

    def _decref(self, blocks):
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                top = int(self.hdr[1])
                self.stack[top] = b
                self.hdr[1] = top + 1

    def _entry(self, sid):
        e = self.tables.get(sid)             # one round trip to the manager
        if e is None:
            raise PeerError(sid)
        return e

    def _grow(self, sid, n):
        ln, table = self._entry(sid)
        table = list(table)
        bs = self.bs
        need = (ln + n + bs - 1) // bs - len(table)
        off = ln % bs
        if off and self.ref[table[ln // bs]] > 1:          # copy-on-write
            i = ln // bs
            new = self._alloc(1)[0]
            s, d = table[i] * bs, new * bs
            self.pool[:, :, d:d + off] = self.pool[:, :, s:s + off]
            self._decref((table[i],))
            table[i] = new
        if need > 0:
            table.extend(self._alloc(need))
        return ln, table

    # ---- the API ---------------------------------------------------------------------
    def create_sequence(self):
        with self.lock:
            sid = int(self.hdr[0])
            self.hdr[0] = sid + 1
            self.tables[sid] = (0, ())
        return sid

    def reserve(self, sid, n):
        with self.lock:
            ln, table = self._grow(sid, n)
            self.tables[sid] = (ln + n, tuple(table))
        pos = np.arange(ln, ln + n)
        return np.asarray(table, np.int64)[pos // self.bs] * self.bs + pos % self.bs

    def append(self, sid, k, v):
        n = check_tokens(self.cfg, k, v)
        bs = self.bs
        with self.lock:
            ln, table = self._grow(sid, n)
            p, i = ln, 0
            while i < n:
                off = p % bs
                cnt = min(bs - off, n - i)
                s = table[p // bs] * bs + off
                self.pool[0, :, s:s + cnt] = k[:, i:i + cnt]
                self.pool[1, :, s:s + cnt] = v[:, i:i + cnt]
                p += cnt
                i += cnt
            self.tables[sid] = (ln + n, tuple(table))

    def fork(self, sid):
        with self.lock:
            ln, table = self._entry(sid)
            shared = tuple(table[:(ln + self.bs - 1) // self.bs])
            for b in shared:
                self.ref[b] += 1
            child = int(self.hdr[0])
            self.hdr[0] = child + 1
            self.tables[child] = (ln, shared)
        return child

    def gather(self, sid, start=None, stop=None, *, out=None):
        bs = self.bs
        with self.lock:
            ln, table = self._entry(sid)
            a, b = token_range(ln, start, stop)
            ko, vo = out_arrays(self.cfg, b - a, out)
            p, o = a, 0
            while p < b:
                off = p % bs
                cnt = min(bs - off, b - p)
                s = table[p // bs] * bs + off
                ko[:, o:o + cnt] = self.pool[0, :, s:s + cnt]
                vo[:, o:o + cnt] = self.pool[1, :, s:s + cnt]
                p += cnt
                o += cnt
        return ko, vo

    def seq_len(self, sid):
        return self._entry(sid)[0]

    def batch_block_tables(self, sids):
        with self.lock:
            entries = [self._entry(int(s)) for s in sids]
        nbs = [(ln + self.bs - 1) // self.bs for ln, _ in entries]
        return pad_tables([t[:nb] for (_, t), nb in zip(entries, nbs)],
                          [ln for ln, _ in entries])

    def free(self, sid):
        with self.lock:
            _, table = self._entry(sid)
            del self.tables[sid]
            self._decref(reversed(table))
