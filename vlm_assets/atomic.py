"""Atomic file writes: readers see the old file or the complete new one, never a half."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pandas as pd


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `target`; rename it over `target` on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        # mkstemp creates owner-only files; outputs are data for other users and tools too.
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
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


def remove_stale_temp_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete temp files an interrupted writer left behind (never complete outputs)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = [path for path in directory.glob(".*.tmp") if path.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale
