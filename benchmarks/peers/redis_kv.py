"""A real Redis server holding KV blocks as values.

The benchmark starts its own ``redis-server`` on a unix socket in a fresh temporary
directory (TCP disabled: ``--port 0``), with persistence off, and stops it by PID
afterwards.  Keys: ``b:<id>`` a block's tokens (token-major, see base.to_token_major;
SETRANGE writes one token in place), ``r:<id>`` its ref count, ``free`` the list of free
block ids, ``t:<sid>`` a sequence's block ids (a list), ``l:<sid>`` its length, ``nsid``
and ``nseq`` counters.  Every metadata change is one Lua script (atomic, one round trip);
an append sends its bytes into the same script, so the data lands atomically with the
new length.  A gather reads the table, then GETs the blocks in one pipeline.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

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

_CREATE = """
if tonumber(redis.call('GET', 'nseq') or '0') >= tonumber(ARGV[1]) then
  return redis.error_reply('EFULL sequence slots')
end
redis.call('INCR', 'nseq')
local sid = redis.call('INCR', 'nsid')
redis.call('SET', 'l:' .. sid, 0)
return sid
"""

# ARGV: sid, n, block_size, bytes_per_token [, data]  -> {old length, block ids touched}
_GROW = """
local sid, n, bs, tb = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local data = ARGV[5]
local lk, tk = 'l:' .. sid, 't:' .. sid
local ln = redis.call('GET', lk)
if not ln then return redis.error_reply('ENOSEQ') end
ln = tonumber(ln)
local nb = redis.call('LLEN', tk)
local need = math.floor((ln + n + bs - 1) / bs) - nb
local off = ln % bs
local bi = math.floor(ln / bs)
local cow = 0
if off ~= 0 then
  local b = redis.call('LINDEX', tk, bi)
  if tonumber(redis.call('GET', 'r:' .. b)) > 1 then cow = 1 end
end
if need + cow > redis.call('LLEN', 'free') then return redis.error_reply('EFULL') end
if cow == 1 then
  local old = redis.call('LINDEX', tk, bi)
  local new = redis.call('LPOP', 'free')
  redis.call('SET', 'r:' .. new, 1)
  redis.call('SET', 'b:' .. new, redis.call('GETRANGE', 'b:' .. old, 0, off * tb - 1))
  redis.call('LSET', tk, bi, new)
  redis.call('DECR', 'r:' .. old)
end
if need > 0 then
  local ids = redis.call('LPOP', 'free', need)
  for i = 1, #ids do redis.call('SET', 'r:' .. ids[i], 1) end
  redis.call('RPUSH', tk, unpack(ids))
end
redis.call('SET', lk, ln + n)
local ids = redis.call('LRANGE', tk, bi, math.floor((ln + n - 1) / bs))
if data then
  local p, i, j = ln, 0, 1
  while i < n do
    local o = p % bs
    local cnt = math.min(bs - o, n - i)
    local piece = data
    if cnt ~= n then piece = string.sub(data, i * tb + 1, (i + cnt) * tb) end
    redis.call('SETRANGE', 'b:' .. ids[j], o * tb, piece)
    p = p + cnt
    i = i + cnt
    j = j + 1
  end
end
return {ln, ids}
"""

_FORK = """
local sid, bs = ARGV[1], tonumber(ARGV[2])
local ln = redis.call('GET', 'l:' .. sid)
if not ln then return redis.error_reply('ENOSEQ') end
if tonumber(redis.call('GET', 'nseq') or '0') >= tonumber(ARGV[3]) then
  return redis.error_reply('EFULL sequence slots')
end
redis.call('INCR', 'nseq')
local nb = math.floor((tonumber(ln) + bs - 1) / bs)
local child = redis.call('INCR', 'nsid')
redis.call('SET', 'l:' .. child, ln)
if nb > 0 then
  local ids = redis.call('LRANGE', 't:' .. sid, 0, nb - 1)
  for i = 1, #ids do redis.call('INCR', 'r:' .. ids[i]) end
  redis.call('RPUSH', 't:' .. child, unpack(ids))
end
return child
"""

_FREE = """
local sid = ARGV[1]
if redis.call('EXISTS', 'l:' .. sid) == 0 then return redis.error_reply('ENOSEQ') end
local ids = redis.call('LRANGE', 't:' .. sid, 0, -1)
for i = #ids, 1, -1 do
  local b = ids[i]
  if redis.call('DECR', 'r:' .. b) <= 0 then
    redis.call('DEL', 'r:' .. b, 'b:' .. b)
    redis.call('RPUSH', 'free', b)
  end
end
redis.call('DEL', 'l:' .. sid, 't:' .. sid)
redis.call('DECR', 'nseq')
return #ids
"""


class RedisServer:
    """redis-server on a unix socket in a temp dir; stopped (by PID) in stop()."""

    def __init__(self, exe: str):
        self.dir = tempfile.mkdtemp(prefix="shmkv-bench-redis-")
        self.sock = os.path.join(self.dir, "redis.sock")
        self.log = open(os.path.join(self.dir, "redis.log"), "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [exe, "--port", "0", "--bind", "127.0.0.1", "--unixsocket", self.sock,
             "--unixsocketperm", "700", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning",
             "--databases", "1", "--proto-max-bulk-len", "1gb"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.version = subprocess.run([exe, "--version"], capture_output=True, check=False,
                                      text=True).stdout.strip()

    def client(self, timeout: float = 10.0):
        import redis

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            if os.path.exists(self.sock):
                try:
                    r = redis.Redis(unix_socket_path=self.sock)
                    r.ping()
                    return r
                except redis.exceptions.ConnectionError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not come up")
            time.sleep(0.02)

    def stop(self):
        try:
            if self.proc.poll() is None:
                self.proc.terminate()               # SIGTERM to its PID
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
        finally:
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)


class RedisCache:
    name = "Redis (unix socket)"

    def __init__(self, cfg, server: RedisServer):
        self.cfg = cfg
        self.bs = cfg.block_size
        self.tb = cfg.bytes_per_token
        self.r = server.client()
        self.r.flushall()
        self._create = self.r.register_script(_CREATE)
        self._grow = self.r.register_script(_GROW)
        self._fork = self.r.register_script(_FORK)
        self._free = self.r.register_script(_FREE)
        ids = list(range(cfg.num_blocks))
        for i in range(0, len(ids), 4096):
            self.r.rpush("free", *ids[i:i + 4096])

    def close(self):
        try:
            self.r.flushall()
        finally:
            self.r.close()

    def _call(self, script, args):
        import redis

        try:
            return script(args=args)
        except redis.exceptions.ResponseError as e:
            if "ENOSEQ" in str(e):
                raise PeerError(args[0]) from None
            if "EFULL" in str(e):
                raise PeerFull(str(e)) from None
            raise

    def create_sequence(self):
        return int(self._call(self._create, [self.cfg.max_seqs]))

    def reserve(self, sid, n):
        ln, ids = self._call(self._grow, [sid, n, self.bs, self.tb])
        ids = np.array(ids, np.int64)
        pos = np.arange(ln, ln + n)
        return ids[pos // self.bs - ln // self.bs] * self.bs + pos % self.bs

    def append(self, sid, k, v):
        n = check_tokens(self.cfg, k, v)
        data = memoryview(to_token_major(k, v)).cast("B")
        self._call(self._grow, [sid, n, self.bs, self.tb, data])

    def fork(self, sid):
        return int(self._call(self._fork, [sid, self.bs, self.cfg.max_seqs]))

    def _table(self, sid):
        pipe = self.r.pipeline(transaction=True)
        pipe.get(f"l:{sid}")
        pipe.lrange(f"t:{sid}", 0, -1)
        ln, ids = pipe.execute()
        if ln is None:
            raise PeerError(sid)
        return int(ln), [int(x) for x in ids]

    def gather(self, sid, start=None, stop=None, *, out=None):
        bs, tb = self.bs, self.tb
        ln, table = self._table(sid)
        a, b = token_range(ln, start, stop)
        ko, vo = out_arrays(self.cfg, b - a, out)
        if b == a:
            return ko, vo
        first, last = a // bs, (b - 1) // bs
        pipe = self.r.pipeline(transaction=False)
        for blk in table[first:last + 1]:
            pipe.get(f"b:{blk}")
        vals = pipe.execute()
        p, o = a, 0
        for val in vals:
            off = p % bs
            cnt = min(bs - off, b - p)
            copy_tokens_out(block_view(self.cfg, val, len(val) // tb), off, cnt, ko, vo, o)
            p += cnt
            o += cnt
        return ko, vo

    def seq_len(self, sid):
        return self._table(sid)[0]

    def batch_block_tables(self, sids):
        pipe = self.r.pipeline(transaction=True)
        for s in sids:
            pipe.get(f"l:{int(s)}")
            pipe.lrange(f"t:{int(s)}", 0, -1)
        res = pipe.execute()
        tables, lens = [], []
        for i in range(0, len(res), 2):
            if res[i] is None:
                raise PeerError(sids[i // 2])
            ln = int(res[i])
            lens.append(ln)
            tables.append([int(x) for x in res[i + 1][:(ln + self.bs - 1) // self.bs]])
        return pad_tables(tables, lens)

    def free(self, sid):
        self._call(self._free, [sid])
