"""Each `trainer.chat_template` counts a child as LoongForge's VLM task encoder encodes it under that template.

The reference below is written out from the consumer's code, apart from the product's: its media
plugins (Qwen2-VL's and Qwen3-VL's: the image resized, capped and its shorter side raised; a clip's
frames sampled and resized by the encoder, then, under Qwen3-VL's, handed to the video processor as a
clip of 24 frames a second, which samples them again and prints each temporal patch's time), and its
two text rules: the legacy multi-turn encoding (each piece tokenised on its own, answers closed by the
end-of-text id) and the `*-hf` templates' rendering of the whole conversation. Real Qwen2-VL, Qwen2.5-VL
and Qwen3-VL processors (built offline) give the tokens of each medium; real clips of several rates,
a variable-rate and a rotated one among them, give the frames.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from vlm_assets.config import CHAT_TEMPLATES, ConfigError, FrameCacheConfig, ModelConfig, TrainerConfig
from vlm_assets.media.trainer_decoder import TrainerClipView
from vlm_assets.tokens.consumer import CONSUMER_TEMPLATES, CountingRule, consumer_clip_shape
from vlm_assets.tokens.lengths import LengthCounter, SampleForLength
from vlm_assets.tokens.processor import load_processor
from vlm_assets_tests.processor_families import family_processor_dirs, proven_modalities
from vlm_assets_tests.test_consumer_contract import _by_hand_resize

pytestmark = pytest.mark.families

FRAME_CACHE = FrameCacheConfig(num_frames=4, frame_size=56, rows=2, cols=2)
# Each template, with the families LoongForge registers it for.
TEMPLATE_FAMILIES = (("qwen2-vl", "qwen2_vl"), ("qwen2-vl", "qwen2_5_vl"), ("qwen3-vl", "qwen3_vl"),
                     ("qwen2.5-vl-hf", "qwen2_5_vl"), ("qwen3-vl-hf", "qwen3_vl"))
LEGACY_TEMPLATES = ("qwen2-vl", "qwen3-vl")
QWEN3_PLUGIN_TEMPLATES = ("qwen3-vl", "qwen3-vl-hf")
DEFAULT_SYSTEM = "You are a helpful assistant."
DOG = "xtuner/tests/resource/mscoco_dog_000000319154.jpg"
CATS = "xtuner/tests/resource/mscoco_twocat_000000039769.jpg"
HOPPER = "Pillow/Tests/images/hopper.webp"
CLIPS = ("LLaMA-Factory/data/mllm_demo_data/4.mp4", "decord/examples/flipping_a_pancake.mkv",
         "torchcodec/test/resources/var_fps_video.mp4", "decord/tests/test_data/video_90.mov",
         "decord/tests/test_data/video_180.mov", "torchcodec/test/resources/nasa_13013.mp4")


def _turns(*texts: str) -> list[dict[str, str]]:
    return [{"role": "user" if index % 2 == 0 else "assistant", "content": text} for index, text in enumerate(texts)]


# id -> (turns, media kind, media files)
RECORDS = {
    "text": (_turns("Say hi.", "Hi.", "Again, in  two lines\n", "Hi\nagain."), "", ()),
    "one_image": (_turns("<image>What animal is this?", "A dog."), "image", (DOG,)),
    "webp": (_turns("Who is this? <image>", "Grace Hopper."), "image", (HOPPER,)),
    "two_images": (_turns("<image> and <image>: which has cats?", "The second.", "How many?", "Two."), "image",
                   (DOG, CATS)),
    "multi_turn": (_turns("<image>Describe it.", "A dog on grass.", "What colour is it?", "Brown.",
                          "Is it happy?", "It seems so."), "image", (DOG,)),
    **{f"clip_{index}": (_turns("<video>\nWhat happens?", "Something moves."), "video", (clip,))
       for index, clip in enumerate(CLIPS)},
    "two_clips": (_turns("Compare <video> and <video>.", "Alike.", "Why?", "Same scene."), "video",
                  (CLIPS[0], CLIPS[2])),
    "system_image": ([{"role": "system", "content": "You are a vet."}, *_turns("<image>Healthy?", "Yes.")], "image",
                     (DOG,)),
    "system_text": ([{"role": "system", "content": "Answer in French."}, *_turns("Hello!", "Bonjour !")], "", ()),
    "system_clip": ([{"role": "system", "content": "Be brief."}, *_turns("<video>Cooked?", "A pancake.")], "video",
                    (CLIPS[1],)),
    # Answers opening with white space: the header's newline and theirs tokenise apart (legacy templates) or
    # together, a token across the answer's start that the HF templates' encoding refuses.
    "newline_answer": (_turns("<image>What is it?", "\nA dog."), "image", (DOG,)),
    "spaced_answers": (_turns("Say hi.", " \nHi.", "Again?", "\n\nHi.", "Once more?", " Hi."), "", ()),
    "tab_answer": (_turns("<video>What happens?", "\tIt flips."), "video", (CLIPS[1],)),
}


def _samples(shared_data: Path, with_system: bool) -> list[SampleForLength]:
    return [SampleForLength(key, json.dumps(turns), [kind] * len(files), [str(shared_data / f) for f in files])
            for key, (turns, kind, files) in RECORDS.items() if with_system or not key.startswith("system")]


# ---- the consumer, written out from LoongForge's code ------------------------------------------------
def _consumer_image_tokens(processor, path: Path, qwen3_plugin: bool) -> int:
    """VLMTaskEncoder._resize_image (factor 28), then the plugin's _preprocess_image (longer side capped
    at 512, shorter side at least 28 or, for Qwen3-VL, 32; an extreme aspect cut to 180:1), then the
    image processor's grid over merge_size²."""
    from PIL import Image

    trainer = TrainerConfig()
    image = Image.open(path).convert("RGB")
    height, width = _by_hand_resize(image.height, image.width, trainer.min_pixels, trainer.max_pixels)
    image = image.resize((width, height))
    if max(image.width, image.height) > 512:
        factor = 512 / max(image.width, image.height)
        image = image.resize((int(image.width * factor), int(image.height * factor)))
    shortest = 32 if qwen3_plugin else 28
    if min(image.width, image.height) < shortest:
        image = image.resize((max(image.width, shortest), max(image.height, shortest)))
    grid = processor.image_processor([image], return_tensors="pt")["image_grid_thw"][0]
    return int(grid.prod()) // processor.image_processor.merge_size ** 2


def _consumer_frames(path: Path) -> torch.Tensor:
    """VLMTaskEncoder._resize_video: Energon's decoder gives the frame count T and rate r; n = T / r × fps
    within [fps_min_frames, fps_max_frames] and T, floored to pairs; each frame resized within the frame
    budget. Only the shape matters to the count."""
    from megatron.energon.av import AVDecoder

    trainer = TrainerConfig()
    decoder = AVDecoder(io.BytesIO(path.read_bytes()))
    _duration, total = decoder.get_video_duration(get_frame_count=True)
    wanted = total / decoder.get_video_fps() * trainer.fps
    frames = math.floor(min(max(wanted, 4), 768, total) / 2) * 2
    first = decoder.get_clips(video_clip_ranges=[(0, 1)], video_unit="frames").video_clips[0]
    height, width = first.shape[-2:]
    height, width = _by_hand_resize(height, width, int(trainer.frame_min_pixels * 1.05),
                                    min(trainer.frame_max_pixels, trainer.video_max_pixels / frames * 2))
    return torch.zeros((frames, 3, height, width))


def _consumer_clip_text(processor, path: Path, qwen3_plugin: bool) -> str:
    """The text a clip's placeholder becomes. Qwen2-VL's plugin: its grid's tokens between the vision
    markers. Qwen3-VL's: the frames given to the video processor with fps 24 (the processor has no
    `video_fps`), which keeps int(n / 24 × its fps) of them (within its min/max frames and n), evenly;
    per temporal patch `<t seconds>` (its two frames' indices / 24, averaged, one decimal) and the patch's
    tokens between the vision markers."""
    frames = _consumer_frames(path)
    video_processor = processor.video_processor
    merge = video_processor.merge_size
    if not qwen3_plugin:
        grid = video_processor(videos=[frames], return_tensors="pt")["video_grid_thw"][0]
        return "<|vision_start|>" + "<|video_pad|>" * (int(grid.prod()) // merge ** 2) + "<|vision_end|>"
    assert not hasattr(processor, "video_fps")
    count = len(frames)
    kept = min(max(int(count / 24 * video_processor.fps), video_processor.min_frames), video_processor.max_frames,
               count)
    indices = np.linspace(0, count - 1, kept).round().astype(int).tolist()
    out = video_processor(videos=[frames], video_metadata=[{"fps": 24.0, "duration": None, "total_num_frames": count}],
                          return_metadata=True)
    grid, metadata = out["video_grid_thw"][0], out["video_metadata"][0]
    assert list(metadata.frames_indices) == indices
    indices += [indices[-1]] * (len(indices) % 2)
    times = [(indices[i] / 24 + indices[i + 1] / 24) / 2 for i in range(0, len(indices), 2)]
    assert int(grid[0]) == len(times)
    patch = int(grid[1] * grid[2]) // merge ** 2
    return "".join(f"<{time:.1f} seconds><|vision_start|>" + "<|video_pad|>" * patch + "<|vision_end|>"
                   for time in times)


def _expanded(processor, turns: list[dict], kind: str, files: list[Path], qwen3_plugin: bool) -> list[dict]:
    """The plugin's process_messages: each placeholder, in order over the turns, replaced by its medium's text."""
    if kind == "image":
        texts = ["<|vision_start|>" + "<|image_pad|>" * _consumer_image_tokens(processor, f, qwen3_plugin)
                 + "<|vision_end|>" for f in files]
    else:
        texts = [_consumer_clip_text(processor, f, qwen3_plugin) for f in files]
    placeholder, texts = f"<{kind}>", iter(texts)
    expanded = []
    for turn in turns:
        content = turn["content"]
        while kind and placeholder in content:
            content = content.replace(placeholder, next(texts), 1)
        expanded.append({"role": turn["role"], "content": content})
    return expanded


def consumer_length(processor, template: str, sample: SampleForLength) -> int:
    """The tokens the consumer encodes for a packed_multi_mix_qa / packed_chat_mix child under `template`."""
    turns, kind, _files = RECORDS[sample.sample_id]
    system = next((turn["content"] for turn in turns if turn["role"] == "system"), None)
    turns = [turn for turn in turns if turn["role"] != "system"]
    files = [Path(ref) for ref in sample.media_refs]
    turns = _expanded(processor, turns, kind, files, template in QWEN3_PLUGIN_TEMPLATES)
    tokenizer = processor.tokenizer

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0

    if template in LEGACY_TEMPLATES:  # ChatTemplate.encode_multiturn: each piece tokenised on its own
        pieces, end_of_text_ids = [f"<|im_start|>system\n{system or DEFAULT_SYSTEM}<|im_end|>\n"], 0
        for index, turn in enumerate(turns):
            if turn["role"] == "user":
                pieces += ["\n"] * (index > 0)
                pieces.append(f"<|im_start|>user\n{turn['content']}<|im_end|>\n<|im_start|>assistant\n")
            else:
                pieces.append(turn["content"])
                end_of_text_ids += 1
        return sum(map(count, pieces)) + end_of_text_ids
    # HFChatTemplate.encode_openai: the system turn put first, the whole rendered, then tokenised; each answer's
    # span (its text and closing <|im_end|>\n) found by the tokens' character offsets, none crossing its start.
    text = f"<|im_start|>system\n{system}<|im_end|>\n" if system else (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n" if template == "qwen2.5-vl-hf" else "")
    answer_starts = []
    for turn in turns:
        text += f"<|im_start|>{turn['role']}\n"
        if turn["role"] == "assistant":
            answer_starts.append(len(text))
        text += f"{turn['content']}<|im_end|>\n"
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if any(begin < start < end for start in answer_starts for begin, end in offsets):
        raise ValueError("HuggingFace generation boundary splits a token")
    return len(offsets)


# ---- tests ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def processors(family_cache) -> dict[str, object]:
    directories = family_processor_dirs(("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision"), family_cache)
    return {family: load_processor(ModelConfig(processor=str(directory))) for family, directory in directories.items()}


@pytest.mark.parametrize("sample_type", ["packed_multi_mix_qa", "packed_chat_mix"])
@pytest.mark.parametrize(("template", "family"), TEMPLATE_FAMILIES)
def test_each_template_counts_what_the_consumer_encodes(template, family, sample_type, processors, shared_data):
    processor = processors[family]
    rule = CountingRule(sample_type, TrainerConfig(chat_template=template))
    counter = LengthCounter(processor, FRAME_CACHE, modalities=proven_modalities(processor, FRAME_CACHE), rule=rule)
    samples = _samples(shared_data, with_system=sample_type == "packed_chat_mix")
    counted = counter.count(samples)
    refused = set()
    for sample, result in zip(samples, counted, strict=True):
        assert result == counter.exact(sample), sample.sample_id  # the fast path where proven, the exact one alike
        try:
            consumer = consumer_length(processor, template, sample)
        except ValueError:
            refused.add(sample.sample_id)
            assert result.status == "rejected" and "refuses a token across an answer's start" in result.reason
            continue
        assert result.status == "ok", (sample.sample_id, result.reason)
        assert result.token_len == consumer, sample.sample_id
    # The HF templates' encoding refuses the answers opening with a newline; the legacy ones count them.
    assert refused == (set() if template in LEGACY_TEMPLATES else {"newline_answer", "spaced_answers"})


def test_qwen3_vl_templates_count_a_clip_resampled_by_the_video_processor(processors, shared_data):
    """Qwen3-VL's plugin leaves about one frame in 12 of those the encoder sampled: a clip counts far
    fewer tokens than under Qwen2-VL's plugin, whose frames the processor takes as they are."""
    processor = processors["qwen3_vl"]
    clip = next(sample for sample in _samples(shared_data, False) if sample.sample_id == "clip_1")  # 310 frames, 30 fps
    qwen3 = LengthCounter(processor, FRAME_CACHE, rule=CountingRule("packed_multi_mix_qa",
                                                                    TrainerConfig(chat_template="qwen3-vl")))
    as_sampled = LengthCounter(processor, FRAME_CACHE, rule=CountingRule("packed_multi_mix_qa",
                                                                         TrainerConfig(chat_template="processor")))
    resampled, whole = qwen3.exact(clip), as_sampled.exact(clip)
    # 20 sampled frames (10 temporal patches) become int(20 / 24 × 2) = 1, raised to min_frames 4: 2 patches.
    assert whole.video_tokens == 5 * resampled.video_tokens


@pytest.mark.parametrize(("template", "other"), [("qwen2-vl", "qwen3_vl"), ("qwen3-vl", "qwen2_5_vl"),
                                                 ("qwen3-vl-hf", "qwen2_vl"), ("qwen2.5-vl-hf", "qwen2_vl"),
                                                 ("qwen3-vl-hf", "llava_onevision")])
def test_a_processor_of_another_family_than_the_template_is_refused_at_load(template, other, processors):
    processor = processors[other]
    with pytest.raises(ConfigError, match=rf"trainer.chat_template '{template}' is LoongForge's template for .* "
                                          rf"but the loaded processor is {type(processor).__name__}"):
        LengthCounter(processor, FRAME_CACHE, rule=CountingRule("packed_multi_mix_qa",
                                                                TrainerConfig(chat_template=template)))


def test_the_default_and_processor_templates_still_count_other_families_by_their_own_template(processors):
    for template in ("qwen2-vl", "processor"):
        counter = LengthCounter(processors["llava_onevision"], FRAME_CACHE,
                                rule=CountingRule("packed_multi_mix_qa", TrainerConfig(chat_template=template)))
        assert counter.rule is not None and counter.rule.template is None
    processor = LengthCounter(processors["qwen3_vl"], FRAME_CACHE,
                              rule=CountingRule("packed_multi_mix_qa", TrainerConfig(chat_template="processor")))
    assert processor.rule is not None and processor.rule.template is None and processor.rule.resizes_media


def test_every_configurable_template_has_a_rule():
    assert tuple(CONSUMER_TEMPLATES) == CHAT_TEMPLATES



def _catalogued_view(path: Path) -> str:
    """The view the catalogue records of a clip: from the frame count its one decoding pass proves."""
    from vlm_assets.media.trainer_decoder import trainer_clip_view
    from vlm_assets.media.video import read_sampled_frames

    try:
        decoded = read_sampled_frames(str(path), FRAME_CACHE.num_frames, lambda _index, _frame: None)
    except Exception:  # the catalogue rejects it: no view
        return ""
    view = trainer_clip_view(str(path), decoded.total_frames)
    return view.text() if view is not None else ""


@pytest.mark.parametrize(("template", "family"), TEMPLATE_FAMILIES)
def test_clips_counted_from_the_catalogue_view_equal_their_frames_read_as_the_consumer_does(
        template, family, processors, shared_data, tmp_path):
    """Each clip's length from the catalogue's view of it is the one its frames, decoded by Energon's
    decoder and sampled as the consumer samples them, give; a clip that decoder cannot read has no view.
    The view's path reads no byte of the clip: emptied afterwards, it is counted all the same."""
    import shutil

    processor = processors[family]
    counter = LengthCounter(processor, FRAME_CACHE, modalities=proven_modalities(processor, FRAME_CACHE),
                            rule=CountingRule("packed_chat_mix", TrainerConfig(chat_template=template)))
    turns = json.dumps([{"role": "system", "content": "Be brief."}, *_turns("<video>\nWhat happens?", "It moves.")])
    # Every real clip of the shared data: several containers and codecs, a variable rate, rotated ones,
    # four-frame ones, an AVI Energon's decoder cannot seek (2.avi) and a corrupt MP4.
    clips = sorted(str(path.relative_to(shared_data)) for path in shared_data.rglob("*")
                   if path.suffix in {".mp4", ".mkv", ".avi", ".mov", ".webm"})
    modalities = counter.modalities
    proven = modalities.clip_shape_plugin_text if template in QWEN3_PLUGIN_TEMPLATES else modalities.clip_shape_tokens
    viewed = shaped = 0
    for number, clip in enumerate(clips):
        copy = tmp_path / f"{number}{Path(clip).suffix}"
        shutil.copyfile(shared_data / clip, copy)
        view = _catalogued_view(copy)
        sample = SampleForLength(clip, turns, ["video"], [str(copy)], [view])
        exact = counter.exact(sample)
        if not view:
            assert exact.status == "rejected", clip
            continue
        viewed += 1
        assert exact.status == "ok", (clip, exact.reason)
        assert counter.counted(sample) == exact, clip
        if proven and consumer_clip_shape(TrainerClipView.parse(view), counter.rule) is not None:
            shaped += 1
            copy.write_bytes(b"")
            assert counter.counted(sample) == exact, clip
    assert viewed == len(clips) - 2
    # Where the probes prove the arithmetic, only the clips whose sampled frames are neighbours (four-frame
    # ones) are decoded: Energon's reader seeks back for those.
    assert shaped >= viewed - 5 if proven else shaped == 0
    assert _catalogued_view(shared_data / "LLaMA-Factory/data/mllm_demo_data/2.avi") == ""
