"""Which assets a `vlm-assets run` builds, and in what order, from the definitions' public asset specs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import dagster as dg

from vlm_assets.asset_specs import ASSET_NAMES, selected_asset
from vlm_assets.defs.resources import SOURCE_CHUNKS, SOURCE_CHUNKS_PARTITIONS, SOURCES_PARTITIONS
from vlm_assets.defs.tags import CHUNKED_TAG
from vlm_assets.tokens.chunk_plan import split_chunk_partition


@dataclass(frozen=True)
class GraphShape:
    order: list[str]  # asset names, dependencies first
    parents: dict[str, set[str]]
    partitioning: dict[str, str | None]  # name of the dynamic partitions definition (or SOURCE_CHUNKS), or None
    partitions_defs: dict[str, dg.PartitionsDefinition | None]
    chunked: set[str] = field(default_factory=set)  # assets whose step can use several processes


def graph_shape(defs: dg.Definitions) -> GraphShape:
    # The assets we build; external ones (the sources' files) are observed, not built.
    specs = {spec.key.to_user_string(): spec for spec in defs.resolve_all_asset_specs()
             if spec.key.to_user_string() in ASSET_NAMES}
    parents = {name: {dep.asset_key.to_user_string() for dep in spec.deps} & set(specs) for name, spec in specs.items()}
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
    return GraphShape(order, parents, partitioning, partitions_defs, chunked)


def _partitioning_name(partitions_def: dg.PartitionsDefinition | None) -> str | None:
    if partitions_def == SOURCE_CHUNKS_PARTITIONS:
        return SOURCE_CHUNKS
    return getattr(partitions_def, "name", None)


def source_of(key: str, partitioning: str | None) -> str:
    """The source a `sources` or `source_chunks` partition key belongs to (a chunk selection may name a whole source)."""
    return split_chunk_partition(key)[0] if partitioning == SOURCE_CHUNKS and "|" in key else key


def _per_source(partitionings: set[str | None]) -> bool:
    """A source partition and its chunks read each other (a chunk its source's catalogue, a source its chunks)."""
    return partitionings == {SOURCES_PARTITIONS.name, SOURCE_CHUNKS}


@dataclass(frozen=True)
class Selection:
    """The assets a run builds, dependencies first, and for some of them only these partitions."""

    assets: list[str]
    # asset -> its partitions to build (for chunk partitions, whole sources may be named); absent: all
    partitions: dict[str, set[str]] = field(default_factory=dict)

    def keeps(self, asset: str, partition: str | None) -> bool:
        if asset not in self.partitions or partition in self.partitions[asset]:
            return True
        return partition is not None and "|" in partition and source_of(partition, SOURCE_CHUNKS) in self.partitions[asset]


def selection_of(shape: GraphShape, items: Sequence[str] | None) -> Selection:
    """`items` (asset names, or `asset[partition]` for one partition of a partitioned asset) and
    everything they read, dependencies first; every asset when `items` is empty.

    An upstream asset partitioned like its selected partition is built for that partition only;
    one partitioned otherwise (a shard's plan reads every source) is built for all of them.
    """
    if not items:
        return Selection(list(shape.order))
    named: dict[str, set[str] | None] = {}
    for item in items:
        asset, partition = selected_asset(item)
        if partition is not None and shape.partitioning[asset] is None:
            raise ValueError(f"{item}: {asset} is not partitioned; select it as `{asset}`")
        if partition is None or named.get(asset, set()) is None:
            named[asset] = None
        else:
            named.setdefault(asset, set()).add(partition)  # type: ignore[union-attr]
    wanted: dict[str, set[str] | None] = dict(named)
    for name in reversed(shape.order):
        if name not in wanted:
            continue
        for parent in shape.parents[name]:
            child_keys, partitionings = wanted[name], {shape.partitioning[parent], shape.partitioning[name]}
            inherited: set[str] | None = None
            if child_keys is not None and len(partitionings) == 1:
                inherited = set(child_keys)
            elif child_keys is not None and _per_source(partitionings):
                inherited = {source_of(key, shape.partitioning[name]) for key in child_keys}
            if parent not in wanted:
                wanted[parent] = inherited
            elif wanted[parent] is not None:
                wanted[parent] = None if inherited is None else wanted[parent] | inherited  # type: ignore[operator]
    return Selection([name for name in shape.order if name in wanted],
                     {name: keys for name, keys in wanted.items() if keys is not None})
