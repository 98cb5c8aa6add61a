"""The graph's assets, one spec each, upstream first: everything vlm-assets knows about an asset
that is not how it is built.

A spec names the asset, its code revision, how it is partitioned, its upstream assets, the config
values its step reads, the files that must exist for it to count as built, what it publishes to
object storage, and the storage locks its step holds. Fingerprints, freshness, publishing, the
sensors, `vlm-assets run --select` and the Dagster definitions all read these specs; the build
functions live in `vlm_assets.defs.<group>.assets`.

Bump an asset's revision when a code change alters what it writes: its fingerprint changes
(vlm_assets.fingerprints), so every output it wrote before is rebuilt.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vlm_assets.config import AppConfig
from vlm_assets.frames.index import INDEX_FILE
from vlm_assets.frames.plan import PLAN_FILE
from vlm_assets.frames.render import mosaic_settings
from vlm_assets.frames.shard import done_path, tar_path
from vlm_assets.layout import StorageLayout
from vlm_assets.packing.energon import DATASET_YAML, MAIN_FOLDER_NAME
from vlm_assets.packing.wds import shard_name
from vlm_assets.tokens.chunk_plan import split_chunk_partition


class Partitioning(enum.Enum):
    SOURCES = "one partition per source"
    SOURCE_CHUNKS = "one partition per chunk of a source's catalogue"
    FRAME_CACHE_SHARDS = "one partition per frame-cache shard"
    NONE = "not partitioned"


@dataclass(frozen=True)
class Locks:
    """Storage locks (vlm_assets.locks) a step holds while it writes: exclusive ones alone, shared ones with other readers."""

    exclusive: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()


# (storage layout, partition or "", config) -> paths
Paths = Callable[[StorageLayout, str, AppConfig], list[Path]]
# (storage layout, partition or "", config, every source's name) -> locks
LocksOf = Callable[[StorageLayout, str, AppConfig, tuple[str, ...]], Locks]
# (storage layout, partition or "", its last materialisation's metadata values) -> each damage, named
DamageOf = Callable[[StorageLayout, str, dict[str, object]], list[str]]


@dataclass(frozen=True)
class AssetSpec:
    name: str
    revision: int
    group: str
    partitioning: Partitioning
    upstream: tuple[str, ...]
    # The global config values the step reads (per-source ones reach it as inputs, see Fingerprints).
    settings: Callable[[AppConfig], list[Any]]
    # What must exist for an output to count as built.
    outputs: Paths
    locks: LocksOf
    # Whether the processor's fingerprint (its files, kwargs and the transformers release) is a setting.
    reads_processor: bool = False
    # Whether the step or its checks run Megatron-Energon (importing it and torch: seconds of a core).
    runs_energon: bool = False
    # What a build publishes to object storage, files and folders mirrored whole (None: its outputs).
    published: Paths | None = None
    # Damage to its outputs beyond a missing or cut-short file, judged from what its build recorded.
    damage: DamageOf | None = None
    # Upstream assets partitioned alike of which a partition reads every partition, not its own alone.
    reads_every_partition_of: tuple[str, ...] = ()

    def publishes(self, layout: StorageLayout, partition: str | None, app: AppConfig) -> list[Path]:
        return (self.published or self.outputs)(layout, partition or "", app)

    def outputs_of(self, layout: StorageLayout, partition: str | None, app: AppConfig) -> list[Path]:
        return self.outputs(layout, partition or "", app)

    def locks_of(self, layout: StorageLayout, partition: str | None, app: AppConfig, sources: Iterable[str]) -> Locks:
        return self.locks(layout, partition or "", app, tuple(sources))


def _writes_source(layout: StorageLayout, source: str, _app: AppConfig, _sources: tuple[str, ...]) -> Locks:
    return Locks(exclusive=(layout.source_lock(source),))


def _frame_cache_lock(layout: StorageLayout, app: AppConfig, part: str) -> str:
    return layout.frame_cache_lock(app.frame_cache.frame_size, app.frame_cache.num_frames, part)


def _frame_cache_dir(layout: StorageLayout, app: AppConfig) -> Path:
    return layout.frame_cache_dir(app.frame_cache)


def _lengths_settings(app: AppConfig) -> list[Any]:
    fc = app.frame_cache
    return [app.model.model_type, fc.num_frames, fc.frame_size, asdict(app.trainer)]


def _frame_settings(app: AppConfig) -> list[Any]:
    fc = app.frame_cache
    return [fc.num_frames, fc.frame_size, fc.rows, fc.cols, fc.jpeg_quality]


ASSET_SPECS: tuple[AssetSpec, ...] = (
    AssetSpec(
        "sample_catalog", 7, "catalog", Partitioning.SOURCES, ("source_files",),
        settings=lambda app: [app.sample.text_key, app.frame_cache.num_frames],
        outputs=lambda layout, source, _app: [layout.catalog(source), layout.chunk_plan(source)],
        locks=_writes_source,
    ),
    AssetSpec(
        "sample_dedup", 2, "dedup", Partitioning.SOURCES, ("sample_catalog",),
        # A source is compared with the samples kept in the sources before it: their catalogues are
        # built first (its fingerprint names only those, Fingerprints._sample_dedup).
        reads_every_partition_of=("sample_catalog",),
        # packing.mode: in append mode the samples already packed are kept first (vlm_assets.dedup.decide).
        settings=lambda app: [app.dedup.decision_settings(), mosaic_settings(app.frame_cache), app.packing.mode],
        outputs=lambda layout, source, _app: [layout.dedup(source), layout.dedup_signatures(source)],
        locks=_writes_source,
    ),
    AssetSpec(
        "sample_length_chunk", 5, "catalog", Partitioning.SOURCE_CHUNKS, ("sample_catalog",),
        settings=_lengths_settings, reads_processor=True,
        # Kept in the chunk store for sample_lengths to assemble, not an output of its own.
        outputs=lambda _layout, _chunk, _app: [],
        locks=lambda layout, chunk, _app, _sources: Locks(shared=(layout.source_lock(split_chunk_partition(chunk)[0]),)),
    ),
    AssetSpec(
        "sample_lengths", 4, "catalog", Partitioning.SOURCES, ("sample_catalog", "sample_dedup", "sample_length_chunk"),
        settings=_lengths_settings, reads_processor=True,
        outputs=lambda layout, source, _app: [layout.lengths(source)],
        locks=_writes_source,
    ),
    AssetSpec(
        "packing_bins", 3, "packing", Partitioning.SOURCES, ("sample_lengths", "sample_catalog"),
        settings=lambda app: [app.sample.sample_type, app.sample.max_token_len, app.packing.min_fill_ratio,
                              app.packing.mode],
        outputs=lambda layout, source, _app: [layout.bins(source), layout.rejects(source)],
        locks=_writes_source,
    ),
    AssetSpec(
        "packed_json", 2, "packing", Partitioning.SOURCES, ("packing_bins", "sample_catalog"),
        settings=lambda app: [app.sample.sample_type],
        outputs=lambda layout, source, _app: [layout.packed_json(source)],
        locks=_writes_source,
    ),
    AssetSpec(
        "packed_wds_shards", 2, "packing", Partitioning.SOURCES, ("packed_json", "sample_catalog"),
        settings=lambda app: [app.wds.maxcount, app.wds.maxsize, app.packing.mode],
        outputs=lambda layout, source, _app: [layout.packed_wds(source)],
        locks=_writes_source,
        damage=lambda layout, source, recorded: _shards_damage(layout, source, recorded, with_energon_index=False),
    ),
    AssetSpec(
        "energon_dataset", 4, "packing", Partitioning.SOURCES, ("packed_wds_shards",),
        settings=lambda app: [app.sample.sample_type], runs_energon=True,
        # A source with no sample to pack has no Energon dataset, but the record saying why (packing.empty).
        outputs=lambda layout, source, _app: [layout.empty_dataset(source) if layout.empty_dataset(source).is_file()
                                              else layout.packed_wds(source) / MAIN_FOLDER_NAME / DATASET_YAML],
        published=lambda layout, source, _app: [layout.packed_wds(source)],
        locks=_writes_source,
        damage=lambda layout, source, recorded: _shards_damage(layout, source, recorded, with_energon_index=True),
    ),
    AssetSpec(
        "training_mix", 2, "packing", Partitioning.NONE, ("energon_dataset",),
        settings=lambda app: [app.sample.sample_type], runs_energon=True,
        outputs=lambda layout, _partition, _app: [layout.metadataset],
        locks=lambda layout, _partition, _app, sources: Locks(
            exclusive=(layout.TRAINING_MIX_LOCK,), shared=tuple(layout.source_lock(source) for source in sources)),
    ),
    AssetSpec(
        "video_frame_plan", 3, "frame_cache", Partitioning.NONE, ("sample_lengths", "sample_catalog"),
        settings=lambda app: [app.frame_cache.num_frames, app.frame_cache.videos_per_shard],
        outputs=lambda layout, _partition, app: [_frame_cache_dir(layout, app) / PLAN_FILE],
        locks=lambda layout, _partition, app, _sources: Locks(exclusive=(_frame_cache_lock(layout, app, "plan"),)),
    ),
    AssetSpec(
        "frame_cache_shard", 2, "frame_cache", Partitioning.FRAME_CACHE_SHARDS, ("video_frame_plan",),
        settings=_frame_settings,
        outputs=lambda layout, shard, app: [tar_path(_frame_cache_dir(layout, app), shard),
                                            done_path(_frame_cache_dir(layout, app), shard)],
        locks=lambda layout, shard, app, _sources: Locks(exclusive=(_frame_cache_lock(layout, app, shard),),
                                                         shared=(_frame_cache_lock(layout, app, "content"),)),
    ),
    AssetSpec(
        "frame_cache_index", 1, "frame_cache", Partitioning.NONE, ("video_frame_plan", "frame_cache_shard"),
        settings=_frame_settings,
        outputs=lambda layout, _partition, app: [_frame_cache_dir(layout, app) / INDEX_FILE],
        published=lambda layout, _partition, app: [_frame_cache_dir(layout, app)],
        locks=lambda layout, _partition, app, _sources: Locks(exclusive=(_frame_cache_lock(layout, app, "index"),)),
    ),
    AssetSpec(
        "training_package", 2, "package", Partitioning.NONE, ("training_mix", "frame_cache_index"),
        settings=lambda app: [app.package.name, app.package.compress, list(app.package.include),
                              app.package.hyperparameters, app.package.train_command],
        outputs=lambda layout, _partition, app: [layout.package_file(app.package.name, app.package.compress)],
        # Packaging reads every finished output: nothing may write one meanwhile.
        locks=lambda layout, _partition, app, sources: Locks(
            exclusive=(layout.package_lock(app.package.name), _frame_cache_lock(layout, app, "content")),
            shared=(layout.TRAINING_MIX_LOCK, _frame_cache_lock(layout, app, "plan"),
                    _frame_cache_lock(layout, app, "index"), *(layout.source_lock(source) for source in sources))),
    ),
)
SPECS: dict[str, AssetSpec] = {spec.name: spec for spec in ASSET_SPECS}
ASSET_NAMES = tuple(SPECS)


def spec_of(asset: str) -> AssetSpec:
    return SPECS[asset]


def _built_by(selection: Iterable[str] | None) -> set[str]:
    """The assets building `selection` (asset names or `asset[partition]`, and what they read; None:
    every asset) may build."""
    todo = [selected_asset(item)[0] for item in selection] if selection else list(SPECS)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in SPECS and name not in seen:
            seen.add(name)
            todo.extend(SPECS[name].upstream)
    return seen


def reads_the_processor(selection: Iterable[str] | None) -> bool:
    """Whether building `selection` runs a step that loads the model's processor."""
    return any(SPECS[name].reads_processor for name in _built_by(selection))


def runs_energon(selection: Iterable[str] | None) -> bool:
    """Whether building `selection` runs a step or check that runs Megatron-Energon."""
    return any(SPECS[name].runs_energon for name in _built_by(selection))


def source_lineage() -> list[str]:
    """What a new source needs built, in order: every asset partitioned by source."""
    return [spec.name for spec in SPECS.values() if spec.partitioning is Partitioning.SOURCES]


# `run --select` names an asset, or one partition of it as `asset[partition]`.
SELECTED_PARTITION = re.compile(r"^(?P<asset>[^\[\]]+)\[(?P<partition>[^\[\]]+)\]$")


def may_measure_lengths(selection: Iterable[str] | None, app: AppConfig, force: bool) -> bool:
    """Whether building `selection` may measure token lengths, loading the model's processor: it
    reads the processor, and `force` or a selected source has no length table yet. A guess from the
    files alone, for what to load ahead of the runs: a source whose table is there but stale is
    measured all the same, loading the processor where it is needed."""
    if not reads_the_processor(selection):
        return False
    if force:
        return True
    configured = [source.name for source in app.sources]
    items = [selected_asset(item) for item in selection or ()]
    named = {source for _, partition in items if partition for source in configured
             if partition == source or partition.endswith(f"|{source}")}
    sources = configured if not items or any(partition is None for _, partition in items) or not named else named
    layout = StorageLayout(app.storage_root)
    return any(not layout.lengths(source).exists() for source in sources)


def selected_asset(item: str) -> tuple[str, str | None]:
    """One `run --select` item as (asset, partition or None); ValueError naming the known assets when
    the asset is none of them."""
    match = SELECTED_PARTITION.match(item)
    asset, partition = (match["asset"], match["partition"]) if match else (item, None)
    if asset not in SPECS:
        raise ValueError(f"unknown asset key(s): {asset} (known: {', '.join(sorted(ASSET_NAMES))})")
    return asset, partition


def damaged_outputs(layout: StorageLayout, asset: str, partition: str | None, app: AppConfig,
                    recorded: dict[str, object]) -> list[str]:
    """What of `asset`'s outputs on disk no longer matches what its last materialisation recorded
    (`recorded`: its metadata values): a file missing or cut short, each named. Reads no data,
    only sizes and a Parquet file's closing bytes."""
    outputs = spec_of(asset).outputs_of(layout, partition, app)
    damage = [f"{path} is missing" for path in outputs if not path.exists()]
    damage += [f"{path} is cut short (no Parquet footer)" for path in outputs
               if path.suffix == ".parquet" and path.is_file() and not _ends_as_parquet(path)]
    damage_of = spec_of(asset).damage
    return damage + (damage_of(layout, partition or "", recorded) if damage_of is not None else [])


def _shards_damage(layout: StorageLayout, source: str, recorded: dict[str, object], with_energon_index: bool) -> list[str]:
    """A source's shards (as many as its build recorded) missing or cut short; with Energon's index, its files missing."""
    if "shards" not in recorded or recorded.get("empty"):
        return []  # an empty source has neither shards nor Energon's index
    folder = layout.packed_wds(source)
    shards = [folder / shard_name(index) for index in range(int(str(recorded["shards"])))]
    damage = [f"{shard} is missing" for shard in shards if not shard.is_file()]
    if not with_energon_index and not damage and "bytes" in recorded:
        # `bytes` counts the tar blocks written; each file ends padded to whole tar records.
        size = sum(shard.stat().st_size for shard in shards)
        if size < int(str(recorded["bytes"])) or any(shard.stat().st_size % TAR_RECORD for shard in shards):
            damage.append(f"the shards in {folder} are cut short ({size} bytes on disk, {recorded['bytes']} written)")
    if with_energon_index:
        needed = [Path(f"{shard}.idx") for shard in shards] + [folder / MAIN_FOLDER_NAME / "index.sqlite"]
        damage += [f"{path} is missing (Energon's index)" for path in needed if not path.is_file()]
    return damage


PARQUET_MAGIC = b"PAR1"
TAR_RECORD = 10240  # tarfile pads an archive to whole records of 20 blocks


def _ends_as_parquet(path: Path) -> bool:
    with open(path, "rb") as handle:
        handle.seek(0, 2)
        if handle.tell() < len(PARQUET_MAGIC):
            return False
        handle.seek(-len(PARQUET_MAGIC), 2)
        return handle.read() == PARQUET_MAGIC
