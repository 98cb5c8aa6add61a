"""Build one frame-cache shard: part-NNNNN.tar of mosaics, then part-NNNNN.done.json last.

A shard counts as done only when both files exist and the done record matches the shard's
current plan and settings; anything else is rebuilt from scratch. Bad videos are recorded
as failures and the shard still completes.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import av

from vlm_assets.atomic import atomic_path, atomic_write_text
from vlm_assets.media.checks import medium_stamp_or_failure
from vlm_assets.media.refs import describe_ref
from vlm_assets.config import FrameCacheConfig
from vlm_assets.media.video import DEFAULT_DECODER_THREADS
from vlm_assets.frames.plan import PlannedVideo
from vlm_assets.media.video_probe import SampledFrames, VideoError
from vlm_assets.frames.render import mosaic_settings, render_mosaic
from vlm_assets.frames.spool import MosaicSpool

TAR_BLOCK = 512
TAR_COPY_BUFFER = 1 << 20  # tarfile's 16 KB default makes ~500 writes per mosaic
FIXED_MTIME = 0


@dataclass(frozen=True)
class ShardEntry:
    video_id: str
    member: str
    offset: int  # byte offset of the JPEG data in the tar
    size: int
    frame_indices: list[int]
    fps: float
    total_frames: int


@dataclass(frozen=True)
class ShardFailure:
    video_id: str
    error: str


@dataclass(frozen=True)
class ShardRecord:
    """Contents of part-NNNNN.done.json: only what the shard's bytes determine, so a rebuild
    writes it byte for byte again (no timings)."""

    shard: str
    plan_digest: str
    tar_bytes: int
    entries: list[ShardEntry]
    failures: list[ShardFailure]

    @classmethod
    def from_json(cls, data: dict) -> ShardRecord:
        return cls(
            shard=data["shard"],
            plan_digest=data["plan_digest"],
            tar_bytes=data["tar_bytes"],
            entries=[ShardEntry(**entry) for entry in data["entries"]],
            failures=[ShardFailure(**failure) for failure in data["failures"]],
        )


def tar_path(cache_dir: Path, shard: str) -> Path:
    return cache_dir / f"{shard}.tar"


def done_path(cache_dir: Path, shard: str) -> Path:
    return cache_dir / f"{shard}.done.json"


def plan_digest(videos: list[PlannedVideo], config: FrameCacheConfig) -> str:
    """Fingerprint of what the shard's bytes depend on (not the media keys, which only the index
    uses): its videos in the plan and their files as they are now. A video keeps its place in the
    append-only plan when its file is replaced, restored or made readable again; its stamp tells."""
    content = {
        "settings": mosaic_settings(config),
        "videos": [[video.video_id, video.ref, video.frame_indices, video.error] for video in videos],
        "stamps": [medium_stamp_or_failure(video.ref) for video in videos],
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def load_done_shard(cache_dir: Path, shard: str, videos: list[PlannedVideo], config: FrameCacheConfig) -> ShardRecord | None:
    """The shard's record when it is complete and current, else None."""
    done, tar = done_path(cache_dir, shard), tar_path(cache_dir, shard)
    if not (done.is_file() and tar.is_file()):
        return None
    try:
        record = ShardRecord.from_json(json.loads(done.read_text(encoding="utf-8")))
    except (ValueError, KeyError, TypeError):
        return None
    if record.plan_digest != plan_digest(videos, config) or record.tar_bytes != tar.stat().st_size:
        return None
    return record


def ensure_shard(
    cache_dir: Path,
    shard: str,
    videos: list[PlannedVideo],
    config: FrameCacheConfig,
    threads: int = DEFAULT_DECODER_THREADS,
    on_video: Callable[[int, PlannedVideo, str], None] | None = None,
    spool: MosaicSpool | None = None,
) -> tuple[ShardRecord, bool]:
    """Reuse the shard if complete and current, else build it; returns (record, reused)."""
    record = load_done_shard(cache_dir, shard, videos, config)
    if record is not None:
        return record, True
    return build_shard(cache_dir, shard, videos, config, threads, on_video, spool), False


def build_shard(
    cache_dir: Path,
    shard: str,
    videos: list[PlannedVideo],
    config: FrameCacheConfig,
    threads: int = DEFAULT_DECODER_THREADS,
    on_video: Callable[[int, PlannedVideo, str], None] | None = None,
    spool: MosaicSpool | None = None,
) -> ShardRecord:
    """Write the shard's tar (temp name, then rename) and then its done record.

    Mosaics the catalogue already rendered are taken from `spool` (and removed from it once the
    done record is written); the other videos are decoded here.
    `on_video(done_count, video, error)` is called after each video ("" when it succeeded).
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    done_path(cache_dir, shard).unlink(missing_ok=True)
    # Of the videos before they are read: one changed meanwhile makes the record stale at once.
    digest = plan_digest(videos, config)
    entries: list[ShardEntry] = []
    failures: list[ShardFailure] = []
    target = tar_path(cache_dir, shard)
    with atomic_path(target) as temporary:
        with tarfile.open(temporary, "w", format=tarfile.USTAR_FORMAT, copybufsize=TAR_COPY_BUFFER) as tar:
            for count, video in enumerate(videos, 1):
                error = video.error
                if not error:
                    planned = SampledFrames(video.total_frames, video.fps, video.frame_indices)
                    try:
                        spooled = spool.mosaic(video.ref, video.frame_indices) if spool else None
                        jpeg, sampled = spooled or render_mosaic(video.ref, config, planned, threads)
                    except (VideoError, OSError, av.error.FFmpegError) as failure:
                        error = _failure_message(video, failure)
                if error:
                    failures.append(ShardFailure(video.video_id, error))
                else:
                    entries.append(_append_member(tar, video, jpeg, sampled))
                if on_video is not None:
                    on_video(count, video, error)
        tar_bytes = temporary.stat().st_size
    record = ShardRecord(shard, digest, tar_bytes, entries, failures)
    atomic_write_text(done_path(cache_dir, shard), json.dumps(asdict(record), indent=1) + "\n")
    if spool is not None:
        spool.discard(video.ref for video in videos)
    return record


def _failure_message(video: PlannedVideo, failure: Exception) -> str:
    message = str(failure)
    name = describe_ref(video.ref)
    return message if name in message else f"{name}: {message}"


def _append_member(tar: tarfile.TarFile, video: PlannedVideo, jpeg: bytes, sampled: SampledFrames) -> ShardEntry:
    info = tarfile.TarInfo(f"{video.video_id}.jpg")
    info.size = len(jpeg)
    info.mtime = FIXED_MTIME
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(jpeg))
    padded = -(-len(jpeg) // TAR_BLOCK) * TAR_BLOCK
    return ShardEntry(
        video_id=video.video_id,
        member=info.name,
        offset=tar.offset - padded,
        size=len(jpeg),
        frame_indices=list(sampled.frame_indices),
        fps=sampled.fps,
        total_frames=sampled.total_frames,
    )
