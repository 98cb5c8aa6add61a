#!/usr/bin/env bash
# Create .venv and install vlm-assets with its pinned dependencies (idempotent; no model downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.vlm-assets-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[test]"
  touch "$stamp"
fi
# The package's bytecode, as an installed wheel has it: every process a run starts (workers, step
# helpers) would otherwise compile its modules again where Python is told not to write bytecode
# (PYTHONDONTWRITEBYTECODE, common in containers).
.venv/bin/python -m compileall -q vlm_assets
