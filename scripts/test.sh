#!/usr/bin/env bash
# The test command: set up the venv, then ruff, mypy (strict on the package) and the whole pytest suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup-venv.sh
VENV="${P2PKV_VENV:-$ROOT/.venv}"
echo "[test] ruff"
"$VENV/bin/ruff" check p2pkv tests examples
echo "[test] mypy --strict p2pkv"
"$VENV/bin/mypy" p2pkv
echo "[test] pytest"
exec "$VENV/bin/pytest" -q -ra --durations=15 "$@"
