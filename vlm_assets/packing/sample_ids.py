"""Sample ids of a whole source in a few bytes each.

Packing and its checks compare the ids of a million samples; as Python strings in sets and dicts
that is hundreds of bytes per sample. Here an id is a 64-bit hash in a numpy array, and a hash is
only trusted as far as it is checked: a lookup confirms each hit against the id itself, and a
check that finds a hash out of place names the ids by reading them again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from vlm_assets.parquet_batches import parquet_batches

BATCH_ROWS = 8192
# Hashing goes through Python strings (about 70 bytes each): this many at a time.
HASH_SLICE = 65_536


def id_hashes(ids: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A 64-bit hash (uint64) of each id, in order."""
    hashes = np.zeros(len(ids), dtype=np.uint64)
    for start in range(0, len(ids), HASH_SLICE):
        part = ids.slice(start, HASH_SLICE).to_numpy(zero_copy_only=False)
        hashes[start:start + len(part)] = pd.util.hash_array(part, categorize=False)
    return hashes


def column_ids(path: Path, column: str) -> Iterator[pa.Array]:
    """The ids in `column` of the table at `path`, a batch at a time; a list column's ids one by one."""
    for batch in parquet_batches(path, [column], BATCH_ROWS):
        values = batch.column(0)
        yield pc.list_flatten(values) if pa.types.is_list(values.type) or pa.types.is_large_list(values.type) else values


def column_hashes(path: Path, column: str) -> np.ndarray:
    parts = [id_hashes(ids) for ids in column_ids(path, column)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def ids_with_hashes(path: Path, column: str, hashes: np.ndarray) -> list[str]:
    """Every id in `column` whose hash is one of `hashes` (sorted), in table order, repeats kept."""
    found: list[str] = []
    for ids in column_ids(path, column):
        hit = np.isin(id_hashes(ids), hashes, assume_unique=False)
        if hit.any():
            found.extend(ids.filter(pa.array(hit)).to_pylist())
    return found


class IdIndex:
    """Position of each of `ids` (an Arrow string array), found by hash and confirmed by the id."""

    def __init__(self, ids: pa.Array):
        self._ids = ids
        hashes = id_hashes(ids)
        self._order = np.argsort(hashes, kind="stable").astype(np.int32 if len(ids) < 2**31 else np.int64)
        self._sorted = hashes[self._order]
        # Ids sharing a hash (or repeated): looked up by the id itself. Rare: 64 bits.
        shared = np.flatnonzero(self._sorted[1:] == self._sorted[:-1])
        self._shared_hashes = np.unique(self._sorted[shared])
        self._by_id: dict[str, list[int]] = {}
        for position in np.flatnonzero(np.isin(hashes, self._shared_hashes)).tolist():
            self._by_id.setdefault(ids[position].as_py(), []).append(position)

    def __len__(self) -> int:
        return len(self._ids)

    def id_at(self, position: int) -> str:
        return self._ids[position].as_py()

    def positions(self, ids: pa.Array) -> np.ndarray:
        """Position in the index of each of `ids` (the first one, for an id held twice), -1 where absent."""
        hashes = id_hashes(ids)
        found = np.full(len(ids), -1, dtype=np.int64)
        if not len(self._sorted) or not len(ids):
            return found
        slot = np.minimum(np.searchsorted(self._sorted, hashes), len(self._sorted) - 1)
        candidate = np.where(self._sorted[slot] == hashes, self._order[slot], -1)
        shared = np.isin(hashes, self._shared_hashes)
        plain = (candidate >= 0) & ~shared
        if plain.any():
            rows = np.flatnonzero(plain)
            same = pc.equal(self._ids.take(pa.array(candidate[rows])), ids.take(pa.array(rows)))
            rows = rows[same.to_numpy(zero_copy_only=False)]
            found[rows] = candidate[rows]
        for row in np.flatnonzero(shared).tolist():
            found[row] = self._by_id.get(ids[row].as_py(), [-1])[0]
        return found

    @classmethod
    def of(cls, parts: Iterable[pa.Array]) -> IdIndex:
        parts = list(parts)
        return cls(pa.concat_arrays(parts) if parts else pa.array([], type=pa.string()))
