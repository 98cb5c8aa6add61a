"""Exact token lengths: the length of `input_ids` the processor returns for a sample (docs/formats.md).

Two paths that must agree on every sample:
- exact: render the chat template, load images as `transformers.image_utils.load_image` does,
  decode videos to the frames the trainer sees, and call the processor;
- fast: image sizes from file headers (EXIF orientation applied), the video token count of
  one frame-cache-shaped clip (computed once with the real video processor), and batched
  tokenisation of the template rendered with a single pad token per media item.

The fast path runs in two stages: `measure_samples` needs only the text (vlm_assets.tokens.text)
and the files, so it runs where the processor is not loaded; `LengthCounter.complete` turns image
sizes and video counts into tokens with the processor's own arithmetic.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from vlm_assets.catalog.media import open_media
from vlm_assets.catalog.messages import split_on_placeholders
from vlm_assets.catalog.schema import STATUS_OK, STATUS_REJECTED
from vlm_assets.config import FrameCacheConfig
from vlm_assets.tokens.text import ProcessorText, TextCounter

EXIF_ORIENTATION_TAG = 0x0112
ORIENTATIONS_THAT_SWAP_AXES = frozenset({5, 6, 7, 8})

VideoFrameLoader = Callable[[str, FrameCacheConfig], np.ndarray]


@dataclass(frozen=True)
class SampleForLength:
    sample_id: str
    messages: str  # catalogue JSON (role/content with <image>/<video> placeholders)
    media_kinds: Sequence[str]
    media_refs: Sequence[str]


@dataclass(frozen=True)
class LengthResult:
    sample_id: str
    status: str
    reason: str
    token_len: int
    text_tokens: int
    image_tokens: int
    video_tokens: int

    @classmethod
    def rejected(cls, sample_id: str, reason: str) -> LengthResult:
        return cls(sample_id, STATUS_REJECTED, reason, 0, 0, 0, 0)


@dataclass(frozen=True)
class MeasuredSample:
    """A sample's text tokens and media shapes: what its length needs besides the processor's arithmetic."""

    sample_id: str
    text_tokens: int
    image_sizes: tuple[tuple[int, int], ...]  # (height, width) after EXIF orientation
    videos: int
    error: str = ""  # why the text or an image could not be measured: the sample's rejection reason


def chat_conversation(messages_json: str) -> list[dict[str, Any]]:
    """Catalogue messages as the structured conversation HF chat templates expect."""
    return [
        {"role": message["role"], "content": split_on_placeholders(message["content"])}
        for message in json.loads(messages_json)
    ]


def supports_fast_path(processor: Any) -> bool:
    image_processor = getattr(processor, "image_processor", None)
    return (
        hasattr(processor, "image_token")
        and hasattr(processor, "video_token")
        and hasattr(image_processor, "get_number_of_image_patches")
        and hasattr(image_processor, "merge_size")
    )


def decode_video_frames(ref: str, settings: FrameCacheConfig) -> np.ndarray:
    """The frames a trainer sees for a video: the frame cache's sampled frames at frame_size²."""
    from vlm_assets.frames.decode import decode_sampled_frames

    _, frames = decode_sampled_frames(ref, settings.num_frames, settings.frame_size)
    return np.stack(frames)


class LengthCounter:
    def __init__(
        self,
        processor: Any,
        frame_cache: FrameCacheConfig,
        video_loader: VideoFrameLoader = decode_video_frames,
    ) -> None:
        self.processor = processor
        self.frame_cache = frame_cache
        self.video_loader = video_loader
        self.text = ProcessorText(processor)
        self._tokens_by_size: dict[tuple[int, int], int] = {}

    # ---- shared -------------------------------------------------------------------------
    def render(self, messages_json: str) -> str:
        return self.text.render(chat_conversation(messages_json))

    def _pad_ids(self) -> tuple[int, int]:
        tokenizer = self.processor.tokenizer
        return (
            tokenizer.convert_tokens_to_ids(self.processor.image_token),
            tokenizer.convert_tokens_to_ids(self.processor.video_token),
        )

    def _split_counts(self, sample_id: str, input_ids: Sequence[int]) -> LengthResult:
        image_pad, video_pad = self._pad_ids()
        ids = np.asarray(input_ids)
        image_tokens = int(np.count_nonzero(ids == image_pad))
        video_tokens = int(np.count_nonzero(ids == video_pad))
        return LengthResult(
            sample_id, STATUS_OK, "", len(ids), len(ids) - image_tokens - video_tokens, image_tokens, video_tokens
        )

    # ---- exact path ---------------------------------------------------------------------
    def exact(self, sample: SampleForLength) -> LengthResult:
        from PIL import Image
        from transformers.image_utils import load_image

        try:
            text = self.render(sample.messages)
            images, videos = [], []
            for kind, ref in zip(sample.media_kinds, sample.media_refs):
                if kind == "image":
                    with open_media(ref) as handle:
                        images.append(load_image(Image.open(handle)))
                else:
                    videos.append(self.video_loader(ref, self.frame_cache))
            encoded = self.processor(
                text=[text], images=images or None, videos=videos or None, return_tensors=None
            )
        except Exception as error:  # the processor raises ValueError, OSError, RuntimeError...
            return LengthResult.rejected(sample.sample_id, f"{type(error).__name__}: {error}")
        return self._split_counts(sample.sample_id, encoded["input_ids"][0])

    # ---- fast path ----------------------------------------------------------------------
    def image_tokens(self, ref: str) -> int:
        return self.image_tokens_for_size(*oriented_image_size(ref))

    def image_tokens_for_size(self, height: int, width: int) -> int:
        if (height, width) not in self._tokens_by_size:
            image_processor = self.processor.image_processor
            patches = image_processor.get_number_of_image_patches(height, width, {})
            self._tokens_by_size[height, width] = patches // image_processor.merge_size**2
        return self._tokens_by_size[height, width]

    @property
    def video_tokens_per_clip(self) -> int:
        return _video_tokens_for_shape(self.processor, self.frame_cache.num_frames, self.frame_cache.frame_size)

    def fast_many(self, samples: Sequence[SampleForLength], batch_size: int = 256) -> list[LengthResult]:
        if not supports_fast_path(self.processor):
            return [self.exact(sample) for sample in samples]
        results: list[LengthResult] = []
        for start in range(0, len(samples), batch_size):
            results.extend(map(self.complete, measure_samples(samples[start:start + batch_size], self.text)))
        return results

    def complete(self, measured: MeasuredSample) -> LengthResult:
        """The length of a measured sample: its text tokens plus the processor's image and video tokens."""
        if measured.error:
            return LengthResult.rejected(measured.sample_id, measured.error)
        try:
            image_total = sum(self.image_tokens_for_size(*size) for size in measured.image_sizes)
            video_total = measured.videos * self.video_tokens_per_clip if measured.videos else 0
        except Exception as error:  # same failure classes as the exact path
            return LengthResult.rejected(measured.sample_id, f"{type(error).__name__}: {error}")
        return LengthResult(
            measured.sample_id, STATUS_OK, "", measured.text_tokens + image_total + video_total,
            measured.text_tokens, image_total, video_total,
        )


def measure_samples(samples: Sequence[SampleForLength], text: TextCounter) -> list[MeasuredSample]:
    """Each sample's text tokens (its template rendered with one pad token per media item) and media shapes."""
    results: list[MeasuredSample | None] = [None] * len(samples)
    rendered: list[tuple[int, str, tuple[tuple[int, int], ...], int]] = []  # (index, text, image sizes, videos)
    for index, sample in enumerate(samples):
        try:
            sizes = tuple(oriented_image_size(ref) for kind, ref in zip(sample.media_kinds, sample.media_refs)
                          if kind == "image")
            videos = sum(1 for kind in sample.media_kinds if kind == "video")
            rendered.append((index, text.render(chat_conversation(sample.messages)), sizes, videos))
        except Exception as error:  # same failure classes as the exact path
            results[index] = MeasuredSample(sample.sample_id, 0, (), 0, f"{type(error).__name__}: {error}")
    counts = text.token_counts([prompt for _index, prompt, _sizes, _videos in rendered]) if rendered else []
    for (index, _text, sizes, videos), count in zip(rendered, counts):
        # The rendered text holds one pad token per media item; the processor's own counts replace them.
        results[index] = MeasuredSample(samples[index].sample_id, count - len(samples[index].media_kinds), sizes, videos)
    return [result for result in results if result is not None]


def oriented_image_size(ref: str) -> tuple[int, int]:
    """(height, width) after EXIF orientation, read from the header without decoding pixels."""
    from PIL import Image

    with open_media(ref) as handle, Image.open(handle) as image:
        width, height = image.size
        if image.format == "PNG" and not _png_metadata_after_pixels(ref):
            # Everything Pillow would read is already in `info`; PNG's own getexif() would decode the pixels.
            exif = Image.Image.getexif(image)
        else:
            exif = image.getexif()
        orientation = exif.get(EXIF_ORIENTATION_TAG, 1)
    if orientation in ORIENTATIONS_THAT_SWAP_AXES:
        width, height = height, width
    return height, width


PNG_METADATA_CHUNKS = frozenset({b"eXIf", b"iTXt", b"tEXt", b"zTXt"})


def _png_metadata_after_pixels(ref: str) -> bool:
    """True when a PNG stores EXIF/XMP-capable chunks after its pixel data (walks chunk headers only)."""
    with open_media(ref) as handle:
        handle.seek(8)
        seen_pixels = False
        while True:
            header = handle.read(8)
            if len(header) < 8:
                return False
            length, chunk_type = int.from_bytes(header[:4], "big"), header[4:8]
            if chunk_type == b"IDAT":
                seen_pixels = True
            elif chunk_type == b"IEND":
                return False
            elif seen_pixels and chunk_type in PNG_METADATA_CHUNKS:
                return True
            handle.seek(length + 4, 1)


@lru_cache(maxsize=16)
def _video_tokens_for_shape(processor: Any, num_frames: int, frame_size: int) -> int:
    clip = np.zeros((num_frames, frame_size, frame_size, 3), dtype=np.uint8)
    grid = processor.video_processor(videos=[clip], return_tensors="np")["video_grid_thw"][0]
    return int(np.prod(grid)) // processor.video_processor.merge_size**2
