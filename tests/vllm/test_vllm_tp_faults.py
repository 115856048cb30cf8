"""Tensor parallel faults at the connector's worker (a cache never stops the engine): three
ranks of one engine (SmolLM2's 3 KV heads, one per rank), each a process with vLLM's own
distributed setup and the real connector in the WORKER role, driven as vLLM's runner drives
it (tp_worker.py).  Nothing raises into vLLM on any rank, no rank waits for another in a
collective that never comes, nothing a failed save touched is published, and no sequence or
block is left held.

- one rank's registration fails alone: every rank turns the connector off (the all-ranks
  vote);
- a fork fails in a save (no room for a third sequence): the earlier fork is freed, the
  save is dropped and counted;
- rank 0's commit times out (``LockTimeout``): nothing is published, the forks and the
  sequence are freed, the error is counted;
- and a clean save of the same setup publishes, for contrast."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import unique_name
from vllm_helpers import VB, needs_vllm

pytestmark = needs_vllm

HERE = os.path.dirname(os.path.abspath(__file__))
TP = 3


SCENARIOS = ("clean", "commit", "fork", "vote")     # tp_worker.py's, in its order


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every scenario, run by TP rank processes at once (vLLM started once per rank);
    ``{scenario: [answer of rank 0, 1, 2]}``."""
    import shmkv
    from shmkv.pending import unlink_pending

    prefix = unique_name("vllm-tpf")
    init = tmp_path_factory.mktemp("tp-faults") / "rendezvous"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "tp_worker.py"), str(r),
                               str(TP), str(init), prefix], cwd=HERE, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(TP)]
    try:
        outs = []
        for p in procs:
            # a bound for a hang (a rank left in a collective), not a timing assertion
            so, se = p.communicate(timeout=500)
            assert p.returncode == 0, (p.returncode, se[-4000:])
            outs.append(json.loads(so.strip().splitlines()[-1]))
        yield {s: sorted((o[s] for o in outs), key=lambda a: a["rank"]) for s in SCENARIOS}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s in SCENARIOS:
            try:
                shmkv.KVCache.attach(f"{prefix}-{s}").unlink()
            except FileNotFoundError:
                pass
            unlink_pending(f"{prefix}-{s}")


def _nothing_held(seg: dict) -> None:
    assert seg["hit"] == 0, seg                 # nothing of the failed save is findable
    assert seg["sequences"] == 0 and seg["used_blocks"] == 0, seg   # nor left held
    assert seg["check"] == [], seg


def test_one_rank_failing_its_registration_turns_every_rank_off(ranks):
    outs = ranks["vote"]
    assert [(o["save_on"], o["load_on"], o["layout"]) for o in outs] == [(False,) * 3] * TP


def test_a_failed_fork_frees_the_earlier_forks_and_drops_the_save(ranks):
    outs = ranks["fork"]
    assert all(o["save_on"] for o in outs)
    assert outs[0]["stats"]["save_errors"] == 1
    assert all(o["stats"]["saved_tokens"] == 0 for o in outs)
    _nothing_held(outs[0]["segment"])


def test_a_commit_that_times_out_publishes_nothing_and_frees_everything(ranks):
    outs = ranks["commit"]
    assert outs[0]["stats"]["save_errors"] == 1 and outs[0]["stats"]["saved_tokens"] == 0
    _nothing_held(outs[0]["segment"])


def test_a_clean_save_with_three_ranks_publishes(ranks):
    outs = ranks["clean"]
    assert all(o["stats"] == {"saved_tokens": 2 * VB, "save_errors": 0} for o in outs), outs
    seg = outs[0]["segment"]
    assert seg["hit"] == 2 * VB and seg["sequences"] == 0 and seg["check"] == [], seg
