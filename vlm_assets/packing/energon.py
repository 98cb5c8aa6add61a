"""Energon metadata over one source's packed shards: that source's own Energon dataset.

The metadata (``.nv-meta/split.yaml``, ``.info.json``, ``index.sqlite``, the
``*.tar.idx`` beside every shard) is written by megatron-energon's own prepare
(``BaseWebdatasetFactory.prepare_dataset``, what ``energon prepare`` calls); we
add the ``dataset.yaml`` the CLI writes for a ``CrudeWebdataset``, with the
source's subflavors (its ``sample_type`` among them) so cookers can select on
them. Every shard goes to the ``train`` split; no shuffling at prepare time.

Prepare runs aside, in a staging directory under the root whose symlinks mirror
the shards, and its result is then published: each ``.tar.idx`` renamed over the
old one, and the new ``.nv-meta`` swapped in, so a reader (a training loader, the
load check, a packager) never sees metadata half written. Identical shards give
byte-identical metadata, whatever the root directory or the number of workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import itertools
import json
import os
import secrets
import shutil
import sqlite3
import stat
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vlm_assets.locks import local_writer_gone, parse_writer_tag, writer_tag

# Energon's file names, spelled out so that importing this module does not import Energon (and
# torch, seconds per process); vlm_assets_tests/test_energon_metadata.py checks them against Energon.
MAIN_FOLDER_NAME = ".nv-meta"
INDEX_SQLITE_FILENAME = "index.sqlite"
INDEX_UUID_FILENAME = "index.uuid"
INFO_JSON_FILENAME = ".info.json"
SPLIT_YAML_FILENAME = "split.yaml"
ITAR_SUFFIX = ".tar.idx"
DATASET_CLASS = "CrudeWebdataset"
SPLIT = "train"
DATASET_YAML = "dataset.yaml"
STAGING_PREFIX = f"{MAIN_FOLDER_NAME}.staging-"
# Fixed namespace for index.uuid: the uuid is a name derived from the index's content.
_UUID_NAMESPACE = uuid.UUID("5d0f8a63-2b7e-4c41-9a57-1c3e6f2b8d90")
# Energon reads some tables without ORDER BY, so their rows keep the order a one-worker prepare
# inserts them in (shard by shard, sample by sample); every column then breaks ties.
_ROW_ORDER = {
    "samples": ("tar_file_id", "sample_index"),
    "sample_parts": ("tar_file_id", "sample_index", "content_byte_offset"),
}
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


@dataclass(frozen=True)
class EnergonDataset:
    root: Path
    shards: tuple[str, ...]  # relative to root
    sample_count: int

    @property
    def meta_dir(self) -> Path:
        return self.root / MAIN_FOLDER_NAME


def prepare_energon_dataset(
    root: Path, shards: list[Path], subflavors: Mapping[str, Any], workers: int | None = None
) -> EnergonDataset:
    """Index `shards` (all under `root`) with Energon and publish `root/.nv-meta` and the `.tar.idx` files.

    The new metadata replaces the earlier prepare's as a whole, so a shard that went
    away does not linger in the index. Nothing outside `root` is read or written.
    """
    if not shards:
        raise ValueError(f"{root}: no packed shards to prepare (did the source reject all of its samples?)")
    from megatron.energon.flavors import BaseWebdatasetFactory

    relative = [str(path.relative_to(root)) for path in sorted(shards)]
    _remove_stale_staging(root)
    staging = _make_staging(root)
    try:
        _link_shards(root, staging, relative)
        BaseWebdatasetFactory.prepare_dataset(
            staging,
            relative,
            split_parts_ratio=[(SPLIT, 1.0), ("val", 0.0), ("test", 0.0)],
            shuffle_seed=None,
            workers=workers or max(1, min(len(relative), os.cpu_count() or 1)),
        )
        meta_dir = staging / MAIN_FOLDER_NAME
        _canonicalize_sqlite(meta_dir / INDEX_SQLITE_FILENAME)
        dataset_yaml = {
            "__module__": "megatron.energon",
            "__class__": DATASET_CLASS,
            "subflavors": dict(subflavors),
        }
        (meta_dir / DATASET_YAML).write_text(yaml.safe_dump(dataset_yaml, sort_keys=False), encoding="utf-8")
        (meta_dir / INDEX_UUID_FILENAME).write_text(str(_content_uuid(root, meta_dir, relative)), encoding="ascii")
        info = json.loads((meta_dir / INFO_JSON_FILENAME).read_text())
        _publish(root, staging, relative)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return EnergonDataset(root, tuple(relative), int(sum(info["shard_counts"].values())))


def _make_staging(root: Path) -> Path:
    """A fresh directory for one prepare, named after its writer so a stale one can be recognised."""
    staging = root / f"{STAGING_PREFIX}{writer_tag()}-{secrets.token_hex(4)}"
    staging.mkdir()
    # Energon gives .nv-meta the mode of the directory it prepares in: make that the root's, as in place.
    os.chmod(staging, stat.S_IMODE(root.stat().st_mode))
    return staging


def _remove_stale_staging(root: Path) -> None:
    """Delete staging directories whose writer (a process on this host) is gone."""
    for path in root.glob(f"{STAGING_PREFIX}*"):
        writer = parse_writer_tag(path.name[len(STAGING_PREFIX):].rsplit("-", 1)[0])
        if path.is_dir() and writer is not None and local_writer_gone(*writer):
            shutil.rmtree(path, ignore_errors=True)


def _link_shards(root: Path, staging: Path, relative: list[str]) -> None:
    """Mirror every shard into `staging` as a symlink: Energon reads through it and writes beside it."""
    for name in relative:
        link = staging / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to((root / name).absolute())


def _canonicalize_sqlite(path: Path) -> None:
    """Rewrite Energon's index with its rows in a fixed order and the same schema.

    Energon's workers hand in shards as they finish, so row order, and with it the
    file's bytes, would otherwise change from one prepare to the next.
    """
    rebuilt = path.with_name(f"{path.name}.canonical")
    with contextlib.closing(sqlite3.connect(rebuilt)) as target:
        target.execute("ATTACH DATABASE ? AS energon", (str(path),))
        schema = target.execute(
            "SELECT type, name, sql FROM energon.sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
        ).fetchall()
        tables = [(name, sql) for kind, name, sql in schema if kind == "table"]
        for name, sql in tables:
            target.execute(sql)
            columns = [row[1] for row in target.execute(f"PRAGMA energon.table_info({_quoted(name)})")]
            leading = _ROW_ORDER.get(name, ())
            order = [*leading, *(column for column in columns if column not in leading)]
            target.execute(
                f"INSERT INTO main.{_quoted(name)} SELECT * FROM energon.{_quoted(name)} "
                f"ORDER BY {', '.join(_quoted(column) for column in order)}"
            )
        for kind, _, sql in schema:
            if kind != "table":
                target.execute(sql)
        target.commit()
        target.execute("DETACH DATABASE energon")
        target.execute("VACUUM")
    shutil.copymode(path, rebuilt)
    os.replace(rebuilt, path)


def _quoted(identifier: str) -> str:
    return '"' + identifier.replace('"', '""') + '"'


def _content_uuid(root: Path, meta_dir: Path, relative: list[str]) -> uuid.UUID:
    """index.uuid, derived from what it stands for.

    Energon only uses it to name cached join indexes (sample offsets across joined
    datasets): it must change when the index changes, and need not otherwise. The
    index files hold every sample's key, offset and size; shard sizes are added so
    that a rewritten shard always counts as new.
    """
    digest = hashlib.sha256()
    for name in relative:
        digest.update(f"{name}\0{(root / name).stat().st_size}\0".encode())
    for name in (INFO_JSON_FILENAME, SPLIT_YAML_FILENAME, INDEX_SQLITE_FILENAME):
        with open(meta_dir / name, "rb") as handle:
            digest.update(f"{name}\0".encode() + hashlib.file_digest(handle, "sha256").digest())
    return uuid.uuid5(_UUID_NAMESPACE, digest.hexdigest())


def _publish(root: Path, staging: Path, relative: list[str]) -> None:
    """Move the staged `.tar.idx` files and `.nv-meta` into `root`, each in one atomic step."""
    meta_dir = staging / MAIN_FOLDER_NAME
    indexes = [Path(name).with_suffix(ITAR_SUFFIX) for name in relative]
    # Renames are atomic, not durable: the data must be on disk before a name points at it.
    for path in [*(staging / index for index in indexes), *meta_dir.iterdir()]:
        _fsync(path)
    # Tar indexes first: the new split.yaml may name a shard whose index is new too.
    for index in indexes:
        os.replace(staging / index, root / index)
    _swap_directory(meta_dir, root / MAIN_FOLDER_NAME, staging)


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _swap_directory(new: Path, live: Path, scratch: Path) -> None:
    """Make directory `new` the one at `live`; the one it replaces is left in `scratch`.

    rename(2) cannot replace a non-empty directory. Where Linux's renameat2 can
    exchange two names, the old and new directory trade places in one atomic step.
    Elsewhere the old directory is renamed away first, and between that rename and
    the next a reader finds no `live` at all: two renames, with nothing in between,
    is as short as that window can be made.
    """
    for attempt in itertools.count():
        aside = scratch / f"replaced-{attempt}"
        try:
            if _exchange(new, live):
                os.rename(new, aside)
                return
            os.rename(live, aside)
        except FileNotFoundError:
            pass  # first prepare of this root: nothing to put aside
        try:
            os.rename(new, live)
            return
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            # Another prepare published between our two steps: go round and put its result aside too.


def _exchange(first: Path, second: Path) -> bool:
    """Atomically swap two paths; False where the system or the filesystem cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if function is not None:
        function.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
        function.restype = ctypes.c_int
    return function
