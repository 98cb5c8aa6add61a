"""One storage root, one configuration: the root records which config file owns it.

The outputs that span sources (the training mix, the frame-cache plan and index, the packages)
are built from one configuration's sources and settings. Two configurations writing one root
would overwrite each other's and each would then call the other's output up to date. So the
first run on a root claims it for its config file, and a run of any other config file on that
root is refused with an error naming both.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from vlm_assets.atomic import TEMP_SUFFIX, temp_prefix
from vlm_assets.config import ConfigError
from vlm_assets.layout import OWNER_NAME, StorageLayout
from vlm_assets.object_store import ObjectURL, create_once, read_object_if_any


class StorageRootTaken(ConfigError):
    """The storage root belongs to another configuration file."""


def claim_storage_root(root: Path, config: Path) -> None:
    """Record `config` as the owner of `root` if it has none; refuse if another config owns it."""
    owner_file = StorageLayout(root).owner
    me = str(Path(config).resolve())
    owner = _owner(owner_file)
    if owner is None:
        _create_once(owner_file, json.dumps({"config": me}) + "\n")
        owner = _owner(owner_file)
    if owner != me:
        raise StorageRootTaken(
            f"{config}: storage.root {root} belongs to the configuration {owner}; two configurations never "
            "share a root (each would overwrite the other's training mix, frame cache and packages). Give this "
            f"configuration its own storage.root, or, if {owner} has moved here or is gone, delete {owner_file}"
        )


def claim_object_root(url: ObjectURL, config: Path) -> None:
    """`claim_storage_root` for a storage root on object storage: the owner record is an object
    created by a conditional write (If-None-Match), so of two first runs racing, one claims it."""
    record = ObjectURL(url.bucket, f"{url.key}/{OWNER_NAME}" if url.key else OWNER_NAME)
    me = str(Path(config).resolve())
    owner = _owner_of(read_object_if_any(record), str(record))
    if owner is None:
        create_once(record, (json.dumps({"config": me}) + "\n").encode())
        owner = _owner_of(read_object_if_any(record), str(record))
    if owner != me:
        raise StorageRootTaken(
            f"{config}: storage.root {url} belongs to the configuration {owner}; two configurations never "
            "share a root (each would overwrite the other's training mix, frame cache and packages). Give this "
            f"configuration its own storage.root, or, if {owner} has moved or is gone, delete the object {record}"
        )


def _owner_of(data: bytes | None, name: str) -> str | None:
    if data is None:
        return None
    try:
        return str(json.loads(data)["config"])
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{name}: not a storage-root owner record ({error}); delete it to let the next "
                          "run claim the root") from error


def _owner(owner_file: Path) -> str | None:
    try:
        return str(json.loads(owner_file.read_text(encoding="utf-8"))["config"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{owner_file}: not a storage-root owner record ({error}); delete it to let the next "
                          "run claim the root") from error


def _create_once(target: Path, text: str) -> None:
    """Write `target` complete, unless it exists: of two first runs racing, one claims the root."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(target.name), suffix=TEMP_SUFFIX, dir=target.parent)
    except OSError as error:  # a read-only root: name the record, not a temp file's random name
        raise OSError(error.errno, error.strerror, str(target)) from error
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        try:
            os.link(tmp, target)
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)
