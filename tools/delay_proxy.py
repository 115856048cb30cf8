"""A TCP proxy that delays what it forwards, each way: the latency between two hosts where
the kernel has no ``netem`` qdisc (``tc qdisc add ... netem`` answers "unknown qdisc").

    with DelayProxy(("127.0.0.1", 6379), delay=0.05) as p:   # 50 ms each way
        connect to ("127.0.0.1", p.port)

Or as a program, one proxy per pair, until killed (tools/netlab.py runs it in a host)::

    python tools/delay_proxy.py --delay 0.001 LISTEN_IP:PORT=UPSTREAM_IP:PORT ...

Every chunk read from one side is written to the other ``delay`` seconds (plus up to
``jitter``, never out of order) after it arrived; a side that closes is closed on the
other once what it sent is through.  Threads, no event loop: a few connections at a
time, for tests and benchmarks.  ``stop()`` closes everything it opened.
"""
from __future__ import annotations

import argparse
import queue
import random
import signal
import socket
import sys
import threading
import time
from typing import Optional, Sequence

__all__ = ["DelayProxy"]


class DelayProxy:
    def __init__(self, upstream: tuple[str, int], delay: float, *, jitter: float = 0.0,
                 listen: tuple[str, int] = ("127.0.0.1", 0), seed: Optional[int] = None):
        if delay < 0 or jitter < 0:
            raise ValueError(f"delay, jitter: expected >= 0, got {delay}, {jitter}")
        self.upstream = upstream
        self.delay, self.jitter = delay, jitter
        self._rng = random.Random(seed)
        self._srv = socket.create_server(listen)
        self.port = self._srv.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> "DelayProxy":
        self._spawn(self._accept)
        return self

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        with self._lock:
            self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                q: queue.Queue = queue.Queue()
                self._spawn(self._read, a, q)
                self._spawn(self._write, b, q)

    def _due(self, last: float) -> float:
        extra = self._rng.uniform(0, self.jitter) if self.jitter else 0.0
        return max(last, time.monotonic() + self.delay + extra)

    def _read(self, src: socket.socket, q: queue.Queue) -> None:
        last = 0.0
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            last = self._due(last)
            q.put((last, data))
            if not data:
                return

    def _write(self, dst: socket.socket, q: queue.Queue) -> None:
        while True:
            due, data = q.get()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
            except OSError:
                return

    def stop(self) -> None:
        self._stopped = True
        try:
            self._srv.shutdown(socket.SHUT_RDWR)    # wakes the accept (close alone may not)
        except OSError:
            pass
        self._srv.close()
        with self._lock:
            socks, self._socks = self._socks, []
            threads = list(self._threads)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in threads:
            t.join(timeout=5)

    def __enter__(self) -> "DelayProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/delay_proxy.py")
    ap.add_argument("--delay", type=float, required=True, help="seconds each way")
    ap.add_argument("--jitter", type=float, default=0.0)
    ap.add_argument("pairs", nargs="+", metavar="LISTEN=UPSTREAM")
    a = ap.parse_args(argv)
    proxies = []
    for pair in a.pairs:
        listen, _, up = pair.partition("=")
        proxies.append(DelayProxy(_addr(up), a.delay, jitter=a.jitter,
                                  listen=_addr(listen)).start())
    print("ready", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    for p in proxies:
        p.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
