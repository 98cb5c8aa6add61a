"""`source_files`: the files of each source, as Dagster sees them change.

An external asset partitioned like the sources. Its observations carry the digest of the source's
files (vlm_assets.fingerprints.source_files_digest) as data version, so the UI marks a source's
catalogue stale after its files change, exactly when `vlm-assets run` would rebuild it. Whoever
walks a source records what it found: `vlm-assets run` before it judges what to build, the
catalogue step before it reads, and source_files_sensor for a user who only runs the UI.
"""

from __future__ import annotations

from collections.abc import Callable

import dagster as dg

from vlm_assets.config import SourceConfig
from vlm_assets.defs.resources import SOURCES_PARTITIONS
from vlm_assets.defs.tags import DATA_VERSION_TAG

SOURCE_FILES = dg.AssetKey("source_files")

source_files = dg.AssetSpec(
    SOURCE_FILES,
    partitions_def=SOURCES_PARTITIONS,
    group_name="catalog",
    description="A source's files (its path, media root and allowed roots). Each observation's data version "
    "is the digest of their names, sizes and modification times; a new one marks the source's catalogue stale.",
)


def observed_digest(instance: dg.DagsterInstance, source: str) -> str:
    """The digest the latest observation of `source`'s files recorded ("" for none)."""
    records = instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=SOURCE_FILES, asset_partitions=[source]), limit=1).records
    observation = records[0].asset_observation if records else None
    return (observation.data_version or "") if observation else ""


def source_files_observation(source: SourceConfig, digest: str) -> dg.AssetObservation:
    return dg.AssetObservation(
        asset_key=SOURCE_FILES, partition=source.name, tags={DATA_VERSION_TAG: digest},
        metadata={"path": dg.MetadataValue.path(str(source.path)), "kind": source.kind, "digest": digest},
    )


def changed_source_files(instance: dg.DagsterInstance, sources: list[SourceConfig],
                         digest_of: Callable[[str], str]) -> list[dg.AssetObservation]:
    """Observations for the registered sources whose files' digest (`digest_of(name)`) differs from
    the one last observed."""
    registered = set(instance.get_dynamic_partitions(SOURCES_PARTITIONS.name))
    observations = []
    for source in sources:
        if source.name in registered:
            digest = digest_of(source.name)
            if observed_digest(instance, source.name) != digest:
                observations.append(source_files_observation(source, digest))
    return observations
