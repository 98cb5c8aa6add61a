"""A `jsonl` source: one record per JSON line (or per element of a JSON array file), media below its media root."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from vlm_assets.catalog.media_resolution import MediaResolver, SourceScope, resolver_for
from vlm_assets.catalog.readers.raw_record import RawRecord
from vlm_assets.catalog.records import RecordLimits, array_elements, is_json_array, parse_bytes
from vlm_assets.config import SourceConfig
from vlm_assets.object_store import Location, open_location, read_location, resolved

_Entry = tuple[str, str, Any, str]  # (origin, locator, record, reason it is unreadable or "")
# 64 bits: two different records sharing a digest are still told apart, as repeats.
CONTENT_ID_HEX = 16


def read_jsonl(source: SourceConfig, scope: SourceScope, limits: RecordLimits) -> Iterator[RawRecord]:
    path = resolved(source.path)
    resolver = resolver_for(source.name, scope)
    with open_location(path) as handle:
        head = handle.read(4096)
    if is_json_array(head):
        elements = list(_array_entries(path, limits))
        id_pass, entries = elements, elements
    else:
        # JSON lines are read twice rather than held: a source of millions of lines needs no more
        # memory than one line.
        id_pass, entries = _jsonl_entries(path, limits), _jsonl_entries(path, limits)
    survey = IdSurvey.of((entry[2] for entry in id_pass), count_all=False)
    yield from _raw_records(source, resolver, entries, survey.use_ids)


@dataclass(frozen=True)
class IdSurvey:
    """Whether records are named by their ids: when every object record has a usable one (a repeated
    id is then a rejected duplicate, see build.py; never renumbered). Records that are not objects
    are named by where they are; without ids, every object by its content (`content_id`)."""

    records: int = 0
    has_objects: bool = False
    all_have_ids: bool = True

    @classmethod
    def of(cls, records: Iterable[Any], count_all: bool = True) -> IdSurvey:
        """Without `count_all`, it stops at the first object without an id (`records` is then short)."""
        count, has_objects, all_have_ids = 0, False, True
        for record in records:
            count += 1
            if isinstance(record, dict):
                has_objects = True
                all_have_ids = all_have_ids and _usable_id(record.get("id"))
                if not (all_have_ids or count_all):
                    break
        return cls(count, has_objects, all_have_ids)

    def __add__(self, other: IdSurvey) -> IdSurvey:
        return IdSurvey(self.records + other.records, self.has_objects or other.has_objects,
                        self.all_have_ids and other.all_have_ids)

    @property
    def use_ids(self) -> bool:
        return self.has_objects and self.all_have_ids


def _raw_records(source: SourceConfig, resolver: MediaResolver, entries: Iterable[_Entry],
                 use_ids: bool) -> Iterator[RawRecord]:
    for origin, locator, record, error in entries:
        if not isinstance(record, dict):
            yield RawRecord(f"{source.name}/{locator}", origin, record, resolver, error)
        elif use_ids:
            yield RawRecord(f"{source.name}/{record['id']}", origin, record, resolver, error)
        else:
            yield RawRecord(f"{source.name}/{content_id(record)}", origin, record, resolver, error, repeats_numbered=True)


def content_id(record: dict) -> str:
    """The local id of a record without one: a digest of its content, so that a line inserted or
    removed elsewhere leaves it (a line number would shift). Identical records share it: the build
    numbers the repeats (see build.py)."""
    canonical = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:CONTENT_ID_HEX]


@dataclass(frozen=True)
class LineRange:
    """Lines [start, end) of a JSON-lines file, in bytes; `first_line` is its first line's number."""

    start: int
    end: int
    first_line: int


READ_BLOCK = 16 << 20


def line_ranges(path: Location, target_bytes: int, start: int = 0, first_line: int = 1) -> Iterator[LineRange]:
    """The file from byte `start` (line `first_line`) cut into ranges of whole lines, each ending at
    the first line end past a multiple of `target_bytes` from its start, read once at disk speed
    (lines are counted, not parsed)."""
    position, line = start, first_line  # bytes before the block; number of the line the block starts in
    with open_location(path) as handle:
        handle.seek(start)
        while block := handle.read(READ_BLOCK):
            cursor = 0
            while (wanted := start + target_bytes - position) < len(block):
                newline = block.find(b"\n", max(wanted, cursor))
                if newline < 0:
                    break
                line += block.count(b"\n", cursor, newline + 1)
                cursor = newline + 1
                yield LineRange(start, position + cursor, first_line)
                start, first_line = position + cursor, line
            line += block.count(b"\n", cursor)
            position += len(block)
    if position > start:
        yield LineRange(start, position, first_line)


def survey_range(source: SourceConfig, lines: LineRange, count_all: bool = True) -> IdSurvey:
    limits = RecordLimits.of(source)
    return IdSurvey.of((entry[2] for entry in _jsonl_entries(resolved(source.path), limits, lines)), count_all)


def entries_at_lines(source: SourceConfig, lines: LineRange, wanted: set[int]) -> Iterator[_Entry]:
    """The entries (origin, locator, record, reason it is unreadable or "") of the `wanted` line
    numbers of `lines`; the other lines are skipped unparsed."""
    yield from _jsonl_entries(resolved(source.path), RecordLimits.of(source), lines, wanted)


def read_jsonl_range(source: SourceConfig, scope: SourceScope, lines: LineRange, use_ids: bool) -> Iterator[RawRecord]:
    """The raw records of `lines` of a JSON-lines source, as read_jsonl names them: `use_ids` is the
    whole file's IdSurvey.use_ids."""
    path = resolved(source.path)
    resolver = resolver_for(source.name, scope)
    yield from _raw_records(source, resolver, _jsonl_entries(path, RecordLimits.of(source), lines), use_ids)


def _usable_id(value: Any) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def _array_entries(path: Location, limits: RecordLimits) -> Iterator[_Entry]:
    for element in array_elements(read_location(path), str(path), limits):
        yield f"{path}[{element.index}]", f"element-{element.index}", element.record, element.error


def _jsonl_entries(path: Location, limits: RecordLimits, lines: LineRange | None = None,
                   wanted: set[int] | None = None) -> Iterator[_Entry]:
    for number, line, error in _jsonl_lines(path, limits, lines):
        if wanted is not None and number not in wanted:
            continue
        origin = f"{path}:{number}"
        record, error = (None, error) if line is None else parse_bytes(line, origin, limits)
        yield origin, f"line-{number}", record, error


def _jsonl_lines(path: Location, limits: RecordLimits, lines: LineRange | None = None) -> Iterator[tuple[int, bytes | None, str]]:
    """(line number, line, "") for each non-blank line (of `lines` only, if given), or (number, None,
    reason) for one over the limit."""
    with open_location(path) as handle:
        number = 0
        if lines is not None:
            handle.seek(lines.start)
            number = lines.first_line - 1
        while lines is None or handle.tell() < lines.end:
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
