"""KV events: what the host-wide prefix index did, as vLLM reports it to KV-aware routers.

``KVCache.events(since)`` returns an :class:`EventBatch` of :class:`Event`; this module
holds those two types (pure Python, imported by ``import shmkv``) and the bridge to
vLLM's wire format: :class:`ZmqEventPublisher` (ZMQ PUB + replay ROUTER, the socket
pattern of vLLM's ``ZmqEventPublisher``) and :func:`to_vllm`, which build on
:mod:`shmkv.vllm_events` (the msgspec schemas of vLLM 0.32, the default, and v0.11.0).
pyzmq and msgspec (the
``events`` extra) are imported only when a publisher is made or an event converted.

Block hashes are sent as vLLM sends them (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, its
default): one unsigned 64-bit int per block.  shmkv's block hash is 128 bits (two 64-bit
lanes, ``fast`` or truncated ``sha256``); the int is its first lane, ``hash[0]``, the
key the index probes by.  ``parent_block_hash`` is the previous block's int, ``None``
for the first block of a sequence.
"""
from __future__ import annotations

import sys
import time
from collections import deque
from typing import (
    TYPE_CHECKING,
    Any,
    Deque,
    Dict,
    Iterable,
    List,
    NamedTuple,
    Optional,
    Tuple,
    Union,
)

if TYPE_CHECKING:
    from .vllm_events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["Event", "EventBatch", "VLLM_VERSION", "to_vllm", "ZmqEventPublisher"]

#: the vLLM release whose event schema and publisher protocol shmkv follows by default
#: (``schema="0.11"`` gives v0.11.0's)
VLLM_VERSION = "0.32"


class Event(NamedTuple):
    """One KV event of a segment's ring."""

    seq: int
    """Its sequence number: 0 for the segment's first event, +1 per event."""
    kind: str
    """``"stored"`` (a block became findable), ``"removed"`` (a cached block's hash was
    dropped to reuse the block) or ``"cleared"`` (``reset_prefix_cache``)."""
    block_hashes: List[int]
    """The block's hash as vLLM's int (one block per event; [] for "cleared")."""
    parent_block_hash: Optional[int]
    """The previous block's hash ("stored" of a block after the first), else None."""
    token_ids: List[int]
    """The block's ``block_size`` token ids ("stored" only, else [])."""
    block_size: int
    time_ns: int
    """CLOCK_REALTIME when it was written."""
    block_id: int
    """The physical block (-1 for "cleared")."""


class EventBatch(NamedTuple):
    """What ``KVCache.events(since)`` returns."""

    events: List[Event]
    """Events with ``seq >= since`` still in the ring, in order."""
    next_seq: int
    """The ``since`` of the next call."""
    lost: int
    """Events with ``seq >= since`` overwritten before they could be read."""


def to_vllm(events: Iterable[Event], medium: Optional[str] = "CPU", schema: str = "0.32"
            ) -> List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]:
    """shmkv events as vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.

    Consecutive "stored" events that chain (each one's parent is the previous one's
    hash) become one ``BlockStored`` with their hashes and token ids in order, and
    consecutive "removed" events one ``BlockRemoved``, as vLLM groups a request's
    blocks.  ``medium``: where the blocks live (vLLM's ``"GPU"`` / ``"CPU"``); a shmkv
    pool is host memory.  ``schema``: ``"0.32"`` (maps, with ``lora_name``) or
    ``"0.11"`` (v0.11.0's arrays); see :mod:`shmkv.vllm_events`.
    """
    from .vllm_events import classes

    stored_t, removed_t, cleared_t, _ = classes(schema)
    extra: Dict[str, Any] = {"lora_name": None} if schema != "0.11" else {}
    out: List[Any] = []
    for ev in events:
        last = out[-1] if out else None
        if ev.kind == "stored":
            if (isinstance(last, stored_t) and last.block_size == ev.block_size
                    and ev.parent_block_hash == last.block_hashes[-1]):
                last.block_hashes.extend(ev.block_hashes)
                last.token_ids.extend(ev.token_ids)
            else:
                out.append(stored_t(
                    block_hashes=list(ev.block_hashes), parent_block_hash=ev.parent_block_hash,
                    token_ids=list(ev.token_ids), block_size=ev.block_size, lora_id=None,
                    medium=medium, **extra))
        elif ev.kind == "removed":
            if isinstance(last, removed_t):
                last.block_hashes.extend(ev.block_hashes)
            else:
                out.append(removed_t(block_hashes=list(ev.block_hashes), medium=medium))
        elif ev.kind == "cleared":
            out.append(cleared_t())
    return out


class ZmqEventPublisher:
    """Publishes KV event batches the way vLLM's ``ZmqEventPublisher`` does (0.32 by
    default, v0.11.0 with ``schema="0.11"``).

    * PUB socket bound to ``endpoint``: each batch is the multipart message
      ``[topic, seq (8 bytes, big-endian), msgpack(KVEventBatch)]``; ``seq`` counts
      batches from 0 (an event consumer detects a gap by it).
    * ROUTER socket bound to ``replay_endpoint`` (optional): a request whose last frame
      is a start seq (8 bytes, big-endian) gets every buffered batch with
      ``seq >= start`` as ``[topic, seq, payload]`` and then the end marker
      ``[b"", (-1).to_bytes(8, "big", signed=True), b""]`` (0.32; v0.11.0 sends no topic
      frame: ``[seq, payload]``, ``[-1, b""]``).  The last ``buffer_steps`` batches are
      kept.

    Single-threaded: call :meth:`publish` and :meth:`service_replay` from one thread
    (the CLI's loop).  :meth:`close` closes both sockets.
    """

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, *,
                 topic: str = "", buffer_steps: int = 10_000, hwm: int = 100_000,
                 data_parallel_rank: int = 0, medium: Optional[str] = "CPU",
                 schema: str = "0.32") -> None:
        from ._compat import check

        check("pyzmq", what="shmkv.events.ZmqEventPublisher", module="zmq")
        check("msgspec", what="shmkv.events.ZmqEventPublisher")
        import msgspec
        import zmq

        from .vllm_events import classes

        self._batch_t = classes(schema)[3]      # ValueError for an unknown schema
        self.schema = schema

        self._zmq = zmq
        self._ctx: Any = zmq.Context.instance()
        self._pub: Any = None
        self._replay: Any = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except Exception:
            self.close()
            raise
        self._encoder = msgspec.msgpack.Encoder()
        self._topic = topic.encode("utf-8")
        self._buffer: Deque[Tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._dp_rank = data_parallel_rank
        self.medium = medium
        self.next_seq = 0            #: the seq of the next batch
        self.events_sent = 0

    def publish(self, events: List[Event]) -> int:
        """Send ``events`` as one ``KVEventBatch`` (nothing if empty); -> its seq or -1."""
        wire = to_vllm(events, self.medium, self.schema)
        if not wire:
            return -1
        batch = self._batch_t(ts=time.time(), events=wire, data_parallel_rank=self._dp_rank)
        payload = self._encoder.encode(batch)
        seq = self.next_seq
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.next_seq += 1
        self.events_sent += len(events)
        return seq

    def service_replay(self, timeout_ms: int = 0) -> int:
        """Answer the replay requests waiting (after up to ``timeout_ms`` for the first);
        -> the number answered."""
        if self._replay is None:
            if timeout_ms > 0:
                time.sleep(timeout_ms / 1000)
            return 0
        n = 0
        while self._replay.poll(timeout_ms if n == 0 else 0):
            frames = self._replay.recv_multipart()
            if len(frames) < 2 or len(frames[-1]) != 8:
                print(f"shmkv events: invalid replay request ({len(frames)} frames)",
                      file=sys.stderr)
                continue
            ident, start = frames[0], int.from_bytes(frames[-1], "big")
            legacy = self.schema == "0.11"
            for seq, buf in self._buffer:
                if seq >= start:
                    head = (ident, b"") if legacy else (ident, b"", self._topic)
                    self._replay.send_multipart((*head, seq.to_bytes(8, "big"), buf))
            end = (ident, b"") if legacy else (ident, b"", b"")
            self._replay.send_multipart((*end, self.END_SEQ, b""))
            n += 1
        return n

    def close(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._pub = self._replay = None
