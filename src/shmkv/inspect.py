"""Read-only inspection of a segment, for operators and for tools that read raw bytes.

``snapshot(name, *, tables=True)`` copies out everything an operator may want to see of a
segment (its config, counts, processes, sequences, block reference counts and flags, the
event ring's head) through a read-only mapping: it takes no lock and registers nothing,
so it works on a segment whose processes all died, never changes one, and cannot be
blocked by a process that holds a lock.  The ``shmkv`` CLI's inspection commands read
segments through it.

``struct_layout()`` gives the sizes and field offsets of the segment's C structs, taken
from the C structs themselves, for tools that read raw segment bytes (fuzzers,
debuggers).
"""
from ._inspect import snapshot, struct_layout

__all__ = ["snapshot", "struct_layout"]
