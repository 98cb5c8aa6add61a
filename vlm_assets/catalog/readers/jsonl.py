"""A `jsonl` source: one record per JSON line (or per element of a JSON array file), media below its media root."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vlm_assets.catalog.media_resolution import FileResolver, SourceScope, real_path
from vlm_assets.catalog.readers.raw_record import RawRecord
from vlm_assets.catalog.records import RecordLimits, array_elements, is_json_array, parse_bytes
from vlm_assets.config import SourceConfig

_Entry = tuple[str, str, Any, str]  # (origin, locator, record, reason it is unreadable or "")


def read_jsonl(source: SourceConfig, scope: SourceScope, limits: RecordLimits) -> Iterator[RawRecord]:
    path = real_path(source.path)
    resolver = FileResolver(source.name, scope, [scope.media_root])
    with open(path, "rb") as handle:
        head = handle.read(4096)
    if is_json_array(head):
        elements = list(_array_entries(path, limits))
        id_pass, entries = elements, elements
    else:
        # JSON lines are read twice rather than held: a source of millions of lines needs no more
        # memory than one line.
        id_pass, entries = _jsonl_entries(path, limits), _jsonl_entries(path, limits)
    # Record ids when every object record has one (a repeated id is then a rejected duplicate, see
    # build.py; never renumbered); records that are not objects are named by where they are.
    has_objects, all_have_ids = False, True
    for _origin, _locator, record, _error in id_pass:
        if isinstance(record, dict):
            has_objects = True
            if not _usable_id(record.get("id")):
                all_have_ids = False
                break
    use_ids = has_objects and all_have_ids
    for number, (origin, locator, record, error) in enumerate(entries, start=1):
        if use_ids:
            local_id = record["id"] if isinstance(record, dict) else locator
        else:
            local_id = number
        yield RawRecord(f"{source.name}/{local_id}", origin, record, resolver, error)


def _usable_id(value: Any) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def _array_entries(path: Path, limits: RecordLimits) -> Iterator[_Entry]:
    for element in array_elements(path.read_bytes(), str(path), limits):
        yield f"{path}[{element.index}]", f"element-{element.index}", element.record, element.error


def _jsonl_entries(path: Path, limits: RecordLimits) -> Iterator[_Entry]:
    for number, line, error in _jsonl_lines(path, limits):
        origin = f"{path}:{number}"
        record, error = (None, error) if line is None else parse_bytes(line, origin, limits)
        yield origin, f"line-{number}", record, error


def _jsonl_lines(path: Path, limits: RecordLimits) -> Iterator[tuple[int, bytes | None, str]]:
    """(line number, line, "") for each non-blank line, or (number, None, reason) for one over the limit."""
    with open(path, "rb") as handle:
        number = 0
        while True:
            line = handle.readline(limits.max_bytes + 1)
            if not line:
                return
            number += 1
            if len(line) > limits.max_bytes and not line.endswith(b"\n"):
                size = len(line)
                while line and not line.endswith(b"\n"):  # skip the rest of the line unread
                    line = handle.readline(1 << 20)
                    size += len(line)
                size -= line.endswith(b"\n")
                yield number, None, limits.too_large(size, f"{path}:{number}")
                continue
            line = line.rstrip(b"\r\n")
            if line.strip():
                yield number, line, ""
