"""Real `vlm-assets run` processes for the run-safety tests: sites sharing one set of inputs, byte snapshots."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
import yaml

from vlm_assets.media.checks import MediaCheckLog
from vlm_assets.config import load_config
from vlm_assets.layout import StorageLayout
from vlm_assets.locks import LOCK_DIR
from vlm_assets.defs.tags import ASSET_TAG

RUN_TIMEOUT_S = 600


def site_config(demo_config: Path, site: Path, **overrides) -> Path:
    """A config reading the demo's inputs (absolute paths) and writing under `site/vlm_data`."""
    app = load_config(demo_config)
    raw = yaml.safe_load(demo_config.read_text())
    raw["storage"] = {"root": str(site / "vlm_data")}
    raw["inbox"] = str(site / "inbox")
    raw["sources"] = [
        {"name": source.name, "kind": source.kind, "path": str(source.path), "media_root": str(source.media_root)}
        for source in app.sources
    ]
    for section, values in overrides.items():
        raw[section] = {**raw.get(section, {}), **values}
    site.mkdir(parents=True, exist_ok=True)
    path = site / "vlm_assets.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def start_run(config: Path, home: Path, *args: str) -> subprocess.Popen:
    """`vlm-assets run` in its own process group, as a terminal would start it."""
    return subprocess.Popen(
        [sys.executable, "-m", "vlm_assets.cli", "run", "--config", str(config), *args],
        env={**os.environ, "DAGSTER_HOME": str(home), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


def run(config: Path, home: Path, *args: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    process = start_run(config, home, *args)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"vlm-assets run did not finish in {timeout} s:\n{output[-4000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, output, "")


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every output file under `root`, by relative path (coordination files, the root's
    owner record, which names the config file by its absolute path, and the records of which shards
    were checked and indexed, which name them by their modification times, left out)."""
    digests = {}
    layout = StorageLayout(root)
    stamp_records = {layout.checked_shards("-").parent, layout.energon_prepared("-").parent}
    check_logs = layout.media_checks("").name
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if relative.parts[0] == LOCK_DIR or path == layout.owner or path.parent in stamp_records or not path.is_file():
            continue
        if path.name.endswith(check_logs):
            # A SQLite file's pages depend on the order and the builds its rows were written in: its rows are compared.
            digests[str(relative)] = _check_log_digest(path)
            continue
        digests[str(relative)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def _check_log_digest(path: Path) -> str:
    log = MediaCheckLog(path, append=False)
    try:
        return hashlib.sha256("".join(f"{ref}\t{fingerprint}\n" for ref, fingerprint in log.passes()).encode()).hexdigest()
    finally:
        log.close()


def differences(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    problems = [f"missing {name}" for name in sorted(set(expected) - set(actual))]
    problems += [f"unexpected {name}" for name in sorted(set(actual) - set(expected))]
    problems += [f"differs {name}" for name in sorted(set(expected) & set(actual)) if expected[name] != actual[name]]
    return problems


def initialised_home(home: Path) -> Path:
    """`home` with the dagster.yaml `vlm-assets run` writes and its storage created, so a test may read the
    instance while a run starts: two processes creating one fresh sqlite storage at once stamp its schema
    version twice, and neither can open it afterwards."""
    from vlm_assets.orchestration.home import instance_config_text

    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(instance_config_text())
    with dg.DagsterInstance.from_config(str(home)):
        pass
    return home


def single_slot_instance(home: Path) -> None:
    """An instance whose pools have one slot each: a slot a dead run keeps would block every later step."""
    from vlm_assets.orchestration.home import instance_config_text

    home.mkdir(parents=True, exist_ok=True)
    settings = yaml.safe_load(instance_config_text())
    settings["concurrency"]["pools"]["default_limit"] = 1
    (home / "dagster.yaml").write_text(yaml.safe_dump(settings))


def wait_for_started_run(home: Path, asset: str, partition: str | None = None, timeout: float = 300) -> dg.DagsterRun:
    """The first STARTED run that materialises `asset` (that partition), once one exists."""
    deadline = time.monotonic() + timeout
    while not (home / "dagster.yaml").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # the run being waited for has not set its instance up yet
    with dg.DagsterInstance.from_config(str(home)) as instance:
        while time.monotonic() < deadline:
            for run in instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED])):
                wanted_partition = partition is None or run.tags.get("dagster/partition") == partition
                if run.tags.get(ASSET_TAG) == asset and wanted_partition:
                    return run
            time.sleep(0.2)
    raise AssertionError(f"no started run of {asset} within {timeout} s")


def run_status(home: Path, run_id: str) -> dg.DagsterRunStatus:
    with dg.DagsterInstance.from_config(str(home)) as instance:
        return instance.get_run_by_id(run_id).status


def skip_without_mount_namespace() -> None:
    """Skip the test where it cannot mount a small tmpfs of its own (a user and mount namespace)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare to mount a small tmpfs")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here: {probe.stderr.decode().strip()}")


def descendants(pid: int) -> set[int]:
    """The live processes under `pid` (its children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found
