#!/usr/bin/env bash
# The main job: a local 1P1D cluster on the tiny model behind the proxy, with one demo request; Ctrl-C stops it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup-venv.sh"
VENV="${P2PKV_VENV:-$ROOT/.venv}"
exec "$VENV/bin/p2pkv" up --demo "$@"
