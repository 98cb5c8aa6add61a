"""What the packed shards' consumer encodes of a sample: the rule its length is counted by.

The consumer is LoongForge's VLM task encoder (docs/formats.md, "Packed records"), which encodes
each child of a pack by its sample type:
- packed_captioning: `<|vision_start|><|image_pad|><|vision_end|>` + caption + end-of-text, no chat
  template; the image as the processor resizes it.
- packed_vqa: the one user turn and its answer through the processor's chat template, its final
  newline dropped; the image as the processor resizes it.
- packed_multi_mix_qa and packed_chat_mix: every turn through the trainer's chat template
  (`trainer.chat_template`, one of LoongForge's templates for the Qwen-VL families, each a text rule
  and a media plugin: see CONSUMER_TEMPLATES); each image resized within the trainer's
  `min_pixels`/`max_pixels` and its longer side capped at `image_resolution` (512 px when unset),
  each video sampled at `fps` and its frames resized within the frame budget, before the processor
  resizes them in turn (Qwen3-VL's plugin has the processor sample the frames again).
A sample a type cannot carry is refused here with a reason that names the type.

These encodings spell media with Qwen-VL's vision markup. A Qwen-VL processor of another family than
the template's is refused. A processor of another model family reads no such markup: under `qwen2-vl`
(the default) and `processor` its children are counted as its own chat template renders them, the media
at their own size, the sample type still deciding what a pack may carry; the other templates refuse it.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vlm_assets.config import AppConfig, ConfigError, SourceConfig, TrainerConfig
from vlm_assets.media.trainer_decoder import TrainerClipView
from vlm_assets.tokens.video_tokens import patch_times

CAPTIONING, VQA, MULTI_MIX_QA, CHAT_MIX = "packed_captioning", "packed_vqa", "packed_multi_mix_qa", "packed_chat_mix"
SINGLE_IMAGE_TYPES = frozenset({CAPTIONING, VQA})
MEDIA_RESIZING_TYPES = frozenset({MULTI_MIX_QA, CHAT_MIX})
# The consumer's pixel grid (patch 14 × merge 2), frame grouping, and its media plugin's limits.
PIXEL_FACTOR = 28
FRAME_FACTOR = 2
DEFAULT_IMAGE_RESOLUTION = 512
MAX_ASPECT_RATIO = 200
# The processors whose media placeholders are that markup's (`<|image_pad|>`, `<|video_pad|>`).
QWEN_VL_PROCESSORS = frozenset({"Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor"})

# What the templates below write for a clip, which the processor (or Qwen3-VL's media plugin) expands.
CLIP_MARKUP = "<|vision_start|><|video_pad|><|vision_end|>"
_PARTS = (
    '{%- macro body(content) -%}{%- for part in content -%}'
    '{%- if part.type == "image" -%}{{- "<|vision_start|><|image_pad|><|vision_end|>" -}}'
    '{%- elif part.type == "video" -%}{{- "' + CLIP_MARKUP + '" -}}'
    '{%- else -%}{{- part.text -}}{%- endif -%}{%- endfor -%}{%- endmacro -%}'
)
# The system turn's text: the sample's own where it has a non-empty one (the consumer drops an empty one).
_SYSTEM = (
    '{%- set ns = namespace(system="") -%}'
    '{%- for message in messages if message.role == "system" and body(message.content) -%}'
    '{%- set ns.system = body(message.content) -%}{%- endfor -%}'
)
# LoongForge's `qwen2-vl` and `qwen3-vl` templates (its legacy multi-turn encoding): the system turn (its
# default when the sample has none), then user turns each followed by the assistant header, answers
# closed by end-of-text, and a newline before every user turn after the first.
MULTITURN_TEMPLATE = _PARTS + _SYSTEM + (
    '{{- "<|im_start|>system\\n" ~ (ns.system or "You are a helpful assistant.") ~ "<|im_end|>\\n" -}}'
    '{%- for message in messages if message.role != "system" -%}'
    '{%- if message.role == "user" -%}'
    '{%- if not loop.first -%}{{- "\\n" -}}{%- endif -%}'
    '{{- "<|im_start|>user\\n" ~ body(message.content) ~ "<|im_end|>\\n<|im_start|>assistant\\n" -}}'
    '{%- else -%}{{- body(message.content) ~ eos_token -}}{%- endif -%}'
    '{%- endfor -%}'
)
# LoongForge's `*-hf` templates, rendered from its own training Jinja over the turns with their media
# already expanded: every turn `<|im_start|>role\n…<|im_end|>\n`, the last one's newline included.
_HF_TURNS = (
    '{%- for message in messages if message.role != "system" -%}'
    '{{- "<|im_start|>" ~ message.role ~ "\\n" ~ body(message.content) ~ "<|im_end|>\\n" -}}'
    '{%- endfor -%}'
)
# `qwen2.5-vl-hf`: Qwen2.5-VL's default system turn when the sample has none.
QWEN2_5_VL_HF_TEMPLATE = _PARTS + _SYSTEM + (
    '{{- "<|im_start|>system\\n" ~ (ns.system or "You are a helpful assistant.") ~ "<|im_end|>\\n" -}}'
) + _HF_TURNS
# `qwen3-vl-hf`: no system turn unless the sample has one.
QWEN3_VL_HF_TEMPLATE = _PARTS + _SYSTEM + (
    '{%- if ns.system -%}{{- "<|im_start|>system\\n" ~ ns.system ~ "<|im_end|>\\n" -}}{%- endif -%}'
) + _HF_TURNS
CAPTION_TEMPLATE = _PARTS + (
    '{{- "<|vision_start|><|image_pad|><|vision_end|>" -}}'
    '{%- for message in messages if message.role == "assistant" -%}{{- body(message.content) -}}{%- endfor -%}'
    '{{- eos_token -}}'
)


@dataclass(frozen=True)
class ConsumerTemplate:
    """One of `trainer.chat_template`'s names: how the consumer renders a child's text, which media
    plugin resizes its media, and the processors it is LoongForge's template for."""

    name: str
    text: str | None  # the Jinja a child is rendered with (None: the processor's own chat template)
    processors: frozenset[str]  # the processor classes of its family (empty: any)
    # Qwen3-VL's plugin: an image's shorter side at least 32 px (Qwen2-VL's: 28), and a clip's text
    # written by the plugin from frames the video processor samples again (see qwen3_plugin_clip_text).
    qwen3_plugin: bool = False
    # Whether a processor that reads no Qwen-VL markup is still counted (by its own template): only under
    # the default, which is set whatever the model.
    counts_other_families: bool = False
    # How the consumer tokenises an answer against the assistant header before it (ASSISTANT_HEADER):
    # ANSWER_APART, the legacy `encode_multiturn` (each template slot and each answer on its own), or
    # ANSWER_ON_BOUNDARY, `encode_openai` (the whole text at once, then each answer's span of it found by
    # character offsets, refusing a token across the span's start); "": the processor's own tokenisation.
    answer_tokenisation: str = ""

    def counts(self, processor_class: str) -> bool:
        """Whether a processor of this class can be counted under this template."""
        if not self.processors or processor_class in self.processors:
            return True
        return self.counts_other_families and processor_class not in QWEN_VL_PROCESSORS

    def refusal(self, processor_class: str) -> str:
        """Why a processor of this class cannot be counted under this template ("" when it can)."""
        if self.counts(processor_class):
            return ""
        family = " and ".join(sorted(self.processors))
        return (f"trainer.chat_template {self.name!r} is LoongForge's template for {family}, "
                f"but the loaded processor is {processor_class}; set trainer.chat_template to one of "
                f"{', '.join(templates_for(processor_class))} or load a processor of that family")


ANSWER_APART, ANSWER_ON_BOUNDARY = "apart", "on a token boundary"
# What every answer of these templates follows; its special token ends whatever text comes before.
ASSISTANT_HEADER = "<|im_start|>assistant\n"
QWEN2_FAMILY = frozenset({"Qwen2VLProcessor", "Qwen2_5_VLProcessor"})
QWEN3_FAMILY = frozenset({"Qwen3VLProcessor"})
CONSUMER_TEMPLATES: dict[str, ConsumerTemplate] = {template.name: template for template in (
    ConsumerTemplate("qwen2-vl", MULTITURN_TEMPLATE, QWEN2_FAMILY, counts_other_families=True,
                     answer_tokenisation=ANSWER_APART),
    ConsumerTemplate("qwen3-vl", MULTITURN_TEMPLATE, QWEN3_FAMILY, qwen3_plugin=True, answer_tokenisation=ANSWER_APART),
    ConsumerTemplate("qwen2.5-vl-hf", QWEN2_5_VL_HF_TEMPLATE, frozenset({"Qwen2_5_VLProcessor"}),
                     answer_tokenisation=ANSWER_ON_BOUNDARY),
    ConsumerTemplate("qwen3-vl-hf", QWEN3_VL_HF_TEMPLATE, QWEN3_FAMILY, qwen3_plugin=True,
                     answer_tokenisation=ANSWER_ON_BOUNDARY),
    # The processor's own chat template, with Qwen2-VL's media plugin.
    ConsumerTemplate("processor", None, frozenset()),
)}


def templates_for(processor_class: str) -> list[str]:
    """The `trainer.chat_template` names a processor of this class can be counted under."""
    return [name for name, template in CONSUMER_TEMPLATES.items() if template.counts(processor_class)]


# Qwen3-VL's media plugin gives the video processor the sampled frames as a clip of this many frames per
# second, unless the processor has a `video_fps` attribute (see qwen3_plugin_clip_text).
QWEN3_PLUGIN_VIDEO_FPS = 24.0
# Its smallest image side (Qwen3-VL's patch 16 × merge 2); Qwen2-VL's plugin keeps PIXEL_FACTOR.
QWEN3_PLUGIN_MIN_SIDE = 32


# Every reason a sample type gives for not carrying a sample starts so.
NOT_CARRIED_BY = "not carried by"

Conversation = list[dict[str, Any]]  # role + content parts ({"type": "text" | "image" | "video"})


def answers_opening_with_space(conversation: Conversation) -> list[tuple[int, str]]:
    """(turn, text up to its first medium) of each answer whose first character is white space: only
    these tokenise differently after the header than on their own, since Qwen's pre-tokenizer keeps a
    newline apart from any other character that follows it."""
    found = []
    for turn, message in enumerate(conversation, start=1):
        if message["role"] != "assistant":
            continue
        text = ""
        for part in message["content"]:
            if part.get("type") != "text":
                break
            text += part.get("text", "")
        if text[:1].isspace():
            found.append((turn, text))
    return found


def smart_resize(height: int, width: int, factor: int, min_pixels: float, max_pixels: float) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with their product within [min_pixels, max_pixels],
    the aspect ratio kept as near as those allow: the Qwen-VL resize rule the consumer applies."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} is above {MAX_ASPECT_RATIO}")
    new_height = max(factor, round(height / factor) * factor)
    new_width = max(factor, round(width / factor) * factor)
    if new_height * new_width > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        new_height = math.floor(height / scale / factor) * factor
        new_width = math.floor(width / scale / factor) * factor
    elif new_height * new_width < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * scale / factor) * factor
        new_width = math.ceil(width * scale / factor) * factor
    return new_height, new_width


def sampled_frame_count(total_frames: int, video_fps: float, trainer: TrainerConfig) -> int:
    """How many frames the consumer samples from a clip: `fps` per second of it, within
    [fps_min_frames, fps_max_frames] and the clip's own frames, in whole pairs."""
    low = math.ceil(trainer.fps_min_frames / FRAME_FACTOR) * FRAME_FACTOR
    high = math.floor(trainer.fps_max_frames / FRAME_FACTOR) * FRAME_FACTOR
    wanted = total_frames / video_fps * trainer.fps
    frames = math.floor(min(min(max(wanted, low), high), total_frames) / FRAME_FACTOR) * FRAME_FACTOR
    if not FRAME_FACTOR <= frames <= total_frames:
        raise ValueError(f"a clip of {total_frames} frames gives {frames} sampled frames (needs {FRAME_FACTOR} or more)")
    return frames


@dataclass(frozen=True)
class CountingRule:
    """How one sample type's consumer encodes a child, with the trainer's media arguments."""

    sample_type: str
    trainer: TrainerConfig = TrainerConfig()
    qwen_markup: bool = True  # whether the processor reads Qwen-VL's vision markup (see bound_to)

    def bound_to(self, processor_class: str) -> CountingRule:
        """This rule for a processor of this class: the consumer's encoding where the processor reads
        Qwen-VL's vision markup, else the processor's own template and sizes. A processor of another
        family than the trainer's chat template's is refused (ConfigError)."""
        refusal = self.consumer_template.refusal(processor_class)
        if refusal:
            raise ConfigError(refusal)
        return replace(self, qwen_markup=processor_class in QWEN_VL_PROCESSORS)

    @property
    def consumer_template(self) -> ConsumerTemplate:
        return CONSUMER_TEMPLATES[self.trainer.chat_template]

    @property
    def resizes_media(self) -> bool:
        return self.qwen_markup and self.sample_type in MEDIA_RESIZING_TYPES

    @property
    def plugin_writes_clips(self) -> bool:
        """Whether the consumer's media plugin writes each clip's text itself (Qwen3-VL's: qwen3_plugin_clip_text)."""
        return self.resizes_media and self.consumer_template.qwen3_plugin

    @property
    def template(self) -> str | None:
        """The Jinja template the child's text is rendered with (None: the processor's own)."""
        if not self.qwen_markup:
            return None
        if self.sample_type == CAPTIONING:
            return CAPTION_TEMPLATE
        if self.resizes_media:
            return self.consumer_template.text
        return None

    def refusal(self, conversation: Conversation, media_kinds: Sequence[str]) -> str:
        """Why this sample type cannot carry the sample ("" when it can), starting `not carried by <type>: `."""
        why = self._why_not_carried(conversation, media_kinds)
        return f"{NOT_CARRIED_BY} {self.sample_type}: {why}" if why else ""

    @property
    def _answer_tokenisation(self) -> str:
        return self.consumer_template.answer_tokenisation if self.resizes_media else ""

    def answer_refusal(self, conversation: Conversation, token_spans: Callable[[str], list[tuple[int, int]]]) -> str:
        """Why the consumer cannot encode the sample's answers ("" when it can): under an HF template, a
        token across an answer's start makes LoongForge's `encode_openai` raise "generation boundary
        splits a token", and the trainer then drops the child's whole pack. `token_spans`: each token's
        (start, end) characters in a text, as the processor's tokenizer gives them."""
        if self._answer_tokenisation != ANSWER_ON_BOUNDARY:
            return ""
        start = len(ASSISTANT_HEADER)
        for turn, answer in answers_opening_with_space(conversation):
            if any(begin < start < end for begin, end in token_spans(ASSISTANT_HEADER + answer)):
                return (f"{NOT_CARRIED_BY} {self.sample_type}: its answer (turn {turn}) begins with white space "
                        f"that the tokenizer joins to the assistant header's newline, and LoongForge's "
                        f"{self.consumer_template.name!r} encoding refuses a token across an answer's start "
                        "(the trainer would drop the whole pack); strip the answer's leading white space")
        return ""

    def answer_apart_tokens(self, conversation: Conversation, token_counts: Callable[[list[str]], list[int]]) -> int:
        """The tokens the consumer's encoding has beyond the rendered text's: under a legacy template
        each answer is tokenised apart from the header before it, so a leading newline the whole text
        would join to the header's is a token of its own. `token_counts`: the processor's tokenizer's."""
        if self._answer_tokenisation != ANSWER_APART:
            return 0
        answers = [answer for _turn, answer in answers_opening_with_space(conversation)]
        if not answers:
            return 0
        counts = token_counts(["", ASSISTANT_HEADER, *answers, *(ASSISTANT_HEADER + answer for answer in answers)])
        added, header = counts[0], counts[1]  # added: what the tokenizer adds to every text (a BOS)
        apart, joined = counts[2:2 + len(answers)], counts[2 + len(answers):]
        return sum(header + alone - together - added for alone, together in zip(apart, joined))

    def _why_not_carried(self, conversation: Conversation, media_kinds: Sequence[str]) -> str:
        images, videos = media_kinds.count("image"), media_kinds.count("video")
        if images and videos:
            return "it holds both images and videos (a pack holds one media type, a child one kind of media)"
        roles = [message["role"] for message in conversation]
        if "system" in roles and self.sample_type != CHAT_MIX:
            return "it has a system turn (packed_chat_mix carries one)"
        turns = [role for role in roles if role != "system"]
        if roles.count("system") > 1 or (roles.count("system") == 1 and roles[0] != "system"):
            return "it has a system turn after the first turn"
        if not turns or len(turns) % 2 or turns != ["user", "assistant"] * (len(turns) // 2):
            return f"its turns are {turns}, not user/assistant pairs with the user first"
        if self.sample_type in SINGLE_IMAGE_TYPES:
            if images != 1:
                return f"it has {images} images and {videos} videos (this type carries exactly one image per sample)"
            if len(turns) != 2:
                return (f"it has {len(turns) // 2} user turns (this type carries one question and one answer; "
                        "packed_multi_mix_qa keeps them all)")
            if self.sample_type == VQA and not _has_part(conversation[0]["content"], "image"):
                return "its question has no <image> placeholder"
            if self.sample_type == CAPTIONING and _has_part(conversation[1]["content"], "image"):
                return "its caption holds the <image> placeholder"
        return ""

    def conversation(self, conversation: Conversation) -> Conversation:
        """The turns the consumer encodes (a caption: the answer alone)."""
        if self.qwen_markup and self.sample_type == CAPTIONING:
            return [message for message in conversation if message["role"] == "assistant"]
        return conversation

    def finish(self, text: str) -> str:
        """The rendered text as the consumer tokenises it (VQA drops the template's final newline)."""
        return text[:-1] if self.qwen_markup and self.sample_type == VQA and text.endswith("\n") else text

    def image_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an image reaches the processor at."""
        if not self.resizes_media:
            return height, width
        height, width = smart_resize(height, width, PIXEL_FACTOR, self.trainer.min_pixels, self.trainer.max_pixels)
        cap = self.trainer.image_resolution or DEFAULT_IMAGE_RESOLUTION
        if max(width, height) > cap:
            scale = cap / max(width, height)
            width, height = int(width * scale), int(height * scale)
        shortest = QWEN3_PLUGIN_MIN_SIDE if self.consumer_template.qwen3_plugin else PIXEL_FACTOR
        if min(width, height) < shortest:
            width, height = max(width, shortest), max(height, shortest)
        if width / height > MAX_ASPECT_RATIO:
            width = height * 180
        if height / width > MAX_ASPECT_RATIO:
            height = width * 180
        return height, width

    def frame_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the consumer resizes `frames` sampled frames of a clip to."""
        budget = min(self.trainer.frame_max_pixels, self.trainer.video_max_pixels / frames * FRAME_FACTOR)
        return smart_resize(height, width, PIXEL_FACTOR, int(self.trainer.frame_min_pixels * 1.05), budget)


def counting_rule(app: AppConfig, source: SourceConfig) -> CountingRule:
    """The rule a source's lengths are counted by: its sample type's, with the trainer's media arguments."""
    return CountingRule(app.sample_type_of(source), app.trainer)


def _has_part(content: list[dict[str, Any]], kind: str) -> bool:
    return any(part.get("type") == kind for part in content)


@dataclass(frozen=True)
class ClipShape:
    """A clip as the consumer hands it to the processor, by its shape alone: the frames it sampled and
    the size it resized them to."""

    frames: int
    height: int
    width: int


def consumer_clip_shape(view: TrainerClipView, rule: CountingRule) -> ClipShape | None:
    """The shape the consumer gives a clip its decoder sees as `view`: as `consumer_video` samples and
    resizes it, without a frame decoded. Each sampled index yields one frame of the view's size where
    the decoder reads forward, seeking only ahead, as the catalogue proved by reading the clip's last
    frame with it. None where two sampled frames are neighbours: the decoder seeks back to read the
    second, which may yield no frame (a MOV whose timestamps start below zero), so the clip is decoded."""
    frames = sampled_frame_count(view.total_frames, view.fps, rule.trainer)
    indices = consumer_frame_indices(view.total_frames, frames)
    if any(later - earlier < 2 for earlier, later in zip(indices, indices[1:])):
        return None
    return ClipShape(frames, *rule.frame_size(frames, view.height, view.width))


def consumer_frame_indices(total_frames: int, frames: int) -> list[int]:
    """The frames the consumer reads of a clip: `frames` indices spread evenly (its torch arithmetic, in
    single precision, rounded half to even)."""
    import torch

    return torch.linspace(0, total_frames - 1, frames).round().long().tolist()


def clip_video_pads(processor: Any, clip: ClipShape) -> int:
    """The video tokens a Qwen-VL processor writes for a clip of this shape, its frames not sampled
    again: its video processor's patch count (its public arithmetic) over merge_size²."""
    video_processor = processor.video_processor
    patches = video_processor.get_num_of_video_patches(clip.frames, clip.height, clip.width, {})
    return patches // video_processor.merge_size ** 2


def consumer_video(data: bytes, rule: CountingRule) -> Any:
    """A clip's frames as the consumer decodes, samples and resizes them: a (frames, 3, H, W) float tensor.

    Decoded by Energon's own AV decoder, which the consumer reads shards with: its frame count and
    frame rate are the ones the consumer samples by.
    """
    import torch
    from megatron.energon.av import AVDecoder

    try:
        decoder = AVDecoder(io.BytesIO(data))
        _duration, total_frames = decoder.get_video_duration(get_frame_count=True)
        fps = decoder.get_video_fps()
    except Exception as error:
        raise _decoder_failure(error) from error
    # A clip too short to sample is the sample's fault, not the decoder's.
    frames = sampled_frame_count(total_frames, fps, rule.trainer)
    try:
        indices = consumer_frame_indices(total_frames, frames)
        clips = decoder.get_clips(video_clip_ranges=[(index, index + 1) for index in indices], video_unit="frames")
        video = torch.stack([clip[0] for clip in clips.video_clips], dim=0)
    except Exception as error:
        raise _decoder_failure(error) from error
    height, width = rule.frame_size(frames, video.shape[2], video.shape[3])
    return torch.nn.functional.interpolate(video.float(), size=(height, width), mode="bicubic", align_corners=False)



def _decoder_failure(error: Exception) -> ValueError:
    return ValueError(f"Energon's AV decoder, which the consumer reads the clip with, fails on it: "
                      f"{type(error).__name__}: {error}")


def qwen3_plugin_clip_text(processor: Any, clip: Any) -> str:
    """The text Qwen3-VL's media plugin writes for a clip of the frames the consumer sampled, in place of
    its `<|vision_start|><|video_pad|><|vision_end|>`.

    The plugin hands the frames to the processor's video processor as a clip of `video_fps` frames per
    second (the processor's attribute, else 24) and leaves its frame sampling as the processor sets it:
    Qwen3-VL's samples its `fps` frames per second of such a clip again (at 2 and 24: one frame in 12,
    at least its `min_frames`). Per temporal patch of the frames it kept, the plugin writes the patch's
    time (its frames' indices over that rate, averaged, to a tenth of a second) and the patch's tokens
    between the vision markers; the consumer tokenises that text itself, whatever the processor's own
    expansion of a clip would be.
    """
    from transformers.video_utils import VideoMetadata

    merge_size = processor.image_processor.merge_size
    fps = getattr(processor, "video_fps", QWEN3_PLUGIN_VIDEO_FPS)
    metadata = VideoMetadata(total_num_frames=len(clip), fps=fps)
    processed = processor.video_processor(videos=[clip], video_metadata=[metadata], return_metadata=True)
    grid, kept = processed["video_grid_thw"][0], processed["video_metadata"][0]
    patch = "<|vision_start|>" + "<|video_pad|>" * (int(grid[1] * grid[2]) // merge_size ** 2) + "<|vision_end|>"
    times = patch_times(list(kept.frames_indices), kept.fps or QWEN3_PLUGIN_VIDEO_FPS, merge_size, "mean-tenths")
    return "".join(f"<{time} seconds>{patch}" for time in times[:int(grid[0])])


def qwen3_plugin_clip_text_for_shape(processor: Any, clip: ClipShape) -> str:
    """`qwen3_plugin_clip_text` for a clip of this shape, by the video processor's public arithmetic
    (its `sample_frames` and patch count) instead of its pass over the pixels."""
    from transformers.video_utils import VideoMetadata

    video_processor = processor.video_processor
    merge_size = video_processor.merge_size
    fps = getattr(processor, "video_fps", QWEN3_PLUGIN_VIDEO_FPS)
    metadata = VideoMetadata(total_num_frames=clip.frames, fps=fps)
    kept = (list(video_processor.sample_frames(metadata)) if video_processor.do_sample_frames
            else list(range(clip.frames)))
    patches = video_processor.get_num_of_video_patches(len(kept), clip.height, clip.width, {})
    temporal_patches = -(-len(kept) // video_processor.temporal_patch_size)
    pads = patches // temporal_patches // merge_size ** 2
    patch = "<|vision_start|>" + "<|video_pad|>" * pads + "<|vision_end|>"
    times = patch_times(kept, fps, merge_size, "mean-tenths")
    return "".join(f"<{time} seconds>{patch}" for time in times[:temporal_patches])
