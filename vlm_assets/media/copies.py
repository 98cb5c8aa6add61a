"""Copies of the images on object storage that the catalogue read, kept for the shards.

A source's first build reads each image from the store to check it, and its shards would read it
again: the copy saves that second request. A copy is named by the object's URL, size and ETag (the
version its pinned ref names, see vlm_assets.media.refs), so only that version is ever taken
from it. Copies are made only while the disk that holds them keeps MIN_FREE_BYTES free; the shards
step removes a source's copies once its shards are written.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

from vlm_assets.media.refs import object_facts

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
        # A copy is a cache, read only through its checksum: written without fsync, a copy cut short
        # by a crash is a copy not taken, never bytes taken for the object's.
        temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_bytes(data + zlib.crc32(data).to_bytes(4, "big"))
        os.replace(temporary, path)

    def read(self, ref: str) -> bytes | None:
        """The bytes of the pinned object `ref`, if a whole copy of that version is kept."""
        try:
            kept = self._path(ref).read_bytes()
        except FileNotFoundError:
            return None
        data, checksum = kept[:-4], kept[-4:]
        if len(data) != object_facts(ref).size or zlib.crc32(data).to_bytes(4, "big") != checksum:
            return None
        return data

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
