"""A source's catalogue cut into chunks of rows whose token lengths are measured apart, in any order,
on any machine (the `sample_length_chunk` partitions), then assembled into the source's table.

Chunk k holds catalogue rows [k × rows, (k + 1) × rows). Records appended to a source become rows
after the old ones, so the old chunks keep their rows and their digests: only the last, grown chunk
and the new ones are measured again. Each chunk's digest covers what its lengths follow from in
the catalogue (the columns tokens.table reads), so an edited record changes that chunk only.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from vlm_assets.atomic import atomic_write_text
from vlm_assets.config import CHUNK_ROWS_MULTIPLE
from vlm_assets.parquet_batches import aligned_batches, batch_bytes

# Rows of one store entry (tokens.table.ChunkStore): a chunk is a whole number of them, so the
# entries a chunk stores are the ones the assembled table looks up.
STORE_ROWS = CHUNK_ROWS_MULTIPLE
# 16,384 rows: a few seconds to a minute of measuring, and 6,100 chunks for 100 M samples.
DEFAULT_CHUNK_ROWS = 8 * STORE_ROWS
# Beyond this many chunks per source a partition list grows past what the UI and the daemon serve
# well, so a source that large takes bigger chunks (the boundaries then move once, at that size).
MAX_CHUNKS_PER_SOURCE = 10_000
# Catalogue columns the token lengths follow from (what tokens.table reads of each row).
# The media's stamps among them: a medium replaced since is measured again.
DIGESTED_COLUMNS = ["sample_id", "status", "reason", "messages", "media_kinds", "media_refs", "media_stamps",
                    "media_views"]

def chunk_index_key(index: int) -> str:
    return f"{index:05d}"


def chunk_partition_key(source: str, index: int) -> str:
    """A chunk's partition key as Dagster spells a (chunk, source) multi-partition key: `00003|my_source`."""
    return f"{chunk_index_key(index)}|{source}"


def split_chunk_partition(key: str) -> tuple[str, int]:
    """(source, chunk index) of a chunk partition key."""
    index, separator, source = key.partition("|")
    if not separator or not index.isdigit():
        raise ValueError(f"{key!r} is not a chunk partition key (<5-digit chunk index>|<source>)")
    return source, int(index)


def rows_per_chunk(total_rows: int, configured: int | None = None) -> int:
    """`configured` (a source's `chunk_rows`), or the default unless the source needs bigger chunks."""
    if configured is not None:
        return configured
    needed = math.ceil(total_rows / MAX_CHUNKS_PER_SOURCE / STORE_ROWS) * STORE_ROWS
    return max(DEFAULT_CHUNK_ROWS, needed)


@dataclass(frozen=True)
class ChunkPlan:
    """How a catalogue was cut: rows per chunk, rows in all, and each chunk's digest, in order."""

    rows: int
    total_rows: int
    digests: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.digests)

    def row_range(self, index: int) -> range:
        if not 0 <= index < len(self.digests):
            raise IndexError(f"chunk {index} of a catalogue cut into {len(self.digests)}")
        return range(index * self.rows, min((index + 1) * self.rows, self.total_rows))

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps({"rows": self.rows, "total_rows": self.total_rows,
                                            "digests": list(self.digests)}) + "\n")

    @classmethod
    def load(cls, path: Path) -> ChunkPlan | None:
        try:
            data = json.loads(path.read_text())
            return cls(int(data["rows"]), int(data["total_rows"]), tuple(data["digests"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def plan_chunks(catalog: Path, configured_rows: int | None = None) -> ChunkPlan:
    """Cut the catalogue at `catalog` into chunks (rows_per_chunk) and digest each, reading a chunk at a time."""
    total = pq.ParquetFile(catalog, pre_buffer=False).metadata.num_rows
    rows = rows_per_chunk(total, configured_rows)
    digests = []
    for start in range(0, total, rows):
        sha = hashlib.sha256()
        for batch in aligned_batches(catalog, DIGESTED_COLUMNS, STORE_ROWS, start, min(start + rows, total)):
            sha.update(batch_bytes(batch))
        digests.append(sha.hexdigest()[:32])
    return ChunkPlan(rows, total, tuple(digests))

