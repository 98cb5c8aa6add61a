#!/usr/bin/env bash
# Set up and run the tests (what CI runs): check the import layers, validate the Dagster definitions, materialise the demo
# and run its asset checks through `vlm-assets run` (non-zero on any failed run or check), then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "== import layers (lint-imports, contracts in .importlinter)"
.venv/bin/lint-imports --no-cache

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/home"
.venv/bin/vlm-assets demo "$work/demo" >/dev/null

echo "== dagster definitions validate"
VLM_ASSETS_CONFIG="$work/demo/vlm_assets.yaml" DAGSTER_HOME="$work/home" \
  .venv/bin/dagster definitions validate -m vlm_assets.definitions

echo "== demo graph with its asset checks (vlm-assets run)"
# A throwaway sqlite instance, even in a shell whose VLM_ASSETS_PG_* point at a real server.
env -u VLM_ASSETS_PG_HOST DAGSTER_HOME="$work/home" \
  .venv/bin/vlm-assets run --config "$work/demo/vlm_assets.yaml" > "$work/demo-run.log" 2>&1 \
  || { tail -n 60 "$work/demo-run.log"; exit 1; }
grep -E "run\(s\)|FAILED|✗" "$work/demo-run.log" || true

echo "== pytest"
.venv/bin/python -m pytest -q "$@"
