"""The command line: ``parse_args`` (every flag) and ``main``."""
from __future__ import annotations

import argparse
import os
import random
import signal

from shmkv import _core

from .controller import Controller


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="tools/chaos -- the crash-safety proof of shmkv.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--duration", type=float, default=120.0, help="seconds (at least)")
    p.add_argument("--max-duration", type=float, default=270.0,
                   help="after --duration, go on until --min-kills and --min-per-point are "
                        "met, but not past this many seconds")
    p.add_argument("--kill-interval", type=float, default=0.005,
                   help="mean seconds between SIGKILL attempts: each picks a random running "
                        "worker whose life span is over (workers still starting are left to "
                        "the crash points)")
    p.add_argument("--mean-life", type=float, default=0.25,
                   help="mean of the random (exponential) life span of a worker after it is "
                        "ready, before it may be SIGKILLed")
    p.add_argument("--aim", type=float, default=0.3,
                   help="fraction of SIGKILLs aimed at a worker that is inside a pool append")
    p.add_argument("--arm", type=float, default=0.3,
                   help="fraction of restarted workers armed with a crash point")
    p.add_argument("--armed-grace", type=float, default=1.5,
                   help="seconds an armed worker is spared from SIGKILL")
    p.add_argument("--phase", type=float, default=20.0,
                   help="seconds between kill-all audits (0: only at the end)")
    p.add_argument("--check-interval", type=float, default=0.5)
    p.add_argument("--progress", type=float, default=5.0)
    p.add_argument("--bound", type=float, default=1.0,
                   help="seconds a call may block; longer is a failure")
    p.add_argument("--lock-timeout", type=float, default=5.0)
    p.add_argument("--hang-limit", type=float, default=15.0,
                   help="seconds without progress after which a worker (or the controller) "
                        "counts as hung")
    p.add_argument("--min-kills", type=int, default=1000,
                   help="random SIGKILLs of running workers the run must reach (the kill-all "
                        "audits' SIGKILLs are counted apart)")
    p.add_argument("--min-per-point", type=int, default=20,
                   help="deaths the run must see at every crash point")
    p.add_argument("--plant", choices=_core.PLANTED_BUGS, default=None)
    p.add_argument("--sabotage", choices=("free_detached", "corrupt_data", "corrupt_cached"),
                   default=None,
                   help="harness self-test: the controller frees a detached sequence / "
                        "changes one confirmed token / changes one token of a cached, "
                        "findable block behind the workers' backs every check interval; "
                        "the run must FAIL")
    p.add_argument("--expect-failure", action="store_true",
                   help="exit 0 only if a failure was caught (for --plant)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failure")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--verbose", action="store_true")
    g = p.add_argument_group("segment")
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--head-dim", type=int, default=64)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=1024)
    g.add_argument("--max-seqs", type=int, default=256)
    g.add_argument("--max-seq-len", type=int, default=256)
    g.add_argument("--events", type=int, default=256,
                   help="event_capacity of the segment (KV events; 0: off)")
    args = p.parse_args(argv)
    # Under make sanitize (tools/sanitize/san sets SHMKV_TIME_SCALE) instrumented code runs
    # a few times slower: the time bounds a call or a worker is held to scale with it.  The
    # counts a run must reach and its durations do not.
    scale = float(os.environ.get("SHMKV_TIME_SCALE") or 1.0)
    args.bound *= scale
    args.hang_limit *= scale
    args.armed_grace *= scale
    args.lock_timeout *= scale
    if args.seed is None:
        args.seed = random.SystemRandom().getrandbits(32)
    return args


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None):
    import faulthandler
    faulthandler.register(signal.SIGUSR1, all_threads=True)    # a stuck run: kill -USR1
    signal.signal(signal.SIGTERM, _terminate)                  # clean up on timeout(1)
    signal.signal(signal.SIGHUP, _terminate)
    args = parse_args(argv)
    print(f"shmkv chaos: seed {args.seed}, {args.workers} workers, {args.duration} s, "
          f"kill interval {args.kill_interval} s, plant {args.plant}", flush=True)
    return Controller(args).run()
