"""Readers for the three input kinds (docs/formats.md, Inputs): each yields raw records with a media resolver.

Media names resolve to exactly one file (or tar member); anything else is a
reject reason, never a guess.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vlm_assets.catalog.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, tar_member_ref
from vlm_assets.catalog.messages import SampleError
from vlm_assets.config import SourceConfig

MEDIA_EXTENSIONS = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS
TEXT_MEMBER_EXTENSIONS = ("txt", "caption")


@dataclass(frozen=True)
class ResolvedMedia:
    name: str
    ref: str
    key: str


class MediaResolver(Protocol):
    def resolve(self, name: str) -> ResolvedMedia: ...

    def same_stem_media(self) -> list[ResolvedMedia]: ...


@dataclass
class RawRecord:
    sample_id: str
    origin: str
    record: Any
    resolver: MediaResolver
    error: str = ""


class FileResolver:
    """Resolves names against directories on disk, keyed relative to the media root."""

    def __init__(self, source: str, media_root: Path, search_dirs: list[Path], stem_of: Path | None = None) -> None:
        self.source = source
        self.media_root = media_root.resolve()
        self.search_dirs = [directory.resolve() for directory in search_dirs]
        self.stem_of = stem_of

    def _key(self, path: Path) -> str:
        try:
            return f"{self.source}/{path.relative_to(self.media_root).as_posix()}"
        except ValueError:
            return f"{self.source}/{path.as_posix().lstrip('/')}"

    def _inside_allowed(self, path: Path) -> bool:
        return any(path.is_relative_to(directory) for directory in [self.media_root, *self.search_dirs])

    def resolve(self, name: str) -> ResolvedMedia:
        if name.startswith(("http://", "https://", "s3://")):
            raise SampleError(f"remote media {name!r} is not supported (no network): download it first")
        as_path = Path(name)
        if as_path.is_absolute():
            if not as_path.is_file():
                raise SampleError(f"missing media: {name} does not exist")
            return ResolvedMedia(name, str(as_path), self._key(as_path))
        found: dict[Path, None] = {}
        for directory in self.search_dirs:
            candidate = (directory / as_path).resolve()
            if not self._inside_allowed(candidate):
                raise SampleError(f"media path {name!r} escapes the source directory")
            if candidate.is_file():
                found[candidate] = None
        if not found:
            looked = ", ".join(str(directory) for directory in self.search_dirs)
            raise SampleError(f"missing media: {name!r} not found (looked in {looked})")
        if len(found) > 1:
            raise SampleError(f"ambiguous media: {name!r} matches {', '.join(str(path) for path in found)}")
        path = next(iter(found))
        return ResolvedMedia(name, str(path), self._key(path))

    def same_stem_media(self) -> list[ResolvedMedia]:
        if self.stem_of is None:
            return []
        matches = sorted(
            path
            for path in self.stem_of.parent.glob(f"{self.stem_of.stem}.*")
            if path.suffix.lower().lstrip(".") in MEDIA_EXTENSIONS and path.is_file()
        )
        if len(matches) > 1:
            names = ", ".join(path.name for path in matches)
            raise SampleError(f"ambiguous media: {self.stem_of.name} names no media and several files share its stem ({names})")
        return [ResolvedMedia(path.name, str(path.resolve()), self._key(path.resolve())) for path in matches]


class TarSampleResolver:
    """Resolves names among the members of one WebDataset sample inside a tar."""

    def __init__(self, source: str, tar_path: Path, shard_key: str, key: str, members: dict[str, tuple[int, int]]) -> None:
        self.source = source
        self.tar_path = tar_path
        self.shard_key = shard_key
        self.key = key
        self.members = members  # member name -> (data offset, size)

    def _resolved(self, name: str, member: str) -> ResolvedMedia:
        offset, size = self.members[member]
        return ResolvedMedia(name, tar_member_ref(self.tar_path, offset, size), f"{self.source}/{self.shard_key}/{member}")

    def resolve(self, name: str) -> ResolvedMedia:
        candidates = {member for member in self.members if member in (name, f"{self.key}.{name}")}
        if not candidates:
            candidates = {member for member in self.members if member.rsplit("/", 1)[-1] == name.rsplit("/", 1)[-1]}
        if not candidates:
            raise SampleError(f"missing media: {name!r} is not a member of sample {self.key!r} in {self.tar_path}")
        if len(candidates) > 1:
            raise SampleError(f"ambiguous media: {name!r} matches members {sorted(candidates)} in {self.tar_path}")
        return self._resolved(name, candidates.pop())

    def same_stem_media(self) -> list[ResolvedMedia]:
        media = [member for member in sorted(self.members) if _member_extension(member) in MEDIA_EXTENSIONS]
        return [self._resolved(member.rsplit("/", 1)[-1], member) for member in media]


def _member_extension(member: str) -> str:
    base = member.rsplit("/", 1)[-1]
    return base.rsplit(".", 1)[-1].lower() if "." in base else ""


def read_source(source: SourceConfig) -> Iterator[RawRecord]:
    if not source.path.exists():
        raise FileNotFoundError(f"source {source.name!r}: {source.path} does not exist")
    readers = {"flat_dir": _read_flat_dir, "jsonl": _read_jsonl, "wds": _read_wds}
    yield from readers[source.kind](source)


def _read_flat_dir(source: SourceConfig) -> Iterator[RawRecord]:
    root = source.path.resolve()
    paths = sorted(
        path for path in root.rglob("*.json") if not any(part.startswith(".") for part in path.relative_to(root).parts)
    )
    for path in paths:
        relative = path.relative_to(root).as_posix()
        resolver = FileResolver(source.name, source.media_root, [path.parent, root], stem_of=path)
        sample_id = f"{source.name}/{relative}"
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            yield RawRecord(sample_id, str(path), None, resolver, f"malformed JSON in {path}: {error}")
            continue
        yield RawRecord(sample_id, str(path), record, resolver)


def _read_jsonl(source: SourceConfig) -> Iterator[RawRecord]:
    path = source.path.resolve()
    resolver = FileResolver(source.name, source.media_root, [source.media_root])
    text = path.read_text(encoding="utf-8")
    entries: list[tuple[str, Any, str]] = []  # (origin, record, error)
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"malformed JSON array in {path}: {error}") from error
        entries = [(f"{path}[{index}]", record, "") for index, record in enumerate(records)]
    else:
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entries.append((f"{path}:{number}", json.loads(line), ""))
            except json.JSONDecodeError as error:
                entries.append((f"{path}:{number}", None, f"malformed JSON at {path}:{number}: {error}"))
    ids = [record.get("id") if isinstance(record, dict) else None for _origin, record, _error in entries]
    use_ids = all(isinstance(value, (str, int)) and not isinstance(value, bool) for value in ids) and len(
        {str(value) for value in ids}
    ) == len(ids)
    for number, ((origin, record, error), record_id) in enumerate(zip(entries, ids), start=1):
        sample_id = f"{source.name}/{record_id if use_ids else number}"
        yield RawRecord(sample_id, origin, record, resolver, error)


def _read_wds(source: SourceConfig) -> Iterator[RawRecord]:
    root = source.path.resolve()
    shards = [root] if root.is_file() else sorted(path for path in root.rglob("*") if path.is_file() and _is_shard(path))
    for shard in shards:
        shard_key = shard.relative_to(root).as_posix() if root.is_dir() else shard.name
        if not shard.name.endswith(".tar"):
            yield RawRecord(
                f"{source.name}/{shard_key}", str(shard), None, FileResolver(source.name, root, [root]),
                f"compressed shard {shard} cannot be read in place; store shards as plain .tar",
            )
            continue
        yield from _read_tar_samples(source, shard, shard_key)


def _is_shard(path: Path) -> bool:
    return path.name.endswith((".tar", ".tgz", ".tar.gz"))


def _read_tar_samples(source: SourceConfig, shard: Path, shard_key: str) -> Iterator[RawRecord]:
    groups: dict[str, dict[str, tuple[int, int]]] = {}
    try:
        with tarfile.open(shard, "r:") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                directory, _, base = member.name.rpartition("/")
                key = (f"{directory}/" if directory else "") + base.split(".", 1)[0]
                groups.setdefault(key, {})[member.name] = (member.offset_data, member.size)
    except (tarfile.TarError, OSError) as error:
        yield RawRecord(
            f"{source.name}/{shard_key}", str(shard), None, FileResolver(source.name, shard.parent, [shard.parent]),
            f"unreadable tar shard {shard}: {error}",
        )
        return
    for key, members in groups.items():
        resolver = TarSampleResolver(source.name, shard, shard_key, key, members)
        sample_id = f"{source.name}/{key}"
        origin = f"{shard}:{key}"
        json_members = [name for name in members if _member_extension(name) == "json"]
        text_members = [name for name in members if _member_extension(name) in TEXT_MEMBER_EXTENSIONS]
        if json_members:
            offset, size = members[json_members[0]]
            with open(shard, "rb") as handle:
                handle.seek(offset)
                payload = handle.read(size)
            try:
                record = json.loads(payload.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                yield RawRecord(sample_id, origin, None, resolver, f"malformed JSON in {origin}: {error}")
                continue
            yield RawRecord(sample_id, origin, record, resolver)
        elif text_members:
            offset, size = members[text_members[0]]
            with open(shard, "rb") as handle:
                handle.seek(offset)
                caption = handle.read(size).decode("utf-8", errors="replace").strip()
            yield RawRecord(sample_id, origin, {"texts": caption}, resolver)
        else:
            yield RawRecord(sample_id, origin, None, resolver, f"no .json or caption member for sample {key!r} in {shard}")
