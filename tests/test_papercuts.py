"""Papercuts, each as a user meets it: numpy dtype objects in CacheConfig, a
negative --memory, "1 dead processes", the name's leading slash, and the transformers
integration imported without transformers."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support import SMALL, unique_name

import shmkv
from shmkv.cli import main as cli_main
from shmkv.cli.common import held_by_dead, plural
from shmkv.cli.reader import dead_hint


# ---- CacheConfig(dtype=np.float16) ----------------------------------------------------------
@pytest.mark.parametrize("given, name", [
    (np.float16, "float16"), (np.float32, "float32"), (np.int8, "int8"),
    (np.dtype("float16"), "float16"), (np.dtype(np.float32), "float32"),
    ("float16", "float16"),
])
def test_dtype_objects_are_taken_as_their_name(given, name):
    cfg = shmkv.CacheConfig(**{**SMALL, "dtype": given})
    assert cfg.dtype == name and isinstance(cfg.dtype, str)
    assert cfg == shmkv.CacheConfig(**{**SMALL, "dtype": name})
    assert cfg.numpy_dtype == np.dtype(name)


def test_ml_dtypes_objects():
    ml_dtypes = pytest.importorskip("ml_dtypes")   # the bf16 extra; .venv has it
    assert shmkv.CacheConfig(**SMALL, dtype=ml_dtypes.bfloat16).dtype == "bfloat16"
    assert shmkv.CacheConfig(**SMALL, dtype=ml_dtypes.float8_e4m3fn).dtype == "float8_e4m3"


@pytest.mark.parametrize("bad", [np.float64, np.dtype("int16"), "f2", "float64", 3.5, None])
def test_unsupported_dtype_names_expected_and_got(bad):
    with pytest.raises(ValueError) as e:
        shmkv.CacheConfig(**SMALL, dtype=bad)
    msg = str(e.value)
    assert msg.startswith("dtype: expected one of ") and "'float16'" in msg
    assert f"got {bad!r}" in msg


def test_dtype_object_config_round_trips_through_the_segment(seg_name):
    cfg = shmkv.CacheConfig(**SMALL, dtype=np.float16)
    with shmkv.KVCache.create(seg_name, cfg) as c:
        with shmkv.KVCache.attach(seg_name) as a:
            assert a.config == cfg and a.config.dtype == "float16"
        c.unlink()


# ---- shmkv create --memory -1GiB --------------------------------------------------------------
@pytest.mark.parametrize("value", ["-1GiB", "-0.5G", "-1"])
def test_negative_memory_gets_the_size_check_not_argparse(value, capsys):
    name = unique_name("mem")
    rc = cli_main(["create", name, "--preset", "tiny", "--memory", value])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"expected a positive size, got {value!r}" in err, err
    assert "expected one argument" not in err
    assert not os.path.exists("/dev/shm/" + name)


def test_option_values_and_plain_arguments_are_left_alone():
    from shmkv.cli.entry import _join_negative_values, build_parser

    p = build_parser()
    assert _join_negative_values(p, ["create", "x", "--memory", "-1GiB"]) == \
        ["create", "x", "--memory=-1GiB"]
    # a flag (no value) is not joined with what follows; nor anything after "--"
    assert _join_negative_values(p, ["seqs", "x", "--dead", "-1"]) == ["seqs", "x", "--dead", "-1"]
    assert _join_negative_values(p, ["create", "--", "--memory", "-1"]) == \
        ["create", "--", "--memory", "-1"]


# ---- "1 dead processes" -----------------------------------------------------------------------
def test_plural():
    assert plural(0, "dead process") == "0 dead processes"
    assert plural(1, "dead process") == "1 dead process"
    assert plural(2, "sequence") == "2 sequences"
    assert plural(1, "block") == "1 block"
    assert held_by_dead([7]) == "held by a dead process (pid 7)"
    assert held_by_dead([7, 9]) == "held by dead processes (pid 7, 9)"


def test_dead_hint_agrees_with_its_counts():
    one = dead_hint("seg", dict(sequences=1, blocks=1, processes=1, pids=[42]))
    assert one.startswith("1 sequence / 1 block held by a dead process (pid 42)")
    two = dead_hint("seg", dict(sequences=3, blocks=5, processes=2, pids=[42, 43]))
    assert two.startswith("3 sequences / 5 blocks held by dead processes (pid 42, 43)")


def test_procs_line_with_one_live_process(capsys, seg_name):
    with shmkv.KVCache.create(seg_name, shmkv.CacheConfig(**SMALL)):
        assert cli_main(["procs", seg_name]) == 0
    out = capsys.readouterr().out
    assert "1 live, 0 dead processes" in out


# ---- cache.name: no leading slash, as the CLI shows it ----------------------------------------
def test_name_is_shown_as_given_without_the_slash(seg_name, capsys):
    with shmkv.KVCache.create("/" + seg_name, shmkv.CacheConfig(**SMALL)) as c:
        assert c.name == seg_name
        assert repr(c).startswith(f"<KVCache {seg_name!r}")
        with shmkv.KVCache.attach(seg_name) as a, shmkv.KVCache.attach("/" + seg_name) as b:
            assert a.name == b.name == seg_name
        assert cli_main(["ls", "--json"]) == 0
        names = [r["name"] for r in json.loads(capsys.readouterr().out)]
        assert c.name in names                         # the CLI's spelling is the handle's
        c.unlink()                                     # unlink still finds the POSIX name
        assert not os.path.exists("/dev/shm/" + seg_name)


# ---- the transformers integration without transformers ----------------------------------------
_WITHOUT = textwrap.dedent("""
    import importlib.abc, sys
    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == {hide!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
    sys.meta_path.insert(0, Hide())
    try:
        import shmkv.integrations.transformers
    except ImportError as e:
        print("ImportError:", e)
    else:
        print("imported")
""")


@pytest.mark.parametrize("hide", ["transformers", "torch"])
def test_integration_without_its_extra_names_the_extra(hide):
    r = subprocess.run([sys.executable, "-c", _WITHOUT.format(hide=hide)], cwd="/",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip()
    assert out.startswith("ImportError: shmkv.integrations.transformers needs " + hide), out
    assert 'pip install "shmkv[' in out and "does not import here" in out
