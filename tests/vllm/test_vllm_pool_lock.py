"""A process stopped while it holds the segment's pool lock (Ctrl-Z, a debugger, ``docker
pause``) costs a serving engine's steps a bound, not a freeze.

The connector's worker is driven here as vLLM's runner drives it (the real model's config,
real KV tensors, loads in ``start_load_kv``, saves in ``wait_for_save``) beside a real
process stopped inside the pool lock (a crash point in "stop" mode in its
``create_sequence``).  Once the engine serves, each call waits at most ``lock_timeout``
(0.1 s) and, after a wait ran out, none for a second: the step's loads are reported failed
(vLLM recomputes them), its saves dropped, all of it counted, with one warning; a sequence
it could not free is freed by a later step; the holder dead, the next step publishes.  (A
real engine beside such a holder: test_vllm_engine_faults.py.)"""
from __future__ import annotations

import logging
import subprocess
import time

import numpy as np
import pytest
from support import unique_name
from support.stopped_helpers import POOL_LOCK_HOLDER, end, start_stopped
from vllm_helpers import VB, needs_vllm, runner_step, runner_worker

pytestmark = needs_vllm

@pytest.fixture()
def worker():
    with runner_worker(unique_name("vllm-pool-lock")) as w:
        yield w


@pytest.fixture()
def stopped_holder():
    """Starts a process stopped inside the pool lock of a segment; killed by its pid."""
    procs: list[subprocess.Popen] = []
    try:
        yield lambda seg: start_stopped(POOL_LOCK_HOLDER, seg, procs=procs)
    finally:
        for p in procs:
            end(p)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_stopped_pool_lock_holder_costs_a_worker_step_a_bound(worker, stopped_holder):
    from shmkv.integrations.vllm import request_salt
    from shmkv.integrations.vllm.metadata import LoadOp, SaveOp

    w, names, path = worker
    kv = w.connector_worker._kv
    assert kv.lock_timeout == pytest.approx(0.1) and kv.lock_backoff == 1.0
    salt = request_salt(path)
    rng = np.random.default_rng(11)
    toks = [rng.integers(1, 30000, VB, dtype=np.int32) for _ in range(3)]
    runner_step(w, names, [SaveOp("a", toks[0], salt, [1])], len(names))
    assert kv.match_prefix(np.append(toks[0], 0), salt) == VB
    pinned = kv.create_sequence(tokens=np.append(toks[0], 0), salt=salt)   # to free below
    lines = _Lines()
    logging.getLogger("vllm.shmkv").addHandler(lines)
    try:
        holder = stopped_holder(kv.name)
        t0 = time.monotonic()
        for i in range(4):
            # loads toks[0] into vLLM block 3, saves toks[1] from block 2
            runner_step(w, names, [SaveOp(f"b{i}", toks[1], salt, [2])], len(names),
                        loads=[LoadOp(f"c{i}", np.append(toks[0], 0), salt, 0, VB, [3])])
            assert w.get_block_ids_with_load_errors() == {3}, i   # recomputed by vLLM
        took = time.monotonic() - t0
        w.connector_worker._free(pinned)     # shares published blocks: needs the pool lock
        assert w.connector_worker._unfreed == [(pinned, False)]
    finally:
        logging.getLogger("vllm.shmkv").removeHandler(lines)
    # a hang detector: each call waited the segment's 10 s before the step's bound
    assert took < 8.0, f"4 steps took {took:.1f} s behind the stopped holder"
    c = w.connector_worker._iv.data["c"]
    assert c.get("lock_timeouts", 0) >= 8, c        # a load and a save a step, at least
    assert c.get("save_errors", 0) == 4 and c.get("load_failures", 0) == 4, c
    warned = [ln for ln in lines.lines if "pool lock was held past" in ln]
    assert len(warned) == 1 and kv.name in warned[0], lines.lines
    assert not [ln for ln in lines.lines if "failed" in ln], lines.lines   # no line a call
    # the holder dies where it stopped: the next step frees what waited, and publishes
    holder.kill()
    holder.wait(timeout=30)
    runner_step(w, names, [SaveOp("d", toks[2], salt, [2])], len(names))
    assert w.connector_worker._unfreed == []
    assert kv.match_prefix(np.append(toks[2], 0), salt) == VB
    assert kv.stats()["num_sequences"] == 0
    kv.lock_timeout = 10.0
    assert kv.check() == []
