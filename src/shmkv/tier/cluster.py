"""A local Redis Cluster on loopback, from Debian's ``redis-server``: for ``make cluster``,
the tests and the two-host demo.

``LocalCluster(ports).start()`` starts one ``redis-server`` per port (bound to 127.0.0.1,
protected mode on, no persistence, data under a temporary directory), joins them with
``redis-cli --cluster create`` and waits until the cluster says ``cluster_state:ok``.
``stop()`` ends exactly the processes it started, by PID.  ``kill(i)`` SIGKILLs master
``i`` and ``restart(i)`` brings it back on the same port (an empty node that rejoins
from its nodes.conf).  With ``replicas=1`` each master gets a replica on port + 100.

Command line (what the Makefile's ``cluster`` / ``cluster-stop`` targets run)::

    python -m shmkv.tier.cluster start [--ports 7000,7001,7002] [--dir D] [--replicas N]
    python -m shmkv.tier.cluster stop  [--dir D]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

__all__ = ["LocalCluster", "free_ports", "masters_serving", "redis_available"]


def redis_available() -> bool:
    """Whether redis-server and redis-cli are on PATH."""
    return bool(shutil.which("redis-server") and shutil.which("redis-cli"))


def masters_serving(cluster_nodes: str) -> List[str]:
    """The ``host:port`` of every master that serves slots and is not failed, from the
    text of ``CLUSTER NODES``."""
    out = []
    for ln in cluster_nodes.splitlines():
        f = ln.split()
        if len(f) > 8 and "master" in f[2].split(",") and "fail" not in f[2].split(","):
            out.append(f[1].split("@")[0])
    return out


def free_ports(n: int, start: int = 17000, stop: int = 27000) -> List[int]:
    """n loopback ports with their cluster-bus port (+10000) free too, bounded search."""
    out: List[int] = []
    base = start + (os.getpid() * 37) % (stop - start - 200)
    p = base
    while len(out) < n and p < base + 2000:
        if _port_free(p) and _port_free(p + 10000) and _port_free(p + 100) \
                and _port_free(p + 10100):
            out.append(p)
            p += 3
        else:
            p += 1
    if len(out) < n:
        raise RuntimeError("free_ports: no free loopback ports found")
    return out


def _port_free(port: int) -> bool:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _ping(port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class LocalCluster:
    """A Redis Cluster of ``len(ports)`` masters on 127.0.0.1 (see the module doc)."""

    def __init__(self, ports: Sequence[int] = (7000, 7001, 7002), *,
                 directory: Optional[str] = None, replicas: int = 0,
                 maxmemory: Optional[str] = None) -> None:
        if len(ports) < 3:
            raise ValueError("ports: a Redis Cluster needs at least 3 masters")
        self.ports = list(ports)
        self.replica_ports = [p + 100 for p in self.ports] if replicas else []
        self.own_dir = directory is None
        self.dir = directory or tempfile.mkdtemp(prefix="shmkv-redis-")
        self.maxmemory = maxmemory
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}"

    def _spawn(self, port: int) -> None:
        d = os.path.join(self.dir, str(port))
        os.makedirs(d, exist_ok=True)
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                "--protected-mode", "yes", "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
                "--cluster-require-full-coverage", "no",
                "--cluster-allow-reads-when-down", "no",
                # a replica takes over however long it was apart from its master (the
                # default refuses one that never finished its first sync in time)
                "--cluster-replica-validity-factor", "0",
                "--save", "", "--appendonly", "no", "--dir", d,
                "--logfile", os.path.join(d, "redis.log"), "--daemonize", "no"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL,
                                            start_new_session=True)

    def _wait_ping(self, port: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not _ping(port):
            if time.monotonic() > deadline or self.procs[port].poll() is not None:
                raise RuntimeError(f"redis-server on port {port} did not start "
                                   f"(log: {self.dir}/{port}/redis.log)")
            time.sleep(0.05)

    def start(self, timeout: float = 30.0) -> "LocalCluster":
        try:
            every = self.ports + self.replica_ports
            for p in every:
                self._spawn(p)
            for p in every:
                self._wait_ping(p)
            cmd = ["redis-cli", "--cluster", "create"]
            cmd += [f"127.0.0.1:{p}" for p in every]
            cmd += ["--cluster-replicas", "1" if self.replica_ports else "0", "--cluster-yes"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=timeout)
            self.wait_ok(timeout)
            deadline = time.monotonic() + timeout
            for p in self.replica_ports:            # every replica in sync
                while "master_link_status:up" not in self._cli(p, "info", "replication"):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"replica on port {p} did not sync")
                    time.sleep(0.1)
            self._save_state()
            return self
        except BaseException:
            self.stop()
            raise

    def _cli(self, port: int, *args: str, timeout: float = 5.0) -> str:
        r = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True,
                           timeout=timeout)
        return r.stdout.decode(errors="replace")

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every master says cluster_state:ok (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all("cluster_state:ok" in self._cli(p, "cluster", "info")
                       for p in self.ports):
                    return
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def wait_failover(self, i: int, timeout: float = 30.0) -> None:
        """After ``kill(i)`` of a master with a replica: until a live node's map has the
        replica serving its slots (no failed master with slots) and every live node says
        cluster_state:ok.  Bounded: RuntimeError past ``timeout``."""
        dead = f"127.0.0.1:{self.ports[i]}"
        live = [p for p in self.ports + self.replica_ports
                if p in self.procs and self.procs[p].poll() is None]
        deadline = time.monotonic() + timeout
        while True:
            try:
                nodes = self._cli(live[0], "cluster", "nodes")
                serving = masters_serving(nodes)
                if (dead not in serving and len(serving) == len(self.ports)
                        and all("cluster_state:ok" in self._cli(p, "cluster", "info")
                                for p in live)):
                    return
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no replica took over the slots of {dead}")
            time.sleep(0.1)

    def pid(self, i: int) -> int:
        return self.procs[self.ports[i]].pid

    def kill(self, i: int) -> None:
        """SIGKILL master i (a process this object started)."""
        p = self.procs[self.ports[i]]
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=10)

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start master i again on its port (it rejoins from its nodes.conf)."""
        port = self.ports[i]
        self._spawn(port)
        self._wait_ping(port)
        self.wait_ok(timeout)
        self._save_state()

    def flushall(self) -> None:
        for p in self.ports:
            self._cli(p, "flushall")

    def _save_state(self) -> None:
        with open(os.path.join(self.dir, "cluster.json"), "w") as f:
            json.dump({"pids": {str(p): pr.pid for p, pr in self.procs.items()},
                       "ports": self.ports}, f)

    def stop(self) -> None:
        """End the servers this object started (by PID), then remove its directory."""
        for p in list(self.procs.values()):
            if p.poll() is None:
                p.terminate()
        for p in list(self.procs.values()):
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs.clear()
        if self.own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_saved(directory: str) -> int:
    """``make cluster-stop``: ends the servers recorded by ``start`` (their PIDs, each
    checked to still be a redis-server) and removes the directory."""
    path = os.path.join(directory, "cluster.json")
    try:
        with open(path) as f:
            state = json.load(f)
    except FileNotFoundError:
        print(f"no cluster recorded in {directory}")
        return 0
    for pid in state["pids"].values():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"redis-server" not in f.read():
                    continue
            os.kill(int(pid), signal.SIGTERM)
        except (FileNotFoundError, ProcessLookupError):
            pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            os.path.exists(f"/proc/{pid}") for pid in state["pids"].values()):
        time.sleep(0.05)
    shutil.rmtree(directory, ignore_errors=True)
    print(f"stopped the cluster on ports {state['ports']}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shmkv.tier.cluster")
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("--ports", default="7000,7001,7002")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "shmkv-cluster"))
    ap.add_argument("--replicas", type=int, default=0)
    a = ap.parse_args(argv)
    if a.action == "stop":
        return _stop_saved(a.dir)
    if not redis_available():
        print("redis-server / redis-cli not found: `make redis` installs them", file=sys.stderr)
        return 2
    if os.path.exists(os.path.join(a.dir, "cluster.json")):
        print(f"a cluster is recorded in {a.dir} already: `make cluster-stop` first",
              file=sys.stderr)
        return 1
    os.makedirs(a.dir, exist_ok=True)
    c = LocalCluster([int(p) for p in a.ports.split(",")], directory=a.dir,
                     replicas=a.replicas)
    c.start()
    for p in c.procs.values():        # left running on purpose: `stop` ends them by PID
        p.returncode = 0
    print(f"Redis Cluster up: {c.url} (masters {c.ports}"
          + (f", replicas {c.replica_ports}" if c.replica_ports else "")
          + f"); data and PIDs in {a.dir}; stop with `make cluster-stop`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
