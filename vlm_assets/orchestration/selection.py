"""Which assets a `vlm-assets run` builds, and in what order, from the definitions' public asset specs;
which partitions of an asset a partition of another reads, by the partition mappings the definitions
declare on their dependencies (vlm_assets.defs.spec_assets)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import dagster as dg

from vlm_assets.asset_specs import ASSET_NAMES, selected_asset
from vlm_assets.defs.resources import SOURCE_CHUNKS, SOURCE_CHUNKS_PARTITIONS
from vlm_assets.defs.tags import CHUNKED_TAG
from vlm_assets.tokens.chunk_plan import split_chunk_partition


@dataclass(frozen=True)
class GraphShape:
    order: list[str]  # asset names, dependencies first
    parents: dict[str, set[str]]
    partitioning: dict[str, str | None]  # name of the dynamic partitions definition (or SOURCE_CHUNKS), or None
    partitions_defs: dict[str, dg.PartitionsDefinition | None]
    chunked: set[str] = field(default_factory=set)  # assets whose step can use several processes
    # (asset, upstream asset) -> the partition mapping of that dependency (None: the upstream one is not partitioned)
    mappings: dict[tuple[str, str], dg.PartitionMapping | None] = field(default_factory=dict)


def graph_shape(defs: dg.Definitions) -> GraphShape:
    # The assets we build; external ones (the sources' files) are observed, not built.
    specs = {spec.key.to_user_string(): spec for spec in defs.resolve_all_asset_specs()
             if spec.key.to_user_string() in ASSET_NAMES}
    parents = {name: {dep.asset_key.to_user_string() for dep in spec.deps} & set(specs) for name, spec in specs.items()}
    mappings = {(name, dep.asset_key.to_user_string()): dep.partition_mapping
                for name, spec in specs.items() for dep in spec.deps if dep.asset_key.to_user_string() in specs}
    partitions_defs = {name: spec.partitions_def for name, spec in specs.items()}
    partitioning = {name: _partitioning_name(partitions_def) for name, partitions_def in partitions_defs.items()}
    order: list[str] = []
    remaining = dict(parents)
    while remaining:
        ready = sorted(name for name, deps in remaining.items() if deps <= set(order))
        if not ready:
            raise ValueError(f"dependency cycle among {sorted(remaining)}")
        order.extend(ready)
        for name in ready:
            del remaining[name]
    chunked = {name for name, spec in specs.items() if spec.tags.get(CHUNKED_TAG) == "true"}
    return GraphShape(order, parents, partitioning, partitions_defs, chunked, mappings)


def _partitioning_name(partitions_def: dg.PartitionsDefinition | None) -> str | None:
    if partitions_def == SOURCE_CHUNKS_PARTITIONS:
        return SOURCE_CHUNKS
    return getattr(partitions_def, "name", None)


def source_of(key: str, partitioning: str | None) -> str:
    """The source a `sources` or `source_chunks` partition key belongs to (a chunk selection may name a whole source)."""
    return split_chunk_partition(key)[0] if partitioning == SOURCE_CHUNKS and "|" in key else key


def upstream_partitions(shape: GraphShape, asset: str, partition: str | None, parent: str,
                        store: dg.DagsterInstance) -> set[str] | None:
    """The partitions of `parent` that `partition` of `asset` reads, by that dependency's partition
    mapping; None: all of them (`asset` is not partitioned, or `parent` is not)."""
    asset_def, parent_def = shape.partitions_defs[asset], shape.partitions_defs[parent]
    mapping = shape.mappings.get((asset, parent))
    if partition is None or asset_def is None or parent_def is None or mapping is None:
        return None
    mapped = mapping.get_upstream_mapped_partitions_result_for_partitions(
        asset_def.subset_with_partition_keys([partition]), asset_def, parent_def, dynamic_partitions_store=store)
    return set(mapped.partitions_subset.get_partition_keys())


def downstream_partitions(shape: GraphShape, parent: str, partition: str, asset: str,
                          store: dg.DagsterInstance) -> set[str] | None:
    """The partitions of `asset` that read `partition` of `parent`, by that dependency's partition
    mapping; None: all of them (`asset` is not partitioned, or the dependency has no mapping)."""
    asset_def, parent_def = shape.partitions_defs[asset], shape.partitions_defs[parent]
    mapping = shape.mappings.get((asset, parent))
    if asset_def is None or parent_def is None or mapping is None:
        return None
    mapped = mapping.get_downstream_partitions_for_partitions(
        parent_def.subset_with_partition_keys([partition]), parent_def, asset_def, dynamic_partitions_store=store)
    return set(mapped.get_partition_keys())


@dataclass
class Selection:
    """The assets a run builds, dependencies first. Of an asset named with partitions
    (`asset[partition]`), those partitions; of what it reads, the partitions they read.

    `partitions`: the partitions named, by asset (of a chunked asset, whole sources may be named);
    `whole`: the assets named without a partition; `store`: the instance, which knows the partitions
    of the dynamic partitionings.
    """

    shape: GraphShape
    assets: list[str]
    partitions: dict[str, set[str]] = field(default_factory=dict)
    whole: set[str] = field(default_factory=set)
    store: dg.DagsterInstance | None = None
    _kept: dict[tuple[str, str], bool] = field(default_factory=dict, repr=False)

    def keeps(self, asset: str, partition: str | None) -> bool:
        if asset not in self.assets:
            return False
        if partition is None or not self.partitions:
            return True
        if (asset, partition) not in self._kept:
            self._kept[(asset, partition)] = self._kept_for_itself(asset, partition) or self._read_by_one_kept(asset, partition)
        return self._kept[(asset, partition)]

    def _kept_for_itself(self, asset: str, partition: str) -> bool:
        named = self.partitions.get(asset, set())
        return asset in self.whole or partition in named or source_of(partition, self.shape.partitioning[asset]) in named

    def _read_by_one_kept(self, asset: str, partition: str) -> bool:
        if self.store is None:
            raise ValueError("which partitions a selection keeps needs the instance that knows them")
        for child in self.assets:
            if asset in self.shape.parents[child]:
                readers = downstream_partitions(self.shape, asset, partition, child, self.store)
                if readers is None or any(self.keeps(child, key) for key in sorted(readers)):
                    return True
        return False


def selection_of(shape: GraphShape, items: Sequence[str] | None, store: dg.DagsterInstance | None = None) -> Selection:
    """`items` (asset names, or `asset[partition]` for one partition of a partitioned asset) and
    everything they read, dependencies first; every asset when `items` is empty.

    `store` (the instance) is needed to tell which partitions of what a named partition reads are kept.
    """
    if not items:
        return Selection(shape, list(shape.order), store=store)
    partitions: dict[str, set[str]] = {}
    whole: set[str] = set()
    for item in items:
        asset, partition = selected_asset(item)
        if partition is not None and shape.partitioning[asset] is None:
            raise ValueError(f"{item}: {asset} is not partitioned; select it as `{asset}`")
        if partition is None:
            whole.add(asset)
        else:
            partitions.setdefault(asset, set()).add(partition)
    wanted = whole | set(partitions)
    for name in reversed(shape.order):
        if name in wanted:
            wanted |= shape.parents[name]
    return Selection(shape, [name for name in shape.order if name in wanted], partitions, whole, store)
