"""What the trainer's video decoder makes of a clip, learnt in the catalogue's one decoding pass.

The packed shards' consumer reads a clip with Megatron-Energon's AV decoder: it counts the clip's
frames as the video stream's demuxed packets that carry a timestamp, takes its frame rate from the
stream's average rate, and reads the frames it samples by index, seeking to the keyframe before each.
Its count is a header's word where the catalogue's decoding pass has the decoder's (vlm_assets.media.video):
where the two disagree, the trainer would sample indices that yield no frame, so no view is kept and
the clip's length is measured by reading it as the trainer does. A view is kept only where the
trainer's reads, seeking ahead to the keyframe before a frame, yield every frame: a clip of one
keyframe is read front to back, never seeking ahead, and Energon's own decoder must read its first
frame; in a clip of several, its last frame, after seeking to the last keyframe (an AVI whose seek the
demuxer refuses, or one where a seek lands past its keyframe, so the frames run out early, has no
view). The frame it reads must have the first frame's size.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import BinaryIO

from vlm_assets.media.refs import open_media


@dataclass(frozen=True)
class TrainerClipView:
    """A clip as the trainer's decoder sees it: its frame count and rate, and the size of its frames
    (as decoded, before any rotation a container asks for)."""

    total_frames: int
    fps: float
    height: int
    width: int

    def text(self) -> str:
        """The catalogue's spelling: `<frames> <fps> <height> <width>`, the rate as Python writes it back exactly."""
        return f"{self.total_frames} {self.fps!r} {self.height} {self.width}"

    @classmethod
    def parse(cls, text: str) -> TrainerClipView | None:
        """The view a catalogue's `media_views` entry holds (None: "", no view)."""
        if not text:
            return None
        frames, fps, height, width = text.split(" ")
        return cls(int(frames), float(fps), int(height), int(width))


def trainer_clip_view(ref: str, decoded_frames: int) -> TrainerClipView | None:
    """The view of `ref`'s clip through Energon's AV decoder, where it reads exactly the `decoded_frames`
    frames a full decode yields; None where it would not (see the module's docstring), or fails."""
    from megatron.energon.av import AVDecoder

    try:
        with open_media(ref) as handle, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            decoder = AVDecoder(handle, suppress_warnings=True)
            _duration, total_frames = decoder.get_video_duration(get_frame_count=True)
            if total_frames != decoded_frames or total_frames < 1:
                return None
            fps = decoder.get_video_fps()
            first = decoder.get_metadata(get_video_duration=False, get_video_frame_count=False, get_audio=False)
            size = (first.video_height, first.video_width)
            # Reading the last frame decodes from the last keyframe on: with only the first, the whole
            # clip, which the trainer reads front to back; its first frame then proves the reader opens it.
            read = total_frames - 1 if _keyframes(handle) > 1 else 0
            clips, _times = decoder.get_video_clips([(read, read)], video_unit="frames")
            if len(clips) != 1 or clips[0].shape[0] != 1 or tuple(clips[0].shape[2:]) != size:
                return None
    except Exception:  # a decoder refusing the clip: the lengths read it as the trainer does, and say why
        return None
    if not fps or fps <= 0 or None in size:
        return None
    return TrainerClipView(total_frames, float(fps), int(size[0]), int(size[1]))


def _keyframes(handle: BinaryIO) -> int:
    """How many keyframes the video stream's packets mark (demuxed, not decoded)."""
    import av

    handle.seek(0)
    with av.open(handle) as container:
        return sum(1 for packet in container.demux(video=0) if packet.pts is not None and packet.is_keyframe)
