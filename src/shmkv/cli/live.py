"""The commands that watch a segment over time: ``top`` (frames from counter deltas,
redrawn with rich on a terminal) and ``metrics`` (the Prometheus text exposition, on stdout
or served over HTTP)."""
from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
import time

import numpy as np

from .. import inspect as shmkv_inspect
from ..errors import SegmentError
from .common import EXIT_OK, CLIError
from .reader import analyze, load
from .render import emit_json, owner_cell, paint, table

RATE_KEYS = (("allocations", "allocs"), ("frees", "frees"), ("appended_tokens", "append tok"),
             ("forks", "forks"), ("cow_copies", "COW"), ("recoveries", "recoveries"),
             ("gathered_tokens", "gather tok"), ("reclaimed_blocks", "reclaimed blk"))


def top_frame(name, snap, prev, dt, n_top):
    view = analyze(snap)
    cfg = snap["config"]
    c = snap["counters"]
    rates = {k: (max(0, c[k] - prev[k]) / dt if prev is not None and dt > 0 else None)
             for k, _ in RATE_KEYS}
    top = sorted(view["seqs"], key=lambda s: (-s["blocks"], -s["len"], s["sid"]))[:n_top]
    return dict(time=time.time(), name=name, num_blocks=cfg.num_blocks,
                used_blocks=snap["used_blocks"], cached_blocks=snap["cached_blocks"],
                peak_used_blocks=snap["peak_used_blocks"],
                used_pct=round(100.0 * snap["used_blocks"] / cfg.num_blocks, 2),
                num_sequences=len(view["seqs"]), max_seqs=cfg.max_seqs,
                tokens=sum(s["len"] for s in view["seqs"]),
                processes_alive=view["alive"], processes_dead=view["dead"]["processes"],
                dead=view["dead"], rates=rates, counters=dict(c), top_sequences=top,
                processes=view["procs"])


def render_frame(f, interval):
    width = 30
    filled = round(width * f["used_blocks"] / f["num_blocks"])
    bar = paint("#" * filled, "green" if f["used_pct"] < 90 else "red") + \
        paint("." * (width - filled), "dim")
    stamp = time.strftime("%H:%M:%S", time.localtime(f["time"]))
    out = [paint(f"shmkv top {f['name']}", "bold") + f"   {stamp}   every {interval:g}s",
           (f"util   [{bar}] {f['used_pct']:5.1f}%  {f['used_blocks']}/{f['num_blocks']} used"
            f", {f['cached_blocks']} cached, peak {f['peak_used_blocks']}"),
           (f"seqs   {f['num_sequences']}/{f['max_seqs']}  tokens {f['tokens']}   "
            f"procs {f['processes_alive']} live")
           + (paint(f", {f['processes_dead']} DEAD", "bold red") if f["processes_dead"] else "")]
    parts = []
    for k, label in RATE_KEYS:
        r = f["rates"][k]
        parts.append(f"{label} {r:,.1f}" if r is not None else f"{label} -")
    half = len(parts) // 2
    out.append("rate/s " + "  ".join(parts[:half]))
    out.append("       " + "  ".join(parts[half:]))
    out.append("")
    if f["top_sequences"]:
        rows = [[s["sid"], s["owner_pid"] if s["owner_pid"] is not None else "-",
                 owner_cell(s), s["len"], s["blocks"], s["shared_blocks"]]
                for s in f["top_sequences"]]
        out.append(paint("top sequences", "bold"))
        out.append(table(["SID", "OWNER", "STATE", "LEN", "BLOCKS", "SHARED"], rows,
                         align="rrlrrr", indent="  "))
    else:
        out.append("no sequences")
    if f["processes"]:
        rows = [[p["pid"], ("alive", "green") if p["alive"] else ("DEAD", "bold red"),
                 p["sequences"], p["tokens"], p["blocks"]] for p in f["processes"]]
        out.append(paint("processes", "bold"))
        out.append(table(["PID", "STATE", "SEQS", "TOKENS", "BLOCKS"], rows, align="rlrrr",
                         indent="  "))
    else:
        out.append("no process attached")
    return "\n".join(out)


def cmd_top(args):
    if args.interval <= 0:
        raise CLIError("top: --interval must be > 0")
    if args.json and not args.iterations:
        raise CLIError("top: --json needs --iterations N (it prints one JSON list of frames)")
    prev = load(args.name, tables=False)["counters"]
    t_prev = time.monotonic()
    frames = []
    live = None
    if not args.json and sys.stdout.isatty() and not args.plain:
        try:
            from rich.console import Console
            from rich.live import Live
            from rich.text import Text

            console = Console()
            live = Live(Text("shmkv top: first sample in "
                             f"{args.interval:g}s ..."), console=console, auto_refresh=False,
                        screen=False)
            live.start()
        except ImportError:
            live = None
    n = 0
    try:
        while not args.iterations or n < args.iterations:
            time.sleep(args.interval)
            snap = load(args.name, tables=True)
            now = time.monotonic()
            f = top_frame(args.name, snap, prev, now - t_prev, args.top)
            prev, t_prev = snap["counters"], now
            n += 1
            if args.json:
                frames.append(f)
            elif live is not None:
                live.update(Text.from_ansi(render_frame(f, args.interval)), refresh=True)
            else:
                print(render_frame(f, args.interval))
                print(flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
    if args.json:
        emit_json(frames)
    return EXIT_OK


_COUNTER_HELP = {
    "allocations": "Blocks taken from the pool.",
    "frees": "Blocks returned to the pool.",
    "forks": "Sequences forked (copy-on-write).",
    "cow_copies": "Partial blocks copied before a write (copy-on-write).",
    "sequences_created": "Sequences created.",
    "sequences_freed": "Sequences freed.",
    "appended_tokens": "Tokens appended (append and reserve).",
    "gathered_tokens": "Tokens gathered.",
    "recoveries": "Recovery passes run.",
    "reclaimed_sequences": "Sequences reclaimed from dead processes.",
    "reclaimed_blocks": "Blocks reclaimed from dead processes.",
    "lock_owner_dead": "Times the pool lock was found held by a dead process.",
    "lock_waits": "Times a lock was busy and a process waited.",
    "prefix_queries": "Tokens looked up in the prefix cache.",
    "prefix_hits": "Tokens found in the prefix cache.",
    "cached_blocks_reused": "Cached blocks taken by a prefix hit.",
    "cached_blocks_evicted": "Cached blocks reused for new data.",
    "trimmed_blocks": "Blocks trimmed from sequences.",
    "processes_attached": "Process attachments.",
    "tier_hits": "Blocks loaded from the remote tier (summed over the processes with one set).",
    "tier_misses": "Remote-tier lookups that ended on an absent, corrupt or foreign value.",
    "tier_errors": "Remote-tier calls that failed (node down, timeout, refused, queue full).",
    "tier_bytes_in": "Bytes read from the remote tier.",
    "tier_bytes_out": "Bytes stored in the remote tier.",
}


def _esc(v):
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_value(v):
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def exposition(names):
    """Prometheus text exposition (format 0.0.4) of every segment in `names`."""
    fams = {}      # name -> (type, help, [(labels dict, value)])

    def add(metric, mtype, help_, labels, value):
        fams.setdefault(metric, (mtype, help_, []))[2].append((labels, value))

    for name in names:
        base = {"segment": name}
        try:
            snap = shmkv_inspect.snapshot(name, tables=True)
        except (OSError, SegmentError):
            add("shmkv_up", "gauge", "1 if the segment could be read, else 0.", base, 0)
            continue
        view = analyze(snap)
        cfg = snap["config"]
        b = view["blocks"]
        add("shmkv_up", "gauge", "1 if the segment could be read, else 0.", base, 1)
        add("shmkv_info", "gauge", "Configuration of the segment (value 1).",
            {**base, "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads,
             "head_dim": cfg.head_dim, "block_size": cfg.block_size, "dtype": cfg.dtype,
             "layout_version": snap["layout_version"]}, 1)
        gauges = [
            ("shmkv_segment_size_bytes", "Size of the shared-memory segment.",
             snap["segment_size"]),
            ("shmkv_block_size_tokens", "Tokens per block.", cfg.block_size),
            ("shmkv_bytes_per_block", "K+V bytes of one block over all layers.",
             cfg.bytes_per_block),
            ("shmkv_blocks_capacity", "Physical blocks in the pool.", cfg.num_blocks),
            ("shmkv_blocks_used", "Blocks with refcount > 0.", snap["used_blocks"]),
            ("shmkv_blocks_free", "Blocks with refcount 0 (cached ones included).",
             snap["free_blocks"]),
            ("shmkv_blocks_cached", "Free blocks still holding a prefix-cache entry.",
             snap["cached_blocks"]),
            ("shmkv_blocks_shared", "Blocks with refcount > 1.", b["shared"]),
            ("shmkv_blocks_used_peak", "High-water mark of used blocks.",
             snap["peak_used_blocks"]),
            ("shmkv_blocks_dead", "Blocks used only by sequences of dead processes.",
             b["held_by_dead"]),
            ("shmkv_tokens", "Tokens in all live sequences.",
             sum(s["len"] for s in view["seqs"])),
            ("shmkv_wasted_token_slots", "Empty token slots in used blocks.",
             b["fragmentation"]["wasted_token_slots"]),
            ("shmkv_sequences", "Live sequences.", len(view["seqs"])),
            ("shmkv_sequences_capacity", "Sequence slots.", cfg.max_seqs),
            ("shmkv_sequences_dead", "Sequences owned by dead processes (reclaimable).",
             view["dead"]["sequences"]),
            ("shmkv_processes", "Live attached processes.", view["alive"]),
            ("shmkv_processes_dead", "Dead processes still in the process table.",
             view["dead"]["processes"]),
            ("shmkv_processes_capacity", "Process-table slots.", cfg.max_procs),
            ("shmkv_index_entries", "Entries in the prefix-cache hash index.",
             snap["index_entries"]),
            ("shmkv_recovery_last_seconds", "Duration of the last recovery pass.",
             snap["last_recovery_s"]),
            ("shmkv_recovery_max_seconds", "Longest recovery pass.", snap["max_recovery_s"]),
            ("shmkv_events_capacity", "KV events the segment's ring keeps (0: off).",
             snap["events"]["capacity"]),
        ]
        for metric, help_, value in gauges:
            add(metric, "gauge", help_, base, value)
        ev = snap["events"]
        add("shmkv_events_total", "counter", "KV events written (the next event's seq).",
            base, ev["head"])
        add("shmkv_events_overwritten_total", "counter",
            "KV events the ring no longer holds (a reader further behind lost them).",
            base, max(0, ev["head"] - ev["capacity"]) if ev["capacity"] else 0)
        for key, value in snap["counters"].items():
            if key.startswith("evictions_"):
                add("shmkv_evictions_total", "counter", "Cached blocks evicted, by policy.",
                    {**base, "policy": key[len("evictions_"):]}, value)
                continue
            add(f"shmkv_{key}_total", "counter",
                _COUNTER_HELP.get(key, f"Counter {key} of the segment."), base, value)
    out = []
    for metric, (mtype, help_, samples) in fams.items():
        out.append(f"# HELP {metric} {help_}")
        out.append(f"# TYPE {metric} {mtype}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
            out.append(f"{metric}{{{lab}}} {_fmt_value(value)}")
    return "\n".join(out) + "\n"


def parse_listen(text):
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 127.0.0.1:9464), got {text!r}")
    host = host.strip("[]")
    if not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a host, got {text!r}")
    return host, int(port)


def cmd_metrics(args):
    for name in args.names:
        load(name, tables=False)          # a bad name fails now, not at the first scrape
    if args.listen is None:
        text = exposition(args.names)
        if args.json:
            emit_json(dict(format="prometheus-0.0.4", text=text))
        else:
            sys.stdout.write(text)
        return EXIT_OK
    import socket
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from socketserver import ThreadingMixIn

    names = list(args.names)
    scrapes = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body = exposition(names).encode()
                ctype = "text/plain; version=0.0.4; charset=utf-8"
                code = 200
            elif path == "/":
                body = ("<html><body><h1>shmkv metrics</h1><p><a href=\"/metrics\">/metrics"
                        "</a> for " + ", ".join(names) + "</p></body></html>\n").encode()
                ctype, code = "text/html; charset=utf-8", 200
            else:
                body, ctype, code = b"not found; try /metrics\n", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            if path == "/metrics":
                scrapes.append(time.monotonic())

        def log_message(self, fmt, *a):
            if args.verbose:
                sys.stderr.write(f"shmkv metrics: {self.address_string()} {fmt % a}\n")

    class Server(ThreadingMixIn, HTTPServer):
        daemon_threads = True
        allow_reuse_address = True
        address_family = socket.AF_INET6 if ":" in args.listen[0] else socket.AF_INET

    try:
        server = Server(args.listen, Handler)
    except OSError as e:
        raise CLIError(f"metrics: cannot listen on {args.listen[0]}:{args.listen[1]}: "
                       f"{e.strerror or e}") from None
    host, port = server.server_address[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"shmkv metrics: serving http://{shown}:{port}/metrics", file=sys.stderr, flush=True)

    stopping = threading.Event()
    old = signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    deadline = time.monotonic() + args.duration if args.duration else None
    server.timeout = 0.2
    try:
        while not stopping.is_set():
            server.handle_request()
            if args.once and scrapes:
                break
            if deadline and time.monotonic() >= deadline:
                break
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, old)
        server.server_close()
    return EXIT_OK
