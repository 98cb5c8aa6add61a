"""Best-fit-decreasing bin packing of integer token lengths.

Remaining capacities are small integers (0..capacity), so open bins are kept in
one stack per remaining capacity plus a sorted list of the capacities that have
any open bin. Finding the best fit is one bisect over at most `capacity + 1`
values, whatever the number of bins, which keeps a million items to a few
seconds on one core.

The result is deterministic: items are taken longest first, ties by input
position; a bin is reused last-in-first-out among equally good fits.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort

import numpy as np


def lower_bound(lengths: np.ndarray, capacity: int) -> int:
    """No packing can use fewer bins than ceil(total / capacity)."""
    return math.ceil(int(np.asarray(lengths, dtype=np.int64).sum()) / capacity)


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Pack items into bins of `capacity`; returns, per bin, the item indices it holds.

    Every length must be in 1..capacity. Bins come out in the order they were
    opened (so their first items are in decreasing length order); within a bin,
    items are in the order they were placed.
    """
    values = np.asarray(lengths, dtype=np.int64)
    if values.size == 0:
        return []
    if values.min() < 1 or values.max() > capacity:
        raise ValueError(f"lengths must lie in 1..{capacity}; got {values.min()}..{values.max()}")
    order = np.argsort(-values, kind="stable")
    bin_of_item = _assign(values[order].tolist(), capacity)
    return _group(order, np.asarray(bin_of_item, dtype=np.int64))


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Plain first-fit decreasing (the baseline benchmarks compare against).

    Uses a max-segment-tree over bin remainders to find the first bin that fits.
    """
    values = np.asarray(lengths, dtype=np.int64)
    if values.size == 0:
        return []
    order = np.argsort(-values, kind="stable")
    size = 1
    while size < values.size:
        size *= 2
    tree = [0] * (2 * size)
    bin_of_item = []
    opened = 0
    for length in values[order].tolist():
        if tree[1] >= length:
            node = 1
            while node < size:
                node = 2 * node if tree[2 * node] >= length else 2 * node + 1
            target = node - size
        else:
            target = opened
            opened += 1
            node = target + size
            tree[node] = capacity
        tree[node] -= length
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
        bin_of_item.append(target)
    return _group(order, np.asarray(bin_of_item, dtype=np.int64))


def _assign(sizes: list[int], capacity: int) -> list[int]:
    """Best-fit bin number for each size, in the given (decreasing) order."""
    open_bins: list[list[int]] = [[] for _ in range(capacity + 1)]
    free_levels: list[int] = []  # sorted remaining capacities that have an open bin
    bin_of_item: list[int] = []
    append = bin_of_item.append
    opened = 0
    for size in sizes:
        position = bisect_left(free_levels, size)
        if position == len(free_levels):
            target = opened
            opened += 1
            remaining = capacity - size
        else:
            level = free_levels[position]
            stack = open_bins[level]
            target = stack.pop()
            if not stack:
                del free_levels[position]
            remaining = level - size
        append(target)
        if remaining:
            stack = open_bins[remaining]
            if not stack:
                insort(free_levels, remaining)
            stack.append(target)
    return bin_of_item


def _group(order: np.ndarray, bin_of_sorted: np.ndarray) -> list[np.ndarray]:
    """Split item indices (taken in `order`) by bin, keeping placement order."""
    regroup = np.argsort(bin_of_sorted, kind="stable")
    items = order[regroup]
    counts = np.bincount(bin_of_sorted)
    return np.split(items, np.cumsum(counts)[:-1])
