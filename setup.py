"""Build of the shmkv extension.

Two extensions: ``shmkv._core``, the Cython class over the mapped segment with the C
kernels of ``kernels/*.h`` compiled into it, and ``shmkv._attention``, the paged-attention
kernel (``kernels/attention.c``) with its wrapper, which reaches the segment through the C
API that ``_core.pxd`` declares.  ``SHMKV_DEBUG=1`` builds the debug variant:
C asserts and the ``SHMKV_DEBUG`` blocks on, Cython bounds checks on, no optimisation.
"""
import glob
import os

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

cflags = ["-std=gnu11", "-Wall", "-Wno-unused-function", "-Wno-unreachable-code"]
if DEBUG:
    cflags += ["-O0", "-g", "-DSHMKV_DEBUG=1", "-UNDEBUG"]
else:
    cflags += ["-O2", "-DNDEBUG"]

core = Extension(
    "shmkv._core",
    sources=["shmkv/_core.pyx"],
    include_dirs=["shmkv", numpy.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    extra_compile_args=cflags,
    libraries=["rt", "pthread"],
    depends=(["shmkv/_layout.h", "shmkv/_layout.pxd", "shmkv/_core.pxd"]
             + sorted(h for h in glob.glob("shmkv/kernels/*.h") if "attention" not in h)),
)

# paged attention: its own module and C file; it reaches the segment through _core's C API
attention = Extension(
    "shmkv._attention",
    sources=["shmkv/_attention.pyx", "shmkv/kernels/attention.c"],
    include_dirs=["shmkv", numpy.get_include()],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    extra_compile_args=cflags,
    libraries=["m", "pthread"],
    depends=["shmkv/kernels/attention.h", "shmkv/kernels/attention_isa.h", "shmkv/_core.pxd"],
)

setup(ext_modules=cythonize([core, attention], compiler_directives=directives,
                            gdb_debug=False, annotate=False))
