"""Finding 64-bit perceptual hashes within a Hamming distance without comparing every pair.

Multi-index hashing: a hash is cut into `m` bands of bits, each band value a key of its own. Two
hashes that differ in at most `r` bits differ in at most `r // m` bits in some band (pigeonhole),
so looking up, in each band, the query's band value and every value within `r // m` bits of it
finds every stored hash within `r`, plus some farther ones, which are measured and dropped. Bands
of about 16 bits keep both the lookups per query (the values within `r // m` bits) and the hashes
met per lookup (stored hashes / 2¹⁶) small.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import combinations

HASH_BITS = 64
BAND_BITS = 16


def hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()


def _masks(width: int, radius: int) -> list[int]:
    """Every `width`-bit value with at most `radius` bits set: the flips that reach a band's neighbours."""
    return [sum(1 << bit for bit in bits) for count in range(radius + 1) for bits in combinations(range(width), count)]


class BandedHashIndex:
    """Items by 64-bit hash; `positions` hashes per item (a video's frames), each position indexed
    apart. `candidates` returns the items with a hash at some position within `max_distance` bits
    of the query's at that position (exactly those)."""

    def __init__(self, max_distance: int) -> None:
        self.max_distance = max_distance
        bands = max(1, min(max_distance + 1, HASH_BITS // BAND_BITS))
        widths = [HASH_BITS // bands + (band < HASH_BITS % bands) for band in range(bands)]
        radius = max_distance // bands
        self._bands: list[tuple[int, int, list[int]]] = []  # (shift, mask, neighbour flips)
        shift = 0
        for width in widths:
            self._bands.append((shift, (1 << width) - 1, _masks(width, radius)))
            shift += width
        # position -> band -> band value -> items
        self._tables: dict[int, list[dict[int, list[int]]]] = defaultdict(lambda: [defaultdict(list) for _ in self._bands])
        self._hashes: dict[int, tuple[int, ...]] = {}

    def add(self, item: int, hashes: tuple[int, ...]) -> None:
        self._hashes[item] = hashes
        for position, value in enumerate(hashes):
            for table, (shift, mask, _) in zip(self._tables[position], self._bands):
                table[(value >> shift) & mask].append(item)

    def candidates(self, hashes: tuple[int, ...]) -> set[int]:
        found: set[int] = set()
        for position, value in enumerate(hashes):
            if position not in self._tables:
                continue
            met: set[int] = set()
            for table, (shift, mask, flips) in zip(self._tables[position], self._bands):
                band = (value >> shift) & mask
                for flip in flips:
                    met.update(table.get(band ^ flip, ()))
            found.update(item for item in met - found if position < len(self._hashes[item])
                         and hamming(self._hashes[item][position], value) <= self.max_distance)
        return found
