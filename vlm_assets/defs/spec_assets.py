"""Dagster assets made from their specs (vlm_assets.asset_specs): the name, upstream assets, group and
partitions come from the spec, the rest (kinds, pools, automation, description) from the call."""

from collections.abc import Callable
from typing import Any

import dagster as dg

from vlm_assets.asset_specs import Partitioning, spec_of
from vlm_assets.defs.resources import FRAME_CACHE_SHARD_PARTITIONS, SOURCE_CHUNKS_PARTITIONS, SOURCES_PARTITIONS

PARTITIONS_OF: dict[Partitioning, dg.PartitionsDefinition | None] = {
    Partitioning.SOURCES: SOURCES_PARTITIONS,
    Partitioning.SOURCE_CHUNKS: SOURCE_CHUNKS_PARTITIONS,
    Partitioning.FRAME_CACHE_SHARDS: FRAME_CACHE_SHARD_PARTITIONS,
    Partitioning.NONE: None,
}


def spec_asset(name: str, **settings: Any) -> Callable[[Callable[..., Any]], dg.AssetsDefinition]:
    """`@dg.asset` for the asset `name` its spec describes."""
    spec = spec_of(name)
    return dg.asset(name=name, deps=list(spec.upstream), group_name=spec.group,
                    partitions_def=PARTITIONS_OF[spec.partitioning], **settings)
