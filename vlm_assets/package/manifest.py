"""The `manifest.json` that opens every training package.

The manifest is the package's table of contents and its integrity record: every
data member is listed with its role, archive path, size and sha256, so a reader
can check a package on a machine that has nothing but the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DATA_PREFIX = "data"


class PackageError(Exception):
    """A package that cannot be read, trusted or unpacked; the message names the file."""


@dataclass(frozen=True)
class FileEntry:
    role: str
    archive_path: str
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "path": self.archive_path, "size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class Manifest:
    name: str
    created_at: str | None  # None (JSON null): no time recorded, so identical inputs give identical bytes
    compress: str
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    train_command: str = ""
    files: tuple[FileEntry, ...] = ()
    format_version: int = FORMAT_VERSION

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(entry.role for entry in self.files))

    @property
    def total_size(self) -> int:
        return sum(entry.size for entry in self.files)

    def by_path(self) -> dict[str, FileEntry]:
        return {entry.archive_path: entry for entry in self.files}

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "name": self.name,
            "created_at": self.created_at,
            "compress": self.compress,
            "hyperparameters": self.hyperparameters,
            "train_command": self.train_command,
            "files": [entry.to_json() for entry in self.files],
        }

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2, sort_keys=False, ensure_ascii=False) + "\n").encode("utf-8")


def _optional_text(value: Any) -> str | None:
    return None if value is None else str(value)


def role_root(role: str) -> str:
    """Archive folder that holds one role's files (and becomes its dataset path on extraction)."""
    return f"{DATA_PREFIX}/{role}"


def check_archive_path(name: str) -> str:
    """Return `name` if it is a plain relative POSIX path that stays inside the target, else raise."""
    if not name or "\\" in name or "\x00" in name:
        raise PackageError(f"unsafe member name {name!r}")
    path = PurePosixPath(name)
    if path.is_absolute() or name.startswith("/"):
        raise PackageError(f"unsafe member name {name!r}: absolute path")
    if any(part in ("..", "") for part in name.split("/")) or ".." in path.parts:
        raise PackageError(f"unsafe member name {name!r}: '..' or empty path component")
    if any(part == "." for part in name.split("/")):
        raise PackageError(f"unsafe member name {name!r}: '.' path component")
    return name


def parse_manifest(raw: bytes, source: str) -> Manifest:
    """Parse and validate manifest bytes read from `source` (named in every error)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PackageError(f"{source}: manifest.json is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise PackageError(f"{source}: manifest.json must be a JSON object")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise PackageError(f"{source}: unsupported package format_version {version!r} (this reader knows {FORMAT_VERSION})")
    try:
        files = tuple(
            FileEntry(role=str(item["role"]), archive_path=str(item["path"]), size=int(item["size"]), sha256=str(item["sha256"]))
            for item in data["files"]
        )
        manifest = Manifest(
            name=str(data["name"]),
            created_at=_optional_text(data["created_at"]),
            compress=str(data["compress"]),
            hyperparameters=dict(data.get("hyperparameters") or {}),
            train_command=str(data.get("train_command") or ""),
            files=files,
            format_version=version,
        )
    except (KeyError, TypeError, ValueError) as error:
        raise PackageError(f"{source}: manifest.json is missing or has a malformed field: {error!r}") from error
    seen: set[str] = set()
    for entry in manifest.files:
        try:
            check_archive_path(entry.archive_path)
        except PackageError as error:
            raise PackageError(f"{source}: manifest lists {error}") from error
        if not entry.archive_path.startswith(role_root(entry.role) + "/"):
            raise PackageError(f"{source}: manifest entry {entry.archive_path!r} is not under {role_root(entry.role)}/")
        if entry.archive_path in seen:
            raise PackageError(f"{source}: manifest lists {entry.archive_path!r} twice")
        seen.add(entry.archive_path)
    return manifest
