"""LMDB holding KV blocks as values, in a directory on /dev/shm.

Named databases: ``blocks`` (block id -> the block's tokens, token-major, see
base.to_token_major; a value holds the tokens written so far), ``refs`` (block id -> ref
count), ``free`` (the free block ids, as keys), ``seqs`` (sid -> int32 [length, block ids])
and ``meta`` (the sid counter).  Every operation is one LMDB transaction, so it is atomic
and any process that opens the same directory shares the cache.  LMDB has no partial
write, so appending to a partly filled block rewrites that block's value.
"""
from __future__ import annotations

import shutil
import tempfile

import lmdb
import numpy as np

from .base import (
    PeerError,
    PeerFull,
    block_view,
    check_tokens,
    copy_tokens_out,
    out_arrays,
    pad_tables,
    to_token_major,
    token_range,
)


def _key(i: int) -> bytes:
    return int(i).to_bytes(4, "big")


class LmdbCache:
    name = "LMDB (/dev/shm)"

    def __init__(self, cfg, directory: str = "/dev/shm"):
        self.cfg = cfg
        self.bs = cfg.block_size
        self.tb = cfg.bytes_per_token
        self.path = tempfile.mkdtemp(prefix="shmkv-bench-lmdb-", dir=directory)
        try:
            # room for every block twice over (copy-on-write pages of big values)
            map_size = 2 * cfg.num_blocks * cfg.bytes_per_block + (256 << 20)
            self.env = lmdb.open(self.path, map_size=map_size, max_dbs=5, sync=False,
                                 metasync=False, writemap=True, readahead=False,
                                 meminit=False, max_readers=64)
            self.db_blocks = self.env.open_db(b"blocks")
            self.db_refs = self.env.open_db(b"refs")
            self.db_free = self.env.open_db(b"free")
            self.db_seqs = self.env.open_db(b"seqs")
            self.db_meta = self.env.open_db(b"meta")
            with self.env.begin(write=True) as txn:
                for b in range(cfg.num_blocks):
                    txn.put(_key(b), b"", db=self.db_free)
                txn.put(b"next_sid", _key(1), db=self.db_meta)
        except BaseException:
            self.close()
            raise

    def close(self):
        env = getattr(self, "env", None)
        if env is not None:
            env.close()
            self.env = None
        shutil.rmtree(self.path, ignore_errors=True)

    # ---- helpers inside a write transaction -----------------------------------------
    def _alloc(self, txn, n):
        if n > txn.stat(self.db_free)["entries"]:
            raise PeerFull(f"{n} blocks wanted")
        cur = txn.cursor(db=self.db_free)
        cur.first()
        got = []
        for _ in range(n):
            got.append(int.from_bytes(cur.key(), "big"))
            cur.delete()
        for b in got:
            txn.put(_key(b), (1).to_bytes(4, "little"), db=self.db_refs)
        return got

    def _ref(self, txn, b):
        return int.from_bytes(txn.get(_key(b), db=self.db_refs), "little")

    def _decref(self, txn, blocks):
        for b in blocks:
            r = self._ref(txn, b) - 1
            if r == 0:
                txn.delete(_key(b), db=self.db_refs)
                txn.delete(_key(b), db=self.db_blocks)
                txn.put(_key(b), b"", db=self.db_free)
            else:
                txn.put(_key(b), r.to_bytes(4, "little"), db=self.db_refs)

    def _rec(self, txn, sid):
        rec = txn.get(_key(sid), db=self.db_seqs)
        if rec is None:
            raise PeerError(sid)
        arr = np.frombuffer(rec, np.int32)
        return int(arr[0]), arr[1:].tolist()

    def _put_rec(self, txn, sid, ln, table):
        txn.put(_key(sid), np.array([ln] + list(table), np.int32).tobytes(), db=self.db_seqs)

    def _new_sid(self, txn):
        if txn.stat(self.db_seqs)["entries"] >= self.cfg.max_seqs:
            raise PeerFull("every sequence slot is taken")
        sid = int.from_bytes(txn.get(b"next_sid", db=self.db_meta), "big")
        txn.put(b"next_sid", _key(sid + 1), db=self.db_meta)
        return sid

    def _grow(self, txn, sid, n):
        ln, table = self._rec(txn, sid)
        bs = self.bs
        need = (ln + n + bs - 1) // bs - len(table)
        off = ln % bs
        if off and self._ref(txn, table[ln // bs]) > 1:          # copy-on-write
            i = ln // bs
            new = self._alloc(txn, 1)[0]
            old = txn.get(_key(table[i]), db=self.db_blocks) or b""
            txn.put(_key(new), bytes(old[:off * self.tb]), db=self.db_blocks)
            self._decref(txn, (table[i],))
            table[i] = new
        if need > 0:
            table.extend(self._alloc(txn, need))
        return ln, table

    # ---- the API ----------------------------------------------------------------------
    def create_sequence(self):
        with self.env.begin(write=True) as txn:
            sid = self._new_sid(txn)
            self._put_rec(txn, sid, 0, ())
        return sid

    def reserve(self, sid, n):
        with self.env.begin(write=True) as txn:
            ln, table = self._grow(txn, sid, n)
            self._put_rec(txn, sid, ln + n, table)
        pos = np.arange(ln, ln + n)
        return np.asarray(table, np.int64)[pos // self.bs] * self.bs + pos % self.bs

    def append(self, sid, k, v):
        n = check_tokens(self.cfg, k, v)
        mv = memoryview(to_token_major(k, v)).cast("B")
        bs, tb = self.bs, self.tb
        with self.env.begin(write=True, buffers=True) as txn:
            ln, table = self._grow(txn, sid, n)
            p, i = ln, 0
            while i < n:
                off = p % bs
                cnt = min(bs - off, n - i)
                key = _key(table[p // bs])
                new = mv[i * tb:(i + cnt) * tb]
                if off:                      # no partial writes: rewrite the whole value
                    old = txn.get(key, db=self.db_blocks) or b""
                    head = old[:off * tb]
                    if len(head) < off * tb:          # reserved, never written
                        head = bytes(head) + bytes(off * tb - len(head))
                    new = b"".join((head, new))
                txn.put(key, new, db=self.db_blocks)
                p += cnt
                i += cnt
            self._put_rec(txn, sid, ln + n, table)

    def fork(self, sid):
        with self.env.begin(write=True) as txn:
            ln, table = self._rec(txn, sid)
            shared = table[:(ln + self.bs - 1) // self.bs]
            child = self._new_sid(txn)
            for b in shared:
                txn.put(_key(b), (self._ref(txn, b) + 1).to_bytes(4, "little"),
                        db=self.db_refs)
            self._put_rec(txn, child, ln, shared)
        return child

    def gather(self, sid, start=None, stop=None, *, out=None):
        bs, tb = self.bs, self.tb
        with self.env.begin(buffers=True) as txn:
            ln, table = self._rec(txn, sid)
            a, b = token_range(ln, start, stop)
            ko, vo = out_arrays(self.cfg, b - a, out)
            p, o = a, 0
            while p < b:
                off = p % bs
                cnt = min(bs - off, b - p)
                val = txn.get(_key(table[p // bs]), db=self.db_blocks)
                copy_tokens_out(block_view(self.cfg, val, len(val) // tb), off, cnt, ko, vo, o)
                p += cnt
                o += cnt
        return ko, vo

    def seq_len(self, sid):
        with self.env.begin() as txn:
            return self._rec(txn, sid)[0]

    def batch_block_tables(self, sids):
        bs = self.bs
        tables, lens = [], []
        with self.env.begin() as txn:
            for s in sids:
                ln, table = self._rec(txn, int(s))
                tables.append(table[:(ln + bs - 1) // bs])
                lens.append(ln)
        return pad_tables(tables, lens)

    def free(self, sid):
        with self.env.begin(write=True) as txn:
            _ln, table = self._rec(txn, sid)
            txn.delete(_key(sid), db=self.db_seqs)
            self._decref(txn, reversed(table))
