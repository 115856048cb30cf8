"""Build of the shmkv extensions.

One extension per Cython module.  ``shmkv._core`` is the handle's base (mapping,
attachment, Segment, the status translator, the crash-point switches, a C API in
``_core.pxd``); ``_inspect``, ``_prefix``, ``_sequences``, ``_quant`` and ``_kvdata`` are the links of
the method chain that ``KVCache`` ends, each a ``cdef class`` subclassing the one below
it across modules (declared in its ``.pxd``).  Each of them compiles the static C kernels
of ``kernels/*.h`` (through ``_core.pxd``) and binds their debug switches to ``_core``'s
at import.  ``shmkv._attention`` is the paged-attention kernel (``kernels/attention.c``)
with its wrapper.  ``SHMKV_DEBUG=1`` builds the debug variant: C asserts and the
``SHMKV_DEBUG`` blocks on, Cython bounds checks on, no optimisation.  ``shmkv._bench``
holds the benchmark and test hooks (kernels/bench.h, kernels/bench_floor.h) so that the
shipped modules do not; ``shmkv._checksum`` the tier's value checksum (kernels/checksum.h).

The generated C (``src/shmkv/_*.c``) is of one variant at a time, named in ``.cython-variant``:
a build of the other variant regenerates it (cythonize compares only timestamps, and a
change of directives does not count); ``SHMKV_CYTHON_FORCE=1`` regenerates it whatever
(make debug, sanitize and coverage set it).
``SHMKV_EXTRA_CFLAGS`` / ``SHMKV_EXTRA_LDFLAGS`` (split on spaces) are appended after the
project's own flags, so they win over them (make sanitize: ``-O1 -fsanitize=...
-fno-wrapv``; Python's CFLAGS carry ``-fwrapv``, which would turn UBSan's signed-overflow
checks off).  The compiler is the usual ``CC``.

A release build with no extra flags ships stripped extensions: ``-g0`` after Python's own
``-g`` and ``-Wl,--strip-debug`` at link (debug info made the wheel 5.6 MB; the symbol
table stays, so perf and gdb still name the functions).  ``SHMKV_KEEP_DEBUG=1`` keeps it;
a debug build and any build given ``SHMKV_EXTRA_CFLAGS`` / ``SHMKV_EXTRA_LDFLAGS``
(sanitizers, coverage) are never stripped.
"""
import glob
import os
import shlex

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("SHMKV_DEBUG", "") not in ("", "0")

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": False,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
    "freethreading_compatible": False,
}

cflags = ["-std=gnu11", "-Wall", "-Wno-unreachable-code"]
if DEBUG:
    cflags += ["-O0", "-g", "-DSHMKV_DEBUG=1", "-UNDEBUG"]
else:
    cflags += ["-O2", "-DNDEBUG"]
EXTRA_CFLAGS = shlex.split(os.environ.get("SHMKV_EXTRA_CFLAGS", ""))
EXTRA_LDFLAGS = shlex.split(os.environ.get("SHMKV_EXTRA_LDFLAGS", ""))
STRIP = (not DEBUG and not EXTRA_CFLAGS and not EXTRA_LDFLAGS
         and os.environ.get("SHMKV_KEEP_DEBUG", "") in ("", "0"))
ldflags = []
if STRIP:
    cflags += ["-g0"]
    ldflags += ["-Wl,--strip-debug"]
cflags += EXTRA_CFLAGS
ldflags += EXTRA_LDFLAGS

KERNELS = sorted(h for h in glob.glob("src/shmkv/kernels/*.h") if "attention" not in h)
PXD = ["src/shmkv/_layout.pxd", "src/shmkv/_sizes.pxd", "src/shmkv/_core.pxd"]

# the handle's base first, then the method chain bottom-up (each .pxd cimports the one below)
CHAIN = [("_sizes", []),    # the C layout's binding, below config and _core
         ("_core", []), ("_inspect", ["_inspect"]), ("_prefix", ["_inspect", "_prefix"]),
         ("_sequences", ["_inspect", "_prefix", "_sequences"]),
         ("_quant", ["_inspect", "_prefix", "_sequences", "_quant"]),
         ("_kvdata", ["_inspect", "_prefix", "_sequences", "_quant"]),
         ("_events", []),       # the KV event ring's reader (not a link of the chain)
         ("_vcopy", []),        # the vLLM connector's block copy (no segment access)
         ("_checksum", [])]     # the tier's value checksum (kernels/checksum.h)


def _module(name, pxds):
    return Extension(
        f"shmkv.{name}",
        sources=[f"src/shmkv/{name}.pyx"],
        include_dirs=["src/shmkv", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=cflags,
        extra_link_args=ldflags,
        libraries=["rt", "pthread"],
        depends=["src/shmkv/_layout.h"] + PXD + [f"src/shmkv/{p}.pxd" for p in pxds] + KERNELS,
    )


# paged attention: its own module and C file; it reaches the segment through _core's C API
attention = Extension(
    "shmkv._attention",
    sources=["src/shmkv/_attention.pyx", "src/shmkv/kernels/attention.c"],
    include_dirs=["src/shmkv", numpy.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    extra_compile_args=cflags,
    extra_link_args=ldflags,
    libraries=["m", "pthread"],
    depends=sorted(glob.glob("src/shmkv/kernels/attention*")) + ["src/shmkv/kernels/cpu.h",
             "src/shmkv/_attention.pxd"] + PXD,
)

# the benchmark and test hooks (numpy's _multiarray_tests pattern): kernels/bench.h over the
# pool's kernels, kernels/bench_floor.h on the attention kernel's pool (its runner is
# cimported from _attention); the shipped modules carry none of them
bench = _module("_bench", ["_attention"])

VARIANT, STAMP = ("debug" if DEBUG else "release"), ".cython-variant"
try:
    with open(STAMP) as f:
        same = f.read().strip() == VARIANT
except OSError:
    same = False
force = not same or os.environ.get("SHMKV_CYTHON_FORCE", "") not in ("", "0")
# every core: Cython's C generation and the C compilation each run one module per core
# (SHMKV_BUILD_JOBS overrides; a 2-core CI machine builds in about half the time)
JOBS = int(os.environ.get("SHMKV_BUILD_JOBS", "0")) or os.cpu_count() or 1
modules = cythonize([_module(n, p) for n, p in CHAIN] + [attention, bench], compiler_directives=directives,
                    gdb_debug=False, annotate=False, force=force, nthreads=JOBS)
with open(STAMP, "w") as f:
    f.write(VARIANT + "\n")
setup(ext_modules=modules, options={"build_ext": {"parallel": JOBS}})
