"""KV events (the API contract, "KV events and the remote tier"): the ring in the segment,
cache.events(since), its crash safety, and `shmkv events` publishing vLLM's wire format
to a ZMQ subscriber that decodes vLLM's own schema."""
import hashlib
import os
import socket
import subprocess
import sys
import time
from typing import Any, List, Optional, Union

import numpy as np
import pytest
from support import SMALL, unique_name
from support.procout import readline_with
from workers import event_workers as W

import shmkv

BS = SMALL["block_size"]


def _run(spawn, target, *args, code=0):
    p = spawn(target, *args)
    p.join(timeout=30)
    assert p.exitcode == code, f"{target.__name__}: exit code {p.exitcode}, expected {code}"


def _blocks(prompt):
    """The token ids of each full block of a prompt."""
    n = len(prompt) // BS
    return [list(map(int, prompt[i * BS:(i + 1) * BS])) for i in range(n)]


def _assert_dense(batch, since=0):
    seqs = [e.seq for e in batch.events]
    assert seqs == list(range(since + batch.lost, since + batch.lost + len(seqs)))
    assert batch.next_seq == since + batch.lost + len(seqs)


# ---- configuration ------------------------------------------------------------------
def test_config_default_off_and_round_trip(make_cache):
    cache = make_cache()
    assert cache.config.event_capacity == 0
    assert cache.events() == ([], 0, 0)
    assert cache.events(since=5) == ([], 0, 0)
    on = make_cache(event_capacity=100)
    with shmkv.KVCache.attach(on.name) as other:
        assert other.config == on.config and other.config.event_capacity == 100
    assert on.config.segment_size() > cache.config.segment_size()


def test_config_validation():
    with pytest.raises(ValueError, match="event_capacity"):
        shmkv.CacheConfig(**SMALL, event_capacity=-1)
    with pytest.raises(ValueError, match="event_capacity"):
        shmkv.CacheConfig(**SMALL, event_capacity=(1 << 24) + 1)
    with pytest.raises(ValueError, match="event_capacity"):
        shmkv.CacheConfig(**{**SMALL, "block_size": 2048}, event_capacity=8)
    shmkv.CacheConfig(**{**SMALL, "block_size": 2048})        # no events: any block size


def test_events_argument_errors(make_cache):
    cache = make_cache(event_capacity=8)
    with pytest.raises(ValueError, match="since"):
        cache.events(-1)
    with pytest.raises(TypeError, match="since"):
        cache.events("0")
    with pytest.raises(ValueError, match="max_events"):
        cache.events(0, max_events=0)


# ---- order and counts across processes -----------------------------------------------
def test_order_and_counts_two_processes(make_cache, spawn):
    cache = make_cache(event_capacity=256, num_blocks=16)
    a = np.arange(3 * BS + 2, dtype=np.int32)                  # 3 full blocks
    b = np.arange(1000, 1000 + 2 * BS, dtype=np.int32)          # 2 full blocks
    _run(spawn, W.publish, cache.name, a)
    _run(spawn, W.publish, cache.name, b)
    _run(spawn, W.publish, cache.name, a)                       # already there: no event
    batch = cache.events()
    _assert_dense(batch)
    assert batch.lost == 0
    assert [e.kind for e in batch.events] == ["stored"] * 5
    assert [e.token_ids for e in batch.events] == _blocks(a) + _blocks(b)
    assert all(e.block_size == BS and len(e.block_hashes) == 1 for e in batch.events)
    # the parent chain: None for a first block, the previous block's hash after it
    ev = batch.events
    assert ev[0].parent_block_hash is None and ev[3].parent_block_hash is None
    assert ev[1].parent_block_hash == ev[0].block_hashes[0]
    assert ev[2].parent_block_hash == ev[1].block_hashes[0]
    assert ev[4].parent_block_hash == ev[3].block_hashes[0]
    assert all(0 <= e.block_hashes[0] < 1 << 64 for e in ev)
    assert len({e.block_hashes[0] for e in ev}) == 5
    assert cache.stats()["cached_blocks"] == 5
    # 16 blocks, 5 cached: taking all 16 reuses the 5 cached ones, least recent first
    _run(spawn, W.fill_pool, cache.name, 16 * BS)
    batch = cache.events(since=5)
    _assert_dense(batch, 5)
    assert [e.kind for e in batch.events] == ["removed"] * 5
    assert {e.block_hashes[0] for e in batch.events} == {e.block_hashes[0] for e in ev}
    assert all(e.token_ids == [] and e.parent_block_hash is None for e in batch.events)
    assert cache.stats()["cached_blocks_evicted"] == 5
    assert cache.check() == []


def test_cleared(make_cache, spawn):
    cache = make_cache(event_capacity=64)
    p = np.arange(2 * BS, dtype=np.int32)
    _run(spawn, W.publish, cache.name, p)
    _run(spawn, W.publish, cache.name, p + 50, False)   # a sequence that keeps its blocks
    assert cache.stats()["index_entries"] == 4
    _run(spawn, W.reset, cache.name)
    batch = cache.events()
    assert [e.kind for e in batch.events] == ["stored"] * 4 + ["cleared"]
    cl = batch.events[-1]
    assert (cl.block_hashes, cl.parent_block_hash, cl.token_ids) == ([], None, [])
    st = cache.stats()
    assert st["index_entries"] == 0 and st["cached_blocks"] == 0
    assert cache.match_prefix(np.append(p, 0)) == 0
    assert cache.check() == []
    # published again after the clear: "stored" again
    _run(spawn, W.publish, cache.name, p)
    assert [e.kind for e in cache.events(5).events] == ["stored"] * 2


def test_sha256_hash_ints(make_cache):
    cache = make_cache(event_capacity=16, hash="sha256")
    p = np.arange(2 * BS, dtype=np.int32)
    sid = cache.create_sequence()
    kv = np.zeros((2, len(p), 2, 8), np.float16)
    cache.append(sid, kv, kv, tokens=p)
    ev = cache.events().events
    # the int is the first 64-bit lane (little-endian) of the 128-bit truncated sha256
    # of seed | parent hash (none: 16 zero bytes) | salt digest (none: zeros) | ids
    seed = cache._debug_info()["hash_seed"]
    d0 = hashlib.sha256(seed.to_bytes(8, "little") + bytes(32) + p[:BS].tobytes()).digest()
    assert ev[0].block_hashes == [int.from_bytes(d0[:8], "little")]
    assert ev[1].parent_block_hash == ev[0].block_hashes[0]


# ---- the ring: wrap-around, lost counts ------------------------------------------------
def test_lost_after_wrap_around(make_cache):
    cache = make_cache(event_capacity=4)
    kv = np.zeros((2, BS, 2, 8), np.float16)
    for i in range(10):                                  # 10 single-block prompts
        sid = cache.create_sequence()
        cache.append(sid, kv, kv, tokens=np.arange(i * BS, (i + 1) * BS))
    b = cache.events(0)
    assert b.lost == 6 and b.next_seq == 10
    assert [e.seq for e in b.events] == [6, 7, 8, 9]
    assert [e.token_ids[0] for e in b.events] == [6 * BS, 7 * BS, 8 * BS, 9 * BS]
    assert cache.events(5) == (b.events, 10, 1)
    assert cache.events(8).events == b.events[2:] and cache.events(8).lost == 0
    assert cache.events(10) == ([], 10, 0)
    assert cache.events(99) == ([], 10, 0)              # a cursor past head comes back
    c = cache.events(0, max_events=3)
    assert ([e.seq for e in c.events], c.next_seq, c.lost) == ([6, 7, 8], 9, 6)
    assert cache.check() == []


def test_a_lapped_read_stays_contiguous(make_cache):
    """An event that fails its stamp check mid-read (here: its stamp cleared, as a
    writer lapping the reader does) counts as lost with every event before it: what is
    returned stays contiguous."""
    import mmap

    cache = make_cache(event_capacity=8)
    kv = np.zeros((2, BS, 2, 8), np.float16)
    for i in range(6):
        sid = cache.create_sequence()
        cache.append(sid, kv, kv, tokens=np.arange(i * BS, (i + 1) * BS))
    lay = cache._debug_info()["layout"]
    rec = lay["event_record_bytes"]
    fd = os.open(f"/dev/shm/{cache.name}", os.O_RDWR)
    try:
        m = mmap.mmap(fd, lay["segment_size"])
        o = lay["off_events"] + 64 + 3 * rec                # seq 3's slot (of 9)
        m[o:o + 8] = bytes(8)
        b = cache.events(1)
        assert ([e.seq for e in b.events], b.next_seq, b.lost) == ([4, 5], 6, 3)
        m[o:o + 8] = (4).to_bytes(8, "little")             # its stamp back: seq 3 + 1
        assert [e.seq for e in cache.events(1).events] == [1, 2, 3, 4, 5]
        m.close()
    finally:
        os.close(fd)


# ---- crash safety ----------------------------------------------------------------------
@pytest.mark.parametrize("countdown", [1, 3])
def test_sigkill_mid_event_leaves_no_torn_event(make_cache, spawn, countdown):
    cache = make_cache(event_capacity=2)      # small: the dying write overwrites a slot
    first = np.arange(3 * BS, dtype=np.int32)
    _run(spawn, W.publish, cache.name, first)               # seqs 0..2; window [1, 3)
    before = cache.events()
    assert [e.seq for e in before.events] == [1, 2]
    p = np.arange(500, 500 + 4 * BS, dtype=np.int32)
    _run(spawn, W.die_mid_event, cache.name, p, countdown, code=86)
    # the dead writer's half record is invisible, and no event it could have destroyed
    # was visible: capacity + 1 slots
    mid = cache.events()
    _assert_dense(mid)
    assert mid.next_seq == 3 + countdown - 1
    assert [e.seq for e in mid.events] == list(range(mid.next_seq - 2, mid.next_seq))
    for e in mid.events:
        assert e.kind == "stored" and len(e.token_ids) == BS
    assert cache.check() == []                  # the ring's invariant included
    # the next writer takes the seq the dead one never published
    _run(spawn, W.publish, cache.name, np.arange(900, 900 + BS, dtype=np.int32))
    after = cache.events(mid.next_seq)
    assert after.lost == 0 and [e.seq for e in after.events] == [mid.next_seq]
    assert after.events[0].token_ids == list(range(900, 900 + BS))
    assert cache.check() == []


def test_sigkill_mid_reset(make_cache, spawn):
    cache = make_cache(event_capacity=32)
    _run(spawn, W.publish, cache.name, np.arange(3 * BS, dtype=np.int32))
    _run(spawn, W.die_mid_reset, cache.name, code=86)
    assert cache.check() == []                   # recovery rebuilt index and lists
    assert [e.kind for e in cache.events().events] == ["stored"] * 3 + ["cleared"]


def test_corrupt_ring_never_crashes(make_cache):
    """A hostile ring (random bytes over every record and the head) gives lost events
    or odd values, never a crash, in events() and the read-only reader."""
    from shmkv._events import EventReader

    cache = make_cache(event_capacity=16)
    lay = cache._debug_info()["layout"]
    import mmap

    fd = os.open(f"/dev/shm/{cache.name}", os.O_RDWR)
    try:
        m = mmap.mmap(fd, lay["segment_size"])
        rng = np.random.default_rng(0)
        off, n = lay["off_events"], 64 + 17 * lay["event_record_bytes"]
        for trial in range(20):
            junk = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            if trial % 2:                         # plausible stamps, hostile fields
                junk = bytearray(junk)
                junk[0:8] = (trial * 3).to_bytes(8, "little")
                for s in range(17):
                    o = 64 + s * lay["event_record_bytes"]
                    junk[o:o + 8] = (s + 1).to_bytes(8, "little")
                junk = bytes(junk)
            m[off:off + n] = junk
            b = cache.events(0)
            assert len(b.events) + b.lost <= max(0, b.next_seq)
            with EventReader(cache.name) as r:
                r.read(0)
        m[off:off + n] = bytes(n)
        m.close()
    finally:
        os.close(fd)
    assert cache.events() == ([], 0, 0)


# ---- the CLI and the vLLM wire format ----------------------------------------------------
SHMKV = [sys.executable, "-m", "shmkv"]


def _cli(*args, timeout=30):
    return subprocess.run([*SHMKV, *args], capture_output=True, text=True, timeout=timeout,
                          cwd="/")


def test_cli_events_text_json(make_cache):
    import json

    cache = make_cache(event_capacity=8)
    kv = np.zeros((2, 2 * BS, 2, 8), np.float16)
    sid = cache.create_sequence()
    cache.append(sid, kv, kv, tokens=np.arange(2 * BS))
    r = _cli("events", cache.name)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("stored") == 2 and "next seq 2" in r.stderr
    r = _cli("events", cache.name, "--json", "--since", "1")
    doc = json.loads(r.stdout)
    assert [e["seq"] for e in doc["events"]] == [1] and doc["next_seq"] == 2
    assert doc["events"][0]["token_ids"] == list(range(BS, 2 * BS))
    r = _cli("events", cache.name, "--follow", "--json", "--duration", "0.5")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2
    off = make_cache()
    r = _cli("events", off.name)
    assert r.returncode == 2 and "event_capacity" in r.stderr
    assert _cli("events", unique_name("missing")).returncode == 2


def test_import_shmkv_imports_no_zmq_msgspec(make_cache):
    cache = make_cache(event_capacity=8)
    code = ("import sys, shmkv; c = shmkv.KVCache.attach(sys.argv[1]); c.events(); "
            "c.close(); assert 'zmq' not in sys.modules and 'msgspec' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code, cache.name], capture_output=True,
                       text=True, cwd="/", timeout=30)
    assert r.returncode == 0, r.stderr


msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")


# vLLM v0.11.0 (--vllm-schema 0.11; the default, 0.32, is tested against vLLM's own
# classes in tests/vllm/test_vllm_events.py), vllm/distributed/kv_events.py: the
# consumer's side, declared here as vLLM
# declares it (not imported from shmkv) so that this test checks shmkv against vLLM.
ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: List[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: List[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: List[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: List[ExternalBlockHash]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: List[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_zmq_subscriber_decodes_vllm_schema(make_cache):
    cache = make_cache(event_capacity=64, num_blocks=8)
    kv = np.zeros((2, 3 * BS, 2, 8), np.float16)
    early = np.arange(3 * BS, dtype=np.int32)
    sid = cache.create_sequence()
    cache.append(sid, kv, kv, tokens=early)              # published before anyone listens
    cache.free(sid)
    pub_ep, rep_ep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    proc = subprocess.Popen([*SHMKV, "events", cache.name, "--zmq-pub", pub_ep,
                             "--vllm-schema", "0.11", "--zmq-replay", rep_ep,
                             "--topic", "kv", "--duration", "20",
                             "--interval", "0.02"], stderr=subprocess.PIPE, text=True,
                            cwd="/")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    try:
        line = readline_with(proc.stderr, "publishing")
        assert "vLLM 0.11" in line, line
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub_ep)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(rep_ep)
        time.sleep(0.5)                                   # the subscription reaches PUB
        # live: a new prompt (stored) and then a pool-filling sequence (removed)
        late = np.arange(100, 100 + 3 * BS, dtype=np.int32)
        sid = cache.create_sequence()
        cache.append(sid, kv, kv, tokens=late)
        cache.free(sid)
        big = np.zeros((2, 8 * BS, 2, 8), np.float16)
        sid = cache.create_sequence()
        cache.append(sid, big, big)                          # reuses all 6 cached blocks
        cache.reset_prefix_cache()
        got, seqs = [], []
        deadline = time.monotonic() + 15
        while not (got and isinstance(got[-1], AllBlocksCleared)):
            assert time.monotonic() < deadline, f"timed out, got {got}"
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv" and len(seq) == 8
                seqs.append(int.from_bytes(seq, "big"))
                batch = dec.decode(payload)
                assert batch.data_parallel_rank == 0 and batch.ts > 0
                if seqs[-1] > 0:              # batch 0: the early prompt (checked below)
                    got.extend(batch.events)
        # batch seqs count from 0 (batch 0 may have gone out before we subscribed), dense
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] in (0, 1)
        stored = [e for e in got if isinstance(e, BlockStored)]
        removed = [e for e in got if isinstance(e, BlockRemoved)]
        assert got == stored + removed + [AllBlocksCleared()]
        ring = cache.events(3).events                      # what the ring says
        assert [h for e in stored for h in e.block_hashes] == \
            [e.block_hashes[0] for e in ring[:3]]
        assert [t for e in stored for t in e.token_ids] == list(map(int, late))
        st = stored[0]                    # chained blocks travel as one BlockStored
        assert st.parent_block_hash is None and st.block_size == BS
        assert st.medium == "CPU" and st.lora_id is None
        assert sorted(h for e in removed for h in e.block_hashes) == \
            sorted(e.block_hashes[0] for e in ring[3:9])
        assert all(e.medium == "CPU" for e in removed)
        # replay from 0: the batch published before we subscribed, then the rest, then
        # vLLM's end marker (-1, b"")
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == -1:
                assert frames[2] == b""
                break
            replies.append((seq, dec.decode(frames[2])))
        assert [s for s, _ in replies] == list(range(seqs[-1] + 1))
        first = replies[0][1].events[0]
        assert isinstance(first, BlockStored) and first.token_ids == list(map(int, early))
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()
        proc.terminate()
        proc.wait(timeout=10)
        proc.stderr.close()
    assert proc.returncode == 0
