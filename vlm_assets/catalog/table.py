"""A source's catalogue written as it is built, on one process or several, with what the UI shows of it.

Rows are written a few thousand at a time as the chunks come back, so building the catalogue
needs memory for the chunks in flight and the counts below, not for the whole source.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from vlm_assets.atomic import atomic_path
from vlm_assets.catalog.build import CATALOG_CHUNK_WORK, MediaValidator, iter_catalog_chunks
from vlm_assets.catalog.schema import CATALOG_COLUMNS, STATUS_OK
from vlm_assets.config import SourceConfig
from vlm_assets.wording import shortened

LIST_COLUMNS = ("media_files", "media_kinds", "media_refs", "media_keys")
CATALOG_SCHEMA = pa.schema([
    (column, pa.list_(pa.string()) if column in LIST_COLUMNS else pa.int64() if column == "n_turns" else pa.string())
    for column in CATALOG_COLUMNS
])
# Rows per parquet row group: chunks are small (they balance the workers), row groups need not be.
ROWS_PER_WRITE = 8192
REASON_CHARS = 120
# A reason ends with where the sample came from ("[file:line]"); the UI groups reasons without it.
_ORIGIN_SUFFIX = re.compile(r"\s*\[.*\]$")


def reason_kind(reason: str) -> str:
    return shortened(_ORIGIN_SUFFIX.sub("", reason), REASON_CHARS)


@dataclass
class CatalogSummary:
    samples: int = 0
    ok: int = 0
    multi_turn: int = 0  # ok samples with more than one user/assistant exchange
    media_types: Counter[str] = field(default_factory=Counter)  # of the ok samples
    reject_reasons: Counter[str] = field(default_factory=Counter)  # by reason_kind

    @property
    def rejected(self) -> int:
        return self.samples - self.ok

    def add(self, rows: list[dict]) -> None:
        self.samples += len(rows)
        for row in rows:
            if row["status"] == STATUS_OK:
                self.ok += 1
                self.media_types[row["media_type"]] += 1
                self.multi_turn += row["n_turns"] > 2
            else:
                self.reject_reasons[reason_kind(row["reason"])] += 1


class SourceChangedError(RuntimeError):
    """The source's files changed (or vanished) while its catalogue was being read: no catalogue is published."""


def source_snapshot(source: SourceConfig, excluded: Iterable[Path] = ()) -> tuple[int, int, int]:
    """(files, bytes, newest mtime) of what the source's records are read from: its path, and a media
    root of its own (not one it shares with others, such as the folder a manifest sits in). Hidden
    entries and `excluded` trees (our own outputs, the config) are left out, as in its fingerprint."""
    skip = {os.path.realpath(path) for path in excluded}
    roots = [source.path]
    if source.media_root != source.path and source.media_root not in source.path.parents:
        roots.append(source.media_root)
    files = size = newest = 0
    for root in roots:
        for path in _visible_files(root, skip):
            try:
                stat = os.stat(path)
            except OSError:  # gone since it was listed: the next snapshot differs anyway
                continue
            files, size, newest = files + 1, size + stat.st_size, max(newest, stat.st_mtime_ns)
    return files, size, newest


def _visible_files(root: Path, skip: set[str]) -> Iterator[str]:
    if root.is_file():
        yield str(root)
        return
    for directory, subdirectories, names in os.walk(root, followlinks=True):
        subdirectories[:] = [name for name in subdirectories if not name.startswith(".")
                             and os.path.realpath(os.path.join(directory, name)) not in skip]
        yield from (os.path.join(directory, name) for name in names if not name.startswith("."))


def write_catalog(
    source: SourceConfig,
    target: Path,
    text_key: str,
    validator: MediaValidator,
    processes: int = 1,
    progress: Callable[[int], None] | None = None,
    chunk_work: int = CATALOG_CHUNK_WORK,
    excluded: Iterable[Path] = (),
) -> CatalogSummary:
    """Build `source`'s catalogue into `target` (atomically). `progress(rows so far)` after each write.

    The validator's check log, if any, is compacted to this build's media once the catalogue is written.
    A source whose files change or vanish while it is read raises SourceChangedError and publishes
    nothing; `excluded` trees (the storage root, the config) are not part of it.
    """
    summary = CatalogSummary()
    pending: list[dict] = []
    if not source.path.exists():
        raise SourceChangedError(f"source {source.name!r}: {source.path} does not exist (any more)")
    before = source_snapshot(source, excluded)
    try:
        with atomic_path(target) as tmp:
            with pq.ParquetWriter(tmp, CATALOG_SCHEMA) as writer:
                for rows in iter_catalog_chunks(source, text_key, validator, processes, chunk_work):
                    pending.extend(rows)
                    summary.add(rows)
                    if len(pending) >= ROWS_PER_WRITE:
                        writer.write_table(pa.Table.from_pylist(pending, schema=CATALOG_SCHEMA))
                        pending = []
                        if progress:
                            progress(summary.samples)
                if pending:
                    writer.write_table(pa.Table.from_pylist(pending, schema=CATALOG_SCHEMA))
            # Rows read from a source that moved under us would be a partial catalogue that looks complete.
            after = source_snapshot(source, excluded) if source.path.exists() else None
            if after != before:
                state = "vanished" if after is None else f"changed ({before[0]} files, {before[1]} bytes before; {after[0]}, {after[1]} after)"
                raise SourceChangedError(
                    f"source {source.name!r}: {source.path} {state} while it was read; nothing was published, "
                    "run again once it is complete")
    finally:
        if validator.check_log is not None:
            validator.check_log.close()
    if validator.check_log is not None:
        validator.check_log.compact()
    return summary
