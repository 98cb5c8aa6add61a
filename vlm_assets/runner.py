"""`vlm-assets run`: materialise the graph (or a selection plus its upstream) on the real instance.

Runs go through Dagster on the instance in $DAGSTER_HOME, one run per partition,
in dependency order, so they show in the UI exactly like sensor-launched runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
import yaml

from vlm_assets.atomic import atomic_write_text
from vlm_assets.config import CONFIG_ENV_VAR, AppConfig
from vlm_assets.defs.resources import FRAME_CACHE_SHARD_PARTITIONS, SOURCES_PARTITIONS

REPO_INSTANCE_CONFIG = Path(__file__).resolve().parent.parent / "dagster.yaml"
RUN_LOGGING = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}


@dataclass
class RunSummary:
    runs: int = 0
    failed_runs: list[str] = field(default_factory=list)
    failed_checks: list[str] = field(default_factory=list)
    materialized: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed_runs and not self.failed_checks


INSTANCE_CONFIG_HEADER = (
    "# Written by vlm-assets from the project's dagster.yaml (+ dagster.postgres.yaml when "
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
    text = INSTANCE_CONFIG_HEADER + REPO_INSTANCE_CONFIG.read_text(encoding="utf-8")
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


def register_sources(instance: dg.DagsterInstance, app: AppConfig) -> list[str]:
    existing = set(instance.get_dynamic_partitions(SOURCES_PARTITIONS.name))
    new = [source.name for source in app.sources if source.name not in existing]
    if new:
        instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, new)
    return [source.name for source in app.sources]


WAVE_PRIORITY = {SOURCES_PARTITIONS.name: 0, None: 1, FRAME_CACHE_SHARD_PARTITIONS.name: 2}


def _waves(graph, selected: set[dg.AssetKey]) -> list[list[dg.AssetKey]]:
    """Selected keys in dependency order, grouped into waves that share one partitioning."""
    order = {key: index for index, key in enumerate(graph.toposorted_asset_keys)}

    def partitioning(key: dg.AssetKey) -> str | None:
        return getattr(graph.get(key).partitions_def, "name", None)

    def parents(key: dg.AssetKey) -> set[dg.AssetKey]:
        return set(graph.get(key).parent_keys) & selected

    remaining, done, waves = set(selected), set(), []
    while remaining:
        ready = [key for key in remaining if parents(key) <= done]
        name = min((partitioning(key) for key in ready), key=lambda n: WAVE_PRIORITY.get(n, 3))
        wave = {key for key in ready if partitioning(key) == name}
        grew = True
        while grew:
            extra = {k for k in remaining - wave if partitioning(k) == name and parents(k) <= done | wave}
            grew = bool(extra)
            wave |= extra
        waves.append(sorted(wave, key=order.__getitem__))
        done |= wave
        remaining -= wave
    return waves


def run_graph(
    defs: dg.Definitions,
    app: AppConfig,
    instance: dg.DagsterInstance,
    select: Sequence[str] | None = None,
    echo: Callable[[str], None] = print,
) -> RunSummary:
    graph = defs.resolve_asset_graph()
    all_keys = set(graph.get_all_asset_keys())
    if select:
        wanted = {dg.AssetKey.from_user_string(name) for name in select}
        unknown = sorted(key.to_user_string() for key in wanted - all_keys)
        if unknown:
            raise ValueError(f"unknown asset key(s): {', '.join(unknown)} (known: {', '.join(sorted(k.to_user_string() for k in all_keys))})")
        selected = set(dg.AssetSelection.assets(*wanted).upstream().resolve(graph))
    else:
        selected = all_keys
    register_sources(instance, app)
    summary = RunSummary()
    assets = list(defs.assets or []) + list(defs.asset_checks or [])
    resources = defs.resources or {}
    for wave in _waves(graph, selected):
        partitions = graph.get(wave[0]).partitions_def
        names = ", ".join(key.to_user_string() for key in wave)
        if partitions is None:
            partition_keys: list[str | None] = [None]
        else:
            partition_keys = list(instance.get_dynamic_partitions(partitions.name))
            if partitions.name == SOURCES_PARTITIONS.name:
                configured = {source.name for source in app.sources}
                partition_keys = [key for key in partition_keys if key in configured]
        if not partition_keys:
            echo(f"· {names}: no partitions yet, skipped")
            continue
        for partition_key in partition_keys:
            label = f"{names}" + (f" [{partition_key}]" if partition_key else "")
            echo(f"▶ {label}")
            result = dg.materialize(
                assets,
                selection=dg.AssetSelection.assets(*wave),
                partition_key=partition_key,
                instance=instance,
                resources=resources,
                run_config=RUN_LOGGING,
                raise_on_error=False,
                tags={"vlm_assets/launched_by": "cli"},
            )
            summary.runs += 1
            _collect(result, label, summary, echo)
    return summary


def _collect(result: dg.ExecuteInProcessResult, label: str, summary: RunSummary, echo: Callable[[str], None]) -> None:
    for event in result.all_events:
        if event.event_type_value == "ASSET_MATERIALIZATION":
            key = event.asset_key.to_user_string()
            summary.materialized.append(key)
            echo(f"  ✓ materialised {key}" + (f" [{event.partition}]" if event.partition else ""))
        elif event.event_type_value == "ASSET_CHECK_EVALUATION":
            evaluation = event.event_specific_data
            name = f"{evaluation.asset_key.to_user_string()}:{evaluation.check_name}"
            status = "passed" if evaluation.passed else f"FAILED ({evaluation.severity.value})"
            echo(f"  {'✓' if evaluation.passed else '✗'} check {name} {status}")
            if not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.ERROR:
                summary.failed_checks.append(f"{name} ({label})")
    if not result.success:
        summary.failed_runs.append(f"{label} (run {result.run_id})")
        for event in result.all_events:
            if event.event_type_value == "STEP_FAILURE":
                error = event.event_specific_data.error
                echo(f"  ✗ {event.step_key} failed: {error.message.strip() if error else 'unknown error'}")


def print_outputs(app: AppConfig, echo: Callable[[str], None] = print) -> None:
    root = app.storage_root
    echo(f"outputs under {root}:")
    for name in ("catalog", "lengths", "packing", "packed_json", "packed_wds", "frame_cache", "packages"):
        path = root / name
        if path.exists():
            count = sum(1 for item in path.rglob("*") if item.is_file())
            echo(f"  {path}  ({count} files)")


def stderr(message: str) -> None:
    print(message, file=sys.stderr)


__all__ = ["CONFIG_ENV_VAR", "RunSummary", "ensure_dagster_home", "print_outputs", "register_sources", "run_graph"]
