import json
import os
import random
import shutil
from dataclasses import replace

import pytest
from PIL import Image

from vlm_assets_tests.catalog_support import build_catalog
from vlm_assets_tests.processor_families import proven_modalities
from vlm_assets.config import FrameCacheConfig, ModelConfig, SourceConfig
from vlm_assets.tokens.lengths import LengthCounter, SampleForLength, measure_samples, oriented_image_size
from vlm_assets.tokens.processor import embedded_processor_dir, processor_fingerprint
from vlm_assets.tokens.text import PIECE_CHARS, SpecText, spec_text, store_text_spec, stored_text_spec, text_spec_of

SMALL_CLIPS = FrameCacheConfig(num_frames=8, frame_size=112, rows=2, cols=4)


def samples_of(frame):
    ok = frame[frame.status == "ok"]
    return [SampleForLength(r.sample_id, r.messages, list(r.media_kinds), list(r.media_refs)) for r in ok.itertuples()]


def proven(processor, frame_cache) -> LengthCounter:
    """A counter whose fast path is on where its probes proved it, as `sample_lengths` loads it."""
    return LengthCounter(processor, frame_cache, modalities=proven_modalities(processor, frame_cache))


def assert_fast_equals_exact(counter, samples):
    assert counter.modalities.fast_text and counter.modalities.fast_images and counter.modalities.fast_videos
    fast = counter.count(samples)
    exact = [counter.exact(sample) for sample in samples]
    assert [r.sample_id for r in fast] == [s.sample_id for s in samples]
    for f, e in zip(fast, exact):
        assert (f.status, f.token_len, f.image_tokens, f.video_tokens) == (e.status, e.token_len, e.image_tokens, e.video_tokens), f.sample_id
    # Chunk processes measure with the text spec alone, without the processor: the same lengths.
    without_processor = spec_text(text_spec_of(counter.processor))
    measured = measure_samples(samples, without_processor, counter.modalities)
    assert [counter.complete(one) for one in measured] == fast
    return fast


def test_fast_equals_exact_on_every_demo_sample(demo_app, processor):
    counter = proven(processor, demo_app.frame_cache)
    for source in demo_app.sources:
        samples = samples_of(build_catalog(source, "messages"))
        results = assert_fast_equals_exact(counter, samples)
        assert all(r.status == "ok" and r.token_len > 0 for r in results)
    video = {r.sample_id: r for r in counter.count(samples_of(build_catalog(demo_app.source("demo_video"))))}
    assert video["demo_video/v1"].video_tokens == 6272  # 64 frames of 384² -> 32 × 28 × 28 / 4


def test_a_conversation_longer_than_a_piece_counts_as_the_processor_counts_it_whole(demo_app, processor):
    """Counted a piece at a time (cut before the template's special tokens), in memory that does not grow
    with the conversation: the same length as the processor's own call on the whole text."""
    counter = proven(processor, demo_app.frame_cache)
    # Whitespace and non-ASCII text at every turn's edges, where the pieces meet.
    turns = [{"role": ("user", "assistant")[turn % 2], "content": f"\n {turn} ünïcödé 漢字  words\t \n" * 800}
             for turn in range(40)]
    sample = SampleForLength("long", json.dumps(turns), [], [])
    text = spec_text(text_spec_of(processor))
    assert text.spec.cut_before and len(counter.render(sample.messages)) > 2 * PIECE_CHARS
    [measured] = measure_samples([sample], text, counter.modalities)
    fast, exact = counter.complete(measured), counter.exact(sample)
    assert (fast.status, fast.token_len, fast.text_tokens) == (exact.status, exact.token_len, exact.text_tokens) == (
        "ok", exact.token_len, exact.token_len)


def test_fast_equals_exact_on_real_images_and_videos(tmp_path, shared_data, processor):
    images = [p for p in (shared_data / "Pillow/Tests/images").iterdir()
              if p.name not in ("truncated_jpeg.jpg", "broken.png")]
    images += list((shared_data / "clip-retrieval/tests/test_clip_inference/test_images").glob("*.jpg"))
    images += list((shared_data / "xtuner/tests/resource").glob("*.jpg"))
    rng = random.Random(7)
    for index, image in enumerate(sorted(images)):
        media = [str(image)] + ([str(rng.choice(images))] if index % 3 == 0 else [])
        turns = [{"role": "user", "content": "Describe."}, {"role": "assistant", "content": "Something " * (index + 1)}]
        if index % 2:
            turns += [{"role": "user", "content": "More?"}, {"role": "assistant", "content": "No."}]
        (tmp_path / f"{index:03d}.json").write_text(json.dumps({"messages": turns, "images": media}))
    videos = ["LLaMA-Factory/data/mllm_demo_data/4.mp4", "decord/tests/test_data/video_90.mov",
              "torchcodec/test/resources/var_fps_video.mp4"]
    for index, video in enumerate(videos):
        (tmp_path / f"v{index}.json").write_text(json.dumps(
            {"messages": [{"role": "user", "content": "<video>What?"}, {"role": "assistant", "content": "That."}],
             "videos": [str(shared_data / video)]}))
    samples = samples_of(build_catalog(SourceConfig("real", "flat_dir", tmp_path, tmp_path, allowed_roots=(shared_data,))))
    assert len(samples) == len(images) + len(videos)
    counter = proven(processor, SMALL_CLIPS)
    assert_fast_equals_exact(counter, samples)


def test_exif_orientation_swaps_header_size(shared_data, processor):
    rotated = shared_data / "Pillow/Tests/images/hopper_orientation_6.jpg"
    assert oriented_image_size(str(rotated)) == (128, 128)  # square: orientation cannot change tokens
    path = shared_data / "clip-retrieval/tests/test_clip_inference/test_images/123_456.jpg"
    assert oriented_image_size(str(path)) == Image.open(path).size[::-1]


def test_exif_rotated_demo_image_counts_as_displayed(demo_app, processor):
    counter = proven(processor, demo_app.frame_cache)
    rotated = str(demo_app.sources[0].path / "0009.jpg")
    assert oriented_image_size(rotated) == (640, 360)  # stored 640×360, EXIF 6 -> displayed portrait
    assert counter.image_tokens(rotated) == processor.image_processor.get_number_of_image_patches(640, 360, {}) // 4


def test_unprocessable_image_is_a_rejected_row_in_both_paths(tmp_path, processor):
    Image.new("RGB", (2000, 5)).save(tmp_path / "thin.png")  # aspect ratio 400 > Qwen2-VL's limit of 200
    (tmp_path / "thin.json").write_text(json.dumps(
        {"messages": [{"role": "user", "content": "<image>?"}], "images": ["thin.png"]}))
    samples = samples_of(build_catalog(SourceConfig("t", "flat_dir", tmp_path, tmp_path)))
    counter = proven(processor, SMALL_CLIPS)
    fast, exact = counter.count(samples)[0], counter.exact(samples[0])
    assert fast.status == exact.status == "rejected"
    assert "aspect ratio" in fast.reason


@pytest.mark.parametrize("kwargs", [{"min_pixels": 3136, "max_pixels": 200704}])
def test_processor_kwargs_change_image_budget(demo_app, kwargs):
    from vlm_assets.config import ModelConfig
    from vlm_assets.tokens.processor import load_processor

    small = load_processor(ModelConfig(processor_kwargs=kwargs))
    counter = proven(small, demo_app.frame_cache)
    samples = samples_of(build_catalog(demo_app.source("demo_images")))
    results = assert_fast_equals_exact(counter, samples)
    assert max(r.image_tokens for r in results) <= 2 * 200704 // (28 * 28)


def _png_with_exif_after_pixels(path, orientation: int) -> None:
    import struct
    import zlib

    Image.new("RGB", (300, 120), (10, 200, 30)).save(path, "PNG")
    data = path.read_bytes()
    exif = Image.Exif()
    exif[0x0112] = orientation
    payload = exif.tobytes()[6:]  # PNG's eXIf chunk holds the TIFF block without the "Exif\0\0" prefix
    chunk = struct.pack(">I", len(payload)) + b"eXIf" + payload + struct.pack(">I", zlib.crc32(b"eXIf" + payload))
    iend = data.rindex(b"IEND") - 4
    path.write_bytes(data[:iend] + chunk + data[iend:])


def test_png_orientation_stored_after_pixels_is_honoured(tmp_path, processor):
    _png_with_exif_after_pixels(tmp_path / "late.png", 6)
    (tmp_path / "late.json").write_text(json.dumps(
        {"messages": [{"role": "user", "content": "<image>?"}], "images": ["late.png"]}))
    assert oriented_image_size(str(tmp_path / "late.png")) == (300, 120)
    samples = samples_of(build_catalog(SourceConfig("png", "flat_dir", tmp_path, tmp_path)))
    assert_fast_equals_exact(proven(processor, SMALL_CLIPS), samples)


def test_text_spec_is_kept_per_processor_and_refused_when_the_processor_renders_differently(tmp_path):
    from vlm_assets.config import ModelConfig
    from vlm_assets.tokens.processor import load_processor

    model = ModelConfig(processor="embedded")
    processor = load_processor(model, tmp_path)
    spec = text_spec_of(processor)
    assert spec is not None and stored_text_spec(model, tmp_path) is None
    # Counting then uses the SpecText that proved the spec: its tokenizer is not parsed a second time.
    proving = spec_text(spec)
    assert text_spec_of(processor) == spec and spec_text(spec) is not proving
    store_text_spec(model, spec, tmp_path)
    assert stored_text_spec(model, tmp_path) == spec
    # Other kwargs make another processor (fingerprint): its spec is its own.
    assert stored_text_spec(ModelConfig(processor="embedded", processor_kwargs={"max_pixels": 50176}), tmp_path) is None

    text = SpecText(spec)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    assert text.render(conversation) == processor.apply_chat_template(conversation, tokenize=False)
    # Built once per process for a spec (a worker measures source after source), again for another.
    kept = spec_text(spec)
    assert spec_text(stored_text_spec(model, tmp_path)) is kept and kept.render(conversation) == text.render(conversation)
    other = replace(spec, chat_template=spec.chat_template + " ")
    assert spec_text(other) is not kept and spec_text(other).spec == other
    # A processor whose own rendering differs from its template (a subclass's override) keeps its own path.
    rendering = processor.apply_chat_template
    processor.apply_chat_template = lambda conversation, tokenize=False: rendering(conversation, tokenize=tokenize) + "\n"
    assert text_spec_of(processor) is None


def test_processor_fingerprint_follows_every_rewrite_of_its_files(tmp_path):
    directory = tmp_path / "processor"
    shutil.copytree(embedded_processor_dir(), directory)
    model = ModelConfig(processor=str(directory))
    original = processor_fingerprint(model)
    assert processor_fingerprint(model) == original
    config = directory / "processor_config.json"
    text = config.read_text(encoding="utf-8")
    edited = text.replace('"temporal_patch_size": 2', '"temporal_patch_size": 3', 1)
    assert edited != text and len(edited) == len(text)
    written = config.stat().st_mtime_ns
    with open(config, "r+", encoding="utf-8") as handle:  # in place: same inode, same size
        handle.write(edited)
    assert processor_fingerprint(model) != original
    os.utime(config, ns=(written + 10**9, written + 10**9))  # as if edited long ago
    assert processor_fingerprint(model) != original
    config.write_text(text, encoding="utf-8")
    assert processor_fingerprint(model) == original
    (directory / "extra.txt").write_text("x", encoding="utf-8")
    assert processor_fingerprint(model) != original
