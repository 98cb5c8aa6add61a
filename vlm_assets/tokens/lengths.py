"""Exact token lengths: the length of `input_ids` the processor returns for a sample (docs/formats.md).

The exact path calls the processor as a trainer does: the chat template rendered by the processor,
a sample's images loaded as `transformers.image_utils.load_image` does and passed as one group
(so multi-image modes apply), each video as the frame cache's frames with the processor's own frame
sampling off and the clip's metadata (fps, frame count, the cache's frame indices) alongside.

The fast path counts without pixels: image sizes from file headers (EXIF orientation applied) and
the family's own image-token arithmetic (vlm_assets.tokens.image_tokens), one frame-cache-shaped
clip's video token count (vlm_assets.tokens.video_tokens), and batched tokenisation of the template
rendered with a single placeholder token per media item (inside the text the processor writes
around its tokens: for a Qwen3-VL or GLM-4.1V clip, each temporal patch's time, from the clip's fps
and frame indices as the catalogue's decoding pass kept them). It is used per family and modality only where
probes proved it equal to the exact path (vlm_assets.tokens.profile); every other sample goes through
the exact path.

The fast path runs in two stages: `measure_samples` needs only the text (vlm_assets.tokens.text)
and the files, so it runs where the processor is not loaded; `LengthCounter.complete` turns image
sizes and video counts into tokens with the processor's own arithmetic.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vlm_assets.media.checks import medium_read_failure
from vlm_assets.media.images import oriented_image_size
from vlm_assets.media.refs import read_media_bytes
from vlm_assets.catalog.messages import split_on_placeholders
from vlm_assets.catalog.schema import STATUS_OK, STATUS_REJECTED
from vlm_assets.config import FrameCacheConfig
from vlm_assets.media.video_probe import SampledFrames
from vlm_assets.media.trainer_decoder import TrainerClipView
from vlm_assets.tokens.consumer import (
    CLIP_MARKUP,
    ClipShape,
    CountingRule,
    clip_video_pads,
    consumer_clip_shape,
    consumer_video,
    qwen3_plugin_clip_text,
    qwen3_plugin_clip_text_for_shape,
)
from vlm_assets.tokens.image_tokens import ImageExpansion, image_token_arithmetic, marked_token_ids
from vlm_assets.tokens.text import ProcessorText, TextCounter, control_token_in
from vlm_assets.tokens.video_tokens import (
    ClipFacts,
    VideoExpansion,
    usable_clip_facts,
    video_tokens_for_shape,
)

# Reason prefix of a sample the processor call itself refused (not its media, text or template):
# `lengths_match_processor` fails on such rows, since they point at the processor or at this code.
PROCESSOR_CALL_FAILED = "processor call failed"

VideoFrameLoader = Callable[[str, FrameCacheConfig], tuple[SampledFrames, np.ndarray]]


@dataclass(frozen=True)
class SampleForLength:
    sample_id: str
    messages: str  # catalogue JSON (role/content with <image>/<video> placeholders)
    media_kinds: Sequence[str]
    media_refs: Sequence[str]
    # What the trainer's decoder makes of each video (the catalogue's media_views; "" or none: not known).
    media_views: Sequence[str] = ()

    def trainer_views(self) -> list[TrainerClipView] | None:
        """The views of the sample's videos, in order (None: one is not known)."""
        views = [TrainerClipView.parse(view) for kind, view in zip(self.media_kinds, self.media_views) if kind == "video"]
        return None if None in views or len(views) != list(self.media_kinds).count("video") else views


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

    def with_text_tokens_added(self, tokens: int) -> LengthResult:
        if not tokens or self.status != STATUS_OK:
            return self
        return replace(self, token_len=self.token_len + tokens, text_tokens=self.text_tokens + tokens)


@dataclass(frozen=True)
class MeasuredSample:
    """A sample's text tokens and media shapes: what its length needs besides the processor's arithmetic."""

    sample_id: str
    text_tokens: int
    image_sizes: tuple[tuple[int, int], ...]  # (height, width) after EXIF orientation
    videos: int
    error: str = ""  # why the text or an image could not be measured: the sample's rejection reason
    # Its clips are written with the processor's image tokens and it has images: the exact path's split
    # counts the clips' tokens among its image tokens.
    video_tokens_are_image_tokens: bool = False

    @property
    def grouped_images(self) -> bool:
        """Whether the images reach the processor as a group of several (LLaVA-OneVision counts those apart)."""
        return len(self.image_sizes) > 1


@dataclass(frozen=True)
class Modalities:
    """What a processor takes, and which of it the fast path counts (proven by vlm_assets.tokens.profile)."""

    processor_class: str
    takes_images: bool
    takes_videos: bool
    fast_text: bool = False
    fast_images: bool = False
    fast_videos: bool = False
    # The fast path's text for an image (image_tokens.ImageExpansion), where it is not the placeholder alone.
    image_placeholder: str = ""
    image_expansion: str = ""
    image_tokens_in_expansion: int = 1
    # The fast path's text for a clip (video_tokens.VideoExpansion), where it is not the placeholder alone.
    video_placeholder: str = ""
    video_patch_text: str = ""
    video_patch_frames: int = 0
    video_tokens_in_patch: int = 1
    video_spelled_with_image_tokens: bool = False
    video_clip_tokens: int = 0  # a clip's tokens in that text, for a video processor without a patch count
    video_time_style: str = ""  # how that text prints each temporal patch's time (video_tokens.PATCH_TIME_STYLES)
    # Whether a clip the consumer resizes is counted from its shape (consumer.ClipShape) as the processor
    # counts its pixels, and whether Qwen3-VL's media plugin writes the same text for that shape.
    clip_shape_tokens: bool = False
    clip_shape_plugin_text: bool = False

    def with_image_expansion(self, expansion: ImageExpansion) -> Modalities:
        return replace(self, image_placeholder=expansion.placeholder, image_expansion=expansion.text,
                       image_tokens_in_expansion=expansion.image_tokens)

    def expand_images(self, text: str) -> str:
        return text.replace(self.image_placeholder, self.image_expansion) if self.image_placeholder else text

    def with_video_expansion(self, expansion: VideoExpansion) -> Modalities:
        return replace(self, video_placeholder=expansion.placeholder, video_patch_text=expansion.patch_text,
                       video_patch_frames=expansion.patch_frames, video_tokens_in_patch=expansion.video_tokens_in_patch,
                       video_spelled_with_image_tokens=expansion.spelled_with_image_tokens,
                       video_clip_tokens=expansion.clip_tokens, video_time_style=expansion.time_style)

    @property
    def video_expansion(self) -> VideoExpansion | None:
        if not self.video_placeholder:
            return None
        return VideoExpansion(self.video_placeholder, self.video_patch_text, self.video_patch_frames,
                              self.video_tokens_in_patch, self.video_spelled_with_image_tokens,
                              self.video_clip_tokens, self.video_time_style)

    def video_clips(self, sample: SampleForLength, clip_facts: ClipFacts | None) -> list[SampledFrames | None] | None:
        """The facts of the sample's clips that its videos' text needs (None: one of them is not known)."""
        videos = [ref for kind, ref in zip(sample.media_kinds, sample.media_refs) if kind == "video"]
        expansion = self.video_expansion
        if expansion is None or not expansion.needs_clip_facts:
            return [None] * len(videos)
        clips = [clip_facts(ref) if clip_facts is not None else None for ref in videos]
        return None if None in clips else clips

    def expand_videos(self, text: str, clips: Sequence[SampledFrames | None]) -> tuple[str, int]:
        """`text` with each clip's placeholder replaced by the clip's text, and the video tokens left in it."""
        expansion = self.video_expansion
        if expansion is None:
            return text, len(clips)
        pieces = text.split(expansion.placeholder)
        if len(pieces) != len(clips) + 1:
            raise ValueError(f"the text has {len(pieces) - 1} video placeholders for {len(clips)} videos")
        expanded = [pieces[0]]
        for clip, piece in zip(clips, pieces[1:]):
            expanded += [expansion.clip_text(clip), piece]
        return "".join(expanded), sum(expansion.video_tokens_in_clip(clip) for clip in clips)

    def refusal(self, media_kinds: Sequence[str]) -> str:
        """Why the processor cannot count a sample with these media ("" when it can)."""
        for kind, takes in (("image", self.takes_images), ("video", self.takes_videos)):
            if kind in media_kinds and not takes:
                return f"processor {self.processor_class} takes no {kind}"
        return ""

    def counts_fast(self, media_kinds: Sequence[str]) -> bool:
        return (self.fast_text
                and (self.fast_images or "image" not in media_kinds)
                and (self.fast_videos or "video" not in media_kinds))


def modalities_of(processor: Any) -> Modalities:
    """The modalities a loaded processor takes; the fast path is off until proven."""
    return Modalities(
        type(processor).__name__,
        takes_images=getattr(processor, "image_processor", None) is not None,
        takes_videos=getattr(processor, "video_processor", None) is not None,
    )


def chat_conversation(messages_json: str) -> list[dict[str, Any]]:
    """Catalogue messages as the structured conversation HF chat templates expect."""
    return [
        {"role": message["role"], "content": split_on_placeholders(message["content"])}
        for message in json.loads(messages_json)
    ]


def text_refusal(conversation: list[dict[str, Any]], text: TextCounter, reject_control_tokens: bool) -> str:
    return control_token_in(conversation, text.control_tokens) if reject_control_tokens else ""


def sample_refusal(conversation: list[dict[str, Any]], media_kinds: Sequence[str], modalities: Modalities,
                   text: TextCounter, reject_control_tokens: bool, rule: CountingRule | None) -> str:
    """Why the sample gets no length ("" when it gets one): a modality the processor does not take,
    a control token in its text, or a shape its sample type's consumer cannot carry."""
    return (modalities.refusal(media_kinds) or text_refusal(conversation, text, reject_control_tokens)
            or (rule.refusal(conversation, media_kinds) or rule.answer_refusal(conversation, text.token_spans)
                if rule is not None else ""))


def answer_apart_tokens(text: TextCounter, conversation: list[dict[str, Any]], rule: CountingRule | None) -> int:
    """The text tokens the consumer's encoding has beyond the rendered text's (CountingRule.answer_apart_tokens)."""
    return rule.answer_apart_tokens(conversation, text.token_counts) if rule is not None else 0


def rendered_text(text: TextCounter, conversation: list[dict[str, Any]], rule: CountingRule | None) -> str:
    """The text the processor tokenises: the chat template's, or the one the sample type's consumer encodes."""
    if rule is None:
        return text.render(conversation)
    return rule.finish(text.render(rule.conversation(conversation), rule.template))


def fast_path_counts(sample: SampleForLength, modalities: Modalities, text: TextCounter, reject_control_tokens: bool,
                     rule: CountingRule | None = None, clip_facts: ClipFacts | None = None) -> bool:
    """Whether the fast path counts this sample: its modalities are proven, and its text holds no control
    token that is kept (only the processor knows what a kept one does: expand it, refuse it, ...).
    A video the consumer samples itself is counted from its frames (the exact path), and so is one
    whose text needs facts of the clip (Qwen3-VL's times) that `clip_facts` does not know."""
    if not modalities.counts_fast(sample.media_kinds):
        return False
    if rule is not None and rule.resizes_media and "video" in sample.media_kinds:
        return False
    if "video" in sample.media_kinds and modalities.video_clips(sample, clip_facts) is None:
        return False
    return reject_control_tokens or not control_token_in(chat_conversation(sample.messages), text.control_tokens)


def supports_fast_images(processor: Any) -> bool:
    """Whether the processor has the arithmetic the fast path counts images with (whether it is right, probes tell)."""
    return hasattr(processor, "image_token") and image_token_arithmetic(processor) is not None


def supports_fast_videos(processor: Any) -> bool:
    """Whether the processor has what the fast path counts videos with: a video token whose replacement it
    reports, and a clip's tokens by its video processor's patch count or counted in that replacement
    (`clip_video_tokens`). Whether the count is right, probes tell."""
    return hasattr(processor, "video_token") and getattr(processor, "video_processor", None) is not None


def clip_video_tokens(processor: Any, frame_cache: FrameCacheConfig, modalities: Modalities) -> int:
    """A clip's video tokens at the frame cache's shape: by the video processor's patch count, else as
    counted in the processor's text for such a clip (the clip expansion of `modalities`)."""
    counted = video_tokens_for_shape(processor, frame_cache.num_frames, frame_cache.frame_size)
    if counted is not None:
        return counted
    if not modalities.video_clip_tokens:
        raise TypeError(f"no video-token count for {modalities.processor_class}")
    return modalities.video_clip_tokens


def decode_video_frames(ref: str, settings: FrameCacheConfig) -> tuple[SampledFrames, np.ndarray]:
    """The frames a trainer sees for a video: the frame cache's sampled frames at frame_size², and which they are."""
    from vlm_assets.media.video import decode_sampled_frames

    sampled, frames = decode_sampled_frames(ref, settings.num_frames, settings.frame_size)
    return sampled, np.stack(frames)


def video_metadata(sampled: SampledFrames, frame_size: int) -> Any:
    """The clip's metadata as transformers' video processors take it (Qwen3-VL prints timestamps from it)."""
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(
        total_num_frames=sampled.total_frames,
        fps=sampled.fps or None,
        width=frame_size,
        height=frame_size,
        duration=sampled.total_frames / sampled.fps if sampled.fps else None,
        frames_indices=list(sampled.frame_indices),
    )


class LengthCounter:
    def __init__(
        self,
        processor: Any,
        frame_cache: FrameCacheConfig,
        video_loader: VideoFrameLoader = decode_video_frames,
        modalities: Modalities | None = None,
        reject_control_tokens: bool = True,
        tokens_per_clip: int | None = None,
        rule: CountingRule | None = None,
        clip_facts: ClipFacts | None = None,
    ) -> None:
        """`tokens_per_clip`: a video's tokens, when a processor of the same files counted them before.
        `rule`: what the packed shards' consumer encodes of a sample (None: the sample as the chat template
        renders it, videos as the frame cache's frames).
        `clip_facts`: each video's frame count, fps and frame indices as the frame cache samples them
        (e.g. `MosaicSpool.sampled`), for a family whose video text follows them; without them, or for a
        video they do not know, such a sample is counted by the exact path."""
        self.processor = processor
        self.frame_cache = frame_cache
        self.video_loader = video_loader
        self.modalities = modalities or modalities_of(processor)
        self.reject_control_tokens = reject_control_tokens
        self.text = ProcessorText(processor)
        self.rule = rule.bound_to(self.modalities.processor_class) if rule is not None else None
        self._image_arithmetic = image_token_arithmetic(processor)
        self._tokens_by_size: dict[tuple[int, int], int] = {}
        self._grouped_tokens_by_size: dict[tuple[int, int], int] = {}
        self._tokens_per_clip = tokens_per_clip
        self.clip_facts = clip_facts

    # ---- shared -------------------------------------------------------------------------
    def render(self, messages_json: str) -> str:
        return rendered_text(self.text, chat_conversation(messages_json), self.rule)

    def _split_counts(self, sample: SampleForLength, input_ids: Sequence[int]) -> LengthResult:
        """The length, split by what the processor's image and video token ids mark (text: the rest)."""
        ids = np.asarray(input_ids).reshape(-1)
        image_ids = marked_token_ids(self.processor, "image") if self.modalities.takes_images else []
        video_ids = marked_token_ids(self.processor, "video") if self.modalities.takes_videos else []
        image_tokens = int(np.isin(ids, image_ids).sum())
        video_tokens = int(np.isin(ids, [i for i in video_ids if i not in image_ids]).sum())
        # A family may spell video frames with its image tokens (InternVL): in a sample without images they are video.
        if "image" not in sample.media_kinds:
            image_tokens, video_tokens = 0, image_tokens + video_tokens
        return LengthResult(sample.sample_id, STATUS_OK, "", len(ids), len(ids) - image_tokens - video_tokens,
                            image_tokens, video_tokens)

    # ---- exact path ---------------------------------------------------------------------
    def exact(self, sample: SampleForLength) -> LengthResult:
        """The length as the consumer's own reading gives it: every medium decoded."""
        return self._length(sample, None)

    def counted(self, sample: SampleForLength) -> LengthResult:
        """The length of a sample off the fast path: the consumer's clips by their shape, from what the
        trainer's decoder makes of each (the catalogue's views), where the probes proved that shape's
        count equal to the pixels'; else the exact path."""
        return self._length(sample, self._clip_shapes(sample))

    def _clip_shapes(self, sample: SampleForLength) -> list[ClipShape] | None:
        if self.rule is None or not self.rule.resizes_media or "video" not in sample.media_kinds:
            return None
        proven = (self.modalities.clip_shape_plugin_text if self.rule.plugin_writes_clips
                  else self.modalities.clip_shape_tokens)
        views = sample.trainer_views() if proven else None
        if views is None:
            return None
        try:
            shapes = [consumer_clip_shape(view, self.rule) for view in views]
        except ValueError:  # a clip too short or too narrow: the exact path names why
            return None
        return None if None in shapes else shapes

    def _length(self, sample: SampleForLength, clip_shapes: list[ClipShape] | None) -> LengthResult:
        try:
            conversation = chat_conversation(sample.messages)
            refusal = sample_refusal(conversation, sample.media_kinds, self.modalities, self.text,
                                     self.reject_control_tokens, self.rule)
            if refusal:
                return LengthResult.rejected(sample.sample_id, refusal)
            text = rendered_text(self.text, conversation, self.rule)
            images, videos, metadata = [], [], []
            decoded: dict[str, Any] = {}  # a file named several times is decoded once, passed as one object
            for kind, ref in zip(sample.media_kinds, sample.media_refs):
                if kind == "image":
                    if ref not in decoded:
                        decoded[ref] = self._image(ref)
                    images.append(decoded[ref])
                elif clip_shapes is not None:
                    videos.append(clip_shapes[len(videos)])
                elif self.rule is not None and self.rule.resizes_media:
                    videos.append(consumer_video(read_media_bytes(ref), self.rule))
                else:
                    sampled, frames = self.video_loader(ref, self.frame_cache)
                    videos.append(frames)
                    metadata.append(video_metadata(sampled, self.frame_cache.frame_size))
        except Exception as error:  # a template, a file or a decoder refusing the sample
            _raise_if_machine_failure(error, sample)
            return LengthResult.rejected(sample.sample_id, f"{type(error).__name__}: {error}")
        return self._encoded_length(sample, text, images, videos, metadata, clip_shapes).with_text_tokens_added(
            answer_apart_tokens(self.text, conversation, self.rule))

    def _encoded_length(self, sample: SampleForLength, text: str, images: list, videos: list, metadata: list,
                        clip_shapes: list[ClipShape] | None) -> LengthResult:
        if videos and self.rule is not None and self.rule.plugin_writes_clips:
            return self._count_plugin_clips(sample, text, videos)
        if clip_shapes is not None:
            return self._count_shaped_clips(sample, text, clip_shapes)
        video_kwargs: dict[str, Any] = {"do_sample_frames": False} if videos else {}
        if metadata:
            video_kwargs["video_metadata"] = metadata
        try:
            # Tensors: some families (InternVL) assemble video pixels from tensors only.
            encoded = self.processor(
                text=[text], images=[images] if images else None, videos=videos or None, return_tensors="pt",
                **video_kwargs,
            )
        except Exception as error:
            return LengthResult.rejected(sample.sample_id, self._call_failure(error, sample, images, videos, metadata))
        return self._split_counts(sample, encoded["input_ids"][0])

    def _count_plugin_clips(self, sample: SampleForLength, text: str, clips: list[Any]) -> LengthResult:
        """A sample whose clips the consumer's media plugin writes into its text (Qwen3-VL's), each in place
        of the next clip's markup, the whole then tokenised by the tokenizer alone, as the consumer does."""
        video_refs = [ref for ref, kind in zip(sample.media_refs, sample.media_kinds) if kind == "video"]
        for ref, clip in zip(video_refs, clips, strict=True):
            try:
                clip_text = (qwen3_plugin_clip_text_for_shape(self.processor, clip) if isinstance(clip, ClipShape)
                             else qwen3_plugin_clip_text(self.processor, clip))
            except Exception as error:  # the video processor refusing the clip
                return LengthResult.rejected(sample.sample_id, f"{type(error).__name__}: {error} (video {ref})")
            text = text.replace(CLIP_MARKUP, clip_text, 1)
        return self._split_counts(sample, self.processor.tokenizer(text)["input_ids"])

    def _count_shaped_clips(self, sample: SampleForLength, text: str, clips: list[ClipShape]) -> LengthResult:
        """A sample whose clips are known by their shape: each clip's markup holds the video tokens the
        processor would put there for such frames, the whole tokenised as the processor tokenises it."""
        for clip in clips:
            pads = CLIP_MARKUP.replace(self.processor.video_token, self.processor.video_token * clip_video_pads(
                self.processor, clip))
            text = text.replace(CLIP_MARKUP, pads, 1)
        return self._split_counts(sample, self.processor.tokenizer(text)["input_ids"])

    def _image(self, ref: str) -> Any:
        """The image's pixels at the size they reach the processor."""
        from vlm_assets.media.images import decoded_rgb

        image = decoded_rgb(ref)
        if self.rule is not None and self.rule.resizes_media:
            height, width = self.rule.image_size(image.height, image.width)
            image = image.resize((width, height))
        return image

    def _call_failure(self, error: Exception, sample: SampleForLength, images: list, videos: list, metadata: list) -> str:
        """Why the processor call failed: a media item its image or video processor refuses alone, else the call."""
        image_refs = [ref for ref, kind in zip(sample.media_refs, sample.media_kinds) if kind == "image"]
        video_refs = [ref for ref, kind in zip(sample.media_refs, sample.media_kinds) if kind == "video"]
        for ref, image in zip(image_refs, images):
            try:
                self.processor.image_processor(images=[image], return_tensors="pt")
            except Exception as media_error:
                return f"{type(media_error).__name__}: {media_error} (image {ref})"
        for ref, clip, clip_metadata in zip(video_refs, videos, metadata or [None] * len(videos)):
            try:
                self.processor.video_processor(videos=[clip], do_sample_frames=False,
                                               video_metadata=[clip_metadata] if clip_metadata else None,
                                               return_tensors="pt")
            except Exception as media_error:
                return f"{type(media_error).__name__}: {media_error} (video {ref})"
        return f"{PROCESSOR_CALL_FAILED} ({self.modalities.processor_class}): {type(error).__name__}: {error}"

    # ---- fast path ----------------------------------------------------------------------
    def image_tokens(self, ref: str) -> int:
        return self.image_tokens_for_size(*oriented_image_size(ref))

    def image_tokens_for_size(self, height: int, width: int, grouped: bool = False) -> int:
        """`grouped`: the image is one of several of its sample."""
        known = self._grouped_tokens_by_size if grouped else self._tokens_by_size
        if (height, width) not in known:
            if self._image_arithmetic is None:
                raise TypeError(f"no image-token arithmetic for {self.modalities.processor_class}")
            known[height, width] = self._image_arithmetic(height, width, grouped)
        return known[height, width]

    @property
    def video_tokens_per_clip(self) -> int:
        if self._tokens_per_clip is None:
            self._tokens_per_clip = clip_video_tokens(self.processor, self.frame_cache, self.modalities)
        return self._tokens_per_clip

    def count(self, samples: Sequence[SampleForLength], batch_size: int = 256) -> list[LengthResult]:
        """Each sample's length: the fast path where it is proven for the sample's modalities, else the exact path."""
        results: list[LengthResult] = []
        for start in range(0, len(samples), batch_size):
            batch = samples[start:start + batch_size]
            clip_facts = usable_clip_facts(self.clip_facts, self.frame_cache) if self.clip_facts else None
            fast = [fast_path_counts(sample, self.modalities, self.text, self.reject_control_tokens, self.rule,
                                     clip_facts) for sample in batch]
            measured = iter(measure_samples([sample for sample, quick in zip(batch, fast) if quick], self.text,
                                            self.modalities, self.reject_control_tokens, self.rule, clip_facts))
            results.extend(self.complete(next(measured)) if quick else self.counted(sample)
                           for sample, quick in zip(batch, fast))
        return results

    def complete(self, measured: MeasuredSample) -> LengthResult:
        """The length of a measured sample: its text tokens plus the processor's image and video tokens."""
        return completed_length(measured, self.image_tokens_for_size, lambda: self.video_tokens_per_clip)

    @property
    def image_tokens_by_size(self) -> dict[tuple[int, int], int]:
        """The image tokens of every (height, width) this counter has counted for an image alone in its sample."""
        return dict(self._tokens_by_size)

    @property
    def grouped_image_tokens_by_size(self) -> dict[tuple[int, int], int]:
        """The image tokens of every (height, width) this counter has counted for one of several images of a sample."""
        return dict(self._grouped_tokens_by_size)


def completed_length(measured: MeasuredSample, image_tokens_for_size: Callable[[int, int, bool], int],
                     video_tokens_per_clip: Callable[[], int]) -> LengthResult:
    """The length of a measured sample: its text tokens plus the image and video tokens the
    processor's arithmetic gives (from the processor, or as it gave them before)."""
    if measured.error:
        return LengthResult.rejected(measured.sample_id, measured.error)
    try:
        image_total = sum(image_tokens_for_size(*size, measured.grouped_images) for size in measured.image_sizes)
        video_total = measured.videos * video_tokens_per_clip() if measured.videos else 0
    except Exception as error:  # same failure classes as the exact path
        return LengthResult.rejected(measured.sample_id, f"{type(error).__name__}: {error}")
    if measured.video_tokens_are_image_tokens:
        image_total, video_total = image_total + video_total, 0
    return LengthResult(
        measured.sample_id, STATUS_OK, "", measured.text_tokens + image_total + video_total,
        measured.text_tokens, image_total, video_total,
    )


def _raise_if_machine_failure(error: Exception, sample: SampleForLength) -> None:
    """A medium the catalogue read that cannot be read now fails the step instead of rejecting the
    sample: restored, the medium would otherwise stay rejected (see media.checks.MediumChanged)."""
    failure = medium_read_failure(error, sample.media_refs)
    if failure is not None:
        raise failure from error


def measure_samples(
    samples: Sequence[SampleForLength], text: TextCounter, modalities: Modalities, reject_control_tokens: bool = True,
    rule: CountingRule | None = None, clip_facts: ClipFacts | None = None,
) -> list[MeasuredSample]:
    """Each sample's text tokens (its template rendered with one pad token per media item, an image's with
    the text the processor puts around its tokens, a clip's with its text and one pad per run of video
    tokens) and media shapes (images: the size they reach the processor at). `clip_facts`: what the
    clips' text needs of them, known for every video of these samples (see fast_path_counts)."""
    results: list[MeasuredSample | None] = [None] * len(samples)
    # (index, text, image sizes, videos, video pads, tokens the consumer has beyond the text's)
    rendered: list[tuple[int, str, tuple[tuple[int, int], ...], int, int, int]] = []
    for index, sample in enumerate(samples):
        clips = modalities.video_clips(sample, clip_facts)
        if clips is None:
            raise ValueError(f"{sample.sample_id}: its clips' facts are not known; the exact path counts it "
                             "(see fast_path_counts)")
        try:
            conversation = chat_conversation(sample.messages)
            refusal = sample_refusal(conversation, sample.media_kinds, modalities, text, reject_control_tokens, rule)
            if refusal:
                results[index] = MeasuredSample(sample.sample_id, 0, (), 0, refusal)
                continue
            sizes = tuple(oriented_image_size(ref) for kind, ref in zip(sample.media_kinds, sample.media_refs)
                          if kind == "image")
            if rule is not None:
                # A size and its transpose give the same tokens, so EXIF orientation (which the consumer's
                # decoder does not apply) changes no count.
                sizes = tuple(rule.image_size(*size) for size in sizes)
            prompt, video_pads = modalities.expand_videos(
                modalities.expand_images(rendered_text(text, conversation, rule)), clips)
            rendered.append((index, prompt, sizes, len(clips), video_pads, answer_apart_tokens(text, conversation, rule)))
        except Exception as error:  # same failure classes as the exact path
            _raise_if_machine_failure(error, sample)
            results[index] = MeasuredSample(sample.sample_id, 0, (), 0, f"{type(error).__name__}: {error}")
    counts = text.token_counts([prompt for _index, prompt, *_shapes in rendered]) if rendered else []
    for (index, _text, sizes, videos, video_pads, apart), count in zip(rendered, counts):
        # The rendered text holds the expansions' video tokens per video and image tokens per image; the
        # processor's own counts replace them.
        pads = video_pads + len(sizes) * modalities.image_tokens_in_expansion
        results[index] = MeasuredSample(samples[index].sample_id, count - pads + apart, sizes, videos,
                                        video_tokens_are_image_tokens=bool(
                                            videos and sizes and modalities.video_spelled_with_image_tokens))
    return [result for result in results if result is not None]
