"""A source's files, walked: the digest of everything it can read, and the snapshot of the files its
records come from (which must not change while they are read)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from stat import S_ISLNK
from typing import Any

from vlm_assets.config import SourceConfig
from vlm_assets.object_store import ObjectURL, head, list_objects


# (files, bytes, newest mtime) of the files a source's records are read from: changes while they are read.
Snapshot = tuple[int, int, int]


@dataclass(frozen=True)
class SourceFiles:
    """One walk of a source's files: the digest of all it can read, and the snapshot of those its records come from."""

    digest: str
    snapshot: Snapshot


def walk_source(source: SourceConfig, excluded: Iterable[Path]) -> SourceFiles:
    """Every file a source can read (its path, media root and allowed roots, by name, size,
    modification and change times: a file restored with its old mtime, or made readable again,
    changes its ctime), digested with how it reads them (its kind) and its input limits; with the snapshot
    (`source_snapshot`) taken from the same walk, since a million-file walk takes seconds.

    Hidden entries and `excluded` trees (the storage root, the config file) are left out, so our
    own outputs and config edits never count as a change of the input.
    """
    if source.on_object_store:
        return _walk_object_source(source)
    skip = {os.path.realpath(path) for path in excluded}
    roots = sorted({Path(root) for root in (source.path, source.media_root, *source.allowed_roots)})
    by_root = {root: list(_walk_tree(root, skip)) for root in roots}
    entries = [entry for root in roots for entry in by_root[root]]
    limits = [[str(root) for root in source.allowed_roots], source.max_record_bytes, source.max_json_depth,
              source.max_image_pixels]
    # Ordering by path alone is the order of the entries themselves (a path is listed twice only where
    # roots overlap, alike), and cheaper than comparing them whole.
    entries.sort(key=itemgetter(0))
    snapshot = _snapshot(entry for root in _snapshot_roots(source) for entry in by_root[Path(root)])
    overlap = any(other in root.parents for root in roots for other in roots)
    return SourceFiles(_walk_digest([source.kind, str(source.path), str(source.media_root), limits], entries, overlap),
                       snapshot)


_DIGEST_BATCH = 65_536


# (path, size, mtime ns, ctime ns) of a file a walk found
WalkEntry = tuple[str, int, int, int]


def _walk_digest(head: list[Any], entries: list[WalkEntry], may_repeat: bool = True) -> str:
    """`digest(*head, unique)` of the sorted `entries` with repeats dropped (`may_repeat`: there may
    be some), hashed a batch of entries at a time, never the whole listing's JSON at once."""
    hasher = hashlib.sha256(json.dumps(head, sort_keys=True, default=str)[:-1].encode() + b", [")
    previous: WalkEntry | None = None
    separator = ""
    for start in range(0, len(entries), _DIGEST_BATCH):
        batch = entries[start:start + _DIGEST_BATCH]
        if may_repeat:
            batch = [entry for entry, before in zip(batch, [previous, *batch]) if entry != before]
            if not batch:
                continue
            previous = batch[-1]
        # Each path written between quotes as it is, then the batch's text checked at once: JSON
        # spells it so unless a path holds a quote, a backslash, or a character not printable ASCII.
        text = ", ".join([f'["{path}", {size}, {mtime}, {ctime}]' for path, size, mtime, ctime in batch])
        if not (text.isascii() and text.isprintable() and "\\" not in text and text.count('"') == 2 * len(batch)):
            text = ", ".join([f'["{path}", {size}, {mtime}, {ctime}]' if _plain(path)
                              else json.dumps([path, size, mtime, ctime]) for path, size, mtime, ctime in batch])
        hasher.update((separator + text).encode())
        separator = ", "
    hasher.update(b"]]")
    return hasher.hexdigest()[:20]


def _plain(text: str) -> bool:
    """Whether JSON spells `text` as it is, between quotes."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def _walk_object_source(source: SourceConfig) -> SourceFiles:
    """`walk_source` of a source on object storage: its objects by key, size, ETag and modification
    time, listed a page at a time and digested as they come (a listing is in key order)."""
    assert isinstance(source.path, ObjectURL)
    limits = [[str(root) for root in source.allowed_roots], source.max_record_bytes, source.max_json_depth,
              source.max_image_pixels]
    hasher = hashlib.sha256(json.dumps([source.kind, str(source.path), str(source.media_root), limits]).encode())
    snapshot_roots = _snapshot_roots(source)
    snapshot: Snapshot = (0, 0, 0)
    roots = sorted({source.path, source.media_root, *source.allowed_roots}, key=str)
    for root in roots:
        # A manifest is one object; a folder of shards, a media root, an allowed root: objects below a prefix.
        info = head(root) if root == source.path else None
        objects = [info] if info is not None else list_objects(root)
        files = size = newest = 0
        for item in objects:
            hasher.update(f"{item.url}\0{item.size}\0{item.etag}\0{item.mtime_ns}\n".encode())
            files, size, newest = files + 1, size + item.size, max(newest, item.mtime_ns)
        if root in snapshot_roots:
            snapshot = (snapshot[0] + files, snapshot[1] + size, max(snapshot[2], newest))
    return SourceFiles(hasher.hexdigest()[:20], snapshot)


def source_snapshot(source: SourceConfig, excluded: Iterable[Path], processes: int = 1,
                    helpers: Executor | None = None) -> Snapshot:
    """(files, bytes, newest mtime) of what the source's records are read from: its path, and a media
    root of its own (not one it shares with others, such as the folder a manifest sits in), walked
    as its digest walks them. With `processes` above one, each of that many processes stats a share
    of the files (by their names): a million files take seconds. `helpers`: spawned processes
    already at hand for the other shares (otherwise started here)."""
    if source.on_object_store:
        return _walk_object_source(source).snapshot
    skip = {os.path.realpath(path) for path in excluded}
    roots = [str(root) for root in _snapshot_roots(source)]
    if processes <= 1:
        return _snapshot_share(roots, skip, 0, 1)
    with contextlib.ExitStack() as stack:
        if helpers is None:
            helpers = stack.enter_context(ProcessPoolExecutor(max_workers=processes - 1,
                                                              mp_context=multiprocessing.get_context("spawn")))
        others = [helpers.submit(_snapshot_share, roots, skip, share, processes) for share in range(1, processes)]
        shares = [_snapshot_share(roots, skip, 0, processes), *(future.result() for future in others)]
    files, size, newest = zip(*shares)
    return sum(files), sum(size), max(newest)


def _snapshot_share(roots: list[str], skip: set[str], share: int, shares: int) -> Snapshot:
    """`source_snapshot` of the files under `roots` whose names are in `share` of `shares`."""
    # Summed as the walk lists them: a list of a million files' entries would be 250 MB.
    takes = None if shares == 1 else lambda name: zlib.crc32(name.encode("utf-8", "surrogateescape")) % shares == share
    return _snapshot(entry for root in roots for entry in _walk_tree(Path(root), skip, takes))


def _snapshot_roots(source: SourceConfig) -> list[Path | ObjectURL]:
    if isinstance(source.media_root, ObjectURL) and isinstance(source.path, ObjectURL):
        return [source.path] if source.media_root.contains(source.path) else [source.path, source.media_root]
    if source.media_root != source.path and source.media_root not in source.path.parents:
        return [source.path, source.media_root]
    return [source.path]


def _snapshot(entries: Iterable[WalkEntry]) -> Snapshot:
    files = total = newest = 0
    for _path, size, mtime, _ctime in entries:
        if size >= 0:  # a dangling link has no size
            files, total = files + 1, total + size
            if mtime > newest:
                newest = mtime
    return files, total, newest


def _walk_tree(root: Path, skip: set[str], takes: Callable[[str], bool] | None = None) -> Iterator[WalkEntry]:
    """Each file's (path, size, mtime, ctime) under `root`, folder by folder; with `takes`, only
    those of the files whose names it takes. A dangling link's size and times are -1. Folders (symlinked
    ones too) are walked into; hidden entries and `skip` trees are left out."""
    if root.is_file():
        if takes is None or takes(root.name):
            stat = root.stat()
            yield str(root), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns
        return
    # A plain file is an excluded one only if its name is: resolving every file's path would cost
    # more than the rest of the walk (a source holds millions of images).
    skipped_names = {os.path.basename(path) for path in skip}
    pending = [str(root)]
    while pending:
        folder = pending.pop()
        # Paths spelt as os.scandir(folder) spells its entries': digests of earlier walks stay valid.
        prefix = folder if folder.endswith(os.sep) else folder + os.sep
        folders: list[str] = []
        try:
            descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue  # an unreadable folder, as os.walk skips it
        try:
            # The listing's own entries, listed by descriptor: each file's stat is then made relative to
            # the folder, not by its whole path again; one loop, no function call per file.
            with os.scandir(descriptor) as listing:
                for entry in listing:
                    name = entry.name
                    try:
                        is_folder = entry.is_dir()
                    except OSError:
                        is_folder = False
                    if is_folder:
                        if not name.startswith(".") and os.path.realpath(prefix + name) not in skip:
                            folders.append(prefix + name)
                        continue
                    if name.startswith(".") or (takes is not None and not takes(name)):
                        continue
                    try:
                        info = entry.stat(follow_symlinks=False)
                        if S_ISLNK(info.st_mode) or name in skipped_names:
                            if os.path.realpath(prefix + name) in skip:
                                continue
                            info = os.stat(prefix + name)
                    except OSError:
                        yield prefix + name, -1, -1, -1  # a dangling link still counts: its rejection is an output
                        continue
                    yield prefix + name, info.st_size, info.st_mtime_ns, info.st_ctime_ns
        except OSError:
            continue  # an unreadable folder, as os.walk skips it
        finally:
            os.close(descriptor)
        pending.extend(sorted(folders, reverse=True))
