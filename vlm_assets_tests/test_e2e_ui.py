"""`dagster dev` end to end, the way a user sees it: webserver + daemon on a temporary instance,
the inbox sensor switched on through GraphQL, a demo image source and a demo video source dropped
into the inbox, the sensor-launched runs and the automation that follows them awaited, results
asserted through GraphQL, and a headless-Chromium screenshot of the asset graph kept in
test-artifacts/. Every process started here is stopped, and none may outlive the test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import uuid
from pathlib import Path

import pytest

from vlm_assets.orchestration.home import POSTGRES_HOST_ENV, ensure_dagster_home
from vlm_assets_tests.automation_support import (
    drop_flat_source,
    drop_video_source,
    write_inbox_config,
)
from vlm_assets_tests.ui_support import Ui, free_port, start_dagster, stop_group, wait_for, wait_for_location

pytestmark = [pytest.mark.browser, pytest.mark.processes]

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
DAGSTER = Path(sys.executable).with_name("dagster")
STARTUP_TIMEOUT_S = 240
PIPELINE_TIMEOUT_S = 600
SHUTDOWN_TIMEOUT_S = 60
MARKER_ENV = "VLM_ASSETS_E2E_MARKER"
TERMINAL = {"SUCCESS", "FAILURE", "CANCELED"}
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]

ASSETS_QUERY = """
query {
  assetNodes {
    assetKey { path }
    groupName
    partitionStats { numMaterialized numPartitions }
    assetMaterializations(limit: 1) { timestamp }
    assetChecksOrError { ... on AssetChecks { checks { name } } }
  }
}"""
RUNS_QUERY = """
query { runsOrError { ... on Runs { results { runId status tags { key value } } } } }"""
CHECK_EXECUTIONS_QUERY = """
query($key: AssetKeyInput!, $name: String!) {
  assetCheckExecutions(assetKey: $key, checkName: $name, limit: 50) { runId status timestamp }
}"""
NUX_SEEN = "mutation { setNuxSeen }"  # the community sign-up dialog would cover the graph
START_SENSOR = """
mutation($selector: SensorSelector!) {
  startSensor(sensorSelector: $selector) {
    __typename ... on Sensor { sensorState { status } } ... on PythonError { message }
  }
}"""


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI is set but no chromium is installed (.ci/run installs Debian's chromium)")
    pytest.skip("chromium not installed (apt-get install chromium)")


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _pipeline_state(ui: Ui):
    assets = {tuple(node["assetKey"]["path"]): node for node in ui.graphql(ASSETS_QUERY)["assetNodes"]}
    runs = ui.graphql(RUNS_QUERY)["runsOrError"]["results"]

    def latest(name: str) -> float:
        materializations = assets[(name,)]["assetMaterializations"]
        return float(materializations[0]["timestamp"]) if materializations else 0.0

    def all_partitions(name: str) -> bool:
        stats = assets[(name,)]["partitionStats"]
        return bool(stats) and stats["numPartitions"] > 0 and stats["numMaterialized"] == stats["numPartitions"]

    pending = [run["runId"][:8] for run in runs if run["status"] not in TERMINAL]
    done = (
        all(all_partitions(name)
            for name in ("sample_catalog", "packed_wds_shards", "energon_dataset", "frame_cache_shard"))
        and latest("energon_dataset") >= latest("packed_wds_shards")
        and latest("training_mix") >= latest("energon_dataset")
        and latest("video_frame_plan") >= latest("sample_catalog")
        and latest("frame_cache_index") >= max(latest("frame_cache_shard"), latest("video_frame_plan"))
        and not pending
    )
    summary = {name[0]: (node["partitionStats"] or {}).get("numMaterialized", bool(node["assetMaterializations"]))
               for name, node in assets.items()} | {"runs": len(runs), "unfinished": pending}
    return ((assets, runs) if done else None), summary


def test_dagster_dev_sensor_runs_checks_and_asset_graph(tmp_path, demo_config_path, monkeypatch):
    chromium = _chromium()
    config = write_inbox_config(tmp_path / "site")
    inbox = config.parent / "inbox"
    marker = uuid.uuid4().hex
    monkeypatch.delenv(POSTGRES_HOST_ENV, raising=False)  # this test's instance is sqlite in a temp dir
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))
    home = ensure_dagster_home(tmp_path / "dagster_home")
    location = ["-m", "vlm_assets.definitions"]
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home), "VLM_ASSETS_CONFIG": str(config), MARKER_ENV: marker,
           "VLM_ASSETS_SENSOR_INTERVAL_S": "5", "PYTHONPATH": str(REPO)}
    ARTIFACTS.mkdir(exist_ok=True)
    log = ARTIFACTS / "dagster-dev.log"
    ui = Ui(port)
    with open(log, "wb") as log_file:
        dev = start_dagster(
            [str(DAGSTER), "dev", *location, "--host", "127.0.0.1", "--port", str(port), "--live-data-poll-rate", "5000"],
            cwd=tmp_path, env=env, stdout=log_file, stderr=subprocess.STDOUT,
        )
        try:
            entry = wait_for_location(ui, STARTUP_TIMEOUT_S, log)
            selector = {"repositoryLocationName": entry["name"],
                        "repositoryName": entry["locationOrLoadError"]["repositories"][0]["name"],
                        "sensorName": "inbox_sensor"}
            started = ui.graphql(START_SENSOR, {"selector": selector})["startSensor"]
            assert started["__typename"] == "Sensor" and started["sensorState"]["status"] == "RUNNING", started

            drop_flat_source(demo_config_path.parent, inbox, name="photos")
            drop_video_source(demo_config_path.parent, inbox, name="clips")
            assets, runs = wait_for("the sensor-launched runs and the automation after them", PIPELINE_TIMEOUT_S,
                                 lambda: _pipeline_state(ui), log, interval_s=5)

            failed = [(run["runId"], run["status"]) for run in runs if run["status"] != "SUCCESS"]
            assert not failed, failed
            launched_by = {tag["value"] for run in runs for tag in run["tags"] if tag["key"] == "vlm_assets/launched_by"}
            assert {"inbox_sensor", "frame_cache_shards_sensor", "follow_upstream_sensor"} <= launched_by
            inbox_partitions = {tag["value"] for run in runs for tag in run["tags"] if tag["key"] == "dagster/partition"}
            assert {"inbox-photos", "inbox-clips"} <= inbox_partitions
            for name in ("sample_catalog", "sample_lengths", "packing_bins", "packed_json", "packed_wds_shards",
                         "energon_dataset"):
                assert assets[(name,)]["partitionStats"]["numMaterialized"] == 2, name
            partition_of = {run["runId"]: next((t["value"] for t in run["tags"] if t["key"] == "dagster/partition"), None)
                            for run in runs}
            latest_status = {}  # (asset, check, partition) -> status of the newest execution
            for key, node in assets.items():
                if not node["assetMaterializations"]:
                    continue  # not materialised (training_package is built on request only)
                for check in (node["assetChecksOrError"] or {}).get("checks", []):
                    executions = ui.graphql(CHECK_EXECUTIONS_QUERY, {"key": {"path": list(key)}, "name": check["name"]})
                    executions = sorted(executions["assetCheckExecutions"], key=lambda e: e["timestamp"])
                    assert executions, f"{key[0]}:{check['name']} never ran"
                    for execution in executions:
                        latest_status[(key[0], check["name"], partition_of.get(execution["runId"]))] = execution["status"]
            assert len(latest_status) >= 12, latest_status
            assert {check: status for check, status in latest_status.items() if status != "SUCCEEDED"} == {}

            screenshot = ARTIFACTS / "asset-graph.png"
            screenshot.unlink(missing_ok=True)
            ui.graphql(NUX_SEEN)
            groups = sorted({node["groupName"] for node in assets.values() if node["groupName"]})
            expanded = urllib.parse.quote(",".join(f"global@global:{group}" for group in groups))
            browser = subprocess.Popen(
                [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}",
                 "--window-size=1800,1000", "--virtual-time-budget=25000", f"--screenshot={screenshot}",
                 f"{ui.url}/asset-groups?expanded={expanded}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env={**os.environ, MARKER_ENV: marker},
            )
            try:
                browser.wait(120)
            finally:
                stop_group(browser, 10)
            assert screenshot.is_file() and screenshot.stat().st_size > 20_000, "no screenshot of the asset graph"
        finally:
            stop_group(dev, SHUTDOWN_TIMEOUT_S)
            deadline = time.monotonic() + 30
            while _processes_with(marker) and time.monotonic() < deadline:
                time.sleep(1)
            leaked = _processes_with(marker)
            for pid in leaked:
                os.kill(pid, signal.SIGKILL)
    assert not leaked, f"processes outlived dagster dev: {leaked}"
