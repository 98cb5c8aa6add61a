"""One video's mosaic: decode its sampled frames, resize, tile row-major, encode as JPEG."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import av
import numpy as np

from vlm_assets.config import FrameCacheConfig
from vlm_assets.media.video import (
    DEFAULT_DECODER_THREADS,
    FrameResizer,
    read_sampled_frames,
)
from vlm_assets.frames.mosaic import encode_jpeg, mosaic_canvas, mosaic_canvas_shape, place_tile
from vlm_assets.media.video_probe import SampledFrames

RESIZE_QUEUE_DEPTH = 8
# One canvas per thread, reused from video to video: writing tiles into a fresh 28 MB array costs
# its page faults on every video, more than the copying itself.
_canvases = threading.local()


def mosaic_settings(config: FrameCacheConfig) -> list[int]:
    """The settings a mosaic's bytes depend on."""
    return [config.num_frames, config.frame_size, config.rows, config.cols, config.jpeg_quality]


def render_mosaic(
    ref: str,
    config: FrameCacheConfig,
    planned: SampledFrames | None = None,
    threads: int = DEFAULT_DECODER_THREADS,
) -> tuple[bytes, SampledFrames]:
    """The JPEG mosaic of `ref`'s sampled frames, with the frame count and indices it shows.

    `planned` fixes the indices (else they are spread over the decoded count). Resizing runs on a helper
    thread while the next frames decode (both release the GIL), so a lone worker uses a second
    core; the bounded queue keeps at most a few full-size decoded frames alive.
    """
    resize = FrameResizer(config.frame_size, "rgba")  # used on the helper thread only
    tiles: dict[int, Future[np.ndarray]] = {}
    with ThreadPoolExecutor(max_workers=1) as resizer:
        pending: deque[Future[np.ndarray]] = deque()

        def resize_later(index: int, frame: av.VideoFrame) -> None:
            tiles[index] = resizer.submit(resize, frame)
            pending.append(tiles[index])
            if len(pending) > RESIZE_QUEUE_DEPTH:
                pending.popleft().result()

        sampled = read_sampled_frames(ref, config.num_frames, resize_later, planned, threads)
        canvas = _reusable_canvas(config)
        if len(sampled.frame_indices) < config.rows * config.cols:
            canvas.fill(0)  # the cells this mosaic leaves empty still show the last one
        for position, index in enumerate(sampled.frame_indices):
            place_tile(canvas, position, config.cols, tiles[index].result())
    return encode_jpeg(canvas, config.jpeg_quality), sampled


def _reusable_canvas(config: FrameCacheConfig) -> np.ndarray:
    canvas = getattr(_canvases, "canvas", None)
    shape = mosaic_canvas_shape(config.rows, config.cols, config.frame_size)
    if canvas is None or canvas.shape != shape:
        canvas = _canvases.canvas = mosaic_canvas(config.rows, config.cols, config.frame_size)
    return canvas
