"""An image's tokens from its (height, width) alone, by each family's own arithmetic: no pixels.

Families spell an image differently: Qwen2-VL (and GLM-4.1V) merges the patches of the resized image,
InternVL tiles it into crops of a fixed token count between <img> and </img>, LLaVA-OneVision picks an
anyres grid for an image alone in its sample and a base view for each of several, Gemma3 gives every
image the same sequence between newlines and image markers. Other families (LLaVA-NeXT's anyres grid,
Mistral3's rows of patches ended by [IMG_BREAK] and [IMG_END]) are counted by the per-image token counter
their processor has for serving engines. `image_token_arithmetic` picks the family's by what the
processor has; whether it holds for a processor, the probes of vlm_assets.tokens.profile tell. The
text the processor writes around an image's tokens is text: `image_expansion` gives it, to be
tokenised with the sample's own text, since its newlines may merge with the text next to them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

# (height, width, one of several images of its sample) -> the image's tokens. Several images are
# processed as one group, which LLaVA-OneVision counts differently (its multi-image mode).
ImageTokenArithmetic = Callable[[int, int, bool], int]


@dataclass(frozen=True)
class ImageExpansion:
    """What the processor puts in place of the chat template's image placeholder, each run of image
    tokens cut to one, and how many image tokens are left in it."""

    placeholder: str
    text: str
    image_tokens: int


def image_token_arithmetic(processor: Any) -> ImageTokenArithmetic | None:
    """The family's arithmetic, from the processor's public attributes (None: none known, the exact path counts)."""
    image_processor = getattr(processor, "image_processor", None)
    patches = getattr(image_processor, "get_number_of_image_patches", None)
    if patches is not None and hasattr(image_processor, "merge_size"):
        return lambda height, width, _grouped: patches(height, width, {}) // image_processor.merge_size**2
    if patches is not None and all(hasattr(processor, name) for name in
                                   ("image_seq_length", "start_image_token", "end_image_token")):
        images_kwargs = _call_image_defaults(processor, patches)
        # Its <img> and </img> are image tokens too.
        return lambda height, width, _grouped: 2 + processor.image_seq_length * patches(height, width, images_kwargs)
    if hasattr(image_processor, "image_grid_pinpoints") and all(
            hasattr(processor, name) for name in ("num_image_tokens", "vision_aspect_ratio")):
        return _anyres_arithmetic(processor)
    if hasattr(processor, "image_seq_length") and hasattr(processor, "full_image_sequence"):
        return lambda _height, _width, _grouped: processor.image_seq_length
    if all(hasattr(processor, name) for name in ("spatial_merge_size", "image_break_token", "image_end_token")):
        return _patch_rows_arithmetic(processor)
    if hasattr(processor, "_get_num_multimodal_tokens"):
        return _serving_counter_arithmetic(processor)
    return None


def _call_image_defaults(processor: Any, patches: Callable[..., int]) -> dict[str, Any]:
    """The image settings a call of the processor takes by default (InternVL turns crop_to_patches on):
    its `images_kwargs` where the release has that attribute, else the crop setting that gives what a
    call gives for one image (the probes check the outcome either way)."""
    defaults = getattr(processor, "images_kwargs", None)
    if defaults:
        return dict(defaults)
    from PIL import Image

    height, width = 480, 640
    called = processor(text=[processor.image_token], images=[[Image.new("RGB", (width, height))]])
    image_tokens = int(np.isin(np.asarray(called["input_ids"][0]), marked_token_ids(processor, "image")).sum())
    cropped = {"crop_to_patches": True}
    return cropped if 2 + processor.image_seq_length * patches(height, width, cropped) == image_tokens else {}


def _serving_counter_arithmetic(processor: Any) -> ImageTokenArithmetic:
    """The tokens of one image by the counter transformers gives serving engines (vLLM) per processor.
    It sees each image alone: a family that counts a group of images otherwise fails its probes."""

    def tokens(height: int, width: int, _grouped: bool) -> int:
        (count,) = processor._get_num_multimodal_tokens(image_sizes=[[height, width]])["num_image_tokens"]
        return int(count)

    return tokens


def _patch_rows_arithmetic(processor: Any) -> ImageTokenArithmetic:
    """Pixtral's (Mistral3's) count: an [IMG] per merged patch of the image as its image processor's
    public resize rule sizes it, and after each row an [IMG_BREAK] (the last one [IMG_END]). Its counter
    for serving engines counts so too, but builds a float array of the image's full size for each image
    (100 MB for 2048x2048) and takes an image 1 or 3 pixels tall for channels first; the rule is applied
    here to a stand-in of the image's shape that holds no pixels, channels last."""
    from transformers.image_utils import ChannelDimension
    from transformers.models.pixtral.image_processing_pixtral import get_resize_output_image_size

    patch = processor.patch_size * processor.spatial_merge_size
    longest_edge = processor.image_processor.size["longest_edge"]

    def tokens(height: int, width: int, _grouped: bool) -> int:
        stand_in = np.broadcast_to(np.uint8(0), (height, width, 3))
        resized_height, resized_width = get_resize_output_image_size(
            stand_in, size=(longest_edge, longest_edge), patch_size=(patch, patch),
            input_data_format=ChannelDimension.LAST)
        rows, columns = resized_height // patch, resized_width // patch
        return rows * (columns + 1)

    return tokens


def _anyres_arithmetic(processor: Any) -> ImageTokenArithmetic:
    """LLaVA-OneVision's count as its processor's token expansion computes it; transformers has it only
    in private methods, so it is written out here (the probes compare it with the processor's)."""
    from transformers.image_processing_utils import select_best_resolution

    image_processor = processor.image_processor
    size = image_processor.size
    tile = size["shortest_edge"] if size.get("shortest_edge") else min(size["height"], size["width"])
    base_view = processor.num_image_tokens
    features_per_side = math.isqrt(base_view)
    max_tiles = int(processor.vision_aspect_ratio.removeprefix("anyres_max_"))
    # "default" drops the vision tower's first feature of each image.
    dropped = 1 if processor.vision_feature_select_strategy == "default" else 0

    def tokens(height: int, width: int, grouped: bool) -> int:
        if grouped:
            return base_view + 1 - dropped  # the base view and one newline
        grid_height, grid_width = select_best_resolution([height, width], image_processor.image_grid_pinpoints)
        rows = features_per_side * (grid_height // tile)
        columns = features_per_side * (grid_width // tile)
        # The features the image covers once fitted into the grid; its padding is cut off.
        if width / height > columns / rows:
            rows -= 2 * ((rows - int(round(height * (columns / width), 7))) // 2)
        else:
            columns -= 2 * ((columns - int(round(width * (rows / height), 7))) // 2)
        ratio = math.sqrt(rows * columns / (max_tiles * features_per_side**2))
        if ratio > 1.1:  # more than max_tiles tiles' worth: pooled down
            rows, columns = int(rows // ratio), int(columns // ratio)
        return rows * columns + rows + base_view - dropped  # one newline per row, then the base view

    return tokens


def image_expansion(processor: Any, image: Any) -> ImageExpansion:
    """The processor's replacement for its image placeholder, as it reports it for `image`."""
    placeholder = processor.image_token
    # Without the tokenizer's own <s> or <bos>, which are no part of the image's text.
    encoded = processor(text=[placeholder], images=[[image]], add_special_tokens=False,
                        return_text_replacement_offsets=True)
    if "text_replacement_offsets" in encoded:
        (replaced,) = encoded["text_replacement_offsets"][0]
        replacement = replaced["replacement"]
    else:
        # A transformers release whose processor does not report its replacements: the text it
        # produced, read back from its ids (the probes prove it tokenises the same way).
        replacement = processor.tokenizer.decode(encoded["input_ids"][0], skip_special_tokens=False)
    image_token_strings = processor.tokenizer.convert_ids_to_tokens(marked_token_ids(processor, "image"))
    run = re.compile("(?:" + "|".join(map(re.escape, image_token_strings)) + ")+")
    # One image token keeps the run's place: special tokens split the text, so what is around it tokenises as it does.
    text, runs = run.subn(lambda match: next(token for token in image_token_strings if match.group().startswith(token)),
                          replacement)
    return ImageExpansion(placeholder, text, runs)


def marked_token_ids(processor: Any, kind: str) -> list[int]:
    """The ids a processor marks as `kind` tokens (`image_token_ids`; a processor class older than that API: its one id)."""
    ids = getattr(processor, f"{kind}_token_ids", None) or [getattr(processor, f"{kind}_token_id", None)]
    return [token_id for token_id in ids if token_id is not None]
