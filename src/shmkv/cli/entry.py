"""The top of the CLI: the argument parser (every command's flags and help text), the
``demo`` hand-off, and ``main``, the entry point of the ``shmkv`` console script and of
``python -m shmkv``.  (Named ``entry`` rather than ``main`` so that ``shmkv.cli.main`` stays
the function.)"""
from __future__ import annotations

import argparse
import os
import re
import sys

from .. import _core
from ..config import DTYPES, HASHES
from .common import EXIT_OK, EXIT_USAGE, PRESETS, CLIError, parse_size, shmkv_version
from .events import cmd_events
from .inspect import cmd_blocks, cmd_info, cmd_ls, cmd_procs, cmd_seqs
from .live import cmd_metrics, cmd_top, parse_listen
from .manage import cmd_check, cmd_create, cmd_recover, cmd_rm
from .reader import seg_name
from .render import set_color


def cmd_demo(argv):
    import importlib
    import importlib.util

    if importlib.util.find_spec("shmkv.demo") is None:
        raise CLIError("demo: not available in this installation of shmkv")
    demo = importlib.import_module("shmkv.demo")
    rc = demo.main(argv)
    return rc if isinstance(rc, int) else EXIT_OK


DESCRIPTION = """\
Inspect, repair and watch shmkv segments: paged KV caches that live in one POSIX
shared-memory segment (/dev/shm/NAME) shared by several inference processes."""


EPILOG = """\
typical session:
  shmkv ls                       find the segments on this host and their state
  shmkv info NAME                config, sizes, counters of one segment
  shmkv procs NAME               who is attached, alive or DEAD, what each holds
  shmkv seqs NAME                every sequence: owner, alive/DEAD/detached, length, blocks
  shmkv seqs NAME --dead         only the sequences a dead worker leaked
  shmkv recover NAME             reclaim what dead processes held (prints what it freed)
  shmkv check NAME               verify every invariant (check --repair: recover first)
  shmkv top NAME                 live view, refreshed every second (Ctrl-C quits)
  shmkv blocks NAME --png p.png  the block pool, drawn
  shmkv metrics NAME --listen 127.0.0.1:9464   Prometheus endpoint /metrics
  shmkv events NAME --follow     the KV events (stored/removed/cleared) as they happen
  shmkv events NAME --zmq-pub tcp://127.0.0.1:5557   ... in vLLM's wire format over ZMQ
  shmkv create NAME --preset llama3-8b --memory 8GiB
  shmkv rm NAME | shmkv rm --stale

A worker that died (SIGKILL, OOM) leaves its sequences and blocks allocated until the next
recovery: `procs` and `seqs` mark it DEAD and print the leak; `recover` reclaims it.

Inspection (ls, info, seqs, blocks, procs, top, metrics, events) maps the segment read-only, takes
no lock and changes nothing; it works while workers run and after they all died.
check only attaches to run the invariants and changes nothing; check --repair, recover,
create and rm change the segment or its name.

every command: --help; --json prints one JSON document on stdout (a list for ls, seqs,
procs; an object for info, blocks, check, recover, create); --color auto|always|never.
exit codes: 0 success; 1 a check found problems, or rm refused; 2 usage error, or a
segment that cannot be read (missing, not shmkv, corrupt, incompatible, no permission)."""


class _Fmt(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=30)


def build_parser():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON document on stdout instead of text")
    common.add_argument("--color", choices=("auto", "always", "never"),
                        default=argparse.SUPPRESS,
                        help="colour: auto (only on a terminal; NO_COLOR disables), always, "
                             "never")

    p = argparse.ArgumentParser(prog="shmkv", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=_Fmt)
    p.add_argument("--version", action="version",
                   version=f"shmkv {shmkv_version()} (layout version {_core.LAYOUT_VERSION})")
    p.add_argument("--json", action="store_true", default=False,
                   help="print one JSON document on stdout instead of text")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour: auto (only on a terminal), always, never")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    def cmd(name, help_, desc, func, epilog=None):
        sp = sub.add_parser(name, help=help_, description=desc, epilog=epilog,
                            parents=[common], formatter_class=_Fmt)
        sp.set_defaults(func=func)
        return sp

    def name_arg(sp):
        sp.add_argument("name", metavar="NAME", type=seg_name,
                        help="segment name as `shmkv ls` shows it (/NAME and "
                             "/dev/shm/NAME work too)")

    sp = cmd("ls", "list every shmkv segment on this host",
             "List every shmkv segment in /dev/shm: name, size, model shape, blocks, used %,\n"
             "sequences, live and dead attached processes, state.",
             cmd_ls, epilog="""\
states:
  ok            at least one live process is attached
  stale         no live process is attached (an idle segment made by `shmkv create`, or
                what dead workers left); `shmkv rm --stale` removes these
  corrupt       the header or sizes contradict themselves (e.g. a truncated file)
  incompatible  made by another layout version / ABI of shmkv
  not-ready     its creator is still initialising it, or died doing so
which files count: regular files in /dev/shm whose first 8 bytes are shmkv's magic
"__SHMKV1"; other shared-memory files (other programs, semaphores) are not shown unless
--all, where they appear as not-shmkv.  DEAD > 0 means a worker died holding blocks:
run `shmkv recover NAME`.""")
    sp.add_argument("pattern", nargs="*", metavar="PATTERN",
                    help="only names matching these shell patterns (e.g. 'llama*')")
    sp.add_argument("--all", action="store_true",
                    help="also list /dev/shm files that are not shmkv segments")

    sp = cmd("info", "header, config, sizes and every counter of a segment",
             "Show a segment's header (layout version, ABI, creator pid, creation time),\n"
             "its config, sizes, usage and all counters.", cmd_info)
    name_arg(sp)

    sp = cmd("seqs", "the sequence table: owner, alive/DEAD/detached, length, blocks",
             "List the live sequences: id, owner pid and whether the owner is alive (DEAD:\n"
             "its process died; the sequence leaks until `shmkv recover`), detached ones\n"
             "(owned by no process, kept on purpose), length in tokens, blocks, and blocks\n"
             "shared with other sequences (copy-on-write after fork).", cmd_seqs)
    name_arg(sp)
    sp.add_argument("--dead", action="store_true",
                    help="only sequences whose owner died (what recovery would reclaim)")
    sp.add_argument("--pid", type=int, help="only sequences owned by this pid")
    sp.add_argument("--sort", choices=("sid", "len", "blocks", "shared", "age"), default="sid",
                    help="order (default: sid; len/blocks/shared: largest first)")
    sp.add_argument("--limit", type=int, default=0, help="show at most N (default: all)")

    sp = cmd("blocks", "the block pool: free/cached/owned/shared, refcounts, fragmentation",
             "Map the block pool: free / cached / owned (refcount 1) / shared (refcount > 1)\n"
             "blocks, blocks held only by dead processes, the refcount histogram and\n"
             "fragmentation (partially filled last blocks, wasted token slots, largest free\n"
             "run, tokens per used block).", cmd_blocks)
    name_arg(sp)
    sp.add_argument("--png", metavar="FILE",
                    help="also draw the pool into a PNG: one cell per block, coloured by state")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--map", dest="map", action="store_true", default=None,
                   help="print an ASCII map of every block (default: pools <= 1024 blocks)")
    g.add_argument("--no-map", dest="map", action="store_false", help="no ASCII map")

    sp = cmd("procs", "attached processes: pid, alive or DEAD, what each holds",
             "List the processes in the segment's process table: pid, alive or DEAD (it died\n"
             "without detaching: its sequences leak until `shmkv recover`), when it attached,\n"
             "the sequences, tokens and blocks it holds, blocks only it references, and blocks\n"
             "it is filling right now (in flight).", cmd_procs)
    name_arg(sp)

    sp = cmd("check", "verify every invariant; exit 1 on problems (--repair: recover first)",
             "Verify every invariant of the segment (refcounts against block tables, free\n"
             "list, sequence slots, ...).  Exit 0 when consistent, 1 when a problem was\n"
             "found.  Blocks leaked by dead processes are a note, not a problem, unless\n"
             "--strict.  check attaches the segment for its duration; a process that\n"
             "detaches runs shmkv's recovery pass, so what dead processes held is reclaimed\n"
             "as check exits even without --repair (the output says how much).",
             cmd_check)
    name_arg(sp)
    sp.add_argument("--repair", action="store_true",
                    help="run recovery first (reclaims what dead processes held, rebuilds "
                         "refcounts), then check")
    sp.add_argument("--strict", action="store_true",
                    help="count sequences/blocks held by dead processes as problems")
    sp.add_argument("--timeout", type=float, default=10.0,
                    help="seconds to wait for a lock held by a live process (default 10)")
    sp.add_argument("--trust", action="append", metavar="USER", default=None,
                    help="attach even though USER (a user name or uid) owns the segment; "
                         "another user's segment is refused otherwise, root included")

    sp = cmd("recover", "reclaim what dead processes held; print what was reclaimed",
             "Run the full recovery pass: free the sequences and blocks of processes that\n"
             "died, release locks they held, trim unpublished tails, recount every refcount\n"
             "and rebuild the lists (O(pool), under the pool lock).  Detached sequences and\n"
             "live processes are never touched.  Safe while workers run.",
             cmd_recover)
    name_arg(sp)
    sp.add_argument("--timeout", type=float, default=10.0,
                    help="seconds to wait for a lock held by a live process (default 10)")
    sp.add_argument("--trust", action="append", metavar="USER", default=None,
                    help="attach even though USER (a user name or uid) owns the segment; "
                         "another user's segment is refused otherwise, root included")

    presets = "\n".join(f"  {k:<12} {v[1]}" for k, v in PRESETS.items())
    sp = cmd("create", "create a segment from flags or a preset",
             "Create a segment.  The shape comes from --preset and/or the flags (flags win);\n"
             "the pool size from --blocks N or --memory SIZE (num_blocks = SIZE //\n"
             "bytes_per_block; SIZE counts the K+V pool only, metadata comes on top).\n"
             "The segment outlives this command; nobody is attached until workers attach.",
             cmd_create, epilog="presets:\n" + presets + "\n\nexamples:\n"
             "  shmkv create llama-cache --preset llama3-8b --memory 8GiB\n"
             "  shmkv create small --layers 4 --kv-heads 2 --head-dim 64 --blocks 1024")
    name_arg(sp)
    sp.add_argument("--preset", choices=sorted(PRESETS), help="a model shape (see below)")
    sp.add_argument("--memory", type=parse_size, metavar="SIZE",
                    help="K+V pool size, e.g. 8GiB, 512MiB, 2GB; sets num_blocks")
    sp.add_argument("--blocks", dest="num_blocks", type=int, metavar="N",
                    help="num_blocks: physical blocks in the pool")
    sp.add_argument("--layers", dest="num_layers", type=int, metavar="N", help="num_layers")
    sp.add_argument("--kv-heads", dest="num_kv_heads", type=int, metavar="N",
                    help="num_kv_heads")
    sp.add_argument("--head-dim", dest="head_dim", type=int, metavar="N", help="head_dim")
    sp.add_argument("--block-size", dest="block_size", type=int, metavar="N",
                    help="tokens per block (default 16)")
    sp.add_argument("--dtype", choices=sorted(DTYPES), help="element type (default float16)")
    sp.add_argument("--max-seqs", dest="max_seqs", type=int, metavar="N",
                    help="sequence slots (default 1024)")
    sp.add_argument("--max-seq-len", dest="max_seq_len", type=int, metavar="N",
                    help="longest sequence in tokens (default: the whole pool)")
    sp.add_argument("--max-procs", dest="max_procs", type=int, metavar="N",
                    help="processes attached at once (default 64)")
    sp.add_argument("--hash", choices=sorted(HASHES), help="prefix-cache block hash "
                    "(default fast)")
    sp.add_argument("--events", dest="event_capacity", type=int, metavar="N",
                    help="KV events kept in the segment's ring, for `shmkv events` "
                         "(default 0: off)")
    sp.add_argument("--mode", type=lambda s: int(s, 8), default=0o600,
                    help="permission bits in octal (default 600; 660 lets the group attach)")
    sp.add_argument("--group", metavar="GROUP",
                    help="give the segment to GROUP (a name or gid) before setting --mode")
    sp.add_argument("--prefault", action="store_true",
                    help="touch every page now, so /dev/shm must hold it all at once")

    sp = cmd("rm", "remove a segment's name (refuses while live processes are attached)",
             "Unlink segments from /dev/shm.  Processes that still map it keep working; the\n"
             "memory is freed when the last one exits.  Refuses (exit 1) while a live process\n"
             "is attached, unless --force.  --stale removes every segment with no live\n"
             "process (state stale, or corrupt/incompatible with no process holding it);\n"
             "PATTERNs narrow it down.", cmd_rm)
    sp.add_argument("names", nargs="*", metavar="NAME",
                    help="segments to remove (with --stale: shell patterns)")
    sp.add_argument("--force", action="store_true",
                    help="remove even with live processes attached, or a non-shmkv file")
    sp.add_argument("--stale", action="store_true",
                    help="remove every segment that no live process is attached to")
    sp.add_argument("--dry-run", action="store_true", help="with --stale: only list them")
    sp.set_defaults(pattern=None)

    sp = cmd("top", "live view: utilization, rates, top sequences, processes",
             "Refresh a live view every --interval seconds: pool utilization, allocations /\n"
             "frees / appended tokens / forks / COW copies / recoveries per second (from\n"
             "counter deltas), the largest sequences and the processes.  Ctrl-C quits.\n"
             "On a terminal it redraws in place; otherwise it prints one text frame per\n"
             "refresh (--json: a list of frames, needs --iterations).", cmd_top)
    name_arg(sp)
    sp.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    sp.add_argument("--iterations", "-n", type=int, default=0,
                    help="stop after N refreshes (default: until Ctrl-C)")
    sp.add_argument("--top", type=int, default=10, help="sequences to show (default 10)")
    sp.add_argument("--plain", action="store_true",
                    help="print frames one after the other even on a terminal")

    sp = cmd("metrics", "Prometheus metrics of segments, over HTTP or on stdout",
             "Expose the counters and gauges in the Prometheus text format 0.0.4 (labels:\n"
             "segment=NAME): counters end in _total (shmkv_allocations_total,\n"
             "shmkv_forks_total, ...), gauges are shmkv_blocks_used, shmkv_blocks_free,\n"
             "shmkv_sequences, shmkv_processes, ...  Without --listen, print once on stdout\n"
             "(for node_exporter's textfile collector).  With --listen HOST:PORT serve\n"
             "http://HOST:PORT/metrics until Ctrl-C / SIGTERM; PORT 0 picks a free port; the\n"
             "bound address is printed on stderr.  Binds only to the HOST you give.",
             cmd_metrics)
    sp.add_argument("names", nargs="+", metavar="NAME", type=seg_name,
                    help="one or more segments")
    sp.add_argument("--listen", type=parse_listen, metavar="HOST:PORT",
                    help="serve over HTTP here (e.g. 127.0.0.1:9464)")
    sp.add_argument("--once", action="store_true", help="exit after the first /metrics scrape")
    sp.add_argument("--duration", type=float, default=0,
                    help="exit after this many seconds (default: run until stopped)")
    sp.add_argument("--verbose", action="store_true", help="log every request on stderr")

    sp = cmd("events", "the KV events of a segment: print, follow, or publish over ZMQ",
             "Print the segment's KV events (stored: a block became findable in the prefix\n"
             "index; removed: a cached block was reused; cleared: reset_prefix_cache), from\n"
             "seq --since on.  The ring keeps the last config.event_capacity events; events\n"
             "overwritten before they were read are counted as lost.  --follow keeps\n"
             "printing new ones (--json: one JSON object per line).  --zmq-pub ENDPOINT\n"
             "publishes them in vLLM's wire format (multipart [topic, 8-byte big-endian\n"
             "seq, msgpack KVEventBatch]; vLLM 0.32's schema, events as maps tagged \"type\"\n"
             "with lora_name; --vllm-schema 0.11 sends v0.11.0's arrays) so a vLLM KV-event\n"
             "consumer (llm-d, Dynamo) reads shmkv unchanged; --zmq-replay ENDPOINT serves\n"
             "vLLM's replay requests.  Both sockets bind.  Needs the `events` extra (pyzmq,\n"
             "msgspec).",
             cmd_events, epilog="""\
examples:
  shmkv events llama-cache                       the events the ring still holds
  shmkv events llama-cache --since 1200 --json   from seq 1200, one JSON document
  shmkv events llama-cache --follow              tail -f
  shmkv events llama-cache --zmq-pub tcp://127.0.0.1:5557 --zmq-replay tcp://127.0.0.1:5558

block hashes are vLLM-style ints: the first 64-bit lane of shmkv's 128-bit block hash,
unsigned; parent_block_hash is the previous block's (none for a first block).""")
    name_arg(sp)
    sp.add_argument("--since", type=int, default=0, metavar="SEQ",
                    help="first event sequence number (default 0: all the ring holds)")
    sp.add_argument("--follow", "-f", action="store_true",
                    help="keep printing new events until Ctrl-C / SIGTERM / --duration")
    sp.add_argument("--interval", type=float, default=0.1,
                    help="seconds between polls of the ring when idle (default 0.1)")
    sp.add_argument("--duration", type=float, default=0,
                    help="with --follow / --zmq-pub: stop after this many seconds")
    sp.add_argument("--zmq-pub", metavar="ENDPOINT",
                    help="publish on a ZMQ PUB socket bound here (e.g. tcp://127.0.0.1:5557)")
    sp.add_argument("--zmq-replay", metavar="ENDPOINT",
                    help="answer replay requests on a ZMQ ROUTER socket bound here")
    sp.add_argument("--topic", default="", help="the ZMQ topic frame (default empty, as vLLM)")
    sp.add_argument("--medium", default="CPU",
                    help="the events' medium field (default CPU: shmkv pools are host "
                         "memory; 'none' sends None)")
    sp.add_argument("--vllm-schema", choices=("0.32", "0.11"), default="0.32",
                    help="the event schema: vLLM 0.32's maps (default) or v0.11.0's arrays")
    sp.add_argument("--dp-rank", type=int, default=0,
                    help="data_parallel_rank of the batches (default 0)")
    sp.add_argument("--batch", type=int, default=1024,
                    help="at most this many events per published batch (default 1024)")
    sp.add_argument("--buffer-steps", type=int, default=10_000,
                    help="batches kept for replay (default 10000, as vLLM)")

    sub.add_parser("demo", help="run the shmkv demo (shmkv demo --help for its options)",
                   add_help=False)
    return p


def _command_index(argv):
    """Index of the command word in argv (after the global options), or None."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--color":
            i += 2
        elif a.startswith("-"):
            i += 1
        else:
            return i
    return None


def _value_options(parser):
    """Every option string (of the parser and its subcommands) that takes a value."""
    out = set()
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out |= _value_options(sub)
        elif a.option_strings and a.nargs is None and a.const is None:
            out.update(a.option_strings)
    return out


_NEGATIVE = re.compile(r"-[0-9.]")


def _join_negative_values(parser, argv):
    """``--memory -1GiB`` -> ``--memory=-1GiB``: argparse takes a value that starts with
    '-' (but is not a plain negative number) for an option and answers "expected one
    argument"; joined, the value reaches the option's own check, whose message names what
    was expected and what came."""
    opts = _value_options(parser)
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out += argv[i:]
            break
        if a in opts and i + 1 < len(argv) and _NEGATIVE.match(argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def main(argv=None):
    """Entry point of the `shmkv` console script and `python -m shmkv`; returns the exit
    code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        i = _command_index(argv)
        if i is not None and argv[i] == "demo":     # everything after it is the demo's
            return cmd_demo(argv[i + 1:])
        parser = build_parser()
        argv = _join_negative_values(parser, argv)
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:         # --help, --version, usage errors
            return e.code if isinstance(e.code, int) else EXIT_USAGE
        if not getattr(args, "command", None):
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        set_color(args.color == "always" or
                  (args.color == "auto" and sys.stdout.isatty()
                   and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"))
        return args.func(args)
    except CLIError as e:
        sys.stderr.write(f"shmkv: {e}\n")
        return e.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `shmkv ls | head`: the reader went away; exit quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_OK
