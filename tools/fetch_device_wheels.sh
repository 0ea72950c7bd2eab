#!/usr/bin/env bash
# Download the pure-Python wheels linvit_mm imports (mmengine, mmcv-lite, mmpretrain and what
# they import) for a bare GPU machine with Python 3.12 and its own torch, into
# work_dirs/device_wheels (about 5 MB); tools/device_check.py installs them there when
# mmengine is missing. Needs the package index once, here.
#   bash tools/fetch_device_wheels.sh [PYTHON_VERSION]   (default 3.12)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python_version="${1:-3.12}"
out=work_dirs/device_wheels
mkdir -p "$out"
python="${PYTHON:-.venv/bin/python}"
"$python" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version "$python_version" --platform manylinux2014_x86_64 -d "$out" \
    mmengine==0.10.7 mmcv-lite==2.1.0 mmpretrain==1.2.0 addict yapf termcolor mat4py \
    model-index ordered-set markdown importlib-metadata==8.5.0 rich markdown-it-py mdurl \
    pygments platformdirs
ls "$out"
