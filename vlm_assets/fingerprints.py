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

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlm_assets.asset_specs import SPECS, Partitioning
from vlm_assets.catalog.source_walk import SourceFiles, walk_source
from vlm_assets.config import AppConfig, SourceConfig
from vlm_assets.dedup.decisions import decisions_digest
from vlm_assets.dedup.order import priority_order
from vlm_assets.frames.plan import (
    PLAN_FILE,
    frames_source_files,
    plan_file_digest,
    read_plan,
    shard_members,
)
from vlm_assets.frames.shard import plan_digest
from vlm_assets.layout import StorageLayout
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

    def _sample_dedup(self, source: str) -> str:
        # Its decisions follow from the catalogues kept before its own; it reads every source's built so
        # far, as its dependency in the graph says (so the UI agrees), in keep order.
        return self._of("sample_dedup", source, [
            (name, recorded) for name in priority_order(self.sources, self.app.dedup.priority)
            for recorded in [self.recorded("sample_catalog", name)] if recorded or name == source])

    def dedup_ahead(self, source: str) -> list[str]:
        """The sources whose kept samples win over `source`'s, in keep order."""
        order = priority_order(self.sources, self.app.dedup.priority)
        return order[:order.index(source)]

    def dedup_behind(self, source: str) -> list[str]:
        """The sources whose kept samples come after `source`'s, in keep order (but for those already packed)."""
        order = priority_order(self.sources, self.app.dedup.priority)
        return order[order.index(source) + 1:]

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
        # The dedup decisions by their bytes, not sample_dedup's record: a catalogue ahead rebuilt
        # without changing what this source loses leaves its lengths as they are.
        return self._of("sample_lengths", source, self.recorded("sample_catalog", source),
                        decisions_digest(StorageLayout(self.app.storage_root).dedup(source)),
                        self.sources[source].special_tokens_in_text, self._sample_type(source))

    def _packing_bins(self, source: str) -> str:
        return self._of("packing_bins", source, self._upstream_records("packing_bins", source), self._sample_type(source))

    def _packed_json(self, source: str) -> str:
        return self._of("packed_json", source, self._upstream_records("packed_json", source), self._sample_type(source))

    def _packed_wds_shards(self, source: str) -> str:
        return self._of("packed_wds_shards", source, self._upstream_records("packed_wds_shards", source))

    def _upstream_records(self, asset: str, source: str) -> list[str]:
        """The fingerprints the source's partition of each of `asset`'s declared upstreams recorded (the
        catalogue's among them where the step reads its messages or media refs beside its upstream table)."""
        return [self.recorded(upstream, source) for upstream in SPECS[asset].upstream]

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
        # A source without token lengths yet is skipped by the plan (and joins it once measured).
        accepted = [self._upstream_records("video_frame_plan", name) for name in sorted(self.sources)
                    if self.recorded("sample_lengths", name)]
        return self._of("video_frame_plan", None, accepted, known)

    def _frame_cache_shard(self, shard: str | None) -> str:
        """A shard's bytes follow from its members in the plan on disk (what its step reads), their
        files as they are now, and the settings (plan_digest)."""
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
