"""tools/chaos -- the crash-safety proof of shmkv (run: python tools/chaos [flags]).

N worker processes run random create / append / fork / reserve+write / gather / paged
read / free / detach / adopt / recover / check loops on one segment.  A controller
SIGKILLs random workers every few milliseconds and restarts them; about half of the
restarted workers are armed with a named crash point (shmkv._core.CRASH_POINTS: the
process _exit(86)s at that line, inside the critical section), round-robin over the
points that have the fewest deaths, so deaths land inside every critical section and
not only between calls.  Every `--phase` seconds and at the end the controller kills
every worker at once and audits the segment: check() before and after recover(), an
independent block audit from the read-only snapshot (every block not referenced by a
live sequence must be free), and every surviving (detached) sequence gathered and
compared token by token with what its writers appended.

How data is verified without a side channel that could lie
----------------------------------------------------------
* Every token is a deterministic function of (segment seed, position): K/V rows come
  from a fixed table indexed by (seed + position), and four elements of K (layer 0,
  head 0) spell out the seed, the start of its lineage segment and the position.  A
  fork child continues its parent's lineage up to the fork point and then gets a new
  seed, so a copy-on-write slip shows as the wrong seed at the wrong place.  Any read
  (gather, fork, lock-free paged read) can check a sequence's structure from the data
  alone.
* A small shared journal (an mmap'd file, one double-buffered record per sequence
  slot, protected by a per-slot OFD lock that the kernel drops when its holder dies)
  records each sequence's lineage, the length its writer saw confirmed (written only
  AFTER the call returned) and the operation in flight (written BEFORE the call).
  After a death, whoever takes the slot next resolves the record against the segment:
  an append in flight may have published all of its n tokens or none of them; every
  confirmed token must still be there, bit for bit.
* Ownership: a worker owns what it created, forked or adopted.  detach() hands a
  sequence to the "pool"; pool sequences survive any death and are appended to
  (under the slot's journal lock, without adopting), forked, read lock-free, adopted
  and freed by other workers.  Non-detached sequences of a dead worker must be
  reclaimed (counted); a detached one must never vanish.
* Every shmkv call is timed; a call longer than --bound seconds, or a LockTimeout, is
  a failure ("no surviving worker ever blocked more than the bound").

Exit status 0 only if there was no failure of any kind and the counts were met
(--min-kills SIGKILLs, --min-per-point deaths at every crash point).  With --plant NAME
every process runs with a planted bug (shmkv._core.PLANTED_BUGS); add --expect-failure
to exit 0 only if the harness caught it.

Workers are started with multiprocessing's forkserver (default; ~15 ms a start, so the
2-core CI machine spends its time on chaos, not on importing numpy) or spawn
(--start-method spawn).  Both import the worker code as the package `chaos` from tools/
(the controller puts tools/ on PYTHONPATH for them).

The modules, bottom to top:
  common       names, counter layout, states, the journal (Entry, Journal), the fill table
  codec        Codec (data that proves itself), Prompts, resolve_record
  worker_own   Worker operations on its own sequences          (mixin)
  worker_pool  Worker operations on pool (detached) sequences   (mixin)
  worker       Worker: state, timed calls, the loop; worker_entry (the process target)
  audit        the kill-all audits: the invariant checks          (mixin of Controller)
  report       the summary dict and its printed table            (mixin of Controller)
  controller   Controller: starts, kills and arms workers, runs checks and audits
  cli          parse_args, main;  __main__ runs main()
"""
from .cli import main, parse_args
from .codec import Codec, DataError, Prompts, resolve_record
from .common import DETACHED, I_APPEND, I_TRIM, SALT_BITS, Entry, Journal, _base_table
from .controller import Controller
from .worker import Worker, worker_entry

# the forkserver preloads this package: build the fill table once there, so every worker
# it forks inherits it instead of building its own
_base_table()

# what tests/test_chaos.py checks the harness's own parts with, and the entry points
__all__ = ["Codec", "Controller", "DataError", "Entry", "Journal", "Prompts", "Worker",
           "DETACHED", "I_APPEND", "I_TRIM", "SALT_BITS", "main", "parse_args",
           "resolve_record", "worker_entry"]
