"""What each asset's output is a function of, as short digests.

Every asset's bytes are determined by its code revision, the config settings it reads and its
inputs. `code_versions` digests the first two per asset (Dagster shows them as code versions, so a
config change marks exactly the assets that read the changed settings as stale); `Fingerprints`
adds the inputs: the files of a source (path, size, modification time) for the catalogue, the
upstream fingerprints for everything after it. An asset records its fingerprint as its data
version, and `vlm-assets run` skips an asset whose recorded fingerprint equals the current one.

Bump an asset's entry in REVISIONS when a code change alters what it writes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from stat import S_ISLNK
from typing import Any

from vlm_assets.config import AppConfig, SourceConfig
from vlm_assets.frames.plan import (
    PLAN_FILE,
    frames_source_files,
    read_plan,
    shard_members,
)
from vlm_assets.frames.shard import plan_digest
from vlm_assets.layout import StorageLayout

REVISIONS = {
    "sample_catalog": 3,
    "sample_lengths": 2,
    "packing_bins": 1,
    "packed_json": 1,
    "packed_wds_shards": 1,
    "energon_dataset": 2,
    "training_mix": 1,
    "video_frame_plan": 2,
    "frame_cache_shard": 2,
    "frame_cache_index": 1,
    "training_package": 1,
}


def digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _settings(app: AppConfig, processor_fingerprint: str) -> dict[str, Any]:
    """The config values each asset reads (beyond its inputs)."""
    fc, sample = app.frame_cache, app.sample
    return {
        "sample_catalog": [sample.text_key, fc.num_frames],
        "sample_lengths": [processor_fingerprint, fc.num_frames, fc.frame_size],
        "packing_bins": [sample.sample_type, sample.max_token_len],
        "packed_json": [sample.sample_type],
        "packed_wds_shards": [app.wds.maxcount, app.wds.maxsize],
        "energon_dataset": [sample.sample_type],
        "training_mix": [sample.sample_type],
        "video_frame_plan": [fc.num_frames, fc.videos_per_shard],
        "frame_cache_shard": [fc.num_frames, fc.frame_size, fc.rows, fc.cols, fc.jpeg_quality],
        "frame_cache_index": [fc.num_frames, fc.frame_size, fc.rows, fc.cols, fc.jpeg_quality],
        "training_package": [app.package.name, app.package.compress, list(app.package.include),
                             app.package.hyperparameters, app.package.train_command],
    }


def code_versions(app: AppConfig, processor_fingerprint: str) -> dict[str, str]:
    settings = _settings(app, processor_fingerprint)
    return {name: f"r{revision}-{digest(settings[name])[:12]}" for name, revision in REVISIONS.items()}


def source_files_digest(source: SourceConfig, excluded: Iterable[Path]) -> str:
    """Digest of every file a source can read (its path, media root and allowed roots, by name, size
    and mtime), of how it reads them (its kind) and of its input limits.

    Hidden entries and `excluded` trees (the storage root, the config file) are left out, so our
    own outputs and config edits never count as a change of the input.
    """
    skip = {os.path.realpath(path) for path in excluded}
    entries: list[tuple[str, int, int]] = []
    for root in sorted({source.path, source.media_root, *source.allowed_roots}):
        entries.extend(_tree_entries(Path(root), skip))
    limits = [[str(root) for root in source.allowed_roots], source.max_record_bytes, source.max_json_depth]
    return digest(source.kind, str(source.path), str(source.media_root), limits, sorted(set(entries)))


def _tree_entries(root: Path, skip: set[str]) -> list[tuple[str, int, int]]:
    if root.is_file():
        stat = root.stat()
        return [(str(root), stat.st_size, stat.st_mtime_ns)]
    # A plain file is an excluded one only if its name is: resolving every file's path would cost
    # more than the rest of the walk (a source holds millions of images).
    skipped_names = {os.path.basename(path) for path in skip}
    entries = []
    for directory, subdirectories, files in os.walk(root, followlinks=True):
        subdirectories[:] = sorted(
            name for name in subdirectories
            if not name.startswith(".") and os.path.realpath(os.path.join(directory, name)) not in skip
        )
        for name in files:
            if name.startswith("."):
                continue
            path = os.path.join(directory, name)
            try:
                info = os.lstat(path)
                if S_ISLNK(info.st_mode) or name in skipped_names:
                    if os.path.realpath(path) in skip:
                        continue
                    info = os.stat(path)
            except OSError:
                entries.append((path, -1, -1))  # a dangling link still counts: its rejection is an output
                continue
            entries.append((path, info.st_size, info.st_mtime_ns))
    return entries


class Fingerprints:
    """Current fingerprints of the graph's assets for one config (memoised; cheap to call)."""

    def __init__(self, app: AppConfig, processor_fingerprint: str, sources: list[SourceConfig]) -> None:
        self.app = app
        self.versions = code_versions(app, processor_fingerprint)
        self.sources = {source.name: source for source in sources}
        self._memo: dict[tuple[str, str | None], str] = {}

    def _of(self, asset: str, partition: str | None, *inputs: Any) -> str:
        return digest(asset, self.versions[asset], partition, *inputs)

    def of(self, asset: str, partition: str | None = None) -> str:
        """The current fingerprint of one asset (partition); frame-cache ones follow the plan on disk."""
        if asset == "frame_cache_shard":
            return self.frame_cache()[0].get(partition or "", "")
        if asset == "frame_cache_index":
            return self.frame_cache()[1]
        if asset == "training_package":
            index = self.frame_cache()[1] if "frame_cache" in self.app.package.include else None
            return self._of("training_package", None, self.of("training_mix"), index)
        key = (asset, partition)
        if key not in self._memo:
            self._memo[key] = getattr(self, f"_{asset}")(partition)
        return self._memo[key]

    # -- per source ------------------------------------------------------------------------------
    def _sample_catalog(self, source: str) -> str:
        excluded = [self.app.storage_root, self.app.path]
        return self._of("sample_catalog", source, source_files_digest(self.sources[source], excluded))

    def _sample_lengths(self, source: str) -> str:
        return self._of("sample_lengths", source, self.of("sample_catalog", source),
                        self.sources[source].special_tokens_in_text)

    def _packing_bins(self, source: str) -> str:
        return self._of("packing_bins", source, self.of("sample_lengths", source), self._sample_type(source))

    def _packed_json(self, source: str) -> str:
        return self._of("packed_json", source, self.of("packing_bins", source), self._sample_type(source))

    def _packed_wds_shards(self, source: str) -> str:
        return self._of("packed_wds_shards", source, self.of("packed_json", source))

    def _energon_dataset(self, source: str) -> str:
        subflavors = self.sources[source].subflavors
        return self._of("energon_dataset", source, self.of("packed_wds_shards", source), self._sample_type(source), subflavors)

    def _sample_type(self, source: str) -> str:
        return self.app.sample_type_of(self.sources[source])

    # -- across sources --------------------------------------------------------------------------
    def _training_mix(self, _: None) -> str:
        return self._of("training_mix", None, [
            (name, self.of("energon_dataset", name), self.sources[name].weight) for name in sorted(self.sources)
        ])

    def _video_frame_plan(self, _: None) -> str:
        files = sorted({path for source in self.sources.values() for path in frames_source_files(source)})
        known = [(str(path), path.stat().st_size, path.stat().st_mtime_ns) for path in files]
        return self._of("video_frame_plan", None, [self.of("sample_catalog", name) for name in sorted(self.sources)], known)

    def frame_cache(self) -> tuple[dict[str, str], str]:
        """(fingerprint of every planned shard, of the index over them) from the plan on disk.

        A shard's bytes follow from its members in the plan and the settings; the index from the
        whole plan and the shards.
        """
        settings = self.app.frame_cache
        cache_dir = StorageLayout(self.app.storage_root).frame_cache_dir(settings)
        plan = read_plan(cache_dir)
        shards = {
            shard: self._of("frame_cache_shard", shard, plan_digest(videos, settings))
            for shard, videos in shard_members(plan).items()
        }
        plan_file = cache_dir / PLAN_FILE
        plan_bytes = hashlib.sha256(plan_file.read_bytes()).hexdigest() if plan_file.is_file() else ""
        return shards, self._of("frame_cache_index", None, plan_bytes, sorted(shards.items()))
