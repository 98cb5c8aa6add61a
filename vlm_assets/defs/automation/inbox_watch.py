"""When an inbox entry is ready to become a source: the inbox sensor's decision, without Dagster.

An entry is picked up once its fingerprint (files, bytes, newest mtime) is the same on two
consecutive ticks (a copy in progress keeps changing it) and, when the config asks for one, its
`_READY` marker exists. The cursor stays small: a high-water mark (the newest mtime among the
entries already launched) plus the fingerprints of entries still waiting, which drain as they
are launched or vanish.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from vlm_assets.inbox import READY_MARKER, InboxEntry


def fingerprint_key(entry: InboxEntry) -> str:
    files, size, newest = entry.fingerprint
    return f"{files}f-{size}b-{newest:.6f}"


@dataclass(frozen=True)
class InboxCursor:
    mark: float = 0.0  # newest mtime among entries already launched
    waiting: dict[str, str] = field(default_factory=dict)  # name -> fingerprint seen at the last tick

    @classmethod
    def from_json(cls, text: str | None) -> InboxCursor:
        if not text:
            return cls()
        data = json.loads(text)
        return cls(float(data.get("mark", 0.0)), dict(data.get("waiting", {})))

    def to_json(self) -> str:
        return json.dumps({"mark": self.mark, "waiting": self.waiting}, sort_keys=True)


@dataclass(frozen=True)
class InboxDecision:
    ready: list[InboxEntry]
    not_ready: dict[str, str]  # name -> why it waits
    cursor: InboxCursor


def decide(
    entries: list[InboxEntry], cursor: InboxCursor, registered: set[str], require_ready_marker: bool
) -> InboxDecision:
    """Entries to launch now, those still waiting (with why), and the next cursor.

    An entry whose partition exists and whose files are no newer than the mark was launched
    before; touching any of its files (e.g. `_READY`) makes it new data again.
    """
    ready: list[InboxEntry] = []
    not_ready: dict[str, str] = {}
    waiting: dict[str, str] = {}
    for entry in entries:
        name, key = entry.source.name, fingerprint_key(entry)
        if name in registered and entry.fingerprint[2] <= cursor.mark:
            continue
        if require_ready_marker and not entry.ready_marker:
            not_ready[name] = f"no {READY_MARKER} marker yet"
            waiting[name] = key
        elif cursor.waiting.get(name) != key:
            not_ready[name] = "new or still changing; picked up when unchanged at the next tick"
            waiting[name] = key
        else:
            ready.append(entry)
    mark = max([cursor.mark] + [entry.fingerprint[2] for entry in ready])
    return InboxDecision(ready, not_ready, InboxCursor(mark, waiting))
