"""What each asset's output was built from, as short digests (its provenance).

An asset's bytes are determined by its code revision, the config settings it reads and the
inputs it reads. `code_versions` digests the first two per asset (Dagster shows them as code
versions, so a config change marks exactly the assets that read the changed settings as stale).
`Fingerprints` adds the inputs: the files of a source (path, size, modification time) for the
catalogue, and for everything after it the fingerprints its upstream outputs *recorded* when they
were built, not ones recomputed from today's config. A step computes its fingerprint from the
settings it loaded and the upstream records it read, and records it as its data version;
`vlm-assets run` skips an asset whose recorded fingerprint equals the one its inputs give now.
So an output built from an upstream that has been rebuilt since (a config edited mid-run) never
counts as up to date.

An asset's code revision and the settings it reads are in its spec (vlm_assets.asset_specs).
"""

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

from vlm_assets.asset_specs import SPECS, Partitioning
from vlm_assets.config import AppConfig, SourceConfig
from vlm_assets.frames.plan import (
    PLAN_FILE,
    frames_source_files,
    plan_file_digest,
    read_plan,
    shard_members,
)
from vlm_assets.frames.shard import plan_digest
from vlm_assets.layout import StorageLayout
from vlm_assets.object_store import ObjectURL, head, list_objects
from vlm_assets.tokens.chunk_plan import ChunkPlan, split_chunk_partition

# The fingerprint an output recorded when it was last built: (asset, partition) -> fingerprint,
# "" for one never built.
RecordedFingerprint = Callable[[str, "str | None"], str]


def digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _settings(app: AppConfig, processor_fingerprint: str) -> dict[str, Any]:
    """The global config values each asset's step reads (per-source ones are inputs, see Fingerprints)."""
    return {spec.name: [processor_fingerprint, *spec.settings(app)] if spec.reads_processor else spec.settings(app)
            for spec in SPECS.values()}


def code_versions(app: AppConfig, processor_fingerprint: str) -> dict[str, str]:
    settings = _settings(app, processor_fingerprint)
    if app.storage_url is not None:
        # Published there too: moving the root publishes everything again.
        settings = {name: [*values, str(app.storage_url)] for name, values in settings.items()}
    return {spec.name: f"r{spec.revision}-{digest(settings[spec.name])[:12]}" for spec in SPECS.values()}


# (files, bytes, newest mtime) of the files a source's records are read from: changes while they are read.
Snapshot = tuple[int, int, int]


@dataclass(frozen=True)
class SourceFiles:
    """One walk of a source's files: the digest of all it can read, and the snapshot of those its records come from."""

    digest: str
    snapshot: Snapshot


def walk_source(source: SourceConfig, excluded: Iterable[Path]) -> SourceFiles:
    """Every file a source can read (its path, media root and allowed roots, by name, size and
    mtime), digested with how it reads them (its kind) and its input limits; with the snapshot
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
    # roots overlap, alike), at a third of the cost of comparing them whole (seconds for a million files).
    entries.sort(key=itemgetter(0))
    snapshot = _snapshot(entry for root in _snapshot_roots(source) for entry in by_root[Path(root)])
    overlap = any(other in root.parents for root in roots for other in roots)
    return SourceFiles(_walk_digest([source.kind, str(source.path), str(source.media_root), limits], entries, overlap),
                       snapshot)


_DIGEST_BATCH = 65_536


def _walk_digest(head: list[Any], entries: list[tuple[str, int, int]], may_repeat: bool = True) -> str:
    """`digest(*head, unique)` of the sorted `entries` with repeats dropped (`may_repeat`: there may
    be some), hashed a batch of entries at a time: the JSON of a million entries at once took
    seconds and a copy of them as text."""
    hasher = hashlib.sha256(json.dumps(head, sort_keys=True, default=str)[:-1].encode() + b", [")
    previous: tuple[str, int, int] | None = None
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
        text = ", ".join([f'["{path}", {size}, {mtime}]' for path, size, mtime in batch])
        if not (text.isascii() and text.isprintable() and "\\" not in text and text.count('"') == 2 * len(batch)):
            text = ", ".join([f'["{path}", {size}, {mtime}]' if _plain(path) else json.dumps([path, size, mtime])
                              for path, size, mtime in batch])
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


def source_files_digest(source: SourceConfig, excluded: Iterable[Path]) -> str:
    """The digest of `walk_source`."""
    return walk_source(source, excluded).digest


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


def _snapshot(entries: Iterable[tuple[str, int, int]]) -> Snapshot:
    files = total = newest = 0
    for _path, size, mtime in entries:
        if size >= 0:  # a dangling link has no size
            files, total = files + 1, total + size
            if mtime > newest:
                newest = mtime
    return files, total, newest


def _walk_tree(root: Path, skip: set[str], takes: Callable[[str], bool] | None = None) -> Iterator[tuple[str, int, int]]:
    """Each file's (path, size, mtime) under `root`, folder by folder; with `takes`, only those of
    the files whose names it takes. A dangling link's size and mtime are -1. Folders (symlinked
    ones too) are walked into; hidden entries and `skip` trees are left out."""
    if root.is_file():
        if takes is None or takes(root.name):
            stat = root.stat()
            yield str(root), stat.st_size, stat.st_mtime_ns
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
            # the folder, not by its whole path again (a sixth of the walk's kernel time). A third
            # faster than os.walk with an lstat per file, for a million media files. One loop, no call
            # per file: a million files' calls are a second.
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
                        yield prefix + name, -1, -1  # a dangling link still counts: its rejection is an output
                        continue
                    yield prefix + name, info.st_size, info.st_mtime_ns
        except OSError:
            continue  # an unreadable folder, as os.walk skips it
        finally:
            os.close(descriptor)
        pending.extend(sorted(folders, reverse=True))


class Fingerprints:
    """Fingerprints of the graph's assets for one config, from their upstreams' recorded fingerprints.

    `recorded` gives what an upstream output recorded when it was built (the Dagster instance's
    latest materialisation). A source's catalogue digest is memoised: walking a source is the one
    costly input, and it is taken once per step (or per `vlm-assets run`).
    """

    def __init__(self, app: AppConfig, processor_fingerprint: str, sources: list[SourceConfig],
                 recorded: RecordedFingerprint) -> None:
        self.app = app
        self.versions = code_versions(app, processor_fingerprint)
        self.sources = {source.name: source for source in sources}
        self.recorded = recorded
        self._source_files: dict[str, SourceFiles] = {}
        self._chunk_plans: dict[str, ChunkPlan | None] = {}
        self._plan: tuple[tuple, dict[str, list]] | None = None

    def _of(self, asset: str, partition: str | None, *inputs: Any) -> str:
        return digest(asset, self.versions[asset], partition, *inputs)

    def of(self, asset: str, partition: str | None = None) -> str:
        """The fingerprint `asset` (`partition`) has when built now from its upstreams as recorded."""
        inputs = getattr(self, f"_{asset}", None)
        return inputs(partition) if inputs is not None else self._from_upstream(asset, partition)

    def _from_upstream(self, asset: str, partition: str | None) -> str:
        """An asset whose step reads only its upstream outputs: the same partition of a partitioned
        upstream partitioned alike, else the upstream as a whole (the assets above spell out what
        else their steps read)."""
        spec = SPECS[asset]
        upstream = [self.recorded(name, partition if SPECS[name].partitioning is spec.partitioning
                                  and spec.partitioning is not Partitioning.NONE else None)
                    for name in spec.upstream]
        return self._of(asset, partition, upstream)

    # -- per source ------------------------------------------------------------------------------
    def source_files(self, source: str) -> str:
        """The digest of the source's files as they are now (walked once per Fingerprints)."""
        return self.source_walk(source).digest

    def source_walk(self, source: str) -> SourceFiles:
        """The source's files as they are now, walked once per Fingerprints."""
        if source not in self._source_files:
            self._source_files[source] = walk_source(self.sources[source], self.excluded)
        return self._source_files[source]

    def assume_walked(self, source: str, files: SourceFiles) -> None:
        """Take `files` as the source's files now, without walking them (the caller proves they are)."""
        self._source_files[source] = files

    @property
    def excluded(self) -> list[Path]:
        """What no source's files include: our outputs and the config file."""
        return [self.app.storage_root, self.app.path]

    def _sample_catalog(self, source: str) -> str:
        return self._of("sample_catalog", source, self.source_files(source), self.sources[source].chunk_rows)

    def _sample_length_chunk(self, key: str) -> str:
        source, index = split_chunk_partition(key)
        if source not in self._chunk_plans:
            self._chunk_plans[source] = ChunkPlan.load(StorageLayout(self.app.storage_root).chunk_plan(source))
        plan = self._chunk_plans[source]
        rows = plan.digests[index] if plan is not None and index < len(plan) else None
        # The chunk's rows, not the whole catalogue's record: records appended elsewhere leave it as it is.
        return self._of("sample_length_chunk", key, rows, self.sources[source].special_tokens_in_text,
                        self._sample_type(source))

    def _sample_lengths(self, source: str) -> str:
        return self._of("sample_lengths", source, self.recorded("sample_catalog", source),
                        self.sources[source].special_tokens_in_text, self._sample_type(source))

    def _packing_bins(self, source: str) -> str:
        return self._of("packing_bins", source, self._read_with_catalogue("sample_lengths", source), self._sample_type(source))

    def _packed_json(self, source: str) -> str:
        return self._of("packed_json", source, self._read_with_catalogue("packing_bins", source), self._sample_type(source))

    def _packed_wds_shards(self, source: str) -> str:
        return self._of("packed_wds_shards", source, self._read_with_catalogue("packed_json", source))

    def _read_with_catalogue(self, upstream: str, source: str) -> list[str]:
        """These steps read the catalogue (messages, media refs) beside their upstream table."""
        return [self.recorded(upstream, source), self.recorded("sample_catalog", source)]

    def _energon_dataset(self, source: str) -> str:
        return self._of("energon_dataset", source, self.recorded("packed_wds_shards", source),
                        self._sample_type(source), self.sources[source].subflavors)

    def _sample_type(self, source: str) -> str:
        return self.app.sample_type_of(self.sources[source])

    # -- across sources --------------------------------------------------------------------------
    def _training_mix(self, _: None) -> str:
        # An inbox source with no dataset yet is left out of the mix (VlmConfig.mix_sources), so its
        # arrival alone changes nothing the mix reads.
        configured = {source.name for source in self.app.sources}
        return self._of("training_mix", None, [
            (name, dataset, source.weight, self._sample_type(name), source.subflavors)
            for name, source in sorted(self.sources.items())
            for dataset in [self.recorded("energon_dataset", name)] if dataset or name in configured
        ])

    def _video_frame_plan(self, _: None) -> str:
        # Pre-computed frame counts are read as the videos of their source's media root.
        known = [(name, str(source.media_root), str(path), path.stat().st_size, path.stat().st_mtime_ns)
                 for name, source in sorted(self.sources.items()) for path in frames_source_files(source)]
        # A source without a catalogue yet is skipped by the plan (and joins it when catalogued).
        catalogues = [recorded for name in sorted(self.sources) for recorded in [self.recorded("sample_catalog", name)] if recorded]
        return self._of("video_frame_plan", None, catalogues, known)

    def _frame_cache_shard(self, shard: str | None) -> str:
        """A shard's bytes follow from its members in the plan on disk (what its step reads) and the settings."""
        members = self._plan_shards().get(shard or "", [])
        return self._of("frame_cache_shard", shard, plan_digest(members, self.app.frame_cache))

    def _frame_cache_index(self, _: None) -> str:
        """The index follows from the whole plan on disk and the shards as recorded."""
        plan_bytes = plan_file_digest(self._frame_cache_dir())
        shards = sorted((shard, self.recorded("frame_cache_shard", shard)) for shard in self._plan_shards())
        return self._of("frame_cache_index", None, plan_bytes, shards)

    def _plan_shards(self) -> dict[str, list]:
        """The plan's shards and their videos, read again only when the plan file was rewritten: a
        run asks for every shard's fingerprint, and a big plan holds hundreds of shards."""
        cache_dir = self._frame_cache_dir()
        try:
            stat = (cache_dir / PLAN_FILE).stat()
            identity: tuple = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except FileNotFoundError:
            identity = ()
        if self._plan is None or self._plan[0] != identity:
            self._plan = (identity, shard_members(read_plan(cache_dir)))
        return self._plan[1]

    def _training_package(self, _: None) -> str:
        index = self.recorded("frame_cache_index", None) if "frame_cache" in self.app.package.include else None
        return self._of("training_package", None, self.recorded("training_mix", None), index)

    def _frame_cache_dir(self) -> Path:
        return StorageLayout(self.app.storage_root).frame_cache_dir(self.app.frame_cache)
