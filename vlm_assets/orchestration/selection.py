"""Which assets a `vlm-assets run` builds, and in what order, from the definitions' public asset specs."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import dagster as dg

from vlm_assets.asset_registry import ASSET_NAMES
from vlm_assets.defs.tags import CHUNKED_TAG


@dataclass(frozen=True)
class GraphShape:
    order: list[str]  # asset names, dependencies first
    parents: dict[str, set[str]]
    partitioning: dict[str, str | None]  # name of the dynamic partitions definition, or None
    partitions_defs: dict[str, dg.PartitionsDefinition | None]
    chunked: set[str] = field(default_factory=set)  # assets whose step can use several processes


def graph_shape(defs: dg.Definitions) -> GraphShape:
    # The assets we build; external ones (the sources' files) are observed, not built.
    specs = {spec.key.to_user_string(): spec for spec in defs.resolve_all_asset_specs()
             if spec.key.to_user_string() in ASSET_NAMES}
    parents = {name: {dep.asset_key.to_user_string() for dep in spec.deps} & set(specs) for name, spec in specs.items()}
    partitions_defs = {name: spec.partitions_def for name, spec in specs.items()}
    partitioning = {name: getattr(partitions_def, "name", None) for name, partitions_def in partitions_defs.items()}
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


@dataclass(frozen=True)
class Selection:
    """The assets a run builds, dependencies first, and for some of them only these partitions."""

    assets: list[str]
    partitions: dict[str, set[str]] = field(default_factory=dict)  # asset -> its partitions to build; absent: all

    def keeps(self, asset: str, partition: str | None) -> bool:
        return asset not in self.partitions or partition in self.partitions[asset]


SELECTED_PARTITION = re.compile(r"^(?P<asset>[^\[\]]+)\[(?P<partition>[^\[\]]+)\]$")


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
        match = SELECTED_PARTITION.match(item)
        asset, partition = (match["asset"], match["partition"]) if match else (item, None)
        if asset not in shape.order:
            raise ValueError(f"unknown asset key(s): {asset} (known: {', '.join(sorted(shape.order))})")
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
            same = wanted[name] is not None and shape.partitioning[parent] == shape.partitioning[name]
            inherited = set(wanted[name]) if same else None  # type: ignore[arg-type]
            if parent not in wanted:
                wanted[parent] = inherited
            elif wanted[parent] is not None:
                wanted[parent] = None if inherited is None else wanted[parent] | inherited  # type: ignore[operator]
    return Selection([name for name in shape.order if name in wanted],
                     {name: keys for name, keys in wanted.items() if keys is not None})
