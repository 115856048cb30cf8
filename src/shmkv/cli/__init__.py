"""shmkv admin CLI: find segments, see who holds what, repair, watch live, export metrics.

Every inspection command (ls, info, seqs, blocks, procs, top, metrics) reads the segment
through ``shmkv.inspect.snapshot``: a read-only mapping, no lock, no registration in the process
table, every index clamped.  So it works on a segment whose processes all died, never
changes one, and cannot be blocked by a process that holds a lock.  Only ``check``,
``recover``, ``create`` and ``rm`` change anything, and they say so in their help.

Human output by default (aligned tables; colour only on a terminal), ``--json`` for
scripts: one JSON document on stdout.  Exit codes: 0 success, 1 a check found problems
(or ``rm`` refused), 2 usage or a segment that cannot be read.

The modules, bottom to top (each imports only those below it; no command module imports
another):
  common   constants, exit codes, presets, CLIError, size parsing
  reader   snapshot loading, error classification, analyze(), the /dev/shm scan, attach
  render   colour, tables, formatting, JSON output, the PNG pool map
  inspect  ls, info, seqs, procs, blocks            (read-only)
  manage   recover, check, create, rm               (change a segment or its name)
  live     top, metrics                             (watch over time)
  entry    the argument parser and main()
"""
from .common import parse_size
from .entry import main
from .live import exposition, parse_listen
from .reader import analyze, seg_name

# main is the entry point; the rest are what the tests and scripts call directly
__all__ = ["main", "analyze", "exposition", "parse_listen", "parse_size", "seg_name"]
