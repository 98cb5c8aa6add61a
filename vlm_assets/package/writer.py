"""Write a training package: manifest.json first, then every data file, byte-for-byte deterministic.

One read pass over the data. The manifest must come first but carries the
checksums, so it goes into its own uncompressed gzip member / zstd frame whose
length is known in advance (sha256 hex digests have a fixed width). The writer
leaves that much room, streams the data members through gzip or multi-threaded
zstd while hashing them, then fills the room with the finished manifest.
Files a quick probe finds incompressible (JPEG, video: most of a VLM dataset)
go into uncompressed frames, a copy instead of a futile compression attempt.
Member metadata is fixed (mtime 0, uid/gid 0, mode 0644, sorted paths), so the
same inputs and `created_at` give the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import zstandard

from vlm_assets.atomic import atomic_path
from vlm_assets.package.compression import (
    READ_CHUNK,
    PackageStreamWriter,
    StoredSegment,
    stored_frame,
)
from vlm_assets.package.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    PackageError,
    check_archive_path,
    role_root,
)
from vlm_assets.wording import plural

_ROLE_PATTERN = re.compile(r"^[A-Za-z0-9_-]+$")
_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE

Log = Callable[[str], None]


@dataclass(frozen=True)
class PackagePart:
    """One dataset in the package: everything under `source` (a directory or one file) gets `role`;
    with `only`, just those entries of the directory (files or folders, by name)."""

    role: str
    source: Path
    only: tuple[str, ...] = ()


@dataclass(frozen=True)
class PackageSpec:
    name: str
    compress: str
    parts: tuple[PackagePart, ...]
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    train_command: str = ""


@dataclass(frozen=True)
class PackResult:
    path: Path
    manifest: Manifest
    package_bytes: int
    hash_seconds: float  # time spent in sha256, part of write_seconds
    write_seconds: float

    @property
    def data_bytes(self) -> int:
        return self.manifest.total_size

    @property
    def compression_ratio(self) -> float:
        return self.data_bytes / self.package_bytes if self.package_bytes else 0.0


@dataclass(frozen=True)
class _Source:
    role: str
    archive_path: str
    path: Path
    size: int


def is_staging_dir(name: str) -> bool:
    """Work folders of writers in progress or killed (`.<name>.staging-<writer>`) never go into a package."""
    return name.startswith(".") and ".staging-" in name


def is_temp_file(name: str) -> bool:
    """Half-written outputs of atomic writers (`.<name>~<writer>~<random>.tmp`) never go into a package."""
    return name.startswith(".") and name.endswith(".tmp")


def collect_sources(parts: Iterable[PackagePart]) -> list[_Source]:
    """Every regular file of every part, sorted by archive path (the member order)."""
    sources: list[_Source] = []
    roles: set[str] = set()
    for part in parts:
        if not _ROLE_PATTERN.match(part.role):
            raise PackageError(f"role {part.role!r}: use letters, digits, '_' or '-' only")
        if part.role in roles:
            raise PackageError(f"role {part.role!r} is given twice")
        roles.add(part.role)
        root = Path(part.source)
        if root.is_file():
            sources.append(_source(part.role, f"{role_root(part.role)}/{root.name}", root))
        elif root.is_dir():
            for directory, dirnames, filenames in os.walk(root):
                dirnames[:] = sorted(name for name in dirnames if not is_staging_dir(name))
                if part.only and Path(directory) == root:
                    dirnames[:] = [name for name in dirnames if name in part.only]
                    filenames = [name for name in filenames if name in part.only]
                for filename in filenames:
                    path = Path(directory, filename)
                    if is_temp_file(filename) or not path.is_file():
                        continue
                    relative = path.relative_to(root).as_posix()
                    sources.append(_source(part.role, f"{role_root(part.role)}/{relative}", path))
        else:
            raise PackageError(f"{root}: data for role {part.role!r} does not exist")
    sources.sort(key=lambda source: source.archive_path)
    return sources


def _source(role: str, archive_path: str, path: Path) -> _Source:
    check_archive_path(archive_path)
    return _Source(role, archive_path, path, path.stat().st_size)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return digest.hexdigest()


def _tar_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _block_padding(size: int) -> bytes:
    return b"\0" * (-size % _BLOCK)


def _manifest_member(manifest: Manifest) -> bytes:
    data = manifest.to_bytes()
    return _tar_header(MANIFEST_NAME, len(data)) + data + _block_padding(len(data))


_PROBE_BYTES = 32 * 1024
_MIN_STORED_FILE = 128 * 1024
_MIN_SAVING = 0.03


def is_incompressible(path: Path, size: int, probe: zstandard.ZstdCompressor) -> bool:
    """True when a fast compression of three samples saves under 3%: JPEG, video, already-packed media."""
    if size < _MIN_STORED_FILE:
        return False
    with open(path, "rb", buffering=0) as handle:
        sample = b"".join(os.pread(handle.fileno(), _PROBE_BYTES, size * k // 4) for k in (1, 2, 3))
    return len(probe.compress(sample)) > (1 - _MIN_SAVING) * len(sample)


class _DataMembers:
    """Writes the data members (hashing as it goes) and the end of the archive."""

    def __init__(self, out: PackageStreamWriter, offset: int) -> None:
        self._out = out
        self.tar_bytes = offset
        self.hash_seconds = 0.0
        self.stored_bytes = 0
        self._buffer = bytearray(READ_CHUNK)

    def _write(self, target: PackageStreamWriter | StoredSegment, data: bytes | memoryview) -> None:
        target.write(data)
        self.tar_bytes += len(data)

    def write_run(self, sources: list[_Source], stored: bool) -> list[str]:
        """Members for `sources`, compressed, or together in one stored segment; returns their sha256s."""
        headers = [_tar_header(source.archive_path, source.size) for source in sources]
        target: PackageStreamWriter | StoredSegment = self._out
        if stored:
            length = sum(len(header) + source.size + (-source.size % _BLOCK) for header, source in zip(headers, sources))
            target = self._out.stored(length)
            self.stored_bytes += length
        return [self._add_file(target, header, source) for header, source in zip(headers, sources)]

    def _add_file(self, target: PackageStreamWriter | StoredSegment, header: bytes, source: _Source) -> str:
        self._write(target, header)
        digest = hashlib.sha256()
        view = memoryview(self._buffer)
        remaining = source.size
        with open(source.path, "rb", buffering=0) as handle:
            while remaining:
                count = min(handle.readinto(self._buffer), remaining)
                if not count:
                    break
                started = time.perf_counter()
                digest.update(view[:count])
                self.hash_seconds += time.perf_counter() - started
                self._write(target, view[:count])
                remaining -= count
            changed = remaining or handle.read(1)
        if changed:
            raise PackageError(f"{source.path}: file changed size while it was being packed; rerun when its writer is done")
        self._write(target, _block_padding(source.size))
        return digest.hexdigest()

    def finish(self) -> None:
        """End-of-archive: two zero blocks, then zero fill to a whole record, as tar(1) writes it."""
        self._write(self._out, b"\0" * (2 * _BLOCK))
        self._write(self._out, b"\0" * (-self.tar_bytes % _RECORD))


def _runs(sources: list[_Source], stored: list[bool]) -> Iterator[tuple[list[_Source], bool]]:
    """Consecutive sources with the same stored/compressed decision."""
    start = 0
    for index in range(1, len(sources) + 1):
        if index == len(sources) or stored[index] != stored[start]:
            yield sources[start:index], stored[start]
            start = index


_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
SOURCE_DATE_EPOCH = "SOURCE_DATE_EPOCH"


def current_time() -> str:
    """The wall clock as a manifest `created_at` (UTC, whole seconds)."""
    return datetime.now(UTC).strftime(_TIME_FORMAT)


def source_date_epoch() -> str | None:
    """$SOURCE_DATE_EPOCH as a manifest `created_at`, or None when it is unset or empty.

    The reproducible-builds convention: a build that must give the same bytes
    every time takes its timestamp from this variable, never from the clock.
    """
    raw = os.environ.get(SOURCE_DATE_EPOCH, "")
    if not raw:
        return None
    problem = f"{SOURCE_DATE_EPOCH}={raw!r}: expected whole seconds since 1970-01-01 UTC"
    if not (raw.isascii() and raw.isdigit()):
        raise PackageError(problem)
    try:
        return datetime.fromtimestamp(int(raw), UTC).strftime(_TIME_FORMAT)
    except (ValueError, OverflowError, OSError) as error:  # beyond the years datetime can represent
        raise PackageError(problem) from error


def write_package(
    spec: PackageSpec,
    out_path: Path,
    *,
    level: int | None = None,
    threads: int | None = None,
    created_at: str | None = None,
    store_incompressible: bool = True,
    log: Log | None = None,
) -> PackResult:
    """Write `spec` to `out_path` atomically (temp file + rename) and return what was written.

    `created_at` is stored in the manifest as given. The default, None, records no
    time (JSON null), so the package is a function of its inputs alone: identical
    data and spec give byte-identical files whenever and wherever they are written.
    Pass `current_time()` or `source_date_epoch()` to record one.
    `threads`: zstd worker threads (default: all CPUs; 0 compresses in the calling thread).
    Every count from 1 up gives the same bytes; 0 is zstd's single-threaded mode, whose
    frames differ, so reproducible builds leave `threads` at its default or above 0.
    `store_incompressible`: files a quick probe finds incompressible go into uncompressed
    frames instead of through the compressor (much faster, at most ~3% larger for them).
    """
    log = log or (lambda message: None)
    sources = collect_sources(spec.parts)
    total = sum(source.size for source in sources)
    log(f"packing {plural(len(sources), 'file')} ({total / 1e6:.1f} MB) into {out_path} ({spec.compress})")

    def manifest_with(digests: list[str]) -> Manifest:
        return Manifest(
            name=spec.name,
            created_at=created_at,
            compress=spec.compress,
            hyperparameters=dict(spec.hyperparameters),
            train_command=spec.train_command,
            files=tuple(FileEntry(s.role, s.archive_path, s.size, digest) for s, digest in zip(sources, digests)),
        )

    placeholder = manifest_with(["0" * 64] * len(sources))
    head_tar_bytes = len(_manifest_member(placeholder))
    head_length = len(stored_frame(_manifest_member(placeholder), spec.compress))

    started = time.perf_counter()
    probe = zstandard.ZstdCompressor(level=1)
    stored_flags = [store_incompressible and is_incompressible(s.path, s.size, probe) for s in sources]
    with atomic_path(out_path) as tmp:
        with open(tmp, "wb") as handle:
            handle.seek(head_length)
            out = PackageStreamWriter(handle, spec.compress, level=level, threads=threads)
            members = _DataMembers(out, head_tar_bytes)
            digests: list[str] = []
            done, next_report = 0, total / 10
            for run, stored in _runs(sources, stored_flags):
                digests += members.write_run(run, stored)
                done += sum(source.size for source in run)
                if total and done >= next_report:
                    log(f"  {done / total:.0%} written ({done / 1e6:.0f} / {total / 1e6:.0f} MB)")
                    next_report = done + total / 10
            members.finish()
            out.close()
            manifest = manifest_with(digests)
            head = stored_frame(_manifest_member(manifest), spec.compress)
            if len(head) != head_length:
                raise AssertionError("manifest length changed between reservation and write")
            handle.seek(0)
            handle.write(head)
    write_seconds = time.perf_counter() - started
    log(
        f"wrote {out_path} in {write_seconds:.1f} s ({members.tar_bytes / 1e6:.1f} MB tar, "
        f"{members.stored_bytes / 1e6:.1f} MB of it stored as incompressible, {members.hash_seconds:.1f} s hashing)"
    )
    return PackResult(out_path, manifest, out_path.stat().st_size, members.hash_seconds, write_seconds)
