"""What a reader yields for each input record: the record (or why it is unreadable) and its media resolver."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlm_assets.catalog.media_resolution import MediaResolver


@dataclass
class RawRecord:
    sample_id: str
    origin: str
    record: Any
    resolver: MediaResolver
    error: str = ""
    # Named by its content (a JSON-lines record without an id): a repeat is numbered, not rejected.
    repeats_numbered: bool = False
