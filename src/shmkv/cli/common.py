"""Bottom layer of the CLI: constants (exit codes, block states, model presets), the
one expected-failure exception ``CLIError``, and small parsers shared by every command
(``parse_size``, ``model_str``).  Imports nothing else of ``shmkv.cli``."""
from __future__ import annotations

import argparse
import math
import struct

from .. import _core

SHM_DIR = "/dev/shm"


# First 8 bytes of every shmkv segment (SHMKV_MAGIC of _layout.h: "__SHMKV1" read as a
# little-endian u64).  Used only to decide which files in /dev/shm `ls` reports.
MAGIC = _core.MAGIC


MAGIC_BYTES = struct.pack("<Q", MAGIC)


EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


# Block states, in increasing severity (the PNG and the ASCII map use them).
FREE, CACHED, OWNED, SHARED, DEAD = 0, 1, 2, 3, 4


STATE_NAMES = ("free", "cached", "owned", "shared", "dead")


def _preset(model, num_layers, num_kv_heads, head_dim, block_size=16, note="", **more):
    """(config fields, help): the help says the shape the fields give."""
    fields = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  block_size=block_size, dtype="float16", **more)
    shape = (f"{num_layers} layers, {num_kv_heads} kv heads, head_dim {head_dim}, float16, "
             f"block {block_size}")
    if "num_blocks" in more:
        shape += f", {more['num_blocks']} blocks"
    return fields, (f"{model}: {shape}" if model else shape) + note


# name: (config fields, help); num_blocks comes from --blocks / --memory unless given
PRESETS = {
    "tiny": _preset("", 2, 2, 8, 4, " (for tests)", num_blocks=64, max_seqs=32),
    "llama3-8b": _preset("Llama 3 8B", 32, 8, 128),
    "llama3-70b": _preset("Llama 3 70B", 80, 8, 128),
    "llama2-7b": _preset("Llama 2 7B", 32, 32, 128),
    "mistral-7b": _preset("Mistral 7B", 32, 8, 128),
}


class CLIError(Exception):
    """An expected failure: one line on stderr, then exit with ``code``."""

    def __init__(self, message, code=EXIT_USAGE):
        super().__init__(message)
        self.code = code


def model_str(cfg):
    return (f"{cfg.num_layers}L {cfg.num_kv_heads}H {cfg.head_dim}D "
            f"{cfg.dtype} bs{cfg.block_size}")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024 ** 2,
               "mb": 1000 ** 2, "mib": 1024 ** 2, "g": 1024 ** 3, "gb": 1000 ** 3,
               "gib": 1024 ** 3, "t": 1024 ** 4, "tb": 1000 ** 4, "tib": 1024 ** 4}


def parse_size(text):
    """'8GiB', '512M', '1.5GB', '1048576' -> bytes (K/M/G/T and KiB.. are powers of 1024;
    KB/MB/GB/TB powers of 1000)."""
    s = text.strip().replace("_", "")
    i = len(s)
    while i and not (s[i - 1].isdigit() or s[i - 1] == "."):
        i -= 1
    num, unit = s[:i], s[i:].strip().lower()
    if unit not in _SIZE_UNITS or not num:
        raise argparse.ArgumentTypeError(
            f"expected a size like 8GiB, 512MiB, 1.5GB or a number of bytes, got {text!r}")
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return int(value * _SIZE_UNITS[unit])


def plural(n, one, many=None):
    """'1 dead process', '2 dead processes': the count and the noun that agrees with it
    (``many`` defaults to ``one + "s"``; "process" -> "processes")."""
    if many is None:
        many = one + ("es" if one.endswith("s") else "s")
    return f"{n} {one if n == 1 else many}"


def held_by_dead(pids):
    """'held by a dead process (pid 7)' / 'held by dead processes (pid 7, 9)'."""
    pids = list(pids)
    who = "a dead process" if len(pids) == 1 else "dead processes"
    return f"held by {who} (pid {', '.join(map(str, pids)) or '?'})"


def shmkv_version():
    from .. import __version__

    return __version__
