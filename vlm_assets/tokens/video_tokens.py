"""A video's tokens without its pixels: the processor's video-token arithmetic and the text around them.

Every clip of the frame cache has the same shape (`num_frames` frames at `frame_size`²), so its video
tokens are one number per shape: the video processor's public `get_num_of_video_patches` over its
`merge_size`² where it has them (Qwen-VL, GLM-4.1V), else the marked tokens of the processor's own
text for a clip of that shape (LLaVA-OneVision pools each frame to a fixed grid; InternVL writes each
frame with its image tokens). What a family writes around those tokens may follow the clip: Qwen3-VL puts each
temporal patch's time in the clip before it ("<3.6 seconds>"), GLM-4.1V writes each temporal patch as
an image followed by its first frame's whole seconds ("<|end_of_image|>19"), both from the clip's fps
and the frame indices the cache sampled (PATCH_TIME_STYLES). That text is tokenised with the sample's
own text, as the processor tokenises it, with the clip's facts taken from the catalogue's decoding
pass (vlm_assets.frames.spool) instead of the pixels. `video_expansion` reads the text from the
processor itself; the probes of vlm_assets.tokens.profile compare the counts it gives with the exact
path's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from vlm_assets.config import FrameCacheConfig
from vlm_assets.media.video_probe import SampledFrames
from vlm_assets.tokens.image_tokens import marked_token_ids

# A video's frame count, fps and sampled frame indices, as the frame cache has them, without decoding
# it (None: not known, so its sample is counted by the exact path).
ClipFacts = Callable[[str], SampledFrames | None]

# Where a temporal patch's time stands in its text.
TIME_SLOT = "\x00"


def _mean_in_tenths(seconds: Sequence[float]) -> str:
    """Qwen3-VL: the mean of the patch's first and last frame's time, to a tenth of a second."""
    return f"{(seconds[0] + seconds[-1]) / 2:.1f}"


def _first_in_whole_seconds(seconds: Sequence[float]) -> str:
    """GLM-4.1V: the patch's first frame's time, its whole seconds."""
    return str(int(seconds[0]))


# How a family prints a temporal patch's time from its frames' times (index / fps). The processors keep
# this arithmetic private, so it is written out here; `video_expansion` takes the style whose text
# equals the processor's, and the probes compare it with the processor's on clips of other facts.
PATCH_TIME_STYLES: dict[str, Callable[[Sequence[float]], str]] = {
    "mean-tenths": _mean_in_tenths,
    "first-whole-seconds": _first_in_whole_seconds,
}


@dataclass(frozen=True)
class VideoExpansion:
    """What the processor puts in place of a clip's placeholder, each run of video tokens cut to one."""

    placeholder: str  # the rendered text the processor replaces (its video token, or markup around it)
    patch_text: str  # one temporal patch's text, its time at TIME_SLOT; without one, the whole clip's text
    patch_frames: int  # frames per temporal patch, whose first and last frames' mean time is printed (0: no times)
    video_tokens_in_patch: int  # runs of video tokens in `patch_text`
    # Whether the clip is written with the processor's image tokens (InternVL's frames), which a sample
    # with images counts among its image tokens, as the exact path splits them.
    spelled_with_image_tokens: bool = False
    clip_tokens: int = 0  # the marked tokens of the processor's text for the clip it reported it for
    time_style: str = ""  # how each patch's time is printed (a key of PATCH_TIME_STYLES; "": no times)

    @property
    def needs_clip_facts(self) -> bool:
        return self.patch_frames > 0

    def clip_text(self, clip: SampledFrames | None) -> str:
        """The clip's text (`clip`: its facts, where the text has times)."""
        if not self.needs_clip_facts:
            return self.patch_text
        assert clip is not None, "a clip's text with times needs the clip's facts"
        return "".join(self.patch_text.replace(TIME_SLOT, time)
                       for time in patch_times(clip.frame_indices, clip.fps, self.patch_frames, self.time_style))

    def video_tokens_in_clip(self, clip: SampledFrames | None) -> int:
        if not self.needs_clip_facts:
            return self.video_tokens_in_patch
        assert clip is not None, "a clip's text with times needs the clip's facts"
        return self.video_tokens_in_patch * -(-len(clip.frame_indices) // self.patch_frames)


def patch_times(frame_indices: Sequence[int], fps: float, patch_frames: int, style: str) -> list[str]:
    """Each temporal patch's time as `style` prints it, the last patch filled up with the clip's last frame."""
    indices = list(frame_indices) + [frame_indices[-1]] * (-len(frame_indices) % patch_frames)
    seconds = [index / fps for index in indices]
    printed = PATCH_TIME_STYLES[style]
    return [printed(seconds[start:start + patch_frames]) for start in range(0, len(seconds), patch_frames)]


def video_tokens_for_shape(processor: Any, num_frames: int, frame_size: int) -> int | None:
    """A clip's video tokens at the frame cache's shape by the video processor's public patch count (None:
    it has none; the processor's text for such a clip counts them, `VideoExpansion.clip_tokens`)."""
    video_processor = processor.video_processor
    if not (hasattr(video_processor, "merge_size") and hasattr(video_processor, "get_num_of_video_patches")):
        return None
    patches = video_processor.get_num_of_video_patches(num_frames, frame_size, frame_size, {})
    return patches // video_processor.merge_size**2


def video_expansion(processor: Any, rendered: str, frames: Any, clip: SampledFrames,
                    metadata: Any) -> VideoExpansion | None:
    """The processor's replacement for the one clip placeholder of `rendered`, as it reports it for `frames`
    with `metadata` (the facts of `clip`); None where its text is not one this module writes. Its tokens
    follow no pixel: where the probes prove they follow no clip fact either, they are every clip's."""
    replaced = _clip_replacement(processor, rendered, frames, metadata)
    clip_tokens = _count_clip_tokens(processor, replaced["replacement"])
    text, runs = _cut_video_runs(processor, replaced["replacement"])
    if runs == 0:
        return None
    spelled_with_image_tokens = not _cut_video_runs(processor, replaced["replacement"], video_only=True)[1]
    patch_frames = getattr(processor.video_processor, "temporal_patch_size", 0)
    if runs == 1 or not patch_frames:
        # A text for the whole clip that no clip fact enters (the probes check it on clips of other facts).
        return VideoExpansion(replaced["text"], text, 0, runs, spelled_with_image_tokens, clip_tokens)
    for style in PATCH_TIME_STYLES:
        times = patch_times(clip.frame_indices, clip.fps, patch_frames, style)
        patch = _patch_with_time_slot(text, times)
        if patch is None:
            continue
        expansion = VideoExpansion(replaced["text"], patch, patch_frames, runs // len(times),
                                   spelled_with_image_tokens, clip_tokens, style)
        if expansion.clip_text(clip) == text:
            return expansion
    return None


def _clip_replacement(processor: Any, text: str, frames: Any, metadata: Any) -> dict[str, Any]:
    """What the processor reports it put in place of the one clip placeholder of `text` for `frames`."""
    encoded = processor(text=[text], videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                        return_text_replacement_offsets=True)
    (replaced,) = encoded["text_replacement_offsets"][0]
    return replaced


def _patch_with_time_slot(text: str, times: list[str]) -> str | None:
    """The first temporal patch of `text` (every patch's text alike but for its time), its time at TIME_SLOT."""
    first = text.find(times[0])
    if first < 0:
        return None
    before = text[:first]
    after_first = first + len(times[0])
    end = text.find(before + times[1], after_first) if len(times) > 1 else len(text)
    return None if end < 0 else before + TIME_SLOT + text[after_first:end]


def _clip_token_ids(processor: Any, video_only: bool = False) -> list[int]:
    """The ids a clip's tokens may be: the processor's video tokens, and its image tokens, with which a
    family may write video frames (InternVL, GLM-4.1V)."""
    video_ids = marked_token_ids(processor, "video")
    return video_ids if video_only else [*video_ids, *marked_token_ids(processor, "image")]


def _count_clip_tokens(processor: Any, replacement: str) -> int:
    """The clip's tokens in `replacement`: special tokens, written out whole."""
    tokens = sorted(set(processor.tokenizer.convert_ids_to_tokens(_clip_token_ids(processor))), key=len, reverse=True)
    return len(re.findall("|".join(map(re.escape, tokens)), replacement)) if tokens else 0


def _cut_video_runs(processor: Any, replacement: str, video_only: bool = False) -> tuple[str, int]:
    """`replacement` with each run of a clip's tokens cut to one token, and how many runs there were
    (`video_only`: runs of the processor's video tokens alone)."""
    tokens = processor.tokenizer.convert_ids_to_tokens(_clip_token_ids(processor, video_only))
    if not tokens:
        return replacement, 0
    # Longest first: a token that begins another (<img> and <img_x>) does not end its run early.
    tokens = sorted(set(tokens), key=len, reverse=True)
    run = re.compile("(?:" + "|".join(map(re.escape, tokens)) + ")+")
    return run.subn(lambda match: next(token for token in tokens if match.group().startswith(token)), replacement)


def usable_clip_facts(clip_facts: ClipFacts, frame_cache: FrameCacheConfig) -> ClipFacts:
    """`clip_facts` for one batch of samples: each video looked up once (deciding the path and measuring
    see the same facts, though an entry may go meanwhile), and only facts of the frame cache's shape
    with a frame rate kept (others are the exact path's to count)."""

    @lru_cache(maxsize=None)
    def facts(ref: str) -> SampledFrames | None:
        clip = clip_facts(ref)
        if clip is None or clip.fps <= 0 or len(clip.frame_indices) != frame_cache.num_frames:
            return None
        return clip if all(0 <= index < clip.total_frames for index in clip.frame_indices) else None

    return facts
