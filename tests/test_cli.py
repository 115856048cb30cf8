"""The admin CLI, run as a user runs it: `python -m shmkv ...` in a subprocess from a
directory outside the repository, against live segments (workers appending and forking),
segments whose workers were SIGKILLed, and garbage / truncated / wrong-version files.

Cheap argument-level checks (help texts, the full error matrix, parsers) call
``shmkv.cli.main`` in-process to keep the file well under a minute on 2 cores.
"""
import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import re
import signal
import struct
import subprocess
import sys
import urllib.error
import urllib.request
import uuid

import numpy as np
import pytest
from support.procout import readline_with, stderr_lines
from workers import cli_workers

import shmkv
import shmkv._core as core
from shmkv import cli
from shmkv import inspect as shmkv_inspect
from shmkv.inspect import snapshot

SPAWN = mp.get_context("spawn")
TINY = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
COMMANDS = ("ls", "info", "seqs", "blocks", "procs", "check", "recover", "create", "rm",
            "top", "metrics")


def unique(tag):
    return f"shmkv-test-cli-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def unlink(name):
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:
        pass


@pytest.fixture
def names():
    """A list to put segment names in; every one is unlinked at teardown."""
    made = []
    try:
        yield made
    finally:
        for n in made:
            unlink(n)


@pytest.fixture
def workers():
    """Started processes; killed by PID and joined at teardown if still running."""
    started = []
    try:
        yield started
    finally:
        for p in started:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=10)


@pytest.fixture
def shmkv_cli(tmp_path):
    """shmkv_cli(*args) -> CompletedProcess of `python -m shmkv args` run from tmp_path
    (so the installed package is used), with a no-traceback check on every call."""

    def run(*args, timeout=30):
        env = dict(os.environ)
        for k in ("SHMKV_PLANT", "SHMKV_CRASH_POINT", "NO_COLOR"):
            env.pop(k, None)
        r = subprocess.run([sys.executable, "-m", "shmkv", *map(str, args)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=timeout, env=env,
                           check=False)
        assert "Traceback" not in r.stderr, r.stderr
        if "always" not in args:
            assert "\x1b[" not in r.stdout, "colour codes on a pipe"
        return r

    def run_json(*args, rc=0, timeout=30):
        r = run(*args, "--json", timeout=timeout)
        assert r.returncode == rc, (args, r.returncode, r.stdout, r.stderr)
        return json.loads(r.stdout)

    run.json = run_json
    return run


def fail_line(r, name):
    """An expected failure: exit 2, nothing on stdout, one line on stderr naming it."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = stderr_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"shmkv: {name}"), r.stderr
    assert r.stdout == ""
    return lines[0]


# ======================================================================================
# help: an operator finds everything from `shmkv --help`
# ======================================================================================
def test_top_level_help_is_a_map_of_the_tool(shmkv_cli):
    r = shmkv_cli("--help")
    assert r.returncode == 0
    out = r.stdout
    for cmd in COMMANDS:
        assert re.search(rf"^\s+{cmd}\s+\S", out, re.MULTILINE), f"{cmd} missing from --help"
    # the operator's path: find, who holds what, dead leak, repair, watch live
    for words in ("shmkv ls", "DEAD", "shmkv recover NAME", "check --repair", "shmkv top NAME",
                  "--json", "exit codes", "metrics NAME --listen"):
        assert words in out, words
    assert "demo" in out


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_has_help(cmd, capsys):
    assert cli.main([cmd, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: shmkv {cmd}")
    assert "--json" in out
    assert len(out.splitlines()) > 6


def test_usage_errors_exit_2(shmkv_cli):
    r = shmkv_cli()
    assert r.returncode == 2 and "usage: shmkv" in r.stderr
    assert shmkv_cli("frobnicate").returncode == 2
    assert shmkv_cli("info").returncode == 2                     # NAME missing
    assert shmkv_cli("info", "a/b").returncode == 2              # not a segment name
    assert shmkv_cli("top", "x", "--json").returncode == 2       # --json needs --iterations


def test_demo_is_wired(shmkv_cli):
    if importlib.util.find_spec("shmkv.demo") is not None:
        r = shmkv_cli("demo", "--help")
        assert r.returncode == 0 and "usage" in r.stdout.lower()
    else:
        r = shmkv_cli("demo")
        assert r.returncode == 2 and "demo" in r.stderr


# ======================================================================================
# a live segment while workers append and fork
# ======================================================================================
def test_every_command_on_a_live_segment(shmkv_cli, names, workers, tmp_path):
    name = unique("live")
    names.append(name)
    cfg = shmkv.CacheConfig(**TINY, num_blocks=256, max_seqs=64)
    cache = shmkv.KVCache.create(name, cfg)
    try:
        stop = SPAWN.Event()
        started = [SPAWN.Event() for _ in range(2)]
        for i in range(2):
            # they work until `stop` below: 600 s is only a cap (a loaded host under make
            # sanitize took longer than 30 s to get to `top`, and found them gone)
            p = SPAWN.Process(target=cli_workers.churn, args=(name, 600.0, i, started[i], stop))
            p.start()
            workers.append(p)
        for e in started:
            assert e.wait(30)
        pids = {p.pid for p in workers}

        # ls: ours, ok, with the test process and both workers attached
        rows = shmkv_cli.json("ls", name)
        assert [r["name"] for r in rows] == [name]
        row = rows[0]
        assert row["state"] == "ok" and row["processes_alive"] == 3
        assert row["processes_dead"] == 0 and row["num_blocks"] == 256
        assert row["config"]["num_layers"] == 2 and row["model"] == "2L 2H 8D float16 bs4"
        r = shmkv_cli("ls", name)
        assert r.returncode == 0
        header, line = r.stdout.splitlines()[:2]
        assert header.split() == ["NAME", "SIZE", "MODEL", "BLOCKS", "USED", "SEQS", "PROCS",
                                  "DEAD", "STATE"]
        assert line.startswith(name) and line.split()[-1] == "ok"

        # info: header, config, sizes, counters
        info = shmkv_cli.json("info", name)
        assert info["config"] == {**TINY, "num_blocks": 256, "max_seqs": 64, "dtype": "float16",
                                  "max_seq_len": 1024, "max_procs": 64, "hash": "fast",
                                  "event_capacity": 0}
        assert info["layout_version"] == core.LAYOUT_VERSION
        assert info["creator_pid"] == os.getpid()
        assert info["sizes"]["segment_bytes"] == cfg.segment_size()
        assert info["sizes"]["bytes_per_block"] == cfg.bytes_per_block
        u = info["usage"]
        assert u["used_blocks"] + u["free_blocks"] == 256
        assert set(core.COUNTER_NAMES) <= set(info["counters"])
        r = shmkv_cli("info", name)
        assert r.returncode == 0 and "counters" in r.stdout and "cow_copies" in r.stdout

        # seqs: owners are the workers (or us), alive; shared <= blocks
        seqs = shmkv_cli.json("seqs", name)
        assert seqs, "the workers keep sequences alive"
        for s in seqs:
            assert s["owner"] == "alive" and s["owner_pid"] in pids
            assert 0 <= s["shared_blocks"] <= s["blocks"]
            assert s["len"] <= s["blocks"] * cfg.block_size
        r = shmkv_cli("seqs", name)
        assert r.returncode == 0 and r.stdout.split()[:6] == ["SID", "OWNER", "STATE", "LEN",
                                                              "BLOCKS", "SHARED"]
        assert "DEAD" not in r.stdout

        # blocks: a partition of the pool; the PNG is a picture of the pool
        png = tmp_path / "pool.png"
        b = shmkv_cli.json("blocks", name, "--png", png)
        assert b["free"] + b["cached"] + b["owned"] + b["shared"] == 256
        assert sum(b["refcount_histogram"].values()) == 256
        assert b["held_by_dead"] == 0
        fr = b["fragmentation"]
        assert 0 <= fr["wasted_token_slots"] <= b["used"] * cfg.block_size
        assert 0 < fr["largest_free_run"] <= b["free"] + b["cached"]
        from PIL import Image

        with Image.open(png) as img:
            assert img.format == "PNG" and img.size[0] >= 64 * 4 and img.size[1] > 50
        r = shmkv_cli("blocks", name)
        assert r.returncode == 0 and "refcount histogram" in r.stdout
        assert "largest free run" in r.stdout and "map" in r.stdout

        # procs: both workers alive, holding what they hold
        procs = shmkv_cli.json("procs", name)
        by_pid = {p["pid"]: p for p in procs}
        assert pids <= set(by_pid) and os.getpid() in by_pid
        assert all(p["alive"] for p in procs)
        # each process's command line (vLLM's processes show their titles: VLLM::Worker...)
        with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
            mine = f.read().rstrip(b"\0").replace(b"\0", b" ").decode()
        assert by_pid[os.getpid()]["command"] == mine and "python" in mine
        r = shmkv_cli("procs", name)
        assert r.returncode == 0 and "DEAD" not in r.stdout and "COMMAND" in r.stdout

        # check under load: consistent
        r = shmkv_cli("check", name)
        assert r.returncode == 0 and f"{name}: consistent" in r.stdout
        chk = shmkv_cli.json("check", name)
        assert chk["consistent"] is True and chk["problems"] == []

        # counters only grow while the workers work
        later = shmkv_cli.json("info", name)["counters"]
        assert later["allocations"] > info["counters"]["allocations"]
        assert later["forks"] >= info["counters"]["forks"] > 0

        # top: frames with rates from counter deltas
        frames = shmkv_cli.json("top", name, "--iterations", 2, "--interval", 0.3)
        assert len(frames) == 2
        for f in frames:
            assert f["num_blocks"] == 256 and f["processes_alive"] == 3
            assert set(f["rates"]) >= {"allocations", "appended_tokens", "forks",
                                       "cow_copies", "recoveries"}
            assert all(v is not None and v >= 0 for v in f["rates"].values())
        assert any(f["rates"]["appended_tokens"] > 0 for f in frames)
        r = shmkv_cli("top", name, "--iterations", 3, "--interval", 0.2)
        assert r.returncode == 0
        assert r.stdout.count(f"shmkv top {name}") == 3
        assert r.stdout.count("rate/s allocs") == 3 and "top sequences" in r.stdout
        assert "processes" in r.stdout

        stop.set()
        for p in workers:
            p.join(timeout=30)
            assert p.exitcode == 0
        assert cache.check() == []

        # rm: refused while we are attached, --force unlinks; we keep working on it
        r = shmkv_cli("rm", name)
        assert r.returncode == 1 and str(os.getpid()) in r.stderr
        assert os.path.exists(f"/dev/shm/{name}")
        r = shmkv_cli("rm", "--force", name)
        assert r.returncode == 0 and not os.path.exists(f"/dev/shm/{name}")
        sid = cache.create_sequence()
        cache.free(sid)
        assert cache.check() == []
    finally:
        cache.close()


# ======================================================================================
# workers SIGKILLed: procs shows them dead, recover reclaims, check passes
# ======================================================================================
def _start_holders(name, n, workers, n_seqs=4, n_tokens=9):
    q = SPAWN.Queue()
    ps = []
    for _ in range(n):
        p = SPAWN.Process(target=cli_workers.hold, args=(name, n_seqs, n_tokens, q))
        p.start()
        workers.append(p)
        ps.append(p)
    got = dict(q.get(timeout=30) for _ in ps)
    return ps, got


def _kill(p):
    os.kill(p.pid, signal.SIGKILL)
    p.join(timeout=10)
    assert p.exitcode == -signal.SIGKILL


def test_killed_workers_are_shown_dead_and_recovered(shmkv_cli, names, workers):
    name = unique("dead")
    names.append(name)
    made = shmkv_cli.json("create", name, "--preset", "tiny", "--blocks", 128,
                          "--max-seqs", 64)
    assert made["config"]["num_blocks"] == 128 and made["config"]["num_layers"] == 2
    # the CLI left the segment with nobody attached and nothing in it
    assert shmkv_cli.json("ls", name)[0]["state"] == "stale"
    assert shmkv_cli.json("procs", name) == [] and shmkv_cli.json("seqs", name) == []

    (a, b), sids = _start_holders(name, 2, workers)
    _kill(a)

    procs = {p["pid"]: p for p in shmkv_cli.json("procs", name)}
    assert procs[a.pid]["alive"] is False and procs[b.pid]["alive"] is True
    assert procs[a.pid]["sequences"] == 4 and procs[b.pid]["sequences"] == 4
    seqs = {s["sid"]: s for s in shmkv_cli.json("seqs", name)}
    assert {sid for sid, s in seqs.items() if s["owner"] == "dead"} == set(sids[a.pid])
    assert {sid for sid, s in seqs.items() if s["owner"] == "alive"} == set(sids[b.pid])
    assert {s["sid"] for s in shmkv_cli.json("seqs", name, "--dead")} == set(sids[a.pid])
    # forks share blocks: the fork of a 9-token sequence shares its first 2 full blocks
    assert any(s["shared_blocks"] >= 2 for s in seqs.values())

    r = shmkv_cli("seqs", name)
    assert r.returncode == 0 and "DEAD" in r.stdout
    assert f"shmkv recover {name}" in r.stdout and f"pid {a.pid}" in r.stdout
    r = shmkv_cli("procs", name)
    assert re.search(rf"^\s*{a.pid}\s+\d+\s+DEAD", r.stdout, re.MULTILINE), r.stdout
    row = shmkv_cli.json("ls", name)[0]
    assert row["state"] == "ok" and row["processes_dead"] == 1 and row["dead_sequences"] == 4

    # rm refuses while B lives; rm --stale leaves it alone
    r = shmkv_cli("rm", name)
    assert r.returncode == 1 and "refusing" in r.stderr and str(b.pid) in r.stderr
    assert os.path.exists(f"/dev/shm/{name}")
    assert shmkv_cli.json("rm", "--stale", "--dry-run", name) == []

    _kill(b)
    row = shmkv_cli.json("ls", name)[0]
    assert row["state"] == "stale" and row["processes_alive"] == 0
    assert row["processes_dead"] == 2 and row["dead_sequences"] == 8
    blocks = shmkv_cli.json("blocks", name)
    assert blocks["used"] > 0 and blocks["held_by_dead"] == blocks["used"]
    assert [r["name"] for r in shmkv_cli.json("rm", "--stale", "--dry-run", name)] == [name]
    assert os.path.exists(f"/dev/shm/{name}")

    rec = shmkv_cli.json("recover", name)
    assert rec["sequences"] == 8 and rec["blocks"] == blocks["held_by_dead"]
    assert rec["processes"] == 2 and sorted(rec["dead_pids"]) == sorted([a.pid, b.pid])

    r = shmkv_cli("check", name)
    assert r.returncode == 0 and "consistent" in r.stdout
    assert shmkv_cli.json("procs", name) == [] and shmkv_cli.json("seqs", name) == []
    after = shmkv_cli.json("blocks", name)
    assert after["used"] == 0 and after["free"] == 128
    assert shmkv_cli.json("info", name)["counters"]["reclaimed_sequences"] >= 8
    r = shmkv_cli("recover", name)
    assert r.returncode == 0 and "nothing to reclaim" in r.stdout

    r = shmkv_cli("rm", name)
    assert r.returncode == 0 and not os.path.exists(f"/dev/shm/{name}")


def test_check_repair_and_strict(shmkv_cli, names, workers):
    name = unique("repair")
    names.append(name)
    shmkv.KVCache.create(name, shmkv.CacheConfig(**TINY, num_blocks=64, max_seqs=32)).close()

    (a,), _ = _start_holders(name, 1, workers)
    _kill(a)
    r = shmkv_cli("check", name, "--strict")
    assert r.returncode == 1 and "held by a dead process (pid" in r.stdout
    # check without --repair looks and changes nothing: the leak is still there
    assert len(shmkv_cli.json("seqs", name)) == 4
    assert shmkv_cli.json("recover", name)["sequences"] == 4

    (a,), _ = _start_holders(name, 1, workers)
    _kill(a)
    rep = shmkv_cli.json("check", name, "--repair")
    assert rep["consistent"] is True and rep["repair"]["sequences"] == 4
    assert rep["dead_after"]["sequences"] == 0
    assert shmkv_cli.json("procs", name) == []


def test_check_reports_an_inconsistent_segment(shmkv_cli, names, workers):
    """A planted leak (free keeps a block) is an invariant violation: exit 1, listed."""
    name = unique("leak")
    names.append(name)
    shmkv.KVCache.create(name, shmkv.CacheConfig(**TINY, num_blocks=64, max_seqs=32)).close()
    q = SPAWN.Queue()
    p = SPAWN.Process(target=cli_workers.leak_on_free, args=(name, q))
    p.start()
    workers.append(p)
    assert q.get(timeout=30) == p.pid
    _kill(p)
    res = shmkv_cli.json("check", name, rc=1)
    assert res["consistent"] is False and res["problems"]
    r = shmkv_cli("check", name, "--repair")
    assert r.returncode == 0, r.stdout


# ======================================================================================
# segments that cannot be read
# ======================================================================================
def _bad_segments(names):
    """{kind: name} of broken files in /dev/shm, made from a real segment's bytes."""
    good = unique("good")
    names.append(good)
    shmkv.KVCache.create(good, shmkv.CacheConfig(**TINY, num_blocks=64, max_seqs=8)).close()
    with open(f"/dev/shm/{good}", "rb") as f:
        data = f.read()
    made = {}

    def put(kind, payload):
        n = unique(kind)
        names.append(n)
        with open(f"/dev/shm/{n}", "wb") as f:
            f.write(payload)
        made[kind] = n

    put("garbage", np.random.default_rng(1).bytes(8192))
    put("empty", b"")
    put("magiconly", data[:8])
    put("truncated", data[:len(data) // 2])
    v = bytearray(data)
    struct.pack_into("<I", v, 8, core.LAYOUT_VERSION + 98)
    put("version", bytes(v))
    v = bytearray(data)
    v[200] ^= 0xFF                                  # inside the checksummed header
    put("checksum", bytes(v))
    made["missing"] = unique("missing")
    return made


def test_bad_segments_give_one_line_and_exit_2(shmkv_cli, names, capsys):
    bad = _bad_segments(names)
    # the full matrix in-process (fast) ...
    for kind, n in bad.items():
        for argv in (["info", n], ["seqs", n], ["blocks", n], ["procs", n], ["check", n],
                     ["check", "--repair", n], ["recover", n], ["top", n, "-n", "1"],
                     ["metrics", n]):
            rc = cli.main(argv)
            cap = capsys.readouterr()
            assert rc == 2, (kind, argv, cap)
            lines = cap.err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith(f"shmkv: {n}"), (kind, argv, cap.err)
            assert cap.out == ""
    # ... and each kind once as a real process (no traceback, right words)
    assert "not a shmkv segment" in fail_line(shmkv_cli("info", bad["garbage"]), bad["garbage"])
    assert "not a shmkv segment" in fail_line(shmkv_cli("seqs", bad["empty"]), bad["empty"])
    assert "too small" in fail_line(shmkv_cli("seqs", bad["magiconly"]), bad["magiconly"])
    assert "corrupt" in fail_line(shmkv_cli("blocks", bad["truncated"]), bad["truncated"])
    line = fail_line(shmkv_cli("procs", bad["version"]), bad["version"])
    assert "incompatible" in line and f"version {core.LAYOUT_VERSION + 98}" in line
    assert "corrupt" in fail_line(shmkv_cli("check", bad["checksum"]), bad["checksum"])
    assert "no such segment" in fail_line(shmkv_cli("recover", bad["missing"]), bad["missing"])

    # ls: shmkv-looking files are listed with their state, foreign files only with --all
    rows = {r["name"]: r for r in shmkv_cli.json("ls", "shmkv-test-cli-*")
            if r["name"] in bad.values()}
    assert rows[bad["truncated"]]["state"] == "corrupt"
    assert rows[bad["checksum"]]["state"] == "corrupt"
    assert rows[bad["magiconly"]]["state"] == "corrupt"
    assert rows[bad["version"]]["state"] == "incompatible"
    assert bad["garbage"] not in rows and bad["empty"] not in rows
    everything = {r["name"]: r for r in shmkv_cli.json("ls", "--all", "shmkv-test-cli-*")}
    assert everything[bad["garbage"]]["state"] == "not-shmkv"
    r = shmkv_cli("ls", bad["truncated"], bad["version"])
    assert r.returncode == 0 and "corrupt" in r.stdout and "incompatible" in r.stdout

    # rm: a foreign file needs --force; broken shmkv files nobody holds go with --stale
    r = shmkv_cli("rm", bad["garbage"])
    assert r.returncode == 1 and "not a shmkv segment" in r.stderr
    assert shmkv_cli("rm", "--force", bad["garbage"]).returncode == 0
    assert not os.path.exists(f"/dev/shm/{bad['garbage']}")
    gone = {r["name"] for r in shmkv_cli.json("rm", "--stale", bad["truncated"], bad["version"])}
    assert gone == {bad["truncated"], bad["version"]}
    assert not os.path.exists(f"/dev/shm/{bad['truncated']}")


# ======================================================================================
# metrics over HTTP
# ======================================================================================
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*"'
                     r'(,[a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*")*)\})? (\S+)$')


def parse_exposition(text):
    """{(metric, segment label): value}, after checking the 0.0.4 text format."""
    types, helps, samples = {}, set(), {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helps.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, metric, typ = line.split()
            types[metric] = typ
        else:
            m = _SAMPLE.match(line)
            assert m, f"bad sample line {line!r}"
            metric = m.group(1)
            assert metric in types and metric in helps, metric
            seg = re.search(r'segment="([^"]*)"', line).group(1)
            key = (metric, seg) if "policy=" not in line else (metric, seg, line)
            samples[key] = float(m.group(7))
    for metric, typ in types.items():
        assert typ in ("counter", "gauge")
        assert metric.endswith("_total") == (typ == "counter"), metric
        assert metric.startswith("shmkv_")
    return samples


def test_metrics_scraped_over_http(tmp_path, names):
    name = unique("metrics")
    names.append(name)
    cache = shmkv.KVCache.create(name, shmkv.CacheConfig(**TINY, num_blocks=64, max_seqs=16))
    try:
        sid = cache.create_sequence()
        k = np.ones((2, 9, 2, 8), np.float16)
        cache.append(sid, k, k)
        child = cache.fork(sid)
        cache.append(child, k[:, :1], k[:, :1])
        st = cache.stats()
        proc = subprocess.Popen([sys.executable, "-m", "shmkv", "metrics", name, "--listen",
                                 "127.0.0.1:0", "--once"], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = readline_with(proc.stderr, "/metrics")
            m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
            assert m, line
            base = f"http://127.0.0.1:{m.group(1)}"
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + "/nope", timeout=10)
            assert e.value.code == 404
            with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                body = resp.read().decode()
            assert proc.wait(timeout=15) == 0          # --once: gone after one scrape
            assert "Traceback" not in proc.stderr.read()
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        s = parse_exposition(body)
        assert s[("shmkv_up", name)] == 1
        assert s[("shmkv_blocks_used", name)] == st["used_blocks"] == 4
        assert s[("shmkv_blocks_free", name)] == st["free_blocks"]
        assert s[("shmkv_blocks_shared", name)] == 2
        assert s[("shmkv_sequences", name)] == 2
        assert s[("shmkv_processes", name)] == 1
        assert s[("shmkv_allocations_total", name)] == st["allocations"]
        assert s[("shmkv_forks_total", name)] == 1
        assert s[("shmkv_cow_copies_total", name)] == st["cow_copies"] == 1
        assert s[("shmkv_appended_tokens_total", name)] == 10
        assert s[("shmkv_blocks_capacity", name)] == 64
    finally:
        cache.close()


def test_metrics_on_stdout_and_a_vanished_segment(shmkv_cli, names):
    name = unique("metrics2")
    names.append(name)
    shmkv.KVCache.create(name, shmkv.CacheConfig(**TINY, num_blocks=32, max_seqs=8)).close()
    r = shmkv_cli("metrics", name)
    assert r.returncode == 0
    s = parse_exposition(r.stdout)
    assert s[("shmkv_blocks_free", name)] == 32 and s[("shmkv_processes", name)] == 0
    unlink(name)
    fail_line(shmkv_cli("metrics", name), name)                  # missing at start: exit 2
    # a segment that vanishes between scrapes reads as shmkv_up 0, not an error
    assert "shmkv_up{segment=\"" + name + "\"} 0" in cli.exposition([name])


# ======================================================================================
# create
# ======================================================================================
def test_create_from_preset_and_memory(shmkv_cli, names):
    name = unique("create")
    names.append(name)
    made = shmkv_cli.json("create", name, "--preset", "llama3-8b", "--memory", "64MiB")
    cfg = made["config"]
    assert (cfg["num_layers"], cfg["num_kv_heads"], cfg["head_dim"], cfg["dtype"],
            cfg["block_size"]) == (32, 8, 128, "float16", 16)
    per_block = 2 * 32 * 8 * 128 * 2 * 16
    assert made["bytes_per_block"] == per_block and cfg["num_blocks"] == 64 * 2 ** 20 // per_block
    snap = snapshot(name)
    assert snap["config"] == shmkv.CacheConfig(**cfg)
    assert snap["processes"] == [] and snap["sequences"] == []     # the CLI let go of it
    assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600

    line = fail_line(shmkv_cli("create", name, "--preset", "tiny"), name)
    assert "exists" in line
    other = unique("create2")
    names.append(other)
    r = shmkv_cli("create", other, "--layers", 0, "--kv-heads", 2, "--head-dim", 8,
                  "--blocks", 8)
    assert r.returncode == 2 and "num_layers" in r.stderr
    r = shmkv_cli("create", other, "--preset", "llama3-8b")
    assert r.returncode == 2 and "--memory" in r.stderr
    r = shmkv_cli("create", other, "--preset", "llama3-8b", "--memory", "1KiB")
    assert r.returncode == 2 and "holds no block" in r.stderr
    r = shmkv_cli("create", other, "--preset", "tiny", "--memory", "lots")
    assert r.returncode == 2 and "size" in r.stderr
    assert not os.path.exists(f"/dev/shm/{other}")
    r = shmkv_cli("create", other, "--layers", 3, "--kv-heads", 1, "--head-dim", 4,
                  "--blocks", 10, "--block-size", 2, "--dtype", "float32", "--max-seqs", 5,
                  "--max-procs", 7, "--mode", "640")
    assert r.returncode == 0 and f"created {other}" in r.stdout
    assert snapshot(other)["config"] == shmkv.CacheConfig(
        num_layers=3, num_kv_heads=1, head_dim=4, num_blocks=10, block_size=2,
        dtype="float32", max_seqs=5, max_procs=7)
    assert os.stat(f"/dev/shm/{other}").st_mode & 0o777 == 0o640


# ======================================================================================
# pure helpers: torn values, parsers
# ======================================================================================
def test_analyze_tolerates_torn_and_corrupt_values():
    """A snapshot taken mid-change may hold block ids out of range, a length past the
    table, a refcount that disagrees with the tables: numbers, never an exception."""
    cfg = shmkv.CacheConfig(**TINY, num_blocks=8, max_seqs=4)
    rc = np.array([1, 2, 0, 0, 5, 0, 1, 0], np.uint32)
    seq = dict(sid=4, slot=0, len=10 ** 6, nblocks=99, owner_token=(1 << 32) | 1,
               owner_pid=123, detached=False, owner_alive=False, writer_token=0,
               writer_alive=None, priority=0, hashed=0, created_ns=0, last_access_ns=0,
               access_count=0, consistent=False,
               table=np.array([0, 1, -1, 2 ** 31 - 1, 1, 7], np.int32))
    snap = dict(config=cfg, ref_cnt=rc, block_flags=np.zeros(8, np.uint32),
                processes=[dict(slot=0, pid=123, pid_start=0, gen=1, attach_time_ns=0,
                                alive=False, inflight=[4, 99, 2 ** 32 - 1])],
                sequences=[seq, dict(seq, sid=5, detached=True, owner_token=0,
                                     owner_alive=None, table=np.array([], np.int32))])
    v = cli.analyze(snap)
    b = v["blocks"]
    assert b["free"] + b["cached"] + b["owned"] + b["shared"] == 8
    assert v["seqs"][0]["blocks"] == 4 and v["seqs"][0]["owner"] == "dead"
    assert v["seqs"][1]["owner"] == "detached"
    assert v["dead"]["sequences"] == 1 and v["dead"]["pids"] == [123]
    assert v["procs"][0]["inflight"] == [4]


def test_parsers():
    assert cli.parse_size("8GiB") == 8 * 2 ** 30
    assert cli.parse_size("512M") == 512 * 2 ** 20
    assert cli.parse_size("1.5GB") == 1_500_000_000
    assert cli.parse_size("4096") == 4096
    for bad in ("", "GiB", "-1G", "8 parsecs", "nanG"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.parse_size(bad)
    assert cli.parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert cli.parse_listen("[::1]:9464") == ("::1", 9464)
    for bad in ("9464", ":9464", "host:port", "h:70000"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.parse_listen(bad)
    assert cli.seg_name("/dev/shm/abc") == "abc" == cli.seg_name("/abc") == cli.seg_name("abc")
    with pytest.raises(argparse.ArgumentTypeError):
        cli.seg_name("a/b")


def test_json_flag_before_the_command(shmkv_cli, names):
    name = unique("flag")
    names.append(name)
    shmkv.KVCache.create(name, shmkv.CacheConfig(**TINY, num_blocks=16, max_seqs=4)).close()
    r = shmkv_cli("--json", "info", name)
    assert r.returncode == 0 and json.loads(r.stdout)["name"] == name
    r = shmkv_cli("--color", "always", "ls", name)
    assert r.returncode == 0 and "\x1b[" in r.stdout


def test_permission_denied_and_a_segment_that_vanishes(monkeypatch, capsys, names):
    def denied(name, tables=True):
        raise PermissionError(f"segment {name!r}: permission denied")

    monkeypatch.setattr(shmkv_inspect, "snapshot", denied)
    assert cli.main(["info", "someone-elses"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "permission denied" in err[0]
    monkeypatch.undo()

    # top keeps reading; when the segment goes away it says so in one line, exit 2
    name = unique("vanish")
    names.append(name)
    shmkv.KVCache.create(name, shmkv.CacheConfig(**TINY, num_blocks=16, max_seqs=4)).close()
    real, calls = snapshot, []

    def vanishing(n, tables=True):
        calls.append(n)
        if len(calls) == 3:
            unlink(name)
        return real(n, tables=tables)

    monkeypatch.setattr(shmkv_inspect, "snapshot", vanishing)
    assert cli.main(["top", name, "--iterations", "5", "--interval", "0.01"]) == 2
    cap = capsys.readouterr()
    assert cap.out.count(f"shmkv top {name}") == 1
    assert cap.err.strip().splitlines() == [
        f"shmkv: {name}: no such segment (/dev/shm/{name} does not exist; "
        "`shmkv ls` lists segments)"]
