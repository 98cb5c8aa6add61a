"""`vlm-assets run` and the UI judge state alike.

The demo graph is built by `vlm-assets run`, then a real `dagster-webserver` serves its instance.
After each event (a config edit, a changed source file, a new inbox entry registered by the inbox
sensor, a run killed mid-step, a medium replaced, a code-version bump) the asset partitions that `vlm-assets run --plan` would build are
exactly those the webserver's GraphQL API marks stale, missing or failed; after `vlm-assets run`,
the UI marks none and the plan lists none.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml

from vlm_assets.demo import write_demo
from vlm_assets.layout import StorageLayout
from vlm_assets.locks import file_lock
from vlm_assets.orchestration.home import POSTGRES_HOST_ENV, ensure_dagster_home
from vlm_assets_tests.automation_support import drop_flat_source, register_inbox_entries
from vlm_assets_tests.run_support import run, site_config, start_run, wait_for_started_run
from vlm_assets_tests.ui_support import Ui, free_port, start_dagster, stop_group, wait_for_location

pytestmark = pytest.mark.processes

WEBSERVER = Path(sys.executable).with_name("dagster-webserver")
REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 240

ASSET_NODES = """
query {
  assetNodes {
    assetKey { path } isMaterializable isPartitioned partitionKeys staleStatus
    assetPartitionStatuses { ... on DefaultPartitionStatuses { failedPartitions unmaterializedPartitions } }
  }
}"""
STALE_PARTITIONS = """
query($key: AssetKeyInput!, $partitions: [String!]!) {
  assetNodeOrError(assetKey: $key) { ... on AssetNode { staleStatusByPartition(partitions: $partitions) } }
}"""
LATEST = """
query($keys: [AssetKeyInput!]!) {
  assetsLatestInfo(assetKeys: $keys) { assetKey { path } latestMaterialization { runId } latestRun { id status } }
}"""
RELOAD = "mutation { reloadWorkspace { __typename } }"
# A multi-partitioned asset's statuses (source × chunk): per range of its primary dimension's keys,
# the other dimension's failed and unmaterialised keys; primary keys in no range have no materialisation.
MULTI_STATUSES = """
query($key: AssetKeyInput!) {
  assetNodeOrError(assetKey: $key) { ... on AssetNode {
    partitionKeysByDimension { name partitionKeys }
    assetPartitionStatuses { ... on MultiPartitionStatuses { primaryDimensionName ranges {
      primaryDimStartKey primaryDimEndKey
      secondaryDim { ... on DefaultPartitionStatuses { failedPartitions unmaterializedPartitions } } } } } } }
}"""


def multi_partitions_needing_building(ui: Ui, path: list[str]) -> set[str]:
    """Failed or unmaterialised keys of a (chunk, source) multi-partitioned asset, spelled `chunk|source`."""
    node = ui.graphql(MULTI_STATUSES, {"key": {"path": path}})["assetNodeOrError"]
    keys = {dimension["name"]: dimension["partitionKeys"] for dimension in node["partitionKeysByDimension"]}
    statuses = node["assetPartitionStatuses"]
    primary = statuses["primaryDimensionName"]
    (secondary,) = set(keys) - {primary}
    covered: dict[str, set[str]] = {}
    for span in statuses["ranges"]:
        order = keys[primary]
        for key in order[order.index(span["primaryDimStartKey"]):order.index(span["primaryDimEndKey"]) + 1]:
            covered[key] = set(span["secondaryDim"]["failedPartitions"]) | set(span["secondaryDim"]["unmaterializedPartitions"])
    pending = set()
    for primary_key in keys[primary]:
        for secondary_key in covered.get(primary_key, keys[secondary]):
            dimensions = {primary: primary_key, secondary: secondary_key}
            pending.add(f"{dimensions['chunk']}|{dimensions['source']}")
    return pending


def ui_needs_building(ui: Ui) -> set[str]:
    """Asset partitions the UI shows as missing, failed or stale, labelled as `vlm-assets run` labels them."""
    nodes = [node for node in ui.graphql(ASSET_NODES)["assetNodes"] if node["isMaterializable"]]
    latest = {tuple(info["assetKey"]["path"]): info for info in
              ui.graphql(LATEST, {"keys": [{"path": node["assetKey"]["path"]} for node in nodes]})["assetsLatestInfo"]}
    shown = set()
    for node in nodes:
        name = "/".join(node["assetKey"]["path"])
        if node["isPartitioned"]:
            statuses = node["assetPartitionStatuses"]
            if statuses is not None and "failedPartitions" in statuses:
                pending = set(statuses["failedPartitions"]) | set(statuses["unmaterializedPartitions"])
            else:
                pending = multi_partitions_needing_building(ui, node["assetKey"]["path"])
            keys = node["partitionKeys"]
            stale = ui.graphql(STALE_PARTITIONS, {"key": {"path": node["assetKey"]["path"]}, "partitions": keys})
            for key, status in zip(keys, stale["assetNodeOrError"]["staleStatusByPartition"]):
                if key in pending or status != "FRESH":
                    shown.add(f"{name} [{key}]")
        else:
            info = latest[tuple(node["assetKey"]["path"])]
            run, materialization = info["latestRun"], info["latestMaterialization"]
            failed = run is not None and run["status"] == "FAILURE" and (materialization or {}).get("runId") != run["id"]
            if failed or node["staleStatus"] != "FRESH":
                shown.add(name)
    return shown


def plan_needs_building(config: Path, home: Path) -> set[str]:
    result = run(config, home, "--plan")
    assert result.returncode == 0, result.stdout[-3000:]
    states = [line.strip() for line in result.stdout.splitlines() if line.startswith(" ") or line.startswith("up to date")]
    return {line.split("  ", 1)[1].strip() for line in states
            if line.split("  ", 1)[0].strip() in ("missing", "failed", "stale")}


def test_run_and_the_ui_agree_on_what_needs_building(tmp_path, monkeypatch):
    demo = write_demo(tmp_path / "demo").parent
    config = site_config(demo / "vlm_assets.yaml", tmp_path / "site")
    monkeypatch.delenv(POSTGRES_HOST_ENV, raising=False)
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    home = ensure_dagster_home(tmp_path / "home")
    built = run(config, home, "--workers", "2")
    assert built.returncode == 0, built.stdout[-4000:]

    port = free_port()
    log = tmp_path / "webserver.log"
    env = {**os.environ, "DAGSTER_HOME": str(home), "VLM_ASSETS_CONFIG": str(config)}
    with open(log, "wb") as log_file:
        server = start_dagster(
            [str(WEBSERVER), "-m", "vlm_assets.definitions", "--host", "127.0.0.1", "--port", str(port)],
            cwd=tmp_path, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            ui = Ui(port)
            wait_for_location(ui, STARTUP_TIMEOUT_S, log)

            def agree(event: str) -> set[str]:
                planned = plan_needs_building(config, home)  # first: it observes the sources, fails dead runs
                shown = ui_needs_building(ui)
                assert planned == shown, f"{event}: `run --plan` would build {sorted(planned)}, the UI shows {sorted(shown)}"
                return planned

            def settle(event: str) -> None:
                result = run(config, home, "--workers", "2")
                assert result.returncode == 0, result.stdout[-4000:]
                assert agree(f"after the run that followed {event}") == set()

            assert agree("the first full build") == set()

            raw = yaml.safe_load(config.read_text())
            raw["sample"]["max_token_len"] = 4096
            config.write_text(yaml.safe_dump(raw, sort_keys=False))
            ui.graphql(RELOAD)  # the webserver reads the config when it loads the code location
            assert {f"packing_bins [{name}]" for name in ("demo_images", "demo_video", "demo_wds")} <= agree("a config edit")
            settle("a config edit")

            manifest = demo / "video_train.jsonl"
            stat = manifest.stat()
            os.utime(manifest, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
            assert agree("a changed source file") == {"sample_catalog [demo_video]"}
            settle("a changed source file")

            # A copy of demo_images: every sample of it a duplicate, it is built empty.
            drop_flat_source(demo, config.parent / "inbox")
            (entry,) = register_inbox_entries(config, home)
            assert {f"sample_catalog [{entry}]", f"energon_dataset [{entry}]"} <= agree("a new inbox entry")
            settle("a new inbox entry")

            # The test holds the source's lock shared, as a reader would: the forced catalogue step, which
            # writes under the exclusive lock, is certainly mid-step when the CLI is killed.
            storage_root = Path(yaml.safe_load(config.read_text())["storage"]["root"])
            with file_lock(storage_root, StorageLayout.source_lock("demo_video"), shared=True):
                killed = start_run(config, home, "--select", "sample_catalog[demo_video]", "--force")
                wait_for_started_run(home, "sample_catalog", "demo_video")
                os.killpg(killed.pid, signal.SIGKILL)
                killed.wait(30)
            assert agree("a run killed mid-step") == {"sample_catalog [demo_video]"}
            settle("a run killed mid-step")

            # A medium the JSON-lines source names replaced by another picture (same path, other bytes).
            (demo / "media/stills/frame_still.jpg").write_bytes((demo / "flat/photos/0001.jpg").read_bytes())
            assert "sample_catalog [demo_video]" in agree("a medium replaced")
            settle("a medium replaced")
        finally:
            stop_group(server, 30)

        # A code-version bump: the same code with packing_bins' revision one higher, served and planned alike.
        code = tmp_path / "code"
        shutil.copytree(REPO / "vlm_assets", code / "vlm_assets", ignore=shutil.ignore_patterns("__pycache__"))
        specs = code / "vlm_assets/asset_specs.py"
        revision = re.search(r'"packing_bins", (\d+),', specs.read_text())
        specs.write_text(specs.read_text().replace(revision.group(0), f'"packing_bins", {int(revision.group(1)) + 1},'))
        monkeypatch.setenv("PYTHONPATH", str(code))
        monkeypatch.chdir(tmp_path)  # `python -m` puts its working directory first on the path: not the checkout
        server = start_dagster(
            [str(WEBSERVER), "-m", "vlm_assets.definitions", "--host", "127.0.0.1", "--port", str(port)],
            cwd=tmp_path, env={**env, "PYTHONPATH": str(code)}, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            wait_for_location(ui, STARTUP_TIMEOUT_S, log)
            assert {f"packing_bins [{name}]" for name in ("demo_images", "demo_video", "demo_wds")} <= agree(
                "a code-version bump")
            settle("a code-version bump")
        finally:
            stop_group(server, 30)
