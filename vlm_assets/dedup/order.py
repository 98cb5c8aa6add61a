"""The order in which sources keep their samples: a sample is a duplicate only of one kept before it."""

from __future__ import annotations

from collections.abc import Iterable


def priority_order(sources: Iterable[str], priority: Iterable[str]) -> list[str]:
    """Sources in keep order: those `priority` (`dedup.priority`) names, in its order, then the others as given."""
    names = list(sources)
    first = [name for name in priority if name in names]
    return first + [name for name in names if name not in first]
