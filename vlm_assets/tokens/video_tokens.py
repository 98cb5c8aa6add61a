"""A video's tokens without its pixels: the processor's video-token arithmetic and the text around them.

Every clip of the frame cache has the same shape (`num_frames` frames at `frame_size`²), so its video
tokens are one number per shape: the video processor's public `get_num_of_video_patches` over its
`merge_size`². What a family writes around those tokens may follow the clip: Qwen3-VL puts each
temporal patch's time in the clip before it ("<3.6 seconds>"), from the clip's fps and the frame
indices the cache sampled. That text is tokenised with the sample's own text, as the processor
tokenises it, with the clip's facts taken from the catalogue's decoding pass (vlm_assets.frames.spool)
instead of the pixels. `video_expansion` reads the text from the processor itself; the probes of
vlm_assets.tokens.profile compare the counts it gives with the exact path's.
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


@dataclass(frozen=True)
class VideoExpansion:
    """What the processor puts in place of a clip's placeholder, each run of video tokens cut to one."""

    placeholder: str  # the rendered text the processor replaces (its video token, or markup around it)
    patch_text: str  # one temporal patch's text, its time at TIME_SLOT; without one, the whole clip's text
    patch_frames: int  # frames per temporal patch, whose first and last frames' mean time is printed (0: no times)
    video_tokens_in_patch: int  # runs of video tokens in `patch_text`

    @property
    def needs_clip_facts(self) -> bool:
        return self.patch_frames > 0

    def clip_text(self, clip: SampledFrames | None) -> str:
        """The clip's text (`clip`: its facts, where the text has times)."""
        if not self.needs_clip_facts:
            return self.patch_text
        assert clip is not None, "a clip's text with times needs the clip's facts"
        return "".join(self.patch_text.replace(TIME_SLOT, f"{seconds:.1f}")
                       for seconds in patch_times(clip.frame_indices, clip.fps, self.patch_frames))

    def video_tokens_in_clip(self, clip: SampledFrames | None) -> int:
        if not self.needs_clip_facts:
            return self.video_tokens_in_patch
        assert clip is not None, "a clip's text with times needs the clip's facts"
        return self.video_tokens_in_patch * -(-len(clip.frame_indices) // self.patch_frames)


def patch_times(frame_indices: Sequence[int], fps: float, patch_frames: int) -> list[float]:
    """Each temporal patch's time in seconds: the mean of its first and last frame's, the last patch
    filled up with the clip's last frame. Qwen3-VL's processor keeps this arithmetic private, so it
    is written out here (the probes compare the text it gives with the processor's)."""
    indices = list(frame_indices) + [frame_indices[-1]] * (-len(frame_indices) % patch_frames)
    seconds = [index / fps for index in indices]
    return [(seconds[start] + seconds[start + patch_frames - 1]) / 2 for start in range(0, len(seconds), patch_frames)]


def video_tokens_for_shape(processor: Any, num_frames: int, frame_size: int) -> int:
    """A clip's video tokens at the frame cache's shape, by the video processor's public patch count."""
    video_processor = processor.video_processor
    patches = video_processor.get_num_of_video_patches(num_frames, frame_size, frame_size, {})
    return patches // video_processor.merge_size**2


def video_expansion(processor: Any, rendered: str, frames: Any, clip: SampledFrames,
                    metadata: Any) -> VideoExpansion | None:
    """The processor's replacement for the one clip placeholder of `rendered`, as it reports it for `frames`
    with `metadata` (the facts of `clip`); None where its text is not one this module writes."""
    encoded = processor(text=[rendered], videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                        return_text_replacement_offsets=True)
    (replaced,) = encoded["text_replacement_offsets"][0]
    text, runs = _cut_video_runs(processor, replaced["replacement"])
    if runs == 1:
        # One run for the whole clip: a text that no clip fact enters (the probes check it on clips of other facts).
        return VideoExpansion(replaced["text"], text, 0, 1)
    patch_frames = getattr(processor.video_processor, "temporal_patch_size", 0)
    if not patch_frames:
        return None
    times = [f"{seconds:.1f}" for seconds in patch_times(clip.frame_indices, clip.fps, patch_frames)]
    patch = _patch_with_time_slot(text, times)
    if patch is None:
        return None
    expansion = VideoExpansion(replaced["text"], patch, patch_frames, runs // len(times))
    return expansion if expansion.clip_text(clip) == text else None


def _patch_with_time_slot(text: str, times: list[str]) -> str | None:
    """The first temporal patch of `text` (every patch's text alike but for its time), its time at TIME_SLOT."""
    first = text.find(times[0])
    if first < 0:
        return None
    before = text[:first]
    after_first = first + len(times[0])
    end = text.find(before + times[1], after_first) if len(times) > 1 else len(text)
    return None if end < 0 else before + TIME_SLOT + text[after_first:end]


def _cut_video_runs(processor: Any, replacement: str) -> tuple[str, int]:
    """`replacement` with each run of video tokens cut to one token, and how many runs there were."""
    image_ids = set(marked_token_ids(processor, "image"))
    video_ids = [token_id for token_id in marked_token_ids(processor, "video") if token_id not in image_ids]
    tokens = processor.tokenizer.convert_ids_to_tokens(video_ids)
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
