"""The tier's transport: redis-py for the cluster, a lean pipelined path for the bytes.

What comes from redis-py (no home-made cluster protocol): the cluster's topology
(``CLUSTER SLOTS`` through ``redis.cluster.RedisCluster``'s ``NodesManager``), the key ->
slot -> node mapping, and re-reading the topology after a ``MOVED``, a refused
connection or a timeout.  What is ours: per node, one plain socket that sends a whole
batch of ``SET``/``GET`` commands at once (one ``sendmsg`` of the headers and the values'
memoryviews, no concatenation), then reads the batch's replies, receiving each bulk
value straight into its destination buffer (``recv_into``, the GIL released).  Measured
against redis-py's cluster pipeline in benchmarks/tier_bench.py ("client choice").

Every call is bounded (connect and socket timeouts); any failure raises ``TierIOError``
after closing the node's sockets and marking the topology stale.  A failure that a new
topology may cure -- a refused or closed connection (a master killed; its replica took
over), a ``MOVED``/``ASK``/``CLUSTERDOWN``/``TRYAGAIN`` reply -- is retried once by
``set_many``/``get_many`` (``TierIOError.retry``; a timeout is not: a slow node would
cost the wait twice).  The topology is re-read from every node known so far, not only the
URL's (which may be the one that died).  Past that the caller (shmkv.tier) counts the
failure and backs off.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlparse

__all__ = ["Transport", "TierIOError"]


class TierIOError(Exception):
    """The tier could not be reached or answered with an error.  ``retry``: whether a
    second try on a topology read anew may go through (False for a timeout)."""

    def __init__(self, msg: str, retry: bool = True) -> None:
        super().__init__(msg)
        self.retry = retry


_TOPOLOGY_ERRORS = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN")


def _io_error(what: str, e: BaseException) -> TierIOError:
    return TierIOError(f"{what}: {e}", retry=not isinstance(e, TimeoutError))


class _Node:
    """One plain connection to one Redis node (used by one thread at a time)."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.addr = (host, port)
        self.timeout = timeout
        self.sock: Optional[socket.socket] = None
        self.buf = bytearray()
        self.pos = 0

    def connect(self) -> socket.socket:
        if self.sock is None:
            try:
                s = socket.create_connection(self.addr, timeout=self.timeout)
            except OSError as e:
                raise _io_error(f"connect {self.addr[0]}:{self.addr[1]}", e) from None
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            s.settimeout(self.timeout)
            self.sock = s
            self.buf = bytearray()
            self.pos = 0
        return self.sock

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None

    # ---- sending ---------------------------------------------------------------------
    def send(self, parts: List[Any]) -> None:
        s = self.connect()
        try:
            # sendmsg in slices: the kernel takes at most IOV_MAX buffers per call
            i = 0
            while i < len(parts):
                chunk = parts[i:i + 512]
                n = s.sendmsg(chunk)
                total = sum(len(memoryview(p).cast("B")) for p in chunk)
                if n < total:                    # a partial send: finish it piece by piece
                    for p in chunk:
                        mv = memoryview(p).cast("B")
                        if n >= len(mv):
                            n -= len(mv)
                            continue
                        s.sendall(mv[n:])
                        n = 0
                i += 512
        except OSError as e:
            self.close()
            raise _io_error(f"send to {self.addr[0]}:{self.addr[1]}", e) from None

    # ---- reading ---------------------------------------------------------------------
    def _fill(self) -> None:
        assert self.sock is not None
        if self.pos and self.pos == len(self.buf):
            self.buf = bytearray()
            self.pos = 0
        chunk = self.sock.recv(65536)
        if not chunk:
            raise OSError("connection closed by the server")
        self.buf += chunk

    def readline(self) -> bytes:
        while True:
            i = self.buf.find(b"\r\n", self.pos)
            if i >= 0:
                line = bytes(self.buf[self.pos:i])
                self.pos = i + 2
                return line
            if len(self.buf) - self.pos > 1 << 16:
                raise OSError("protocol error: a reply line over 64 KiB")
            self._fill()

    def readinto(self, mv: memoryview) -> None:
        """Exactly len(mv) bytes: what is buffered, then recv_into the rest."""
        n = len(mv)
        have = min(n, len(self.buf) - self.pos)
        if have:
            mv[:have] = self.buf[self.pos:self.pos + have]
            self.pos += have
        assert self.sock is not None
        while have < n:
            got = self.sock.recv_into(mv[have:], n - have)
            if got == 0:
                raise OSError("connection closed by the server")
            have += got

    def skip(self, n: int) -> None:
        while n:
            have = min(n, len(self.buf) - self.pos)
            self.pos += have
            n -= have
            if n:
                self._fill()

    def reply(self, dest: Optional[memoryview] = None) -> Tuple[str, Any]:
        """One reply: ("ok", None) for +..., ("nil", None), ("bulk", length) with the
        value read into dest when it fits exactly (else ("size", length), value skipped),
        ("err", message) for -..., ("int", n)."""
        line = self.readline()
        kind = line[:1]
        if kind == b"+":
            return "ok", None
        if kind == b"-":
            return "err", line[1:].decode(errors="replace")
        if kind == b":":
            return "int", int(line[1:])
        if kind == b"$":
            n = int(line[1:])
            if n < 0:
                return "nil", None
            if dest is not None and n == len(dest):
                self.readinto(dest)
                self.skip(2)
                return "bulk", n
            self.skip(n + 2)
            return "size", n
        raise OSError(f"protocol error: unexpected reply {line[:40]!r}")


def _seeds(url: str) -> List[Tuple[str, int]]:
    """The (host, port) pairs of ``redis://host:port[,host:port...]``."""
    text = url if "://" in url else "redis://" + url
    scheme, _, rest = text.partition("://")
    if scheme != "redis" or not rest:
        raise ValueError(f"url: expected redis://host:port[,host:port...], got {url!r}")
    out = []
    for part in rest.rstrip("/").split(","):
        u = urlparse("redis://" + part.strip())
        try:
            port = u.port or 6379
        except ValueError:
            port = -1
        if not u.hostname or not 0 < port < 65536:
            raise ValueError(f"url: expected redis://host:port[,host:port...], got {url!r}")
        out.append((u.hostname, port))
    return out


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


class Transport:
    """Batched SET/GET of large values over a Redis Cluster (or one node).

    Not shared between threads: the tier gives its writer thread and its readers one
    each.  The topology (``redis.cluster.RedisCluster``) is created lazily, so a
    cluster that is down at construction is an error counted later, not an exception.
    """

    def __init__(self, url: str, *, cluster: bool = True, timeout: float = 1.0,
                 connect_timeout: float = 0.5) -> None:
        self.seeds = _seeds(url)
        self.host, self.port = self.seeds[0]
        self._known: List[Tuple[str, int]] = []    # every node of the last map read
        self.retries = 0                            # batches tried again (set/get_many)
        self.cluster = cluster
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._rc: Any = None
        self._stale = False                     # re-read the topology before the next use
        self._nodes: Dict[Tuple[str, int], _Node] = {}
        self._lock = threading.Lock()
        self.bufs: Dict[int, List[Any]] = {}      # value buffers by size, for their user

    # ---- topology (redis-py) ---------------------------------------------------------
    def _topology(self) -> Any:
        if self._stale and self._rc is not None:
            # from every node the last map named (redis-py's dynamic startup nodes): the
            # URL's node may be the one that died
            self._stale = False
            try:
                self._rc.nodes_manager.initialize()
            except Exception:
                rc, self._rc = self._rc, None
                try:
                    rc.close()
                except Exception:
                    pass
        if self._rc is None:
            from redis.cluster import ClusterNode, RedisCluster

            # the URL's nodes, then every node the last map named: the first that answers
            # gives the map (a dead seed is skipped)
            seeds = list(dict.fromkeys(self.seeds + self._known))
            try:
                nodes = [ClusterNode(h, p) for h, p in seeds]  # type: ignore[no-untyped-call]
                self._rc = RedisCluster(startup_nodes=nodes,
                                        socket_timeout=self.timeout,
                                        socket_connect_timeout=self.connect_timeout,
                                        require_full_coverage=False)
            except Exception as e:           # RedisError, RedisClusterException, OSError
                raise _io_error(f"cluster at {', '.join(f'{h}:{p}' for h, p in seeds)}",
                                e) from None
            try:
                self._known = [(n.host, int(n.port)) for n in self._rc.get_nodes()]
            except Exception:
                pass
        return self._rc

    def refresh(self) -> None:
        """Close the sockets and mark the topology stale: the next batch reads it anew."""
        self._stale = True
        for n in self._nodes.values():
            n.close()
        self._nodes.clear()

    def close(self) -> None:
        self.refresh()
        rc, self._rc = self._rc, None
        if rc is not None:
            try:
                rc.close()
            except Exception:
                pass

    def _node_of(self, key: bytes) -> _Node:
        if not self.cluster:
            addr = (self.host, self.port)
        else:
            rc = self._topology()
            try:
                n = rc.nodes_manager.get_node_from_slot(rc.keyslot(key))
            except Exception as e:             # a slot no master serves right now
                raise TierIOError(f"no node for key: {e}") from None
            addr = (n.host, int(n.port))
        node = self._nodes.get(addr)
        if node is None:
            node = self._nodes[addr] = _Node(addr[0], addr[1], self.timeout)
            node.timeout = self.timeout
        return node

    def _group(self, keys: Sequence[bytes]) -> Dict[Tuple[str, int], List[int]]:
        groups: Dict[Tuple[str, int], List[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(self._node_of(k).addr, []).append(i)
        return groups

    def _fail(self, msg: str, retry: bool = True) -> None:
        self.refresh()
        raise TierIOError(msg, retry)

    # ---- the two batch operations ----------------------------------------------------
    def set_many(self, keys: Sequence[bytes], values: Sequence[Any],
                 ttl: Optional[int] = None) -> int:
        """SET every key (pipelined per node; all nodes sent to before any reply is
        read).  Returns how many were stored; raises TierIOError on a failure (after one
        retry on a topology read anew, where that may cure it)."""
        try:
            return self._set_many(keys, values, ttl)
        except TierIOError as e:
            if not e.retry:
                raise
        self.retries += 1
        return self._set_many(keys, values, ttl)

    def _set_many(self, keys: Sequence[bytes], values: Sequence[Any],
                  ttl: Optional[int]) -> int:
        groups = self._group(keys)
        extra = b"" if ttl is None else b"$2\r\nEX\r\n" + _bulk(str(ttl).encode())
        argc = b"*3\r\n" if ttl is None else b"*5\r\n"
        deadline = time.monotonic() + self.timeout * (2 + len(keys))
        for addr, idx in groups.items():
            node = self._nodes[addr]
            parts: List[Any] = []
            for i in idx:
                v = values[i]
                parts.append(argc + b"$3\r\nSET\r\n" + _bulk(keys[i])
                             + b"$%d\r\n" % len(memoryview(v).cast("B")))
                parts.append(v)
                parts.append(b"\r\n" + extra if extra else b"\r\n")
            try:
                node.send(parts)
            except TierIOError:
                self.refresh()
                raise
        stored = 0
        errors: List[str] = []
        for addr, idx in groups.items():
            node = self._nodes[addr]
            try:
                for _ in idx:
                    kind, what = node.reply()
                    if kind == "ok":
                        stored += 1
                    else:
                        errors.append(str(what))
                    if time.monotonic() > deadline:
                        raise TimeoutError("batch deadline passed")
            except (OSError, ValueError) as e:
                node.close()
                self._fail(f"SET replies from {addr[0]}:{addr[1]}: {e}",
                           not isinstance(e, TimeoutError))
        if errors:
            moved = any(e.startswith(_TOPOLOGY_ERRORS) for e in errors)
            if moved:
                self.refresh()
            raise TierIOError(f"{len(errors)} SET(s) refused: {errors[0]}", moved)
        return stored

    def get_many(self, keys: Sequence[bytes], dests: Sequence[Any]) -> List[str]:
        """GET every key into its destination buffer (pipelined per node).  Returns per
        key "bulk" (read, exactly the buffer's size), "nil" (absent), "size" (present
        with another size: a truncated or foreign value) or "err".  A failure that a
        topology read anew may cure, or a reply that says the map moved, is retried
        once."""
        try:
            out = self.get_recv(self.get_send(keys), dests)
            if not self.moved(out):
                return out
        except TierIOError as e:
            if not e.retry:
                raise
        self.retries += 1
        return self.get_recv(self.get_send(keys), dests)

    @staticmethod
    def moved(kinds: Sequence[str]) -> bool:
        """Whether get_recv's answer has a reply that says the map moved ("moved")."""
        return "moved" in kinds

    def get_send(self, keys: Sequence[bytes]) -> Any:
        """The request half of get_many: the GETs go out to every node at once (the
        caller may work while the servers answer).  Pass the result to get_recv."""
        groups = self._group(keys)
        try:
            for addr, idx in groups.items():
                node = self._nodes[addr]
                node.send([b"".join(b"*2\r\n$3\r\nGET\r\n" + _bulk(keys[i]) for i in idx)])
        except TierIOError:
            self.refresh()
            raise
        return len(keys), groups

    def get_recv(self, sent: Any, dests: Sequence[Any]) -> List[str]:
        """The reply half of get_many (every reply of a get_send must be read, in
        order, before the next request on these connections).  A key whose node said
        the map moved (MOVED, ASK, CLUSTERDOWN, TRYAGAIN) is "moved" (the topology is
        then marked stale)."""
        n, groups = sent
        out = ["err"] * n
        deadline = time.monotonic() + self.timeout * (2 + n)
        moved = False
        for addr, idx in groups.items():
            node = self._nodes.get(addr)
            if node is None:
                self._fail(f"GET replies from {addr[0]}:{addr[1]}: connection gone")
            assert node is not None
            try:
                for i in idx:
                    kind, what = node.reply(dests[i])
                    if kind == "err" and str(what).startswith(_TOPOLOGY_ERRORS):
                        kind = "moved"
                        moved = True
                    out[i] = kind
                    if time.monotonic() > deadline:
                        raise TimeoutError("batch deadline passed")
            except (OSError, ValueError) as e:
                node.close()
                self._fail(f"GET replies from {addr[0]}:{addr[1]}: {e}",
                           not isinstance(e, TimeoutError))
        if moved:
            self.refresh()
        return out

    def flushall(self) -> None:
        """Test helper: FLUSHALL on every master."""
        rc = self._topology() if self.cluster else None
        addrs = ([(n.host, int(n.port)) for n in rc.get_primaries()] if rc is not None
                 else [(self.host, self.port)])
        for addr in addrs:
            node = self._nodes.get(addr) or _Node(addr[0], addr[1], self.timeout)
            self._nodes[addr] = node
            node.send([b"*1\r\n$8\r\nFLUSHALL\r\n"])
            node.reply()
