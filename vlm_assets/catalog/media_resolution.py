"""Media names in a record resolved to files or tar members, never outside the source's scope.

A name resolves to exactly one file (or tar member); anything else is a reject reason, never a
guess. Nothing outside a source's scope (its own directory, its media root and its
`allowed_roots`, compared by real path) is read: a record naming such a file, or reaching it
through a symlink anywhere in the chain, is rejected with the path named.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from vlm_assets.media.refs import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, fetch_object, pinned_object_ref, tar_member_ref
from vlm_assets.catalog.messages import SampleError
from vlm_assets.config import SourceConfig
from vlm_assets.object_store import URL_SCHEME, ObjectInfo, ObjectURL, head

MEDIA_EXTENSIONS = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS
_REMOTE_PREFIXES = ("http://", "https://", "s3://")


@dataclass(frozen=True)
class ResolvedMedia:
    name: str
    ref: str
    key: str


class MediaResolver(Protocol):
    def resolve(self, name: str, fetch: bool = False) -> ResolvedMedia:
        """`fetch`: the medium is read right after (its check), so an object may be read now, instead
        of only asked whether it exists (one request instead of two)."""
        ...

    def same_stem_media(self) -> list[ResolvedMedia]: ...

    def listed_media_names(self) -> list[str]:
        """Media beside the record that are already known without touching the disk (a hint of its work)."""
        ...


def real_path(path: str | os.PathLike[str]) -> Path:
    # os.path.realpath, not Path.resolve: a symlink loop must become a missing file, not a RuntimeError.
    return Path(os.path.realpath(path))


def is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # e.g. a name too long for the filesystem: no such file
        return False


class SourceScope:
    """The directories a source may read, as real paths: its own, its media root, its allowed roots."""

    def __init__(self, source: SourceConfig) -> None:
        # A jsonl source's own directory is its media root (by default the file's directory).
        own = [] if source.kind == "jsonl" else [source.path]
        self.object_roots: tuple[ObjectURL, ...] = ()
        if isinstance(source.media_root, ObjectURL):
            self.object_media_root = source.media_root
            self.object_roots = tuple(dict.fromkeys(
                root for root in [*own, source.media_root, *source.allowed_roots] if isinstance(root, ObjectURL)))
            return
        self.media_root = real_path(source.media_root)
        self.roots = tuple(dict.fromkeys(real_path(root) for root in [*own, source.media_root, *source.allowed_roots]))

    def contains(self, real: Path) -> bool:
        return any(real.is_relative_to(root) for root in self.roots)

    def contains_object(self, url: ObjectURL) -> bool:
        return any(root.contains(url) for root in self.object_roots)

    def describe(self) -> str:
        return ", ".join(str(root) for root in self.object_roots or self.roots)

    def escape_reason(self, what: str, real: Path | ObjectURL) -> str:
        return (f"{what} escapes the source: it resolves to {real}, outside {self.describe()} "
                "(add a directory to the source's allowed_roots to read media from it)")


class FileResolver:
    """Resolves names against directories on disk, keyed relative to the media root."""

    def __init__(
        self, source: str, scope: SourceScope, search_dirs: list[Path], stem_of: Path | None = None,
        stem_folder: list[str] | None = None,
    ) -> None:
        """`stem_folder`: the names in `stem_of`'s folder, when already listed (else it is listed here);
        those starting with its stem and a dot are enough (the only ones same-stem media are taken from)."""
        self.source = source
        self.scope = scope
        self.search_dirs = list(dict.fromkeys(search_dirs))
        self.stem_of = stem_of
        self.stem_folder = stem_folder
        self._real_directories: dict[Path, tuple[Path, bool]] = {}  # -> (real path, inside the scope)

    def _key(self, path: Path) -> str:
        try:
            return f"{self.source}/{path.relative_to(self.scope.media_root).as_posix()}"
        except ValueError:
            return f"{self.source}/{path.as_posix().lstrip('/')}"

    def _checked(self, name: str, path: Path) -> Path:
        real = real_path(path)
        if not self.scope.contains(real):
            raise SampleError(self.scope.escape_reason(f"media path {name!r}", real))
        return real

    def _located(self, name: str, directory: Path, as_path: Path) -> tuple[Path, bool]:
        """(real path of `directory`/`name`, whether it is a file).

        A plain file name in a directory already resolved costs one lstat instead of one per path
        component: a source's reader resolves every media file it names.
        """
        if len(as_path.parts) == 1 and name not in (".", ".."):
            if directory not in self._real_directories:
                real_directory = real_path(directory)
                self._real_directories[directory] = (real_directory, self.scope.contains(real_directory))
            real_directory, in_scope = self._real_directories[directory]
            real = real_directory / name
            try:
                mode: int | None = os.lstat(real).st_mode
            except OSError:
                mode = None  # missing (or unreadable): the caller names it
            if mode is None or not stat.S_ISLNK(mode):
                if not (in_scope or self.scope.contains(real)):
                    raise SampleError(self.scope.escape_reason(f"media path {name!r}", real))
                return real, mode is not None and stat.S_ISREG(mode)
        candidate = self._checked(name, directory / as_path)
        return candidate, is_file(candidate)

    def resolve(self, name: str, fetch: bool = False) -> ResolvedMedia:
        if name.startswith(_REMOTE_PREFIXES):
            raise SampleError(f"remote media {name!r} is not supported (no network): download it first")
        if "\x00" in name:
            raise SampleError(f"media name {name!r} contains a NUL character")
        as_path = Path(name)
        if as_path.is_absolute():
            real = self._checked(name, as_path)
            if not is_file(real):
                raise SampleError(f"missing media: {name} does not exist")
            return ResolvedMedia(name, str(real), self._key(real))
        found: dict[Path, None] = {}
        for directory in self.search_dirs:
            candidate, found_file = self._located(name, directory, as_path)
            if found_file:
                found[candidate] = None
        if not found:
            looked = ", ".join(str(directory) for directory in self.search_dirs)
            raise SampleError(f"missing media: {name!r} not found (looked in {looked})")
        if len(found) > 1:
            raise SampleError(f"ambiguous media: {name!r} matches {', '.join(str(path) for path in found)}")
        path = next(iter(found))
        return ResolvedMedia(name, str(path), self._key(path))

    def listed_media_names(self) -> list[str]:
        if self.stem_of is None or self.stem_folder is None:
            return []
        prefix = f"{self.stem_of.stem}."
        return [name for name in self.stem_folder if name.startswith(prefix) and name != self.stem_of.name]

    def same_stem_media(self) -> list[ResolvedMedia]:
        if self.stem_of is None:
            return []
        folder = self.stem_of.parent
        names = self.stem_folder if self.stem_folder is not None else sorted(os.listdir(folder))
        prefix = f"{self.stem_of.stem}."
        candidates = [
            folder / name for name in names
            if name.startswith(prefix) and name.rsplit(".", 1)[-1].lower() in MEDIA_EXTENSIONS
        ]
        matches = [(path, real) for path in candidates if is_file(real := self._checked(path.name, path))]
        if len(matches) > 1:
            names = ", ".join(path.name for path, _real_path in matches)
            raise SampleError(f"ambiguous media: {self.stem_of.name} names no media and several files share its stem ({names})")
        return [ResolvedMedia(path.name, str(real), self._key(real)) for path, real in matches]


class ObjectResolver:
    """Resolves names among objects: a name is a key relative to each of `search_dirs` (by default
    the source's media root), or an s3:// URL; each candidate is checked to stay within the source's
    prefixes before any request, and proven to exist by one HEAD request. As on disk, a name must
    match exactly one object. `stem_of`, `stem_names`: a flat_dir record file and the names in its
    folder that start with its stem and a dot (for same-stem media)."""

    def __init__(self, source: str, scope: SourceScope, search_dirs: list[ObjectURL] | None = None,
                 stem_of: ObjectURL | None = None, stem_names: list[str] | None = None) -> None:
        self.source = source
        self.scope = scope
        self.media_root = scope.object_media_root
        self.search_dirs = list(dict.fromkeys(search_dirs or [self.media_root]))
        self.stem_of = stem_of
        self.stem_names = stem_names or []

    def _checked(self, name: str, target: ObjectURL | None, directory: ObjectURL) -> ObjectURL:
        if target is None or not self.scope.contains_object(target):
            where = target if target is not None else f"{directory}/{name} (above the bucket)"
            raise SampleError(self.scope.escape_reason(f"media path {name!r}", where))
        return target

    def _resolved(self, name: str, target: ObjectURL, info: ObjectInfo | None = None) -> ResolvedMedia:
        """`info`: the object's HEAD, which pins the ref to the version found (later steps read that one)."""
        if self.media_root.contains(target):
            key = f"{self.source}/{self.media_root.relative(target)}"
        else:
            key = f"{self.source}/{target.key}"
        return ResolvedMedia(name, pinned_object_ref(target, info.size, info.etag) if info else str(target), key)

    def resolve(self, name: str, fetch: bool = False) -> ResolvedMedia:
        if "\x00" in name:
            raise SampleError(f"media name {name!r} contains a NUL character")
        # An image is small: read whole, it is found and checked in one request. A video is asked for.
        found = fetch_object if fetch and name.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS else head
        if name.startswith(URL_SCHEME):
            try:
                target = self._checked(name, ObjectURL.parse(name), self.media_root)
            except ValueError as error:
                raise SampleError(f"media name {name!r}: {error}") from error
            info = found(target)
            if info is None:
                raise SampleError(f"missing media: {name!r} not found (looked for {target})")
            return self._resolved(name, target, info)
        if name.startswith(_REMOTE_PREFIXES):
            raise SampleError(f"remote media {name!r} is not supported (no network): copy it below the source's media_root")
        if name.startswith("/"):
            raise SampleError(f"media name {name!r} is an absolute path; a source on object storage names its media "
                              f"by their keys relative to its media_root ({self.media_root})")
        candidates = [
            self._checked(name, ObjectURL(directory.bucket, "").child(f"{directory.key}/{name}" if directory.key else name),
                          directory)
            for directory in self.search_dirs
        ]
        # Among several places, each is asked (a name must match one object only).
        places = list(dict.fromkeys(candidates))
        infos = [info for info in map(found if len(places) == 1 else head, places) if info is not None]
        if not infos:
            looked = ", ".join(str(directory) for directory in self.search_dirs)
            raise SampleError(f"missing media: {name!r} not found (looked in {looked})")
        if len(infos) > 1:
            raise SampleError(f"ambiguous media: {name!r} matches {', '.join(str(info.url) for info in infos)}")
        return self._resolved(name, infos[0].url, infos[0])

    def listed_media_names(self) -> list[str]:
        if self.stem_of is None:
            return []
        return [name for name in self.stem_names if name != self.stem_of.name]

    def same_stem_media(self) -> list[ResolvedMedia]:
        if self.stem_of is None:
            return []
        folder = self.stem_of.parent
        names = [name for name in self.listed_media_names() if name.rsplit(".", 1)[-1].lower() in MEDIA_EXTENSIONS]
        if len(names) > 1:
            raise SampleError(f"ambiguous media: {self.stem_of.name} names no media and several files share its stem "
                              f"({', '.join(names)})")
        return [self._resolved(name, ObjectURL(folder.bucket, f"{folder.key}/{name}" if folder.key else name))
                for name in names]


def resolver_for(source: str, scope: SourceScope) -> FileResolver | ObjectResolver:
    """The resolver of a jsonl source's record: names below its media root, on disk or on object storage."""
    if scope.object_roots:
        return ObjectResolver(source, scope)
    return FileResolver(source, scope, [scope.media_root])


@dataclass
class TarSample:
    """The members of one WebDataset sample: regular files by name (data offset, size), and the rest."""

    key: str
    occurrence: int  # 1 for the first sample with this key in the shard, 2 for a second one, ...
    members: dict[str, tuple[int, int]] = field(default_factory=dict)
    others: dict[str, str] = field(default_factory=dict)  # member name -> what it is (a link, a device, ...)

    def holds(self, name: str) -> bool:
        return name in self.members or name in self.others


class TarSampleResolver:
    """Resolves names among the members of one WebDataset sample inside a tar (never outside it)."""

    def __init__(self, source: str, tar_path: Path | ObjectURL, shard_key: str, sample: TarSample) -> None:
        self.source = source
        self.tar_path = tar_path
        self.shard_key = shard_key
        self.key = sample.key
        self.members = sample.members
        self.others = sample.others

    def _resolved(self, name: str, member: str) -> ResolvedMedia:
        if member in self.others:
            raise SampleError(f"tar member {member!r} in {self.tar_path} is {self.others[member]}: only regular "
                              "members are read (links inside a shard are never followed)")
        offset, size = self.members[member]
        return ResolvedMedia(name, tar_member_ref(self.tar_path, offset, size), f"{self.source}/{self.shard_key}/{member}")

    def resolve(self, name: str, fetch: bool = False) -> ResolvedMedia:
        names = [*self.members, *self.others]
        candidates = {member for member in names if member in (name, f"{self.key}.{name}")}
        if not candidates:
            candidates = {member for member in names if member.rsplit("/", 1)[-1] == name.rsplit("/", 1)[-1]}
        if not candidates:
            raise SampleError(f"missing media: {name!r} is not a member of sample {self.key!r} in {self.tar_path}")
        if len(candidates) > 1:
            raise SampleError(f"ambiguous media: {name!r} matches members {sorted(candidates)} in {self.tar_path}")
        return self._resolved(name, candidates.pop())

    def listed_media_names(self) -> list[str]:
        return list(self.members)

    def same_stem_media(self) -> list[ResolvedMedia]:
        media = [member for member in sorted([*self.members, *self.others]) if member_extension(member) in MEDIA_EXTENSIONS]
        return [self._resolved(member.rsplit("/", 1)[-1], member) for member in media]


def member_extension(member: str) -> str:
    """The lower-cased extension of a tar member's base name ("" when it has none)."""
    base = member.rsplit("/", 1)[-1]
    return base.rsplit(".", 1)[-1].lower() if "." in base else ""
