#!/usr/bin/env bash
# The GPU kit (docs/development.md, "The GPU kit"): on the device machine, installs what its image lacks
# from the wheels in .whl/ (bench/gpu/wheels.sh made them here), keeps the image's CUDA torch, then runs
# bench/gpu/kit.py (the CUDA tier, the 7B-shaped checkpoint, the benchmark, the profile) into $OUT.
#   bench/gpu/run.sh [kit.py flags]          on the device machine: OUT is set there
#   bench/gpu/run.sh --dry [kit.py flags]    here, on the CPU, with the project's venv
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/mmserve-gpu-kit}
mkdir -p "$OUT"
if [[ " $* " == *" --dry "* ]]; then
    PY=${PY:-.venv/bin/python}
else
    PY=python3
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl >/tmp/mmserve-install.log 2>&1 || { tail -20 /tmp/mmserve-install.log; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    # the image's torchvision (a CUDA build matching its torch) serves the tests' HF video reference
    export MMSERVE_REFERENCE_OWN_TORCHVISION=1 HF_HUB_OFFLINE=1
fi
exec "$PY" bench/gpu/kit.py --out "$OUT" "$@"
