"""The sample ids a catalogue build has read, each with the origin it was first read from.

A build looks up every record's id to find duplicates. As a dict of strings that is over 200 bytes
per record (a 50-million-record source: over 10 GB). Here memory holds about 18 bytes per id: its
hash (Python's, so the set lives in one process), where its id and origin lie in a scratch file,
and two bits of a filter that answers most lookups of new ids alone. An id and its origin are read
back only for an id whose hash was seen before (a duplicate, or, rarely, another id's hash): those
of this build from the scratch file beside the catalogue (named as its temp files are, so a killed
build's is removed by the next one), those of an earlier catalogue being extended from its file.
"""

from __future__ import annotations

import bisect
import itertools
import os
import tempfile
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow.parquet as pq

from vlm_assets.atomic import TEMP_SUFFIX, temp_prefix

# Ids added since the last merge stay in Python lists until there are this many.
MERGE_EVERY = 65_536
FILTER_BITS_PER_ID = 16  # at most 1 in 16 lookups of a new id goes past the filter
# Python's hash of a string: computed once per string object, and ids are looked up and then added.
id_hash = hash


class SeenIds:
    """`sample_id in seen`, `seen[sample_id]` (its first origin), `seen[sample_id] = origin`, `len(seen)`."""

    def __init__(self, beside: Path | None = None, earlier: Path | None = None):
        """The scratch file, made once 65,536 ids are held, is a temp file of `beside` in its folder
        (default: in the system's temp folder). `earlier`: a catalogue whose rows' ids (and origins)
        count as seen, first."""
        self._beside = beside
        self._scratch: BinaryIO | None = None  # made by the first merge
        self._path: Path | None = None
        self._end = 0
        self._keys = np.zeros(0, dtype=np.int64)  # merged hashes, sorted
        self._offsets = np.zeros(0, dtype=np.int64)  # where each one's id and origin lie in the scratch file
        self._recent: list[tuple[int, str, str]] = []  # (hash, id, origin) added since the last merge
        self._recent_by_key: dict[int, int] = {}  # hash -> its first row in _recent
        self._earlier = _EarlierIds(earlier) if earlier is not None else None
        self._count = len(self._earlier) if self._earlier is not None else 0
        self._set_filter(self._earlier.keys if self._earlier is not None else self._keys)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, sample_id: str) -> bool:
        key = id_hash(sample_id)
        # Inline: the filter answers most lookups of a big build, a function call each would double their cost.
        if not self._filter[(key >> 3) & self._filter_mask] >> (key & 7) & 1:
            return False
        return self._find(sample_id, key) is not None

    def __getitem__(self, sample_id: str) -> str:
        origin = self._find(sample_id, id_hash(sample_id))
        if origin is None:
            raise KeyError(sample_id)
        return origin

    def __setitem__(self, sample_id: str, origin: str) -> None:
        """Adds a new id (check `in` first: an id added twice keeps its first origin)."""
        key = id_hash(sample_id)
        self._recent_by_key.setdefault(key, len(self._recent))
        self._recent.append((key, sample_id, origin))
        self._filter[(key >> 3) & self._filter_mask] |= 1 << (key & 7)
        self._count += 1
        if len(self._recent) >= MERGE_EVERY:
            self._merge()

    def _find(self, sample_id: str, key: int) -> str | None:
        if self._earlier is not None:
            origin = self._earlier.get(sample_id, key)
            if origin is not None:
                return origin
        first = self._recent_by_key.get(key)
        if first is not None:
            for recent_key, recent_id, origin in itertools.islice(self._recent, first, None):
                if recent_key == key and recent_id == sample_id:
                    return origin
        low, high = _equal_range(self._keys, key)
        for offset in self._offsets[low:high].tolist():
            found_id, origin = self._read(offset)
            if found_id == sample_id:
                return origin
        return None

    def _read(self, offset: int) -> tuple[str, str]:
        descriptor = self._open_scratch().fileno()
        length = int.from_bytes(os.pread(descriptor, 4, offset), "little")
        data = os.pread(descriptor, length, offset + 4)
        sample_id, _, origin = data.decode("utf-8", "surrogatepass").partition("\0")
        return sample_id, origin

    def _open_scratch(self) -> BinaryIO:
        if self._scratch is None:
            beside = self._beside
            if beside is not None:
                beside.parent.mkdir(parents=True, exist_ok=True)
            handle, name = tempfile.mkstemp(prefix=temp_prefix(beside.name) if beside else ".seen-ids-",
                                            suffix=TEMP_SUFFIX, dir=beside.parent if beside else None)
            self._path, self._scratch = Path(name), os.fdopen(handle, "w+b")
        return self._scratch

    def _merge(self) -> None:
        scratch = self._open_scratch()
        records = [f"{sample_id}\0{origin}".encode("utf-8", "surrogatepass") for _, sample_id, origin in self._recent]
        sizes = np.fromiter((len(record) + 4 for record in records), dtype=np.int64, count=len(records))
        offsets = self._end + np.concatenate([[0], np.cumsum(sizes)[:-1]])
        scratch.write(b"".join(len(record).to_bytes(4, "little") + record for record in records))
        scratch.flush()
        self._end += int(sizes.sum())
        keys = np.concatenate([self._keys, np.fromiter((key for key, _, _ in self._recent), dtype=np.int64,
                                                       count=len(self._recent))])
        order = np.argsort(keys, kind="stable")  # a sorted run and the new keys
        self._keys = keys[order]
        self._offsets = np.concatenate([self._offsets, offsets])[order]
        self._recent, self._recent_by_key = [], {}
        if len(self) * FILTER_BITS_PER_ID > self._filter_bits:
            self._set_filter(np.concatenate([*([self._earlier.keys] if self._earlier is not None else []), self._keys]))

    def _set_filter(self, keys: np.ndarray) -> None:
        """One bit per hash (a Bloom filter of one probe): a clear bit means the hash was never added."""
        self._filter_bits = 1 << max(20, int(len(keys) * FILTER_BITS_PER_ID * 2 - 1).bit_length())
        self._filter = bytearray(self._filter_bits // 8)
        self._filter_mask = self._filter_bits // 8 - 1
        np.bitwise_or.at(np.frombuffer(self._filter, dtype=np.uint8), (keys >> 3) & self._filter_mask,
                         np.left_shift(1, keys & 7).astype(np.uint8))

    def close(self) -> None:
        if self._scratch is not None:
            self._scratch.close()
            self._path.unlink(missing_ok=True)
            self._scratch = None

    def __enter__(self) -> SeenIds:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _equal_range(sorted_keys: np.ndarray, key: int) -> tuple[int, int]:
    return int(np.searchsorted(sorted_keys, key, "left")), int(np.searchsorted(sorted_keys, key, "right"))


class _EarlierIds:
    """The ids of a catalogue's rows by hash (12 bytes each); a row's id and origin read from the file."""

    BATCH_ROWS = 65_536

    def __init__(self, catalog: Path):
        self._file = pq.ParquetFile(catalog, pre_buffer=False)
        hashes = np.zeros(self._file.metadata.num_rows, dtype=np.int64)
        start = 0
        for batch in self._file.iter_batches(batch_size=self.BATCH_ROWS, columns=["sample_id"]):
            hashes[start:start + batch.num_rows] = [id_hash(sample_id) for sample_id in batch.column(0).to_pylist()]
            start += batch.num_rows
        self._rows = np.argsort(hashes, kind="stable").astype(np.int32 if len(hashes) < 2**31 else np.int64)
        self.keys = hashes[self._rows]
        group_rows = (self._file.metadata.row_group(index).num_rows for index in range(self._file.num_row_groups))
        self._group_starts = list(itertools.accumulate(group_rows, initial=0))

    def __len__(self) -> int:
        return len(self.keys)

    def get(self, sample_id: str, key: int) -> str | None:
        low, high = _equal_range(self.keys, key)
        for row in sorted(self._rows[low:high].tolist()):
            found_id, origin = self._row(row)
            if found_id == sample_id:
                return origin
        return None

    def _row(self, row: int) -> tuple[str, str]:
        group = bisect.bisect_right(self._group_starts, row) - 1
        table = self._file.read_row_group(group, columns=["sample_id", "origin"])
        offset = row - self._group_starts[group]
        return table.column(0)[offset].as_py(), table.column(1)[offset].as_py()
