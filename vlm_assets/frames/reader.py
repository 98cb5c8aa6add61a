"""Read cached frames back: one seek into the shard tar per video, no tar scanning."""

from __future__ import annotations

import difflib
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from vlm_assets.frames.index import FAILURES_FILE, INDEX_FILE, METADATA_FILE
from vlm_assets.frames.mosaic import split_mosaic
from vlm_assets.frames.shard import tar_path
from vlm_assets.wording import plural

SHOWN_KEYS = 5


class FrameCacheReader:
    """Frames of cached videos by media key (`<source>/<relative path>`)."""

    def __init__(self, cache_dir: str | Path) -> None:
        self.cache_dir = Path(cache_dir)
        metadata_path = self.cache_dir / METADATA_FILE
        if not metadata_path.is_file():
            raise FileNotFoundError(f"{metadata_path}: no frame cache here (materialise frame_cache_index first)")
        self.metadata = json.loads(metadata_path.read_text(encoding="utf-8"))
        self.records: dict[str, dict] = {}
        with open(self.cache_dir / INDEX_FILE, encoding="utf-8") as handle:
            for line in handle:
                record = json.loads(line)
                self.records[record["video"]] = record

    def __contains__(self, video: str) -> bool:
        return video in self.records

    def record(self, video: str) -> dict:
        try:
            return self.records[video]
        except KeyError:
            raise KeyError(f"{video!r} is not in the frame cache at {self.cache_dir}: {self._why_missing(video)}") from None

    def _why_missing(self, video: str) -> str:
        """The video's caching error if it failed; else a few cached keys (the most similar first) and the total."""
        failures = self.cache_dir / FAILURES_FILE
        if failures.is_file():
            for line in failures.read_text(encoding="utf-8").splitlines():
                failure = json.loads(line)
                if failure["video"] == video:
                    return f"it could not be cached: {failure['error']}"
        if not self.records:
            return "it holds no videos"
        similar = difflib.get_close_matches(video, list(self.records), n=SHOWN_KEYS, cutoff=0.6)
        shown = (similar + [key for key in self.records if key not in similar])[:SHOWN_KEYS]
        more = ", …" if len(self.records) > len(shown) else ""
        return f"it holds {plural(len(self.records), 'video key')}, e.g. {', '.join(shown)}{more}"

    def read_jpeg(self, video: str) -> bytes:
        record = self.record(video)
        with open(tar_path(self.cache_dir, record["shard"]), "rb") as handle:
            handle.seek(record["offset"])
            data = handle.read(record["size"])
        if len(data) != record["size"]:
            raise OSError(f"{record['shard']}.tar: truncated at offset {record['offset']} for {video!r}")
        return data

    def read(self, video: str) -> np.ndarray:
        """(num_frames, frame_size, frame_size, 3) uint8 frames of `video`, in sampled order."""
        with Image.open(io.BytesIO(self.read_jpeg(video))) as image:
            mosaic = np.asarray(image.convert("RGB"))
        meta = self.metadata
        return split_mosaic(mosaic, meta["rows"], meta["cols"], meta["num_frames"])
