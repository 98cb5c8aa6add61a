"""Finding 64-bit perceptual hashes within a Hamming distance without comparing every pair.

Multi-index hashing: a hash is cut into `m` bands of bits. Two hashes that differ in at most `r` bits
differ in at most `r // m` bits in some band (pigeonhole), so looking up, in each band, the query's
band value and every value within `r // m` bits of it finds every stored hash within `r`, plus some
farther ones, which are measured and dropped. Few wide bands mean many values to look up; many
narrow ones mean many hashes met per lookup (stored hashes / 2^width). `m` is chosen for the number
of hashes held, the one with the least of both (about 4 bands for a hundred thousand hashes at the
default distance, 3 for millions).

Memory matters at a hundred million samples, so nothing is held per hash as a Python object. The
hashes live in sorted runs of numpy arrays (per band: the band values in order and where each hash
is), found by binary search; new hashes wait in a small buffer that is scanned whole, and become a
run when it fills. Runs of like size merge, as in a log-structured merge tree, so a hash is re-sorted
only a logarithmic number of times and a query searches a logarithmic number of runs. A run keeps
every band's keys in one sorted array, so a query costs one search per run, not one per band. That
is 8 + 16·m bytes per hash (its item, and per band its key, itself and its place).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from itertools import combinations

import numpy as np

HASH_BITS = 64
# Hashes buffered before they become a sorted run; a query scans the buffer whole.
BUFFER_HASHES = 16384
# What a value looked up (two binary searches in a large run) costs against a hash met, as measured
# at ten million hashes.
LOOKUP_COST = 12.0


def hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()


@functools.cache
def _flips(width: int, radius: int) -> np.ndarray:
    """Every `width`-bit value with at most `radius` bits set: the flips that reach a band's neighbours."""
    dtype = np.uint32 if width <= 32 else np.uint64  # a band of up to 32 bits is held in 4 bytes
    return np.array([sum(1 << bit for bit in bits) for count in range(radius + 1)
                     for bits in combinations(range(width), count)], dtype=dtype)


def _widths(count: int) -> list[int]:
    return [HASH_BITS // count + (band < HASH_BITS % count) for band in range(count)]


def _query_cost(count: int, max_distance: int, held: int) -> float:
    """Values looked up and hashes met per query, with `held` hashes cut into `count` bands."""
    radius = max_distance // count
    cost = 0.0
    for width in _widths(count):
        lookups = sum(math.comb(width, flipped) for flipped in range(min(radius, width) + 1))
        cost += lookups * (LOOKUP_COST + held / 2**width)
    return cost


class _Bands:
    """How hashes are cut into bands, and their keys: a band's value with the band's number above it,
    so that one sorted array holds every band, each band's keys side by side."""

    def __init__(self, max_distance: int, held: int) -> None:
        count = min(range(1, min(HASH_BITS, max_distance + 1) + 1),
                    key=lambda count: _query_cost(count, max_distance, held))
        widths = _widths(count)
        self.count = count
        self.shifts = np.cumsum([0, *widths[:-1]]).astype(np.uint64)
        self.masks = np.array([(1 << width) - 1 for width in widths], dtype=np.uint64)
        tag_shift = max(widths)
        self.dtype = np.uint32 if tag_shift + (count - 1).bit_length() <= 32 else np.uint64
        self.tags = [self.dtype(band << tag_shift) if count > 1 else self.dtype(0) for band in range(count)]
        flips = [_flips(width, max_distance // count).astype(self.dtype) for width in widths]
        self.flip_counts = np.array([len(each) for each in flips])
        self.flips = np.concatenate(flips)
        self.flip_tags = np.repeat(np.array(self.tags, dtype=self.dtype), self.flip_counts)
        self.top = np.iinfo(self.dtype).max

    def keys(self, hashes: np.ndarray, band: int) -> np.ndarray:
        return ((hashes >> self.shifts[band]) & self.masks[band]).astype(self.dtype) | self.tags[band]

    def wanted(self, query: np.uint64) -> np.ndarray:
        """The keys within the per-band radius of the query's, in order."""
        values = ((query >> self.shifts) & self.masks).astype(self.dtype)
        return np.sort((np.repeat(values, self.flip_counts) ^ self.flips) | self.flip_tags)


class _Run:
    """Hashes sorted once by every band's key, for binary search."""

    def __init__(self, items: np.ndarray, hashes: np.ndarray, max_distance: int) -> None:
        self.items = items
        self.max_distance = max_distance
        self.bands = _Bands(max_distance, len(hashes))
        # The keys in order, the hashes in that order (the hashes a lookup meets lie side by side in
        # memory), and where each of them is in `items`. A band's keys sort below the next band's, so
        # each band is sorted into its own block: no sort of every band's keys at once, nor its memory.
        held, count = len(hashes), self.bands.count
        self.keys = np.empty(held * count, dtype=self.bands.dtype)
        self.hashes = np.empty(held * count, dtype=np.uint64)
        self.where = np.empty(held * count, dtype=np.int64 if held >= 2**31 else np.int32)
        for band in range(count):
            keys = self.bands.keys(hashes, band)
            order = np.argsort(keys, kind="stable")
            block = slice(band * held, (band + 1) * held)
            self.keys[block], self.hashes[block], self.where[block] = keys[order], hashes[order], order

    def __len__(self) -> int:
        return len(self.items)

    def contents(self) -> tuple[np.ndarray, np.ndarray]:
        """(items, hashes), in the first band's order (its keys come first)."""
        return self.items[self.where[:len(self)]], self.hashes[:len(self)]

    @property
    def nbytes(self) -> int:
        return self.items.nbytes + self.keys.nbytes + self.hashes.nbytes + self.where.nbytes

    def near(self, query: np.uint64) -> np.ndarray:
        """The items of this run whose hash is within `max_distance` bits of `query`."""
        # In order: each binary search starts where the one before ended, and reads memory near it.
        wanted = self.bands.wanted(query)
        # One search for where each wanted key starts and where the next key starts.
        bounds = np.searchsorted(self.keys, np.concatenate([wanted, wanted + 1]))
        starts, ends = bounds[:len(wanted)], bounds[len(wanted):]
        # A key at the top of its type wraps to 0 above: its end is the array's end.
        ends[wanted == self.bands.top] = len(self.keys)
        hits = ends > starts
        if not hits.any():
            return np.empty(0, dtype=np.int64)
        at = _ranges(starts[hits], ends[hits])
        # A hash found in several bands is listed several times: the caller's set takes it once.
        return self.items[self.where[at[np.bitwise_count(self.hashes[at] ^ query) <= self.max_distance]]]


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The concatenation of range(start, end) for each pair, without a Python loop."""
    lengths = ends - starts
    offsets = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return offsets + np.arange(int(lengths.sum()))


class _Position:
    """The index of one hash position (an image's one hash, or one of a video's frames)."""

    def __init__(self, max_distance: int) -> None:
        self.max_distance = max_distance
        self.runs: list[_Run] = []
        self.buffer_items = np.empty(BUFFER_HASHES, dtype=np.int64)
        self.buffer_hashes = np.empty(BUFFER_HASHES, dtype=np.uint64)
        self.buffered = 0

    def add(self, item: int, value: int) -> None:
        self.buffer_items[self.buffered], self.buffer_hashes[self.buffered] = item, value
        self.buffered += 1
        if self.buffered == BUFFER_HASHES:
            self._seal()

    def _seal(self) -> None:
        """The buffer becomes a run; runs that are no more than twice the next one's size merge."""
        run = _Run(self.buffer_items.copy(), self.buffer_hashes.copy(), self.max_distance)
        self.buffered = 0
        while self.runs and len(self.runs[-1]) <= 2 * len(run):
            (items, hashes), (more_items, more_hashes) = self.runs.pop().contents(), run.contents()
            run = _Run(np.concatenate([items, more_items]), np.concatenate([hashes, more_hashes]), self.max_distance)
        self.runs.append(run)

    @property
    def nbytes(self) -> int:
        return self.buffer_items.nbytes + self.buffer_hashes.nbytes + sum(run.nbytes for run in self.runs)

    def near(self, value: int) -> list[np.ndarray]:
        query = np.uint64(value)
        found = [run.near(query) for run in self.runs]
        buffered = self.buffer_hashes[:self.buffered]
        found.append(self.buffer_items[:self.buffered][np.bitwise_count(buffered ^ query) <= self.max_distance])
        return found


class BandedHashIndex:
    """Items by 64-bit hash; `positions` hashes per item (a video's frames), each position indexed
    apart. `candidates` returns the items with a hash at some position within `max_distance` bits
    of the query's at that position (exactly those)."""

    def __init__(self, max_distance: int) -> None:
        self._positions: dict[int, _Position] = defaultdict(lambda: _Position(max_distance))

    def add(self, item: int, hashes: tuple[int, ...]) -> None:
        for position, value in enumerate(hashes):
            self._positions[position].add(item, value)

    def memory_bytes(self) -> int:
        """The bytes the index's arrays hold."""
        return sum(position.nbytes for position in self._positions.values())

    def candidates(self, hashes: tuple[int, ...]) -> set[int]:
        found: set[int] = set()
        for position, value in enumerate(hashes):
            if position in self._positions:
                for items in self._positions[position].near(value):
                    found.update(items.tolist())
        return found
