"""Dagster assets made from their specs (vlm_assets.asset_specs): the name, upstream assets, group and
partitions come from the spec, the rest (kinds, pools, automation, description) from the call.

Each dependency between two specs carries its partition mapping, so Dagster (the UI, automation,
backfills) and `vlm-assets run` read the same answer to which partitions a partition reads.
"""

import warnings
from collections.abc import Callable
from typing import Any

import dagster as dg

from vlm_assets.asset_specs import SPECS, AssetSpec, Partitioning, spec_of
from vlm_assets.defs.resources import (
    FRAME_CACHE_SHARD_PARTITIONS, SOURCE_CHUNKS_PARTITIONS, SOURCE_DIMENSION, SOURCES_PARTITIONS,
)

PARTITIONS_OF: dict[Partitioning, dg.PartitionsDefinition | None] = {
    Partitioning.SOURCES: SOURCES_PARTITIONS,
    Partitioning.SOURCE_CHUNKS: SOURCE_CHUNKS_PARTITIONS,
    Partitioning.FRAME_CACHE_SHARDS: FRAME_CACHE_SHARD_PARTITIONS,
    Partitioning.NONE: None,
}
# Dagster's own default between the two partitionings, declared so that everything reads it from one
# place (the class is marked beta, hence the warning left out).
with warnings.catch_warnings():
    warnings.simplefilter("ignore", dg.BetaWarning)
    BY_SOURCE = dg.MultiToSingleDimensionPartitionMapping(partition_dimension_name=SOURCE_DIMENSION)


def partition_mapping(downstream: Partitioning, upstream: Partitioning) -> dg.PartitionMapping | None:
    """Which partitions of an asset partitioned `upstream` a partition of one partitioned `downstream`
    reads: the same one; a source's chunks and the source read each other; otherwise all of them.
    None where the upstream asset is one output, which every partition reads."""
    if upstream is Partitioning.NONE:
        return None
    if downstream is upstream:
        return dg.IdentityPartitionMapping()
    if {downstream, upstream} == {Partitioning.SOURCES, Partitioning.SOURCE_CHUNKS}:
        return BY_SOURCE
    return dg.AllPartitionMapping()


def dependencies(spec: AssetSpec) -> list[dg.AssetDep]:
    """The spec's upstream assets, each with its partition mapping (Dagster's own for an external one)."""
    return [dg.AssetDep(name, partition_mapping=dg.AllPartitionMapping() if name in spec.reads_every_partition_of
                        else partition_mapping(spec.partitioning, SPECS[name].partitioning))
            if name in SPECS else dg.AssetDep(name) for name in spec.upstream]


def spec_asset(name: str, **settings: Any) -> Callable[[Callable[..., Any]], dg.AssetsDefinition]:
    """`@dg.asset` for the asset `name` its spec describes."""
    spec = spec_of(name)
    return dg.asset(name=name, deps=dependencies(spec), group_name=spec.group,
                    partitions_def=PARTITIONS_OF[spec.partitioning], **settings)
