"""`source_files`: the files of each source, as Dagster sees them change.

An external asset partitioned like the sources. Its observations carry the digest of the source's
files (vlm_assets.catalog.source_walk.walk_source) as data version, so the UI marks a source's
catalogue stale after its files change, exactly when `vlm-assets run` would rebuild it. Whoever
walks a source records what it found: `vlm-assets run` before it judges what to build, the
catalogue step before it reads, and source_files_sensor for a user who only runs the UI. An
observation also holds the snapshot (files, bytes, newest mtime) of the files the records are read
from: the catalogue step starts from it instead of walking the source once more, and its walk after
reading proves the files are still as observed.
"""

from __future__ import annotations

from collections.abc import Callable

import dagster as dg

from vlm_assets.config import SourceConfig
from vlm_assets.catalog.source_walk import SourceFiles
from vlm_assets.defs.resources import SOURCES_PARTITIONS
from vlm_assets.defs.tags import DATA_VERSION_TAG

SOURCE_FILES = dg.AssetKey("source_files")

source_files = dg.AssetSpec(
    SOURCE_FILES,
    partitions_def=SOURCES_PARTITIONS,
    group_name="catalog",
    description="A source's files (its path, media root and allowed roots). Each observation's data version "
    "is the digest of their names, sizes and modification times; a new one marks the source's catalogue stale. "
    "files_read, bytes_read: what its records are read from (its path, and a media root of its own).",
)


def _latest_observation(instance: dg.DagsterInstance, source: str) -> dg.AssetObservation | None:
    records = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=SOURCE_FILES, asset_partitions=[source]), limit=1).records
    return records[0].asset_observation if records else None


def observed_digest(instance: dg.DagsterInstance, source: str) -> str:
    """The digest the latest observation of `source`'s files recorded ("" for none)."""
    observation = _latest_observation(instance, source)
    return (observation.data_version or "") if observation else ""


def observed_source_files(instance: dg.DagsterInstance, source: str) -> SourceFiles | None:
    """The source's files as last observed (None: never, or by a version that recorded no snapshot)."""
    observation = _latest_observation(instance, source)
    if observation is None or not observation.data_version:
        return None
    values = [getattr(observation.metadata.get(key), "value", None) for key in _SNAPSHOT_KEYS]
    if not all(isinstance(value, int) for value in values):
        return None
    files, size, newest = values
    return SourceFiles(observation.data_version, (files, size, newest))


# The snapshot of a source's files (vlm_assets.catalog.source_walk.Snapshot), in an observation's metadata.
_SNAPSHOT_KEYS = ("files_read", "bytes_read", "newest_mtime_ns")


def source_files_observation(source: SourceConfig, files: SourceFiles) -> dg.AssetObservation:
    snapshot = dict(zip(_SNAPSHOT_KEYS, files.snapshot))
    return dg.AssetObservation(
        asset_key=SOURCE_FILES, partition=source.name, tags={DATA_VERSION_TAG: files.digest},
        metadata={"path": dg.MetadataValue.path(str(source.path)), "kind": source.kind, "digest": files.digest,
                  **snapshot},
    )


def changed_source_files(instance: dg.DagsterInstance, sources: list[SourceConfig],
                         walk: Callable[[str], SourceFiles]) -> list[dg.AssetObservation]:
    """Observations for the registered sources whose files' digest (`walk(name)`) differs from the
    one last observed."""
    registered = set(instance.get_dynamic_partitions(SOURCES_PARTITIONS.name))
    observations = []
    for source in sources:
        if source.name in registered:
            files = walk(source.name)
            if observed_digest(instance, source.name) != files.digest:
                observations.append(source_files_observation(source, files))
    return observations
