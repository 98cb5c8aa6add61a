#!/usr/bin/env bash
# Set up and run every test tier (what CI runs): check the import layers, validate the Dagster
# definitions on the demo config, then pytest with all markers (plain `pytest` runs the fast tier
# only). The whole demo graph with its asset checks is built once, by the session's reference run
# (vlm_assets_tests/conftest.py), which test_cli_run.py checks for failed runs and checks. The
# token-length tests under the oldest transformers release supported run beside all that, on the
# cores it leaves idle (below).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

work="$(mktemp -d)"
oldest_pid=""
stop_oldest() {
  if [ -n "$oldest_pid" ]; then kill -- "-$oldest_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap stop_oldest EXIT

# The token-length tests again under the oldest transformers release supported (the tiers below
# have the newest the range allows), in a session of their own at idle CPU priority (SCHED_IDLE):
# the main tiers' processes never wait for them, and they take the cores those leave idle while
# their tests wait on processes, servers and sensors. Their output follows the main tiers'.
idle=(chrt --idle 0)
"${idle[@]}" true 2>/dev/null || idle=(nice -n 19)
set -m  # a process group of its own, stopped whole if the tiers below fail
"${idle[@]}" bash scripts/test_transformers_oldest.sh > "$work/oldest.log" 2>&1 &
oldest_pid=$!
set +m

echo "== import layers (lint-imports, contracts in .importlinter)"
.venv/bin/lint-imports --no-cache

mkdir -p "$work/home"
.venv/bin/vlm-assets demo "$work/demo" >/dev/null

echo "== dagster definitions validate"
VLM_ASSETS_CONFIG="$work/demo/vlm_assets.yaml" DAGSTER_HOME="$work/home" \
  .venv/bin/dagster definitions validate -m vlm_assets.definitions

echo "== pytest, every tier"
# A throwaway sqlite instance per test, even in a shell whose VLM_ASSETS_PG_* point at a real server.
env -u VLM_ASSETS_PG_HOST .venv/bin/python -m pytest -q -m "" "$@"

# What is left of the oldest release's tests gets the normal priority back, then its output.
for pid in $(pgrep -g "$oldest_pid" || true); do
  chrt --all-tasks --other --pid 0 "$pid" >/dev/null 2>&1 || renice -n 0 -p "$pid" >/dev/null 2>&1 || true
done
status=0
wait "$oldest_pid" || status=$?
oldest_pid=""
cat "$work/oldest.log"
exit "$status"
