"""Outputs published to a storage root on object storage.

With `storage.root: s3://bucket/prefix`, each step builds its outputs in the local working copy
(`storage.work_dir`) exactly as under a local root, then publishes them: every file becomes the
object at the same relative key below the prefix. An object is uploaded whole (see
vlm_assets.object_store.upload_file), so a reader never sees half of one.
A published folder is mirrored: its new objects are put first (those of its hidden metadata
folders, such as Energon's `.nv-meta`, last), then the objects it no longer holds are deleted. A file published as it is now (its size and mtime as when uploaded, the object
still carrying the ETag it got then) is not uploaded again, so a step that changed nothing writes
no object. What was uploaded is remembered per file under `spool/published/`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vlm_assets.atomic import TEMP_SUFFIX, atomic_write_text
from vlm_assets.object_store import REQUESTS, ObjectURL, client, head, list_objects, upload_file

LEDGER_FOLDER = Path("spool") / "published"


@dataclass
class Published:
    put: int = 0
    put_bytes: int = 0
    unchanged: int = 0
    deleted: int = 0

    def describe(self, url: ObjectURL) -> str:
        return (f"published to {url}: {self.put} object(s) put ({self.put_bytes / 1e6:.1f} MB), "
                f"{self.unchanged} unchanged, {self.deleted} deleted")


def msc_url(root: Path, url: ObjectURL, path: Path) -> str:
    """Where the published copy of `path` (below `root`) is, as Energon names it: through
    multi-storage-client's implicit profile for the bucket, which the AWS environment configures."""
    return f"msc://_s3-{url.bucket}/{_below(url, path.relative_to(root)).key}"


def publish(root: Path, url: ObjectURL, paths: list[Path]) -> Published:
    """Publish `paths` (files or folders below `root`) to the same relative keys below `url`."""
    summary = Published()
    for path in paths:
        if path.is_dir():
            prefix = _below(url, path.relative_to(root))
            remote = {info.url.key: info.etag for info in list_objects(prefix)}
            local = {_below(url, file.relative_to(root)).key: file for file in _files_below(path)}
            # Metadata folders (Energon's .nv-meta) last: a reader finds it only over the data it indexes.
            for key, file in sorted(local.items(), key=lambda item: ("/." in item[0][len(prefix.key):], item[0])):
                _publish_file(root, file, ObjectURL(url.bucket, key), remote.get(key), summary)
            for key in sorted(set(remote) - set(local)):
                REQUESTS["delete"] += 1
                client().delete_object(Bucket=url.bucket, Key=key)
                summary.deleted += 1
        elif path.is_file():
            _publish_file(root, path, _below(url, path.relative_to(root)), None, summary)
    return summary


def _below(url: ObjectURL, relative: Path) -> ObjectURL:
    return ObjectURL(url.bucket, f"{url.key}/{relative.as_posix()}" if url.key else relative.as_posix())


def _files_below(folder: Path) -> Iterator[Path]:
    for directory, _subdirectories, names in os.walk(folder):
        for name in sorted(names):
            if not name.endswith(TEMP_SUFFIX):  # another writer's file, not yet in place
                yield Path(directory) / name


def _publish_file(root: Path, file: Path, target: ObjectURL, listed_etag: str | None, summary: Published) -> None:
    """Upload `file` to `target` unless the object is what was uploaded from the file as it is now."""
    ledger = root / LEDGER_FOLDER / (file.relative_to(root).as_posix() + ".json")
    stat = file.stat()
    identity = [stat.st_size, stat.st_mtime_ns]
    try:
        recorded = json.loads(ledger.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        recorded = {}
    if recorded.get("file") == identity and recorded.get("object") == str(target):
        info = None if listed_etag is not None else head(target)
        etag = listed_etag if listed_etag is not None else info.etag if info is not None else None
        if etag == recorded.get("etag"):
            summary.unchanged += 1
            return
    upload_file(file, target)
    uploaded = head(target)
    if uploaded is None:
        raise OSError(f"{target}: not there after its upload")
    ledger.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(ledger, json.dumps({"object": str(target), "file": identity, "etag": uploaded.etag}) + "\n")
    summary.put += 1
    summary.put_bytes += stat.st_size
