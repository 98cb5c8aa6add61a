"""Merge finished shards into index.jsonl, failures.jsonl and metadata.json, and verify them."""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from vlm_assets.atomic import atomic_write_text
from vlm_assets.config import FrameCacheConfig
from vlm_assets.frames.plan import PlannedVideo, shard_members
from vlm_assets.frames.shard import ShardRecord, load_done_shard, tar_path
from vlm_assets.wording import plural

INDEX_FILE = "index.jsonl"
FAILURES_FILE = "failures.jsonl"
METADATA_FILE = "metadata.json"
MOSAIC_ORDER = "row-major"


@dataclass(frozen=True)
class IndexSummary:
    records: int  # index rows (one per media key)
    skipped: int  # keys whose shard is not built yet
    failed: int  # keys of videos that could not be cached
    videos: int  # unique files cached
    shards_done: int
    shards_pending: list[str]

    def line(self) -> str:
        return f"RGB cache: {plural(self.records, 'record')}, {self.skipped} skipped, {self.failed} failed"


def done_shards(cache_dir: Path, plan: list[PlannedVideo], config: FrameCacheConfig) -> dict[str, ShardRecord | None]:
    """Every planned shard with its current record (None while not built or stale)."""
    return {shard: load_done_shard(cache_dir, shard, videos, config) for shard, videos in shard_members(plan).items()}


def write_index(cache_dir: Path, plan: list[PlannedVideo], config: FrameCacheConfig) -> IndexSummary:
    shards = done_shards(cache_dir, plan, config)
    entries = {entry.video_id: entry for record in shards.values() if record for entry in record.entries}
    failures = {failure.video_id: failure.error for record in shards.values() if record for failure in record.failures}
    index_lines: list[str] = []
    failure_lines: list[str] = []
    skipped = videos = 0
    for video in plan:
        entry = entries.get(video.video_id)
        if entry is not None:
            videos += 1
            for key in video.keys:
                row = {
                    "video": key,
                    "shard": video.shard,
                    "offset": entry.offset,
                    "size": entry.size,
                    "frame_indices": entry.frame_indices,
                    "fps": entry.fps,
                    "total_frames": entry.total_frames,
                }
                index_lines.append(json.dumps(row) + "\n")
        elif video.video_id in failures:
            failure_lines.extend(json.dumps({"video": key, "error": failures[video.video_id]}) + "\n" for key in video.keys)
        else:
            skipped += len(video.keys)
    metadata = {
        "num_frames": config.num_frames,
        "frame_size": config.frame_size,
        "rows": config.rows,
        "cols": config.cols,
        "order": MOSAIC_ORDER,
        "jpeg_quality": config.jpeg_quality,
        "mosaic_width": config.cols * config.frame_size,
        "mosaic_height": config.rows * config.frame_size,
        "shards": sorted(shard for shard, record in shards.items() if record),
    }
    atomic_write_text(cache_dir / INDEX_FILE, "".join(index_lines))
    atomic_write_text(cache_dir / FAILURES_FILE, "".join(failure_lines))
    atomic_write_text(cache_dir / METADATA_FILE, json.dumps(metadata, indent=1) + "\n")
    return IndexSummary(
        records=len(index_lines),
        skipped=skipped,
        failed=len(failure_lines),
        videos=videos,
        shards_done=sum(1 for record in shards.values() if record),
        shards_pending=[shard for shard, record in shards.items() if record is None],
    )


def verify_shard(cache_dir: Path, record: ShardRecord, config: FrameCacheConfig) -> list[str]:
    """Problems with a built shard: the tar must hold exactly the recorded JPEGs at their offsets."""
    problems: list[str] = []
    path = tar_path(cache_dir, record.shard)
    expected = {entry.member: entry for entry in record.entries}
    with tarfile.open(path, "r:") as tar:
        members = tar.getmembers()
    names = [member.name for member in members]
    if sorted(names) != sorted(expected) or len(names) != len(set(names)):
        problems.append(f"{path.name}: members {sorted(names)} differ from the recorded {sorted(expected)}")
    size = (config.cols * config.frame_size, config.rows * config.frame_size)
    with open(path, "rb") as handle:
        for member in members:
            entry = expected.get(member.name)
            if entry is None:
                continue
            if (member.offset_data, member.size) != (entry.offset, entry.size):
                problems.append(f"{path.name}:{member.name}: at {member.offset_data}+{member.size}, recorded {entry.offset}+{entry.size}")
                continue
            handle.seek(entry.offset)
            with Image.open(io.BytesIO(handle.read(entry.size))) as image:
                if image.format != "JPEG" or image.size != size:
                    problems.append(f"{path.name}:{member.name}: {image.format} {image.size}, expected JPEG {size}")
    return problems


def verify_coverage(cache_dir: Path, plan: list[PlannedVideo]) -> list[str]:
    """Every planned media key is in index.jsonl or failures.jsonl, and none twice."""
    seen: dict[str, int] = {}
    for name in (INDEX_FILE, FAILURES_FILE):
        path = cache_dir / name
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                key = json.loads(line)["video"]
                seen[key] = seen.get(key, 0) + 1
    planned = [key for video in plan for key in video.keys]
    problems = [f"{key}: neither cached nor failed" for key in planned if key not in seen]
    problems += [f"{key}: listed {count} times" for key, count in seen.items() if count > 1]
    problems += [f"{key}: listed but not planned" for key in sorted(set(seen) - set(planned))]
    return problems
