"""Copies of the images on object storage that the catalogue read, kept for the shards.

A source's first build reads each image from the store to check it, and its shards would read it
again: the copy saves that second request. A copy is named by the object's URL, size and ETag (the
version its pinned ref names, see vlm_assets.catalog.media), so only that version is ever taken
from it. Copies are made only while the disk that holds them keeps MIN_FREE_BYTES free; the shards
step removes a source's copies once its shards are written.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from vlm_assets.atomic import atomic_write_bytes
from vlm_assets.catalog.media import object_facts

MIN_FREE_BYTES = 1 << 30


@dataclass(frozen=True)
class MediaCopies:
    folder: Path

    def _path(self, ref: str) -> Path:
        facts = object_facts(ref)
        digest = hashlib.sha256(f"{facts.url}\n{facts.size}\n{facts.etag}".encode()).hexdigest()
        return self.folder / digest[:2] / digest

    def keep(self, ref: str, data: bytes) -> None:
        """Keep `data`, the bytes of the pinned object `ref`, unless the disk is short of space."""
        path = self._path(ref)
        path.parent.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(path.parent).free - len(data) < MIN_FREE_BYTES:
            return
        atomic_write_bytes(path, data)

    def read(self, ref: str) -> bytes | None:
        """The bytes of the pinned object `ref`, if a copy of that version is kept."""
        try:
            data = self._path(ref).read_bytes()
        except FileNotFoundError:
            return None
        return data if len(data) == object_facts(ref).size else None

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
