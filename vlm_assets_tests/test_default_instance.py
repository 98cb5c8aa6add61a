"""One default instance: with no $DAGSTER_HOME exported, `vlm-assets run` from anywhere and `dagster dev`
(here `dagster instance info`, which finds its instance the same way) from the project directory agree,
and both use the instance settings of the project's `dagster.yaml`."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vlm_assets.demo import write_demo
from vlm_assets.orchestration.workers import default_workers
from vlm_assets_tests.ui_support import Ui, free_port, start_dagster, stop_group, wait_for, wait_for_location

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def _without_instance_variables() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key not in ("DAGSTER_HOME", "VLM_ASSETS_CONFIG")}


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlm_assets.cli", *args], cwd=cwd, env=_without_instance_variables(),
                          capture_output=True, text=True, timeout=300)


def _dagster_home_seen_by_dagster(cwd: Path) -> str:
    result = subprocess.run([str(VENV_BIN / "dagster"), "instance", "info"], cwd=cwd, env=_without_instance_variables(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return next(line.split(":", 1)[1].strip() for line in result.stdout.splitlines() if line.startswith("$DAGSTER_HOME:"))


def test_run_from_anywhere_and_dagster_dev_in_the_project_use_one_instance(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "workspace.yaml", project / "workspace.yaml")
    (project / ".env").write_text("# the user's own settings stay\nMY_SETTING=1\n")
    config = write_demo(project / "demo")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    built = _cli(project, "run", "--config", "demo/vlm_assets.yaml", "--select", "sample_catalog[demo_images]")
    assert built.returncode == 0, built.stdout[-3000:]
    home = project / ".dagster_home"
    assert (home / "dagster.yaml").is_file()
    assert f"cd {project} && " in built.stdout
    env_lines = (project / ".env").read_text().splitlines()
    assert env_lines[:2] == ["# the user's own settings stay", "MY_SETTING=1"]
    assert f"DAGSTER_HOME={home}" in env_lines and f"VLM_ASSETS_CONFIG={config}" in env_lines

    assert _dagster_home_seen_by_dagster(project) == str(home)
    plan = _cli(elsewhere, "run", "--config", str(config), "--plan", "--select", "sample_catalog[demo_images]")
    assert plan.returncode == 0, plan.stdout[-3000:]
    assert "up to date  sample_catalog [demo_images]" in plan.stdout
    assert not (project / "demo" / ".dagster_home").exists()

    # A DAGSTER_HOME the user put in the project's .env is the instance for both, and is kept.
    own = tmp_path / "own_home"
    (project / ".env").write_text(f"DAGSTER_HOME={own}\n")
    moved = _cli(elsewhere, "run", "--config", str(config), "--plan")
    assert moved.returncode == 0, moved.stdout[-3000:]
    assert f"Dagster instance: {own}" in moved.stdout
    assert (own / "dagster.yaml").is_file()
    assert _dagster_home_seen_by_dagster(project) == str(own)
    assert f"DAGSTER_HOME={own}" in (project / ".env").read_text()


def test_an_instance_named_by_the_variable_is_not_written_into_the_projects_env(tmp_path):
    """A bench or a script exporting DAGSTER_HOME leaves the project's .env alone: `dagster dev` started there
    later shows the project's instance, not the one a single command named."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "workspace.yaml", project / "workspace.yaml")
    config = write_demo(project / "demo")
    home = tmp_path / "bench home"
    planned = subprocess.run([sys.executable, "-m", "vlm_assets.cli", "run", "--config", str(config), "--plan"],
                             cwd=project, env={**_without_instance_variables(), "DAGSTER_HOME": str(home)},
                             capture_output=True, text=True, timeout=300)
    assert planned.returncode == 0, planned.stdout[-3000:]
    assert (home / "dagster.yaml").is_file() and not (project / ".env").exists()
    assert f"DAGSTER_HOME={shlex.quote(str(home))}" in planned.stdout  # the printed command names it


def test_the_hint_for_an_instance_outside_the_projects_shows_that_instance_from_any_folder(tmp_path):
    """A config outside any project, run with an instance of its own; its hint is then used in a project
    whose .env names another instance: the printed command still shows the run's instance, though
    `dagster dev` takes the .env of the folder it starts in over the variables it is given."""
    import re

    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "workspace.yaml", project / "workspace.yaml")
    (project / ".env").write_text(f"DAGSTER_HOME={tmp_path / 'the projects home'}\n")
    config = write_demo(tmp_path / "outside" / "demo")
    home = tmp_path / "its home"
    planned = _cli(project, "run", "--config", str(config), "--dagster-home", str(home), "--plan",
                   "--select", "sample_catalog[demo_images]")
    assert planned.returncode == 0, planned.stdout[-3000:]
    hint = re.search(r"\(see the runs with: (.*) dev -m vlm_assets\.definitions\)$", planned.stdout, re.MULTILINE)
    assert hint, planned.stdout[:2000]
    shown = subprocess.run(["bash", "-c", f"{hint.group(1)} instance info"], cwd=project,
                           env=_without_instance_variables(), capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert f"$DAGSTER_HOME: {home}" in shown.stdout, shown.stdout


INSTANCE_SETTINGS = "{ instance { runQueueConfig { maxConcurrentRuns } poolConfig { poolGranularity defaultPoolLimit } } }"


def test_dagster_dev_from_the_project_directory_uses_the_projects_dagster_yaml(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(REPO / "workspace.yaml", project / "workspace.yaml")
    settings = yaml.safe_load((REPO / "dagster.yaml").read_text())
    settings["concurrency"]["pools"]["default_limit"] = 5
    settings["concurrency"]["runs"]["max_concurrent_runs"] = 3
    (project / "dagster.yaml").write_text(yaml.safe_dump(settings))
    write_demo(project / "demo")

    planned = _cli(project, "run", "--config", "demo/vlm_assets.yaml", "--plan")
    assert planned.returncode == 0, planned.stdout[-3000:]
    written = (project / ".dagster_home" / "dagster.yaml").read_text()
    assert str(project / "dagster.yaml") in written.splitlines()[0]

    port = free_port()
    log = tmp_path / "dagster-dev.log"
    with open(log, "wb") as log_file:
        dev = start_dagster([str(VENV_BIN / "dagster"), "dev", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=project, env=_without_instance_variables(), stdout=log_file, stderr=subprocess.STDOUT)
        try:
            ui = Ui(port)
            wait_for_location(ui, 240, log)
            instance = wait_for("the instance settings", 60, lambda: (ui.graphql(INSTANCE_SETTINGS)["instance"], None), log)
        finally:
            stop_group(dev, 30)
    assert instance["runQueueConfig"]["maxConcurrentRuns"] == 3
    assert instance["poolConfig"] == {"poolGranularity": "op", "defaultPoolLimit": 5}

    # Settings the project leaves out: one pool slot and one run per core.
    (project / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    assert _cli(project, "run", "--config", "demo/vlm_assets.yaml", "--plan").returncode == 0
    cores = default_workers()
    written = yaml.safe_load((project / ".dagster_home" / "dagster.yaml").read_text())
    assert written["concurrency"] == {"pools": {"granularity": "op", "default_limit": cores},
                                      "runs": {"max_concurrent_runs": cores}}
