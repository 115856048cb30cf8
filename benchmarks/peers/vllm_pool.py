"""A pure-Python block pool after vLLM v1's design, with numpy pools for the bytes.

vLLM v1 (vllm/v1/core/block_pool.py, kv_cache_utils.py) keeps one Python object per
physical block (id, ref_cnt, hash, prev/next links) and the free blocks in a doubly linked
queue whose links live in the block objects themselves: popleft and append are O(1), and
so is removing a block from the middle (a cached free block that a new request hits).
Allocation pops from the head and bumps ref_cnt; freeing drops ref_cnt and appends the
blocks that reached zero, in reverse order, so a request's tail blocks are evicted first;
sharing (prefix hit, fork) "touches" blocks: a free one leaves the queue, then ref_cnt+1.
Block tables are Python lists per request, padded into a numpy array per step.

Written from that design for this benchmark (not copied).  The KV bytes live in
process-local numpy arrays [layers, num_blocks * block_size, heads, dim]: this peer is
what a single process can do with no sharing at all.
"""
from __future__ import annotations

import numpy as np

from .base import PeerError, PeerFull, check_tokens, out_arrays, token_range


class Block:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash = None
        self.prev_free = None
        self.next_free = None


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel head and tail."""

    def __init__(self, blocks):
        self.head = Block(-1)
        self.tail = Block(-1)
        prev = self.head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = self.tail
        self.tail.prev_free = prev
        self.num_free = len(blocks)

    def popleft(self) -> Block:
        b = self.head.next_free
        if b is self.tail:
            raise PeerFull("no free block")
        self.remove(b)
        return b

    def popleft_n(self, n: int) -> list:
        if n > self.num_free:
            raise PeerFull(f"{n} blocks wanted, {self.num_free} free")
        out = []
        b = self.head.next_free
        for _ in range(n):
            out.append(b)
            nxt = b.next_free
            b.prev_free = b.next_free = None
            b = nxt
        self.head.next_free = b
        b.prev_free = self.head
        self.num_free -= n
        return out

    def remove(self, b: Block) -> None:
        b.prev_free.next_free = b.next_free
        b.next_free.prev_free = b.prev_free
        b.prev_free = b.next_free = None
        self.num_free -= 1

    def append(self, b: Block) -> None:
        last = self.tail.prev_free
        last.next_free = b
        b.prev_free = last
        b.next_free = self.tail
        self.tail.prev_free = b
        self.num_free += 1


class BlockPool:
    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached = {}                     # block hash -> Block (prefix cache)

    def get_new_blocks(self, n: int) -> list:
        got = self.free_queue.popleft_n(n)
        for b in got:
            if b.block_hash is not None:     # evict a cached block being reused
                self.cached.pop(b.block_hash, None)
                b.block_hash = None
            b.ref_cnt += 1
        return got

    def touch(self, blocks) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered) -> None:
        for b in ordered:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free


class VllmStyleCache:
    """The shmkv API over a vLLM-style block pool; process-local."""

    name = "vllm-pool (py)"

    def __init__(self, cfg):
        self.cfg = cfg
        self.bs = cfg.block_size
        self.pool = BlockPool(cfg.num_blocks)
        shape = (cfg.num_layers, cfg.num_blocks * cfg.block_size, cfg.num_kv_heads,
                 cfg.head_dim)
        self.k = np.zeros(shape, cfg.numpy_dtype)     # lazily backed: untouched pages free
        self.v = np.zeros(shape, cfg.numpy_dtype)
        self.tables = {}                 # sid -> list[Block]
        self.lens = {}                   # sid -> tokens
        self.next_sid = 1
        self.max_seqs = cfg.max_seqs

    def close(self):
        self.tables.clear()
        self.k = self.v = None

    # ---- sequences --------------------------------------------------------------------
    def create_sequence(self) -> int:
        if len(self.tables) >= self.max_seqs:
            raise PeerFull("every sequence slot is taken")
        sid = self.next_sid
        self.next_sid += 1
        self.tables[sid] = []
        self.lens[sid] = 0
        return sid

    def _table(self, sid):
        try:
            return self.tables[sid]
        except KeyError:
            raise PeerError(sid) from None

    def _grow(self, sid, n):
        """Room for n tokens after the current length: new blocks, and a private copy of
        a shared partial last block (copy-on-write).  Returns (table, old length)."""
        table = self._table(sid)
        ln = self.lens[sid]
        bs = self.bs
        need = (ln + n + bs - 1) // bs - len(table)
        off = ln % bs
        cow = off and table[ln // bs].ref_cnt > 1
        if need + cow > self.pool.num_free_blocks:
            raise PeerFull(f"{need + cow} blocks wanted")
        if cow:
            i = ln // bs
            old = table[i]
            new = self.pool.get_new_blocks(1)[0]
            s, d = old.block_id * bs, new.block_id * bs
            self.k[:, d:d + off] = self.k[:, s:s + off]
            self.v[:, d:d + off] = self.v[:, s:s + off]
            table[i] = new
            self.pool.free_blocks((old,))
        if need > 0:
            table.extend(self.pool.get_new_blocks(need))
        return table, ln

    def reserve(self, sid, n):
        table, ln = self._grow(sid, n)
        self.lens[sid] = ln + n
        bs = self.bs
        if n == 1:
            return np.array([table[ln // bs].block_id * bs + ln % bs], np.int64)
        pos = np.arange(ln, ln + n)
        ids = np.fromiter((b.block_id for b in table), np.int64, len(table))
        return ids[pos // bs] * bs + pos % bs

    def append(self, sid, k, v):
        n = check_tokens(self.cfg, k, v)
        table, ln = self._grow(sid, n)
        bs = self.bs
        p, i = ln, 0
        while i < n:
            off = p % bs
            cnt = min(bs - off, n - i)
            s = table[p // bs].block_id * bs + off
            self.k[:, s:s + cnt] = k[:, i:i + cnt]
            self.v[:, s:s + cnt] = v[:, i:i + cnt]
            p += cnt
            i += cnt
        self.lens[sid] = ln + n

    def fork(self, sid):
        table = self._table(sid)
        ln = self.lens[sid]
        shared = table[:(ln + self.bs - 1) // self.bs]
        child = self.create_sequence()
        self.pool.touch(shared)
        self.tables[child] = list(shared)
        self.lens[child] = ln
        return child

    def gather(self, sid, start=None, stop=None, *, out=None):
        table = self._table(sid)
        a, b = token_range(self.lens[sid], start, stop)
        ko, vo = out_arrays(self.cfg, b - a, out)
        bs = self.bs
        p, o = a, 0
        while p < b:
            off = p % bs
            cnt = min(bs - off, b - p)
            s = table[p // bs].block_id * bs + off
            ko[:, o:o + cnt] = self.k[:, s:s + cnt]
            vo[:, o:o + cnt] = self.v[:, s:s + cnt]
            p += cnt
            o += cnt
        return ko, vo

    def seq_len(self, sid):
        self._table(sid)
        return self.lens[sid]

    def batch_block_tables(self, sids):
        """vLLM-style: block-id lists padded in Python, then one numpy array."""
        tables = [[b.block_id for b in self._table(s)] for s in sids]
        lens = [self.lens[s] for s in sids]
        W = max((len(t) for t in tables), default=0)
        padded = [t + [-1] * (W - len(t)) for t in tables]
        return np.array(padded, np.int32).reshape(len(tables), W), np.array(lens, np.int32)

    def free(self, sid):
        table = self.tables.pop(sid, None)
        if table is None:
            raise PeerError(sid)
        del self.lens[sid]
        self.pool.free_blocks(reversed(table))     # tail blocks are evicted first
