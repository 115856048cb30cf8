"""Targets (PASS/FAIL), the Markdown report and the chart, from the results dict."""
from __future__ import annotations

import os

from timing import fmt_ns

PEERS = ("vLLM-style pool (py)", "naive shm+Manager", "LMDB", "Redis")
COPY_OPS = ("append1", "prefill512", "gather1k_out", "gather1k_new")
FLOOR = "memcpy matched"
FLOOR_AFTER = "memcpy matched, after shmkv"
LAYOUT_ROWS = "layout-matched rows"


def _floor_ns(recs, op, cfg):
    """The floor the ratios use: the fastest sample of the matched memcpy, measured
    before and again right after shmkv's ops (a floor is a lower bound; other jobs on the
    machine only ever slow it)."""
    vals = [r["min_ns"] for r in recs
            if r.get("section") == "ops" and r.get("op") == op and r.get("config") == cfg
            and r.get("impl") in (FLOOR, FLOOR_AFTER) and r.get("min_ns")]
    return min(vals) if vals else None


def _find(records, **kw):
    for r in records:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def _med(records, **kw):
    r = _find(records, **kw)
    return None if r is None else r.get("median_ns")


def _ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


# ---- targets --------------------------------------------------------------------------
def evaluate_targets(results):
    """One row per target: what was measured, the limit, PASS / FAIL / n/a."""
    recs = [r for r in results["records"] if r.get("section") in ("ops", "scaling", "threads")]
    rows = []

    def add(name, value, limit, unit, note="", cmp="<="):
        if value is None:
            status = "n/a"
        else:
            status = "PASS" if (value <= limit if cmp == "<=" else value >= limit) else "FAIL"
        rows.append({"target": name, "measured": value, "limit": limit, "unit": unit, "cmp": cmp,
                         "status": status, "note": note})

    for cfg in ("small", "llama"):
        life = _med(recs, section="ops", op="life", config=cfg, impl="shmkv")
        vl = _med(recs, section="ops", op="life", config=cfg, impl="vLLM-style pool (py)")
        add(f"[{cfg}] sequence life from Python (create+reserve+free), 1 process", life, 600,
            "ns", f"vLLM-style pool: {fmt_ns(vl)}")
    per2 = _find(recs, section="scaling", op="life", config="small", impl="shmkv", workers=2)
    add("[small] sequence life, per process, 2 processes on one segment",
        per2 and per2.get("per_worker_ns_median"), 600, "ns",
        "each process's own time per life while both run")
    _gate(rows[-1], per2)
    for cfg in ("small", "llama"):
        k = _med(recs, section="ops", op="life", config=cfg, impl="shmkv kernel alloc+free")
        vp = _med(recs, section="ops", op="life", config=cfg,
                  impl="vLLM-style pool (py) alloc+free")
        ks = _med(recs, section="ops", op="life", config=cfg,
                  impl="shmkv kernel alloc+free (shared pool)")
        add(f"[{cfg}] kernel-level block alloc+free (bench_alloc_free)", k, 25, "ns",
            f"through the shared pool lock instead of the process cache: {fmt_ns(ks)}; "
            f"vLLM-style pool get_new_blocks(1)+free_blocks from Python: {fmt_ns(vp)}")
    for cfg in ("small", "llama"):
        add(f"[{cfg}] reserve(sid, 1) in decode (no new block)",
            _med(recs, section="ops", op="reserve1", config=cfg, impl="shmkv"), 150, "ns")
    for cfg in ("small", "llama"):
        vl = _med(recs, section="ops", op="fork1k", config=cfg, impl="vLLM-style pool (py)")
        add(f"[{cfg}] fork of a 1k-token sequence",
            _med(recs, section="ops", op="fork1k", config=cfg, impl="shmkv"), 2000, "ns",
            f"vLLM-style pool: {fmt_ns(vl)}")
    for cfg, op, limit, label in (("llama", "append1", 1.3, "append 1 token (128 KiB)"),
                                  ("llama", "prefill512", 1.15, "prefill 512 tokens"),
                                  ("small", "prefill512", 1.15, "prefill 512 tokens"),
                                  ("llama", "gather1k_out", 1.2, "gather 1k tokens, out="),
                                  ("small", "gather1k_out", 1.2, "gather 1k tokens, out=")):
        s = _med(recs, section="ops", op=op, config=cfg, impl="shmkv")
        f = _floor_ns(recs, op, cfg)
        hot = _med(recs, section="ops", op=op, config=cfg, impl="memcpy hot")
        cold = _med(recs, section="ops", op=op, config=cfg, impl="memcpy cold")
        stream = _med(recs, section="ops", op=op, config=cfg, impl="streaming copy matched")
        note = f"shmkv {fmt_ns(s)}, memcpy same working set {fmt_ns(f)}"
        if stream:
            note += (f"; shmkv copies this with streaming stores: ×{_ratio(s, stream):.2f} "
                     f"of a streaming copy of the same working set ({fmt_ns(stream)})")
        for lab, fl2 in (("hot", hot), ("cold", cold)):
            if _ratio(s, fl2):
                note += f"; ×{_ratio(s, fl2):.2f} of {lab} memcpy"
        for d in recs:
            if (d.get("kind") == "diagnostic" and d.get("op") == op and d.get("config") == cfg
                    and d.get("section") == "ops" and f):
                note += (f"; {d['impl'].split(', ', 1)[1]}: {fmt_ns(d['median_ns'])} "
                         f"(×{d['median_ns'] / f:.2f})")
        add(f"[{cfg}] {label} / memcpy floor", _ratio(s, f), limit, "x", note)
    for cfg in ("llama", "small"):
        s = _med(recs, section="ops", op="append1", config=cfg, impl="shmkv")
        lr = _find(recs, section="ops", op="append1", config=cfg, impl=LAYOUT_ROWS)
        if lr:
            f = _floor_ns(recs, "append1", cfg)
            rows.append({"target": f"[{cfg}] append 1 token / layout-matched floor (report)",
                         "measured": _ratio(s, lr["median_ns"]), "limit": None, "unit": "x",
                         "cmp": "", "status": "report",
                         "note": f"shmkv {fmt_ns(s)}; {lr['note']}: {fmt_ns(lr['median_ns'])}; "
                                 f"contiguous memcpy of the same bytes (matched span) "
                                 f"{fmt_ns(f)}: the rows cost x{_ratio(lr['median_ns'], f):.2f} "
                                 "of one contiguous stream"})
    add("[small] append 1 token (4 KiB)",
        _med(recs, section="ops", op="append1", config="small", impl="shmkv"), 2000, "ns")
    for cfg in ("small", "llama"):
        s = _med(recs, section="ops", op="gather1k_out", config=cfg, impl="shmkv")
        lm = _med(recs, section="ops", op="gather1k_out", config=cfg, impl="LMDB")
        add(f"[{cfg}] gather 1k tokens out= faster than LMDB (shmkv / LMDB)", _ratio(s, lm),
            1.0, "x", f"shmkv {fmt_ns(s)}, LMDB {fmt_ns(lm)}", cmp="<")
        if rows[-1]["measured"] is not None:
            rows[-1]["status"] = "PASS" if rows[-1]["measured"] < 1.0 else "FAIL"
    for cfg in ("small", "llama"):
        new = _med(recs, section="ops", op="gather1k_new", config=cfg, impl="shmkv")
        out = _med(recs, section="ops", op="gather1k_out", config=cfg, impl="shmkv")
        al = _med(recs, section="ops", op="gather1k_new", config=cfg, impl="np.empty x2")
        af = _med(recs, section="ops", op="gather1k_new", config=cfg,
                  impl="np.empty x2 + page faults")
        rows.append({"target": f"[{cfg}] gather 1k tokens into fresh arrays (report)",
                         "measured": new, "limit": None, "unit": "ns", "cmp": "", "status": "report",
                         "note": f"out= {fmt_ns(out)}; np.empty x2 {fmt_ns(al)}; "
                              f"np.empty x2 + first touch of every page {fmt_ns(af)}"})
    vl = _med(recs, section="ops", op="bbt256", config="small", impl="vLLM-style pool (py)")
    add("[small] batch_block_tables, 256 sequences (int64 sids)",
        _med(recs, section="ops", op="bbt256", config="small", impl="shmkv"), 10_000, "ns",
        f"vLLM-style padded Python lists: {fmt_ns(vl)}")
    for cfg, op, label in (("small", "life", "sequence life (alloc/free)"),
                           ("small", "alloc_free_kernel", "kernel alloc+free"),
                           ("small", "append", "append 1 token"),
                           ("llama", "append", "append 1 token")):
        r = _find(recs, section="scaling", op=op, config=cfg, impl="shmkv", workers=2)
        c = _find(recs, section="scaling", op="cpu_ceiling", config=cfg,
                  impl="python loop (ceiling)", workers=2, paired_with=op)
        note = _scal_note(recs, "scaling", op, cfg, "shmkv")
        if c:
            note += (f"; a pure-Python loop scales ×{c['speedup_vs_1']:.2f} in the same rounds "
                     f"({c['rounds_kept']} of {c['rounds_tried']} rounds kept)")
        add(f"[{cfg}] {label}: 2 processes / 1 process, aggregate", r and r["speedup_vs_1"],
            1.7, "x", note, cmp=">=")
        _gate(rows[-1], r)
    r = _find(recs, section="scaling", op="alloc_free_kernel_shared", config="small",
              impl="shmkv", workers=2)
    if r:
        rows.append({"target": "[small] kernel alloc+free through the shared pool lock (no "
                     "process cache): 2 processes / 1 process (report)",
                     "measured": r["speedup_vs_1"], "limit": None, "unit": "x", "cmp": "",
                     "status": "report",
                     "note": _scal_note(recs, "scaling", "alloc_free_kernel_shared", "small",
                                        "shmkv")})
    for cfg in ("small", "llama"):
        r = _find(recs, section="threads", op="gather1k_out", config=cfg, impl="shmkv",
                  workers=2)
        ceil = _find(recs, section="threads", op="gather1k_out", config=cfg,
                     impl="numpy copy (ceiling)", workers=2)
        cc = _find(recs, section="threads", op="cpu_ceiling", config=cfg, workers=2)
        note = []
        if ceil:
            note.append(f"numpy copy of the same bytes scales ×{ceil['speedup_vs_1']:.2f}")
        if cc:
            note.append(f"a GIL-free C loop ×{cc['speedup_vs_1']:.2f}")
        note = ", ".join(note) + " in the same rounds" if note else ""
        if r and ceil:
            note += (f"; 2 threads: shmkv {r['aggregate_ops_s']:.1f} gathers/s, numpy copy "
                     f"of the same bytes {ceil['aggregate_ops_s']:.1f}/s")
        if cfg == "small":
            note = "in-cache copies: the GIL test; " + note
        else:
            note = "128 MiB from DRAM per gather: bounded by memory bandwidth; " + note
        add(f"[{cfg}] gather 1k tokens: 2 threads / 1 thread, aggregate",
            r and r["speedup_vs_1"], 1.6, "x", note, cmp=">=")
        _gate(rows[-1], r)
    return rows


def _gate(row, r):
    """A scaling figure from rounds in which the machine did not give us its two cores
    (see run.gated_rounds) says nothing about shmkv: inconclusive, not FAIL."""
    if r and r.get("rounds_kept") == 0 and row["status"] == "FAIL":
        row["status"] = "INCONCLUSIVE"
        row["note"] += " — machine busy: no round had both cores free"


def _scal_note(recs, section, op, cfg, impl):
    parts = []
    for n in (1, 2, 4):
        r = _find(recs, section=section, op=op, config=cfg, impl=impl, workers=n)
        if r:
            parts.append(f"{n}p {r['aggregate_ops_s'] / 1e6:.2f} M/s")
    return ", ".join(parts)


def _fmt_measured(t):
    v = t["measured"]
    if v is None:
        return "–"
    if t["unit"] == "ns":
        return fmt_ns(v)
    return f"{v:.2f}×"


def _fmt_limit(t):
    if t["limit"] is None:
        return "–"
    op = {"<=": "≤", ">=": "≥", "<": "<"}.get(t["cmp"], "")
    return f"{op} {fmt_ns(t['limit'])}" if t["unit"] == "ns" else f"{op} {t['limit']}×"


def targets_text(results):
    lines = ["", "targets:"]
    for t in results["targets"]:
        lines.append(f"  {t['status']:<6} {t['target']}: {_fmt_measured(t)} "
                     f"(target {_fmt_limit(t)}) {t['note']}")
    return "\n".join(lines)


# ---- Markdown --------------------------------------------------------------------------
SERVER_PEERS = ("naive shm+Manager", "Redis")     # work done in another process


def _busy(r):
    """Wall time well above this thread's CPU time, for work done in this thread: the
    CPU was taken by other tasks while the sample ran."""
    cpu = r.get("cpu_median_ns")
    return bool(cpu) and r["impl"] not in SERVER_PEERS and r["median_ns"] > 1.25 * cpu


def _cell(r, floor=None, base=None):
    if r is None:
        return "–"
    s = f"**{fmt_ns(r['median_ns'])}**{' †' if _busy(r) else ''}<br>" \
        f"{fmt_ns(r['p10_ns'])}–{fmt_ns(r['p90_ns'])}"
    if floor:
        s += f"<br>×{r['median_ns'] / floor:.2f} floor"
    elif base:
        s += f"<br>×{r['median_ns'] / base:.1f} shmkv"
    return s


def markdown(results, chart_rel="out/chart.png"):
    m = results["meta"]
    recs = results["records"]
    out = []
    w = out.append
    w("# shmkv benchmark results\n")
    w(f"Measured {m['date']} in **{m['mode']}** mode by `python benchmarks/run.py"
      f"{' --quick' if m['mode'] == 'quick' else ''}` (shmkv {m['shmkv']}, commit "
      f"`{m['git_commit']}`, layout v{m['layout_version']}).  Every figure below comes from "
      "this one run.\n")
    w(f"Machine: {m['cpu']}, {m['cpus']} CPUs, LLC {m['llc_bytes'] >> 20} MiB, "
      f"{(m['mem_bytes'] or 0) / 2**30:.0f} GiB RAM, Linux {m['kernel']}; Python "
      f"{m['python']}, numpy {m['numpy']}, py-lmdb {m['lmdb']}, redis-py {m['redis_py']}, "
      f"{m['redis_server'] or 'no redis-server'}.  An empty Python loop iteration costs "
      f"{m['loop_overhead_ns']} ns here (included in every Python-level figure, not "
      "subtracted).\n")
    if m.get("nice"):
        w(f"The run had scheduling priority nice {m['nice']} (`nice -n {m['nice']}`), so "
          "that other jobs on the shared machine took less of its CPU.\n")
    ld = m.get("others_running") or {}
    if ld.get("samples"):
        w(f"Other load on the machine (runnable tasks besides the benchmark, sampled "
          f"between measurements): mean {ld['mean']}, max {ld['max']}, busy in "
          f"{100 * ld['busy_fraction']:.0f}% of {ld['samples']} samples; the run took "
          f"{m.get('duration_s')} s.  Figures taken while the machine was busy are "
          "inflated; `others_running` in results.json tags every record.\n")
    drops = sum(r.get("preempted_dropped") or 0 for r in recs)
    w(f"Samples of work done in the benchmark's own thread during which other tasks held "
      f"its CPU for more than 20% of the sample were dropped and taken again: {drops} in "
      "this run (`preempted_dropped` per record).  Memory and cache interference from other "
      "jobs is not filtered.\n")
    w("Each cell: **median** per call, p10–p90 over samples, and the ratio to the memcpy "
      "floor of the same bytes over the same working set (copy ops; the floor is the "
      "fastest sample of that memcpy, measured before and again right after shmkv's ops) "
      "or to shmkv "
      "(peers, metadata ops).  † marks a median more than 25% above the calling thread's "
      "CPU time per call: other tasks held the CPU during those samples (not applied to "
      "the Manager and Redis peers, whose work runs in another process).  Method, configs "
      "and peers: [README.md](README.md).\n")
    if results.get("skipped"):
        w("**Skipped:** " + "; ".join(f"{s['impl']} ({s['config']}): {s['reason']}"
                                      for s in results["skipped"]) + "\n")

    w("## Targets\n")
    w("| target | measured | target | result | notes |")
    w("|---|---|---|---|---|")
    for t in results["targets"]:
        w(f"| {t['target']} | {_fmt_measured(t)} | {_fmt_limit(t)} | **{t['status']}** | "
          f"{t['note']} |")
    w("")

    for cfg in ("small", "llama"):
        ops = [o for o in ("life", "reserve1", "fork1k", "append1", "prefill512",
                           "gather1k_out", "gather1k_new", "bbt256")
               if _find(recs, section="ops", op=o, config=cfg, impl="shmkv")]
        if not ops:
            continue
        chk = _find(recs, section="checks", op="check_after_ops", config=cfg)
        w(f"## {cfg} config\n")
        cfgdesc = {"small": "4 layers, 4 KV heads, head_dim 64, float16, block_size 16, "
                            "12288 blocks (4 KiB per token, 64 KiB per block)",
                   "llama": "Llama-3-8B KV shape: 32 layers, 8 KV heads, head_dim 128, "
                            "float16, block_size 16, 1024 blocks (128 KiB per token, 2 MiB "
                            "per block, 2 GiB pool)"}[cfg]
        w(f"{cfgdesc}.  `cache.check()` after the ops: "
          f"{'[] (consistent)' if chk and chk.get('ok') else chk and chk.get('problems')}\n")
        w("| op | shmkv | kernel-only | memcpy floor (same bytes, same working set) | "
          "numpy copy | " + " | ".join(PEERS) + " |")
        w("|---" * (5 + len(PEERS)) + "|")
        for op in ops:
            s = _find(recs, section="ops", op=op, config=cfg, impl="shmkv")
            f = _find(recs, section="ops", op=op, config=cfg, impl=FLOOR)
            fl = _floor_ns(recs, op, cfg)
            base = s and s["median_ns"]
            if op == "life":
                kern = _cell(_find(recs, section="ops", op=op, config=cfg,
                                   impl="shmkv kernel alloc+free")) + "<br>(1 block alloc+free)"
            elif op in COPY_OPS:
                kern = "memcpy floor →"
            else:
                kern = "–"
            npc = _find(recs, section="ops", op=op, config=cfg, impl="numpy copy")
            scell = _cell(s, fl)
            diag = [r for r in recs if r.get("section") == "ops" and r.get("op") == op
                    and r.get("config") == cfg and r.get("kind") == "diagnostic"]
            if diag and fl:
                scell += "<br>*alignment variants, taken in turn (compare among themselves):*"
                for d in diag:
                    scell += (f"<br>{d['impl'].split(', ', 1)[1]}: {fmt_ns(d['median_ns'])} "
                              f"(×{d['median_ns'] / fl:.2f})")
            fcell = "–"
            if f:
                fa = _find(recs, section="ops", op=op, config=cfg, impl=FLOOR_AFTER)
                fcell = _cell(f) + (f"<br>again after shmkv: {fmt_ns(fa['median_ns'])}"
                                    if fa else "") + f"<br>floor used: **{fmt_ns(fl)}**"
            cells = [f"{op}: {_title(op)}" + (f" ({_bytes(s['nbytes'])})" if s and s.get(
                "nbytes") else ""), scell, kern, fcell,
                _cell(npc, fl) if npc else "–"]
            for p in PEERS:
                r = _find(recs, section="ops", op=op, config=cfg, impl=p)
                c = _cell(r, fl) if fl else _cell(r, base=base)
                pa = _find(recs, section="ops", op=op, config=cfg, impl=f"{p} alloc+free")
                if pa:
                    c += f"<br>pool alone, 1 block alloc+free: {fmt_ns(pa['median_ns'])}"
                cells.append(c)
            w("| " + " | ".join(cells) + " |")
        w("")
        if any(_find(recs, section="ops", op=o, config=cfg, impl="np.empty x2")
               for o in ("gather1k_new",)):
            a = _find(recs, section="ops", op="gather1k_new", config=cfg, impl="np.empty x2")
            b = _find(recs, section="ops", op="gather1k_new", config=cfg,
                      impl="np.empty x2 + page faults")
            w(f"Fresh-array cost beside `gather1k_new`: two `np.empty` of the output shape "
              f"{fmt_ns(a['median_ns'])}; with the first write to each page (the faults the "
              f"gather pays) {fmt_ns(b['median_ns'])}.\n")
        w("Floors per size (steady state, first pass cancelled):\n")
        w("| op | bytes | memcpy hot (span = bytes) | memcpy matched (span) | "
          "memcpy cold (256 MiB span) | numpy copy | streaming copy matched (what shmkv "
          "uses at >= 8 MiB per array) |")
        w("|---|---|---|---|---|---|---|")
        for op in ops:
            if op not in COPY_OPS:
                continue
            h = _find(recs, section="ops", op=op, config=cfg, impl="memcpy hot")
            mt = _find(recs, section="ops", op=op, config=cfg, impl=FLOOR)
            c = _find(recs, section="ops", op=op, config=cfg, impl="memcpy cold")
            npc = _find(recs, section="ops", op=op, config=cfg, impl="numpy copy")
            stc = _find(recs, section="ops", op=op, config=cfg, impl="streaming copy matched")
            w(f"| {op} | {_bytes(h['nbytes'])} | {_cell(h)} | {_cell(mt)} "
              f"({_bytes(mt.get('span', 0))}) | {_cell(c)} | {_cell(npc)} | "
              f"{_cell(stc) if stc else '–'} |")
        w("")

    sc = [r for r in recs if r.get("section") in ("scaling", "threads")]
    if sc:
        w("## Scaling\n")
        w("Processes (spawned) on one segment, each looping for a fixed time after a common "
          "barrier; aggregate = sum of the per-process rates (median over repeats).  "
          "`life` = create_sequence + reserve(block_size) + free; `append` = 64 one-token "
          "appends into a fresh sequence, then free (amortised); `alloc_free_kernel` = "
          "bench_alloc_free in every process.  Threads: gather 1k tokens (out=) in one "
          "process.  The machine has 2 cores: 4 workers share them.\n")
        w("| what | config | workers | aggregate | per op, group | per op, each worker | "
          "speedup vs 1 |")
        w("|---|---|---|---|---|---|---|")
        for r in sc:
            agg = r["aggregate_ops_s"]
            unit = "calls/s" if r["section"] == "threads" else "ops/s"
            tag = f", rounds of {r['paired_with']}" if r["op"] == "cpu_ceiling" and r.get(
                "paired_with") else ""
            w(f"| {r['section']}: {r['op']} ({r['impl']}{tag}) | {r['config']} | {r['workers']} | "
              f"{_rate(agg)} {unit} | {fmt_ns(r['median_ns'])} | "
              f"{fmt_ns(r.get('per_worker_ns_median'))} | ×{r['speedup_vs_1']:.2f} |")
        w("")
        for r in sc:
            if r.get("note") and r["workers"] == 1 and r["section"] == "threads":
                w(f"- {r['impl']}: {r['note']}")
        w("")
        for r in recs:
            if r.get("op") == "check_after_scaling":
                w(f"`cache.check()` after the {r['config']} scaling runs: "
                  f"{'[] (consistent)' if r.get('ok') else r.get('problems')}\n")
    w(f"![shmkv vs peers vs floor]({chart_rel})\n")
    w("Raw records (every sample statistic, quartiles, calls per sample): "
      "`benchmarks/out/results.json`.\n")
    return "\n".join(out)


def _title(op):
    import suite
    return suite.OP_TITLES.get(op, op)


def _bytes(n):
    if not n:
        return "–"
    for u, s in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= u:
            return f"{n / u:g} {s}"
    return f"{n} B"


def _rate(x):
    if x >= 1e6:
        return f"{x / 1e6:.2f} M"
    if x >= 1e3:
        return f"{x / 1e3:.1f} k"
    return f"{x:.1f}"


# ---- chart -----------------------------------------------------------------------------
def draw_chart(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    recs = results["records"]
    impls = [("shmkv", "#1f77b4"), (FLOOR, "#2ca02c"), ("numpy copy", "#98df8a")] + list(
        zip(PEERS, ("#ff7f0e", "#d62728", "#9467bd", "#8c564b")))
    cfgs = [c for c in ("small", "llama") if _find(recs, section="ops", config=c, impl="shmkv")]
    sc = [r for r in recs if r.get("section") in ("scaling", "threads")]
    ncol = len(cfgs) + (1 if sc else 0)
    fig, axes = plt.subplots(1, max(ncol, 1), figsize=(7.5 * max(ncol, 1), 8), squeeze=False)
    for ax, cfg in zip(axes[0], cfgs):
        ops = [o for o in ("life", "reserve1", "fork1k", "append1", "prefill512",
                           "gather1k_out", "gather1k_new", "bbt256")
               if _find(recs, section="ops", op=o, config=cfg, impl="shmkv")]
        h = 0.8 / len(impls)
        for j, (impl, color) in enumerate(impls):
            ys, xs, lo, hi = [], [], [], []
            for i, op in enumerate(ops):
                r = _find(recs, section="ops", op=op, config=cfg, impl=impl)
                if r is None or not r.get("median_ns"):
                    continue
                ys.append(i + (j - len(impls) / 2 + 0.5) * h)
                xs.append(r["median_ns"])
                lo.append(r["median_ns"] - r["p10_ns"])
                hi.append(r["p90_ns"] - r["median_ns"])
            if xs:
                ax.barh(ys, xs, height=h, color=color, label=impl,
                        xerr=np.array([lo, hi]), error_kw={"lw": 0.6, "capsize": 1.5})
        ax.set_yticks(range(len(ops)))
        ax.set_yticklabels(ops)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ns per call (median, p10–p90), log scale")
        ax.set_title(f"{cfg} config: shmkv vs peers vs memcpy floor")
        ax.grid(axis="x", which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    if sc:
        ax = axes[0][-1]
        series = {}
        for r in sc:
            tag = f", rounds of {r['paired_with']}" if r["op"] == "cpu_ceiling" and r.get(
                "paired_with") else ""
            series.setdefault(f"{r['section']}: {r['op']} {r['config']} ({r['impl']}{tag})",
                              []).append((r["workers"], r["speedup_vs_1"]))
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)
        for label, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.plot([1, 2, 4], [1, 2, 2], "k:", lw=1, label="ideal on 2 cores")
        ax.set_xticks([1, 2, 4])
        ax.set_xlabel("processes / threads")
        ax.set_ylabel("aggregate throughput vs 1")
        ax.set_title("scaling on one segment")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Results files of the other benchmark scripts, appended to RESULTS.md in this order so
# that one file holds every result: (file, markers or None).  prefix_bench.py,
# transformers_bench.py, quant_bench.py/quant_accuracy.py and tier_bench.py write their
# own file; attention_bench.py also splices its section into RESULTS.md between markers.
SECTIONS = (("RESULTS_prefix.md", None),
            ("RESULTS_attention.md", "attention-bench"),
            ("RESULTS_quant.md", "quant-bench"),
            ("RESULTS_transformers.md", "transformers-bench"),
            ("RESULTS_tier.md", "tier-bench"))


def _section(fname, mark, here):
    path = os.path.join(here, fname)
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        body = f.read().strip()
    if mark is None:          # a file of its own level-1 title: one level down
        lines = [("#" + ln) if ln.startswith("#") else ln for ln in body.splitlines()]
        return "\n\n" + "\n".join(lines) + "\n"
    return f"\n\n<!-- {mark} -->\n{body}\n<!-- /{mark} -->\n"


def extra_sections(here=None):
    """Every other benchmark's section (SECTIONS), for the end of RESULTS.md."""
    here = here or os.path.dirname(os.path.abspath(__file__))
    return "".join(_section(f, m, here) for f, m in SECTIONS)
