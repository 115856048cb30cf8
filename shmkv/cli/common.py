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


PRESETS = {
    # name: (config fields, help); num_blocks comes from --blocks / --memory unless given
    "tiny": (dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, num_blocks=64,
                  max_seqs=32, dtype="float16"),
             "2 layers, 2 kv heads, head_dim 8, float16, block 4, 64 blocks (for tests)"),
    "llama3-8b": (dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                       dtype="float16"),
                  "Llama 3 8B: 32 layers, 8 kv heads, head_dim 128, float16, block 16"),
    "llama3-70b": (dict(num_layers=80, num_kv_heads=8, head_dim=128, block_size=16,
                        dtype="float16"),
                   "Llama 3 70B: 80 layers, 8 kv heads, head_dim 128, float16, block 16"),
    "llama2-7b": (dict(num_layers=32, num_kv_heads=32, head_dim=128, block_size=16,
                       dtype="float16"),
                  "Llama 2 7B: 32 layers, 32 kv heads, head_dim 128, float16, block 16"),
    "mistral-7b": (dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                        dtype="float16"),
                   "Mistral 7B: 32 layers, 8 kv heads, head_dim 128, float16, block 16"),
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


def shmkv_version():
    from .. import __version__

    return __version__
