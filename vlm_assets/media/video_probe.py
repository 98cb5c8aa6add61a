"""What a video holds: its frames in presentation order, keyframes and frame rate.

Container headers lie (MKV reports 0 frames, an AVI counts its zero-size "repeat the previous
frame" entries, a corrupted MP4 claims frames it cannot decode), so the count comes from
demuxing the video stream's packets, which is cheap (no decoding). It is a first estimate: the
decoding pass (`vlm_assets.media.video.read_sampled_frames`) checks it against what the decoder
actually yields and the count a full decode gives wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import BinaryIO

import av
import numpy as np

from vlm_assets.media.refs import describe_ref, open_media


class VideoError(Exception):
    """A video that cannot be cached (broken, truncated, zero-frame, unsupported)."""


@dataclass(frozen=True)
class VideoProbe:
    total_frames: int
    fps: float
    frame_pts: tuple[int, ...]  # presentation timestamps; frame i has the i-th smallest
    keyframes: tuple[int, ...]  # frame indices (presentation order) of keyframes, ascending
    timestamps_reliable: bool  # False: locate frames by counting from the start, never by seeking


@dataclass(frozen=True)
class SampledFrames:
    """A video's frame count (as a full decode yields it), frame rate, and the frame indices sampled from it."""

    total_frames: int
    fps: float
    frame_indices: list[int]


def sample_indices(total_frames: int, num_frames: int) -> list[int]:
    """`num_frames` indices spread evenly over `total_frames` decodable frames (repeats when there are fewer)."""
    if total_frames < 1:
        raise VideoError("video has no decodable frames")
    return [int(i) for i in np.round(np.linspace(0, total_frames - 1, num_frames))]


def open_video(ref: str) -> tuple[BinaryIO, av.container.InputContainer]:
    """Open a media ref with PyAV; the format comes from the content, so no extension is needed."""
    handle = open_media(ref)
    try:
        container = av.open(handle, mode="r")
    except (av.error.FFmpegError, ValueError) as error:
        handle.close()
        raise VideoError(f"{describe_ref(ref)}: cannot open video: {error}") from error
    if not container.streams.video:
        container.close()
        handle.close()
        raise VideoError(f"{describe_ref(ref)}: no video stream")
    return handle, container


def probe_video(ref: str) -> VideoProbe:
    handle, container = open_video(ref)
    try:
        with handle, container:
            stream = container.streams.video[0]
            indexed_at_open = len(stream.index_entries)
            pts_and_key: list[tuple[int | None, bool]] = []
            try:
                for packet in container.demux(stream):
                    if packet.size == 0:
                        continue
                    if packet.is_corrupt:
                        raise VideoError(f"{describe_ref(ref)}: corrupt packet at pts {packet.pts}")
                    pts_and_key.append((packet.pts, packet.is_keyframe))
            except av.error.FFmpegError as error:
                raise VideoError(f"{describe_ref(ref)}: demuxing failed: {error}") from error
            if not pts_and_key:
                raise VideoError(f"{describe_ref(ref)}: video has no frames")
            known_pts = [pts for pts, _ in pts_and_key if pts is not None]
            if known_pts:
                span = max(known_pts) - min(known_pts)
                slots = span + 1 if _is_avi(container) else len(pts_and_key)
                _check_complete(ref, stream, slots, indexed_at_open == len(pts_and_key), span)
            reliable = _timestamps_reliable(container, pts_and_key)
            if reliable:
                pts_and_key.sort()
            frame_pts = tuple(pts or 0 for pts, _ in pts_and_key)
            keyframes = tuple(i for i, (_, key) in enumerate(pts_and_key) if key)
            fps = _frame_rate(stream, list(frame_pts) if reliable else [])
            return VideoProbe(len(frame_pts), fps, frame_pts, keyframes, reliable)
    except av.error.FFmpegError as error:
        raise VideoError(f"{describe_ref(ref)}: {error}") from error


def _check_complete(ref: str, stream: av.video.stream.VideoStream, slots: int, index_matches: bool, pts_span: int) -> None:
    """Reject a file cut short: fewer frames than its header lists, or ending before its track duration.

    `slots` counts the frame positions the packets cover: in an AVI a zero-size entry ("repeat
    the previous frame") holds a position but no packet, so there it is the timestamp span. A
    header count above `slots` is only a cut when the container's own index (read at open)
    does not list exactly the packets demuxed: an intact index with fewer packets than the
    header means the header counts entries that carry no frame (trailing repeats, a wrong total).
    """
    if stream.frames and slots < stream.frames and not index_matches:
        raise VideoError(f"{describe_ref(ref)}: truncated: header lists {stream.frames} frames, only {slots} present")
    declared = _duration_tag_seconds(stream.metadata.get("DURATION", ""))
    if declared is None or not stream.time_base:
        return
    rate = float(stream.average_rate or stream.guessed_rate or 25)
    present = float(pts_span * stream.time_base) + 1 / rate
    if present < declared - max(0.25, 2 / rate):
        raise VideoError(f"{describe_ref(ref)}: truncated: track lasts {declared:.2f} s, frames stop at {present:.2f} s")


def _duration_tag_seconds(tag: str) -> float | None:
    """Matroska's per-track DURATION tag ("HH:MM:SS.fffffffff") in seconds."""
    try:
        hours, minutes, seconds = tag.split(":")
        return int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    except ValueError:
        return None


def _is_avi(container: av.container.InputContainer) -> bool:
    return "avi" in container.format.name.split(",")


def _timestamps_reliable(container: av.container.InputContainer, pts_and_key: list[tuple[int | None, bool]]) -> bool:
    """Whether presentation timestamps identify frames (AVI only guesses them from packet order)."""
    if _is_avi(container):
        return False
    pts = [value for value, _ in pts_and_key]
    return None not in pts and len(set(pts)) == len(pts)


def _frame_rate(stream: av.video.stream.VideoStream, frame_pts: list[int]) -> float:
    """The stream's average rate; else frames over the span they cover (`frame_pts` ascending)."""
    rate = stream.average_rate or stream.guessed_rate
    if rate and math.isfinite(float(rate)) and float(rate) > 0:
        return round(float(rate), 6)
    if len(frame_pts) > 1 and stream.time_base:
        span = float((frame_pts[-1] - frame_pts[0]) * stream.time_base)
        if span > 0:
            return round((len(frame_pts) - 1) / span, 6)
    return 0.0
