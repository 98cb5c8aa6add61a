#!/usr/bin/env bash
# Set up, write the demo dataset under ./demo and materialise the whole graph on it through Dagster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/vlm-assets demo demo
.venv/bin/vlm-assets run --config demo/vlm_assets.yaml "$@"
