"""Shared fixtures.  Every test gets unique segment names and every segment it makes is
unlinked, whatever happens; processes are ended by PID."""
import os

import pytest
from support import ISAS, SMALL, unique_name, unlink_segment

import shmkv
from shmkv import _attention

# The suite tests the installed package, never the source tree.
_HERE = os.path.dirname(os.path.abspath(__file__))
_SRC = os.path.join(os.path.dirname(_HERE), "src", "shmkv")
assert not os.path.abspath(shmkv.__file__).startswith(_SRC), (
    f"tests must run against the installed package, imported {shmkv.__file__}")


@pytest.fixture
def seg_name():
    """A unique segment name, unlinked at teardown."""
    name = unique_name()
    try:
        yield name
    finally:
        unlink_segment(name)


@pytest.fixture
def make_cache():
    """make_cache(**config_overrides) -> a fresh KVCache; closed and unlinked at teardown."""
    made = []

    def make(**kw):
        cfg = shmkv.CacheConfig(**{**SMALL, **kw})
        name = unique_name()
        made.append(name)
        cache = shmkv.KVCache.create(name, cfg)
        made.append(cache)
        return cache

    try:
        yield make
    finally:
        for x in made:
            if isinstance(x, str):
                unlink_segment(x)
            else:
                x.close()


@pytest.fixture
def cache(make_cache):
    return make_cache()


@pytest.fixture
def procs():
    """A list to put started processes in; each is joined, and killed by PID if it is
    still running at teardown."""
    started = []
    try:
        yield started
    finally:
        for p in started:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


@pytest.fixture
def spawn(procs):
    """spawn(target, *args) -> a started process of the "spawn" context; like every entry
    of `procs`, joined at teardown and killed by PID if still running.  spawn.ctx is the
    context (for Barrier, Event, ...)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")

    def start(target, *args):
        p = ctx.Process(target=target, args=args, daemon=True)
        p.start()
        procs.append(p)
        return p

    start.ctx = ctx
    return start


@pytest.fixture(params=ISAS)
def isa(request):
    """Each ISA path this CPU can run, forced on in turn."""
    before = _attention.isa()
    _attention._force_isa(request.param)
    try:
        yield request.param
    finally:
        _attention._force_isa(before)


@pytest.fixture(scope="module")
def cluster():
    """A Redis Cluster of 3 masters from Debian's redis-server on free loopback ports,
    started for a module and stopped after it (the tier tests: tests/test_tier.py,
    tests/vllm/test_vllm_tier.py, which skip or fail on a missing server themselves)."""
    from shmkv.tier.cluster import LocalCluster, free_ports

    c = LocalCluster(free_ports(3))
    c.start()
    try:
        yield c
    finally:
        c.stop()
