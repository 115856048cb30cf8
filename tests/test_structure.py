"""The split of the Cython layer into modules: one set of debug switches for every copy of
the static kernels, the names tools read from shmkv._core, the typed user script."""
import multiprocessing as mp
import os
import runpy
import sys

import numpy as np
import pytest
from support import unique_name, unlink_segment
from workers import struct_workers

import shmkv
import shmkv._core as _core
import shmkv._inspect as _inspect
from shmkv import _attention, _bench
from shmkv.inspect import snapshot, struct_layout

ctx = mp.get_context("spawn")

# (crash point, operation): each operation is a method of another module than _core
CASES = [("create_mid", "create"), ("fork_mid", "fork"), ("free_mid", "free"),
         ("append_before_publish", "append"), ("gather_mid", "gather"),
         ("trim_mid", "trim"), ("publish_mid", "commit"), ("recover_mid", "recover"),
         ("reset_mid", "reset"), ("truncate_mid", "truncate")]


def _run_worker(cache, procs, point, op, disarm=False):
    p = ctx.Process(target=struct_workers.die_in,
                    args=(cache.name, point, op, disarm))
    p.start()
    procs.append(p)
    p.join(timeout=60)
    return p.exitcode


@pytest.mark.slow
@pytest.mark.parametrize("point,op", CASES)
def test_crash_point_armed_in_core_fires_in_sibling(cache, procs, point, op):
    """set_crash_point writes _core's switches; the kernel that passes the point runs in
    the module of the method (_sequences, _kvdata, _prefix, _inspect, _events), whose copy of the
    kernels reads them through its shmkv_dbg pointer, bound to _core's at import."""
    assert _run_worker(cache, procs, point, op) == 86, f"{point} did not fire in {op}"
    cache.recover()
    assert cache.check() == []


@pytest.mark.slow
def test_disarmed_crash_point_does_not_fire(cache, procs):
    assert _run_worker(cache, procs, "free_mid", "free", disarm=True) == 0
    cache.recover()
    assert cache.check() == []


def test_planted_bug_reaches_sibling(cache):
    """plant_bug (in _core) switches the free kernels that _sequences runs."""
    cfg = cache.config
    sid = cache.create_sequence()
    cache.reserve(sid, 2 * cfg.block_size)
    _core.plant_bug("leak_on_free")
    try:
        cache.free(sid)
    finally:
        _core.plant_bug(None)
    assert any("leaked" in line or "ref_cnt" in line for line in cache.check())
    cache.recover(full=True)                   # nothing died: only the full pass recounts
    assert cache.check() == []
    sid = cache.create_sequence()              # and off again: a free frees everything
    cache.reserve(sid, 2 * cfg.block_size)
    cache.free(sid)
    assert cache.check() == []
    assert cache.stats()["used_blocks"] == 0


def test_method_chain():
    """One class chain, so a method call is one Python -> C transition."""
    chain = [c.__module__ + "." + c.__qualname__ for c in shmkv.KVCache.__mro__]
    assert chain == ["shmkv.cache.KVCache", "shmkv._kvdata.DataOps", "shmkv._quant.QuantOps",
                     "shmkv._sequences.SequenceOps", "shmkv._prefix.PrefixOps",
                     "shmkv._inspect.InspectOps", "shmkv._core.Segment", "builtins.object"]
    assert "reserve" not in shmkv.KVCache.__dict__        # inherited as is


def test_hooks_live_in_their_own_modules():
    """The benchmark and test hooks are shmkv._bench's, not the shipped modules'; the
    read-only inspection is shmkv.inspect's; _core forwards no name to a sibling."""
    assert snapshot is _inspect.snapshot
    assert struct_layout is _inspect.struct_layout
    hooks = ("bench_alloc_free", "bench_memcpy", "bench_append_rows", "bench_fma", "bench_read")
    for name in hooks:
        assert callable(getattr(_bench, name))
        for mod in (_core, _inspect, _attention):
            assert not hasattr(mod, name), (mod.__name__, name)
    for name in ("snapshot", "struct_layout", "empty_gather_buffers", "__getattr__", "_MOVED"):
        assert not hasattr(_core, name), name


def test_typed_api_script_runs():
    """tests/typecheck/api_usage.py (checked by mypy --strict in make lint) works."""
    name = unique_name("api")
    path = os.path.join(os.path.dirname(__file__), "typecheck", "api_usage.py")
    argv = sys.argv
    sys.argv = [path, name]
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = argv
        unlink_segment(name)
    with pytest.raises(FileNotFoundError):             # the script unlinked it itself
        shmkv.KVCache.attach(name)


def test_typed_api_script_catches_a_wrong_result(monkeypatch):
    """The script's checks can fail: a gather that returns other data is caught."""
    path = os.path.join(os.path.dirname(__file__), "typecheck", "api_usage.py")
    mod = runpy.run_path(path)
    real = shmkv.KVCache.gather

    def wrong(self, sid, start=None, stop=None, *, out=None):
        k, v = real(self, sid, start, stop, out=out)
        return k, np.zeros_like(v)

    monkeypatch.setattr(shmkv.KVCache, "gather", wrong)
    name = unique_name("api")
    try:
        with pytest.raises(AssertionError):
            mod["main"](name)
    finally:
        unlink_segment(name)
