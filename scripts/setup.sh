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
  # pip compiles every module it installs in one process; compileall below does it on every core.
  .venv/bin/python -m pip install --quiet --no-compile -e ".[test]"
  # Bytecode for what the environment imports (test suites shipped inside packages never are). A
  # module written for a newer Python (torch ships some) does not compile; pip's own pass skips it too.
  site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  .venv/bin/python -m compileall -q -j 0 -x '/tests?/' "$site" >/dev/null || true
  touch "$stamp"
fi
# The package's bytecode, as an installed wheel has it: every process a run starts (workers, step
# helpers) would otherwise compile its modules again where Python is told not to write bytecode
# (PYTHONDONTWRITEBYTECODE, common in containers).
.venv/bin/python -m compileall -q vlm_assets
