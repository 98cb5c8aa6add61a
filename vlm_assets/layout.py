"""Where every output lives under `storage.root` (docs/formats.md); the only place paths are spelled."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlm_assets.config import FrameCacheConfig


# The training mix's file in the packed_wds folder (and in a package's packed_wds role).
METADATASET_NAME = "metadataset.yaml"
# Which config file owns a storage root (vlm_assets.root_owner).
OWNER_NAME = ".vlm_assets_owner.json"
# A package's file name ends by its outer compression (`package.compress`).
PACKAGE_EXTENSIONS = {"gzip": ".nnpkg", "zstd": ".nnpkg.zst"}
# The top-level folder of each kind of output, in build order.
OUTPUT_FOLDERS = ("catalog", "dedup", "lengths", "packing", "packed_json", "packed_wds", "frame_cache", "packages")


@dataclass(frozen=True)
class StorageLayout:
    root: Path

    @property
    def owner(self) -> Path:
        """Which config file owns this root (vlm_assets.root_owner)."""
        return self.root / OWNER_NAME

    def catalog(self, source: str) -> Path:
        return self.root / "catalog" / f"{source}.parquet"

    def chunk_plan(self, source: str) -> Path:
        """How the catalogue is cut into chunks whose lengths are measured apart (tokens.chunk_plan)."""
        return self.root / "catalog" / f"{source}.chunks.json"

    def catalog_read_mark(self, source: str) -> Path:
        """What the last build of a JSON-lines source's catalogue read (catalog.appending)."""
        return self.root / "catalog" / f"{source}.read.json"

    def media_checks(self, source: str) -> Path:
        return self.root / "catalog" / f"{source}.media_checks.sqlite"

    def dedup(self, source: str) -> Path:
        """The samples `sample_dedup` removed from the source, each with the sample kept and why (vlm_assets.dedup)."""
        return self.root / "dedup" / f"{source}.parquet"

    def dedup_signatures(self, source: str) -> Path:
        """The signatures of the source's catalogued samples, kept for a rebuild to reuse (vlm_assets.dedup.signatures)."""
        return self.root / "dedup" / f"{source}.signatures.parquet"

    def lengths(self, source: str) -> Path:
        return self.root / "lengths" / f"{source}.parquet"

    def lengths_failed_check(self, source: str) -> Path:
        """Where a length table that failed `lengths_match_processor` is moved, for inspection."""
        return self.root / "lengths" / f"{source}.failed-check.parquet"

    def bins(self, source: str) -> Path:
        return self.root / "packing" / f"{source}.bins.parquet"

    def rejects(self, source: str) -> Path:
        return self.root / "packing" / f"{source}.rejects.parquet"

    def packed_json(self, source: str) -> Path:
        return self.root / "packed_json" / f"{source}.jsonl"

    @property
    def packed_wds_root(self) -> Path:
        return self.root / "packed_wds"

    def packed_wds(self, source: str) -> Path:
        """A source's shards; with its `.nv-meta`, that source's own Energon dataset."""
        return self.packed_wds_root / source

    def empty_dataset(self, source: str) -> Path:
        """In place of the Energon dataset of a source with no sample to pack, why it has none
        (vlm_assets.packing.empty)."""
        return self.packed_wds(source) / "empty.json"

    @property
    def metadataset(self) -> Path:
        """The training mix: an Energon metadataset blending every source's dataset."""
        return self.packed_wds_root / METADATASET_NAME

    def frame_cache(self, frame_size: int, num_frames: int) -> Path:
        return self.root / "frame_cache" / str(frame_size) / str(num_frames)

    def frame_cache_dir(self, settings: FrameCacheConfig) -> Path:
        """The frame cache built with `settings` (the config's `frame_cache:` section); use this one."""
        return self.frame_cache(settings.frame_size, settings.num_frames)

    def mosaic_spool(self, settings: FrameCacheConfig) -> Path:
        """Mosaics the catalogue rendered for that frame cache, until its shards take them (outside it: not packaged)."""
        return self.root / "spool" / "frame_cache" / str(settings.frame_size) / str(settings.num_frames)

    def media_copies(self, source: str) -> Path:
        """Copies of the source's images on object storage that its catalogue read, until its shards take them."""
        return self.root / "spool" / "media" / source

    def length_chunks(self, source: str) -> Path:
        """Token lengths of the source's catalogue chunks measured so far, for a rebuild to reuse (see tokens.table)."""
        return self.root / "spool" / "lengths" / source

    def checked_shards(self, source: str) -> Path:
        """The source's shards that passed the member check, as they were then (vlm_assets.packing.verify.CheckedShards)."""
        return self.root / "spool" / "shards" / f"{source}.checked.json"

    def energon_prepared(self, source: str) -> Path:
        """What the source's last Energon prepare indexed (vlm_assets.packing.energon.PreparedRecord)."""
        return self.root / "spool" / "energon" / f"{source}.prepared.json"

    def energon_loaded(self, source: str) -> Path:
        """The index whose every sample the source's load check last loaded (see defs/packing/checks.py)."""
        return self.root / "spool" / "energon" / f"{source}.loaded.json"

    @property
    def packages(self) -> Path:
        return self.root / "packages"

    def package_file(self, name: str, compress: str) -> Path:
        return self.packages / (name + PACKAGE_EXTENSIONS[compress])

    @property
    def output_folders(self) -> list[Path]:
        return [self.root / name for name in OUTPUT_FOLDERS]

    # Names of the locks (vlm_assets.locks) that keep concurrent runs on this root apart.
    @staticmethod
    def source_lock(source: str) -> str:
        """Held by each step writing a source's outputs (its Energon metadata too); shared by readers of them."""
        return f"source-{source}"

    TRAINING_MIX_LOCK = "packed_wds-metadataset"

    @staticmethod
    def frame_cache_lock(frame_size: int, num_frames: int, part: str) -> str:
        """`part`: plan, index, a shard key, or `content` (shared by shard builders, exclusive for packaging)."""
        return f"frame_cache-{frame_size}-{num_frames}-{part}"

    @staticmethod
    def package_lock(name: str) -> str:
        return f"package-{name}"
