"""A step whose forward did not complete publishes nothing.

vLLM 0.32 calls the connector's ``wait_for_save`` from the ``finally:`` of its step
(``_get_kv_connector_output``), so also when the forward raised: a SIGTERM turned into
SystemExit in a worker, a KeyboardInterrupt, an error in a layer.  The step's vLLM blocks
then hold the K/V of the layers that ran and stale bytes in the others, under the right
token hashes: published, every instance would load them as hits.  A connector worker is
driven here as vLLM's runner drives it (the real model's config, real KV tensors, vLLM's
``save_kv_layer`` after each attention layer, ``wait_for_save`` in a ``finally``), without
an engine: a complete step publishes, a step that stopped half-way through its layers or
raised publishes nothing, and the connector counts it."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from support import unique_name
from vllm_helpers import VB, runner_step, runner_worker

try:
    import vllm  # noqa: F401
    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")


@pytest.fixture()
def worker():
    with runner_worker(unique_name("vllm-unfinished")) as w:
        yield w


def _step(w, names, ops, layers_done, raise_exc=None):
    runner_step(w, names, ops, layers_done, raise_exc)


def _hit(w, tokens, salt):
    return w.connector_worker._kv.match_prefix(np.append(tokens, 0), salt)


def test_a_forward_that_did_not_finish_publishes_nothing(worker):
    from shmkv.integrations.vllm import request_salt
    from shmkv.integrations.vllm.connector import SaveOp

    w, names, path = worker
    salt = request_salt(path)
    rng = np.random.default_rng(5)
    toks = [rng.integers(1, 30000, VB, dtype=np.int32) for _ in range(4)]
    ops = [SaveOp(f"r{i}", t, salt, [i + 1]) for i, t in enumerate(toks)]
    # a complete step publishes
    _step(w, names, ops[:1], len(names))
    assert _hit(w, toks[0], salt) == VB
    # half of the layers ran, the rest raised (SystemExit: SIGTERM in a TP worker)
    _step(w, names, ops[1:2], len(names) // 2, SystemExit(143))
    assert _hit(w, toks[1], salt) == 0
    # every layer ran, then the step raised (the sampler, a KeyboardInterrupt)
    _step(w, names, ops[2:3], len(names), KeyboardInterrupt())
    assert _hit(w, toks[2], salt) == 0
    # half of the layers reported, no exception seen (a forward cut short another way)
    _step(w, names, ops[3:4], len(names) // 2)
    assert _hit(w, toks[3], salt) == 0
    stats = w.connector_worker.stats
    assert stats["unfinished_saves"] == 3 and stats["saved_tokens"] == VB, stats
    assert stats["save_errors"] == 0
    # and the next complete step publishes again
    _step(w, names, ops[1:2], len(names))
    assert _hit(w, toks[1], salt) == VB
    assert w.connector_worker._kv.check() == []


def test_a_runner_that_never_reports_layers_still_saves(worker):
    """A vLLM whose runner does not call save_kv_layer (the hook is per attention op):
    the exception check alone decides."""
    from shmkv.integrations.vllm import request_salt
    from shmkv.integrations.vllm.connector import SaveOp

    w, names, path = worker
    salt = request_salt(path)
    t = np.arange(1, VB + 1, dtype=np.int32)
    _step(w, names, [SaveOp("r", t, salt, [2])], 0, RuntimeError("in a layer"))
    assert _hit(w, t, salt) == 0
    _step(w, names, [SaveOp("r", t, salt, [2])], 0)
    assert _hit(w, t, salt) == VB


class _TermMidCopy:
    """The worker's layout, whose copy sends this process SIGTERM before layer ``at``."""

    def __init__(self, layout, at: int) -> None:
        self._real, self._at, self.calls = layout, at, 0

    def __getattr__(self, name):
        return getattr(self._real, name)

    def copy(self, *args, **kwargs):
        if self.calls == self._at:
            os.kill(os.getpid(), signal.SIGTERM)
        self.calls += 1
        return self._real.copy(*args, **kwargs)


def test_a_sigterm_inside_the_saves_copy_publishes_nothing(worker):
    """The other point of a step: SIGTERM lands while ``wait_for_save`` copies the blocks
    of a forward that completed.  vLLM's workers turn it into SystemExit (their handler,
    as here), raised in the middle of the copy: it leaves the save before ``commit``, the
    sequence it reserved is freed, nothing of it is findable, and SystemExit goes on to
    stop the worker."""
    from shmkv.integrations.vllm import request_salt
    from shmkv.integrations.vllm.connector import SaveOp

    w, names, path = worker
    salt = request_salt(path)
    t = np.arange(7, VB + 7, dtype=np.int32)
    real = w.connector_worker._layout
    w.connector_worker._layout = term = _TermMidCopy(real, len(names) // 2)

    def as_vllm(signum, frame):                 # vLLM's worker: SIGTERM -> SystemExit
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, as_vllm)
    try:
        with pytest.raises(SystemExit):
            runner_step(w, names, [SaveOp("r", t, salt, [1])], len(names))
    finally:
        signal.signal(signal.SIGTERM, old)
        w.connector_worker._layout = real
    assert term.calls == len(names) // 2            # it stopped half-way through the layers
    assert _hit(w, t, salt) == 0
    kv = w.connector_worker._kv
    assert kv.stats()["num_sequences"] == 0 and kv.check() == []
    runner_step(w, names, [SaveOp("r", t, salt, [1])], len(names))   # and later: saved
    assert _hit(w, t, salt) == VB


def test_between_unregister_and_restore_of_the_kv_caches_nothing_is_copied(worker):
    """vLLM 0.34's sleep hooks: after ``unregister_kv_caches`` a save publishes nothing and
    a planned load is reported failed (vLLM recomputes it) -- no copy touches the tensors --
    until ``restore_kv_caches``; then both copy again, the same bytes.  Both idempotent."""
    import torch

    from shmkv.integrations.vllm import request_salt
    from shmkv.integrations.vllm.connector import LoadOp, SaveOp

    w, names, path = worker
    salt = request_salt(path)
    rng = np.random.default_rng(11)
    a, b = (rng.integers(1, 30000, VB, dtype=np.int32) for _ in range(2))
    tensors = [t for t, _, _ in w.connector_worker._layers]
    _step(w, names, [SaveOp("a", a, salt, [1])], len(names))
    assert _hit(w, a, salt) == VB
    w.unregister_kv_caches()
    w.unregister_kv_caches()
    before = [t.clone() for t in tensors]
    runner_step(w, names, [SaveOp("b", b, salt, [2])], len(names),
                loads=[LoadOp("a2", np.append(a, 0), salt, 0, VB, [5])])
    assert _hit(w, b, salt) == 0                                # not saved
    assert w.get_block_ids_with_load_errors() == {5}            # not loaded: recomputed
    assert all(torch.equal(x, y) for x, y in zip(tensors, before))
    assert w.connector_worker.stats["save_errors"] == 0
    w.restore_kv_caches()
    w.restore_kv_caches()
    runner_step(w, names, [SaveOp("b", b, salt, [2])], len(names),
                loads=[LoadOp("a2", np.append(a, 0), salt, 0, VB, [5])])
    assert _hit(w, b, salt) == VB
    assert w.get_block_ids_with_load_errors() == set()
    assert all(torch.equal(t[5], t[1]) for t in tensors)        # block 1's bytes, loaded
    assert w.connector_worker._kv.check() == []
