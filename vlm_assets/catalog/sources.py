"""Readers for the three input kinds (docs/formats.md, Inputs): each yields raw records with a media resolver.

Media names resolve to exactly one file (or tar member); anything else is a
reject reason, never a guess. Nothing outside a source's scope (its own
directory, its media root and its `allowed_roots`, compared by real path) is
read: a record naming such a file, or reaching it through a symlink anywhere
in the chain, is rejected with the path named. Every input record becomes
exactly one raw record (ok or carrying its reject reason), so the catalogue
accounts for all of them.
"""

from __future__ import annotations

import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from vlm_assets.catalog.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, tar_member_ref
from vlm_assets.catalog.messages import SampleError
from vlm_assets.catalog.records import RecordLimits, array_elements, is_json_array, parse_bytes
from vlm_assets.config import SourceConfig

MEDIA_EXTENSIONS = IMAGE_EXTENSIONS | VIDEO_EXTENSIONS
TEXT_MEMBER_EXTENSIONS = ("txt", "caption")
_REMOTE_PREFIXES = ("http://", "https://", "s3://")


@dataclass(frozen=True)
class ResolvedMedia:
    name: str
    ref: str
    key: str


class MediaResolver(Protocol):
    def resolve(self, name: str) -> ResolvedMedia: ...

    def same_stem_media(self) -> list[ResolvedMedia]: ...

    def listed_media_names(self) -> list[str]:
        """Media beside the record that are already known without touching the disk (a hint of its work)."""
        ...


@dataclass
class RawRecord:
    sample_id: str
    origin: str
    record: Any
    resolver: MediaResolver
    error: str = ""


def _real(path: str | os.PathLike[str]) -> Path:
    # os.path.realpath, not Path.resolve: a symlink loop must become a missing file, not a RuntimeError.
    return Path(os.path.realpath(path))


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # e.g. a name too long for the filesystem: no such file
        return False


class SourceScope:
    """The directories a source may read, as real paths: its own, its media root, its allowed roots."""

    def __init__(self, source: SourceConfig) -> None:
        # A jsonl source's own directory is its media root (by default the file's directory).
        own = [] if source.kind == "jsonl" else [source.path]
        self.media_root = _real(source.media_root)
        self.roots = tuple(dict.fromkeys(_real(root) for root in [*own, source.media_root, *source.allowed_roots]))

    def contains(self, real: Path) -> bool:
        return any(real.is_relative_to(root) for root in self.roots)

    def describe(self) -> str:
        return ", ".join(str(root) for root in self.roots)

    def escape_reason(self, what: str, real: Path) -> str:
        return (f"{what} escapes the source: it resolves to {real}, outside {self.describe()} "
                "(add a directory to the source's allowed_roots to read media from it)")


class FileResolver:
    """Resolves names against directories on disk, keyed relative to the media root."""

    def __init__(
        self, source: str, scope: SourceScope, search_dirs: list[Path], stem_of: Path | None = None,
        stem_folder: list[str] | None = None,
    ) -> None:
        """`stem_folder`: the names in `stem_of`'s folder, when already listed (else it is listed here)."""
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
        real = _real(path)
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
                real_directory = _real(directory)
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
        return candidate, _is_file(candidate)

    def resolve(self, name: str) -> ResolvedMedia:
        if name.startswith(_REMOTE_PREFIXES):
            raise SampleError(f"remote media {name!r} is not supported (no network): download it first")
        if "\x00" in name:
            raise SampleError(f"media name {name!r} contains a NUL character")
        as_path = Path(name)
        if as_path.is_absolute():
            real = self._checked(name, as_path)
            if not _is_file(real):
                raise SampleError(f"missing media: {name} does not exist")
            return ResolvedMedia(name, str(real), self._key(real))
        found: dict[Path, None] = {}
        for directory in self.search_dirs:
            candidate, is_file = self._located(name, directory, as_path)
            if is_file:
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
        matches = [(path, real) for path in candidates if _is_file(real := self._checked(path.name, path))]
        if len(matches) > 1:
            names = ", ".join(path.name for path, _real_path in matches)
            raise SampleError(f"ambiguous media: {self.stem_of.name} names no media and several files share its stem ({names})")
        return [ResolvedMedia(path.name, str(real), self._key(real)) for path, real in matches]


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

    def __init__(self, source: str, tar_path: Path, shard_key: str, sample: TarSample) -> None:
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

    def _located(self, name: str, directory: Path, as_path: Path) -> tuple[Path, bool]:
        """(real path of `directory`/`name`, whether it is a file).

        A plain file name in a directory already resolved costs one lstat instead of one per path
        component: a source's reader resolves every media file it names.
        """
        if len(as_path.parts) == 1 and name not in (".", ".."):
            if directory not in self._real_directories:
                real_directory = _real(directory)
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
        return candidate, _is_file(candidate)

    def resolve(self, name: str) -> ResolvedMedia:
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
        media = [member for member in sorted([*self.members, *self.others]) if _member_extension(member) in MEDIA_EXTENSIONS]
        return [self._resolved(member.rsplit("/", 1)[-1], member) for member in media]


def _member_extension(member: str) -> str:
    base = member.rsplit("/", 1)[-1]
    return base.rsplit(".", 1)[-1].lower() if "." in base else ""


def read_source(source: SourceConfig) -> Iterator[RawRecord]:
    if not source.path.exists():
        raise FileNotFoundError(f"source {source.name!r}: {source.path} does not exist")
    readers = {"flat_dir": _read_flat_dir, "jsonl": _read_jsonl, "wds": _read_wds}
    yield from readers[source.kind](source, SourceScope(source), RecordLimits.of(source))


@dataclass(frozen=True)
class _Entry:
    """A file found below a source directory (`path` as reached, `real` its real path), or a reason not to read one."""

    path: Path
    real: Path
    refused: str = ""
    special: bool = False  # exists but is not a regular file (a FIFO, a device, a socket)


class _Walk:
    """Files below `root` whose name is `wanted`, sorted by path; names starting with "." are skipped.

    A symlinked folder is followed when its real path stays inside the source's scope and was not
    read already; otherwise it becomes a refused entry saying why (so nothing below it is silently
    missing). A file reached twice (through links) is read once, preferably where it lies; its
    other paths become refused entries. A file whose real path is outside the scope, or that is
    not a regular file, is refused too. `listings` keeps each folder's names (for same-stem media).
    """

    def __init__(self, root: Path, scope: SourceScope, wanted: Callable[[str], bool]) -> None:
        self.scope = scope
        self.wanted = wanted
        self.listings: dict[Path, list[str]] = {}
        self._visited: dict[Path, Path] = {}  # real folder -> the path it was read at
        self._found: list[_Entry] = []
        pending: list[tuple[Path, Path]] = [(root, _real(root))]  # (path as reached, real path)
        links: list[Path] = []  # symlinked folders, followed once every plain folder is read
        self._visited[pending[0][1]] = root
        while pending or links:
            if pending:
                self._read_folder(*pending.pop(), pending, links)
                continue
            link = links.pop(0)
            real = _real(link)
            if not scope.contains(real):
                self._refuse(link, real, f"symlinked folder {link} leads outside the source: it resolves to {real}, "
                             f"outside {scope.describe()}; not searched for samples (add it to the source's "
                             "allowed_roots to read it)")
            elif real in self._visited:
                self._refuse(link, real, f"symlinked folder {link} is {self._visited[real]} again (to {real}; a link "
                             "loop or a second link to one folder): its samples are read once, there")
            else:
                self._visited[real] = link
                pending.append((link, real))

    def _refuse(self, path: Path, real: Path, reason: str) -> None:
        self._found.append(_Entry(path, real, reason))

    def _read_folder(self, folder: Path, real: Path, pending: list[tuple[Path, Path]], links: list[Path]) -> None:
        try:
            with os.scandir(folder) as iterator:
                entries = sorted(iterator, key=lambda entry: entry.name)
        except OSError as error:
            self._refuse(folder, real, f"unreadable folder {folder}: {error}")
            return
        self.listings[folder] = [entry.name for entry in entries]
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = folder / entry.name
            link = _is_link(entry)
            if _is_dir(entry):
                if link:
                    links.append(path)
                elif real / entry.name in self._visited:  # below a followed link, already read at another path
                    self._refuse(path, real / entry.name, f"folder {path} is {self._visited[real / entry.name]} again "
                                 "(reached through a symlinked folder): its samples are read once, there")
                else:
                    self._visited[real / entry.name] = path
                    pending.append((path, real / entry.name))
            elif self.wanted(entry.name):
                if link:
                    target = _real(path)
                    self._found.append(_Entry(path, target, special=target.exists() and not _is_file(target)))
                else:
                    self._found.append(_Entry(path, real / entry.name, special=not _is_regular(entry)))
        links.sort()

    def entries(self) -> list[_Entry]:
        first: dict[Path, Path] = {}
        # A file reached at several paths is read at its own path if the walk got there, else at the first.
        for entry in sorted(self._found, key=lambda entry: (entry.path != entry.real, entry.path)):
            if not entry.refused and self.scope.contains(entry.real):
                first.setdefault(entry.real, entry.path)
        result = []
        for entry in sorted(self._found, key=lambda entry: entry.path):
            if entry.refused:
                result.append(entry)
            elif not self.scope.contains(entry.real):
                result.append(_Entry(entry.path, entry.real, self.scope.escape_reason(f"file {entry.path}", entry.real)))
            elif entry.special:
                result.append(_Entry(entry.path, entry.real, f"{entry.path} is not a regular file"))
            elif first[entry.real] != entry.path:
                result.append(_Entry(entry.path, entry.real, (
                    f"file {entry.path} is {first[entry.real]} again (through a symlink): read once, there")))
            else:
                result.append(entry)
        return result


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _is_link(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_symlink()
    except OSError:
        return False


def _is_regular(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file(follow_symlinks=False)
    except OSError:
        return False


def _read_file(path: Path, limits: RecordLimits) -> tuple[bytes | None, str]:
    """The bytes of a record file, or the reason it cannot be read (too large: refused unread)."""
    try:
        size = path.stat().st_size
        error = limits.too_large(size, str(path))
        if error:
            return None, error
        with open(path, "rb") as handle:
            return handle.read(limits.max_bytes + 1), ""
    except OSError as error:
        return None, f"unreadable record file {path}: {error}"


def _read_flat_dir(source: SourceConfig, scope: SourceScope, limits: RecordLimits) -> Iterator[RawRecord]:
    root = _real(source.path)
    walk = _Walk(root, scope, lambda name: name.endswith(".json"))
    for entry in walk.entries():
        relative = entry.path.relative_to(root).as_posix()
        resolver = FileResolver(source.name, scope, [entry.path.parent, root], entry.path, walk.listings.get(entry.path.parent))
        sample_id = f"{source.name}/{relative}"
        if entry.refused:
            yield RawRecord(sample_id, str(entry.path), None, resolver, entry.refused)
            continue
        data, error = _read_file(entry.path, limits)
        record, error = (None, error) if data is None else parse_bytes(data, str(entry.path), limits)
        yield RawRecord(sample_id, str(entry.path), record, resolver, error)


def _jsonl_lines(path: Path, limits: RecordLimits) -> Iterator[tuple[int, bytes | None, str]]:
    """(line number, line, "") for each non-blank line, or (number, None, reason) for one over the limit."""
    with open(path, "rb") as handle:
        number = 0
        while True:
            line = handle.readline(limits.max_bytes + 1)
            if not line:
                return
            number += 1
            if len(line) > limits.max_bytes and not line.endswith(b"\n"):
                size = len(line)
                while line and not line.endswith(b"\n"):  # skip the rest of the line unread
                    line = handle.readline(1 << 20)
                    size += len(line)
                size -= line.endswith(b"\n")
                yield number, None, limits.too_large(size, f"{path}:{number}")
                continue
            line = line.rstrip(b"\r\n")
            if line.strip():
                yield number, line, ""


Entry = tuple[str, str, Any, str]  # (origin, locator, record, reason it is unreadable or "")


def _array_entries(path: Path, limits: RecordLimits) -> Iterator[Entry]:
    for element in array_elements(path.read_bytes(), str(path), limits):
        yield f"{path}[{element.index}]", f"element-{element.index}", element.record, element.error


def _jsonl_entries(path: Path, limits: RecordLimits) -> Iterator[Entry]:
    for number, line, error in _jsonl_lines(path, limits):
        origin = f"{path}:{number}"
        record, error = (None, error) if line is None else parse_bytes(line, origin, limits)
        yield origin, f"line-{number}", record, error


def _read_jsonl(source: SourceConfig, scope: SourceScope, limits: RecordLimits) -> Iterator[RawRecord]:
    path = _real(source.path)
    resolver = FileResolver(source.name, scope, [scope.media_root])
    with open(path, "rb") as handle:
        head = handle.read(4096)
    if is_json_array(head):
        elements = list(_array_entries(path, limits))
        id_pass, entries = elements, elements
    else:
        # JSON lines are read twice rather than held: a source of millions of lines needs no more
        # memory than one line.
        id_pass, entries = _jsonl_entries(path, limits), _jsonl_entries(path, limits)
    # Record ids when every object record has one (a repeated id is then a rejected duplicate, see
    # build.py; never renumbered); records that are not objects are named by where they are.
    has_objects, all_have_ids = False, True
    for _origin, _locator, record, _error in id_pass:
        if isinstance(record, dict):
            has_objects = True
            if not _usable_id(record.get("id")):
                all_have_ids = False
                break
    use_ids = has_objects and all_have_ids
    for number, (origin, locator, record, error) in enumerate(entries, start=1):
        if use_ids:
            local_id = record["id"] if isinstance(record, dict) else locator
        else:
            local_id = number
        yield RawRecord(f"{source.name}/{local_id}", origin, record, resolver, error)


def _usable_id(value: Any) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def _read_wds(source: SourceConfig, scope: SourceScope, limits: RecordLimits) -> Iterator[RawRecord]:
    root = _real(source.path)
    if root.is_file():
        shards = [_Entry(root, root)]
    else:
        shards = _Walk(root, scope, _is_shard).entries()
    for shard in shards:
        shard_key = shard.path.relative_to(root).as_posix() if root.is_dir() else shard.path.name
        resolver = FileResolver(source.name, scope, [root])
        if shard.refused:
            yield RawRecord(f"{source.name}/{shard_key}", str(shard.path), None, resolver, shard.refused)
        elif not shard.path.name.endswith(".tar"):
            yield RawRecord(
                f"{source.name}/{shard_key}", str(shard.path), None, resolver,
                f"compressed shard {shard.path} cannot be read in place; store shards as plain .tar",
            )
        else:
            yield from _read_tar_samples(source, shard.real, shard_key, limits, resolver)


def _is_shard(name: str) -> bool:
    return name.endswith((".tar", ".tgz", ".tar.gz"))


def _tar_samples(shard: Path) -> tuple[list[TarSample], str]:
    """The shard's samples in member order, and why reading stopped early ("" when it did not).

    Members group by directory + basename up to the first "."; a member name seen again in a key's
    sample starts a new sample with that key (so a repeated key is seen, not merged away).
    """
    samples: list[TarSample] = []
    latest: dict[str, TarSample] = {}
    try:
        with tarfile.open(shard, "r:") as archive:
            for member in archive:
                if member.isdir():
                    continue
                directory, _, base = member.name.rpartition("/")
                key = (f"{directory}/" if directory else "") + base.split(".", 1)[0]
                sample = latest.get(key)
                if sample is None or sample.holds(member.name):
                    sample = TarSample(key, 1 if sample is None else sample.occurrence + 1)
                    latest[key] = sample
                    samples.append(sample)
                if member.isfile():
                    sample.members[member.name] = (member.offset_data, member.size)
                else:
                    sample.others[member.name] = _member_kind(member)
            end = archive.offset
        return samples, _unread_tail(shard, end)
    except (tarfile.TarError, OSError) as error:
        return samples, f"unreadable tar shard {shard}: {error}"


def _unread_tail(shard: Path, end: int) -> str:
    """Why the shard holds more than tarfile read (it stops quietly at a cut header), or ""."""
    size = shard.stat().st_size
    if end > size:
        return f"unreadable tar shard {shard}: truncated (its members run to byte {end}, the file has {size})"
    with open(shard, "rb") as handle:
        handle.seek(end)
        while chunk := handle.read(1 << 20):
            if chunk.strip(b"\0"):
                return (f"unreadable tar shard {shard}: damaged or truncated after byte {end} "
                        "(what follows is not a tar member; the samples there cannot be read)")
    return ""


def _member_kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return f"a symbolic link to {member.linkname!r}"
    if member.islnk():
        return f"a hard link to {member.linkname!r}"
    return "not a regular file"


def _read_member(shard: Path, offset: int, size: int) -> bytes:
    with open(shard, "rb") as handle:
        handle.seek(offset)
        data = handle.read(size)
    if len(data) != size:
        raise OSError(f"member data is truncated ({len(data)} of {size} bytes)")
    return data


def _read_tar_samples(
    source: SourceConfig, shard: Path, shard_key: str, limits: RecordLimits, shard_resolver: FileResolver
) -> Iterator[RawRecord]:
    samples, stopped = _tar_samples(shard)
    for sample in samples:
        key, members = sample.key, sample.members
        resolver = TarSampleResolver(source.name, shard, shard_key, sample)
        sample_id = f"{source.name}/{key}"
        origin = f"{shard}:{key}" + (f"#{sample.occurrence}" if sample.occurrence > 1 else "")
        json_members = [name for name in members if _member_extension(name) == "json"]
        text_members = [name for name in members if _member_extension(name) in TEXT_MEMBER_EXTENSIONS]
        chosen = (json_members or text_members or [None])[0]
        if chosen is None:
            yield RawRecord(sample_id, origin, None, resolver, f"no .json or caption member for sample {key!r} in {shard}")
            continue
        offset, size = members[chosen]
        where = f"{shard}:{chosen}"
        error = limits.too_large(size, where)
        if error:
            yield RawRecord(sample_id, origin, None, resolver, error)
            continue
        try:
            payload = _read_member(shard, offset, size)
        except OSError as read_error:
            yield RawRecord(sample_id, origin, None, resolver, f"unreadable member {where}: {read_error}")
            continue
        if json_members:
            record, error = parse_bytes(payload, where, limits)
        else:
            record, error = {"texts": payload.decode("utf-8", errors="replace").strip()}, ""
        yield RawRecord(sample_id, origin, record, resolver, error)
    if stopped:
        # Samples after the damage cannot be told apart: one row stands for the rest of the shard.
        yield RawRecord(f"{source.name}/{shard_key}", str(shard), None, shard_resolver, stopped)
