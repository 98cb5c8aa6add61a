"""Atomic file writes: readers see the old file or the complete new one, never a half."""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

from vlm_assets.locks import local_writer_gone, parse_writer_tag, writer_tag

if TYPE_CHECKING:
    import pandas as pd

TEMP_SUFFIX = ".tmp"
# `.<target name>~<host>-<pid>~<random>.tmp`: the writer's host and pid let cleanup tell a dead
# writer's leftovers from a live writer's file in progress.
TEMP_SEPARATOR = "~"


COMPARE_CHUNK = 1 << 20


def same_bytes(a: Path, b: Path) -> bool:
    """Whether two files hold the same bytes (sizes first, so a changed file is rarely read twice)."""
    try:
        if a.stat().st_size != b.stat().st_size:
            return False
        with open(a, "rb") as first, open(b, "rb") as second:
            while True:
                chunk = first.read(COMPARE_CHUNK)
                if chunk != second.read(COMPARE_CHUNK):
                    return False
                if not chunk:
                    return True
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def naming_a_full_disk(path: str | os.PathLike[str]) -> Iterator[None]:
    """A full disk met while writing `path` re-raised as OSError(ENOSPC) naming it: SQLite says only
    "database or disk is full", and a failed write() names no file."""
    try:
        yield
    except Exception as error:
        if _disk_full(error):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from error
        raise


def _disk_full(error: BaseException | None) -> bool:
    """Whether `error`, or one it was raised from, is a full disk that names no file."""
    while error is not None:
        if isinstance(error, sqlite3.Error) and getattr(error, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_FULL:
            return True
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return error.filename is None
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `target`; rename it over `target` on success.

    When the new bytes equal the existing file's, the existing file is kept as it is: a rebuild
    that changes nothing touches nothing, and a reader holding the file never sees it replaced.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps_of(target)
    fd, tmp_name = tempfile.mkstemp(prefix=temp_prefix(target.name), suffix=TEMP_SUFFIX, dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        # mkstemp creates owner-only files; outputs are data for other users and tools too.
        os.chmod(tmp, 0o644)
        if not same_bytes(tmp, target):
            os.replace(tmp, target)
    except OSError as error:
        if error.filename is None and error.errno is not None:
            # A failed write() names no file; "No space left on device" alone does not say where.
            raise OSError(error.errno, error.strerror, str(target)) from error
        raise
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_open(target: str | os.PathLike[str], mode: str = "wb", **kwargs) -> Iterator[IO]:
    """Open a temporary file for writing; it replaces `target` only if the block succeeds."""
    with atomic_path(target) as tmp:
        with open(tmp, mode, **kwargs) as handle:
            yield handle


def atomic_write_bytes(target: str | os.PathLike[str], data: bytes) -> None:
    with atomic_open(target, "wb") as handle:
        handle.write(data)


def atomic_write_text(target: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(target, text.encode("utf-8"))


def write_parquet(frame: pd.DataFrame, target: str | os.PathLike[str]) -> None:
    with atomic_path(target) as tmp:
        frame.to_parquet(tmp, index=False)


def temp_prefix(name: str) -> str:
    return f".{name}{TEMP_SEPARATOR}{writer_tag()}{TEMP_SEPARATOR}"


def temp_writer_gone(path: Path) -> bool:
    """Whether the process that wrote temp file `path` is gone (a temp file of unknown format counts as stale)."""
    parts = path.name[: -len(TEMP_SUFFIX)].rsplit(TEMP_SEPARATOR, 2)
    writer = parse_writer_tag(parts[1]) if len(parts) == 3 else None
    return writer is None or local_writer_gone(*writer)


def _remove_stale_temps_of(target: Path) -> None:
    for stale in target.parent.glob(f".{glob.escape(target.name)}{TEMP_SEPARATOR}*{TEMP_SUFFIX}"):
        if temp_writer_gone(stale):
            stale.unlink(missing_ok=True)


def remove_stale_temp_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete temp files whose writer is gone (killed mid-write); a live writer's file is left alone."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = [path for path in directory.glob(f".*{TEMP_SUFFIX}") if path.is_file() and temp_writer_gone(path)]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale
