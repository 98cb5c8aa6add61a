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

Shards are only ever added after the ones already indexed (``packing.mode: append``), so a
prepare may keep the live index's entries for the leading shards it recorded (`PreparedRecord`)
when they are still as they were: Energon's prepare then indexes only the new shards, and their
entries are added after the kept ones. The result is byte for byte what a prepare over every
shard gives; only the new shards are read.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from vlm_assets.atomic import atomic_write_text, naming_a_full_disk
from vlm_assets.locks import local_writer_gone, parse_writer_tag, writer_tag
from vlm_assets.packing.wds import ShardStamp

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
class PreparedRecord:
    """What one prepare published: its index's uuid, the shards it indexed as they were then, and
    how many of their samples it kept from the index it extended (`extends`, that index's uuid)."""

    index_uuid: str
    shards: tuple[ShardStamp, ...]
    samples: int
    extends: str | None = None
    kept_samples: int = 0

    def save(self, path: Path) -> None:
        record = {**asdict(self), "shards": [[s.name, s.size, s.mtime_ns] for s in self.shards]}
        atomic_write_text(path, json.dumps(record, indent=1))

    @classmethod
    def load(cls, path: Path) -> PreparedRecord | None:
        """The record at `path`; None when there is none or it cannot be read (a full prepare follows)."""
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            return cls(**{**record, "shards": tuple(ShardStamp(*stamp) for stamp in record["shards"])})
        except (OSError, ValueError, TypeError, KeyError):
            return None


@dataclass(frozen=True)
class EnergonDataset:
    root: Path
    shards: tuple[str, ...]  # relative to root
    sample_count: int
    record: PreparedRecord
    kept_shards: int = 0
    read_in_full: str = ""  # why no shard's entries could be kept, when none were

    @property
    def meta_dir(self) -> Path:
        return self.root / MAIN_FOLDER_NAME


def prepare_energon_dataset(
    root: Path,
    shards: list[Path],
    subflavors: Mapping[str, Any],
    workers: int | None = None,
    previous: PreparedRecord | None = None,
) -> EnergonDataset:
    """Index `shards` (all under `root`) with Energon and publish `root/.nv-meta` and the `.tar.idx` files.

    The new metadata replaces the earlier prepare's as a whole, so a shard that went
    away does not linger in the index. With `previous`, the record of the prepare whose
    metadata is live, the entries of the leading shards it indexed are kept when they
    still hold (see `keepable_shards`). Nothing outside `root` is read or written.
    """
    if not shards:
        raise ValueError(f"{root}: no packed shards to prepare (did the source reject all of its samples?)")
    from megatron.energon.flavors import BaseWebdatasetFactory

    relative = [str(path.relative_to(root)) for path in sorted(shards)]
    keep, read_in_full = keepable_shards(root, relative, previous) if previous else (0, "no earlier prepare recorded")
    _remove_stale_staging(root)
    staging = _make_staging(root)
    try:
        # Energon's index is SQLite, whose full disk names no file.
        with naming_a_full_disk(staging):
            _link_shards(root, staging, relative[keep:])
            BaseWebdatasetFactory.prepare_dataset(
                staging,
                relative[keep:],
                split_parts_ratio=[(SPLIT, 1.0), ("val", 0.0), ("test", 0.0)],
                shuffle_seed=None,
                workers=workers or max(1, min(len(relative) - keep, os.cpu_count() or 1)),
            )
            meta_dir = staging / MAIN_FOLDER_NAME
            if keep:
                _add_kept_entries(root / MAIN_FOLDER_NAME, meta_dir, relative, keep)
            else:
                staged_index = meta_dir / INDEX_SQLITE_FILENAME
                _write_canonical_index(staged_index, [_IndexRows(staged_index, 0, in_order=False)])
            dataset_yaml = {
                "__module__": "megatron.energon",
                "__class__": DATASET_CLASS,
                "subflavors": dict(subflavors),
            }
            (meta_dir / DATASET_YAML).write_text(yaml.safe_dump(dataset_yaml, sort_keys=False), encoding="utf-8")
            index_uuid = str(_content_uuid(root, meta_dir, relative))
            (meta_dir / INDEX_UUID_FILENAME).write_text(index_uuid, encoding="ascii")
            counts = json.loads((meta_dir / INFO_JSON_FILENAME).read_text())["shard_counts"]
            _publish(root, staging, relative[keep:])
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    kept_samples = sum(counts[name] for name in relative[:keep])
    record = PreparedRecord(
        index_uuid, tuple(ShardStamp.of(root, name) for name in relative), int(sum(counts.values())),
        extends=previous.index_uuid if keep and previous else None, kept_samples=kept_samples,
    )
    return EnergonDataset(root, tuple(relative), record.samples, record, keep, "" if keep else read_in_full)


def live_index_uuid(root: Path) -> str | None:
    try:
        return (root / MAIN_FOLDER_NAME / INDEX_UUID_FILENAME).read_text(encoding="ascii")
    except OSError:
        return None


def first_unloaded_sample(prepared: PreparedRecord | None, live_uuid: str | None, loaded_record: Path) -> int:
    """Where a load check of the live index must start: past the samples it kept from an index whose
    every sample a load check already loaded (`loaded_record`, see `record_loaded`), else at 0.

    The kept samples' shards and index entries are unchanged since (`keepable_shards`), so loading
    them again would prove nothing new.
    """
    try:
        loaded_uuid = json.loads(loaded_record.read_text(encoding="utf-8"))["index_uuid"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    if prepared and prepared.index_uuid == live_uuid and prepared.extends and prepared.extends == loaded_uuid:
        return prepared.kept_samples
    return 0


def record_loaded(loaded_record: Path, live_uuid: str | None) -> None:
    """Record that every sample of index `live_uuid` loaded (None: that nothing is known to have)."""
    if live_uuid is None:
        loaded_record.unlink(missing_ok=True)
    else:
        atomic_write_text(loaded_record, json.dumps({"index_uuid": live_uuid}))


def keepable_shards(root: Path, relative: list[str], previous: PreparedRecord) -> tuple[int, str]:
    """How many leading shards of `relative` keep their entries in the live index; when none, why.

    They do when the live metadata is the one `previous` recorded, the shards it indexed are the
    first of `relative` with the size and modification time it recorded, and new shards follow them.
    """
    from megatron.energon import __version__ as energon_version

    meta_dir = root / MAIN_FOLDER_NAME
    kept = [stamp.name for stamp in previous.shards]
    live_uuid = live_index_uuid(root)
    try:
        live_info = json.loads((meta_dir / INFO_JSON_FILENAME).read_text())
    except (OSError, ValueError):
        return 0, "no readable Energon metadata in place"
    if live_uuid != previous.index_uuid:
        return 0, "the Energon metadata in place is not the one last recorded"
    if live_info.get("energon_version") != energon_version:
        return 0, f"indexed by Energon {live_info.get('energon_version')}, now {energon_version}"
    if relative[:len(kept)] != kept or len(relative) == len(kept):
        return 0, "the shards are not the indexed ones followed by new ones"
    changed = [name for name, stamp in zip(kept, previous.shards) if _stamp_or_none(root, name) != stamp]
    if changed:
        return 0, f"{changed[0]} changed since it was indexed"
    if not all((root / name).with_suffix(ITAR_SUFFIX).is_file() for name in kept):
        return 0, "a tar index of the indexed shards is missing"
    return len(kept), ""


def _stamp_or_none(root: Path, name: str) -> ShardStamp | None:
    try:
        return ShardStamp.of(root, name)
    except OSError:
        return None


def _add_kept_entries(live_meta: Path, staged_meta: Path, relative: list[str], keep: int) -> None:
    """Complete the staged metadata of the new shards (`relative[keep:]`) with the live entries of the first `keep`.

    What Energon writes for all of them: every kept row first, the new shards' rows numbered
    after the kept shards; the shard counts in shard order; one split naming every shard. The
    live index is ours, so its rows are in canonical order already: only the new ones are sorted.
    """
    from megatron.energon.bracecollapse import collapse

    staged_index = staged_meta / INDEX_SQLITE_FILENAME
    _write_canonical_index(staged_index, [_IndexRows(live_meta / INDEX_SQLITE_FILENAME, 0, in_order=True),
                                          _IndexRows(staged_index, keep, in_order=False)])

    info_path = staged_meta / INFO_JSON_FILENAME
    live_info, added_info = (json.loads(path.read_text()) for path in (live_meta / INFO_JSON_FILENAME, info_path))
    live_info["shard_counts"] = {**live_info["shard_counts"], **added_info["shard_counts"]}
    info_path.write_text(json.dumps(live_info, indent=2))
    split = {"split_parts": {SPLIT: collapse(relative, keep_order=True), "val": [], "test": []}, "exclude": []}
    (staged_meta / SPLIT_YAML_FILENAME).write_text(yaml.dump(split, sort_keys=False))


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


@dataclass(frozen=True)
class _IndexRows:
    """The rows of one Energon index file, to go into a canonical index."""

    path: Path
    tar_file_offset: int  # added to their tar_file_id (the shards of `path` come after that many)
    in_order: bool  # already in canonical order (an index written by `_write_canonical_index`)


def _write_canonical_index(target: Path, parts: list[_IndexRows]) -> None:
    """Write (or replace) Energon's index at `target` with the rows of `parts`, one after the other,
    in a fixed order and with the schema of the first.

    Energon's workers hand in shards as they finish, so row order, and with it the file's bytes,
    would otherwise change from one prepare to the next. The rows of the parts must follow each
    other in that order (later parts: later shards).
    """
    rebuilt = target.with_name(f"{target.name}.canonical")
    rebuilt.unlink(missing_ok=True)
    with contextlib.closing(sqlite3.connect(rebuilt)) as index:
        # A file of our own until it replaces the index: no rollback journal, and sorting in memory.
        index.execute("PRAGMA journal_mode = OFF")
        index.execute("PRAGMA temp_store = MEMORY")
        aliases = [f"part{number}" for number in range(len(parts))]
        for alias, part in zip(aliases, parts):
            index.execute(f"ATTACH DATABASE ? AS {alias}", (str(part.path),))
        schema = index.execute(
            f"SELECT type, name, sql FROM {aliases[0]}.sqlite_master WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%' "
            "ORDER BY rowid"
        ).fetchall()
        tables = [(name, sql) for kind, name, sql in schema if kind == "table"]
        if {name for name, _ in tables} != set(_ROW_ORDER):
            raise RuntimeError(f"Energon's index has tables {sorted(name for name, _ in tables)}; expected {sorted(_ROW_ORDER)}")
        for name, sql in tables:
            index.execute(sql)
            columns = [row[1] for row in index.execute(f"PRAGMA {aliases[0]}.table_info({_quoted(name)})")]
            leading = _ROW_ORDER[name]
            order = ", ".join(_quoted(column) for column in [*leading, *(column for column in columns if column not in leading)])
            for alias, part in zip(aliases, parts):
                selected = ", ".join(f"{_quoted(column)} + {part.tar_file_offset} AS {_quoted(column)}"
                                     if column == "tar_file_id" else _quoted(column) for column in columns)
                index.execute(
                    f"INSERT INTO main.{_quoted(name)} ({', '.join(map(_quoted, columns))}) "
                    f"SELECT {selected} FROM {alias}.{_quoted(name)}" + ("" if part.in_order else f" ORDER BY {order}")
                )
        for kind, _, sql in schema:
            if kind != "table":
                index.execute(sql)
        index.commit()
        for alias in aliases:
            index.execute(f"DETACH DATABASE {alias}")
    shutil.copymode(target, rebuilt)
    os.replace(rebuilt, target)


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
