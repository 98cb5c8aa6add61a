"""Read a training package as a stream: its manifest, a full checksum verification, a safe extraction.

Nothing here seeks, so every operation is one sequential pass and `read_manifest`
stops after the first member. Extraction trusts nothing in the archive: a member
must be a regular file with a plain relative name that the manifest lists, and
files are written only below the target, never through a symlink found there,
and only once the whole package has checked out.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from vlm_assets.object_store import ObjectURL, location_of
from vlm_assets.package.compression import DecompressedStream, open_decompressed
from vlm_assets.package.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    PackageError,
    check_archive_path,
    parse_manifest,
)
from vlm_assets.wording import plural

_DATA_CHUNK = 1 << 20
_TAR_BUFFER = 1 << 16
_MAX_MANIFEST_BYTES = 256 << 20

Log = Callable[[str], None]


@dataclass(frozen=True)
class VerifyReport:
    path: Path
    manifest: Manifest
    checked_files: int
    checked_bytes: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


class PackageStream:
    """An open package positioned after its manifest; iterate `members()` once, then `finish()`."""

    def __init__(self, path: Path, stream: DecompressedStream, tar: tarfile.TarFile, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self._stream = stream
        self._tar = tar

    def members(self) -> Iterator[tarfile.TarInfo]:
        while True:
            try:
                member = self._tar.next()
            except tarfile.ReadError as error:
                raise PackageError(f"{self.path}: package is truncated or corrupt (tar: {error})") from error
            if member is None:
                return
            yield member

    def chunks(self, member: tarfile.TarInfo) -> Iterator[bytes]:
        return _member_chunks(self.path, self._tar, member)

    def finish(self) -> None:
        """Read the compressed stream to its end so a damaged tail is not missed."""
        self._stream.drain()


def _member_chunks(path: Path, tar: tarfile.TarFile, member: tarfile.TarInfo) -> Iterator[bytes]:
    reader = tar.extractfile(member)
    assert reader is not None, "only regular members are read"
    try:
        while chunk := reader.read(_DATA_CHUNK):
            yield chunk
    except tarfile.ReadError as error:
        raise PackageError(f"{path}: package is truncated or corrupt at {member.name} (tar: {error})") from error


def _open_tar_stream(path: Path, stream: DecompressedStream) -> tarfile.TarFile:
    try:
        return tarfile.open(fileobj=stream, mode="r|", bufsize=_TAR_BUFFER)  # type: ignore[call-overload]
    except tarfile.ReadError as error:
        raise PackageError(f"{path}: package is truncated or not a tar archive ({error})") from error


@contextlib.contextmanager
def open_package(path: str | os.PathLike[str] | ObjectURL) -> Iterator[PackageStream]:
    """The package at a path, or at an `s3://` URL (streamed with ranged reads, never downloaded whole)."""
    path = location_of(path)
    with open_decompressed(path) as stream, _open_tar_stream(path, stream) as tar:
        try:
            first = tar.next()
        except tarfile.ReadError as error:
            raise PackageError(f"{path}: package is truncated or not a tar archive ({error})") from error
        if first is None or first.name != MANIFEST_NAME:
            found = "nothing" if first is None else repr(first.name)
            raise PackageError(f"{path}: first member must be {MANIFEST_NAME}, found {found}")
        if not first.isreg() or first.size > _MAX_MANIFEST_BYTES:
            raise PackageError(f"{path}: {MANIFEST_NAME} is not a regular file of sane size")
        raw = b"".join(_member_chunks(path, tar, first))
        if len(raw) != first.size:
            raise PackageError(f"{path}: package is truncated inside {MANIFEST_NAME}")
        yield PackageStream(path, stream, tar, parse_manifest(raw, str(path)))


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest alone: decompresses only as far as the first member."""
    with open_package(path) as package:
        return package.manifest


def _member_problem(member: tarfile.TarInfo, expected: dict[str, FileEntry], seen: set[str]) -> str | None:
    """Why `member` may not be extracted, or None if it is a listed regular file."""
    try:
        check_archive_path(member.name)
    except PackageError as error:
        return str(error)
    if member.issym():
        return f"{member.name}: symbolic link (to {member.linkname!r}) is not allowed"
    if member.islnk():
        return f"{member.name}: hard link (to {member.linkname!r}) is not allowed"
    if member.ischr() or member.isblk():
        return f"{member.name}: device node is not allowed"
    if not member.isreg() or member.issparse():
        return f"{member.name}: not a regular file (tar type {member.type!r})"
    entry = expected.get(member.name)
    if entry is None:
        return f"{member.name}: not listed in the manifest"
    if member.name in seen:
        return f"{member.name}: appears twice in the archive"
    if member.size != entry.size:
        return f"{member.name}: size mismatch (manifest {entry.size}, archive {member.size})"
    return None


def _missing_problems(expected: dict[str, FileEntry], seen: set[str]) -> list[str]:
    missing = sorted(expected.keys() - seen)
    return [f"{name}: listed in the manifest but missing from the archive (truncated or incomplete package)" for name in missing]


def verify_package(path: str | os.PathLike[str], *, log: Log | None = None) -> VerifyReport:
    """Recompute every checksum; each problem in the report names the file it concerns.

    A cut or damaged compressed stream raises PackageError (nothing after it can be checked).
    """
    log = log or (lambda message: None)
    problems: list[str] = []
    checked_files = checked_bytes = 0
    with open_package(path) as package:
        expected = package.manifest.by_path()
        seen: set[str] = set()
        for member in package.members():
            problem = _member_problem(member, expected, seen)
            if problem:
                problems.append(problem)
                continue
            seen.add(member.name)
            digest = hashlib.sha256()
            for chunk in package.chunks(member):
                digest.update(chunk)
            entry = expected[member.name]
            if digest.hexdigest() != entry.sha256:
                problems.append(f"{member.name}: sha256 mismatch (manifest {entry.sha256[:16]}…, data {digest.hexdigest()[:16]}…)")
            checked_files += 1
            checked_bytes += member.size
        problems += _missing_problems(expected, seen)
        package.finish()
    log(f"verified {plural(checked_files, 'file')} ({checked_bytes / 1e6:.1f} MB): {len(problems)} problem(s)")
    return VerifyReport(location_of(path), package.manifest, checked_files, checked_bytes, tuple(problems))


class _Extraction:
    """Members staged under temporary names beside their destinations, and the folders created for them.

    Nothing the target already held changes until `commit`, so a failed extraction
    is undone by `discard`, which removes only what the extraction itself made.
    """

    def __init__(self) -> None:
        self.created_dirs: list[Path] = []
        self.staged: list[tuple[Path, Path]] = []  # (temporary file, destination)

    def open_target(self, target: Path, force: bool) -> Path:
        """Create `target` (and missing parents) or check that an existing one may be extracted into."""
        if target.is_dir():
            if not force and any(target.iterdir()):
                raise PackageError(
                    f"{target}: directory is not empty; pass --force to extract into it anyway "
                    "(files the package lists are replaced, nothing else is touched)"
                )
            return target.resolve()
        if os.path.lexists(target):
            raise PackageError(f"{target}: exists and is not a directory")
        missing = [target]
        while not missing[-1].parent.exists():
            missing.append(missing[-1].parent)
        for directory in reversed(missing):
            directory.mkdir()
            self.created_dirs.append(directory)
        return target.resolve()

    def _parent(self, root: Path, archive_path: str) -> Path:
        """Create the member's parent folders below `root`, refusing to pass through a symlink."""
        parent = root
        for part in archive_path.split("/")[:-1]:
            parent = parent / part
            if parent.is_symlink():
                raise PackageError(f"{archive_path}: refusing to write through symlink {parent}")
            if not parent.exists():
                parent.mkdir()
                self.created_dirs.append(parent)
            elif not parent.is_dir():
                raise PackageError(f"{archive_path}: {parent} exists and is not a directory")
        return parent

    def stage(self, package: PackageStream, member: tarfile.TarInfo, root: Path) -> str:
        """Write `member` to a new temporary file beside its destination; returns the data's sha256."""
        parent = self._parent(root, member.name)
        destination = parent / member.name.rsplit("/", 1)[-1]
        if destination.is_dir() and not destination.is_symlink():
            raise PackageError(f"{package.path}: cannot extract {member.name}: {destination} is a directory")
        digest = hashlib.sha256()
        try:
            # A fresh random name (`.<name>.<random>.tmp`, which packing skips) never clobbers a file already there.
            fd, name = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".tmp", dir=parent)
            self.staged.append((Path(name), destination))
            with os.fdopen(fd, "wb") as out:
                # mkstemp makes owner-only files; extracted data is for other users and tools too.
                os.fchmod(out.fileno(), 0o644)
                for chunk in package.chunks(member):
                    digest.update(chunk)
                    out.write(chunk)
        except OSError as error:
            raise PackageError(f"cannot extract {member.name} to {destination}: {error.strerror or error}") from error
        return digest.hexdigest()

    def commit(self) -> None:
        """Rename every staged file into place; if a rename fails, put back every file replaced so far."""
        placed: list[tuple[Path, Path | None]] = []  # (destination, the file it replaced, moved aside)
        try:
            for temp, destination in self.staged:
                placed.append((destination, _move_aside(destination)))
                # os.replace swaps a symlink at the destination for the file; it never writes through it.
                os.replace(temp, destination)
        except OSError as error:
            _restore(placed)
            raise PackageError(f"cannot move {destination} into place: {error.strerror or error}") from error
        except BaseException:
            _restore(placed)
            raise
        for _, aside in placed:
            if aside is not None:
                aside.unlink()

    def discard(self) -> None:
        for temp, _ in self.staged:
            temp.unlink(missing_ok=True)
        for directory in reversed(self.created_dirs):
            with contextlib.suppress(OSError):  # not empty: someone else wrote there meanwhile
                directory.rmdir()


def _move_aside(destination: Path) -> Path | None:
    """Rename an existing `destination` to a fresh temporary name beside it, so a failed commit can restore it."""
    if not os.path.lexists(destination):
        return None
    fd, name = tempfile.mkstemp(prefix=f".{destination.name}.", suffix=".tmp", dir=destination.parent)
    os.close(fd)
    try:
        os.replace(destination, name)
    except BaseException:
        os.unlink(name)
        raise
    return Path(name)


def _restore(placed: list[tuple[Path, Path | None]]) -> None:
    for destination, aside in reversed(placed):
        if aside is None:
            destination.unlink(missing_ok=True)
        else:
            os.replace(aside, destination)


def extract_package(
    path: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    force: bool = False,
    log: Log | None = None,
) -> Manifest:
    """Verify and extract into `target` in one pass; the target changes only if the whole package checks out.

    A `target` that already holds anything is refused unless `force`; with it, the
    package's files replace those at the same paths and everything else stays.
    Members are written under temporary names and renamed into place only after
    every checksum and the end of the compressed stream have been checked, so a
    damaged, truncated or hostile package leaves the target exactly as it was
    (folders the extraction created are removed again). Until then a file being
    replaced and its new version both take disk space.
    """
    log = log or (lambda message: None)
    extraction = _Extraction()
    try:
        root = extraction.open_target(Path(target), force)
        manifest = _stage_members(location_of(path), root, extraction, log)
        extraction.commit()
    except BaseException:
        extraction.discard()
        raise
    log(f"extracted {plural(len(manifest.files), 'file')} ({manifest.total_size / 1e6:.1f} MB) into {root}")
    return manifest


def _stage_members(path: Path, root: Path, extraction: _Extraction, log: Log) -> Manifest:
    """Stage every member and check it against the manifest; raise on the first reason not to commit."""
    with open_package(path) as package:
        manifest = package.manifest
        expected = manifest.by_path()
        seen: set[str] = set()
        mismatches: list[str] = []
        total = manifest.total_size
        done = 0
        next_report = total / 10
        for member in package.members():
            problem = _member_problem(member, expected, seen)
            if problem:
                raise PackageError(f"{package.path}: refusing to extract: {problem}")
            seen.add(member.name)
            if extraction.stage(package, member, root) != expected[member.name].sha256:
                mismatches.append(f"{member.name}: sha256 mismatch")
            done += member.size
            if total and done >= next_report:
                log(f"  {done / total:.0%} extracted ({done / 1e6:.0f} / {total / 1e6:.0f} MB)")
                next_report = done + total / 10
        missing = _missing_problems(expected, seen)
        if missing:
            raise PackageError(f"{package.path}: package is truncated or incomplete: " + "; ".join(missing[:5]))
        package.finish()
        if mismatches:
            raise PackageError(f"{package.path}: checksum verification failed: " + "; ".join(mismatches))
    return manifest
