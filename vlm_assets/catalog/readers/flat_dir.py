"""A `flat_dir` source: every `*.json` file below a folder is one record, its media beside it."""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator
from pathlib import Path

from vlm_assets.catalog.media_resolution import FileResolver, ObjectResolver, SourceScope, real_path
from vlm_assets.catalog.readers.raw_record import RawRecord
from vlm_assets.catalog.readers.source_walk import SourceWalk, WalkEntry
from vlm_assets.catalog.records import RecordLimits, parse_bytes
from vlm_assets.config import SourceConfig
from vlm_assets.object_store import ObjectInfo, ObjectURL, list_objects, read_range


class FolderListing:
    """A flat_dir source's record files in reading order (sorted by path), its folders walked once.

    `stamped`: each record file's stamp is taken as it is listed (see `stamps`), so before it is
    read: a file changed while the records are read no longer matches its stamp.
    """

    def __init__(self, source: SourceConfig, scope: SourceScope, stamped: bool = False) -> None:
        self.source = source
        self.scope = scope
        self.root = real_path(source.path)
        self.walk = SourceWalk(self.root, scope, lambda name: name.endswith(".json"))
        self.entries: list[WalkEntry] = self.walk.entries()
        self.stamps = self._stamps() if stamped else []

    def _stamps(self) -> list[str]:
        """One line per record file: its path below the root and its stamp (size, mtime, ctime), or why it is refused."""
        stamps = []
        for entry in self.entries:
            relative = entry.path.relative_to(self.root).as_posix()
            if entry.refused:
                stamps.append(f"{relative}\trefused\t{entry.refused}")
                continue
            try:
                stat = os.stat(entry.path)
                stamps.append(f"{relative}\t{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}")
            except OSError as error:
                stamps.append(f"{relative}\t{type(error).__name__}")
        return stamps

    def record(self, index: int, limits: RecordLimits) -> RawRecord:
        entry = self.entries[index]
        relative = entry.path.relative_to(self.root).as_posix()
        folder = self.walk.listings.get(entry.path.parent)
        resolver = FileResolver(self.source.name, self.scope, [entry.path.parent, self.root], entry.path,
                                None if folder is None else names_starting(folder, f"{entry.path.stem}."))
        sample_id = f"{self.source.name}/{relative}"
        if entry.refused:
            return RawRecord(sample_id, str(entry.path), None, resolver, entry.refused)
        data, error = _read_file(entry.path, limits)
        record, error = (None, error) if data is None else parse_bytes(data, str(entry.path), limits)
        return RawRecord(sample_id, str(entry.path), record, resolver, error)

    def records(self, limits: RecordLimits, start: int = 0) -> Iterator[RawRecord]:
        """The raw records of the record files from the `start`th on."""
        for index in range(start, len(self.entries)):
            yield self.record(index, limits)


class ObjectFolderListing:
    """`FolderListing` of a flat_dir source on object storage: its `*.json` objects in key order,
    listed a page at a time (names starting with "." anywhere below the prefix are skipped, as on
    disk). Each object's stamp is its key below the prefix, size and ETag."""

    def __init__(self, source: SourceConfig, scope: SourceScope, stamped: bool = False) -> None:
        assert isinstance(source.path, ObjectURL)
        self.source = source
        self.scope = scope
        self.root = source.path
        self.entries: list[ObjectInfo] = []
        self.listings: dict[ObjectURL, list[str]] = {}  # folder -> its object names (for same-stem media)
        for info in list_objects(self.root):
            relative = self.root.relative(info.url)
            if any(part.startswith(".") for part in relative.split("/")):
                continue
            self.listings.setdefault(info.url.parent, []).append(info.url.name)
            if info.url.name.endswith(".json"):
                self.entries.append(info)
        self.stamps = [f"{self.root.relative(info.url)}\t{info.size}:{info.etag}" for info in self.entries] if stamped else []

    def record(self, index: int, limits: RecordLimits) -> RawRecord:
        info = self.entries[index]
        url = info.url
        folder = sorted(self.listings.get(url.parent, []))
        resolver = ObjectResolver(self.source.name, self.scope, [url.parent, self.root], url,
                                  names_starting(folder, f"{url.name.rsplit('.', 1)[0]}."))
        sample_id = f"{self.source.name}/{self.root.relative(url)}"
        error = limits.too_large(info.size, str(url))
        if error:
            return RawRecord(sample_id, str(url), None, resolver, error)
        try:
            data = read_range(url, 0, info.size)
        except OSError as read_error:
            return RawRecord(sample_id, str(url), None, resolver, f"unreadable record file {url}: {read_error}")
        record, error = parse_bytes(data, str(url), limits)
        return RawRecord(sample_id, str(url), record, resolver, error)

    def records(self, limits: RecordLimits, start: int = 0) -> Iterator[RawRecord]:
        for index in range(start, len(self.entries)):
            yield self.record(index, limits)


def folder_listing(source: SourceConfig, scope: SourceScope, stamped: bool = False) -> FolderListing | ObjectFolderListing:
    if isinstance(source.path, ObjectURL):
        return ObjectFolderListing(source, scope, stamped)
    return FolderListing(source, scope, stamped)


def names_starting(names: list[str], prefix: str) -> list[str]:
    """The names in sorted `names` that start with `prefix`. A record carries only these, not its folder's
    whole listing: looking through (and sending to a worker) a million names per record would make a big
    folder's catalogue quadratic."""
    first = bisect.bisect_left(names, prefix)
    last = first
    while last < len(names) and names[last].startswith(prefix):
        last += 1
    return names[first:last]


def read_flat_dir(source: SourceConfig, scope: SourceScope, limits: RecordLimits) -> Iterator[RawRecord]:
    yield from folder_listing(source, scope).records(limits)


def _read_file(path: Path, limits: RecordLimits) -> tuple[bytes | None, str]:
    """The bytes of a record file, or the reason it cannot be read (too large: refused unread)."""
    try:
        size = path.stat().st_size
        error = limits.too_large(size, str(path))
        if error:
            return None, error
        with open(path, "rb") as handle:
            return handle.read(limits.max_bytes + 1), ""
    except OSError as error:
        return None, f"unreadable record file {path}: {error}"
