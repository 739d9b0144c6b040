#!/usr/bin/env bash
# Every GPU check in one command (under 5 minutes on one H200): a table of rows, exit status 1 if any fails.
# On a machine without a CUDA device every row is skipped and the exit status is 0.
# The GPU tests of the pytest suite (marker `gpu`) run first; they skip with a reason without a GPU.
# On a machine without msgspec (the lent GPU machine), run scripts/gpu_wheels.sh here first and carry `.whl`:
# the wheels found there are installed into a scratch directory.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
[ -x "$ROOT/.venv/bin/python" ] && [ -z "${P2PKV_GPU_PYTHON:-}" ] && PYTHON="$ROOT/.venv/bin/python"
PYTHON="${P2PKV_GPU_PYTHON:-$PYTHON}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
if ! "$PYTHON" -c "import msgspec" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  site="$(mktemp -d)"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH="$PYTHONPATH:$site"
fi
status=0
if "$PYTHON" -c "import pytest" 2>/dev/null; then
  # Only the files holding GPU tests: the others import the proxy's web stack, which a GPU machine may lack.
  mapfile -t files < <(grep -l "pytest.mark.gpu" tests/unit/*.py)
  "$PYTHON" -m pytest -q -m gpu -rs -p no:cacheprovider "${files[@]}" || status=$?
  [ "$status" -eq 5 ] && status=0  # no test collected
fi
"$PYTHON" -m p2pkv.bench.gpu_check || status=1
exit "$status"
