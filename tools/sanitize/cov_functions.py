"""tools/sanitize/cov_functions.py -- the C kernels' functions by line coverage, least
covered first, from gcovr's JSON (make coverage).  Owns only this report.

    python tools/sanitize/cov_functions.py .coverage-c/coverage.json [--top N]
"""
import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    with open(a.json) as f:
        data = json.load(f)
    rows, total, hit = [], 0, 0
    for fi in data["files"]:
        lines = fi["lines"]
        # gcovr 8: functions carry their first line; a function's lines run to the next one
        funcs = sorted(((fn.get("lineno", 0), fn["name"], fn.get("execution_count", 0))
                        for fn in fi.get("functions", [])), key=lambda t: t[0])
        for i, (start, name, calls) in enumerate(funcs):
            end = funcs[i + 1][0] if i + 1 < len(funcs) else 1 << 30
            mine = {}
            for ln in lines:
                if start <= ln["line_number"] < end:
                    n = mine.get(ln["line_number"], 0)
                    mine[ln["line_number"]] = n + ln["count"]
            if not mine:
                continue
            covered = sum(1 for c in mine.values() if c > 0)
            rows.append((covered / len(mine), len(mine) - covered, fi["file"], name, calls,
                         covered, len(mine)))
        seen = {}
        for ln in lines:
            seen[ln["line_number"]] = seen.get(ln["line_number"], 0) + ln["count"]
        total += len(seen)
        hit += sum(1 for c in seen.values() if c > 0)
    # one row per (file, function): a header compiled into several modules appears once
    best: dict = {}
    for r in rows:
        key = (r[2], r[3])
        if key not in best or r[5] > best[key][5]:
            best[key] = r
    rows = sorted(best.values(), key=lambda r: (r[0], -r[1]))
    print(f"C kernels: {hit}/{total} lines covered ({100 * hit / max(total, 1):.1f}%)")
    print(f"{'cover':>6} {'missed':>6}  function (file)")
    for frac, missed, file, name, calls, covered, n in rows[: a.top]:
        print(f"{100 * frac:5.1f}% {missed:6d}  {name} ({file}, {covered}/{n} lines, "
              f"{calls} calls)")


if __name__ == "__main__":
    main()
