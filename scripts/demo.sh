#!/usr/bin/env bash
# The main job: a local 1P1D cluster on SmolLM2-135M-Instruct behind the proxy, asked one question through its chat
# API (the answer and the proof that the KV moved are printed); Ctrl-C stops it. `--model tiny|DIR` serves another.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup-venv.sh"
VENV="${P2PKV_VENV:-$ROOT/.venv}"
exec "$VENV/bin/p2pkv" up --demo --model smollm2 "$@"
