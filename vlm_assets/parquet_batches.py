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


def batch_bytes(batch: pa.RecordBatch) -> bytes:
    """The batch in Arrow's IPC stream form: the same rows give the same bytes (a digest's input, at C speed)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


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


def aligned_batches(path: Path | str, columns: Sequence[str], batch_rows: int, start: int = 0,
                    stop: int | None = None) -> Iterator[pa.RecordBatch]:
    """Rows [start, stop) of the table at `path` in batches that each cover rows [i × batch_rows,
    (i + 1) × batch_rows) of the table (the last one may be shorter), whatever its row groups.

    Two readers of different ranges thus cut the same rows into the same batches. Only the row
    groups holding the range are read.
    """
    file = pq.ParquetFile(path, pre_buffer=False)
    stop = file.metadata.num_rows if stop is None else min(stop, file.metadata.num_rows)
    groups, first_row, row = [], None, 0
    for index in range(file.metadata.num_row_groups):
        rows = file.metadata.row_group(index).num_rows
        if row + rows > start and row < stop:
            groups.append(index)
            first_row = row if first_row is None else first_row
        row += rows
    if not groups:
        return
    position = first_row  # table row of pending's first row
    pending: list[pa.RecordBatch] = []
    pending_rows = 0
    next_cut = start + batch_rows - start % batch_rows  # the first batch boundary after start
    for batch in file.iter_batches(batch_size=batch_rows, row_groups=groups, columns=list(columns)):
        pending.append(batch)
        pending_rows += batch.num_rows
        while position + pending_rows >= min(next_cut, stop) and pending_rows:
            table = pa.Table.from_batches(pending)
            cut = min(next_cut, stop) - position
            low = max(start - position, 0)
            if cut > low:
                yield table.slice(low, cut - low).combine_chunks().to_batches()[0]
            rest = table.slice(cut)
            pending = rest.to_batches() if rest.num_rows else []
            position, pending_rows = position + cut, rest.num_rows
            if position >= stop:
                return
            next_cut += batch_rows
