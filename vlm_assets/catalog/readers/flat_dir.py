"""A `flat_dir` source: every `*.json` file below a folder is one record, its media beside it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from vlm_assets.catalog.media_resolution import FileResolver, SourceScope, real_path
from vlm_assets.catalog.readers.raw_record import RawRecord
from vlm_assets.catalog.readers.source_walk import SourceWalk
from vlm_assets.catalog.records import RecordLimits, parse_bytes
from vlm_assets.config import SourceConfig


def read_flat_dir(source: SourceConfig, scope: SourceScope, limits: RecordLimits) -> Iterator[RawRecord]:
    root = real_path(source.path)
    walk = SourceWalk(root, scope, lambda name: name.endswith(".json"))
    for entry in walk.entries():
        relative = entry.path.relative_to(root).as_posix()
        resolver = FileResolver(source.name, scope, [entry.path.parent, root], entry.path, walk.listings.get(entry.path.parent))
        sample_id = f"{source.name}/{relative}"
        if entry.refused:
            yield RawRecord(sample_id, str(entry.path), None, resolver, entry.refused)
            continue
        data, error = _read_file(entry.path, limits)
        record, error = (None, error) if data is None else parse_bytes(data, str(entry.path), limits)
        yield RawRecord(sample_id, str(entry.path), record, resolver, error)


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
