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
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

# Items are assigned this many at a time, so only that many lengths and bin numbers are Python ints
# at once (36 bytes each) while the whole assignment stays in numpy.
ASSIGN_SLICE = 65_536


@dataclass(frozen=True)
class Bins:
    """Item indices grouped by bin: bin b holds `items[starts[b]:starts[b + 1]]`, in placement order."""

    items: np.ndarray
    starts: np.ndarray

    def __len__(self) -> int:
        return self.starts.size - 1

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.items[self.starts[index]:self.starts[index + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[index] for index in range(len(self)))


def lower_bound(lengths: np.ndarray, capacity: int) -> int:
    """No packing can use fewer bins than ceil(total / capacity)."""
    return math.ceil(int(np.asarray(lengths, dtype=np.int64).sum()) / capacity)


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> Bins:
    """Pack items into bins of `capacity`; returns the item indices each bin holds.

    Every length must be in 1..capacity. Bins come out in the order they were
    opened (so their first items are in decreasing length order); within a bin,
    items are in the order they were placed.
    """
    values = np.asarray(lengths)
    if values.size == 0:
        return _group(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    if not np.issubdtype(values.dtype, np.integer):
        raise TypeError(f"lengths must be integers; got {values.dtype}")
    if values.min() < 1 or values.max() > capacity or capacity >= 2**31:
        raise ValueError(f"lengths must lie in 1..{capacity}; got {values.min()}..{values.max()}")
    # int32 indices and sizes: a million items' arrays are what packing holds per sample.
    sizes = values.astype(np.int32, copy=False)
    order = np.argsort(-sizes, kind="stable").astype(np.int32)
    return _group(order, _assign(sizes[order], capacity))


def _assign(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Best-fit bin number for each size, in the given (decreasing) order."""
    open_bins: list[list[int]] = [[] for _ in range(capacity + 1)]
    free_levels: list[int] = []  # sorted remaining capacities that have an open bin
    bin_of_item = np.empty(sizes.size, dtype=np.int32)
    opened = 0
    for start in range(0, sizes.size, ASSIGN_SLICE):
        part = sizes[start:start + ASSIGN_SLICE].tolist()
        bin_of_item[start:start + len(part)], opened = _assign_part(part, capacity, open_bins, free_levels, opened)
    return bin_of_item


def _assign_part(sizes: list[int], capacity: int, open_bins: list[list[int]], free_levels: list[int],
                 opened: int) -> tuple[list[int], int]:
    bin_of_item: list[int] = []
    append = bin_of_item.append
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
    return bin_of_item, opened


def _group(order: np.ndarray, bin_of_sorted: np.ndarray) -> Bins:
    """Item indices (taken in `order`) grouped by bin, keeping placement order."""
    items = order[np.argsort(bin_of_sorted, kind="stable")]
    starts = np.zeros(int(bin_of_sorted.max(initial=-1)) + 2, dtype=np.int64)
    np.cumsum(np.bincount(bin_of_sorted), out=starts[1:])
    return Bins(items, starts)
