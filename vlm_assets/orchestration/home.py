"""The Dagster instance's home: $DAGSTER_HOME and the dagster.yaml we manage in it (no Dagster import)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from vlm_assets.atomic import atomic_write_text
from vlm_assets.config import CONFIG_ENV_VAR
from vlm_assets.object_store import ObjectURL
from vlm_assets.orchestration.workers import default_workers

# The project's `dagster.yaml` (beside its workspace.yaml) holds the instance settings the user edits.
# The package carries the repository's own (a link to it), for instances outside any project.
PROJECT_INSTANCE_FILE = "dagster.yaml"
PACKAGED_INSTANCE_CONFIG = Path(__file__).resolve().parents[1] / "instance" / PROJECT_INSTANCE_FILE
# The instance's own dagster.yaml starts with this line while vlm-assets manages it.
INSTANCE_CONFIG_HEADER = "# Written by vlm-assets from "
POSTGRES_TEMPLATE = PACKAGED_INSTANCE_CONFIG.with_name("dagster.postgres.yaml")
POSTGRES_HOST_ENV = "VLM_ASSETS_PG_HOST"
# s3://bucket/prefix: every step's captured stdout and stderr are kept there (Dagster's S3 compute log
# manager), so the UI shows a step's logs whichever machine ran it; the endpoint and credentials are the
# standard AWS variables, as for the storage root.
LOGS_URL_ENV = "VLM_ASSETS_LOGS_URL"
# `dagster dev` finds its code location through this file in the directory it is started from, and
# reads that directory's `.env` into its environment: the project directory (project_dir).
WORKSPACE_FILE = "workspace.yaml"
ENV_FILE = ".env"
DEFAULT_HOME_NAME = ".dagster_home"
POSTGRES_DEFAULTS = {"VLM_ASSETS_PG_PORT": 5432, "VLM_ASSETS_PG_USER": "postgres", "VLM_ASSETS_PG_PASSWORD": "",
                     "VLM_ASSETS_PG_DB": "dagster"}


def instance_settings_file(project: Path | None) -> Path:
    """The project's dagster.yaml, else the one the package carries."""
    own = project / PROJECT_INSTANCE_FILE if project else None
    return own if own and own.is_file() else PACKAGED_INSTANCE_CONFIG


def instance_config_text(settings_file: Path = PACKAGED_INSTANCE_CONFIG) -> str:
    """The instance's dagster.yaml: `settings_file`'s settings, one pool slot and one run per core
    where it leaves those limits out, and PostgreSQL storage when $VLM_ASSETS_PG_HOST is set.

    Set variables stay `{env: ...}` references (no password lands in the file); unset ones take
    POSTGRES_DEFAULTS.
    """
    settings = yaml.safe_load(settings_file.read_text(encoding="utf-8")) or {}
    concurrency = settings["concurrency"] = settings.get("concurrency") or {}
    for section, limit in (("pools", "default_limit"), ("runs", "max_concurrent_runs")):
        # A section written with no keys (`runs:`) reads as None.
        concurrency[section] = concurrency.get(section) or {}
        concurrency[section].setdefault(limit, default_workers())
    if os.environ.get(POSTGRES_HOST_ENV):
        storage = yaml.safe_load(POSTGRES_TEMPLATE.read_text(encoding="utf-8"))
        fields = storage["storage"]["postgres"]["postgres_db"]
        for name, value in fields.items():
            if isinstance(value, dict) and not os.environ.get(value["env"]) and value["env"] in POSTGRES_DEFAULTS:
                fields[name] = POSTGRES_DEFAULTS[value["env"]]
        settings.update(storage)
    if os.environ.get(LOGS_URL_ENV) and "compute_logs" not in settings:
        settings["compute_logs"] = object_store_compute_logs(os.environ[LOGS_URL_ENV])
    source = settings_file.resolve()
    header = (f"{INSTANCE_CONFIG_HEADER}{source}, rewritten on every run: edit that file, or delete this line "
              "to keep your own edits here.\n")
    return header + yaml.safe_dump(settings, sort_keys=False)


def object_store_compute_logs(url: str) -> dict[str, Any]:
    """The instance's `compute_logs` section keeping captured logs below `url` (s3://bucket/prefix)."""
    location = ObjectURL.parse(url)
    config: dict[str, Any] = {"bucket": location.bucket, "prefix": location.key or "dagster-logs",
                              # An empty stream is no object: a step that printed nothing costs no request.
                              "skip_empty_files": True}
    for field, variable in (("endpoint_url", "AWS_ENDPOINT_URL"), ("region", "AWS_DEFAULT_REGION")):
        if os.environ.get(variable):
            config[field] = {"env": variable}
    return {"module": "dagster_aws.s3.compute_log_manager", "class": "S3ComputeLogManager", "config": config}


def ensure_dagster_home(default: Path, project: Path | None = None) -> Path:
    """$DAGSTER_HOME, else `default`; its dagster.yaml (re)written from the project's settings
    (instance_settings_file) unless the user owns it."""
    home = Path(os.environ.get("DAGSTER_HOME") or default).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["DAGSTER_HOME"] = str(home)
    target = home / "dagster.yaml"
    current = target.read_text(encoding="utf-8") if target.exists() else None
    if current is None or current.startswith(INSTANCE_CONFIG_HEADER):
        wanted = instance_config_text(instance_settings_file(project))
        if current != wanted:
            atomic_write_text(target, wanted)
    return home


def project_dir(config_path: Path) -> Path:
    """The nearest directory at or above the config's that holds a `workspace.yaml` (where `dagster dev`
    is started from), else the config's own directory."""
    start = Path(config_path).resolve().parent
    return next((directory for directory in (start, *start.parents) if (directory / WORKSPACE_FILE).is_file()), start)


def read_env_file(path: Path) -> dict[str, str]:
    """`KEY=value` lines of a `.env` file (comments, blank and other lines skipped; quotes stripped)."""
    values: dict[str, str] = {}
    if not path.is_file():
        return values
    for line in path.read_text(encoding="utf-8").splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key and not key.startswith("#"):
            values[key.removeprefix("export ").strip()] = value.strip().strip("'\"")
    return values


def default_home(config_path: Path) -> Path:
    """The instance a command uses when $DAGSTER_HOME is not set: the one the project's `.env` names
    (what `dagster dev` started in the project directory uses), else `.dagster_home` there."""
    project = project_dir(config_path)
    named = read_env_file(project / ENV_FILE).get("DAGSTER_HOME")
    return (project / named).resolve() if named else project / DEFAULT_HOME_NAME


def remember_for_dagster_dev(home: Path, config_path: Path) -> bool:
    """Whether `dagster dev` started in the project directory shows this instance and this config with
    no variable exported: their paths are written into the project's `.env` (its other lines kept),
    unless it names another DAGSTER_HOME. Outside a project (no `workspace.yaml` above the config)
    nothing is written."""
    project = project_dir(config_path)
    if not (project / WORKSPACE_FILE).is_file():
        return False
    env_file = project / ENV_FILE
    current = read_env_file(env_file)
    if current.get("DAGSTER_HOME", str(home)) != str(home):
        return False
    wanted = {"DAGSTER_HOME": str(home), CONFIG_ENV_VAR: str(Path(config_path).resolve())}
    if all(current.get(key) == value for key, value in wanted.items()):
        return True
    lines = env_file.read_text(encoding="utf-8").splitlines() if env_file.is_file() else []
    kept = [line for line in lines if line.strip().partition("=")[0].removeprefix("export ").strip() not in wanted]
    atomic_write_text(env_file, "\n".join(kept + [f"{key}={value}" for key, value in wanted.items()]) + "\n")
    return True
