"""Sources dropped into the inbox directory (config key `inbox`), discovered by shape (docs/formats.md).

- a subdirectory holding `*.json` files             -> flat_dir source
- a subdirectory holding `pretrain-*.tar` shards     -> wds source
- a `*.jsonl` file (media under a sibling directory of the same stem, else the inbox) -> jsonl source
A source's name is `inbox-<entry name>` (sanitised), so it never collides with configured names;
a name the sanitising changed gets a digest of the entry's own name, so that two entries (`set a`,
`set_a`) never become one source.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from vlm_assets.config import SourceConfig

READY_MARKER = "_READY"
INBOX_PREFIX = "inbox-"


@dataclass(frozen=True)
class InboxEntry:
    source: SourceConfig
    fingerprint: tuple[int, int, float]  # (files, bytes, newest mtime): changes while still being copied
    ready_marker: bool


def source_name_for(entry: Path) -> str:
    stem = entry.name[: -len(".jsonl")] if entry.name.endswith(".jsonl") else entry.name
    safe = re.sub(r"[^A-Za-z0-9_-]+", "_", stem).strip("_")
    if safe != stem:
        safe = f"{safe}-{hashlib.sha256(stem.encode()).hexdigest()[:8]}"
    return INBOX_PREFIX + safe


def _fingerprint(paths: list[Path]) -> tuple[int, int, float]:
    stats = [path.stat() for path in paths if path.is_file()]
    return (len(stats), sum(stat.st_size for stat in stats), max((stat.st_mtime for stat in stats), default=0.0))


def discover_inbox(inbox: Path) -> list[InboxEntry]:
    if not inbox.is_dir():
        return []
    entries: list[InboxEntry] = []
    # A `<stem>.jsonl`'s sibling directory holds its media: it is part of that entry, not one of its own.
    media_dirs = {name[: -len(".jsonl")] for name in (path.name for path in inbox.iterdir()) if name.endswith(".jsonl")}
    for entry in sorted(inbox.iterdir()):
        if entry.name.startswith((".", "_")) or (entry.is_dir() and entry.name in media_dirs):
            continue
        name = source_name_for(entry)
        if entry.is_file() and entry.name.endswith(".jsonl"):
            media_root = inbox / entry.name[: -len(".jsonl")]
            media_root = media_root if media_root.is_dir() else inbox
            files = [entry] + (list(media_root.rglob("*")) if media_root != inbox else [])
            marker = (media_root / READY_MARKER).exists() or (inbox / f"{entry.name}{READY_MARKER}").exists()
            entries.append(InboxEntry(SourceConfig(name, "jsonl", entry, media_root), _fingerprint(files), marker))
        elif entry.is_dir():
            files = list(entry.rglob("*"))
            kind = "wds" if any(p.name.startswith("pretrain-") and p.name.endswith(".tar") for p in files) else (
                "flat_dir" if any(p.suffix == ".json" for p in files) else None)
            if kind:
                entries.append(InboxEntry(SourceConfig(name, kind, entry, entry), _fingerprint(files),
                                          (entry / READY_MARKER).exists()))
    return entries


def inbox_sources(inbox: Path) -> list[SourceConfig]:
    return [entry.source for entry in discover_inbox(inbox)]
