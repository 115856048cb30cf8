"""``shmkv events``: the KV event ring of a segment -- printed, followed, or published in
vLLM's wire format over ZMQ (``--zmq-pub``, ``--zmq-replay``).

Reads through ``shmkv._events.EventReader``: a read-only mapping, no attach, no lock, so
it works beside running workers and after they all died.  Imports nothing of the other
command modules; pyzmq and msgspec only for ``--zmq-pub``.
"""
from __future__ import annotations

import json
import signal
import sys
import time

from .common import EXIT_OK, EXIT_USAGE, CLIError
from .reader import _mapped, seg_path
from .render import paint


def _open(name):
    from .._events import EventReader
    from ..errors import SegmentError

    try:
        return EventReader(name)
    except (OSError, SegmentError) as e:
        err = _mapped(e, name, f" ({seg_path(name)} does not exist; `shmkv ls` lists "
                      "segments)", " (the segment belongs to another user)")
        raise (err or CLIError(f"{name}: cannot read the segment: {e}")) from None


def _event_doc(ev):
    return dict(seq=ev.seq, kind=ev.kind, block_hashes=ev.block_hashes,
                parent_block_hash=ev.parent_block_hash, token_ids=ev.token_ids,
                block_size=ev.block_size, time_ns=ev.time_ns, block_id=ev.block_id)


def _hx(h):
    return "-" if h is None else f"{h:016x}"


def _event_line(ev):
    t = time.strftime("%H:%M:%S", time.localtime(ev.time_ns / 1e9))
    t += f".{ev.time_ns % 1_000_000_000 // 1_000_000:03d}"
    kind = paint(f"{ev.kind:<8}", {"stored": "green", "removed": "yellow",
                                   "cleared": "bold red"}[ev.kind])
    if ev.kind == "cleared":
        return f"{ev.seq:>8}  {t}  {kind}"
    line = (f"{ev.seq:>8}  {t}  {kind}  block {ev.block_id:<6} hash {_hx(ev.block_hashes[0])}")
    if ev.kind == "stored":
        toks = ev.token_ids
        shown = " ".join(map(str, toks[:8])) + (" ..." if len(toks) > 8 else "")
        line += f"  parent {_hx(ev.parent_block_hash)}  tokens [{shown}]"
    return line


class _Stop:
    """Ctrl-C / SIGTERM / --duration: the follow loops poll this."""

    def __init__(self, duration):
        self.deadline = time.monotonic() + duration if duration else None
        self.flag = False

    def __bool__(self):
        return self.flag or (self.deadline is not None and time.monotonic() >= self.deadline)


def cmd_events(args):
    reader = _open(args.name)
    try:
        if reader.capacity == 0:
            raise CLIError(f"{args.name}: the segment keeps no events (event_capacity 0); "
                           "create it with CacheConfig(..., event_capacity=N)", EXIT_USAGE)
        if args.since < 0:
            raise CLIError(f"--since: expected a sequence number >= 0, got {args.since}")
        if args.zmq_replay and not args.zmq_pub:
            raise CLIError("--zmq-replay needs --zmq-pub")
        stop = _Stop(args.duration)
        old = signal.signal(signal.SIGTERM, lambda *_: setattr(stop, "flag", True))
        try:
            if args.zmq_pub:
                return _publish(args, reader, stop)
            return _print(args, reader, stop)
        finally:
            signal.signal(signal.SIGTERM, old)
    finally:
        reader.close()


def _print(args, reader, stop):
    since = args.since
    if not args.follow:
        batch = reader.read(since)
        if args.json:
            json.dump(dict(name=args.name, capacity=reader.capacity, head=reader.head,
                           events=[_event_doc(e) for e in batch.events],
                           next_seq=batch.next_seq, lost=batch.lost), sys.stdout, indent=2)
            sys.stdout.write("\n")
            return EXIT_OK
        for ev in batch.events:
            print(_event_line(ev))
        if batch.lost:
            print(paint(f"{batch.lost} events since seq {since} were overwritten before "
                        f"this read (the ring keeps {reader.capacity})", "yellow"),
                  file=sys.stderr)
        print(f"{len(batch.events)} events, next seq {batch.next_seq}", file=sys.stderr)
        return EXIT_OK
    # --follow: one line (or one JSON object) per event, until Ctrl-C / SIGTERM / --duration
    try:
        while not stop:
            batch = reader.read(since)
            if batch.lost:
                if args.json:
                    print(json.dumps(dict(lost=batch.lost, since=since)))
                else:
                    print(paint(f"-- {batch.lost} events lost (overwritten before they "
                                "were read)", "yellow"))
            for ev in batch.events:
                print(json.dumps(_event_doc(ev)) if args.json else _event_line(ev))
            sys.stdout.flush()
            since = batch.next_seq
            if since >= reader.head:
                time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    return EXIT_OK


def _publish(args, reader, stop):
    try:
        from ..events import ZmqEventPublisher
        pub = ZmqEventPublisher(args.zmq_pub, args.zmq_replay, topic=args.topic,
                                data_parallel_rank=args.dp_rank,
                                medium=None if args.medium == "none" else args.medium,
                                buffer_steps=args.buffer_steps, schema=args.vllm_schema)
    except ImportError as e:
        raise CLIError(f"--zmq-pub needs pyzmq and msgspec ({e.name} is missing): "
                       "pip install \"shmkv[events]\"") from None
    except Exception as e:          # zmq.ZMQError: a bad endpoint, a port in use
        raise CLIError(f"--zmq-pub {args.zmq_pub}: {e}") from None
    since, lost = args.since, 0
    print(f"shmkv events: publishing {args.name} on {args.zmq_pub}"
          + (f", replay on {args.zmq_replay}" if args.zmq_replay else "")
          + f", topic {args.topic!r}, vLLM {args.vllm_schema} KVEventBatch (msgpack)",
          file=sys.stderr, flush=True)
    try:
        while not stop:
            batch = reader.read(since, max_events=args.batch)
            if batch.lost:
                lost += batch.lost
                print(f"shmkv events: {batch.lost} events before seq {since + batch.lost} "
                      "were overwritten before they could be published", file=sys.stderr)
            if batch.events:
                pub.publish(batch.events)
            since = batch.next_seq
            if since >= reader.head:      # caught up: wait, serving replay requests
                pub.service_replay(int(args.interval * 1000))
            else:
                pub.service_replay(0)
    except KeyboardInterrupt:
        pass
    finally:
        pub.close()
    if args.json:
        print(json.dumps(dict(name=args.name, batches=pub.next_seq,
                              events=pub.events_sent, lost=lost, next_seq=since)))
    else:
        print(f"shmkv events: {pub.events_sent} events in {pub.next_seq} batches published, "
              f"{lost} lost, next seq {since}", file=sys.stderr)
    return EXIT_OK
