"""The Dagster instance's home: $DAGSTER_HOME and the dagster.yaml we manage in it (no Dagster import)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from vlm_assets.atomic import atomic_write_text
from vlm_assets.orchestration.workers import default_workers

# Instance templates ship inside the package, so a non-editable install finds them too.
REPO_INSTANCE_CONFIG = Path(__file__).resolve().parents[1] / "instance" / "dagster.yaml"
INSTANCE_CONFIG_HEADER = (
    "# Written by vlm-assets from vlm_assets/instance/dagster.yaml (+ dagster.postgres.yaml when "
    "$VLM_ASSETS_PG_HOST is set) and rewritten on every run; delete this line to keep your own edits.\n"
)
POSTGRES_TEMPLATE = REPO_INSTANCE_CONFIG.with_name("dagster.postgres.yaml")
POSTGRES_HOST_ENV = "VLM_ASSETS_PG_HOST"
POSTGRES_DEFAULTS = {"VLM_ASSETS_PG_PORT": 5432, "VLM_ASSETS_PG_USER": "postgres", "VLM_ASSETS_PG_PASSWORD": "",
                     "VLM_ASSETS_PG_DB": "dagster"}


def instance_config_text() -> str:
    """The project's dagster.yaml, with PostgreSQL storage when $VLM_ASSETS_PG_HOST is set.

    Set variables stay `{env: ...}` references (no password lands in the file); unset ones take
    POSTGRES_DEFAULTS.
    """
    text = INSTANCE_CONFIG_HEADER + REPO_INSTANCE_CONFIG.read_text(encoding="utf-8").replace("{cores}", str(default_workers()))
    if os.environ.get(POSTGRES_HOST_ENV):
        storage = yaml.safe_load(POSTGRES_TEMPLATE.read_text(encoding="utf-8"))
        fields = storage["storage"]["postgres"]["postgres_db"]
        for name, value in fields.items():
            if isinstance(value, dict) and not os.environ.get(value["env"]) and value["env"] in POSTGRES_DEFAULTS:
                fields[name] = POSTGRES_DEFAULTS[value["env"]]
        text += "\n" + yaml.safe_dump(storage, sort_keys=False)
    return text


def ensure_dagster_home(default: Path) -> Path:
    """$DAGSTER_HOME, else `default`; its dagster.yaml (re)written from the project's unless the user owns it."""
    home = Path(os.environ.get("DAGSTER_HOME") or default).resolve()
    home.mkdir(parents=True, exist_ok=True)
    os.environ["DAGSTER_HOME"] = str(home)
    target = home / "dagster.yaml"
    current = target.read_text(encoding="utf-8") if target.exists() else None
    if current is None or current.startswith(INSTANCE_CONFIG_HEADER):
        wanted = instance_config_text()
        if current != wanted:
            atomic_write_text(target, wanted)
    return home
