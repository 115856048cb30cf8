"""tools/sanitize/cov_functions.py -- the C kernels' functions by line coverage, least
covered first, from gcovr's JSON (make coverage).  Owns only this report.

A header compiled into several modules is one file to gcovr (its counts merged), so a
function is one row whatever the number of copies.

    python tools/sanitize/cov_functions.py .coverage-c/coverage.json [--top N]
"""
import argparse
import json
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    with open(a.json) as f:
        data = json.load(f)
    lines: dict = defaultdict(dict)           # (file, function) -> {line: count}
    for fi in data["files"]:
        for ln in fi["lines"]:
            key = (fi["file"], ln.get("function_name") or "?")
            mine = lines[key]
            mine[ln["line_number"]] = mine.get(ln["line_number"], 0) + ln["count"]
    total = sum(len(v) for v in lines.values())
    hit = sum(1 for v in lines.values() for c in v.values() if c > 0)
    rows = []
    for (file, name), mine in lines.items():
        covered = sum(1 for c in mine.values() if c > 0)
        rows.append((covered / len(mine), covered - len(mine), file, name, covered, len(mine)))
    rows.sort()
    print(f"C kernels: {hit}/{total} lines covered ({100 * hit / max(total, 1):.1f}%), "
          f"{len(rows)} functions, {sum(1 for r in rows if r[4] == 0)} never run")
    print(f"{'cover':>6} {'missed':>6}  function (file, lines covered)")
    for frac, neg_missed, file, name, covered, n in rows[: a.top]:
        print(f"{100 * frac:5.1f}% {-neg_missed:6d}  {name} ({file}, {covered}/{n})")


if __name__ == "__main__":
    main()
