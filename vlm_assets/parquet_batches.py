"""Reading a parquet table a batch at a time, in memory that does not grow with the table."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq


def parquet_batches(path: Path | str, columns: Sequence[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    """`columns` of the table at `path`, `batch_rows` rows at a time.

    Pre-buffering is off: with it (pyarrow's default) the file keeps every row group's bytes it has
    read until it is closed, about 1 KB per catalogue row, so streaming a big table would hold it all.
    """
    yield from pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=batch_rows, columns=list(columns))


def parquet_rows(path: Path | str) -> int:
    return pq.ParquetFile(path, pre_buffer=False).metadata.num_rows


def rows_with_ids(path: Path | str, sample_ids: Sequence[str], columns: Sequence[str],
                  batch_rows: int = 8192) -> list[dict]:
    """The rows whose `sample_id` is one of `sample_ids`, in table order, read a batch at a time.

    Rows are matched in Arrow and only the matches become Python objects: reading the table with a
    filter instead held the whole table (about 5 KB per catalogue row) at its peak.
    """
    wanted = pa.array(list(sample_ids), type=pa.string())
    found: list[dict] = []
    for batch in parquet_batches(path, ["sample_id", *[column for column in columns if column != "sample_id"]],
                                 batch_rows):
        found.extend(batch.filter(pc.is_in(batch.column(0), value_set=wanted)).to_pylist())
    return found
