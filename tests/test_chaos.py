"""The chaos harness (tools/chaos/), short: workers under SIGKILL and every named crash
point, zero failures; and one short run per planted bug, which the harness must catch.

The full run (>= 1,000 SIGKILLs, >= 20 deaths at every crash point) is `make chaos` /
the CI command in tools/README.md; this is its few-minutes-cheaper sibling.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import shmkv
from shmkv import _core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
CHAOS = os.path.join(TOOLS, "chaos")           # the package; python runs its __main__
# make sanitize sets it: instrumented workers run a few times slower, so a planted bug's
# short run lasts longer (up to 3x) to see as many operations (tools/chaos scales its time
# bounds by it)
SLOW = float(os.environ.get("SHMKV_TIME_SCALE") or 1.0)


def run_chaos(tmp_path, *args, timeout=300):
    out = tmp_path / "chaos.json"
    # cwd outside the repository: the source tree must not shadow the installed package
    proc = subprocess.run([sys.executable, CHAOS, "--json", str(out), *args],
                          cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=timeout, check=False)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


def _explain(proc):
    return f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_chaos_short_run_has_no_failures(tmp_path):
    proc, r = run_chaos(tmp_path, "--workers", "8", "--duration", "45", "--phase", "15",
                        "--min-kills", "60", "--min-per-point", "3", "--max-duration", "100")
    assert r is not None, _explain(proc)
    assert proc.returncode == 0, _explain(proc)
    assert r["ok"] and r["counts_met"]
    assert r["failure_total"] == 0, r["failure_samples"]
    assert r["lost_tokens"] == 0 and r["leaked_blocks_max"] == 0
    assert all(n >= 3 for n in r["crash_point_deaths"].values()), r["crash_point_deaths"]
    assert set(r["crash_point_deaths"]) == set(_core.CRASH_POINTS)
    assert r["sigkills"] >= 60
    assert r["max_blocked_s"] < r["bound_s"]
    assert r["recoveries"] > 0 and r["sequences_verified"] > 0 and r["tokens_verified"] > 0
    assert r["dead_owner_sequences_seen_reclaimed"] > 0
    assert r["audits"] >= 3
    # the prefix-cache paths ran, and their results were checked
    px = r["prefix"]
    assert r["crash_point_deaths"]["publish_mid"] >= 3 and r["crash_point_deaths"]["trim_mid"] >= 3
    assert px["prompt_creates"] > 0 and px["hit_blocks_verified_by_workers"] > 0
    assert px["segment"]["cached_blocks_reused"] > 0          # hits on cached blocks ...
    assert px["live_hit_blocks"] > 0                          # ... and on live ones
    assert px["audit_hit_blocks_verified"] > 0 and px["hashed_blocks_verified_in_audits"] > 0
    assert px["token_ids_verified"] > 0 and px["commits"] > 0
    assert px["trims"] > 0 and px["evicted"] > 0
    assert px["truncates"] > 0 and r["crash_point_deaths"]["truncate_mid"] >= 3
    # KV events: written, read racing the writers and in every audit, checked against
    # the index; deaths inside the event write and inside reset_prefix_cache
    ev = r["events"]
    assert ev["written"] > 0 and ev["read_by_workers"] > 0 and ev["read_in_audits"] > 0
    assert ev["findable_blocks_matched_to_stored"] > 0 and ev["resets"] > 0
    assert r["crash_point_deaths"]["event_mid"] >= 3 and r["crash_point_deaths"]["reset_mid"] >= 3


@pytest.mark.slow
def test_chaos_spawn_workers_armed_through_the_environment(tmp_path):
    """--start-method spawn: fresh interpreters, crash points armed the documented way
    (SHMKV_CRASH_POINT=name:N in the environment, read at import)."""
    # fresh interpreters start slowly: arm most restarts, so that every one of the 14
    # points sees a death within the 15 s
    proc, r = run_chaos(tmp_path, "--workers", "6", "--duration", "15", "--phase", "0",
                        "--start-method", "spawn", "--min-kills", "5", "--min-per-point", "1",
                        "--arm", "0.6", "--max-duration", "120")
    assert r is not None, _explain(proc)
    assert proc.returncode == 0, _explain(proc)
    assert r["failure_total"] == 0
    assert all(n >= 1 for n in r["crash_point_deaths"].values()), r["crash_point_deaths"]


# what each planted bug must be caught as
PLANTED = {
    "no_recovery": {"unreclaimed", "invariant", "leak", "unaccounted", "lock_timeout",
                    "blocked"},
    "early_publish": {"garbage", "torn_publish", "lost_tokens"},
    "no_cow": {"lost_tokens", "garbage"},
    "leak_on_free": {"invariant", "leak"},
    "torn_event": {"bad_event"},
}


def test_planted_bug_list_is_covered():
    assert set(PLANTED) == set(_core.PLANTED_BUGS)


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_chaos_catches_planted_bug(tmp_path, bug):
    # An early publish is only visible to a reader (or a death) inside the few
    # microseconds between the early store and the copy: aimed readers make that likely
    # within seconds, not certain, so that one gets a second run.
    # (under sanitizers, fewer operations per second: twice the attempts)
    attempts = (2 if bug == "early_publish" else 1) * (2 if SLOW > 1 else 1)
    for _ in range(attempts):
        dur = f"{8 * min(SLOW, 3):g}"
        proc, r = run_chaos(tmp_path, "--duration", dur, "--phase", "0", "--plant", bug,
                            "--max-duration", dur)
        assert r is not None, _explain(proc)
        if r["caught"]:
            break
    assert proc.returncode != 0, f"planted bug {bug} was not caught:\n{_explain(proc)}"
    assert not r["ok"]
    assert set(r["caught"]) & PLANTED[bug], (bug, r["caught"], r["failure_samples"][:5])
    assert "FAIL" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sabotage,kinds", [("free_detached", {"lost_sequence"}),
                                             ("corrupt_data", {"lost_tokens", "garbage"}),
                                             ("corrupt_cached", {"bad_hit", "bad_index"})])
def test_chaos_catches_sabotage(tmp_path, sabotage, kinds):
    """Damage no planted bug makes: a detached sequence freed behind the workers' backs,
    one confirmed token changed in place, one token of a cached (findable) block
    changed: a later hit on it, or the audit's raw check of hashed blocks, must see it."""
    proc, r = run_chaos(tmp_path, "--duration", "12", "--phase", "0", "--sabotage", sabotage,
                        "--max-duration", "12")
    assert r is not None, _explain(proc)
    assert r["sabotaged"] > 0
    assert proc.returncode != 0, _explain(proc)
    assert set(r["caught"]) & kinds, (r["caught"], r["failure_samples"][:5])


def test_expect_failure_inverts_the_verdict(tmp_path):
    dur = f"{4 * min(SLOW, 3):g}"
    proc, r = run_chaos(tmp_path, "--duration", dur, "--phase", "0", "--plant", "no_cow",
                        "--expect-failure", "--max-duration", dur)
    assert proc.returncode == 0, _explain(proc)
    assert "CAUGHT" in proc.stdout and r["caught"]


# ---- the harness's own checks must be able to fail (no chaos needed) --------------------
@pytest.fixture
def chaos_mod():
    sys.path.insert(0, TOOLS)
    try:
        import chaos
        yield chaos
    finally:
        sys.path.remove(TOOLS)


def _cfg():
    return shmkv.CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=16,
                             block_size=4, dtype="float32", max_seqs=8)


def test_codec_derives_lineages_and_rejects_garbage(chaos_mod):
    codec = chaos_mod.Codec(_cfg())
    segs = [(0, 0x1234567), (5, 0x7654321), (9, 0xABCDEF01)]
    k, v = codec.make(segs, 0, 14)
    assert codec.derive(k, v) == segs
    assert codec.first_mismatch(k, v, segs, 0) == (None, 0)
    # a token from another lineage at the right position
    k2, v2 = k.copy(), v.copy()
    ok, ov = codec.make([(0, 99)], 0, 14)
    k2[:, 7], v2[:, 7] = ok[:, 7], ov[:, 7]
    with pytest.raises(chaos_mod.DataError) as ei:
        codec.derive(k2, v2)
    assert ei.value.pos == 7
    assert codec.first_mismatch(k2, v2, segs, 0) == (7, 1)
    # a torn token: V of one layer missing
    k3, v3 = k.copy(), v.copy()
    v3[1, 3] = 0
    with pytest.raises(chaos_mod.DataError):
        codec.derive(k3, v3)
    # a copy-on-write slip: the child's first own token is its parent's
    child = [(0, 0x1234567), (5, 0x55)]
    ck, cv = codec.make(child, 0, 8)
    pk, pv = codec.make(segs, 0, 8)
    ck[:, 5], cv[:, 5] = pk[:, 5], pv[:, 5]
    with pytest.raises(chaos_mod.DataError):
        codec.derive(ck, cv)
    # zeroed (never written) memory
    with pytest.raises(chaos_mod.DataError):
        codec.derive(np.zeros_like(k), np.zeros_like(v))


def test_journal_survives_a_torn_write(chaos_mod, tmp_path):
    J = chaos_mod.Journal(str(tmp_path / "j"), 2, 8, create=True)
    try:
        e = chaos_mod.Entry(77, chaos_mod.DETACHED, conf=5, segs=[(0, 3), (2, 9)])
        J.write(3, e)
        e.conf = 6
        J.write(3, e)
        assert J.read(3).conf == 6 and J.hints[3] == 77
        # tear the newest copy: the older one is what a reader gets
        newest = max((0, 1), key=lambda c: J._raw_ver(3, c))
        o = J._copy_off(3, newest)
        J.mm[o + 40:o + 44] = b"\x01\x02\x03\x04"
        got = J.read(3)
        assert got.conf == 5 and got.segs == [(0, 3), (2, 9)]
        assert J.read(4) is None
        # the per-slot claim is exclusive between open file descriptions
        J2 = chaos_mod.Journal(str(tmp_path / "j"), 2, 8)
        try:
            assert J.try_lock(3)
            assert not J2.try_lock(3)
            J.unlock(3)
            assert J2.try_lock(3)
            J2.unlock(3)
        finally:
            J2.close()
    finally:
        J.close()


def test_codec_trimmed_lineages_and_token_ids(chaos_mod):
    """After trim_streaming the kept tokens are the sink blocks and the window at their
    ORIGINAL positions: derive_full finds the lineage and the trim; a jump that is no
    whole-block trim after a sink is garbage.  Token ids are a function of the lineage
    without its salt bits: the salted prompt has the unsalted one's ids, other data."""
    cfg = _cfg()                                   # block size 4
    codec = chaos_mod.Codec(cfg)
    segs = [(0, 0x1230), (6, 0x4560), (21, 0x7890)]
    n0 = 26
    k, v = codec.make(segs, 0, n0)
    # sink 1 block, 3 blocks (12 tokens) dropped: current 4.. are original 16..
    pos = codec.orig(1, 12, 0, n0 - 12)
    assert pos.tolist() == [0, 1, 2, 3] + list(range(16, 26))
    tk, tv = k[:, pos], v[:, pos]
    dsegs, dpos, m, t = codec.derive_full(tk, tv)
    assert (m, t) == (4, 12) and dpos.tolist() == pos.tolist()
    assert dsegs == [(0, 0x1230), (6, 0x4560), (21, 0x7890)]
    assert codec.first_mismatch_at(tk, tv, segs, pos) == (None, 0)
    # a jump by part of a block, or not after whole sink blocks
    for bad in ([0, 1, 2, 3, 14, 15, 16], [0, 1, 2, 12, 13, 14, 15]):
        with pytest.raises(chaos_mod.DataError):
            codec.derive_full(k[:, bad], v[:, bad])
    # the kept tokens of the wrong trim (one block too many dropped) differ
    assert codec.first_mismatch_at(tk, tv, segs, codec.orig(1, 16, 0, n0 - 12))[0] == 4
    # ids: salt bits do not change them, everything else does
    p0 = np.arange(12)
    base = [(0, 0x5550 << chaos_mod.SALT_BITS)]
    salted = [(0, (0x5550 << chaos_mod.SALT_BITS) | 1)]
    assert np.array_equal(codec.tid(base, p0), codec.tid(salted, p0))
    assert not np.array_equal(codec.make(base, 0, 12)[0], codec.make(salted, 0, 12)[0])
    assert len(set(codec.tid(base, p0).tolist())) == 12
    assert (codec.tid(base, p0) >= 0).all()


def test_check_block_rejects_a_wrong_findable_block(chaos_mod):
    codec = chaos_mod.Codec(_cfg())
    segs = [(0, 0x1230), (6, 0x4560)]
    k, v = codec.make(segs, 0, 12)
    ids = codec.tid(segs, np.arange(12))
    blk = slice(4, 8)                              # block 1: positions 4..7, two segments
    assert codec.check_block(k[:, blk], v[:, blk], ids[blk]) is None
    assert "id" in codec.check_block(k[:, blk], v[:, blk], ids[0:4])        # other ids
    assert "block" in codec.check_block(k[:, 3:7], v[:, 3:7], ids[3:7])     # misaligned
    k2 = k[:, blk].copy()
    k2[1, 2] += 1                                                            # torn data
    assert codec.check_block(k2, v[:, blk], ids[blk]) is not None


def test_resolve_record_after_a_death(chaos_mod):
    """What a claimant decides about the operation a dead worker left in flight."""
    E, m = chaos_mod.Entry, chaos_mod
    e = E(7, m.DETACHED, m.I_TRIM, conf=40, i_len=40, i_n=16, trim=8, sink=1, segs=[(0, 1)])
    assert m.resolve_record(e, 40, 8)[3] == []                 # never started
    t_exp, conf, _, probs = m.resolve_record(e, 24, 24)        # done (journal redone)
    assert (t_exp, conf, probs) == (24, 24, [])
    kinds = [p[0] for p in m.resolve_record(e, 24, 8)[3]]      # done, trimmed() not told
    assert kinds == ["bad_trim"]
    assert [p[0] for p in m.resolve_record(e, 32, 8)[3]] == ["bad_trim"]   # half a trim
    a = E(7, m.DETACHED, m.I_APPEND, conf=10, i_len=10, i_n=5, segs=[(0, 1)])
    assert m.resolve_record(a, 10, 0)[3] == [] and m.resolve_record(a, 15, 0)[3] == []
    assert [p[0] for p in m.resolve_record(a, 12, 0)[3]] == ["torn_publish"]
    assert [p[0] for p in m.resolve_record(a, 9, 0)[3]] == ["lost_tokens"]


@pytest.mark.slow
def test_a_death_mid_trim_leaves_trimmed_right(seg_name, tmp_path):
    """The trim journal: a process that dies inside trim_streaming (crash point trim_mid,
    armed through the environment; the journal half applied) leaves the sequence trimmed
    all or nothing after recovery, and trimmed() must say how many tokens were dropped
    (a caller adds it to recover original positions).  The chaos harness reports the
    same thing, seen after a trim_mid death of a pool sequence, as bad_trim."""
    cfg = shmkv.CacheConfig(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=32,
                            block_size=4, dtype="float32", max_seqs=8)
    c = shmkv.KVCache.create(seg_name, cfg)
    try:
        sid = c.create_sequence()
        k = np.repeat(np.arange(24, dtype=np.float32).reshape(1, 24, 1, 1), 4, axis=3)
        c.append(sid, k, k)
        c.detach(sid)
        code = ("import shmkv, sys; c = shmkv.KVCache.attach(sys.argv[1]); "
                "c.trim_streaming(int(sys.argv[2]), 4, 4)")
        env = dict(os.environ, SHMKV_CRASH_POINT="trim_mid:1")
        proc = subprocess.run([sys.executable, "-c", code, seg_name, str(sid)], env=env,
                              cwd=str(tmp_path), capture_output=True, text=True, timeout=60,
                              check=False)
        assert proc.returncode == 86, (proc.returncode, proc.stderr[-2000:])   # trim_mid
        c.recover()
        assert c.check() == []
        kept = c.gather(sid)[0][0, :, 0, 0].astype(int).tolist()
        assert kept == [0, 1, 2, 3, 20, 21, 22, 23]      # the trim was finished
        assert c.seq_len(sid) == 8
        assert c.trimmed(sid) == 16, "trimmed() lost the trim a dead process journalled"
        c.free(sid)
    finally:
        c.close()
