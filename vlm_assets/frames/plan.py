"""Which videos the cache holds, their sampled frames, and the shard each one lives in.

The plan is append-only: a video keeps its id and shard forever, new videos go to the end
(filling the last shard, then opening new ones), so new data never moves old entries and
finished shards stay valid.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vlm_assets.atomic import atomic_write_text
from vlm_assets.media.refs import is_object_ref, is_tar_ref
from vlm_assets.catalog.schema import STATUS_OK
from vlm_assets.config import FrameCacheConfig, SourceConfig
from vlm_assets.parquet_batches import parquet_batches
from vlm_assets.media.video_probe import (
    SampledFrames,
    VideoError,
    probe_video,
    sample_indices,
)

PLAN_FILE = "plan.jsonl"
FRAMES_SOURCE_FILE = "video_frames_source.jsonl"
PLAN_BATCH_ROWS = 8192


@dataclass
class PlannedVideo:
    video_id: str  # stable id inside the cache; the tar member is "<video_id>.jpg"
    ref: str  # where the bytes are (vlm_assets.media.refs ref)
    keys: list[str]  # every media key that resolves to this file
    shard: str
    total_frames: int = 0
    fps: float = 0.0
    frame_indices: list[int] = field(default_factory=list)
    error: str = ""  # why planning failed ("" when the video is to be decoded)


def shard_key(number: int) -> str:
    return f"part-{number:05d}"


def file_identity(ref: str) -> str:
    """Refs naming the same bytes map to one identity, so the video is decoded once."""
    return ref if is_tar_ref(ref) or is_object_ref(ref) else os.path.realpath(ref)


def frames_source_files(source: SourceConfig) -> list[Path]:
    """Pre-computed frame counts and indices (video_frames_source.jsonl) beside the source or in its media root
    (on a local disk: a source on object storage has its videos probed)."""
    if source.on_object_store:
        return []
    folders = [source.path.parent if source.path.is_file() else source.path, source.media_root]
    return sorted({folder / FRAMES_SOURCE_FILE for folder in folders if (folder / FRAMES_SOURCE_FILE).is_file()})


def read_plan(cache_dir: Path) -> list[PlannedVideo]:
    path = cache_dir / PLAN_FILE
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as handle:
        return [PlannedVideo(**json.loads(line)) for line in handle if line.strip()]


def plan_file_digest(cache_dir: Path) -> str:
    """sha256 of the plan file's bytes ("" without one)."""
    path = cache_dir / PLAN_FILE
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def write_plan(cache_dir: Path, plan: list[PlannedVideo]) -> None:
    atomic_write_text(cache_dir / PLAN_FILE, "".join(json.dumps(asdict(video)) + "\n" for video in plan))


def shard_members(plan: list[PlannedVideo]) -> dict[str, list[PlannedVideo]]:
    """Shard key -> its videos in plan order, shards in ascending order."""
    members: dict[str, list[PlannedVideo]] = {}
    for video in plan:
        members.setdefault(video.shard, []).append(video)
    return dict(sorted(members.items()))


def accepted_videos(catalog_path: Path, lengths_path: Path) -> Iterator[tuple[str, str]]:
    """(media key, ref) of every video of the samples the source's length table accepts, in catalogue order.

    The length table has one row per catalogue row, in the same order, and keeps the catalogue's
    rejects: a sample it accepts is one the catalogue accepted too. A video it rejects (one frame, too
    many tokens) is never packed, so it is not cached either.
    """
    catalog = parquet_batches(catalog_path, ["sample_id", "media_kinds", "media_refs", "media_keys"], PLAN_BATCH_ROWS)
    lengths = parquet_batches(lengths_path, ["sample_id", "status"], PLAN_BATCH_ROWS)
    for catalog_batch, length_batch in zip(catalog, lengths, strict=True):
        for row, length in zip(catalog_batch.to_pylist(), length_batch.to_pylist()):
            if row["sample_id"] != length["sample_id"]:
                raise ValueError(f"{lengths_path}: row {length['sample_id']!r} stands where the catalogue "
                                 f"{catalog_path} has {row['sample_id']!r}; build sample_lengths again")
            if length["status"] != STATUS_OK:
                continue
            for kind, ref, key in zip(row["media_kinds"], row["media_refs"], row["media_keys"]):
                if kind == "video":
                    yield key, ref


def extend_plan(
    plan: list[PlannedVideo],
    videos: Iterable[tuple[str, str]],
    config: FrameCacheConfig,
    known: Mapping[str, SampledFrames] | None = None,
    on_probe: Callable[[int, PlannedVideo], None] | None = None,
    decoded: Callable[[str], SampledFrames | None] | None = None,
) -> tuple[list[PlannedVideo], int]:
    """Append the (key, ref) pairs not yet planned; returns the plan and how many videos were added.

    Keys of an already planned file are attached to it; new files are placed after every
    existing video with their frames taken from `known` (by key), else from `decoded(ref)` (what
    an earlier decode of the unchanged file found), else from probing.
    """
    plan = [PlannedVideo(**asdict(video)) for video in plan]
    by_identity = {file_identity(video.ref): video for video in plan}
    planned_keys = {key for video in plan for key in video.keys}
    shard_sizes = {key: len(members) for key, members in shard_members(plan).items()}
    added = 0
    for key, ref in videos:
        if key in planned_keys:
            continue
        planned_keys.add(key)
        identity = file_identity(ref)
        if identity in by_identity:
            by_identity[identity].keys.append(key)
            continue
        shard = _shard_for_next(shard_sizes, config.videos_per_shard)
        shard_sizes[shard] = shard_sizes.get(shard, 0) + 1
        video = PlannedVideo(video_id=f"v{len(plan):08d}", ref=ref, keys=[key], shard=shard)
        _fill_frames(video, config.num_frames, (known or {}).get(key), decoded)
        plan.append(video)
        by_identity[identity] = video
        added += 1
        if on_probe is not None:
            on_probe(added, video)
    return plan, added


def _shard_for_next(shard_sizes: dict[str, int], videos_per_shard: int) -> str:
    if not shard_sizes:
        return shard_key(0)
    last = max(shard_sizes)
    if shard_sizes[last] < videos_per_shard:
        return last
    return shard_key(int(last.split("-")[1]) + 1)


def _fill_frames(
    video: PlannedVideo, num_frames: int, known: SampledFrames | None, decoded: Callable[[str], SampledFrames | None] | None
) -> None:
    try:
        if known is not None:
            video.total_frames, video.fps = known.total_frames, known.fps
            indices = known.frame_indices
            valid = len(indices) == num_frames and all(0 <= i < known.total_frames for i in indices)
            video.frame_indices = list(indices) if valid else sample_indices(known.total_frames, num_frames)
            return
        found = decoded(video.ref) if decoded is not None else None
        if found is not None:
            video.total_frames, video.fps, video.frame_indices = found.total_frames, found.fps, list(found.frame_indices)
            return
        probe = probe_video(video.ref)
        video.total_frames, video.fps = probe.total_frames, probe.fps
        video.frame_indices = sample_indices(probe.total_frames, num_frames)
    except (VideoError, OSError) as error:
        video.error = str(error)


_PATH_FIELDS = ("video", "path", "video_path", "file", "name")
_TOTAL_FIELDS = ("total_frames", "frame_count", "num_frames_total", "total")
_INDEX_FIELDS = ("frame_indices", "indices", "sample_indices", "frame_idx")


def load_frames_source(path: Path, source: str, media_root: Path) -> dict[str, SampledFrames]:
    """Read a video_frames_source.jsonl of precomputed frame counts: per line a video path, total frames, fps, indices.

    Paths may be relative to `media_root` or absolute below it; results are keyed by media key
    `<source>/<relative path>`. A line without a path or a frame count is an error naming the line.
    """
    known: dict[str, SampledFrames] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            video = next((record[name] for name in _PATH_FIELDS if name in record), None)
            total = next((record[name] for name in _TOTAL_FIELDS if name in record), None)
            if not isinstance(video, str) or not isinstance(total, int):
                raise ValueError(f"{path}:{number}: needs a video path and an integer total frame count")  # noqa: TRY004 (bad input, not a bad call)
            relative = Path(video)
            if relative.is_absolute():
                relative = relative.relative_to(media_root)
            indices = next((record[name] for name in _INDEX_FIELDS if name in record), [])
            known[f"{source}/{relative.as_posix()}"] = SampledFrames(total, float(record.get("fps", 0.0)), list(indices))
    return known
