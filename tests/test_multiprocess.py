"""Several processes, one segment: sequences by id across processes, zero-copy writes seen
everywhere, concurrent churn and races for the last blocks and slots.  Workers live in
workers/mp_workers.py and run in "spawn" children."""
import os

import numpy as np
import pytest
from workers import mp_workers as w
from workers.mp_workers import assert_consistent, assert_same, read_report, tokens

import shmkv

pytestmark = pytest.mark.slow

JOIN_S = 120


def finish(p, out):
    """Join a worker, assert it exited 0, return its report."""
    p.join(JOIN_S)
    assert not p.is_alive(), f"worker {p.pid} still running after {JOIN_S} s"
    if p.exitcode != 0 and os.path.exists(out):
        read_report(out)                      # raises with the worker's traceback
    assert p.exitcode == 0, f"worker {p.pid} exit code {p.exitcode}"
    return read_report(out)


def test_sequence_built_in_one_process_read_in_another(cache, spawn, tmp_path):
    cfg = cache.config
    n, seed = 23, 77
    out = str(tmp_path / "build.json")
    sid = finish(spawn(w.build_detached, cache.name, n, seed, 5, out), out)
    # the builder has exited (and closed): its detached sequence is still there
    assert cache.sequences() == [sid]
    assert cache.owner_pid(sid) is None
    assert cache.seq_len(sid) == n
    out2 = str(tmp_path / "read.json")
    table = finish(spawn(w.read_verify, cache.name, sid, n, seed, out2), out2)
    assert table == cache.block_table(sid).tolist()
    k, v = tokens(cfg, n, seed)
    gk, gv = cache.gather(sid)
    assert_same(gk, k)
    assert_same(gv, v)
    st = cache.stats()
    assert st["num_processes"] == 1                      # both workers left the table
    cache.free(sid)
    assert_consistent(cache)
    assert cache.stats()["free_blocks"] == cfg.num_blocks


# (int8 pools are quantized: raw writes through the views need the scale views too;
# tests/test_quant.py covers them)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_key_cache_writes_cross_processes(make_cache, spawn, tmp_path, dtype):
    cache = make_cache(dtype=dtype)
    cfg = cache.config
    bs = cfg.block_size
    # 1. a child writes through key_cache/value_cache; the parent gathers it
    sid = cache.create_sequence()
    cache.append(sid, *tokens(cfg, 2, 0))
    slots = cache.reserve(sid, 7)
    out = str(tmp_path / "write.json")
    finish(spawn(w.write_through_views, cache.name, 1, slots.tolist(), 5, out), out)
    rng = np.random.default_rng(5)
    shape = (7, cfg.num_kv_heads, cfg.head_dim)
    k = rng.standard_normal(shape).astype(cfg.numpy_dtype)
    v = rng.standard_normal(shape).astype(cfg.numpy_dtype)
    gk, gv = cache.gather(sid, 2, 9)
    assert_same(gk[1], k)
    assert_same(gv[1], v)
    # 2. the parent writes (write() and the views); a child reads through its views
    k2, v2 = tokens(cfg, 7, 6)
    cache.write(0, slots, k2[0], v2[0])
    kc = cache.key_cache(1)
    kc[slots // bs, slots % bs] = k2[1]
    out = str(tmp_path / "read.json")
    ks, vs = finish(spawn(w.read_views, cache.name, 0, slots.tolist(), out), out)
    assert ks == [k2[0, i].tobytes().hex() for i in range(7)]
    assert vs == [v2[0, i].tobytes().hex() for i in range(7)]
    out = str(tmp_path / "read1.json")
    ks, _ = finish(spawn(w.read_views, cache.name, 1, slots.tolist(), out), out)
    assert ks == [k2[1, i].tobytes().hex() for i in range(7)]
    # 3. a sequence filled only through the parent's views, verified by a child's gather
    k3, v3 = tokens(cfg, 9, 8)
    s3 = cache.create_sequence()
    sl3 = cache.reserve(s3, 9)
    for layer in range(cfg.num_layers):
        cache.key_cache(layer)[sl3 // bs, sl3 % bs] = k3[layer]
        cache.value_cache(layer)[sl3 // bs, sl3 % bs] = v3[layer]
    cache.detach(s3)
    out = str(tmp_path / "verify.json")
    finish(spawn(w.read_verify, cache.name, s3, 9, 8, out), out)
    assert_consistent(cache)


def test_dead_owner_is_reclaimed_detached_survives(cache, spawn, tmp_path):
    cfg = cache.config
    out = str(tmp_path / "die.json")
    sid, kept, table = finish(spawn(w.die_holding, cache.name, 9, 3, out), out)
    # the worker died attached, without close(): its sequence is there until a recovery
    used = cache.stats()["used_blocks"]
    assert used == 2 * len(table)
    r = cache.recover()
    assert r["sequences"] == 1 and r["blocks"] == len(table)
    assert cache.sequences() == [kept]
    with pytest.raises(shmkv.SequenceNotFound):
        cache.seq_len(sid)
    k, v = tokens(cfg, 9, 3)
    gk, gv = cache.gather(kept)
    assert_same(gk, k)
    assert_same(gv, v)
    st = cache.stats()
    assert st["used_blocks"] == len(table) and st["num_processes"] == 1
    assert_consistent(cache)
    r = cache.recover()                       # nothing left to reclaim
    assert r["sequences"] == 0 and r["blocks"] == 0
    cache.free(kept)
    assert cache.stats()["free_blocks"] == cfg.num_blocks


def test_four_processes_append_fork_free_at_once(make_cache, spawn, tmp_path):
    cache = make_cache(num_blocks=24, max_seqs=24)    # small: CacheFullError happens
    cfg = cache.config
    pk, pv = tokens(cfg, 6, 1234)
    prompt = cache.create_sequence()
    cache.append(prompt, pk, pv)               # a partial last block every fork shares
    cache.detach(prompt)
    base = cache.stats()
    workers = []
    for wid in range(4):
        out = str(tmp_path / f"churn{wid}.json")
        workers.append((spawn(w.churn, cache.name, wid, prompt, 6, 1234, 150, 1 + wid, out),
                        out))
    reports = [finish(p, out) for p, out in workers]
    assert cache.sequences() == [prompt]
    assert_consistent(cache)
    gk, gv = cache.gather(prompt)
    assert_same(gk, pk)
    assert_same(gv, pv)
    st = cache.stats()
    assert st["used_blocks"] == 2 and st["num_sequences"] == 1
    assert st["num_processes"] == 1
    assert st["allocations"] - base["allocations"] == st["frees"] - base["frees"]
    assert sum(r["ops"] for r in reports) == 4 * 150
    cache.free(prompt)
    st = cache.stats()
    assert st["free_blocks"] == cfg.num_blocks and st["used_blocks"] == 0
    assert_consistent(cache)


def test_threads_share_one_handle(make_cache, tmp_path):
    """The copies run without the GIL: threads of one process on one segment (each with
    its own handle, all on one attachment) must be as safe as processes."""
    import threading

    cache = make_cache(num_blocks=24, max_seqs=24)
    pk, pv = tokens(cache.config, 6, 99)
    prompt = cache.create_sequence()
    cache.append(prompt, pk, pv)
    outs = [str(tmp_path / f"thread{i}.json") for i in range(4)]
    threads = [threading.Thread(target=w.churn, args=(cache.name, i, prompt, 6, 99, 150,
                                                      10 + i, outs[i]))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive()
    reports = [read_report(o) for o in outs]
    assert sum(r["ops"] for r in reports) == 4 * 150
    assert cache.sequences() == [prompt]
    assert_same(cache.gather(prompt)[0], pk)
    assert cache.stats()["num_processes"] == 1
    cache.free(prompt)
    assert cache.stats()["free_blocks"] == cache.config.num_blocks
    assert_consistent(cache)


@pytest.mark.parametrize("chunks", [(1, 2, 3, 5), (2, 2, 3, 3)])
def test_race_for_the_last_free_blocks(make_cache, spawn, tmp_path, chunks):
    cache = make_cache(num_blocks=40, max_seqs=8)
    cfg = cache.config
    barrier = spawn.ctx.Barrier(len(chunks))
    workers = []
    for wid, nb in enumerate(chunks):
        out = str(tmp_path / f"race{wid}.json")
        workers.append((spawn(w.race_for_blocks, cache.name, wid, nb, barrier, out), out))
    reports = [finish(p, out) for p, out in workers]
    st = cache.stats()
    won = sum(r["ok"] * r["chunk_blocks"] for r in reports)
    # every block is accounted for: taken by exactly the successful calls, or free
    assert won == st["used_blocks"]
    assert won + st["free_blocks"] == cfg.num_blocks
    assert st["free_blocks"] < min(chunks)        # nobody stopped while its chunk fit
    assert_consistent(cache)
    seen = set()
    for r in reports:
        sid = r["sid"]
        ntok = r["chunk_blocks"] * cfg.block_size
        assert cache.seq_len(sid) == r["ok"] * ntok
        table = cache.block_table(sid).tolist()
        assert len(table) == r["ok"] * r["chunk_blocks"]
        assert not seen & set(table)
        seen |= set(table)
        parts = [tokens(cfg, ntok, r["wid"] * 1000 + i) for i in range(r["ok"])]
        if parts:
            gk, gv = cache.gather(sid)
            assert_same(gk, np.concatenate([p[0] for p in parts], 1))
            assert_same(gv, np.concatenate([p[1] for p in parts], 1))
        cache.free(sid)
    assert len(seen) == won
    st = cache.stats()
    assert st["free_blocks"] == cfg.num_blocks and st["num_sequences"] == 0
    assert_consistent(cache)


def test_race_for_the_last_sequence_slots(make_cache, spawn, tmp_path):
    cache = make_cache(max_seqs=10)
    pre = cache.create_sequence()
    barrier = spawn.ctx.Barrier(3)
    workers = []
    for wid in range(3):
        out = str(tmp_path / f"slots{wid}.json")
        workers.append((spawn(w.race_for_slots, cache.name, wid, barrier, out), out))
    got = [finish(p, out) for p, out in workers]
    every = [s for mine in got for s in mine]
    assert len(every) == 9 and len(set(every)) == 9      # exactly the free slots, unique
    assert sorted(cache.sequences()) == sorted(every + [pre])
    with pytest.raises(shmkv.CacheFullError):
        cache.create_sequence()
    for s in every + [pre]:
        cache.free(s)
    assert cache.stats()["num_sequences"] == 0
    assert_consistent(cache)


def test_zero_copy_reader_never_sees_unpublished_tokens(make_cache, spawn, tmp_path):
    """A vLLM-style reader in another process (batch_block_tables, then the pool views,
    no sequence lock) must only ever see tokens whose data is complete: append publishes
    the new length after the copy, never before."""
    cache = make_cache(num_layers=2, num_kv_heads=4, head_dim=64, num_blocks=256,
                       block_size=16, dtype="float32", max_seqs=4)
    cfg = cache.config
    bs, last = cfg.block_size, cfg.num_layers - 1
    shared_sid = spawn.ctx.Value("q", -1, lock=False)
    done = spawn.ctx.Event()
    out = str(tmp_path / "writer.json")
    p = spawn(w.publish_writer, cache.name, shared_sid, done, 1.5, 128, out)
    k0, vl = cache.key_cache(0), cache.value_cache(last)
    seen = bad = 0
    first_bad = None
    while not done.is_set() and p.is_alive():
        sid = shared_sid.value
        if sid < 0:
            continue
        try:
            tables, lens = cache.batch_block_tables([sid])
        except shmkv.SequenceNotFound:
            continue
        n = int(lens[0])
        if n == 0:
            continue
        first = float(k0[tables[0, 0], 0, 0, 0])
        tail_k = k0[tables[0, (n - 1) // bs], (n - 1) % bs].copy()
        tail_v = vl[tables[0, (n - 1) // bs], (n - 1) % bs].copy()  # the last bytes copied
        try:
            still = cache.seq_len(sid)          # the sequence lived throughout the reads
        except shmkv.SequenceNotFound:
            continue
        assert still >= n
        seen += 1
        want = np.float32(first + n - 1)
        if not ((tail_k == want).all() and (tail_v == want).all()):
            bad += 1
            first_bad = first_bad or (sid, n, want, tail_k.ravel()[:4], tail_v.ravel()[:4])
    report = finish(p, out)
    assert report["appends"] > 50 and seen > 50, (report, seen)
    assert bad == 0, f"{bad}/{seen} reads saw a published but unwritten token: {first_bad}"
    assert cache.sequences() == []
    assert_consistent(cache)
    assert cache.stats()["free_blocks"] == cfg.num_blocks


def test_close_reclaims_owned_sequences_at_once(cache, spawn, tmp_path):
    out = str(tmp_path / "owned.json")
    sid, child = finish(spawn(w.build_owned, cache.name, 10, 1, out), out)
    # no recover() needed: the worker's close() gave everything back
    assert cache.sequences() == []
    for s in (sid, child):
        with pytest.raises(shmkv.SequenceNotFound):
            cache.gather(s)
    st = cache.stats()
    assert st["free_blocks"] == cache.config.num_blocks and st["num_processes"] == 1
    assert_consistent(cache)


def test_adopter_dies_sequence_reclaimed(cache, spawn, tmp_path):
    k, v = tokens(cache.config, 7, 2)
    sid = cache.create_sequence()
    cache.append(sid, k, v)
    cache.detach(sid)
    out = str(tmp_path / "adopt.json")
    pid = finish(spawn(w.adopt_and_die, cache.name, sid, out), out)
    assert cache.owner_pid(sid) == pid            # owned by a dead process ...
    r = cache.recover()                            # ... until a recovery
    assert r["sequences"] == 1 and r["blocks"] == 2
    assert cache.sequences() == []
    assert cache.stats()["free_blocks"] == cache.config.num_blocks
    assert_consistent(cache)


def test_dead_processes_do_not_fill_the_process_table(make_cache, spawn, tmp_path):
    """max_procs=2 and this process holds one slot: three workers in a row attach, leave
    a sequence behind and die without closing; each attach must still find a slot
    (recovery frees the dead ones' slots)."""
    cache = make_cache(max_procs=2)
    kept = []
    for i in range(3):
        out = str(tmp_path / f"die{i}.json")
        _, keep, _ = finish(spawn(w.die_holding, cache.name, 5, i, out), out)
        kept.append(keep)
    cache.recover()
    assert sorted(cache.sequences()) == sorted(kept)
    for i, s in enumerate(kept):
        assert_same(cache.gather(s)[0], tokens(cache.config, 5, i)[0])
        cache.free(s)
    st = cache.stats()
    assert st["num_processes"] == 1 and st["free_blocks"] == cache.config.num_blocks
    assert_consistent(cache)


def test_fork_while_another_process_appends(make_cache, spawn, tmp_path):
    """fork takes the published state only: a fork made while another process appends
    sees whole appends, the right data, and the two never see each other's new tokens."""
    cache = make_cache(num_blocks=128, block_size=4, max_seqs=8)   # never short
    shared_sid = spawn.ctx.Value("q", -1, lock=False)
    done = spawn.ctx.Event()
    out_a, out_f = str(tmp_path / "appender.json"), str(tmp_path / "forker.json")
    a = spawn(w.appender, cache.name, shared_sid, done, 1.5, 40, out_a)
    f = spawn(w.forker, cache.name, shared_sid, done, out_f)
    rounds = finish(a, out_a)
    res = finish(f, out_f)
    assert rounds >= 1 and res["forks"] >= 1, (rounds, res)
    assert cache.sequences() == []
    assert_consistent(cache)
    assert cache.stats()["free_blocks"] == cache.config.num_blocks
