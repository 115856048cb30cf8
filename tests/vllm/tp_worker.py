"""One tensor-parallel rank of a vLLM worker's connector, driven as vLLM's model runner
drives it (test_vllm_tp_faults.py): vLLM's own distributed setup (gloo, its TP group), the
real ``ShmkvConnector`` in the WORKER role with real KV tensors of this rank's heads,
``register_kv_caches``, then one step: metadata bound, ``save_kv_layer`` after each
attention layer, ``wait_for_save`` in a ``finally``.

argv: rank, world size, the rendezvous file, a segment name prefix.  Every scenario runs,
in turn, with a connector of its own on segment ``PREFIX-SCENARIO``:

- ``vote``: rank 1's registration fails (its layout self-test raised): every rank must turn
  the connector off, none left waiting for it in a collective;
- ``fork``: the segment has room for 2 sequences, a save with TP=3 needs 3 (the sequence,
  one fork per other rank): rank 0's second fork fails;
- ``commit``: rank 0's commit raises ``LockTimeout`` (a stopped holder of the pool lock);
- ``clean``: a save that goes through.

Prints one JSON line, by scenario: this rank's connector state, its counters, and (rank 0,
after every rank is done) what the segment holds.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np


class _CommitTimesOut:
    """The segment as rank 0 sees it, except that ``commit`` times out on the pool lock."""

    def __init__(self, kv) -> None:
        self._real = kv

    def __getattr__(self, name):
        return getattr(self._real, name)

    def commit(self, sid):
        import shmkv
        raise shmkv.LockTimeout("the pool lock stayed held past lock_timeout (a stopped "
                                "process holds it)")


SCENARIOS = ("clean", "commit", "fork", "vote")


def main() -> None:
    rank, size, init, prefix = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    answers = os.fdopen(os.dup(1), "w")     # vLLM logs to stdout: keep this for the answer
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment
    from vllm.distributed.parallel_state import initialize_model_parallel

    outs = {}
    for i, scenario in enumerate(SCENARIOS):
        cfg = _config(f"{prefix}-{scenario}", size, scenario)
        with set_current_vllm_config(cfg):
            if i == 0:                      # vLLM's TP group, once for the process
                init_distributed_environment(world_size=size, rank=rank, local_rank=rank,
                                             distributed_init_method=f"file://{init}",
                                             backend="gloo")
                initialize_model_parallel(tensor_model_parallel_size=size)
            outs[scenario] = _run(cfg, rank, size, f"{prefix}-{scenario}", scenario)
    print(json.dumps(outs, default=str), file=answers, flush=True)


def _config(seg: str, size: int, scenario: str):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm_helpers import VB, _model_dir

    extra = {"segment": seg, "num_blocks": 256}
    if scenario == "fork":
        extra["max_seqs"] = 2
    return EngineArgs(model=_model_dir(), dtype="bfloat16", enforce_eager=True,
                      max_model_len=1024, block_size=VB, tensor_parallel_size=size,
                      distributed_executor_backend="mp",
                      kv_transfer_config=KVTransferConfig(
                          kv_connector="ShmkvConnector",
                          kv_connector_module_path="shmkv.integrations.vllm",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config=extra)).create_engine_config()


def _run(cfg, rank: int, size: int, seg: str, scenario: str) -> dict:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_helpers import VB, _model_dir

    import shmkv
    from shmkv.integrations.vllm import ShmkvConnector, request_salt
    from shmkv.integrations.vllm.connector import SaveOp, ShmkvConnectorMetadata

    path = _model_dir()
    w = ShmkvConnector(cfg, KVConnectorRole.WORKER, None)
    assert w.connector_worker._tp is not None and w.connector_worker._tp.rank == rank
    kvc = w.connector_worker._kv.config
    names = [f"model.layers.{i}.self_attn.attn" for i in range(kvc.num_layers)]
    g = torch.Generator().manual_seed(3 + rank)
    tensors = {n: torch.randn(8, kvc.num_kv_heads // size, VB, 2 * kvc.head_dim,
                              generator=g).to(torch.bfloat16) for n in names}
    if scenario == "vote" and rank == 1:
        def broken(kv_caches):
            raise RuntimeError("the layout self-test raised on this rank only")
        w.connector_worker._register = broken
    w.register_kv_caches(tensors)
    ww = w.connector_worker
    out: dict = {"rank": rank, "save_on": ww._save_on, "load_on": ww._load_on,
                 "layout": ww._layout is not None}
    salt = request_salt(path)
    tokens = np.random.default_rng(7).integers(1, 30000, 2 * VB, dtype=np.int32)
    if scenario != "vote":
        if scenario == "commit" and rank == 0:
            # the shutdown below closes the real one
            ww._kv = _CommitTimesOut(ww._kv)
        w.bind_connector_metadata(ShmkvConnectorMetadata(
            saves=[SaveOp("r", tokens, salt, [1, 2])]))
        try:
            for n in names:
                w.save_kv_layer(n, None, None)
        finally:
            w.wait_for_save()           # raises nothing into vLLM, on any rank
            w.clear_connector_metadata()
    out["stats"] = {k: w.connector_worker.stats[k] for k in ("saved_tokens", "save_errors")}
    w.connector_worker._tp._min(1)                       # every rank is done with the step
    if rank == 0:
        kv = shmkv.KVCache.attach(seg)
        try:
            st = kv.stats()
            out["segment"] = {"hit": kv.match_prefix(np.append(tokens, 0), salt),
                              "sequences": len(kv.sequences()),
                              "used_blocks": st["used_blocks"], "check": kv.check()}
        finally:
            kv.close()
    w.connector_worker._tp._min(1)
    w.shutdown()
    return out


if __name__ == "__main__":
    main()
