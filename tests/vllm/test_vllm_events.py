"""`shmkv events --zmq-pub` speaks vLLM 0.32's event schema by default: decoded here with
vLLM's own classes (vllm.distributed.kv_events), live and through the replay socket; the
old v0.11 arrays (--vllm-schema 0.11) are not decodable by them."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from support.procout import readline_with

BS = 16
SHMKV = [sys.executable, "-m", "shmkv"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _publisher(name, *extra):
    pub_ep, rep_ep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    proc = subprocess.Popen([*SHMKV, "events", name, "--zmq-pub", pub_ep, "--zmq-replay",
                             rep_ep, "--topic", "kv", "--duration", "20", "--interval", "0.02",
                             *extra], stderr=subprocess.PIPE, text=True, cwd="/")
    return proc, pub_ep, rep_ep


def _replay(zmq, ctx, rep_ep, topic_frame: bool):
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(rep_ep)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            frames = frames[1:]
            if topic_frame:                 # 0.32: (topic, seq, payload); end: (b"", -1, b"")
                assert len(frames) == 3
                frames = frames[1:]
            seq = int.from_bytes(frames[0], "big", signed=True)
            if seq == -1:
                return out
            out.append((seq, frames[1]))
    finally:
        dealer.close(0)


def test_default_schema_decodes_with_vllms_own_classes(make_cache):
    msgspec = pytest.importorskip("msgspec")
    zmq = pytest.importorskip("zmq")
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    cache = make_cache(event_capacity=64, num_blocks=8, block_size=BS)
    kv = np.zeros((2, 3 * BS, 2, 8), np.float16)
    ids = np.arange(3 * BS, dtype=np.int32)
    proc, pub_ep, rep_ep = _publisher(cache.name)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    try:
        line = readline_with(proc.stderr, "publishing")
        assert "vLLM 0.32" in line, line
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(pub_ep)
        time.sleep(0.5)
        sid = cache.create_sequence()
        cache.append(sid, kv, kv, tokens=ids)
        cache.free(sid)
        big = np.zeros((2, 8 * BS, 2, 8), np.float16)
        sid = cache.create_sequence()
        cache.append(sid, big, big)                 # reuses the 3 cached blocks
        cache.reset_prefix_cache()
        got = []
        deadline = time.monotonic() + 15
        while not (got and isinstance(got[-1], AllBlocksCleared)):
            assert time.monotonic() < deadline, f"timed out, got {got}"
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv"
                raw = msgspec.msgpack.decode(payload)
                assert isinstance(raw[1][0], dict) and "type" in raw[1][0]   # maps
                got.extend(dec.decode(payload).events)
        stored = [e for e in got if isinstance(e, BlockStored)]
        removed = [e for e in got if isinstance(e, BlockRemoved)]
        assert len(stored) == 1 and stored[0].token_ids == list(map(int, ids))
        st = stored[0]
        ring = cache.events(0).events
        assert st.block_hashes == [e.block_hashes[0] for e in ring[:3]]
        assert st.parent_block_hash is None and st.block_size == BS
        assert st.medium == "CPU" and st.lora_name is None and st.lora_id is None
        assert sorted(h for e in removed for h in e.block_hashes) == sorted(st.block_hashes)
        replies = _replay(zmq, ctx, rep_ep, topic_frame=True)
        assert [s for s, _ in replies] == list(range(len(replies))) and replies
        assert [e for _, p in replies for e in dec.decode(p).events] == got
    finally:
        sub.close(0)
        ctx.term()
        proc.terminate()
        proc.wait(timeout=10)
        proc.stderr.close()
    assert proc.returncode == 0


def test_legacy_schema_is_not_vllm_032s(make_cache):
    msgspec = pytest.importorskip("msgspec")
    pytest.importorskip("zmq")
    from vllm.distributed.kv_events import KVEventBatch

    from shmkv.events import Event, to_vllm
    from shmkv.vllm_events import classes

    evs = [Event(seq=0, kind="stored", block_hashes=[7], parent_block_hash=None,
                 token_ids=list(range(BS)), block_size=BS, time_ns=0, block_id=0)]
    enc = msgspec.msgpack.Encoder()
    new = enc.encode(classes("0.32")[3](ts=1.0, events=to_vllm(evs), data_parallel_rank=0))
    old = enc.encode(classes("0.11")[3](ts=1.0, events=to_vllm(evs, schema="0.11"),
                                        data_parallel_rank=0))
    ev = msgspec.msgpack.Decoder(type=KVEventBatch).decode(new).events[0]
    assert ev.block_hashes == [7] and ev.token_ids == list(range(BS))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(type=KVEventBatch).decode(old)
    assert msgspec.msgpack.Decoder(type=classes("0.11")[3]).decode(old).events[0].block_size == BS
