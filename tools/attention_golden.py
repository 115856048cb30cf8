"""Regenerates tests/data/attention_default.json: the digests of the attention kernel's
default-precision results on every scalar/vector path this CPU runs (see
tests/attn_golden.py).  Run it only for a deliberate change to the default arithmetic, and
say so in the commit; paths this CPU cannot run keep their recorded digests.

    .venv/bin/python tools/attention_golden.py
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from attn_golden import digests  # noqa: E402

PATH = os.path.join(HERE, "..", "tests", "data", "attention_default.json")


def main():
    old = {}
    if os.path.exists(PATH):
        with open(PATH) as f:
            old = json.load(f)
    new = {**old, **digests()}
    with open(PATH, "w") as f:
        json.dump(new, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"{PATH}: {', '.join(f'{k} ({len(v)} cases)' for k, v in sorted(new.items()))}")


if __name__ == "__main__":
    main()
