"""The Dagster instance a `vlm-assets run` launches on, made ready before any run starts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

# Most of the second an open takes is importing the SQL libraries Dagster's storage is built on:
# imported with this module, so processes opening an instance at once queue under its lock only
# for the rest.
import alembic.command  # noqa: F401
import dagster as dg
import sqlalchemy.orm  # noqa: F401

from vlm_assets.config import AppConfig, SourceConfig
from vlm_assets.defs.automation.dead_runs import fail_dead_runs
from vlm_assets.defs.resources import FRAME_CACHE_POOL, HEAVY_POOL, SOURCES_PARTITIONS, VlmConfig, register_partitions
from vlm_assets.locks import file_lock, process_token, remove_dead_tokens
from vlm_assets.root_owner import claim_object_root, claim_storage_root


def open_instance(home: Path) -> dg.DagsterInstance:
    """The instance in `home`; the first process to open a new one creates its tables alone."""
    with file_lock(home, "instance-init"):
        return dg.DagsterInstance.get()


def prepare_instance(instance: dg.DagsterInstance, app: AppConfig, echo: Callable[[str], None]) -> list[str]:
    """Claim the storage root, fail the runs whose process is gone, register the sources, create the
    pool limits; the ids of the runs failed as dead."""
    claim_storage_root(app.storage_root, app.path)
    if app.storage_url is not None:
        claim_object_root(app.storage_url, app.path)
    process_token(app.storage_root)  # a storage root we cannot write to fails here, in one line, before any run
    dead_runs = fail_dead_runs(instance)
    for run_id in dead_runs:
        echo(f"run {run_id}: its process is gone (killed?); marked failed and its pool slots freed")
    remove_dead_tokens(app.storage_root)
    register_sources(instance, app)
    create_pool_limits(instance, app.storage_root)
    return dead_runs


def create_pool_limits(instance: dg.DagsterInstance, storage_root: Path) -> None:
    """Give each of our pools its default limit before any run claims a slot in it.

    Dagster creates a pool's limit on first use. On PostgreSQL two runs doing that at the same
    moment make one of them fail (its insert conflicts, and the update that follows runs in the
    aborted transaction), so it is done here, once, before runs start side by side.
    """
    with file_lock(storage_root, "dagster-pools"):
        existing = {pool.name for pool in instance.event_log_storage.get_pool_limits()}
        for pool in (FRAME_CACHE_POOL, HEAVY_POOL):
            if pool not in existing:
                instance.event_log_storage.initialize_concurrency_limit_to_default(pool)


def built_sources(vlm_config: VlmConfig, instance: dg.DagsterInstance) -> list[SourceConfig]:
    """The sources a run builds, as the UI lists them: the configured ones, and the inbox entries the
    inbox sensor has registered (a finished entry; one still being copied is not registered yet)."""
    registered = set(instance.get_dynamic_partitions(SOURCES_PARTITIONS.name))
    configured = {source.name for source in vlm_config.app.sources}
    return [source for source in vlm_config.sources() if source.name in configured or source.name in registered]


def register_sources(instance: dg.DagsterInstance, app: AppConfig) -> None:
    register_partitions(instance, SOURCES_PARTITIONS, (source.name for source in app.sources))
