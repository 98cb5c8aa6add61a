"""Dagster assets made from their specs (vlm_assets.asset_specs): the name, upstream assets, group and
partitions come from the spec, the rest (kinds, pools, automation, description) from the call.

An asset's function only builds: it returns `Built` (its metadata). The steps around every build are
the factory's: the fingerprint taken before the function reads an input, the spec's locks held while
it runs, its outputs published (to object storage) when it ends, and the materialisation recorded
with the fingerprint as its data version.

Each dependency between two specs carries its partition mapping, so Dagster (the UI, automation,
backfills) and `vlm-assets run` read the same answer to which partitions a partition reads.
"""

import functools
import inspect
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import dagster as dg

from vlm_assets.asset_specs import SPECS, AssetSpec, Partitioning, spec_of
from vlm_assets.defs.resources import (
    FRAME_CACHE_SHARD_PARTITIONS, SOURCE_CHUNKS_PARTITIONS, SOURCE_DIMENSION, SOURCES_PARTITIONS, VlmConfig,
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


@dataclass(frozen=True)
class Built:
    """What an asset's function returns: the materialisation's metadata, and what differs from the rule."""

    metadata: dict[str, Any]
    # Where the output's bytes can stay the same over changed inputs: its digest, not the fingerprint.
    data_version: str | None = None
    # The catalogue's: which source files it read is known only once it has read them.
    fingerprint: str | None = None
    # Results of the asset's checks computed with it, evaluated once the locks are released.
    checks: Iterable[dg.AssetCheckResult] = ()


def spec_asset(name: str, fingerprints_itself: bool = False,
               **settings: Any) -> Callable[[Callable[..., Built]], dg.AssetsDefinition]:
    """`@dg.asset` for the asset `name` its spec describes, around a function that builds it and
    returns `Built`: the fingerprint, the locks, the publishing and the versioned record are done here.
    `fingerprints_itself`: the function returns the fingerprint (the catalogue: its source's files are
    walked once, as it reads them)."""
    spec = spec_of(name)

    def decorate(build: Callable[..., Built]) -> dg.AssetsDefinition:
        @functools.wraps(build)
        def step(context: dg.AssetExecutionContext, vlm_config: VlmConfig, **resources: Any):
            taken = vlm_config.build(context, take_fingerprint=not fingerprints_itself)
            with taken.writing():
                built = build(context, vlm_config, **resources)
            yield dg.MaterializeResult(**taken.result(built.metadata, built.data_version, built.fingerprint))
            yield from built.checks

        # Dagster reads the parameters (the resources) from the function's; what it returns is ours.
        step.__signature__ = inspect.signature(build).replace(return_annotation=inspect.Signature.empty)
        return dg.asset(name=name, deps=dependencies(spec), group_name=spec.group,
                        partitions_def=PARTITIONS_OF[spec.partitioning], **settings)(step)

    return decorate
