"""Regenerates tests/data/attention_default.json: the digests of the attention kernel's
default-precision results on every scalar/vector path this CPU runs (see
tests/support/attn_golden.py).  Run it only for a deliberate change to the default
arithmetic, and say so in the commit; paths this CPU cannot run keep their recorded digests.

    .venv/bin/python tools/attention_golden.py
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from support.attn_golden import digests  # noqa: E402

PATH = os.path.join(HERE, "..", "tests", "data", "attention_default.json")


def main():
    from shmkv import _attention

    old = {"digests": {}}
    if os.path.exists(PATH):
        with open(PATH) as f:
            old = json.load(f)
    build = _attention._build()
    if old.get("build") not in (None, build):
        raise SystemExit(f"{PATH} holds digests of a {old['build']!r} build; this one is "
                         f"{build!r}: regenerate every path on that build, or all here")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                            capture_output=True, text=True).stdout.strip()
    new = {"build": build, "recorded_at": commit,
           "digests": {**old["digests"], **digests()}}
    with open(PATH, "w") as f:
        json.dump(new, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{PATH} ({build}): " + ", ".join(f"{k} ({len(v)} cases)"
                                              for k, v in sorted(new["digests"].items())))


if __name__ == "__main__":
    main()
