"""Lines appended to a JSON-lines source: its catalogue is extended by reading only them.

After each build of a JSON-lines source, a read mark beside the catalogue records what was read:
the file's length, digest and lines, its records and how they were named, the reading settings and
the catalogue's own digest. When the file next starts with exactly those bytes, the settings are the
same and every media file the kept rows rely on is unchanged, the earlier rows are kept as they are,
the earlier rejects are checked again (a missing image may have arrived since) and only the new
lines are read. The catalogue is then the one a full read gives, byte for byte; whenever that cannot
be shown, the source is read in full and `AppendRefused` says why.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vlm_assets.atomic import atomic_write_text
from vlm_assets.catalog.build import FolderPart, JsonlPart, MediaValidator, catalog_row, is_json_lines
from vlm_assets.catalog.media_resolution import SourceScope, resolver_for
from vlm_assets.catalog.readers.jsonl import IdSurvey, LineRange, entries_at_lines, survey_range
from vlm_assets.catalog.readers.raw_record import RawRecord
from vlm_assets.media.checks import UnchangedMediaCheck
from vlm_assets.catalog.schema import STATUS_OK
from vlm_assets.catalog.seen_ids import SeenIds
from vlm_assets.config import SourceConfig
from vlm_assets.object_store import Location, location_size, location_stamp, open_location, resolved

MARK_FORMAT = 1
_HASH_BLOCK = 8 << 20
# A reject with this reason depends only on the ids before it, which are kept: it is not checked again.
_DUPLICATE_REASON = "duplicate sample id "


def reading_settings(source: SourceConfig, catalog_version: str) -> str:
    """What the rows of a source's records depend on besides its files: the catalogue's code and
    global settings (`catalog_version`) and the source's own reading settings."""
    settings = [MARK_FORMAT, catalog_version, source.kind, str(source.path), str(source.media_root),
                sorted(str(root) for root in source.allowed_roots), source.max_record_bytes, source.max_json_depth,
                source.max_image_pixels]
    return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class FileMark:
    """A file's length, sha256 and newline count, read once."""

    bytes: int
    sha256: str
    lines: int
    ends_with_newline: bool

    @classmethod
    def of(cls, path: Location, stop: int | None = None) -> FileMark:
        """Of the file's first `stop` bytes (default: all of it)."""
        return FileHash().read(path, stop).mark


@dataclass
class FileHash:
    """The sha256, length and newline count of a file's first bytes, going on: the mark of the file
    once lines were appended continues it instead of reading those bytes again (hundreds of MB)."""

    digest: Any = field(default_factory=hashlib.sha256)
    bytes: int = 0
    lines: int = 0
    last: bytes = b""

    def read(self, path: Location, stop: int | None = None) -> FileHash:
        """A copy continued with the file's bytes from `self.bytes` to `stop` (default: its end)."""
        digest, size, lines, last = self.digest.copy(), self.bytes, self.lines, self.last
        with open_location(path) as handle:
            handle.seek(size)
            while stop is None or size < stop:
                block = handle.read(_HASH_BLOCK if stop is None else min(_HASH_BLOCK, stop - size))
                if not block:
                    break
                digest.update(block)
                size, lines, last = size + len(block), lines + block.count(b"\n"), block[-1:]
        return FileHash(digest, size, lines, last)

    @property
    def mark(self) -> FileMark:
        return FileMark(self.bytes, self.digest.hexdigest(), self.lines, self.last == b"\n")


class SavedMark:
    """A read mark kept as JSON beside the catalogue (its dataclass fields)."""

    def save(self, path: Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Self | None:
        """The mark at `path`, or None when there is none, it is unreadable or of another source kind."""
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


@dataclass(frozen=True)
class ReadMark(SavedMark):
    """What a build of a JSON-lines source's catalogue read (see the module's docstring)."""

    settings: str
    bytes: int
    sha256: str
    lines: int
    records: int
    has_objects: bool
    all_have_ids: bool
    catalog_sha256: str

    @property
    def survey(self) -> IdSurvey:
        return IdSurvey(self.records, self.has_objects, self.all_have_ids)


class AppendRefused(Exception):
    """Why a catalogue is read in full rather than extended."""


@dataclass
class Extension:
    """How to extend a catalogue: keep its first `kept_rows` rows, with `rechecked` ones (row index
    -> row) replaced, then read `part`, provided that `media` finds the media the kept rows rely on
    unchanged."""

    part: JsonlPart | FolderPart
    kept_rows: int
    rechecked: dict[int, dict]
    media: UnchangedMediaCheck
    read_before: FileHash | None = None  # of a JSON-lines file's bytes before `part`
    # Of a JSON-lines file, its location_stamp before any of it was read: the same once `part` is
    # read, the rows read are those of the file (vlm_assets.catalog.table).
    file_stamp: str | None = None


def plan_extension(source: SourceConfig, catalog: Path, mark_path: Path, settings: str, text_key: str,
                   validator: MediaValidator, helpers: Executor | None = None) -> Extension:
    """How `catalog` extends to `source`'s appended lines; raises AppendRefused when it does not.

    Starts the check of the media the kept rows rely on (on one of the build's `helpers`, spawned
    processes, when it has some: the extension's `media`) and checks the earlier rejects again, so it is called while the catalogue
    is being rebuilt.
    """
    mark = ReadMark.load(mark_path)
    if mark is None:
        raise AppendRefused("no read mark from an earlier build")
    if not is_json_lines(source):
        raise AppendRefused("not a JSON-lines file")
    if mark.settings != settings:
        raise AppendRefused("the reading settings changed")
    if validator.check_log is None:
        raise AppendRefused("no media check log")
    path = resolved(source.path)
    stamp = location_stamp(path)
    size = location_size(path)
    if size <= mark.bytes:
        raise AppendRefused(f"the file is not longer than the {mark.bytes} bytes read before")
    read_before = FileHash().read(path, mark.bytes)
    if read_before.mark.sha256 != mark.sha256:
        raise AppendRefused(f"its first {mark.bytes} bytes (read before) changed")
    if not catalog.is_file() or FileMark.of(catalog).sha256 != mark.catalog_sha256:
        raise AppendRefused("the catalogue is not the one the mark was written with")
    part = JsonlPart(mark.bytes, mark.lines + 1, mark.survey)
    added = survey_range(source, part.lines(source), count_all=False)
    if (mark.survey + added).use_ids != mark.survey.use_ids:
        raise AppendRefused("the appended records change how all records are named (by id or by number)")
    media = UnchangedMediaCheck(validator.check_log, helpers)
    try:
        table = pq.read_table(catalog, columns=["sample_id", "origin", "status", "reason"])
        if table.num_rows != mark.records:
            raise AppendRefused("the catalogue's rows differ from the records read")
        part.seen = SeenIds(catalog, earlier=catalog)
        rechecked = _rejects_checked_again(source, mark, table, text_key, validator)
    except BaseException:
        media.close()
        raise
    return Extension(part, table.num_rows, rechecked, media, read_before, stamp)


def _rejects_checked_again(source: SourceConfig, mark: ReadMark, table, text_key: str,
                           validator: MediaValidator) -> dict[int, dict]:
    """Each earlier reject (but duplicates) read and checked again: row index -> its row now."""
    rows: dict[int, tuple[int, str]] = {}  # line -> (row index, sample id)
    # Picked in Arrow: as Python objects, a million rows' four columns would be 300 MB.
    rejects = pc.and_(pc.not_equal(table.column("status"), STATUS_OK),
                      pc.invert(pc.starts_with(table.column("reason"), _DUPLICATE_REASON)))
    indices = np.flatnonzero(pc.fill_null(rejects, True).to_numpy(zero_copy_only=False))
    picked = table.take(pa.array(indices)).select(["sample_id", "origin"]).to_pydict()
    for index, sample_id, origin in zip(indices.tolist(), picked["sample_id"], picked["origin"]):
        rows[int(origin.rsplit(":", 1)[1])] = (index, sample_id)
    if not rows:
        return {}
    scope = SourceScope(source)
    resolver = resolver_for(source.name, scope)
    rechecked = {}
    for origin, _locator, record, error in entries_at_lines(source, LineRange(0, mark.bytes, 1), set(rows)):
        index, sample_id = rows[int(origin.rsplit(":", 1)[1])]
        rechecked[index] = catalog_row(RawRecord(sample_id, origin, record, resolver, error), source.name, text_key,
                                       validator)
    if len(rechecked) != len(rows):
        raise AppendRefused("earlier rejects could not be found at their lines")
    return rechecked


def mark_of(source: SourceConfig, part: JsonlPart, records: int, settings: str, catalog_sha256: str,
            read_before: FileHash | None = None) -> ReadMark | None:
    """The read mark of a build that read `part` to the end of the file, or None when the file does
    not end with a whole line (a line still being written may go on). `read_before`: the hash of the
    bytes before the part, when they were hashed already."""
    file = (read_before or FileHash()).read(resolved(source.path)).mark
    if not file.ends_with_newline or part.survey is None:
        return None
    survey = part.survey
    return ReadMark(settings, file.bytes, file.sha256, file.lines, records, survey.has_objects, survey.all_have_ids,
                    catalog_sha256)
