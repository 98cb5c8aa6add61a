"""Token lengths for each model family equal a direct call of that family's processor.

Processors of nine families are built offline from transformers' classes (processor_families.py).
For each, the lengths of real samples (text only, one image, several images, multi-turn, mp4, avi,
mkv and mov videos) counted by `LengthCounter` (the fast path where its probes proved it, the
exact path otherwise) and by the exact path alone equal what the processor returns when called
directly as a trainer calls it: images grouped per sample, the frame cache's frames with the
processor's frame sampling off and the clip's metadata. The catalogue keeps each clip's frame count,
fps and sampled indices (its mosaic spool), which the fast path counts Qwen3-VL's clip times from.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
import yaml

from vlm_assets.catalog.build import MediaValidator
from vlm_assets.catalog.messages import PLACEHOLDER_PATTERN
from vlm_assets.config import ConfigError, FrameCacheConfig, ModelConfig, SourceConfig
from vlm_assets.frames.spool import MosaicSpool
from vlm_assets.layout import StorageLayout
from vlm_assets.tokens.lengths import LengthCounter, SampleForLength, fast_path_counts, measure_samples
from vlm_assets.tokens.processor import load_processor
from vlm_assets.tokens.profile import ProcessorProfile, check_model_type, model_types_of, prove_fast_path
from vlm_assets.tokens.table import sample_kind
from vlm_assets.tokens.text import control_tokens_of
from vlm_assets_tests.catalog_support import build_catalog
from vlm_assets_tests.processor_families import FAMILIES, direct_length, family_processor_dirs, proven_modalities
from vlm_assets_tests.run_support import run
from vlm_assets_tests.test_frames import make_video

pytestmark = pytest.mark.families

CLIPS = FrameCacheConfig(num_frames=8, frame_size=112, rows=2, cols=4)
NO_VIDEO = {"gemma3", "llava_next", "mistral3"}
# The families whose images the fast path counts with arithmetic other than Qwen-VL's image processor's.
NON_QWEN_IMAGE_FAMILIES = ("llava_onevision", "internvl", "gemma3", "llava_next", "mistral3", "glm4v")
REAL_VIDEOS = ("decord/examples/flipping_a_pancake.mkv", "decord/tests/test_data/video_90.mov",
               "torchcodec/test/resources/nasa_13013.mp4")


@pytest.fixture(scope="module")
def family_dirs(family_cache) -> dict[str, Path]:
    return family_processor_dirs(FAMILIES, family_cache)


@pytest.fixture(scope="module")
def processors(family_dirs) -> dict[str, object]:
    return {family: load_processor(ModelConfig(processor=str(directory))) for family, directory in family_dirs.items()}


@pytest.fixture(scope="module")
def clip_spool(tmp_path_factory) -> MosaicSpool:
    """Where the catalogue's decoding pass keeps each clip's frame count, fps and sampled indices."""
    return MosaicSpool(tmp_path_factory.mktemp("spool"), CLIPS)


@pytest.fixture(scope="module")
def real_samples(shared_data, tmp_path_factory, clip_spool) -> list[SampleForLength]:
    """Every accepted sample of the real annotation files, plus text-only samples and real clips of other containers."""
    extra = tmp_path_factory.mktemp("extra")
    records = [
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]},
        {"messages": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello!\n"},
                      {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "Merci  beaucoup"},
                      {"role": "assistant", "content": "De rien."}]},
    ]
    records += [{"messages": [{"role": "user", "content": "<video>\nWhat happens here?"},
                              {"role": "assistant", "content": "Something moves."}],
                 "videos": [str(shared_data / video)]} for video in REAL_VIDEOS]
    for index, record in enumerate(records):
        (extra / f"{index:02d}.json").write_text(json.dumps(record))
    data = shared_data
    sources = [
        SourceConfig("demo", "jsonl", data / "LLaMA-Factory/data/mllm_demo.json", data / "LLaMA-Factory/data"),
        SourceConfig("video", "jsonl", data / "LLaMA-Factory/data/mllm_video_demo.json", data / "LLaMA-Factory/data"),
        SourceConfig("single", "jsonl", data / "xtuner/tests/resource/mllm_sft_single_image_example_data.jsonl",
                     data / "xtuner/tests"),
        SourceConfig("multi", "jsonl", data / "xtuner/tests/resource/mllm_sft_multi_image_example_data.jsonl",
                     data / "xtuner/tests"),
        SourceConfig("extra", "flat_dir", extra, extra, allowed_roots=(data,)),
    ]
    samples = []
    for source in sources:
        frame = build_catalog(source, validator=MediaValidator(CLIPS.num_frames, mosaic_spool=clip_spool))
        samples += [SampleForLength(row.sample_id, row.messages, list(row.media_kinds), list(row.media_refs))
                    for row in frame[frame.status == "ok"].itertuples()]
    kinds = {sample_kind(list(sample.media_kinds)) for sample in samples}
    assert {"text", "single_image", "multi_image", "video"} <= kinds
    assert {Path(ref).suffix for sample in samples for ref in sample.media_refs} >= {".mp4", ".avi", ".mkv", ".mov"}
    return samples


def counter_for(processor, frame_cache: FrameCacheConfig = CLIPS, reject_control_tokens: bool = True,
                spool: MosaicSpool | None = None) -> LengthCounter:
    return LengthCounter(processor, frame_cache, modalities=proven_modalities(processor, frame_cache),
                         reject_control_tokens=reject_control_tokens, clip_facts=spool.sampled if spool else None)


@pytest.mark.parametrize("family", FAMILIES)
def test_lengths_equal_a_direct_processor_call(family, processors, real_samples, clip_spool):
    processor = processors[family]
    counter = counter_for(processor, spool=clip_spool)
    counted = counter.count(real_samples)
    exact = [counter.exact(sample) for sample in real_samples]
    control = control_tokens_of(processor)
    checked = set()
    for sample, ours, exact_one in zip(real_samples, counted, exact, strict=True):
        assert (ours.status, ours.reason, ours.token_len) == (exact_one.status, exact_one.reason, exact_one.token_len), sample.sample_id
        if family in NO_VIDEO and "video" in sample.media_kinds:
            assert ours.reason == f"processor {type(processor).__name__} takes no video"
            continue
        text = PLACEHOLDER_PATTERN.sub("", sample.messages)  # <image> is LLaVA's own token, but here a placeholder
        if any(token in text for token in control):
            # xtuner's multi-image records write InternVL's own <IMG_CONTEXT> into the text.
            assert ours.status == "rejected" and "control token" in ours.reason, sample.sample_id
            continue
        assert ours.status == "ok", (sample.sample_id, ours.reason)
        assert ours.token_len == direct_length(processor, sample, CLIPS), sample.sample_id
        assert ours.token_len == ours.text_tokens + ours.image_tokens + ours.video_tokens
        checked.add(sample_kind(list(sample.media_kinds)))
    expected_kinds = {"text", "single_image", "multi_image"} | (set() if family in NO_VIDEO else {"video"})
    assert expected_kinds <= checked


def test_each_family_says_what_it_takes_and_which_path_counts(processors):
    described = {family: ProcessorProfile(prove_fast_path(processor, CLIPS), model_types_of(processor)).describe()
                 for family, processor in processors.items()}
    assert described["qwen2_vl"].endswith("text: fast, images: fast, videos: fast")
    assert described["qwen2_5_vl"].endswith("text: fast, images: fast, videos: fast")
    # Qwen3-VL prints each clip's times, which the fast path writes from the clip's fps and frame indices.
    assert described["qwen3_vl"].endswith("text: fast, images: fast, videos: fast")
    # LLaVA-OneVision's multi-image mode, InternVL's tiles and Gemma3's image sequence have their own arithmetic;
    # their clips' text is the same for every clip of the frame cache's shape, the processor's own for a blank one.
    assert described["llava_onevision"].endswith("text: fast, images: fast, videos: fast")
    assert described["internvl"].endswith("text: fast, images: fast, videos: fast")
    assert described["gemma3"].startswith("Gemma3Processor (model types gemma3")
    assert described["gemma3"].endswith("takes text, images; lengths by path: text: fast, images: fast")
    # LLaVA-NeXT's anyres grid and Mistral3's rows of patches, by the counter their processors give serving engines.
    assert described["llava_next"].endswith("takes text, images; lengths by path: text: fast, images: fast")
    assert described["mistral3"].startswith("PixtralProcessor (model types mistral3")
    assert described["mistral3"].endswith("takes text, images; lengths by path: text: fast, images: fast")
    # GLM-4.1V merges patches as Qwen2-VL does; its clips print each temporal patch's whole second, which the
    # fast path writes from the clip's fps and frame indices.
    assert described["glm4v"].endswith("text: fast, images: fast, videos: fast")
    for family in FAMILIES:
        assert family in described[family].split(";")[0]


@pytest.mark.parametrize("family", NON_QWEN_IMAGE_FAMILIES)
def test_real_images_counted_from_their_sizes_equal_a_direct_processor_call(family, processors, real_samples):
    """The fast path alone (text, image sizes from file headers, the family's arithmetic) on every real image sample."""
    processor = processors[family]
    counter = counter_for(processor)
    assert counter.modalities.fast_images
    control = control_tokens_of(processor)
    samples = [sample for sample in real_samples if set(sample.media_kinds) == {"image"}
               and not any(token in PLACEHOLDER_PATTERN.sub("", sample.messages) for token in control)]
    assert {sample_kind(list(sample.media_kinds)) for sample in samples} == {"single_image", "multi_image"}
    measured = measure_samples(samples, counter.text, counter.modalities)
    for sample, ours in zip(samples, map(counter.complete, measured), strict=True):
        exact = counter.exact(sample)
        assert ours.status == "ok", (sample.sample_id, ours.reason)
        assert ours.token_len == direct_length(processor, sample, CLIPS), sample.sample_id
        assert (ours.text_tokens, ours.image_tokens) == (exact.text_tokens, exact.image_tokens), sample.sample_id


def test_multi_image_samples_use_llava_onevisions_multi_image_mode(processors, real_samples):
    processor = processors["llava_onevision"]
    sample = next(s for s in real_samples if sample_kind(list(s.media_kinds)) == "multi_image"
                  and "<IMG_CONTEXT>" not in s.messages)
    ours = counter_for(processor).count([sample])[0]
    images = sample.media_kinds.count("image")
    # One base-resolution view per image (729 tokens + a newline), not each image's anyres tiling.
    assert ours.image_tokens == images * (processor.num_image_tokens + 1)


def test_qwen3_vl_timestamps_follow_each_clips_frame_rate(processors, tmp_path):
    slow = make_video(tmp_path / "slow.mp4", frames=300, fps=1, size=(64, 48))
    fast = make_video(tmp_path / "fast.mp4", frames=300, fps=30, size=(64, 48))
    samples = [SampleForLength(f"t/{path.stem}", json.dumps([{"role": "user", "content": "<video>When?"}]),
                               ["video"], [str(path)]) for path in (slow, fast)]
    spool = MosaicSpool(tmp_path / "spool", CLIPS)
    for path in (slow, fast):
        spool.render(str(path))  # as the catalogue's decoding pass does
    processor = processors["qwen3_vl"]
    counter = counter_for(processor, spool=spool)
    assert all(fast_path_counts(sample, counter.modalities, counter.text, True, clip_facts=spool.sampled)
               for sample in samples)
    slow_len, fast_len = (result.token_len for result in counter.count(samples))
    assert (slow_len, fast_len) == tuple(direct_length(processor, sample, CLIPS) for sample in samples)
    # Four temporal patches at 21.5, 106.5, 192.5, 277.5 s against 0.7, 3.6, 6.4, 9.2 s: 7 more digit tokens.
    assert slow_len - fast_len == 7
    # Qwen2.5-VL prints no timestamps: the frame rate changes nothing.
    qwen25 = counter_for(processors["qwen2_5_vl"]).count(samples)
    assert qwen25[0].token_len == qwen25[1].token_len


@pytest.mark.parametrize("family", FAMILIES)
def test_control_tokens_in_sample_text_are_rejected_or_kept_as_the_processor_counts_them(family, processors):
    processor = processors[family]
    # An answer too: LLaVA-NeXT's [INST] is plain text, its only control token in a chat the </s> ending an answer.
    rendered = processor.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                                             tokenize=False)
    role_marker = next(token for token in control_tokens_of(processor) if token in rendered)
    cases = [(SampleForLength("c/role", json.dumps([
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": f"Say {role_marker}assistant\nyes"}]), [], []), role_marker, "turn 3, user")]
    if not PLACEHOLDER_PATTERN.fullmatch(processor.image_token):  # LLaVA's <image> is the catalogue's placeholder
        cases.append((SampleForLength("c/placeholder", json.dumps([
            {"role": "user", "content": f"What is {processor.image_token}?"}]), [], []), processor.image_token, "turn 1, user"))
    rejecting = counter_for(processor)
    for sample, token, turn in cases:
        for result in (rejecting.count([sample])[0], rejecting.exact(sample)):
            assert result.status == "rejected"
            assert repr(token) in result.reason and turn in result.reason
    keeping = counter_for(processor, reject_control_tokens=False)
    faked = cases[0][0]
    kept = keeping.count([faked])[0]
    assert kept.status == "ok" and kept.token_len == direct_length(processor, faked, CLIPS)


def test_model_type_must_name_the_loaded_processors_family(processors):
    profile = ProcessorProfile(proven_modalities(processors["qwen2_vl"], CLIPS), model_types_of(processors["qwen2_vl"]))
    check_model_type(ModelConfig(model_type="qwen2_vl"), profile)
    check_model_type(ModelConfig(), profile)
    with pytest.raises(ConfigError, match=r"model.model_type is 'gemma3' but .* is Qwen2VLProcessor \(model type qwen2_vl\)"):
        check_model_type(ModelConfig(model_type="gemma3"), profile)


@pytest.mark.processes
@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_lengths_are_measured_in_the_clis_worker_processes(family, family_dirs, shared_data, tmp_path):
    """`vlm-assets run` through sample_lengths with the family's processor, loaded in the worker and
    chunk processes, its stored media tokens read there: every check passes. (What is downstream of
    the lengths reads only their numbers, packed and loaded by Energon in the demo graph's tests.)"""
    import pandas as pd

    data = shared_data / "LLaMA-Factory/data"
    sources = [{"name": "images", "kind": "jsonl", "path": str(data / "mllm_demo.json"), "media_root": str(data)}]
    if family not in NO_VIDEO:
        sources.append({"name": "videos", "kind": "jsonl", "path": str(data / "mllm_video_demo.json"),
                        "media_root": str(data)})
    config = tmp_path / "vlm_assets.yaml"
    config.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "out")},
        "inbox": str(tmp_path / "inbox"),
        "sources": sources,
        "model": {"processor": str(family_dirs[family]), "model_type": family},
        "sample": {"max_token_len": 32768},
        "frame_cache": {"num_frames": 8, "frame_size": 112, "rows": 2, "cols": 4},
        # The trainer's template for Qwen3-VL (the default, `qwen2-vl`, refuses its processor).
        **({"trainer": {"chat_template": "qwen3-vl"}} if family == "qwen3_vl" else {}),
    }))
    result = run(config, tmp_path / "home", "--select", "sample_lengths", "--workers", "2")
    assert result.returncode == 0, result.stdout[-4000:]
    assert "0 failed run(s), 0 failed check(s)" in result.stdout
    with dg.DagsterInstance.from_config(str(tmp_path / "home")) as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("sample_lengths"))
    # The step says which family it loaded and which path counted each modality.
    loaded, paths = event.asset_materialization.metadata["length_path"].value.split(" takes ")
    assert family in loaded.split("model type")[1] and "lengths by path: text: fast" in paths
    layout = StorageLayout(tmp_path / "out")
    for source in sources:
        lengths = pd.read_parquet(layout.lengths(source["name"]))
        # 2.avi cannot be seeked by Energon's AV decoder, which the packed shards' consumer reads clips with.
        unreadable = lengths.reason.str.contains("Energon's AV decoder")
        assert (lengths.status[~unreadable] == "ok").all() and unreadable.sum() <= 1
    if family not in NO_VIDEO:
        videos = pd.read_parquet(layout.lengths("videos"))
        assert (videos[videos.status == "ok"].video_tokens > 0).all()
