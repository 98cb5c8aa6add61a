#!/usr/bin/env bash
# Set up and run every test tier (what CI runs): check the import layers, validate the Dagster
# definitions on the demo config, then pytest with all markers (plain `pytest` runs the fast tier
# only). The whole demo graph with its asset checks is built once, by the session's reference run
# (vlm_assets_tests/conftest.py), which test_cli_run.py checks for failed runs and checks; beside it,
# the token-length tests under the oldest transformers release supported.
set -euo pipefail
cd "$(dirname "$0")/.."
# The test processes write the bytecode of what they import, even where Python is told not to
# (PYTHONDONTWRITEBYTECODE): the first process to import a module compiles it once, for all the
# others, and the environment is not compiled in full up front (scripts/setup.sh).
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh

echo "== import layers (lint-imports, contracts in .importlinter)"
.venv/bin/lint-imports --no-cache

# The tests' temporary folders (their sites, outputs and Dagster instances) go in memory where the
# machine has a tmpfs with 4 GiB free, unless $TMPDIR already names a place: every Dagster run
# writes its own sqlite database, committing each event, and on a disk each commit waits for the
# journal, which no test is about. (The full-disk tests mount small file systems of their own.)
in_memory=""
if [ -z "${TMPDIR:-}" ] && [ "$(stat -f -c %T /dev/shm 2>/dev/null)" = tmpfs ] && [ -w /dev/shm ] \
    && [ "$(df -Pk /dev/shm | awk 'NR == 2 {print $4}')" -ge $((4 * 1024 * 1024)) ]; then
  in_memory="$(mktemp -d /dev/shm/vlm-assets-tests.XXXXXX)"
  # Open to every user, as /tmp is: the outage tests' PostgreSQL clusters run as `postgres`.
  chmod 1777 "$in_memory"
  export TMPDIR="$in_memory"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work" ${in_memory:+"$in_memory"}' EXIT
mkdir -p "$work/home"
# The nine families' offline processors, built by the first session below and loaded by the second.
export VLM_ASSETS_TEST_FAMILY_CACHE="$work/families"
.venv/bin/vlm-assets demo "$work/demo" >/dev/null

echo "== dagster definitions validate"
VLM_ASSETS_CONFIG="$work/demo/vlm_assets.yaml" DAGSTER_HOME="$work/home" \
  .venv/bin/dagster definitions validate -m vlm_assets.definitions

# The token-length tests again under the oldest transformers release supported (the session below
# has the newest the range allows), beside it: in a session of their own at the lowest CPU priority
# (the process's and, where the kernel groups processes by session, the session's), they take the
# cores when the tests below leave them idle and yield them at once otherwise. They start once the
# families' processor directories are built, with the newest release, so they load directories
# another release saved, as a trainer would.
oldest_log="$work/oldest.log"
(
  .venv/bin/python -m vlm_assets_tests.processor_families "$VLM_ASSETS_TEST_FAMILY_CACHE"
  exec setsid -w bash -c 'echo 19 > /proc/self/autogroup 2>/dev/null || true; exec nice -n 19 bash scripts/test_transformers_oldest.sh'
) > "$oldest_log" 2>&1 &
oldest=$!
# Its own session hears no Ctrl-C from the terminal: it goes with this script, however this ends.
trap 'kill -- -"$oldest" "$oldest" 2>/dev/null || true; rm -rf "$work" ${in_memory:+"$in_memory"}' EXIT

echo "== pytest, every tier"
# A throwaway sqlite instance per test, even in a shell whose VLM_ASSETS_PG_* point at a real server.
status=0
env -u VLM_ASSETS_PG_HOST .venv/bin/python -m pytest -q -m "" "$@" || status=$?

oldest_status=0
wait "$oldest" || oldest_status=$?
cat "$oldest_log"
[ "$oldest_status" = 0 ] || echo "the token-length tests under the oldest transformers failed (above)" >&2
exit $(( status != 0 ? status : oldest_status ))
