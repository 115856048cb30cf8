#!/usr/bin/env bash
# make dist-check: the artifacts a user or a packager gets, checked as they would use them.
#   1. python -m build: the sdist, then the wheel built *from that sdist* (so a file the
#      sdist lacks fails the build here, not on a mirror);
#   2. twine check --strict on both; LICENSE, README, CHANGELOG and every .pyx/.pxd/.pyi/.h
#      of the checkout in the sdist;
#   3. auditwheel show: the platform policy the wheel meets (a plain `pip wheel` on this
#      machine is linux_x86_64; a manylinux wheel for an index comes from cibuildwheel,
#      configured in pyproject.toml);
#   4. the wheel installed into a fresh venv from /tmp (outside the checkout) and
#      tools/dist_smoke.py run with it.  The sdist is not built a second time by a
#      `pip install` of it: step 1 already built the wheel from it in an isolated build
#      environment (the same PEP 517 build pip runs), and step 4 runs that wheel.
# Work and results in .dist-check/ (the wheel and sdist in .dist-check/dist).
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

step "tools venv (build, twine, auditwheel)"
"$PYTHON" -m venv "$OUT/tools"
T=$OUT/tools/bin
"$T/python" -m pip --disable-pip-version-check install -q -U pip
"$T/python" -m pip --disable-pip-version-check install -q "build>=1.2" "twine>=6.1" "auditwheel>=6.1"

step "python -m build (sdist, then the wheel from the sdist)"
# build from a clean copy of the tracked files: a stale build/ or generated C in the
# checkout must not reach the artifacts
git ls-files -z | (mkdir -p "$OUT/src" && xargs -0 cp --parents -t "$OUT/src")
(cd "$OUT/src" && "$T/python" -m build --outdir "$OUT/dist" . >"$OUT/build.log" 2>&1) \
    || { tail -40 "$OUT/build.log"; exit 1; }
SDIST=$(ls "$OUT"/dist/shmkv-*.tar.gz)
WHEEL=$(ls "$OUT"/dist/shmkv-*.whl)
ls -l "$OUT/dist"

step "twine check --strict"
"$T/twine" check --strict "$SDIST" "$WHEEL"

step "the sdist carries what a build needs"
tar tzf "$SDIST" | sed 's|^[^/]*/||' | sort >"$OUT/sdist.txt"
missing=0
for f in LICENSE README.md CHANGELOG.md setup.py pyproject.toml MANIFEST.in \
         $(git ls-files 'shmkv/*.pyx' 'shmkv/*.pxd' 'shmkv/*.pyi' 'shmkv/*.h' 'shmkv/py.typed' \
                        'shmkv/kernels/*' 'shmkv/*.py' 'shmkv/**/*.py'); do
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

step "auditwheel show"
"$T/auditwheel" show "$WHEEL" | tee "$OUT/auditwheel.txt"

step "a fresh venv from the wheel (built from the sdist), installed and run from /tmp"
"$PYTHON" -m venv "$OUT/venv-wheel"
(cd /tmp && PIP_CONSTRAINT=$ROOT/constraints/main.txt \
    "$OUT/venv-wheel/bin/python" -m pip --disable-pip-version-check install -q "$WHEEL" \
    >"$OUT/install-wheel.log" 2>&1) || { tail -40 "$OUT/install-wheel.log"; exit 1; }
(cd /tmp && "$OUT/venv-wheel/bin/python" "$ROOT/tools/dist_smoke.py")
(cd /tmp && "$OUT/venv-wheel/bin/shmkv" --version)
step "ok: $(du -k "$WHEEL" | cut -f1) KiB wheel, $(du -k "$SDIST" | cut -f1) KiB sdist"
