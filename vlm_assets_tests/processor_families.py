"""Offline Hugging Face processor directories for nine VLM families, built from transformers' own classes.

Each family gets the Qwen tiktoken BPE vocabulary (as the embedded processor does) plus that family's released
special tokens, chat-template format, image/video processor classes and settings and processor arguments, saved
as a normal processor directory that `AutoProcessor.from_pretrained(dir, local_files_only=True)` loads as the
family's processor class. Tests and bench/ use them to compare our token-length code with a direct processor call
on each family, with no model download.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from vlm_assets.parallel import imports_without_gc
from vlm_assets.tokens.processor import (
    QWEN2_PATTERN,
    QWEN2_VL_CHAT_TEMPLATE,
    import_transformers,
    list_added_tokens_in_tokenizer_config,
    qwen_tiktoken_file,
)

FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision", "internvl", "gemma3",
                             "llava_next", "mistral3", "glm4v")

# Bump when a family's build changes: a cached directory written by another version is rebuilt.
BUILD_VERSION = "4"
VERSION_FILE = "vlm_assets_family_version.txt"

FIRST_SPECIAL_ID = 151643  # the first id after the Qwen BPE ranks

# The released tokenizers' added tokens, in id order from 151643 (the Qwen ones keep their released ids).
QWEN2_VL_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
QWEN2_5_SPECIALS = QWEN2_VL_SPECIALS + (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)
QWEN3_SPECIALS = QWEN2_5_SPECIALS + ("<tool_response>", "</tool_response>", "<think>", "</think>")
# llava-onevision-qwen2-*-hf: Qwen2-7B-Instruct's three specials, then <image>=151646 and <video>=151647.
LLAVA_ONEVISION_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>")
# InternVL3-*-hf: the Qwen2.5-VL tokenizer plus InternVL's tokens (<IMG_CONTEXT>=151667, the config's image id).
# Where the -hf conversion puts <video> is not confirmed; it goes last here.
INTERNVL_SPECIALS = QWEN2_5_SPECIALS + (
    "<img>", "</img>", "<IMG_CONTEXT>", "<quad>", "</quad>", "<ref>", "</ref>", "<box>", "</box>", "<video>",
)
# Gemma 3's ids (0, 1, 2, 105, 106, 255999, 256000, 262144) cannot be kept on a Qwen vocabulary; their order is.
# Its <unk> is left out: Qwen's BPE already has "<unk>" as an ordinary token (and nothing here reads it).
GEMMA3_SPECIALS = (
    "<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
    "<start_of_image>", "<end_of_image>", "<image_soft_token>",
)
# Mistral's <unk>, <s> and </s> are ordinary tokens of Qwen's BPE: named as the tokenizer's bos/eos, <s> and
# </s> become special with those ids; <unk> is left out as for Gemma 3.
# llava-v1.6-mistral-7b-hf: Mistral-7B-Instruct-v0.2's tokens, then <image>=32000 and <pad>=32001.
LLAVA_NEXT_SPECIALS = ("<image>", "<pad>")
# Mistral-Small-3.1 (mistral3): the Tekken tokenizer's control tokens 3-19 in id order.
MISTRAL3_SPECIALS = (
    "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
    "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]",
    "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
)
# GLM-4.1V-9B: the GLM-4 tokenizer's added tokens from <|endoftext|>=151329 to <|video|>=151344 (the config's
# image and video ids are 151343 and 151344); where the thinking and box tokens sit is not confirmed, they go last.
GLM4V_SPECIALS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|image|>", "<|video|>", "<think>", "</think>", "<|begin_of_box|>", "<|end_of_box|>",
)

# Qwen2.5-VL's released template has the same format as Qwen2-VL's.
QWEN2_5_VL_CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE
# Qwen3-VL: the Qwen2-VL format without the default system turn (tool calls are left out).
QWEN3_VL_CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE.replace(
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}", "")
# LLaVA-OneVision (-hf): per turn all images first, then all videos, each on its own line, then the text;
# no default system turn.
LLAVA_ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for content in message['content'] if content['type'] == 'image' %}<image>\n{% endfor %}"
    "{% for content in message['content'] if content['type'] == 'video' %}<video>\n{% endfor %}"
    "{% for content in message['content'] if content['type'] == 'text' %}{{ content['text'] }}{% endfor %}"
    "{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# InternVL3 (-hf): items in order, an image as <IMG_CONTEXT> and a video as <video>, each followed by a newline
# (the processor expands them); no default system turn.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif content['type'] == 'video' %}<video>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Gemma 3: <bos> first; a system message is folded into the first user turn; the assistant's role is "model";
# text items are trimmed; an image is <start_of_image> (the processor expands it); no video.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% else %}{% set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' %}{% endif %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ first_user_prefix if loop.first else '' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# LLaVA-NeXT (llava-v1.6-mistral-7b-hf): Mistral's [INST] turns, a user turn's images first (each on its own
# line), then its text; a system turn in <<SYS>>; an assistant turn after a space, ended by </s> and a space.
# The tokenizer prepends <s>.
LLAVA_NEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set texts = [message['content']] if message['content'] is string "
    "else message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | list %}"
    "{% if message['role'] == 'system' %}<<SYS>>\n{{ texts | join('') }}\n<</SYS>>\n\n"
    "{% elif message['role'] == 'user' %}[INST] "
    "{% if message['content'] is not string %}"
    "{% for content in message['content'] if content['type'] == 'image' %}<image>\n{% endfor %}{% endif %}"
    "{{ texts | join('') }} [/INST]"
    "{% elif message['role'] == 'assistant' %} {{ texts | join('') }}</s> "
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)
# Mistral Small 3.1 (mistral3): <s>, then [SYSTEM_PROMPT] turns, [INST] user turns with an image as [IMG] in
# place (the processor expands it), assistant turns ended by </s>. The release adds a default system prompt
# carrying today's date, left out here so that a count does not depend on the day.
MISTRAL3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}[IMG]{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'system' %}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[/INST]"
    "{% else %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
# GLM-4.1V: [gMASK]<sop>, then each turn as <|role|> and a newline; an image as <|begin_of_image|><|image|>
# <|end_of_image|> and a video likewise (the processor expands <|image|> and <|video|>).
GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif item['type'] == 'video' %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
HALF = [0.5, 0.5, 0.5]
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
BILINEAR, BICUBIC = 2, 3


@dataclass(frozen=True)
class TokenizerSpec:
    specials: tuple[str, ...]
    eos: str
    pad: str
    model_max_length: int
    bos: str | None = None
    # Tokenizer attributes the processor class reads (saved as model-specific special tokens).
    named: dict[str, str] = field(default_factory=dict)
    add_bos_token: bool = False


@dataclass(frozen=True)
class FamilySpec:
    processor_class: str
    tokenizer: TokenizerSpec
    chat_template: str
    image_processor: Callable[[], Any]
    video_processor: Callable[[], Any] | None
    processor_kwargs: dict[str, Any] = field(default_factory=dict)


def _qwen2_vl_image_processor():
    from transformers import Qwen2VLImageProcessor

    # Qwen2-VL-7B / Qwen2.5-VL-7B preprocessor_config.json: min_pixels 3136, max_pixels 12845056.
    return Qwen2VLImageProcessor(size={"shortest_edge": 3136, "longest_edge": 12845056}, patch_size=14,
                                 temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD,
                                 resample=BICUBIC)


def _qwen2_vl_video_processor():
    from transformers import Qwen2VLVideoProcessor

    # The released repos ship only preprocessor_config.json (no video config found), from which AutoProcessor
    # also builds the video processor: the image pixel bounds, not the class's video defaults. Explicit False
    # keeps transformers' default (uncapped) total-pixel behaviour and silences its deprecation notice.
    return Qwen2VLVideoProcessor(size={"shortest_edge": 3136, "longest_edge": 12845056}, patch_size=14,
                                 temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD,
                                 resample=BICUBIC, cap_pixels_per_frame=False)


def _qwen3_vl_image_processor():
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16,
                                 temporal_patch_size=2, merge_size=2, image_mean=HALF, image_std=HALF,
                                 resample=BICUBIC)


def _qwen3_vl_video_processor():
    from transformers import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(size={"shortest_edge": 4096, "longest_edge": 25165824}, patch_size=16,
                                 temporal_patch_size=2, merge_size=2, image_mean=HALF, image_std=HALF,
                                 resample=BICUBIC, fps=2, min_frames=4, max_frames=768, do_sample_frames=True,
                                 cap_pixels_per_frame=False)


# anyres_max_9 grid: every (height, width) from 1x1 to 6x6 tiles of 384.
LLAVA_ONEVISION_PINPOINTS = [[384 * rows, 384 * cols] for rows in range(1, 7) for cols in range(1, 7)]


def _llava_onevision_image_processor():
    from transformers import LlavaOnevisionImageProcessor

    # The conversion takes SigLIP-so400m-384's settings (mean/std 0.5, bicubic, 384x384).
    return LlavaOnevisionImageProcessor(size={"height": 384, "width": 384}, image_mean=HALF, image_std=HALF,
                                        resample=BICUBIC, do_pad=True,
                                        image_grid_pinpoints=LLAVA_ONEVISION_PINPOINTS)


def _llava_onevision_video_processor():
    from transformers import LlavaOnevisionVideoProcessor

    return LlavaOnevisionVideoProcessor(size={"height": 384, "width": 384}, image_mean=HALF, image_std=HALF,
                                        resample=BICUBIC)


def _internvl_image_processor():
    from transformers import GotOcr2ImageProcessor

    # crop_to_patches stays off here as in the release: InternVLProcessor turns it on for every call.
    # min/max_patches are the class defaults (the -hf conversion does not set them).
    return GotOcr2ImageProcessor(size={"height": 448, "width": 448}, image_mean=IMAGENET_MEAN,
                                 image_std=IMAGENET_STD, resample=BICUBIC, crop_to_patches=False, min_patches=1,
                                 max_patches=12)


def _internvl_video_processor():
    from transformers import InternVLVideoProcessor

    # The conversion builds it from the image processor's config (448x448, ImageNet mean/std).
    return InternVLVideoProcessor(size={"height": 448, "width": 448}, image_mean=IMAGENET_MEAN,
                                  image_std=IMAGENET_STD, resample=BICUBIC)


def _gemma3_image_processor():
    from transformers import Gemma3ImageProcessor

    # Pan-and-scan is unset in the release (off by the processor's default).
    return Gemma3ImageProcessor(size={"height": 896, "width": 896}, image_mean=HALF, image_std=HALF,
                                resample=BILINEAR)


# llava-v1.6-mistral-7b-hf's preprocessor_config.json.
LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


def _llava_next_image_processor():
    from transformers import LlavaNextImageProcessor

    return LlavaNextImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                   image_mean=CLIP_MEAN, image_std=CLIP_STD, resample=BICUBIC, do_pad=True,
                                   image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)


def _mistral3_image_processor():
    from transformers import PixtralImageProcessor

    # Mistral-Small-3.1-24B-Instruct-2503's preprocessor_config.json.
    return PixtralImageProcessor(size={"longest_edge": 1540}, patch_size={"height": 14, "width": 14},
                                 image_mean=CLIP_MEAN, image_std=CLIP_STD, resample=BICUBIC)


def _glm4v_image_processor():
    from transformers import Glm4vImageProcessor

    # GLM-4.1V-9B-Thinking's preprocessor_config.json.
    return Glm4vImageProcessor(size={"shortest_edge": 12544, "longest_edge": 9633792}, patch_size=14,
                               temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD,
                               resample=BICUBIC)


def _glm4v_video_processor():
    from transformers import Glm4vVideoProcessor

    # GLM-4.1V-9B-Thinking's video_preprocessor_config.json.
    return Glm4vVideoProcessor(size={"shortest_edge": 12544, "longest_edge": 47040000}, patch_size=14,
                               temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN, image_std=CLIP_STD,
                               resample=BICUBIC, fps=2)


QWEN_TOKENIZER = dict(eos="<|im_end|>", pad="<|endoftext|>")
MISTRAL_TOKENIZER = dict(eos="</s>", pad="<pad>", bos="<s>")
SPECS: dict[str, FamilySpec] = {
    "qwen2_vl": FamilySpec(
        "Qwen2VLProcessor", TokenizerSpec(QWEN2_VL_SPECIALS, model_max_length=32768, **QWEN_TOKENIZER),
        QWEN2_VL_CHAT_TEMPLATE, _qwen2_vl_image_processor, _qwen2_vl_video_processor),
    "qwen2_5_vl": FamilySpec(
        "Qwen2_5_VLProcessor", TokenizerSpec(QWEN2_5_SPECIALS, model_max_length=131072, **QWEN_TOKENIZER),
        QWEN2_5_VL_CHAT_TEMPLATE, _qwen2_vl_image_processor, _qwen2_vl_video_processor),
    "qwen3_vl": FamilySpec(
        "Qwen3VLProcessor", TokenizerSpec(QWEN3_SPECIALS, model_max_length=262144, **QWEN_TOKENIZER),
        QWEN3_VL_CHAT_TEMPLATE, _qwen3_vl_image_processor, _qwen3_vl_video_processor),
    "llava_onevision": FamilySpec(
        "LlavaOnevisionProcessor",
        TokenizerSpec(LLAVA_ONEVISION_SPECIALS, model_max_length=131072, **QWEN_TOKENIZER),
        LLAVA_ONEVISION_CHAT_TEMPLATE, _llava_onevision_image_processor, _llava_onevision_video_processor,
        # SigLIP-384/14 gives 27x27 = 729 features per tile, all kept ("full").
        dict(num_image_tokens=729, vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9")),
    "internvl": FamilySpec(
        "InternVLProcessor",
        TokenizerSpec(INTERNVL_SPECIALS, model_max_length=8192, **QWEN_TOKENIZER,
                      named={"start_image_token": "<img>", "end_image_token": "</img>",
                             "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}),
        INTERNVL_CHAT_TEMPLATE, _internvl_image_processor, _internvl_video_processor,
        dict(image_seq_length=256)),
    "gemma3": FamilySpec(
        "Gemma3Processor",
        # Gemma's tokenizer prepends <bos> itself, so a direct call on a rendered chat (which starts with
        # <bos>) has two, as with the released processor.
        TokenizerSpec(GEMMA3_SPECIALS, eos="<eos>", pad="<pad>", bos="<bos>",
                      model_max_length=131072, add_bos_token=True,
                      named={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                             "image_token": "<image_soft_token>"}),
        GEMMA3_CHAT_TEMPLATE, _gemma3_image_processor, None, dict(image_seq_length=256)),
    "llava_next": FamilySpec(
        "LlavaNextProcessor",
        TokenizerSpec(LLAVA_NEXT_SPECIALS, model_max_length=32768, add_bos_token=True, **MISTRAL_TOKENIZER),
        LLAVA_NEXT_CHAT_TEMPLATE, _llava_next_image_processor, None,
        # CLIP-ViT-L/14-336: 24x24 features per crop plus its CLS token, which "default" drops.
        dict(patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)),
    "mistral3": FamilySpec(
        "PixtralProcessor",
        # The template writes <s>; the tokenizer adds none.
        TokenizerSpec(MISTRAL3_SPECIALS, model_max_length=131072, **MISTRAL_TOKENIZER),
        MISTRAL3_CHAT_TEMPLATE, _mistral3_image_processor, None,
        # 14-pixel patches merged 2x2: one [IMG] per 28x28 pixels, [IMG_BREAK] after each row, [IMG_END] last.
        dict(patch_size=14, spatial_merge_size=2)),
    "glm4v": FamilySpec(
        "Glm4vProcessor",
        TokenizerSpec(GLM4V_SPECIALS, eos="<|endoftext|>", pad="<|endoftext|>", model_max_length=65536),
        GLM4V_CHAT_TEMPLATE, _glm4v_image_processor, _glm4v_video_processor),
}

PROCESSOR_CLASSES: dict[str, str] = {family: spec.processor_class for family, spec in SPECS.items()}
SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {family: spec.tokenizer.specials for family, spec in SPECS.items()}


def family_processor_dir(family: str, cache_dir: Path) -> Path:
    """Build (once; reused if already there) and return a processor directory under cache_dir/<family> that
    AutoProcessor.from_pretrained(dir, local_files_only=True) loads as that family's processor class. A process
    asking while another builds it waits for that build and reuses it."""
    target = _family_target(family, cache_dir)
    if _is_current(target):
        return target
    with _build_lock(target, wait=True):
        return _build(family, target)


def family_processor_dirs(families: tuple[str, ...], cache_dir: Path) -> dict[str, Path]:
    """family_processor_dir of each of `families`. Processes asking at once split the builds: each first builds
    the families no other process is building, then waits for the rest."""
    for family in families:
        target = _family_target(family, cache_dir)
        if not _is_current(target):
            with _build_lock(target, wait=False) as held:
                if held:
                    _build(family, target)
    return {family: family_processor_dir(family, cache_dir) for family in families}


def _family_target(family: str, cache_dir: Path) -> Path:
    if family not in SPECS:
        raise ValueError(f"unknown processor family {family!r}; known: {', '.join(FAMILIES)}")
    return Path(cache_dir) / family


@contextlib.contextmanager
def _build_lock(target: Path, wait: bool) -> Iterator[bool]:
    """The lock on building `target`: held (True), or, without `wait`, False while another process holds it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(family: str, target: Path) -> Path:
    """Write the family's processor directory at `target` (temp dir + rename), under its build lock."""
    if _is_current(target):  # built by the process that held the lock before
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{family}.", dir=target.parent))
    try:
        with imports_without_gc():  # a tokenizer's vocabulary: long-lived objects by the hundred thousand
            build_processor(family).save_pretrained(staging)
        list_added_tokens_in_tokenizer_config(staging)
        (staging / VERSION_FILE).write_text(BUILD_VERSION)
        if target.exists():  # written by another BUILD_VERSION: move it aside (rename onto an empty dir)
            stale = Path(tempfile.mkdtemp(prefix=f".{family}.stale.", dir=target.parent))
            os.replace(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_processor(family: str) -> Any:
    """The family's processor object, built offline (not saved)."""
    import_transformers()
    import transformers

    spec = SPECS[family]
    components = dict(image_processor=spec.image_processor(), tokenizer=_tokenizer(spec))
    if spec.video_processor is not None:
        components["video_processor"] = spec.video_processor()
    processor_class = getattr(transformers, spec.processor_class)
    return processor_class(**components, chat_template=spec.chat_template, **spec.processor_kwargs)


def _is_current(directory: Path) -> bool:
    try:
        return (directory / VERSION_FILE).read_text() == BUILD_VERSION
    except OSError:
        return False


@lru_cache(maxsize=1)
def _qwen_bpe_backend_json() -> str:
    """The Qwen tiktoken ranks as a `tokenizers` BPE without any added tokens (converting takes seconds)."""
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(qwen_tiktoken_file()), pattern=QWEN2_PATTERN).converted()
    # qwen_tokenizer NFC-normalises before encoding; so must we.
    backend.normalizer = normalizers.NFC()
    return backend.to_str()


def _tokenizer(spec: FamilySpec):
    from tokenizers import AddedToken, Tokenizer
    from transformers import Qwen2TokenizerFast

    tokens = spec.tokenizer
    backend = Tokenizer.from_str(_qwen_bpe_backend_json())
    # Added first and in order, so each family's tokens get consecutive ids from 151643 (the released ones for
    # the Qwen-based families) before the tokenizer adds any named token it does not know yet.
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in tokens.specials])
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=backend,
        eos_token=tokens.eos,
        pad_token=tokens.pad,
        bos_token=tokens.bos,
        unk_token=None,
        extra_special_tokens=dict(tokens.named) or None,
        add_bos_token=tokens.add_bos_token,
        model_max_length=tokens.model_max_length,
        errors="replace",
        split_special_tokens=False,
    )
    tokenizer.chat_template = spec.chat_template
    ids = tokenizer.convert_tokens_to_ids(list(tokens.specials))
    expected = list(range(FIRST_SPECIAL_ID, FIRST_SPECIAL_ID + len(tokens.specials)))
    if ids != expected:
        raise RuntimeError(f"{spec.processor_class} tokenizer: special token ids {ids} != {expected}")
    return tokenizer


# Per processor object and frame cache: (the processor, kept so its id is not reused; its proof).
_proofs: dict[tuple[int, Any], tuple[Any, Any]] = {}


def proven_modalities(processor: Any, frame_cache: Any) -> Any:
    """prove_fast_path(processor, frame_cache), run once per test process: its probes call the
    processor on images and clips (seconds), and they prove the same for the same processor. Tests
    of the proof itself call prove_fast_path."""
    from vlm_assets.tokens.profile import prove_fast_path

    key = (id(processor), frame_cache)
    if key not in _proofs:
        _proofs[key] = (processor, prove_fast_path(processor, frame_cache))
    return _proofs[key][1]


def direct_length(processor: Any, sample: Any, frame_cache: Any) -> int:
    """The processor called directly on a `SampleForLength`, as a trainer calls it (docs/formats.md §5):
    the baseline the tests and bench/lengths.py compare the product's counting with."""
    from transformers.image_utils import load_image
    from transformers.video_utils import VideoMetadata

    from vlm_assets.catalog.messages import split_on_placeholders
    from vlm_assets.media.video import decode_sampled_frames

    conversation = [{"role": message["role"], "content": split_on_placeholders(message["content"])}
                    for message in json.loads(sample.messages)]
    text = processor.apply_chat_template(conversation, tokenize=False)
    images = [load_image(ref) for kind, ref in zip(sample.media_kinds, sample.media_refs) if kind == "image"]
    videos, metadata = [], []
    for kind, ref in zip(sample.media_kinds, sample.media_refs):
        if kind == "video":
            sampled, frames = decode_sampled_frames(ref, frame_cache.num_frames, frame_cache.frame_size)
            videos.append(frames)
            metadata.append(VideoMetadata(total_num_frames=sampled.total_frames, fps=sampled.fps,
                                          frames_indices=sampled.frame_indices))
    video_kwargs = {"do_sample_frames": False, "video_metadata": metadata} if videos else {}
    encoded = processor(text=[text], images=[images] if images else None, videos=videos or None,
                        return_tensors="pt", **video_kwargs)
    return len(encoded["input_ids"][0])


if __name__ == "__main__":
    # `python -m vlm_assets_tests.processor_families DIR`: build every family's directory in DIR (what
    # scripts/test.sh does before the sessions that load them).
    family_processor_dirs(FAMILIES, Path(sys.argv[1]))
