"""The read-only inspection commands: ``ls``, ``info``, ``seqs``, ``procs``, ``blocks``.
Each maps the segment through a snapshot (no lock, no registration), so it works on a segment
whose processes all died and never changes it."""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from .. import _core
from .common import EXIT_OK, SHM_DIR, plural
from .reader import dead_hint, load_view, scan, seg_path, seg_state
from .render import (
    STATE_STYLE,
    color_on,
    draw_png,
    emit_json,
    fmt_age,
    fmt_bytes,
    fmt_duration,
    fmt_pct,
    fmt_time_ns,
    owner_cell,
    paint,
    table,
)


def print_dead_hint(name, dead, style):
    """The closing line of info/seqs/procs/blocks when dead processes hold something."""
    hint = dead_hint(name, dead)
    if hint:
        print(paint(hint, style))


def cmd_ls(args):
    rows = scan(args.pattern, args.all)
    if args.json:
        emit_json(rows)
        return EXIT_OK
    if not rows:
        print(f"no shmkv segments in {SHM_DIR}" + (" matching " + " ".join(args.pattern)
                                                   if args.pattern else ""))
        return EXIT_OK
    body, notes = [], []
    for r in rows:
        st = (r["state"], STATE_STYLE.get(r["state"]))
        size = fmt_bytes(r["size_bytes"]) if r["size_bytes"] is not None else "-"
        if "model" in r:
            dead = r["processes_dead"]
            body.append([r["name"], size, r["model"], r["num_blocks"], f"{r['used_pct']:.1f}%",
                         r["num_sequences"], r["processes_alive"],
                         (str(dead), "bold red") if dead else "0", st])
            if r["dead_sequences"] or dead:
                notes.append(f"{r['name']}: {plural(r['dead_sequences'], 'sequence')} / "
                             f"{plural(r['dead_blocks'], 'block')} held by "
                             f"{plural(dead, 'dead process')} - "
                             f"`shmkv recover {r['name']}`")
        else:
            body.append([r["name"], size, "-", "-", "-", "-", "-", "-", st])
            notes.append(f"{r['name']}: {r['detail']}")
    print(table(["NAME", "SIZE", "MODEL", "BLOCKS", "USED", "SEQS", "PROCS", "DEAD", "STATE"],
                body, align="lrlrrrrrl"))
    for n in notes:
        print(paint(n, "yellow"))
    return EXIT_OK


def cmd_info(args):
    snap, view = load_view(args.name)
    cfg = snap["config"]
    lay = snap["layout"]
    pool = lay["off_vpool"] - lay["off_kpool"]
    doc = dict(
        name=args.name, path=seg_path(args.name), state=seg_state(snap, view),
        layout_version=snap["layout_version"], supported_layout_version=_core.LAYOUT_VERSION,
        abi_fingerprint=f"{snap['abi_fingerprint']:#018x}",
        creator_pid=snap["creator_pid"], create_time_ns=snap["create_time_ns"],
        create_time=fmt_time_ns(snap["create_time_ns"]), hash_seed=f"{snap['hash_seed']:#018x}",
        config=dataclasses.asdict(cfg),
        sizes=dict(segment_bytes=snap["segment_size"], kv_pool_bytes=2 * pool,
                   metadata_bytes=lay["off_kpool"], bytes_per_token=cfg.bytes_per_token,
                   bytes_per_block=cfg.bytes_per_block,
                   max_blocks_per_seq=cfg.max_blocks_per_seq,
                   token_capacity=cfg.num_blocks * cfg.block_size),
        usage=dict(num_blocks=cfg.num_blocks, used_blocks=snap["used_blocks"],
                   free_blocks=snap["free_blocks"], cached_blocks=snap["cached_blocks"],
                   peak_used_blocks=snap["peak_used_blocks"],
                   num_sequences=snap["num_sequences"], max_seqs=cfg.max_seqs,
                   processes_alive=view["alive"], processes_dead=view["dead"]["processes"],
                   max_procs=cfg.max_procs, index_entries=snap["index_entries"],
                   last_recovery_s=snap["last_recovery_s"],
                   max_recovery_s=snap["max_recovery_s"]),
        dead=view["dead"], counters=dict(snap["counters"]), layout=dict(lay),
        events=dict(snap["events"], overwritten=max(0, snap["events"]["head"]
                                                   - snap["events"]["capacity"])))
    if args.json:
        emit_json(doc)
        return EXIT_OK
    u, sz = doc["usage"], doc["sizes"]

    def kv(key, value):
        print(f"  {key:<22} {value}")

    print(paint(f"segment {args.name}", "bold") + f"  ({doc['path']})")
    kv("state", paint(doc["state"], STATE_STYLE[doc["state"]])
       + f"  ({u['processes_alive']} live, {plural(u['processes_dead'], 'dead process')})")
    kv("layout version", f"{doc['layout_version']} (this shmkv reads "
       f"{doc['supported_layout_version']}), ABI {doc['abi_fingerprint']}")
    kv("created", f"{doc['create_time']} by pid {doc['creator_pid']}")
    kv("size", f"{fmt_bytes(sz['segment_bytes'])} = KV pool {fmt_bytes(sz['kv_pool_bytes'])}"
       f" + metadata {fmt_bytes(sz['metadata_bytes'])}")
    print(paint("config", "bold"))
    for k, v in doc["config"].items():
        kv(k, v)
    print(paint("derived", "bold"))
    kv("bytes_per_token", f"{sz['bytes_per_token']} ({fmt_bytes(sz['bytes_per_token'])})")
    kv("bytes_per_block", f"{sz['bytes_per_block']} ({fmt_bytes(sz['bytes_per_block'])})")
    kv("max_blocks_per_seq", sz["max_blocks_per_seq"])
    kv("token capacity", sz["token_capacity"])
    print(paint("usage", "bold"))
    kv("blocks", f"{u['used_blocks']} used / {u['num_blocks']} "
       f"({fmt_pct(u['used_blocks'] / u['num_blocks'])}), {u['free_blocks']} free "
       f"({u['cached_blocks']} of them cached), peak {u['peak_used_blocks']}")
    kv("sequences", f"{u['num_sequences']} / {u['max_seqs']}")
    kv("processes", f"{u['processes_alive']} live + {u['processes_dead']} dead / "
       f"{u['max_procs']}")
    kv("prefix index entries", u["index_entries"])
    ev = doc["events"]
    kv("KV events", (f"{ev['head']} written (next seq), ring of {ev['capacity']}, "
                     f"{ev['overwritten']} overwritten" if ev["capacity"] else
                     "off (event_capacity 0)"))
    kv("recovery", f"last {fmt_duration(u['last_recovery_s'])}, "
       f"max {fmt_duration(u['max_recovery_s'])}")
    print(paint("counters", "bold"))
    for k, v in doc["counters"].items():
        kv(k, v)
    print_dead_hint(args.name, view["dead"], "yellow")
    return EXIT_OK


def cmd_seqs(args):
    snap, view = load_view(args.name)
    seqs = view["seqs"]
    if args.dead:
        seqs = [s for s in seqs if s["owner"] == "dead"]
    if args.pid is not None:
        seqs = [s for s in seqs if s["owner_pid"] == args.pid]
    key = {"sid": lambda s: s["sid"], "len": lambda s: -s["len"],
           "blocks": lambda s: -s["blocks"], "shared": lambda s: -s["shared_blocks"],
           "age": lambda s: s["created_ns"]}[args.sort]
    seqs = sorted(seqs, key=key)
    total = len(seqs)
    if args.limit:
        seqs = seqs[:args.limit]
    if args.json:
        emit_json(seqs)
        return EXIT_OK
    if not seqs:
        print(f"{args.name}: no sequences" + (" matching the filter" if
                                               (args.dead or args.pid is not None) else ""))
    else:
        rows = [[s["sid"], s["owner_pid"] if s["owner_pid"] is not None else "-",
                 owner_cell(s), s["len"], s["blocks"], s["shared_blocks"], s["priority"],
                 fmt_age(s["created_ns"]), fmt_age(s["last_access_ns"])]
                for s in seqs]
        print(table(["SID", "OWNER", "STATE", "LEN", "BLOCKS", "SHARED", "PRIO", "AGE", "IDLE"],
                    rows, align="rrlrrrrrr"))
        if total > len(seqs):
            print(paint(f"... {total - len(seqs)} more (use --limit 0 for all)", "dim"))
    d = view["dead"]
    print(f"{len(view['seqs'])} sequences, "
          f"{sum(s['len'] for s in view['seqs'])} tokens in {view['blocks']['used']} blocks; "
          f"{sum(1 for s in view['seqs'] if s['owner'] == 'detached')} detached")
    print_dead_hint(args.name, d, "bold red")
    return EXIT_OK


def _command(pid, alive):
    """The process's command line (its title: vLLM names its processes VLLM::EngineCore,
    VLLM::Worker...), '' when it is dead or unreadable."""
    if not alive:
        return ""
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return ""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")


def cmd_procs(args):
    snap, view = load_view(args.name)
    procs = view["procs"]
    for p in procs:
        p["command"] = _command(p["pid"], p["alive"])
    if args.json:
        emit_json(procs)
        return EXIT_OK
    if not procs:
        print(f"{args.name}: no process attached")
    else:
        rows = [[p["pid"], p["slot"], ("alive", "green") if p["alive"] else ("DEAD", "bold red"),
                 fmt_age(p["attach_time_ns"]), p["sequences"], p["tokens"], p["blocks"],
                 p["exclusive_blocks"], len(p["inflight"]),
                 f"{p['cached_blocks']}/{p['cached_seq_slots']}", p["command"][:48]]
                for p in procs]
        print(table(["PID", "SLOT", "STATE", "ATTACHED", "SEQS", "TOKENS", "BLOCKS", "EXCLUSIVE",
                     "INFLIGHT", "CACHE", "COMMAND"], rows, align="rrlrrrrrrrl"))
    print(f"{view['alive']} live, {plural(view['dead']['processes'], 'dead process')} "
          f"(max {view['cfg'].max_procs}); BLOCKS: blocks its sequences reference, "
          "EXCLUSIVE: referenced by no other process, CACHE: free blocks / sequence "
          "slots it keeps for itself (counted as free)")
    print_dead_hint(args.name, view["dead"], "bold red")
    return EXIT_OK


def cmd_blocks(args):
    snap, view = load_view(args.name)
    b = view["blocks"]
    doc = dict(name=args.name, **b)
    if args.png:
        draw_png(args.png, args.name, view)
        doc["png"] = os.path.abspath(args.png)
    if args.json:
        emit_json(doc)
        return EXIT_OK
    nb = b["num_blocks"]
    fr = b["fragmentation"]
    print(paint(f"pool of {args.name}: {nb} blocks x {b['block_size']} tokens", "bold"))
    rows = [["free", b["free"], fmt_pct(b["free"] / nb), "refcount 0, empty"],
            ["cached", b["cached"], fmt_pct(b["cached"] / nb),
             "refcount 0, holds a prefix-cache hit; reusable"],
            ["owned", b["owned"], fmt_pct(b["owned"] / nb), "refcount 1"],
            ["shared", b["shared"], fmt_pct(b["shared"] / nb), "refcount > 1 (copy-on-write)"],
            [("held by dead", "red" if b["held_by_dead"] else None), b["held_by_dead"],
             fmt_pct(b["held_by_dead"] / nb),
             "of the owned/shared: used only by dead processes (recover frees them)"]]
    print(table(["STATE", "BLOCKS", "%", "MEANING"], rows, align="lrrl", indent="  "))
    print(paint("refcount histogram", "bold"))
    hist = sorted(((int(k), v) for k, v in b["refcount_histogram"].items()))
    print(table(["REFCOUNT", "BLOCKS"], hist, align="rr", indent="  "))
    print(paint("fragmentation", "bold"))
    print(f"  partially filled last blocks  {fr['partial_last_blocks']}")
    print(f"  wasted token slots            {fr['wasted_token_slots']} "
          f"(of {b['used'] * b['block_size']} in used blocks)")
    print(f"  largest free run              {fr['largest_free_run']} blocks "
          f"({fr['free_runs']} free runs)")
    print(f"  tokens per used block         {fr['tokens_per_used_block']:.2f} "
          f"of {b['block_size']}")
    print(f"  stored / logical tokens       {fr['stored_tokens']} / {fr['logical_tokens']} "
          f"(sharing saves {fr['blocks_saved_by_sharing']} blocks)")
    if b["in_flight"]:
        print(f"  in flight (no table yet)      {b['in_flight']}")
    if args.map or (args.map is None and nb <= 1024):
        print(paint("map", "bold") + "  . free  c cached  o owned  S shared  X dead")
        chars = np.array(list(".coSX"))[view["state"]]
        width = 64
        for i in range(0, nb, width):
            line = "".join(chars[i:i + width])
            if color_on():
                line = "".join(paint(ch, {"c": "blue", "o": "green", "S": "yellow",
                                          "X": "bold red"}.get(ch, "dim")) for ch in line)
            print(f"  {i:>8} {line}")
    if args.png:
        print(f"picture written to {doc['png']}")
    print_dead_hint(args.name, view["dead"], "bold red")
    return EXIT_OK
