"""A catalogue's ok rows by sample id, from an index on disk.

Packing groups samples by length, so writing a bin's record needs rows from anywhere in the
catalogue. Holding the catalogue in memory costs kilobytes per sample (gigabytes for a big
source); this index is an sqlite file beside the step's output, built in one streaming pass over
the catalogue and removed when the step is done. It is named as a temporary file of that output,
so one left by a killed step is cleaned up like any other dead writer's temporary file. The step's
chunk processes read the same file (`SampleLookupReader`).
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vlm_assets.atomic import TEMP_SUFFIX, temp_prefix
from vlm_assets.catalog.schema import STATUS_OK
from vlm_assets.parquet_batches import parquet_batches

INSERT_BATCH_ROWS = 8192


class _IndexedRows(Mapping[str, dict[str, Any]]):
    """`rows[sample_id]` -> {column: value} from an index file's connection `_db`."""

    columns: tuple[str, ...]
    _db: sqlite3.Connection | None
    _count: int

    def __getitem__(self, sample_id: str) -> dict[str, Any]:
        found = self._db.execute("SELECT row FROM samples WHERE id = ?", (sample_id,)).fetchone()
        if found is None:
            raise KeyError(sample_id)
        return dict(zip(self.columns, json.loads(found[0])))

    def __iter__(self):
        for (sample_id,) in self._db.execute("SELECT id FROM samples"):
            yield sample_id

    def __len__(self) -> int:
        return self._count

    def close(self) -> None:
        if getattr(self, "_db", None) is not None:
            self._db.close()
            self._db = None


class SampleLookup(_IndexedRows):
    """`lookup[sample_id]` -> {column: value} for `columns` of the catalogue at `catalog`.

    `only`: index just these sample ids (the samples of appended bins): the catalogue's row groups
    that hold none of them are skipped after reading their ids, so the cost follows `only`, not the
    catalogue.
    """

    def __init__(self, catalog: Path, columns: Sequence[str], near: Path, only: Collection[str] | None = None) -> None:
        self.columns = tuple(columns)
        near.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=temp_prefix(near.name), suffix=TEMP_SUFFIX, dir=near.parent)
        os.close(fd)
        self.path = Path(name)
        try:
            self._db = sqlite3.connect(name)
            # A scratch file: nothing to recover after a crash, so no journal and no syncs.
            self._db.execute("PRAGMA journal_mode = OFF")
            self._db.execute("PRAGMA synchronous = OFF")
            self._db.execute("CREATE TABLE samples (id TEXT PRIMARY KEY, row TEXT NOT NULL) WITHOUT ROWID")
            for batch in _ok_rows(catalog, ["sample_id", *self.columns], only):
                data = batch.to_pydict()
                self._db.executemany("INSERT INTO samples VALUES (?, ?)", [
                    (sample_id, json.dumps([data[column][index] for column in self.columns]))
                    for index, sample_id in enumerate(data["sample_id"])
                ])
            self._db.commit()
            self._count = self._db.execute("SELECT count(*) FROM samples").fetchone()[0]
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        super().close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> SampleLookup:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _ok_rows(catalog: Path, columns: Sequence[str], only: Collection[str] | None) -> Iterator[pa.RecordBatch]:
    """`columns` of the catalogue's ok rows (of the ids in `only`, when given), a batch at a time."""
    if only is None:
        for batch in parquet_batches(catalog, [*columns, "status"], INSERT_BATCH_ROWS):
            yield batch.filter(pc.equal(batch.column("status"), STATUS_OK))
        return
    wanted = pa.array(sorted(only), type=pa.string())
    if not len(wanted):
        return
    table = pq.ParquetFile(catalog, pre_buffer=False)
    for group in range(table.metadata.num_row_groups):
        verdicts = table.read_row_group(group, columns=["sample_id", "status"])
        keep = pc.and_(pc.is_in(verdicts.column("sample_id"), value_set=wanted),
                       pc.equal(verdicts.column("status"), STATUS_OK))
        if pc.any(keep).as_py():
            yield from table.read_row_group(group, columns=list(columns)).filter(keep).to_batches()


class SampleLookupReader(_IndexedRows):
    """Read-only access, from another process, to the index of a `SampleLookup` that is still open."""

    def __init__(self, path: Path, columns: Sequence[str]) -> None:
        self.columns = tuple(columns)
        self._db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        self._count = self._db.execute("SELECT count(*) FROM samples").fetchone()[0]


# A chunk process's reader of its step's index (`attach`, the chunk pool's initializer).
_attached: SampleLookupReader | None = None


def attach(index_path: str, columns: Sequence[str]) -> None:
    """Make `attached()` read the index at `index_path` in this process, in place of any earlier one."""
    global _attached
    detach()
    _attached = SampleLookupReader(Path(index_path), columns)


def attached() -> SampleLookupReader:
    if _attached is None:
        raise RuntimeError("no sample index is attached in this process (attach() is the chunk pool's initializer)")
    return _attached


def detach() -> None:
    global _attached
    if _attached is not None:
        _attached.close()
        _attached = None
