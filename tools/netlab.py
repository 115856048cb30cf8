"""Hosts as network namespaces on one machine: the lab for a fleet across hosts.

    with Lab(["a", "b", "r"]) as lab:
        cl = lab.cluster(["r", "r", "r"], replicas=["a", "b", "r"])  # Redis Cluster nodes
        lab.delay("b", 0.001)            # host B reaches the cluster 1 ms later each way
        p = lab.popen("a", [sys.executable, "worker.py", cl.url])   # a process on host A
        lab.partition("b"); lab.heal("b")                            # B's link down, up

Each host is a network namespace joined to one switch (a bridge in a namespace of its
own: nothing of it touches the machine's network) by a veth pair, with an address on
``10.213.0.0/24`` and an alias on ``10.213.1.0/24``, and a mount namespace of its own
whose ``/dev/shm`` is a fresh tmpfs: the host's processes share it, and no other host
sees it.  A host's mount namespace is held by one sleeping process; ``popen`` runs a
command in both namespaces through ``nsenter``.

The cluster's nodes are Debian's ``redis-server`` on the hosts named, each with an
address of its own on ``10.213.2.0/24`` (on its host's link; announced to clients and to
the other nodes) and its host's alias.  Delay: this kernel has no ``netem`` qdisc, so
``delay(host, s)`` puts a delaying TCP proxy (tools/delay_proxy.py) in the delayed host
for every node on another host, its client port and its bus port: the node's address is
made local inside the delayed host (on ``lo``; ``arp_ignore=1``/``arp_announce=2`` keep
it from answering for it on the wire) and the proxy forwards to the node's host alias.
The cluster's redirections (``MOVED``) name the node addresses, so they too go through
the proxies; the other hosts' own addresses are not touched (their connections to the
delayed host's services stay direct).  A partition sets the host's port on the switch
down.

Everything the lab makes it removes on exit, also when the code inside fails: the
processes it started (by PID), the namespaces (their links go with them).  Needs root
(CI runs as root) and ``ip``/``nsenter``/``unshare``.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from shmkv.tier.cluster import masters_serving

__all__ = ["Agent", "Lab", "LabCluster", "lab_available"]

HERE = os.path.dirname(os.path.abspath(__file__))
_CLONE_NEWNET = 0x40000000


def lab_available() -> Optional[str]:
    """None when a lab can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "nsenter", "unshare", "redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    return None


def _run(*args: str, timeout: float = 30.0) -> str:
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r.stdout


@dataclass
class _Host:
    name: str
    ns: str
    index: int
    ip: str                     # 10.213.0.x: announced, what clients connect to
    alias: str                  # 10.213.1.x: where the delaying proxies forward to
    port: str                   # its veth's end on the switch
    holder: Optional[subprocess.Popen] = None
    proxies: list = field(default_factory=list)


@dataclass
class LabCluster:
    """A Redis Cluster of the lab: nodes (host, ip, port), and the URL of the first."""
    nodes: list
    replicas: int
    procs: dict = field(default_factory=dict)     # port -> Popen

    @property
    def url(self) -> str:
        """Every node, as a client lists its seeds (one that is down is skipped)."""
        return "redis://" + ",".join(f"{ip}:{p}" for _, ip, p in self.nodes)


class Lab:
    def __init__(self, hosts: Sequence[str], *, shm_size: str = "2g",
                 tag: Optional[str] = None) -> None:
        why = lab_available()
        if why:
            raise RuntimeError(f"netlab: {why}")
        if not 2 <= len(hosts) <= 8 or len(set(hosts)) != len(hosts):
            raise ValueError(f"hosts: 2 to 8 distinct names, got {list(hosts)}")
        self.tag = tag or uuid.uuid4().hex[:6]
        self.shm_size = shm_size
        self.switch = f"shmkv-{self.tag}-sw"
        self.hosts = {h: _Host(h, f"shmkv-{self.tag}-{h}", i, f"10.213.0.{10 + i}",
                               f"10.213.1.{10 + i}", f"p{self.tag}{i}")
                      for i, h in enumerate(hosts)}
        self.procs: list[subprocess.Popen] = []
        self.clusters: list[LabCluster] = []
        self._made: list[str] = []

    # ---- making and removing ------------------------------------------------------
    def __enter__(self) -> "Lab":
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        sw = self.switch
        _run("ip", "netns", "add", sw)
        self._made.append(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        for h in self.hosts.values():
            _run("ip", "netns", "add", h.ns)
            self._made.append(h.ns)
            _run("ip", "-n", h.ns, "link", "add", "eth0", "type", "veth", "peer", "name",
                 h.port, "netns", sw)
            _run("ip", "-n", sw, "link", "set", h.port, "master", "br0", "up")
            _run("ip", "-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
            _run("ip", "-n", h.ns, "addr", "add", f"{h.alias}/24", "dev", "eth0")
            _run("ip", "-n", h.ns, "link", "set", "eth0", "up")
            _run("ip", "-n", h.ns, "link", "set", "lo", "up")
            _run("ip", "-n", h.ns, "route", "add", "10.213.2.0/24", "dev", "eth0")
            for k, v in (("arp_ignore", "1"), ("arp_announce", "2")):
                for dev in ("all", "eth0"):
                    _run("ip", "netns", "exec", h.ns, "sysctl", "-qw",
                         f"net.ipv4.conf.{dev}.{k}={v}")
            # the host's mount namespace, its own /dev/shm; held by this process
            h.holder = subprocess.Popen(
                ["ip", "netns", "exec", h.ns, "unshare", "--mount", "--propagation",
                 "private", "sh", "-c",
                 f"mount -t tmpfs -o size={self.shm_size},mode=1777 shmkv-lab /dev/shm "
                 "&& echo ready && exec sleep 2147483647"],
                stdout=subprocess.PIPE, text=True, start_new_session=True)
            self.procs.append(h.holder)
            assert h.holder.stdout is not None
            if h.holder.stdout.readline().strip() != "ready":
                raise RuntimeError(f"netlab: host {h.name}'s /dev/shm was not mounted")

    def close(self) -> None:
        """Ends every process the lab started (by PID, their groups), removes the
        namespaces.  Safe to call twice."""
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()
        shutil.rmtree(f"/tmp/shmkv-lab-{self.tag}", ignore_errors=True)

    # ---- processes on hosts -------------------------------------------------------
    def prefix(self, host: str) -> list[str]:
        """The command prefix that runs a program on ``host`` (its network and mount
        namespaces; this process's user, environment and working directory)."""
        h = self.hosts[host]
        assert h.holder is not None
        return ["nsenter", "-t", str(h.holder.pid), "--net", "--mount", "--"]

    def popen(self, host: str, args: Sequence[str], **kw) -> subprocess.Popen:
        """A process on ``host``, in a process group of its own; ended by close()."""
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen([*self.prefix(host), *args], **kw)
        self.procs.append(p)
        return p

    def run(self, host: str, args: Sequence[str], timeout: float = 120.0,
            **kw) -> subprocess.CompletedProcess:
        """Runs a program on ``host`` to its end, its output captured (text); killed past
        ``timeout`` (RuntimeError)."""
        p = self.popen(host, args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, **kw)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            raise RuntimeError(f"netlab: {list(args)[:3]} on {host} ran past {timeout} s: "
                               f"{(err or '')[-2000:]}") from None
        finally:
            self.procs.remove(p)
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def call(self, host: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` in a new thread of this process that has joined ``host``'s
        network namespace (``setns`` moves only the calling thread): the sockets ``fn``
        opens are the host's -- HTTP to a server it runs on its 127.0.0.1, a Redis client
        of the cluster -- without a process per call.  Its result, or its exception."""
        path = f"/run/netns/{self.hosts[host].ns}"
        out: list = [None, None]

        def run() -> None:
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.setns(fd, _CLONE_NEWNET) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"setns({path}): {os.strerror(err)}")
                finally:
                    os.close(fd)
                out[0] = fn(*args, **kw)
            except BaseException as e:       # raised in the caller's thread below
                out[1] = e

        t = threading.Thread(target=run, name=f"netlab-{host}", daemon=True)
        t.start()
        t.join()
        if out[1] is not None:
            raise out[1]
        return out[0]

    # ---- the Redis Cluster --------------------------------------------------------
    def cluster(self, masters: Sequence[str], replicas: Sequence[str] = (),
                port: int = 7000, timeout: float = 60.0) -> LabCluster:
        """A Redis Cluster: a master on each host of ``masters`` and a replica on each
        host of ``replicas`` (as many as masters, or none), ports from ``port`` up."""
        if replicas and len(replicas) != len(masters):
            raise ValueError("replicas: none, or one per master")
        nodes = []
        first = sum(len(c.nodes) for c in self.clusters)
        for i, h in enumerate(list(masters) + list(replicas)):
            ip = f"10.213.2.{10 + first + i}"           # the node's own address
            _run("ip", "-n", self.hosts[h].ns, "addr", "add", f"{ip}/32", "dev", "eth0")
            nodes.append((h, ip, port + i))
        c = LabCluster(nodes, 1 if replicas else 0)
        self.clusters.append(c)
        d = f"/tmp/shmkv-lab-{self.tag}"
        for h, ip, p in nodes:
            os.makedirs(f"{d}/{p}", exist_ok=True)
            c.procs[p] = self.popen(h, [
                "redis-server", "--port", str(p), "--bind", ip, self.hosts[h].alias,
                "--protected-mode", "no", "--cluster-enabled", "yes",
                "--cluster-config-file", f"{d}/{p}/nodes.conf", "--cluster-announce-ip", ip,
                "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no",
                # a replica takes over however long it was apart from its master (the
                # default refuses one that never finished its first sync in time)
                "--cluster-replica-validity-factor", "0",
                "--save", "", "--appendonly", "no", "--dir", f"{d}/{p}",
                "--logfile", f"{d}/{p}/redis.log"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for h, ip, p in nodes:
            self._wait_ping(h, ip, p, timeout)
        h0 = nodes[0][0]
        self.run(h0, ["redis-cli", "--cluster", "create", *[f"{ip}:{p}" for _, ip, p in nodes],
                      "--cluster-replicas", str(c.replicas), "--cluster-yes"], timeout=timeout)
        self.wait_cluster_ok(c, timeout)
        t0 = time.monotonic()
        for h, ip, p in nodes[len(masters):]:          # every replica in sync
            while "master_link_status:up" not in self._cli(h, ip, p, "info", "replication"):
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"netlab: replica {ip}:{p} did not sync")
                time.sleep(0.1)
        return c

    def _cli(self, host: str, ip: str, port: int, *args: str) -> str:
        try:
            return self.run(host, ["redis-cli", "-h", ip, "-p", str(port), *args],
                            timeout=10).stdout
        except RuntimeError:
            return ""

    def _wait_ping(self, host: str, ip: str, port: int, timeout: float) -> None:
        t0 = time.monotonic()
        while "PONG" not in self._cli(host, ip, port, "ping"):
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"netlab: redis-server {ip}:{port} on {host} did not start")
            time.sleep(0.1)

    def wait_cluster_ok(self, c: LabCluster, timeout: float = 60.0) -> None:
        """Until every live node of ``c`` says cluster_state:ok (bounded)."""
        t0 = time.monotonic()
        while True:
            live = [(h, ip, p) for h, ip, p in c.nodes if c.procs[p].poll() is None]
            if all("cluster_state:ok" in self._cli(h, ip, p, "cluster", "info")
                   for h, ip, p in live):
                return
            if time.monotonic() - t0 > timeout:
                raise RuntimeError("netlab: the cluster did not reach cluster_state:ok")
            time.sleep(0.2)

    def masters(self, c: LabCluster) -> list[tuple[str, int]]:
        """(ip, port) of every master of ``c`` that serves slots now, as a live node
        sees it."""
        for h, ip, p in c.nodes:
            if c.procs[p].poll() is None:
                out = self._cli(h, ip, p, "cluster", "nodes")
                if out:
                    return [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1]))
                            for a in masters_serving(out)]
        raise RuntimeError("netlab: no node of the cluster answers")

    def kill_node(self, c: LabCluster, i: int) -> None:
        """SIGKILL node ``i`` of ``c`` (a process this lab started)."""
        p = c.procs[c.nodes[i][2]]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)

    def wait_failover(self, c: LabCluster, i: int, timeout: float = 60.0) -> None:
        """After kill_node(c, i) of a master: until a live node's CLUSTER SLOTS names it
        no more (its replica took its slots over) and every live node says ok."""
        dead = f"{c.nodes[i][1]}:{c.nodes[i][2]}"
        t0 = time.monotonic()
        while True:
            live = [(h, ip, p) for h, ip, p in c.nodes if c.procs[p].poll() is None]
            h, ip, p = live[0]
            nodes = self._cli(h, ip, p, "cluster", "nodes")
            serving = masters_serving(nodes)
            masters = len(c.nodes) // (2 if c.replicas else 1)
            if dead not in serving and len(serving) == masters:
                self.wait_cluster_ok(c, timeout)
                return
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"netlab: no replica took the slots of {dead} over")
            time.sleep(0.2)

    # ---- the network between hosts ------------------------------------------------
    def delay(self, host: str, seconds: float, jitter: float = 0.0) -> None:
        """``host`` reaches every cluster node on another host ``seconds`` later each
        way (plus up to ``jitter``): see the module docstring."""
        h = self.hosts[host]
        if h.proxies:
            raise RuntimeError(f"netlab: host {host} is delayed already")
        targets = {(ip, p, self.hosts[n].alias) for c in self.clusters
                   for n, ip, p in c.nodes if n != host}
        for ip in sorted({t[0] for t in targets}):
            _run("ip", "-n", h.ns, "addr", "add", f"{ip}/32", "dev", "lo")
        pairs = [f"{ip}:{q}={alias}:{q}" for ip, p, alias in sorted(targets)
                 for q in (p, p + 10000)]               # the client port, the bus port
        proxy = self.popen(host, [sys.executable, os.path.join(HERE, "delay_proxy.py"),
                                  "--delay", str(seconds), "--jitter", str(jitter), *pairs],
                           stdout=subprocess.PIPE, text=True)
        assert proxy.stdout is not None
        if proxy.stdout.readline().strip() != "ready":
            raise RuntimeError(f"netlab: the delaying proxy on {host} did not start")
        h.proxies.append(proxy)

    def undelay(self, host: str) -> None:
        """Ends ``host``'s delay: its proxies stop (the connections through them close:
        a client reconnects, directly) and the node addresses leave its ``lo``."""
        h = self.hosts[host]
        for p in h.proxies:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
            self.procs.remove(p)
        h.proxies.clear()
        for ip in sorted({ip for c in self.clusters for n, ip, _ in c.nodes if n != host}):
            subprocess.run(["ip", "-n", h.ns, "addr", "del", f"{ip}/32", "dev", "lo"],
                           capture_output=True, timeout=30)

    def partition(self, host: str) -> None:
        """Cuts ``host`` off the switch (its link down): every connection from or to it
        stalls until heal()."""
        _run("ip", "-n", self.switch, "link", "set", self.hosts[host].port, "down")

    def heal(self, host: str) -> None:
        _run("ip", "-n", self.switch, "link", "set", self.hosts[host].port, "up")


class Agent:
    """A long-lived tools/host_agent.py on a host of the lab, its own segment there;
    ``agent(op, **kw)`` sends one command and returns the answer (see host_agent.py)."""

    def __init__(self, lab: Lab, host: str, url: str) -> None:
        self.p = lab.popen(host, [sys.executable, os.path.join(HERE, "host_agent.py"),
                                  f"shmkv-lab-{host}", url],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           cwd="/tmp")
        if json.loads(self._line()) != {"ready": True}:
            raise RuntimeError(f"netlab: the agent on host {host} did not start")

    def _line(self) -> str:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"netlab: the host agent exited ({self.p.poll()})")
        return line

    def __call__(self, op: str, **kw) -> dict:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.p.stdin.flush()
        return json.loads(self._line())

    def close(self, timeout: float = 30.0) -> None:
        """Ends the agent (it removes its segment first)."""
        if self.p.stdin is not None and not self.p.stdin.closed:
            self.p.stdin.close()
        self.p.wait(timeout=timeout)


def demo(delays: Sequence[float], blocks: int) -> None:
    """``make demo-hosts``: host A computes a prompt and writes it through to a cluster on
    three hosts; host B, another host with its own /dev/shm, loads it over the network,
    with added latency each way."""
    with Lab(["a", "b", "r"]) as lab:
        c = lab.cluster(["a", "b", "r"], replicas=["b", "r", "a"])
        print(f"3 hosts (network namespaces on a switch of their own, each its own "
              f"/dev/shm); Redis Cluster of 3 masters + 3 replicas over them: {c.url}")
        a, b = Agent(lab, "a", c.url), Agent(lab, "b", c.url)
        try:
            for i, d in enumerate(delays):
                if d:
                    lab.delay("b", d)
                    b("tier", timeout=max(1.0, 20 * d), deadline=30.0)
                    b("lookup", seed=99, blocks=1)   # the new client reads the map once
                w = a("prefill", seed=100 + i, blocks=blocks)
                got = b("lookup", seed=100 + i, blocks=blocks)
                print(f"B's link +{d * 1e3:.1f} ms each way: A wrote {w['written']} blocks; "
                      f"B loaded {got['tokens']} tokens over the network in "
                      f"{got['seconds'] * 1e3:.1f} ms, K/V equal to A's: {got['equal']}")
                if d:
                    lab.undelay("b")
        finally:
            a.close()
            b.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/netlab.py")
    ap.add_argument("--smoke", action="store_true",
                    help="three hosts, a cluster, a PING from each host to each node")
    ap.add_argument("--delay", type=float, nargs="+", default=[0.0002, 0.001, 0.005],
                    help="the added latency of the demo's next runs (seconds, each way)")
    ap.add_argument("--blocks", type=int, default=128)
    a = ap.parse_args(argv)
    if a.smoke:
        with Lab(["a", "b", "r"]) as lab:
            c = lab.cluster(["a", "b", "r"])
            lab.delay("b", a.delay[0])
            for h in lab.hosts:
                for _, ip, p in c.nodes:
                    t0 = time.monotonic()
                    out = lab.run(h, ["redis-cli", "-h", ip, "-p", str(p), "ping"]).stdout
                    print(f"host {h} -> {ip}:{p}: {out.strip()} in "
                          f"{(time.monotonic() - t0) * 1e3:.0f} ms")
        return 0
    demo([0.0, *a.delay], a.blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
