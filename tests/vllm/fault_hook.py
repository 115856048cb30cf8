"""A fault in a real engine's forward, for the fault tests, installed on every rank: in an
offline engine (configs_worker.py's ``job["hook"]``) by ``LLM.apply_model(partial(install,
spec))``, pickled by reference (this module is importable wherever the engine's processes
run: they inherit the test's ``sys.path``); in ``vllm serve`` by the worker extension
``--worker-extension-cls fault_hook.FaultHook`` (this folder on ``PYTHONPATH``) and
``POST /collective_rpc {"method": "install_fault", "args": [JSON spec]}`` (vLLM's
development endpoints: ``VLLM_SERVER_DEV_MODE=1``).

Before the attention of layer ``spec["layer"]``, on its ``spec["at_call"]``-th prefill call
(``min_tokens`` tokens or more, default 16; counted only once the file ``spec["flag"]``
exists, if one is named): ``"raise"`` raises RuntimeError; ``"sleep"`` writes the call's
number to the file ``spec["marker"]`` and sleeps ``spec["seconds"]`` -- a test stops the
engine there, in the middle of the forward: the layers before done, this one not."""
from __future__ import annotations

import json
import os
import time


def install(spec: dict, model) -> int:
    state = {"calls": 0}

    def pre(module, args, kwargs):
        t = args[0] if args else next(iter(kwargs.values()))
        if t.shape[0] < spec.get("min_tokens", 16):
            return None                                 # a decode step
        if spec.get("flag") and not os.path.exists(spec["flag"]):
            return None
        state["calls"] += 1
        if state["calls"] != spec["at_call"]:
            return None
        if spec["mode"] == "raise":
            raise RuntimeError(f"shmkv test: an error in layer {spec['layer']}")
        with open(spec["marker"], "w") as f:
            f.write(str(state["calls"]))
        time.sleep(spec["seconds"])
        return None

    model.model.layers[spec["layer"]].self_attn.register_forward_pre_hook(pre, with_kwargs=True)
    return os.getpid()


class FaultHook:
    """vLLM worker extension (mixed into each rank's worker): ``install_fault(spec)``."""

    def install_fault(self, spec_json: str) -> int:
        return install(json.loads(spec_json), self.get_model())  # type: ignore[attr-defined]
