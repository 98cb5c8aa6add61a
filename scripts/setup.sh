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
  # uv installs what pip would, given pip's settings (scripts/uv_pip_install.py), unpacking on every
  # core where pip uses one; it is fetched into a folder of its own, not the project's environment.
  # Where it cannot be had or fails, pip installs.
  tools="$(mktemp -d)"
  if .venv/bin/python -m pip install --quiet --target "$tools" uv >/dev/null 2>&1 \
      && .venv/bin/python scripts/uv_pip_install.py "$tools/bin/uv" .venv/bin/python --quiet -e ".[test]"; then
    :
  else
    echo "installing with pip instead of uv"
    .venv/bin/python -m pip install --quiet --upgrade pip
    # Without bytecode: where it is wanted up front, compileall below writes it on every core.
    .venv/bin/python -m pip install --quiet --no-compile -e ".[test]"
  fi
  rm -rf "$tools"
  # Where Python is told not to write bytecode (PYTHONDONTWRITEBYTECODE, common in containers), every
  # process would compile what it imports again: compile the environment once here instead (test
  # suites shipped inside packages never are imported). A module written for a newer Python (torch
  # ships some) does not compile; pip's own pass skips it too. Elsewhere each module's first import
  # writes its bytecode.
  if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
    site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    .venv/bin/python -m compileall -q -j 0 -x '/tests?/' "$site" >/dev/null || true
  fi
  touch "$stamp"
fi
# The package's bytecode, as an installed wheel has it: every process a run starts (workers, step
# helpers) would otherwise compile its modules again where Python is told not to write bytecode
# (PYTHONDONTWRITEBYTECODE, common in containers).
.venv/bin/python -m compileall -q vlm_assets
