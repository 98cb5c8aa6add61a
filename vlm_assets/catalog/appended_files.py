"""Record files added to a flat_dir source: its catalogue is extended by reading only them.

After each build of a flat_dir source, a read mark beside the catalogue records what was read: how
many record files, a digest of their paths, sizes and mtimes in reading order, the reading settings
and the catalogue's own digest. When the source's first record files are exactly those, the new
ones all sort after them, the settings are the same and every media file the kept rows rely on is
unchanged, the earlier rows are kept and only the new files are read.

A new file can still change a kept row: a media file that makes a name ambiguous (it now exists
in both the record's folder and the source's root), or one that shares the stem of a record that
names no media. So each kept row that a new file could concern, and each earlier reject, is read
and checked again. The catalogue is then the one a full read gives, byte for byte; whenever that
cannot be shown, the source is read in full and `AppendRefused` says why.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from vlm_assets.catalog.appending import AppendRefused, Extension, FileMark, SavedMark
from vlm_assets.catalog.build import FolderPart, MediaValidator, catalog_row
from vlm_assets.media.checks import UnchangedMediaCheck
from vlm_assets.catalog.readers.flat_dir import FolderListing, ObjectFolderListing
from vlm_assets.catalog.records import RecordLimits
from vlm_assets.catalog.schema import STATUS_OK
from vlm_assets.catalog.seen_ids import SeenIds
from vlm_assets.config import SourceConfig

@dataclass(frozen=True)
class FolderMark(SavedMark):
    """What a build of a flat_dir source's catalogue read (see the module's docstring)."""

    settings: str
    records: int
    files_sha256: str
    catalog_sha256: str


def files_digest(stamps: list[str]) -> str:
    return hashlib.sha256("\n".join(stamps).encode()).hexdigest()


def plan_folder_extension(source: SourceConfig, catalog: Path, mark_path: Path, settings: str, text_key: str,
                          validator: MediaValidator, listing: FolderListing | ObjectFolderListing,
                          helpers: Executor | None = None) -> Extension:
    """How `catalog` extends to the record files added to `source` (listed in `listing`); raises
    AppendRefused when it does not.

    Starts the check of the media the kept rows rely on (on one of the build's `helpers`, spawned
    processes, when it has some: the extension's `media`) and checks the rows a new file could concern again, so it is called while
    the catalogue is being rebuilt.
    """
    if not isinstance(listing, FolderListing):
        raise AppendRefused("a flat_dir source on object storage is read in full (its unchanged media are not decoded again)")
    mark = FolderMark.load(mark_path)
    if mark is None:
        raise AppendRefused("no read mark from an earlier build")
    if mark.settings != settings:
        raise AppendRefused("the reading settings changed")
    if validator.check_log is None:
        raise AppendRefused("no media check log")
    stamps = listing.stamps
    if len(stamps) <= mark.records:
        raise AppendRefused(f"no record file was added after the {mark.records} read before")
    if files_digest(stamps[:mark.records]) != mark.files_sha256:
        raise AppendRefused(f"the first {mark.records} record files are not the ones read before (one was edited, "
                            "removed or added among them: new files must sort after the ones read)")
    if not catalog.is_file() or FileMark.of(catalog).sha256 != mark.catalog_sha256:
        raise AppendRefused("the catalogue is not the one the mark was written with")
    media = UnchangedMediaCheck(validator.check_log, helpers)
    try:
        table = pq.read_table(catalog, columns=["sample_id", "origin", "status", "media_files", "media_refs"])
        if table.num_rows != mark.records:
            raise AppendRefused("the catalogue's rows differ from the record files read")
        origins = table.column("origin").to_pylist()
        part = FolderPart(listing, mark.records, SeenIds(catalog, earlier=catalog))
        limits = RecordLimits.of(source)
        rechecked = {index: catalog_row(listing.record(index, limits), source.name, text_key, validator)
                     for index in sorted(_rows_to_check_again(listing, table, origins))}
    except BaseException:
        media.close()
        raise
    return Extension(part, mark.records, rechecked, media)


def _rows_to_check_again(listing: FolderListing, table, origins: list[str]) -> set[int]:
    """The earlier rejects, and the kept rows whose media a file not read before could change."""
    known = set(origins)
    for refs in table.column("media_refs").to_pylist():
        known.update(refs)
    listed = {str(folder): set(names) for folder, names in listing.walk.listings.items()}
    new = {os.path.join(folder, name) for folder, names in listed.items() for name in names} - known
    row_of = {origin: index for index, origin in enumerate(origins)}
    rows = {index for index, status in enumerate(table.column("status").to_pylist()) if status != STATUS_OK}
    rows.update(_same_stem_records(new, row_of))
    root = str(listing.root)
    for index, (origin, names) in enumerate(zip(origins, table.column("media_files").to_pylist())):
        folders = dict.fromkeys((os.path.dirname(origin), root))
        if any(_may_be_new(os.path.normpath(os.path.join(folder, name)), new, listed)
               for name in names if not os.path.isabs(name) for folder in folders):
            rows.add(index)
    return rows


def _same_stem_records(new: set[str], row_of: dict[str, int]) -> set[int]:
    """Rows of records a new file shares a stem with ("a.json" and "a.png", "a.b.png"): a record that
    names no media takes those beside it."""
    rows = set()
    for path in new:
        folder, name = os.path.split(path)
        for dot in (position for position, char in enumerate(name) if char == "." and position):
            row = row_of.get(os.path.join(folder, f"{name[:dot]}.json"))
            if row is not None:
                rows.add(row)
    return rows


def _may_be_new(path: str, new: set[str], listed: dict[str, set[str]]) -> bool:
    """Whether a file at `path` may not have been there when the catalogue was read: it is new, or
    below a new folder, or somewhere the walk did not list (outside the source, in a hidden folder)."""
    below = path
    while True:
        folder, name = os.path.split(below)
        if folder in listed:
            if below in new:
                return True
            return below != path and name in listed[folder]  # an old entry not walked into: unknown
        if folder == below:
            return True  # above the source's root
        below = folder


def folder_mark_of(part: FolderPart, records: int, settings: str, catalog_sha256: str) -> FolderMark | None:
    """The read mark of a build that read every record file of `part`'s listing."""
    stamps = part.listing.stamps
    if records != len(stamps):
        return None
    return FolderMark(settings, records, files_digest(stamps), catalog_sha256)
