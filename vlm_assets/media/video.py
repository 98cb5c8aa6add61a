"""Decode the sampled frames of one video, choosing per gap between seeking and decoding on.

Seeking costs a decoder flush plus decoding from the keyframe before the target, so it only
pays when the target lies past the next keyframe; otherwise decoding forward and picking is
cheaper. Frames are identified by presentation timestamp, so variable frame rate and
B-frame reordering cannot shift an index.

Index i means the i-th frame a full front-to-back decode yields. The demuxed count is checked
while decoding: a frame decoding to a timestamp no packet had, a sampled frame missing, or any
frame after the last one counted, sends the video through a full decode, whose count then
decides the sampled indices.

Frames that are neither sampled nor referenced by any other frame (most B-frames) are not
decoded at all: the decoder is told to skip non-reference frames for every packet but the
sampled ones. That leaves the sampled frames' pixels exactly as a full decode gives them, at
a fifth to a third less decoding; what it gives up is noticing damage confined to such a frame,
which no sampled frame shows. The full decode (the fallback, and any video whose timestamps
are unreliable) decodes every frame.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from vlm_assets.media.refs import describe_ref
from vlm_assets.media.video_probe import (
    SampledFrames,
    VideoError,
    VideoProbe,
    open_video,
    probe_video,
    sample_indices,
)

DEFAULT_DECODER_THREADS = 1


def should_seek(keyframes: tuple[int, ...], position: int, target: int) -> bool:
    """True when a keyframe lies after the next frame to decode and at or before `target`.

    `position` is the index of the last decoded frame (-1 before the first).
    """
    next_key = bisect.bisect_right(keyframes, position + 1)
    return next_key < len(keyframes) and keyframes[next_key] <= target


@contextmanager
def opened_video(ref: str, threads: int = DEFAULT_DECODER_THREADS) -> Iterator[tuple[av.container.InputContainer, av.video.stream.VideoStream]]:
    handle, container = open_video(ref)
    with handle, container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = threads
        if threads > 1:
            stream.codec_context.thread_type = "AUTO"
        yield container, stream


class _TimestampMismatch(Exception):
    """Decoded timestamps disagree with the demuxed ones (e.g. AVI packed B-frames, frames the decoder drops)."""


class FrameCountMismatch(VideoError):
    """A full decode yields a different number of frames than demuxing counted."""

    def __init__(self, name: str, counted: int, decoded_frames: int) -> None:
        super().__init__(f"{name}: decoding yields {decoded_frames} frames, demuxing counted {counted}")
        self.decoded_frames = decoded_frames


def iter_sampled_frames(
    container: av.container.InputContainer,
    stream: av.video.stream.VideoStream,
    probe: VideoProbe,
    indices: list[int],
    name: str,
) -> Iterator[tuple[int, av.VideoFrame]]:
    """Yield (index, frame) for each distinct index in ascending order.

    Frames are located by timestamp (seeking where it pays). If the decoder's timestamps turn
    out unreliable, every index is decoded again by counting frames from the start, which
    can yield an index a second time; consumers keep the last frame per index.
    When the last index is the video's last frame, the count is proven too: FrameCountMismatch
    (after the frames) says how many frames a full decode yields.
    """
    targets = sorted(set(indices))
    if targets and targets[-1] >= probe.total_frames:
        raise VideoError(f"{name}: frame {targets[-1]} requested but the video has {probe.total_frames} frames")
    try:
        if probe.timestamps_reliable:
            try:
                yield from _by_timestamp(container, stream, probe, targets)
                return
            except _TimestampMismatch:
                container.seek(0, backward=True)
        # Counting needs every frame, whatever setting the timestamp pass left on the decoder.
        stream.codec_context.skip_frame = "DEFAULT"
        yield from _by_counting(container.decode(stream), targets, name, probe.total_frames)
    except av.error.FFmpegError as error:
        raise VideoError(f"{name}: decoding failed: {error}") from error


def _by_timestamp(
    container: av.container.InputContainer,
    stream: av.video.stream.VideoStream,
    probe: VideoProbe,
    targets: list[int],
) -> Iterator[tuple[int, av.VideoFrame]]:
    index_of_pts = {pts: i for i, pts in enumerate(probe.frame_pts)}
    sampled_pts = {probe.frame_pts[target] for target in targets}
    position = -1
    frames: Iterator[av.VideoFrame] | None = None
    for target in targets:
        just_sought = frames is None or should_seek(probe.keyframes, position, target)
        if just_sought:
            container.seek(probe.frame_pts[target], stream=stream, backward=True)
            frames = _decode_skipping_unsampled(container, stream, sampled_pts)
        while True:
            frame = next(frames, None)
            if frame is None:
                raise _TimestampMismatch  # fewer frames decode than were demuxed: count them from the start
            index = index_of_pts.get(frame.pts)
            # Frames come in order, the skipped ones left out; passing the target means the decoder
            # dropped or skipped it, and a frame at or before the last one means its timestamps repeat.
            if index is None or index > target or (index <= position and not just_sought):
                raise _TimestampMismatch
            just_sought = False
            position = index
            if index == target:
                yield target, frame
                break
    if targets and targets[-1] == probe.total_frames - 1 and frames is not None and next(frames, None) is not None:
        raise _TimestampMismatch  # frames beyond the last one counted


def _decode_skipping_unsampled(
    container: av.container.InputContainer, stream: av.video.stream.VideoStream, sampled_pts: set[int]
) -> Iterator[av.VideoFrame]:
    """Decode on from the container's position, skipping non-reference frames outside `sampled_pts`.

    The setting is read as each packet is decoded (one decoder thread decodes within the call),
    so it applies to that packet's frame. With frame threads a sampled frame could be skipped
    too; its caller then finds the target missing and falls back to a full decode.
    """
    codec = stream.codec_context
    try:
        for packet in container.demux(stream):
            codec.skip_frame = "DEFAULT" if packet.pts is None or packet.pts in sampled_pts else "NONREF"
            yield from codec.decode(packet)
    finally:
        codec.skip_frame = "DEFAULT"


def _by_counting(
    frames: Iterator[av.VideoFrame], targets: list[int], name: str, counted: int
) -> Iterator[tuple[int, av.VideoFrame]]:
    """Pick `targets` by position in decode output; decoding on to the end when the last target is the last counted frame."""
    prove_count = bool(targets) and targets[-1] == counted - 1
    wanted = iter(targets)
    target = next(wanted, None)
    decoded = 0
    for frame in frames:
        if target is None and not prove_count:
            return
        if decoded == target:
            yield target, frame
            target = next(wanted, None)
        decoded += 1
    if decoded == 0:
        raise VideoError(f"{name}: no frame decodes")
    if decoded != counted and (prove_count or target is not None):
        raise FrameCountMismatch(name, counted, decoded)


class FrameResizer:
    """Bicubic resize to size×size RGB, then turn as the display matrix says.

    Resizing in the decoder's own pixel format first and converting the small frame to RGB after
    is about a third cheaper than one combined reformat (subsampled chroma planes are smaller).
    The two scalers are kept across frames: `frame.reformat` builds a fresh swscale context with
    its filter tables on every call, which costs twice the scaling itself at these sizes.
    One instance per thread (swscale contexts are not shareable). `pixel_format` "rgba" gives
    size×size×4 with the same RGB and an opaque fourth byte, the layout a mosaic canvas is kept in.
    """

    def __init__(self, size: int, pixel_format: str = "rgb24") -> None:
        self.size = size
        self.pixel_format = pixel_format
        self._scaler = VideoReformatter()
        self._to_rgb = VideoReformatter()

    def __call__(self, frame: av.VideoFrame) -> np.ndarray:
        resized = self._scaler.reformat(frame, width=self.size, height=self.size, interpolation="BICUBIC")
        rgb = self._to_rgb.reformat(resized, format=self.pixel_format).to_ndarray()
        quarter_turns = round((frame.rotation or 0) / 90) % 4
        return np.rot90(rgb, quarter_turns) if quarter_turns else rgb


def decode_sampled_frames(
    ref: str, num_frames: int, size: int, planned: SampledFrames | None = None, threads: int = DEFAULT_DECODER_THREADS
) -> tuple[SampledFrames, list[np.ndarray]]:
    """A video's sampled frames in sampled order (repeats allowed), each size×size×3 uint8, with the count and indices used."""
    by_index: dict[int, np.ndarray] = {}
    resize = FrameResizer(size)
    sampled = read_sampled_frames(ref, num_frames, lambda index, frame: by_index.__setitem__(index, resize(frame)), planned, threads)
    return sampled, [by_index[index] for index in sampled.frame_indices]


def read_sampled_frames(
    ref: str,
    num_frames: int,
    on_frame: Callable[[int, av.VideoFrame], None],
    planned: SampledFrames | None = None,
    threads: int = DEFAULT_DECODER_THREADS,
) -> SampledFrames:
    """Decode a video's sampled frames into `on_frame(index, frame)`; returns its proven count and the indices used.

    The indices are `planned`'s when given, else spread over the demuxed count. When a full
    decode yields another count, sampled indices are spread over that count and decoded again
    by position (`on_frame` sees the new indices; keep the last frame per index). Indices
    imported from elsewhere that the decoded count contradicts are an error.
    """
    probe = probe_video(ref)
    name = describe_ref(ref)
    sampled = planned or SampledFrames(probe.total_frames, probe.fps, sample_indices(probe.total_frames, num_frames))
    try:
        with opened_video(ref, threads) as (container, stream):
            for index, frame in iter_sampled_frames(container, stream, probe, sampled.frame_indices, name):
                on_frame(index, frame)
        return sampled
    except FrameCountMismatch as mismatch:
        if sampled.frame_indices != sample_indices(sampled.total_frames, num_frames):
            raise
        decoded = replace(probe, total_frames=mismatch.decoded_frames, timestamps_reliable=False)
    resampled = SampledFrames(decoded.total_frames, probe.fps, sample_indices(decoded.total_frames, num_frames))
    with opened_video(ref, threads) as (container, stream):
        for index, frame in iter_sampled_frames(container, stream, decoded, resampled.frame_indices, name):
            on_frame(index, frame)
    return resampled
