"""The attach fuzzer (tools/fuzz_attach.py), short: a few thousand random and mutated
segments through attach() and the read-only snapshot(); no crash, no hang, no exception
outside the contract.  The full run (100,000 cases) is `make fuzz`."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import shmkv
from shmkv import _core
from shmkv.inspect import snapshot, struct_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = os.path.join(ROOT, "tools", "fuzz_attach.py")
SEED = 20240601


def run_fuzz(tmp_path, *args, timeout=600):
    out = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, FUZZ, "--json", str(out), "--out",
                           str(tmp_path / "inputs"), *args],
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=timeout,
                          check=False)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


@pytest.fixture(scope="module")
def fuzz_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    proc, r = run_fuzz(tmp, "--count", "4000", "--batch", "1000", "--seed", str(SEED))
    assert r is not None, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, r


def test_fuzz_no_crash_no_hang(fuzz_report):
    proc, r = fuzz_report
    assert r["cases"] == 4000, proc.stdout[-3000:]
    assert r["crashes"] == [] and r["hangs"] == [], proc.stdout[-3000:]
    # the fuzzer reached deep: most cases pass the header checks and get exercised
    assert r["attached"] > 1000 and r["snapshots_ok"] > 1000
    for kind in ("config", "body_struct", "consistent_seq", "pending", "live"):
        assert r["per_kind"][kind]["attached"] > 0, kind


def test_fuzz_no_exception_outside_the_contract(fuzz_report):
    """Any exception outside SegmentError / FileNotFoundError / ValueError from attach and
    snapshot, or outside ShmkvError from the calls after it, is a finding.
    (Fails while snapshot() raises OverflowError on an owner token whose
    slot half is 0: see test_snapshot_survives_owner_token_with_slot_zero.)"""
    _, r = fuzz_report
    assert r["findings"] == 0, json.dumps(r["finding_samples"][:5], indent=1)


def test_fuzzer_detects_crashes_and_hangs(tmp_path):
    proc, r = run_fuzz(tmp_path, "--count", "120", "--batch", "60", "--seed", "5",
                       "--self-test-crash", "70", "--self-test-hang", "100", "--hang", "2")
    assert proc.returncode != 0
    assert [c["case"] for c in r["crashes"]] == [70]
    assert r["crashes"][0]["exit"] == -11
    assert [h["case"] for h in r["hangs"]] == [100]
    assert os.path.exists(r["crashes"][0]["input"])
    assert r["cases"] == 118             # everything else still ran
    assert "CRASH: case 70" in proc.stdout and "HANG: case 100" in proc.stdout


def test_fuzzer_does_not_take_a_slow_start_for_a_hang(tmp_path):
    """A child's start (spawn, imports) on a loaded 2-core host can outlast --hang; only the
    time spent in one case counts.  (CI once reported cases 71 and 101 as hangs: the
    first cases of children started after a crash and a hang.)"""
    proc, r = run_fuzz(tmp_path, "--count", "40", "--batch", "10", "--seed", "5",
                       "--hang", "1", "--self-test-slow-start", "2.5")
    assert r is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["hangs"] == [] and r["crashes"] == [], proc.stdout[-3000:]
    assert r["cases"] == 40 and proc.returncode == 0, proc.stdout[-3000:]


def test_fuzz_cases_are_reproducible(tmp_path):
    for out in (tmp_path, tmp_path / "again"):
        proc = subprocess.run([sys.executable, FUZZ, "--seed", "9", "--show", "17", "--out",
                               str(out)], cwd=str(tmp_path), capture_output=True, text=True,
                              timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
    (a,) = [p for p in tmp_path.iterdir() if p.is_file()]
    (b,) = list((tmp_path / "again").iterdir())
    assert a.read_bytes() == b.read_bytes()


def test_snapshot_survives_owner_token_with_slot_zero(make_cache):
    """Core bug found by the fuzzer (minimised): a LIVE sequence whose owner token has a
    zero low half makes snapshot() compute (owner & 0xffffffff) - 1 == -1 into a uint64_t
    and raise OverflowError.  The read-only path promises SegmentError or odd numbers on a
    corrupt segment, never an exception like this."""
    cache = make_cache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=4, block_size=4,
                       max_seqs=2)
    cfg = cache.config
    sid = cache.create_sequence()
    a = np.ones((1, 2, 1, 4), cfg.numpy_dtype)
    cache.append(sid, a, a)
    seq = struct_layout()["seq"]
    off = (_core.layout_of(cfg)["off_seqs"] + seq["size"] * (sid % cfg.max_seqs)
           + seq["fields"]["owner"][0])
    with open(os.path.join("/dev/shm", cache.name.lstrip("/")), "r+b") as f:
        f.seek(off)
        f.write(struct.pack("<Q", 1 << 32))
    snap = snapshot(cache.name)
    assert [s["sid"] for s in snap["sequences"]] == [sid]


def test_gather_rejects_a_corrupt_length_before_allocating(make_cache):
    """Core bug found by the fuzzer (minimised): gather() sizes its output arrays from the
    sequence length in shared memory and only validates that length against the block
    table afterwards (shmkv_seq_check_span).  A corrupt length (here 0xfffffff0 tokens on
    a one-block sequence) makes it ask numpy for ~64 GiB: MemoryError here; on a machine
    that overcommits, a huge allocation (or the OOM killer) instead of SegmentError."""
    cache = make_cache(num_layers=2, num_kv_heads=1, head_dim=4, num_blocks=4, block_size=4,
                       max_seqs=2)
    cfg = cache.config
    sid = cache.create_sequence()
    a = np.ones((2, 2, 1, 4), cfg.numpy_dtype)
    cache.append(sid, a, a)
    seq = struct_layout()["seq"]
    off = (_core.layout_of(cfg)["off_seqs"] + seq["size"] * (sid % cfg.max_seqs)
           + seq["fields"]["len"][0])
    with open(os.path.join("/dev/shm", cache.name.lstrip("/")), "r+b") as f:
        f.seek(off)
        f.write(struct.pack("<I", 0xFFFFFFF0))
    with pytest.raises(shmkv.SegmentError):
        cache.gather(sid)


def test_the_pending_cases_can_see_a_lost_mark(monkeypatch):
    """The pending kind's own check can fail: with another owner's marks never counted as
    live (a broken ``_live``), a key one owner claimed is not held for the other."""
    import random

    sys.path.insert(0, os.path.dirname(FUZZ))
    try:
        import fuzz_attach
    finally:
        sys.path.remove(os.path.dirname(FUZZ))
    from shmkv import pending

    live = pending.PendingMarks._live
    monkeypatch.setattr(pending.PendingMarks, "_live", lambda self, rec, now, alive: (
        int(rec["owner"]) == self._token and live(self, rec, now, alive)))
    found = []
    for i in range(40):
        fuzz_attach.run_pending_case(f"shmkv-test-fuzzpend-{os.getpid()}-{i}",
                                     fuzz_attach.pending_table(random.Random(i)),
                                     random.Random(i), lambda where, e: found.append(where))
    assert "pending claim" in found
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("shmkv-test-fuzzpend-")]
