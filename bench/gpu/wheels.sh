#!/usr/bin/env bash
# Downloads bench/gpu/wheels.txt as Python 3.12 x86-64 manylinux wheels into .whl/ (git-ignored), the
# folder the GPU kit carries to the device machine and installs there (bench/gpu/run.sh). Run it here,
# where PyPI is reachable; it fetches nothing twice.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl
platforms=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
    manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 linux_x86_64; do
    platforms+=(--platform "$p")
done
grep -v '^\s*#' bench/gpu/wheels.txt | grep -v '^\s*$' | while read -r req; do
    name=${req%%==*}
    stem=$(echo "$name" | tr '-' '_' | tr 'A-Z' 'a-z')
    if ls .whl 2>/dev/null | tr 'A-Z' 'a-z' | grep -q "^${stem}-${req##*==}-"; then
        continue
    fi
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$req"
done
du -sh .whl
