"""Which assets a `vlm-assets run` builds, and in what order, from the definitions' public asset specs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import dagster as dg

from vlm_assets.defs.tags import CHUNKED_TAG


@dataclass(frozen=True)
class GraphShape:
    order: list[str]  # asset names, dependencies first
    parents: dict[str, set[str]]
    partitioning: dict[str, str | None]  # name of the dynamic partitions definition, or None
    chunked: set[str] = field(default_factory=set)  # assets whose step can use several processes


def graph_shape(defs: dg.Definitions) -> GraphShape:
    specs = {spec.key.to_user_string(): spec for spec in defs.resolve_all_asset_specs()}
    parents = {name: {dep.asset_key.to_user_string() for dep in spec.deps} & set(specs) for name, spec in specs.items()}
    partitioning = {name: getattr(spec.partitions_def, "name", None) for name, spec in specs.items()}
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
    return GraphShape(order, parents, partitioning, chunked)


def selected_assets(shape: GraphShape, select: Sequence[str] | None) -> list[str]:
    """`select` and everything it reads, dependencies first; every asset when `select` is empty."""
    if not select:
        return list(shape.order)
    unknown = sorted(set(select) - set(shape.order))
    if unknown:
        raise ValueError(f"unknown asset key(s): {', '.join(unknown)} (known: {', '.join(sorted(shape.order))})")
    wanted = set(select)
    for name in reversed(shape.order):
        if name in wanted:
            wanted |= shape.parents[name]
    return [name for name in shape.order if name in wanted]
