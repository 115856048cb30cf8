"""Reading what a spawned process printed, whatever warnings it printed besides.

A dependency outside its tested range makes shmkv warn once (``ShmkvVersionWarning``, on
stderr, two lines: the warning and its source line).  A test that parses a process's
output reads past such lines: what the test checks must not change with the versions
installed.
"""
import re
import time

_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")


def stderr_lines(text):
    """The lines of `text` (a process's stderr) less any Python warnings in it."""
    out, skip = [], False
    for line in text.strip().splitlines():
        if _WARNING.match(line):
            skip = True                 # the warning's own line; its source line follows
            continue
        if skip and line.startswith("  "):
            skip = False
            continue
        skip = False
        out.append(line)
    return out


def readline_with(stream, marker, timeout=60.0):
    """The first line read from `stream` that contains `marker`, reading past any other
    (warnings); fails at end of stream or after `timeout` seconds of lines without it."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        if marker in line:
            return line
        seen.append(line)
    raise AssertionError(f"no line with {marker!r} in {seen!r}")
