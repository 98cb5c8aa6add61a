"""Finding 64-bit perceptual hashes within a Hamming distance without comparing every pair.

Multi-index hashing: a hash is cut into `max_distance + 1` bands of bits, and each band value is a
key of its own. Two hashes that differ in at most `max_distance` bits differ in at most that many
bands, so at least one band is equal (pigeonhole): looking up each band of a query finds every
hash within the distance, plus some farther ones, which the caller measures and drops.
"""

from __future__ import annotations

from collections import defaultdict

HASH_BITS = 64


def hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()


class BandedHashIndex:
    """Items by 64-bit hash, looked up by band; `positions` hashes per item (a video's frames), each
    position indexed apart."""

    def __init__(self, max_distance: int) -> None:
        bands = max_distance + 1
        # Bands as even as the bits allow: the first `HASH_BITS % bands` one bit wider.
        widths = [HASH_BITS // bands + (band < HASH_BITS % bands) for band in range(bands)]
        self._bands: list[tuple[int, int]] = []  # (shift, mask)
        shift = 0
        for width in widths:
            self._bands.append((shift, (1 << width) - 1))
            shift += width
        self._items: dict[tuple[int, int, int], list[int]] = defaultdict(list)

    def _keys(self, position: int, value: int) -> list[tuple[int, int, int]]:
        return [(position, band, (value >> shift) & mask) for band, (shift, mask) in enumerate(self._bands)]

    def add(self, item: int, hashes: tuple[int, ...]) -> None:
        for position, value in enumerate(hashes):
            for key in self._keys(position, value):
                self._items[key].append(item)

    def candidates(self, hashes: tuple[int, ...]) -> set[int]:
        """Every item with a hash at some position within the distance of the query's at that position (and others)."""
        found: set[int] = set()
        for position, value in enumerate(hashes):
            for key in self._keys(position, value):
                found.update(self._items.get(key, ()))
        return found
