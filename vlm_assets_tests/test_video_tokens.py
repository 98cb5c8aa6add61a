"""Video tokens counted from each clip's facts, with no pixel decoded, equal a direct processor call.

The catalogue's decoding pass keeps each clip's frame count, fps and sampled frame indices (its
mosaic spool). From those the fast path writes what Qwen3-VL prints before each temporal patch
("<3.6 seconds>") and GLM-4.1V after each one's frame ("…<|end_of_image|>19"); Qwen2-VL prints nothing
that follows the clip. Held-out real clips (of other
containers, codecs, rotations, rates and lengths than the other tests use) are counted so and
compared with a direct call of the processor; a clip the spool does not know, and a processor
that prints other times, are counted by the exact path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from vlm_assets.catalog.build import MediaValidator
from vlm_assets.catalog.table import write_catalog
from vlm_assets.config import FrameCacheConfig, ModelConfig, SourceConfig
from vlm_assets.frames.spool import MosaicSpool
from vlm_assets.tokens.lengths import (
    LengthCounter,
    SampleForLength,
    fast_path_counts,
    measure_samples,
    video_metadata,
)
from vlm_assets.tokens.processor import load_processor
from vlm_assets.tokens.profile import ProcessorProfile, model_types_of
from vlm_assets.tokens.table import write_length_table
from vlm_assets.tokens.video_tokens import TIME_SLOT, usable_clip_facts, video_expansion
from vlm_assets_tests.catalog_support import build_catalog
from vlm_assets_tests.processor_families import direct_length, family_processor_dirs, proven_modalities

pytestmark = pytest.mark.families

# An odd number of frames: Qwen3-VL fills the last temporal patch with the clip's last frame.
FRAME_CACHE = FrameCacheConfig(num_frames=7, frame_size=96, rows=2, cols=4)
VIDEO_FAMILIES = ("qwen3_vl", "qwen2_vl", "llava_onevision", "internvl", "glm4v")
# Families whose clip text prints each temporal patch's time.
TIMED_CLIP_TEXT_FAMILIES = ("qwen3_vl", "glm4v")
# Families whose clip text is the same for every clip of the frame cache's shape: its tokens follow no clip fact.
FIXED_CLIP_TEXT_FAMILIES = ("llava_onevision", "internvl")
HELD_OUT_CLIPS = (
    "decord/tests/test_data/video_0.mov", "decord/tests/test_data/video_180.mov",
    "decord/tests/test_data/video_270.mov", "decord/tests/test_data/unordered.mov",
    "mmaction2/tests/data/test.avi", "torchcodec/test/resources/av1_video.mkv",
    "torchcodec/test/resources/h264_10bits.mp4", "torchcodec/test/resources/h265_video.mp4",
    "torchcodec/test/resources/var_fps_video.mp4",
)


@pytest.fixture(scope="module")
def family_dirs(family_cache) -> dict[str, Path]:
    return family_processor_dirs(VIDEO_FAMILIES, family_cache)


@pytest.fixture(scope="module")
def processors(family_dirs) -> dict[str, object]:
    return {family: load_processor(ModelConfig(processor=str(directory))) for family, directory in family_dirs.items()}


@pytest.fixture(scope="module")
def spool(tmp_path_factory) -> MosaicSpool:
    return MosaicSpool(tmp_path_factory.mktemp("spool"), FRAME_CACHE)


@pytest.fixture(scope="module")
def held_out_source(shared_data, tmp_path_factory) -> SourceConfig:
    """One sample per held-out clip, and two of the clips in a multi-turn one."""
    records = [{"messages": [{"role": "user", "content": f"<video>\nWhat happens in clip {index}?"},
                             {"role": "assistant", "content": "Something moves."}],
                "videos": [str(shared_data / clip)]} for index, clip in enumerate(HELD_OUT_CLIPS)]
    records.append({"messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Compare <video> and\n<video>"}, {"role": "assistant", "content": "Alike."},
        {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Same scene."}],
        "videos": [str(shared_data / HELD_OUT_CLIPS[4]), str(shared_data / HELD_OUT_CLIPS[8])]})
    folder = tmp_path_factory.mktemp("held-out")
    for index, record in enumerate(records):
        (folder / f"{index:02d}.json").write_text(json.dumps(record))
    return SourceConfig("held_out", "flat_dir", folder, folder, allowed_roots=(shared_data,))


@pytest.fixture(scope="module")
def held_out_samples(held_out_source, spool) -> list[SampleForLength]:
    """The held-out samples, catalogued with the spool as the pipeline's catalogue is."""
    frame = build_catalog(held_out_source, validator=MediaValidator(FRAME_CACHE.num_frames, mosaic_spool=spool))
    assert (frame.status == "ok").all(), frame[frame.status != "ok"].reason.tolist()
    return [SampleForLength(row.sample_id, row.messages, list(row.media_kinds), list(row.media_refs))
            for row in frame.itertuples()]


def counter_for(processor, spool: MosaicSpool | None) -> LengthCounter:
    return LengthCounter(processor, FRAME_CACHE, modalities=proven_modalities(processor, FRAME_CACHE),
                         clip_facts=spool.sampled if spool else None)


@pytest.mark.parametrize("family", VIDEO_FAMILIES)
def test_held_out_clips_counted_from_their_facts_equal_a_direct_processor_call(family, processors, held_out_samples,
                                                                               spool):
    processor = processors[family]
    counter = counter_for(processor, spool)
    assert counter.modalities.fast_videos
    facts = usable_clip_facts(spool.sampled, FRAME_CACHE)
    assert all(fast_path_counts(sample, counter.modalities, counter.text, True, clip_facts=facts)
               for sample in held_out_samples)
    measured = measure_samples(held_out_samples, counter.text, counter.modalities, clip_facts=facts)
    for sample, ours in zip(held_out_samples, map(counter.complete, measured), strict=True):
        exact = counter.exact(sample)
        assert ours.status == "ok", (sample.sample_id, ours.reason)
        assert ours.token_len == direct_length(processor, sample, FRAME_CACHE), sample.sample_id
        assert (ours.text_tokens, ours.video_tokens) == (exact.text_tokens, exact.video_tokens), sample.sample_id
    counted = counter.count(held_out_samples)
    assert [result.token_len for result in counted] == [result.token_len for result in map(counter.complete, measured)]


@pytest.mark.parametrize("family", FIXED_CLIP_TEXT_FAMILIES)
def test_clips_of_a_fixed_text_counted_without_their_facts_equal_a_direct_processor_call(family, processors,
                                                                                        held_out_samples, shared_data):
    """LLaVA-OneVision pools each frame to a fixed grid; InternVL writes "Frame{i}: <img>…</img>" per frame
    with its image tokens. Neither needs the clips' facts: the held-out clips, and a clip beside a real image
    (where the exact path counts InternVL's frames among the image tokens), are counted by the fast path
    alone, split into text, image and video tokens as the exact path splits them."""
    processor = processors[family]
    counter = counter_for(processor, None)
    assert counter.modalities.fast_videos and counter.modalities.fast_images
    assert not counter.modalities.video_expansion.needs_clip_facts
    mixed = SampleForLength("mixed/0", json.dumps([{"role": "user", "content": "<image>\nAnd <video>: same scene?"},
                                                   {"role": "assistant", "content": "No."}]),
                            ["image", "video"], [str(shared_data / "LLaMA-Factory/data/mllm_demo_data/1.jpg"),
                                                 held_out_samples[0].media_refs[0]])
    samples = [*held_out_samples, mixed]
    assert all(fast_path_counts(sample, counter.modalities, counter.text, True) for sample in samples)
    measured = measure_samples(samples, counter.text, counter.modalities)
    for sample, ours in zip(samples, map(counter.complete, measured), strict=True):
        exact = counter.exact(sample)
        assert ours.status == "ok", (sample.sample_id, ours.reason)
        assert ours.token_len == direct_length(processor, sample, FRAME_CACHE), sample.sample_id
        assert (ours.text_tokens, ours.image_tokens, ours.video_tokens) == (
            exact.text_tokens, exact.image_tokens, exact.video_tokens), sample.sample_id


@pytest.mark.parametrize("family", TIMED_CLIP_TEXT_FAMILIES)
def test_each_clips_times_are_written_as_its_processor_prints_them(family, processors, held_out_samples, spool):
    """The text of every held-out clip (rates of 10 to 32 fps, a variable one, 3 to 300 frames) equals the
    processor's own replacement for that clip, its video tokens cut to one run per temporal patch: Qwen3-VL's
    mean time of a patch to a tenth of a second, GLM-4.1V's first frame's whole seconds."""
    processor = processors[family]
    expansion = proven_modalities(processor, FRAME_CACHE).video_expansion
    assert expansion is not None and expansion.needs_clip_facts and TIME_SLOT in expansion.patch_text
    frames = np.zeros((FRAME_CACHE.num_frames, FRAME_CACHE.frame_size, FRAME_CACHE.frame_size, 3), dtype=np.uint8)
    rendered = processor.apply_chat_template([{"role": "user", "content": [{"type": "video"}]}], tokenize=False)
    refs = {ref for sample in held_out_samples for ref in sample.media_refs}
    rates = set()
    for ref in refs:
        clip = spool.sampled(ref)
        assert clip is not None, ref
        rates.add(clip.fps)
        metadata = video_metadata(clip, FRAME_CACHE.frame_size)
        processors_own = video_expansion(processor, rendered, frames, clip, metadata)
        assert processors_own is not None
        assert processors_own.clip_text(clip) == expansion.clip_text(clip), ref
        # Seven frames in temporal patches of two: four patches, the last one filled with the last frame.
        assert expansion.video_tokens_in_clip(clip) == 4
    assert len(rates) >= 4


def test_glm4v_clips_beside_an_image_are_counted_as_its_exact_path_splits_them(processors, held_out_samples, spool,
                                                                              shared_data):
    """GLM-4.1V writes a clip's frames with its image tokens: beside a real image the exact path counts them
    among the image tokens, and the fast path, its times from the spool, splits the length as it does."""
    processor = processors["glm4v"]
    counter = counter_for(processor, spool)
    assert counter.modalities.video_expansion.spelled_with_image_tokens
    image = str(shared_data / "LLaMA-Factory/data/mllm_demo_data/1.jpg")
    samples = [SampleForLength(f"mixed/{index}", json.dumps([
        {"role": "user", "content": "<image>\nAnd <video>: same scene?"}, {"role": "assistant", "content": "No."},
        {"role": "user", "content": "Then <video>?"}, {"role": "assistant", "content": "Yes."}]),
        ["image", "video", "video"], [image, first.media_refs[0], second.media_refs[0]])
        for index, (first, second) in enumerate(zip(held_out_samples[:4], held_out_samples[4:8]))]
    facts = usable_clip_facts(spool.sampled, FRAME_CACHE)
    assert all(fast_path_counts(sample, counter.modalities, counter.text, True, clip_facts=facts) for sample in samples)
    measured = measure_samples(samples, counter.text, counter.modalities, clip_facts=facts)
    for sample, ours in zip(samples, map(counter.complete, measured), strict=True):
        exact = counter.exact(sample)
        assert ours.status == "ok", (sample.sample_id, ours.reason)
        assert ours.token_len == direct_length(processor, sample, FRAME_CACHE), sample.sample_id
        assert (ours.text_tokens, ours.image_tokens, ours.video_tokens) == (
            exact.text_tokens, exact.image_tokens, exact.video_tokens), sample.sample_id


def test_a_clip_the_spool_does_not_know_is_counted_by_the_exact_path(processors, held_out_samples, tmp_path):
    """Without the catalogue's facts (no spool, or one kept for another frame-cache shape), the clip is
    decoded; what it is counted from is never guessed."""
    processor = processors["qwen3_vl"]
    other_shape = MosaicSpool(tmp_path / "spool", FrameCacheConfig(num_frames=8, frame_size=96, rows=2, cols=4))
    sample = held_out_samples[4]
    other_shape.render(sample.media_refs[0])
    for spool in (None, other_shape):
        counter = counter_for(processor, spool)
        facts = usable_clip_facts(spool.sampled, FRAME_CACHE) if spool else None
        assert not fast_path_counts(sample, counter.modalities, counter.text, True, clip_facts=facts)
        assert counter.count([sample])[0].token_len == direct_length(processor, sample, FRAME_CACHE)
    # Qwen2-VL's clip text follows no clip fact: its videos are counted fast without them.
    qwen2 = counter_for(processors["qwen2_vl"], None)
    assert fast_path_counts(sample, qwen2.modalities, qwen2.text, True)


def test_a_processor_printing_other_times_counts_its_videos_by_the_exact_path(processors, held_out_samples, spool):
    """A processor whose times differ from the arithmetic written here (whole seconds, as a custom processor
    or another release might print them) is not proven: its videos go through the exact path."""
    qwen3 = processors["qwen3_vl"]

    class WholeSecondTimes(type(qwen3)):
        def replace_video_token(self, video_inputs: dict, video_idx: int, **kwargs) -> str:
            text = super().replace_video_token(video_inputs, video_idx, **kwargs)
            return re.sub(r"<(\d+)\.\d seconds>", r"<\1 seconds>", text)

    processor = WholeSecondTimes(qwen3.image_processor, qwen3.tokenizer, qwen3.video_processor,
                                chat_template=qwen3.chat_template)
    counter = counter_for(processor, spool)
    assert ProcessorProfile(counter.modalities, model_types_of(qwen3)).describe().endswith(
        "text: fast, images: fast, videos: exact")
    for sample in held_out_samples[:3]:
        assert counter.count([sample])[0].token_len == direct_length(processor, sample, FRAME_CACHE)


def test_a_glm4v_processor_rounding_its_seconds_counts_its_videos_by_the_exact_path(processors, held_out_samples,
                                                                                   spool):
    """GLM-4.1V cuts each time to its whole seconds; a processor that rounds them (19.97 s as 20) is not proven."""
    glm4v = processors["glm4v"]

    class RoundedSeconds(type(glm4v)):
        def replace_frame_token_id(self, timestamp_sec, num_image_tokens: int = 1) -> str:
            return super().replace_frame_token_id(round(timestamp_sec), num_image_tokens=num_image_tokens)

    processor = RoundedSeconds(glm4v.image_processor, glm4v.tokenizer, glm4v.video_processor,
                               chat_template=glm4v.chat_template)
    counter = counter_for(processor, spool)
    assert ProcessorProfile(counter.modalities, model_types_of(glm4v)).describe().endswith(
        "text: fast, images: fast, videos: exact")
    for sample in held_out_samples[:3]:
        assert counter.count([sample])[0].token_len == direct_length(processor, sample, FRAME_CACHE)


@pytest.mark.parametrize("family", TIMED_CLIP_TEXT_FAMILIES)
def test_a_length_table_counts_the_clips_from_the_spool_in_its_chunk_processes(family, family_dirs, processors,
                                                                                held_out_source, held_out_samples,
                                                                                tmp_path):
    """`write_length_table` with the spool: the chunk processes measure the clips' times with the stored text
    spec (no processor), and every length is a direct processor call's."""
    catalog, spool = tmp_path / "catalog.parquet", MosaicSpool(tmp_path / "spool", FRAME_CACHE)
    write_catalog(held_out_source, catalog, "messages", MediaValidator(FRAME_CACHE.num_frames, mosaic_spool=spool))
    model = ModelConfig(processor=str(family_dirs[family]))
    lengths = tmp_path / "lengths.parquet"
    write_length_table(catalog, lengths, model, FRAME_CACHE, processes=2, chunk_rows=1, clip_spool=spool.root)
    table = pq.read_table(lengths).to_pylist()
    direct = {sample.sample_id: direct_length(processors[family], sample, FRAME_CACHE)
              for sample in held_out_samples}
    assert {row["sample_id"]: (row["status"], row["token_len"]) for row in table} == {
        sample_id: ("ok", length) for sample_id, length in direct.items()}
