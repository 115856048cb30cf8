"""The commands that change a segment or its name: ``recover``, ``check`` (it attaches;
``--repair`` recovers first), ``create`` and ``rm`` (``--stale`` too)."""
from __future__ import annotations

import dataclasses
import sys

from ..config import CacheConfig
from ..errors import LockTimeout
from .common import EXIT_OK, EXIT_PROBLEMS, PRESETS, CLIError, held_by_dead, model_str, plural
from .reader import analyze, attach, liveness, load, lock_holders, scan, seg_path
from .render import emit_json, fmt_bytes, fmt_duration, paint


def _recover_line(name, r):
    if not (r["sequences"] or r["blocks"] or r["processes"] or r["locks"] or r["tail_blocks"]
            or r["corrupt_sequences"]):
        return f"{name}: nothing to reclaim (recovery pass took {fmt_duration(r['duration_s'])})"
    return (f"{name}: reclaimed {plural(r['sequences'], 'sequence')} and "
            f"{plural(r['blocks'], 'block')} from {plural(r['processes'], 'dead process')} "
            f"({plural(r['locks'], 'lock')} released, "
            f"{plural(r['tail_blocks'], 'unpublished tail block')} trimmed, "
            f"{plural(r['refcounts_fixed'], 'inconsistent refcount')} repaired, "
            f"{plural(r['corrupt_sequences'], 'corrupt sequence')} dropped) in "
            f"{fmt_duration(r['duration_s'])}")


def cmd_recover(args):
    before = analyze(load(args.name))["dead"]
    cache = attach(args.name, args.timeout, args.trust)
    try:
        r = cache.recover(full=True)       # the repair: every refcount and list rebuilt
    except LockTimeout:
        raise CLIError(f"{args.name}: timed out waiting for the pool lock") from None
    finally:
        cache.close()
    doc = dict(name=args.name, **r, dead_pids=before["pids"])
    if args.json:
        emit_json(doc)
    else:
        print(_recover_line(args.name, r))
        if before["pids"]:
            print(f"dead processes: pid {', '.join(map(str, before['pids']))}")
    return EXIT_OK


def cmd_check(args):
    before = load(args.name, tables=True)
    dead_before = analyze(before)["dead"]
    cache = attach(args.name, args.timeout, args.trust)
    repair = None
    try:
        if args.repair:
            repair = cache.recover(full=True)
        problems = list(cache.check())
    except LockTimeout:
        raise CLIError(f"{args.name}: timed out waiting for the pool lock") from None
    finally:
        cache.close()
    view = analyze(load(args.name, tables=True))
    if args.strict and not args.repair and (dead_before["sequences"] or dead_before["blocks"]):
        problems.append(f"{plural(dead_before['sequences'], 'sequence')} / "
                        f"{plural(dead_before['blocks'], 'block')} were "
                        f"{held_by_dead(dead_before['pids'])}")
    ok = not problems
    if args.json:
        emit_json(dict(name=args.name, consistent=ok, problems=problems, repair=repair,
                       dead_before=dead_before, dead_after=view["dead"]))
        return EXIT_OK if ok else EXIT_PROBLEMS
    if repair is not None:
        print(_recover_line(args.name, repair))
    if ok:
        print(paint(f"{args.name}: consistent", "green") +
              f" ({plural(view['cfg'].num_blocks, 'block')}, "
              f"{plural(len(view['seqs']), 'sequence')}, "
              f"{plural(len(view['procs']), 'process')})")
    else:
        print(paint(f"{args.name}: {len(problems)} problem(s)", "bold red"))
        for p in problems:
            print(f"  - {p}")
        if not args.repair:
            print(f"`shmkv check --repair {args.name}` runs recovery first")
    if not args.repair and not args.strict and (dead_before["sequences"]
                                                or dead_before["processes"]):
        print(paint(f"note: {plural(dead_before['sequences'], 'sequence')} / "
                    f"{plural(dead_before['blocks'], 'block')} were "
                    f"{held_by_dead(dead_before['pids'])}: a leak, not an "
                    "inconsistency", "yellow"))
    return EXIT_OK if ok else EXIT_PROBLEMS


def cmd_create(args):
    from ..cache import KVCache

    fields = {}
    if args.preset:
        fields.update(PRESETS[args.preset][0])
    for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "max_seqs",
              "max_seq_len", "max_procs", "hash", "num_blocks", "event_capacity"):
        v = getattr(args, f)
        if v is not None:
            fields[f] = v
    missing = [f for f in ("num_layers", "num_kv_heads", "head_dim") if f not in fields]
    if missing:
        raise CLIError("create: give a --preset or every one of --layers, --kv-heads, "
                       f"--head-dim (missing: {', '.join(missing)})")
    if args.memory is not None:
        if args.num_blocks is not None:
            raise CLIError("create: give --blocks or --memory, not both")
        probe = CacheConfig(**{**fields, "num_blocks": 1, "max_seq_len": None})
        nblocks = args.memory // probe.bytes_per_block
        if nblocks < 1:
            raise CLIError(f"create: --memory {fmt_bytes(args.memory)} holds no block of "
                           f"{fmt_bytes(probe.bytes_per_block)}")
        fields["num_blocks"] = nblocks
    if "num_blocks" not in fields:
        raise CLIError("create: give --blocks N or --memory SIZE (e.g. --memory 8GiB)")
    try:
        cfg = CacheConfig(**fields)
    except ValueError as e:
        raise CLIError(f"create: {e}") from None
    try:
        cache = KVCache.create(args.name, cfg, mode=args.mode, group=args.group,
                               prefault=args.prefault)
    except FileExistsError:
        raise CLIError(f"{args.name}: a segment with that name exists already "
                       f"(`shmkv info {args.name}`, or `shmkv rm {args.name}` first)") from None
    except PermissionError as e:
        raise CLIError(f"{args.name}: permission denied: {e}") from None
    except (TypeError, ValueError) as e:            # an unknown --group
        raise CLIError(f"create: {e}") from None
    except OSError as e:
        raise CLIError(f"{args.name}: cannot create ({fmt_bytes(cfg.segment_size())}): "
                       f"{e.strerror or e}") from None
    cache.close()       # the segment outlives this process; it holds no sequence
    snap = load(args.name, tables=False)
    doc = dict(name=args.name, path=seg_path(args.name), config=dataclasses.asdict(cfg),
               segment_bytes=snap["segment_size"], bytes_per_block=cfg.bytes_per_block,
               token_capacity=cfg.num_blocks * cfg.block_size, mode=f"{args.mode:#o}")
    if args.json:
        emit_json(doc)
    else:
        print(f"created {args.name} ({seg_path(args.name)}, mode {args.mode:#o}): "
              f"{model_str(cfg)}, {cfg.num_blocks} blocks = {doc['token_capacity']} tokens, "
              f"segment {fmt_bytes(snap['segment_size'])}")
    return EXIT_OK


def _unlink(name):
    import posix_ipc

    from shmkv.pending import unlink_pending

    try:
        posix_ipc.unlink_shared_memory("/" + name)
        return True
    except posix_ipc.ExistentialError:
        return False
    except posix_ipc.PermissionsError as e:
        raise CLIError(f"{name}: cannot remove: {e}") from None
    finally:
        unlink_pending(name)            # the segment's pending marks (NAME.pending) too


def cmd_rm(args):
    if args.stale:
        return _rm_stale(args)
    if not args.names:
        raise CLIError("rm: give NAME... or --stale")
    results, refused = [], False
    for name in args.names:
        pids, state = liveness(name)
        reason = None
        if state == "not-shmkv" and not args.force:
            reason = "not a shmkv segment (--force removes it anyway)"
        elif pids and not args.force:
            reason = (f"{len(pids)} live process(es) attached (pid "
                      f"{', '.join(map(str, pids))}); stop them or use --force")
        elif pids is None and lock_holders(name) and not args.force:
            reason = f"{state} segment still in use by a live process; use --force"
        if reason:
            refused = True
            results.append(dict(name=name, removed=False, reason=reason))
            print(f"shmkv: refusing to remove {name}: {reason}", file=sys.stderr)
            continue
        removed = _unlink(name)
        results.append(dict(name=name, removed=removed, reason=None if removed else "gone"))
        if not args.json:
            print(f"removed {name}" + (" (live processes keep their mapping until they exit)"
                                       if pids else ""))
    if args.json:
        emit_json(results)
    return EXIT_PROBLEMS if refused else EXIT_OK


def _rm_stale(args):
    if args.names and not args.pattern:
        args.pattern = args.names
    out = []
    for r in scan(args.pattern or (), False):
        state = r["state"]
        if state == "ok" or state == "not-ready":
            continue                     # live processes; or a creator may be building it
        if state in ("corrupt", "incompatible") and lock_holders(r["name"]) is not False:
            continue                     # cannot tell who uses it: leave it
        if state == "unreadable":
            continue
        removed = False if args.dry_run else _unlink(r["name"])
        out.append(dict(name=r["name"], state=state, removed=removed,
                        processes_dead=r.get("processes_dead"),
                        num_sequences=r.get("num_sequences")))
    if args.json:
        emit_json(out)
        return EXIT_OK
    if not out:
        print("no stale segments")
    for r in out:
        verb = "would remove" if args.dry_run else ("removed" if r["removed"] else "gone:")
        extra = (f" ({plural(r['processes_dead'], 'dead process')}, "
                 f"{plural(r['num_sequences'], 'sequence')})"
                 if r["processes_dead"] is not None else "")
        print(f"{verb} {r['name']}: {r['state']}{extra}")
    return EXIT_OK
