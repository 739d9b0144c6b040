#!/usr/bin/env bash
# Every GPU check in one command (under 5 minutes on one H200): a table of rows, exit status 1 if any fails.
# On a machine without a CUDA device every row is skipped and the exit status is 0.
# On a machine without msgspec, pyzmq or xxhash (the lent GPU machine), run scripts/gpu_wheels.sh here first and
# carry `.whl`: the wheels found there are installed into a scratch directory.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
[ -x "$ROOT/.venv/bin/python" ] && [ -z "${P2PKV_GPU_PYTHON:-}" ] && PYTHON="$ROOT/.venv/bin/python"
PYTHON="${P2PKV_GPU_PYTHON:-$PYTHON}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
if ! "$PYTHON" -c "import msgspec, zmq, xxhash" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  site="$(mktemp -d)"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:$site"
fi
# The pytest suite's GPU tests (marker `gpu`) are these same rows, one test each; they are not run again here.
exec "$PYTHON" -m p2pkv.bench.gpu_check
