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
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import av
import numpy as np

from vlm_assets.atomic import atomic_path, atomic_write_text
from vlm_assets.catalog.media import describe_ref
from vlm_assets.config import FrameCacheConfig
from vlm_assets.frames.decode import DEFAULT_DECODER_THREADS, FrameResizer, iter_sampled_frames, opened_video
from vlm_assets.frames.mosaic import encode_jpeg, mosaic_canvas, place_tile
from vlm_assets.frames.plan import PlannedVideo
from vlm_assets.frames.probe import VideoError, probe_video

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
    writes it byte for byte again (no timings; older records' `seconds` is ignored)."""

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
    """Fingerprint of what the shard's bytes depend on (not the media keys, which only the index uses)."""
    content = {
        "settings": [config.num_frames, config.frame_size, config.rows, config.cols, config.jpeg_quality],
        "videos": [[video.video_id, video.ref, video.frame_indices, video.error] for video in videos],
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
) -> tuple[ShardRecord, bool]:
    """Reuse the shard if complete and current, else build it; returns (record, reused)."""
    record = load_done_shard(cache_dir, shard, videos, config)
    if record is not None:
        return record, True
    return build_shard(cache_dir, shard, videos, config, threads, on_video), False


def build_shard(
    cache_dir: Path,
    shard: str,
    videos: list[PlannedVideo],
    config: FrameCacheConfig,
    threads: int = DEFAULT_DECODER_THREADS,
    on_video: Callable[[int, PlannedVideo, str], None] | None = None,
) -> ShardRecord:
    """Write the shard's tar (temp name, then rename) and then its done record.

    `on_video(done_count, video, error)` is called after each video ("" when it succeeded).
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    done_path(cache_dir, shard).unlink(missing_ok=True)
    entries: list[ShardEntry] = []
    failures: list[ShardFailure] = []
    target = tar_path(cache_dir, shard)
    # One canvas for the whole shard: a fresh 28 MB array per video costs more in page faults than
    # clearing it does.
    canvas = mosaic_canvas(config.rows, config.cols, config.frame_size)
    with atomic_path(target) as temporary:
        with tarfile.open(temporary, "w", format=tarfile.USTAR_FORMAT, copybufsize=TAR_COPY_BUFFER) as tar:
            for count, video in enumerate(videos, 1):
                error = video.error
                if not error:
                    try:
                        jpeg = render_mosaic(video, config, threads, canvas)
                    except (VideoError, OSError, av.error.FFmpegError) as failure:
                        error = _failure_message(video, failure)
                if error:
                    failures.append(ShardFailure(video.video_id, error))
                else:
                    entries.append(_append_member(tar, video, jpeg))
                if on_video is not None:
                    on_video(count, video, error)
        tar_bytes = temporary.stat().st_size
    record = ShardRecord(shard, plan_digest(videos, config), tar_bytes, entries, failures)
    atomic_write_text(done_path(cache_dir, shard), json.dumps(asdict(record), indent=1) + "\n")
    return record


RESIZE_QUEUE_DEPTH = 8


def render_mosaic(
    video: PlannedVideo, config: FrameCacheConfig, threads: int = DEFAULT_DECODER_THREADS, canvas: np.ndarray | None = None
) -> bytes:
    """Decode the planned frames straight into the mosaic and encode it as JPEG.

    `canvas` (rows·size × cols·size × 3) is cleared and reused when given.
    Resizing runs on a helper thread while the next frames decode (both release the GIL), so a
    lone worker uses a second core; the bounded queue keeps at most a few decoded frames alive.
    """
    probe = probe_video(video.ref)
    if canvas is None:
        canvas = mosaic_canvas(config.rows, config.cols, config.frame_size)
    else:
        canvas.fill(0)
    positions: dict[int, list[int]] = {}
    for position, index in enumerate(video.frame_indices):
        positions.setdefault(index, []).append(position)
    resize = FrameResizer(config.frame_size)  # used on the helper thread only

    def place(frame: av.VideoFrame, cells: list[int]) -> None:
        tile = resize(frame)
        for position in cells:
            place_tile(canvas, position, config.cols, tile)

    with ThreadPoolExecutor(max_workers=1) as resizer, opened_video(video.ref, threads) as (container, stream):
        pending: deque[Future[None]] = deque()
        for index, frame in iter_sampled_frames(container, stream, probe, video.frame_indices, describe_ref(video.ref)):
            pending.append(resizer.submit(place, frame, positions[index]))
            if len(pending) > RESIZE_QUEUE_DEPTH:
                pending.popleft().result()
        for placed in pending:
            placed.result()
    return encode_jpeg(canvas, config.jpeg_quality)


def _failure_message(video: PlannedVideo, failure: Exception) -> str:
    message = str(failure)
    name = describe_ref(video.ref)
    return message if name in message else f"{name}: {message}"


def _append_member(tar: tarfile.TarFile, video: PlannedVideo, jpeg: bytes) -> ShardEntry:
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
        frame_indices=list(video.frame_indices),
        fps=video.fps,
        total_frames=video.total_frames,
    )
