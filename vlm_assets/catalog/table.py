"""A source's catalogue written as it is built, on one process or several, with what the UI shows of it.

Rows are written a few thousand at a time as the chunks come back, so building the catalogue
needs memory for the chunks in flight and the counts below, not for the whole source.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vlm_assets.atomic import atomic_path
from vlm_assets.catalog.appended_files import folder_mark_of, plan_folder_extension
from vlm_assets.catalog.appending import AppendRefused, Extension, FileMark, mark_of, plan_extension
from vlm_assets.catalog.build import (
    CATALOG_CHUNK_WORK,
    FolderPart,
    JsonlPart,
    MediaValidator,
    is_json_lines,
    iter_catalog_chunks,
)
from vlm_assets.catalog.media_resolution import SourceScope
from vlm_assets.catalog.readers.flat_dir import folder_listing
from vlm_assets.catalog.schema import CATALOG_COLUMNS, STATUS_OK
from vlm_assets.catalog.seen_ids import SeenIds
from vlm_assets.config import SourceConfig
from vlm_assets.catalog.source_walk import Snapshot, source_snapshot
from vlm_assets.object_store import exists, location_stamp, resolved
from vlm_assets.parallel import helper_processes
from vlm_assets.wording import shortened

LIST_COLUMNS = ("media_files", "media_kinds", "media_refs", "media_keys", "media_stamps", "media_views")
CATALOG_SCHEMA = pa.schema([
    (column, pa.list_(pa.string()) if column in LIST_COLUMNS else pa.int64() if column == "n_turns" else pa.string())
    for column in CATALOG_COLUMNS
])
# Rows per parquet row group: chunks are small (they balance the workers), row groups need not be.
ROWS_PER_WRITE = 8192
REASON_CHARS = 120
# A reason ends with where the sample came from (" [file:line]"); the UI groups reasons without it.
# Only that last bracket: the error before it may quote one of its own ("[Errno 5] …").
_ORIGIN_SUFFIX = re.compile(r"\s*\[[^\[]*\]$")


def reason_kind(reason: str) -> str:
    return shortened(_ORIGIN_SUFFIX.sub("", reason), REASON_CHARS)


@dataclass
class CatalogSummary:
    samples: int = 0
    ok: int = 0
    multi_turn: int = 0  # ok samples with more than one user/assistant exchange
    media_types: Counter[str] = field(default_factory=Counter)  # of the ok samples
    reject_reasons: Counter[str] = field(default_factory=Counter)  # by reason_kind
    kept: int = 0  # rows kept from the last build (lines appended to a JSON-lines source, files added to a folder)
    read_in_full: str = ""  # why such a source was not read as its appended records only

    @property
    def rejected(self) -> int:
        return self.samples - self.ok

    def add(self, table: pa.Table) -> None:
        """Count the catalogue rows of `table`, by column (a kept catalogue's million rows take a second)."""
        ok = pc.equal(table.column("status"), STATUS_OK)
        accepted = table.filter(ok)
        self.samples += table.num_rows
        self.ok += accepted.num_rows
        # value_counts lists values in order of first appearance, as counting row by row would.
        for count in pc.value_counts(accepted.column("media_type")).to_pylist():
            self.media_types[count["values"]] += count["counts"]
        self.multi_turn += pc.sum(pc.greater(accepted.column("n_turns"), 2)).as_py() or 0
        for reason in table.filter(pc.invert(ok)).column("reason").to_pylist():
            self.reject_reasons[reason_kind(reason)] += 1


class SourceChangedError(RuntimeError):
    """The source's files changed (or vanished) while its catalogue was being read: no catalogue is published."""


class _KeptMediaChanged(Exception):
    """A medium the rows kept from the last build rely on changed since: the source is read in full."""




def write_catalog(
    source: SourceConfig,
    target: Path,
    text_key: str,
    validator: MediaValidator,
    processes: int = 1,
    progress: Callable[[int], None] | None = None,
    chunk_work: int = CATALOG_CHUNK_WORK,
    excluded: Iterable[Path] = (),
    read_mark: Path | None = None,
    settings: str = "",
    before: Snapshot | None = None,
    read_in_full: str = "",
) -> CatalogSummary:
    """Build `source`'s catalogue into `target` (atomically). `progress(rows so far)` after each write.

    The validator's check log, if any, is compacted to this build's media once the catalogue is written.
    A source whose files change or vanish while it is read raises SourceChangedError and publishes
    nothing; `excluded` trees (the storage root, the config) are not part of it. With a `read_mark`
    path, the catalogue of a JSON-lines source is extended by its appended lines, and that of a
    flat_dir source by its added record files, when it can be (vlm_assets.catalog.appending and
    .appended_files, under the reading `settings`); the mark is written after. `before`: the source's
    snapshot when it was last walked (vlm_assets.catalog.source_walk.walk_source), if that walk came before
    this call; otherwise it is walked here. `read_in_full`: why the catalogue is not to be extended.
    """
    # The check of the kept rows' media and the walk after reading share the build's spawned helpers.
    with helper_processes(processes - 1) as helpers:
        return _write_catalog(source, target, text_key, validator, processes, progress, chunk_work, excluded,
                              read_mark, settings, before, read_in_full, helpers)


def _write_catalog(source: SourceConfig, target: Path, text_key: str, validator: MediaValidator, processes: int,
                   progress: Callable[[int], None] | None, chunk_work: int, excluded: Iterable[Path],
                   read_mark: Path | None, settings: str, before: Snapshot | None, read_in_full: str,
                   helpers: Executor | None) -> CatalogSummary:
    summary = CatalogSummary()
    if not exists(source.path):
        raise SourceChangedError(f"source {source.name!r}: {source.path} does not exist (any more)")
    if before is None:
        before = source_snapshot(source, excluded, processes, helpers)
    extension, part, mark, changed = None, None, None, ""
    if read_mark is not None and (is_json_lines(source) or source.kind == "flat_dir"):
        listing = folder_listing(source, SourceScope(source), stamped=True) if source.kind == "flat_dir" else None
        try:
            if read_in_full:
                raise AppendRefused(read_in_full)
            if listing is None:
                extension = plan_extension(source, target, read_mark, settings, text_key, validator, helpers)
            else:
                extension = plan_folder_extension(source, target, read_mark, settings, text_key, validator, listing,
                                                  helpers)
        except AppendRefused as refused:
            summary.read_in_full = str(refused)
        part = extension.part if extension else JsonlPart(seen=SeenIds(target)) if listing is None \
            else FolderPart(listing, seen=SeenIds(target))
    try:
        with atomic_path(target) as tmp:
            with pq.ParquetWriter(tmp, CATALOG_SCHEMA) as writer:
                groups = _RowGroups(writer, summary, progress)
                if extension:
                    for table in _kept_tables(target, extension.rechecked):
                        groups.add(table)
                    summary.kept = extension.kept_rows
                for rows in iter_catalog_chunks(source, text_key, validator, processes, chunk_work, part):
                    groups.add(pa.Table.from_pylist(rows, schema=CATALOG_SCHEMA))
                groups.close()
            if isinstance(part, JsonlPart):
                mark = mark_of(source, part, summary.samples, settings, FileMark.of(tmp).sha256,
                               extension.read_before if extension else None)
            elif part is not None:
                mark = folder_mark_of(part, summary.samples, settings, FileMark.of(tmp).sha256)
            # Rows read from a source that moved under us would be a partial catalogue that looks complete.
            if extension is not None and extension.file_stamp is not None:
                moved = _moved_while_extended(source, extension, validator)
            else:
                moved = _moved_while_read(source, excluded, processes, helpers, before)
            if moved:
                raise SourceChangedError(
                    f"source {source.name!r}: {source.path} {moved} while it was read; nothing was published, "
                    "run again once it is complete")
            if extension and (changed := extension.media.changed()):
                raise _KeptMediaChanged(changed)
    except _KeptMediaChanged as error:
        changed = str(error)
    finally:
        if validator.check_log is not None:
            validator.check_log.close()
        if part is not None:
            part.seen.close()
        if extension:
            extension.media.close()
    if changed:
        return _write_catalog(source, target, text_key, validator, processes, progress, chunk_work, excluded, read_mark,
                              settings, before, f"media checked before changed: {changed}", helpers)
    if validator.check_log is not None:
        validator.check_log.compact()
    if read_mark is not None:
        # Written after the catalogue: a mark naming another catalogue's digest is never used.
        if mark is not None:
            mark.save(read_mark)
        else:
            read_mark.unlink(missing_ok=True)
    return summary


def _moved_while_read(source: SourceConfig, excluded: Iterable[Path], processes: int, helpers: Executor | None,
                      before: Snapshot) -> str:
    """How the source's files differ from their snapshot `before` the reading ("" when they do not)."""
    after = source_snapshot(source, excluded, processes, helpers) if exists(source.path) else None
    if after == before:
        return ""
    return "vanished" if after is None else f"changed ({before[0]} files, {before[1]} bytes before; {after[0]}, {after[1]} after)"


def _moved_while_extended(source: SourceConfig, extension: Extension, validator: MediaValidator) -> str:
    """How what an extended JSON-lines catalogue read moved while it was read ("" when it did not):
    the file itself, or a medium of the records read.

    Not the source's snapshot: a walk of every file under it (a million media: seconds of every
    core) for what the kept rows rely on, which their own check covers (Extension.media); a kept
    medium changed after that check makes the next walk of the source differ, and that build reads
    the source in full.
    """
    try:
        if location_stamp(resolved(source.path)) != extension.file_stamp:
            return "changed"
    except FileNotFoundError:
        return "vanished"
    assert validator.check_log is not None  # an extension keeps rows on the log's word
    medium = validator.check_log.first_changed(this_build=True)
    return f"changed (the medium {medium} since it was checked)" if medium else ""


class _RowGroups:
    """Writes rows in row groups of exactly ROWS_PER_WRITE rows (the last one shorter), whatever
    chunks they come in: a catalogue's bytes depend on its rows only, read by one process or
    several, in full or extended."""

    def __init__(self, writer: pq.ParquetWriter, summary: CatalogSummary, progress: Callable[[int], None] | None) -> None:
        self.writer, self.summary, self.progress = writer, summary, progress
        self.pending: list[pa.Table] = []
        self.pending_rows = 0

    def add(self, table: pa.Table) -> None:
        self.summary.add(table)
        self.pending.append(table)
        self.pending_rows += table.num_rows
        if self.pending_rows < ROWS_PER_WRITE:
            return
        rows = pa.concat_tables(self.pending)
        whole = rows.num_rows - rows.num_rows % ROWS_PER_WRITE
        for start in range(0, whole, ROWS_PER_WRITE):
            self._write(rows.slice(start, ROWS_PER_WRITE))
        rest = rows.slice(whole)
        self.pending, self.pending_rows = [rest], rest.num_rows
        if self.progress:
            self.progress(self.summary.samples)

    def close(self) -> None:
        if self.pending_rows:
            self._write(pa.concat_tables(self.pending))
        self.pending, self.pending_rows = [], 0

    def _write(self, rows: pa.Table) -> None:
        # Contiguous columns: where a column's dictionary fills up and its pages end depends on the
        # batches it is written in, so rows arriving in other chunks would give other bytes.
        self.writer.write_table(rows.combine_chunks(), row_group_size=ROWS_PER_WRITE)


def _kept_tables(catalog: Path, rechecked: dict[int, dict]) -> Iterator[pa.Table]:
    """The catalogue's rows a row group at a time, the `rechecked` ones (row index -> row) replaced."""
    file = pq.ParquetFile(catalog)
    start = 0
    for group in range(file.num_row_groups):
        table = file.read_row_group(group).cast(CATALOG_SCHEMA)
        replaced = [index for index in rechecked if start <= index < start + table.num_rows]
        if replaced:
            rows = table.to_pylist()
            for index in replaced:
                rows[index - start] = rechecked[index]
            table = pa.Table.from_pylist(rows, schema=CATALOG_SCHEMA)
        yield table
        start += table.num_rows
