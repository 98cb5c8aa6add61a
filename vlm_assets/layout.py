"""Where every output lives under `storage.root` (SPEC §4); the only place paths are spelled."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StorageLayout:
    root: Path

    def catalog(self, source: str) -> Path:
        return self.root / "catalog" / f"{source}.parquet"

    def media_checks(self, source: str) -> Path:
        return self.root / "catalog" / f"{source}.media_checks.jsonl"

    def lengths(self, source: str) -> Path:
        return self.root / "lengths" / f"{source}.parquet"

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
        return self.packed_wds_root / source

    def frame_cache(self, frame_size: int, num_frames: int) -> Path:
        return self.root / "frame_cache" / str(frame_size) / str(num_frames)

    @property
    def packages(self) -> Path:
        return self.root / "packages"

    @property
    def processor_cache(self) -> Path:
        return self.root / "processor"
