"""One record's JSON, parsed under the source's limits: any bad record fails alone, with a reason.

A record larger than `max_record_bytes` is refused before it is read; one nested deeper than
`max_json_depth` is refused before it is parsed (Python's parser would otherwise hit its
recursion limit and stop the whole source). A JSON array file is split into its elements without
parsing the file as a whole, so one bad element leaves the others readable.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vlm_assets.config import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_RECORD_BYTES, SourceConfig

# A JSON string (escapes included) or one bracket: everything the nesting depth depends on. A lone
# quote is a string never closed: scanning stops there (the parser then names the error), so a
# hostile record cannot make the scan retry at every quote.
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[][{}]|"')
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_SCALAR = re.compile(r'[^\s,\][{}"]+')
_SPACE = re.compile(r"[ \t\n\r]*")
# Bytes that were not UTF-8, as decoded with errors="surrogateescape".
_UNDECODABLE = re.compile("[\udc80-\udcff]")


@dataclass(frozen=True)
class RecordLimits:
    max_bytes: int = DEFAULT_MAX_RECORD_BYTES
    max_depth: int = DEFAULT_MAX_JSON_DEPTH

    @classmethod
    def of(cls, source: SourceConfig) -> RecordLimits:
        return cls(source.max_record_bytes, source.max_json_depth)

    def too_large(self, size: int, where: str) -> str:
        """The reject reason when a record of `size` bytes is over the limit, else ""."""
        if size <= self.max_bytes:
            return ""
        return f"record too large: {where} is {size} bytes, over the source's max_record_bytes ({self.max_bytes})"

    def too_deep(self, where: str) -> str:
        return f"JSON nested too deeply: {where} is nested deeper than the source's max_json_depth ({self.max_depth})"


def parse_bytes(data: bytes, where: str, limits: RecordLimits) -> tuple[Any, str]:
    """(record, "") or (None, reject reason naming `where`)."""
    error = limits.too_large(len(data), where)
    if error:
        return None, error
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as decode_error:
        return None, f"malformed JSON in {where}: not UTF-8 ({decode_error})"
    return parse_text(text, where, limits)


def parse_text(text: str, where: str, limits: RecordLimits, depth: int | None = None) -> tuple[Any, str]:
    """Like parse_bytes for decoded text; `depth` when the caller already measured it."""
    # Nesting cannot exceed the number of brackets: a C-speed count spares most records the scan.
    if depth is None and text.count("[") + text.count("{") > limits.max_depth:
        depth = _nesting_depth(text, limits.max_depth)
    if depth is not None and depth > limits.max_depth:
        return None, limits.too_deep(where)
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as error:
        return None, f"malformed JSON in {where}: {error}"
    except RecursionError:  # only when the configured depth leaves the parser too little stack
        return None, limits.too_deep(where)


def _nesting_depth(text: str, stop_above: int) -> int:
    """How deeply arrays and objects nest in `text` (counting stops once above `stop_above`)."""
    depth = deepest = 0
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > stop_above:
                    break
        elif token in ("]", "}"):
            depth -= 1
        elif token == '"':
            break
    return deepest


def _container_end(text: str, start: int) -> tuple[int | None, int]:
    """End of the array or object opening at `start` (None: never closed) and its nesting depth."""
    depth = deepest = 0
    for match in _TOKENS.finditer(text, start):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in ("]", "}"):
            depth -= 1
            if depth == 0:
                return match.end(), deepest
        elif token == '"':
            break
    return None, deepest


@dataclass(frozen=True)
class ArrayElement:
    index: int
    record: Any
    error: str


def is_json_array(head: bytes) -> bool:
    """Whether a file starting with `head` is a JSON array (rather than JSON lines)."""
    return head.lstrip(b"\xef\xbb\xbf").lstrip(b" \t\r\n").startswith(b"[")


def array_elements(data: bytes, name: str, limits: RecordLimits) -> Iterator[ArrayElement]:
    """Each element of the JSON array file `data`, parsed on its own (`name` appears in reasons).

    Where the array itself is broken, one last element carries the reason: the rest of the file
    cannot be split into records.
    """
    text = data.decode("utf-8-sig", errors="surrogateescape")
    position = _SPACE.match(text, 0).end() + 1  # past the "["
    position = _SPACE.match(text, position).end()
    index = 0
    if text.startswith("]", position):
        position += 1
    else:
        while True:
            where = f"{name}[{index}]"
            start = position
            depth = 0
            if text.startswith(("[", "{"), start):
                end, depth = _container_end(text, start)
            else:
                match = (_STRING if text.startswith('"', start) else _SCALAR).match(text, start)
                end = match.end() if match else None
            if end is None:
                yield ArrayElement(index, None, f"malformed JSON array in {name}: element {index} (character {start}) "
                                                "is never closed; the rest of the file cannot be read")
                return
            yield _element(index, text[start:end], where, depth, limits)
            index += 1
            position = _SPACE.match(text, end).end()
            if text.startswith(",", position):
                position = _SPACE.match(text, position + 1).end()
                continue
            if text.startswith("]", position):
                position += 1
                break
            yield ArrayElement(index, None, f"malformed JSON array in {name}: expected ',' or ']' at character "
                                            f"{position}; the rest of the file cannot be read")
            return
    if text[position:].strip(" \t\r\n"):
        yield ArrayElement(index, None, f"malformed JSON array in {name}: unexpected data after the array "
                                        f"(character {_SPACE.match(text, position).end()})")


def _element(index: int, span: str, where: str, depth: int, limits: RecordLimits) -> ArrayElement:
    if _UNDECODABLE.search(span):
        return ArrayElement(index, None, f"malformed JSON in {where}: not UTF-8")
    size = len(span) if len(span) * 4 <= limits.max_bytes else len(span.encode("utf-8"))
    error = limits.too_large(size, where)
    if error:
        return ArrayElement(index, None, error)
    record, error = parse_text(span, where, limits, depth)
    return ArrayElement(index, record, error)
