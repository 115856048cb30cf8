"""The run's summary: ``_summary`` gathers every counter of the controller and the
workers' lanes into one dict (the ``--json`` document), ``_print`` prints it as the table."""
from __future__ import annotations

import json

from shmkv.inspect import snapshot

from .common import CNT_BASE, FAIL_BASE, FAIL_KINDS, LANE_FIELDS, LF, MAX_BASE, OPS, _lane_sum


class Report:
    """The summary and its table (mixed into Controller)."""

    def _summary(self):
        a, J = self.args, self.J
        snap = snapshot(self.name, tables=False)     # lock-free: safe even if wedged
        st = dict(snap["counters"], max_recovery_s=snap["max_recovery_s"])
        lane_fail = _lane_sum(J, FAIL_BASE, len(FAIL_KINDS))
        fails = {k: int(lane_fail[i]) + self.fails[k] for i, k in enumerate(FAIL_KINDS)}
        counts = _lane_sum(J, CNT_BASE, len(OPS))
        maxns = J.lanes[:, MAX_BASE:MAX_BASE + len(OPS)].max(axis=0)
        lf = {f: int(J.lanes[:, LF[f]].sum()) for f in LANE_FIELDS}
        lost_tokens = lf["lost_token_count"] + self.lost_tokens_ctl
        max_blocked = int(maxns.max())
        worst_op = OPS[int(maxns.argmax())]
        res = {
            "workers": a.workers, "duration_s": round(self.elapsed, 1), "plant": a.plant,
            "sigkills": self.kills, "aimed_kills": self.aimed_kills,
            "sigkills_in_audits": self.kills_quiesce,
            "sigkills_total": self.kills + self.kills_quiesce,
            "crash_point_deaths": dict(self.cp_deaths), "crash_points_armed": dict(self.cp_armed),
            "crash_point_calls": {p: dict(sorted(d.items(), key=lambda x: -x[1]))
                                  for p, d in self.cp_ops.items()},
            "armed_then_sigkilled": self.armed_survived, "restarts": self.restarts,
            "audits": self.audits, "checks": self.checks,
            "recoveries": st["recoveries"], "lock_owner_dead": st["lock_owner_dead"],
            "reclaimed_sequences": st["reclaimed_sequences"],
            "reclaimed_blocks": st["reclaimed_blocks"],
            "dead_owner_sequences_seen_reclaimed": lf["reclaimed_seen"] + self.reclaimed_ctl,
            "max_recovery_s": st["max_recovery_s"],
            "ops": {OPS[i]: int(counts[i]) for i in range(len(OPS))},
            "max_call_s": {OPS[i]: round(int(maxns[i]) / 1e9, 4) for i in range(len(OPS))},
            "max_blocked_s": round(max_blocked / 1e9, 4), "max_blocked_op": worst_op,
            "bound_s": a.bound, "controller_max_call_s": round(self.max_ctl_call_ns / 1e9, 4),
            "tokens_verified": lf["tokens_verified"] + self.tokens_verified_ctl,
            "sequences_verified": lf["seqs_verified"] + self.seqs_verified_ctl,
            "pool_appends": lf["pool_appends"], "cow_appends": lf["cow_appends"],
            "inflight_appends_resolved": lf["resolved_inflight"],
            "paged_reads_discarded": lf["reads_discarded"], "cache_full": lf["cache_full"],
            "worker_startup_mean_s": round(int(J.lanes[:, LF["startup_ns_sum"]].sum()) / 1e9 / max(1, int(J.lanes[:, LF["startups"]].sum())), 4),
            "worker_startup_max_s": round(int(J.lanes[:, LF["startup_ns_max"]].max()) / 1e9, 4),
            "max_journal_claim_wait_s": round(int(J.lanes[:, LF["max_claim_wait_ns"]].max()) / 1e9, 4),
            "lost_tokens": lost_tokens, "leaked_blocks_max": self.max_leaked,
            "failures": fails, "failure_total": sum(fails.values()),
            "exits_other": self.exit_other, "hung_workers": self.hung_workers,
            "sabotage": a.sabotage, "sabotaged": self.sabotaged,
            "prefix": {
                "prompt_creates": lf["prompt_creates"],
                "hit_blocks_verified_by_workers": lf["prefix_hit_blocks"],
                "hit_tokens_verified_by_workers": lf["prefix_hit_tokens_verified"],
                "audit_probes": self.audit_probes,
                "audit_hit_blocks_verified": self.audit_hit_blocks,
                "hashed_blocks_verified_in_audits": self.index_blocks_verified,
                "token_ids_verified": lf["ids_verified"],
                "tokened_appends": lf["tok_appends"], "commits": lf["commits"],
                "committed_blocks": lf["committed_blocks"],
                "trims": lf["trims"], "trimmed_tokens": lf["trimmed_tokens"],
                "inflight_trims_resolved": lf["resolved_trims"] + self.resolved_trims_ctl,
                "truncates": lf["truncates"], "truncated_tokens": lf["truncated_tokens"],
                "inflight_truncates_resolved": (lf["resolved_truncates"]
                                                + self.resolved_truncates_ctl),
                "evict_calls": lf["evict_calls"], "evicted": lf["evicted"],
                "evicted_dead_owners": lf["evicted_dead"], "match_prefix_calls": lf["matches"],
                "live_hit_blocks": (st.get("prefix_hits", 0) // self.cfg.block_size
                                    - st.get("cached_blocks_reused", 0)),
                "segment": {k: st.get(k, 0) for k in (
                    "prefix_queries", "prefix_hits", "cached_blocks_reused",
                    "cached_blocks_evicted", "trimmed_blocks", "evictions_lru",
                    "evictions_lfu", "evictions_longest", "evictions_priority")},
            },
            "events": {
                "event_capacity": self.cfg.event_capacity,
                "written": self.ev_next,
                "read_by_workers": lf["events_read"], "lost_to_workers": lf["events_lost"],
                "read_in_audits": self.events_audited,
                "lost_between_audits": self.events_lost_audit,
                "findable_blocks_matched_to_stored": self.stored_blocks_matched,
                "resets": lf["resets"], "hits_excused_by_reset": lf["resets_excused"],
            },
        }
        lines = self._read_failures() + self.fail_lines
        per_kind = {}
        for line in lines:
            per_kind.setdefault(line.get("kind"), []).append(line)
        res["failure_samples"] = [x for k in FAIL_KINDS for x in per_kind.get(k, [])[:5]]
        ok_counts = self.counts_met()
        res["counts_met"] = ok_counts
        caught = sorted(k for k, v in fails.items() if v)
        res["caught"] = caught
        if a.expect_failure:
            res["ok"] = bool(caught)
        else:
            res["ok"] = not caught and ok_counts
        self._print(res)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
        return 0 if res["ok"] else 1

    def _print(self, r):
        print()
        print("=" * 78)
        print(f"shmkv chaos: {r['workers']} workers, {r['duration_s']} s"
              + (f", planted bug: {r['plant']}" if r["plant"] else ""))
        print("-" * 78)
        rows = [
            ("SIGKILLs (random, running workers)", r["sigkills"]),
            ("  of which aimed at a pool append", r["aimed_kills"]),
            ("SIGKILLs (kill-all audits)", r["sigkills_in_audits"]),
            ("SIGKILLs total", r["sigkills_total"]),
            ("crash-point deaths total", sum(r["crash_point_deaths"].values())),
            ("worker restarts", r["restarts"]),
            ("worker start to ready, mean / max (s)", f"{r['worker_startup_mean_s']} / {r['worker_startup_max_s']}"),
            ("audits (kill all, recover, verify)", r["audits"]),
            ("check() calls by the controller", r["checks"]),
            ("recoveries (segment counter)", r["recoveries"]),
            ("pool lock EOWNERDEAD", r["lock_owner_dead"]),
            ("reclaimed sequences / blocks", f"{r['reclaimed_sequences']} / {r['reclaimed_blocks']}"),
            ("dead workers' sequences seen reclaimed", r["dead_owner_sequences_seen_reclaimed"]),
            ("longest recovery (max_recovery_s)", f"{r['max_recovery_s']:.6f}"),
            ("sequences / tokens verified", f"{r['sequences_verified']} / {r['tokens_verified']}"),
            ("in-flight appends resolved after a death", r["inflight_appends_resolved"]),
            ("prompts created with tokens= (create_sequence)", r["prefix"]["prompt_creates"]),
            ("prefix-hit blocks verified (workers / audits)",
             (f"{r['prefix']['hit_blocks_verified_by_workers']} / "
              f"{r['prefix']['audit_hit_blocks_verified']} ({r['prefix']['audit_probes']} probes)")),
            ("prefix-hit blocks live / cached; cached evicted",
             (f"{r['prefix']['live_hit_blocks']} / "
              f"{r['prefix']['segment']['cached_blocks_reused']}; "
              f"{r['prefix']['segment']['cached_blocks_evicted']}")),
            ("hashed blocks verified raw in audits", r["prefix"]["hashed_blocks_verified_in_audits"]),
            ("token ids verified", r["prefix"]["token_ids_verified"]),
            ("KV events written / read by workers (lost) / in audits",
             (f"{r['events']['written']} / {r['events']['read_by_workers']} "
              f"({r['events']['lost_to_workers']}) / {r['events']['read_in_audits']}")),
            ("findable blocks matched to their stored event; resets",
             (f"{r['events']['findable_blocks_matched_to_stored']}; "
              f"{r['events']['resets']}")),
            ("trims / in-flight trims resolved",
             f"{r['prefix']['trims']} / {r['prefix']['inflight_trims_resolved']}"),
            ("truncates (tokens cut) / in-flight truncates resolved",
             (f"{r['prefix']['truncates']} ({r['prefix']['truncated_tokens']}) / "
              f"{r['prefix']['inflight_truncates_resolved']}")),
            ("evict() calls / sequences evicted (of dead owners)",
             (f"{r['prefix']['evict_calls']} / {r['prefix']['evicted']} "
              f"({r['prefix']['evicted_dead_owners']})")),
            ("max blocked call (s)", f"{r['max_blocked_s']} ({r['max_blocked_op']}; bound {r['bound_s']})"),
            ("hung workers (no call returned)", r["hung_workers"]),
            ("invariant failures", r["failures"]["invariant"]),
            ("leaked blocks (max seen)", r["leaked_blocks_max"]),
            ("lost published tokens", r["lost_tokens"]),
            ("failures total", r["failure_total"]),
        ]
        w = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"  {k:<{w}}  {v}")
        print("  crash point deaths (armed):")
        for p, n in r["crash_point_deaths"].items():
            calls = ", ".join(f"{k} {v}" for k, v in list(r["crash_point_calls"][p].items())[:4])
            print(f"    {p:<24} {n:5d}  ({r['crash_points_armed'][p]})  in: {calls}")
        print("  calls (max seconds):")
        print("    " + ", ".join(f"{k} {r['ops'][k]} ({r['max_call_s'][k]})"
                                 for k in OPS if r["ops"][k]))
        bad = {k: v for k, v in r["failures"].items() if v}
        if bad:
            print("  FAILURES: " + ", ".join(f"{k}={v}" for k, v in bad.items()))
            for line in r["failure_samples"][:12]:
                print(f"    [{line.get('kind')}] lane {line.get('lane')}: "
                      f"{str(line.get('msg'))[:400]}")
        if not r["counts_met"]:
            print(f"  counts NOT met: need >= {self.args.min_kills} random SIGKILLs and >= "
                  f"{self.args.min_per_point} deaths at every crash point")
        if self.args.expect_failure:
            verdict = (f"planted bug {r['plant']!r} CAUGHT: {', '.join(r['caught'])}"
                       if r["ok"] else f"planted bug {r['plant']!r} NOT caught")
        else:
            verdict = "PASS" if r["ok"] else "FAIL"
        print("-" * 78)
        print(f"result: {verdict}")
        print("=" * 78, flush=True)
