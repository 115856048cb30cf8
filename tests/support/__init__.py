"""What the tests share besides fixtures: segment names, the small config, the ISA paths.

Test modules import these from here (``from support import SMALL, unique_name``; pytest
puts ``tests/`` on ``sys.path``, pyproject's ``pythonpath``), never from ``conftest``: a
conftest is pytest's to import (under ``--import-mode=importlib`` as ``tests.conftest``),
and importing it again by the bare name ``conftest`` made a second copy of it, and in
tests/vllm a name that two conftest.py files could answer to.  tests/conftest.py builds its
fixtures on these.
"""
import os
import uuid

from shmkv import _attention

# a segment small enough for every test that does not need a particular shape
SMALL = dict(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=64, block_size=4,
             max_seqs=32)


def unique_name(tag="t"):
    return f"shmkv-test-{tag}-{os.getpid()}-{uuid.uuid4().hex[:10]}"


def unlink_segment(name):
    """Removes the segment ``name`` from /dev/shm if it is there."""
    import posix_ipc

    try:
        posix_ipc.unlink_shared_memory("/" + name.lstrip("/"))
    except posix_ipc.ExistentialError:
        pass


# The attention kernel's instruction-set paths this CPU can run (scalar runs everywhere).
# "amx" is avx512 with the prefill items on AMX-BF16 tiles.
_ISA_ORDER = ("scalar", "avx2", "avx512", "amx")
ISAS = [n for n in _ISA_ORDER if _ISA_ORDER.index(n) <= _ISA_ORDER.index(_attention.cpu_isa())]
