#!/usr/bin/env bash
# Wheels the GPU machine lacks (its Python 3.12 has torch, numpy, httpx and prometheus-client, not msgspec, pyzmq or xxhash), into
# .whl/ (ignored by git). scripts/gpu_check.sh installs them into a scratch directory when it finds them there.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
[ -x "$ROOT/.venv/bin/python" ] && PYTHON="$ROOT/.venv/bin/python"
mkdir -p "$ROOT/.whl"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$ROOT/.whl" "msgspec==0.23.0" "pyzmq==27.3.0" "xxhash==4.1.0"
ls "$ROOT/.whl"
