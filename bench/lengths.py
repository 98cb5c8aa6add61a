"""Token-length throughput per model family: our LengthCounter vs calling the processor directly, as a trainer does.

    .venv/bin/python bench/lengths.py [--families qwen2_vl,gemma3] [--images 300] [--multi 100] [--videos 12]
                                      [--repeats 3] [--direct-repeats 1] [--generated N] [--consumer-videos 48]

Processors: the nine families of vlm_assets_tests/processor_families.py (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
LLaVA-OneVision, InternVL, Gemma3, LLaVA-NeXT, Mistral3, GLM-4.1V), built offline once per run in a temp dir.
Frame-cache shape: the product default FrameCacheConfig() (64 frames at 384²).

Samples, catalogued by vlm_assets_tests.catalog_support.build_catalog from flat_dir JSON records, one workload
each (with a mosaic spool, as the pipeline's catalogue: its decoding pass keeps each clip's frame count, fps
and sampled indices, which ours counts Qwen3-VL's clip times from; the catalogue is not timed, on either side):
  image        one image per sample
  multi_image  2-4 images per sample (all in the first turn, or spread over the turns)
  video        one video per sample, `<video>` in the text (skipped for a family whose processor takes no video)
with text around the media (words, some CJK), ~30% multi-turn, ~10% with a system turn. Images: the real ones
of ../shared/data plus generated ones of many sizes, aspect ratios (panoramas, tall strips), formats and modes
(JPEG, PNG incl. RGBA and grayscale, WEBP; some JPEGs with an EXIF rotation). Videos: the real clips of
../shared/data in mp4, avi, mkv and mov (a clip the catalogue rejects is listed and left out).

For each family and workload, in one run and side by side:
  ours    LengthCounter(processor, FrameCacheConfig(), modalities=prove_fast_path(...),
          clip_facts=spool.sampled).count(samples): the fast path where the family's probes proved it for the
          workload's modalities, the exact path otherwise
  direct  a plain per-sample loop written here: apply_chat_template(tokenize=False), images by
          transformers' load_image passed as one group, each video as the frame cache's 64 frames at 384²
          (decode_sampled_frames) with do_sample_frames=False and its VideoMetadata, return_tensors="pt";
          length = len(input_ids[0])
Every measurement runs in its own spawned process (clean peak RSS; the processor is loaded and one sample
counted there before timing, neither timed). Throughput is samples/s of that one process, the median of
--repeats passes for ours where the fast path counts the whole workload, and of one pass (--direct-repeats)
for direct and for workloads ours counts by the exact path (those cost what direct costs). Every count is
checked: status ok on both sides and the same token length; the first differing samples are printed.

The consumer's default path (--consumer-videos, Qwen-VL families only): video children of packed_chat_mix
under each of LoongForge's templates with its family's processor (qwen2-vl: Qwen2-VL and Qwen2.5-VL; qwen3-vl
and qwen3-vl-hf: Qwen3-VL; qwen2.5-vl-hf: Qwen2.5-VL), trainer media settings at their defaults:
  ours    LengthCounter(..., rule=CountingRule("packed_chat_mix", TrainerConfig(chat_template=...))).count:
          each clip by its shape, from the view of it the catalogue recorded (media_views), where proven
  loop    the consumer's own path written out plainly here (consumer_loop_length): Energon's decoder,
          frames sampled and resized, the template's media plugin, the processor
Video children per CPU-second of each, their ratio, ours' CPU against the catalogue's for the same source
(its one decoding pass, with the mosaic spool), and equal counts (children both sides refuse, a clip
Energon's decoder cannot seek, are counted apart).

Two summaries close the run:
  images per core   the image workload from raw file to length on the fast path (header reads, EXIF
                    orientation, template, tokenisation and the image-token arithmetic, all timed): samples
                    per CPU-second of the counting process (target >= 1000)
  peak memory       each family's counting process at its largest (the max RSS of ours over the workloads),
                    against Qwen2-VL's (target within 1.2x)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue as queue_module
import random
import resource
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
from PIL import Image

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
BROKEN_IMAGES = ("truncated_jpeg.jpg", "broken.png")
REAL_VIDEOS = (
    "LLaMA-Factory/data/mllm_demo_data/1.mp4", "LLaMA-Factory/data/mllm_demo_data/2.avi",
    "LLaMA-Factory/data/mllm_demo_data/3.mp4", "LLaMA-Factory/data/mllm_demo_data/4.mp4",
    "decord/examples/flipping_a_pancake.mkv", "decord/tests/test_data/video_90.mov",
    "torchcodec/test/resources/nasa_13013.mp4", "mmaction2/demo/demo.mp4",
)
WORKLOADS = ("image", "multi_image", "video")
WORKLOAD_KINDS = {"image": ["image"], "multi_image": ["image", "image"], "video": ["video"]}
WORDS = ("the a cat dog photo shows several objects in bright light near water trees what where why how "
         "is are there left right 图片 中 的 狗 视频 里").split()
EXIF_ORIENTATION_TAG = 0x0112
SHOW_DIFFERENCES = 5
IMAGES_PER_CORE_TARGET = 1000
PEAK_RSS_TARGET = 1.2  # a family's counting process against Qwen2-VL's
REFERENCE_FAMILY = "qwen2_vl"


# ---- data ---------------------------------------------------------------------------------------
def real_images() -> list[str]:
    if not SHARED.is_dir():
        return []
    return sorted(str(p) for p in SHARED.rglob("*")
                  if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp") and p.name not in BROKEN_IMAGES)


def generate_images(directory: Path, count: int) -> list[str]:
    """Images of many sizes (64-2048 px a side, panoramas and tall strips), formats and modes."""
    rng = random.Random(0)
    directory.mkdir(parents=True)
    paths = []
    for index in range(count):
        width, height = rng.randint(64, 2048), rng.randint(64, 2048)
        if index % 10 == 0:
            height = max(32, width // rng.randint(3, 8))  # panorama
        elif index % 10 == 5:
            width = max(32, height // rng.randint(3, 8))  # tall strip
        array = np.random.default_rng(index).integers(0, 255, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
        image = Image.fromarray(array).resize((width, height))
        kind = index % 6
        if kind in (0, 3):
            path = directory / f"g{index:04d}.jpg"
            exif = Image.Exif()
            if index % 12 == 3:  # rotated by EXIF: the header says width x height, the trainer sees height x width
                exif[EXIF_ORIENTATION_TAG] = 6
            image.save(path, "JPEG", quality=85, exif=exif)
        elif kind == 1:
            path = directory / f"g{index:04d}.png"
            image.save(path, "PNG")
        elif kind == 4:
            path = directory / f"g{index:04d}.png"
            (image.convert("RGBA") if index % 12 == 4 else image.convert("L")).save(path, "PNG")
        else:
            path = directory / f"g{index:04d}.webp"
            image.save(path, "WEBP", quality=80)
        paths.append(str(path))
    return paths


def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _place(rng: random.Random, placeholders: str, text: str) -> str:
    where = rng.random()
    if where < 0.5:
        return f"{placeholders}\n{text}"
    if where < 0.8:
        return f"{text}\n{placeholders}"
    words = text.split(" ")
    cut = rng.randint(0, len(words))
    return " ".join(words[:cut]) + f" {placeholders} " + " ".join(words[cut:])


def make_records(workload: str, count: int, images: list[str], videos: list[str], seed: int) -> list[dict]:
    rng = random.Random(seed)
    records = []
    video_order = []
    for index in range(count):
        n_turns = 1 if rng.random() < 0.7 else rng.randint(2, 4)
        questions = [_text(rng, 3, 30) for _ in range(n_turns)]
        answers = [_text(rng, 5, 200) for _ in range(n_turns)]
        record: dict = {}
        if workload == "video":
            if not video_order:
                video_order = list(videos)
                rng.shuffle(video_order)
            record["videos"] = [video_order.pop()]
            questions[0] = _place(rng, "<video>", questions[0])
        else:
            n_media = 1 if workload == "image" else rng.randint(2, 4)
            record["images"] = [rng.choice(images) for _ in range(n_media)]
            if n_turns == 1 or rng.random() < 0.6:
                questions[0] = _place(rng, "".join("<image>" for _ in range(n_media)), questions[0])
            else:  # spread over the turns, in order
                turns = sorted(rng.randrange(n_turns) for _ in range(n_media))
                for turn in sorted(set(turns)):
                    questions[turn] = _place(rng, "<image>" * turns.count(turn), questions[turn])
        messages = [{"role": "system", "content": _text(rng, 3, 12)}] if rng.random() < 0.1 else []
        for question, answer in zip(questions, answers):
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        record["messages"] = messages
        records.append(record)
    return records


def catalogue(root: Path, workload: str, records: list[dict]) -> tuple[list[tuple], list[tuple[str, str]]]:
    """The records as catalogued samples (sample_id, messages, kinds, refs), and the rejected (id, reason);
    the videos' facts kept in the mosaic spool at `spool_dir(root)`."""
    from vlm_assets.catalog.build import MediaValidator
    from vlm_assets.config import FrameCacheConfig, SourceConfig
    from vlm_assets.frames.spool import MosaicSpool
    from vlm_assets_tests.catalog_support import build_catalog

    directory = root / workload
    directory.mkdir()
    for index, record in enumerate(records):
        (directory / f"{index:05d}.json").write_text(json.dumps(record, ensure_ascii=False), encoding="utf-8")
    validator = MediaValidator(mosaic_spool=MosaicSpool(spool_dir(root), FrameCacheConfig()))
    frame = build_catalog(SourceConfig(workload, "flat_dir", directory, directory, allowed_roots=(root, SHARED)),
                          validator=validator)
    ok = frame[frame.status == "ok"]
    samples = [(r.sample_id, r.messages, list(r.media_kinds), list(r.media_refs), list(r.media_views))
               for r in ok.itertuples()]
    rejected = [(r.sample_id, r.reason) for r in frame[frame.status != "ok"].itertuples()]
    return samples, rejected


def spool_dir(root: Path) -> Path:
    return root / "mosaic-spool"


# ---- measurements (each in its own spawned process) ---------------------------------------------
def _load(directory: str):
    from transformers.utils import logging

    from vlm_assets.config import ModelConfig
    from vlm_assets.tokens.processor import load_processor

    logging.set_verbosity_error()  # "sequence length is longer than the specified maximum": lengths are what we measure
    # A real palette PNG with transparency bytes: Pillow warns on every RGB conversion (load_image's, on both sides).
    warnings.filterwarnings("ignore", message="Palette images with Transparency", category=UserWarning)
    return load_processor(ModelConfig(processor=directory))


def profile_family(directory: str, results: mp.Queue) -> None:
    from vlm_assets.config import FrameCacheConfig
    from vlm_assets.tokens.profile import ProcessorProfile, model_types_of, prove_fast_path

    start = time.perf_counter()
    processor = _load(directory)
    loaded = time.perf_counter()
    modalities = prove_fast_path(processor, FrameCacheConfig())
    proven = time.perf_counter()
    results.put({"modalities": asdict(modalities), "load_s": loaded - start, "prove_s": proven - loaded,
                 "describe": ProcessorProfile(modalities, model_types_of(processor)).describe()})


def direct_length(processor, sample) -> tuple[str, str, int, str]:
    """The processor called directly per sample, as a trainer calls it (the tests' baseline too)."""
    from vlm_assets.config import FrameCacheConfig
    from vlm_assets.tokens.lengths import SampleForLength
    from vlm_assets_tests.processor_families import direct_length as direct_call

    sample_id = sample[0]
    try:
        length = direct_call(processor, SampleForLength(*sample), FrameCacheConfig())
    except Exception as error:
        return sample_id, "error", 0, f"{type(error).__name__}: {error}"
    return sample_id, "ok", length, ""


def measure(directory: str, method: str, samples: list[tuple], modalities: dict, spool: str, repeats: int,
            results: mp.Queue) -> None:
    from vlm_assets.config import FrameCacheConfig
    from vlm_assets.frames.spool import MosaicSpool
    from vlm_assets.tokens.lengths import LengthCounter, Modalities, SampleForLength

    processor = _load(directory)
    frame_cache = FrameCacheConfig()
    proven = Modalities(**modalities)
    if method == "ours":
        objects = [SampleForLength(*sample) for sample in samples]
        clip_facts = MosaicSpool(Path(spool), frame_cache).sampled

        def one_pass(batch):
            counter = LengthCounter(processor, frame_cache, modalities=proven, clip_facts=clip_facts)
            if proven.fast_videos:
                counter.video_tokens_per_clip  # as the product's length_counter: computed once, before counting
            return [(r.sample_id, r.status, r.token_len, r.reason) for r in counter.count(batch)]
    else:
        objects = samples

        def one_pass(batch):
            return [direct_length(processor, sample) for sample in batch]

    one_pass(objects[:1])  # warm-up (lazy imports, first tokeniser and processor calls), not timed
    base_rss = peak_rss_kb()
    timed = timed_passes(one_pass, objects, repeats)
    results.put({**timed, "peak_rss_mb": peak_rss_kb() / 1024, "base_rss_mb": base_rss / 1024})


def timed_passes(one_pass, objects: list, repeats: int) -> dict:
    """`repeats` passes of `one_pass(objects)`: each one's wall and CPU seconds, and the last one's lengths."""
    times, cpu, lengths = [], [], []
    for _ in range(repeats):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        lengths = one_pass(objects)
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu.append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
    return {"times": times, "cpu": cpu, "lengths": lengths}


# ---- the consumer's default video path ------------------------------------------------------------
# LoongForge's templates for the Qwen-VL families, each with a processor of its family.
CONSUMER_PAIRS = (("qwen2-vl", "qwen2_vl"), ("qwen2-vl", "qwen2_5_vl"), ("qwen3-vl", "qwen3_vl"),
                  ("qwen2.5-vl-hf", "qwen2_5_vl"), ("qwen3-vl-hf", "qwen3_vl"))


def consumer_loop_length(processor, rule, text: str, video: str) -> int:
    """A video child's length by the consumer's own path, written out plainly: Energon's decoder counts the
    clip's frames and rate; `fps` frames a second are sampled (within fps_min/max_frames and the clip, in
    pairs), read by index and resized bicubically within the frame budget; then the template's media plugin:
    Qwen2-VL's hands them to the processor with the text; Qwen3-VL's hands them to the video processor as
    a clip of 24 frames a second and writes each temporal patch's time and tokens into the text, which the
    tokenizer encodes. `text`: the child rendered by the template, its clip as Qwen-VL's vision markup."""
    import io
    import math

    import torch
    from megatron.energon.av import AVDecoder
    from transformers.video_utils import VideoMetadata

    from vlm_assets.tokens.consumer import smart_resize

    trainer = rule.trainer
    decoder = AVDecoder(io.BytesIO(Path(video).read_bytes()))
    _duration, total = decoder.get_video_duration(get_frame_count=True)
    wanted = total / decoder.get_video_fps() * trainer.fps
    low, high = math.ceil(trainer.fps_min_frames / 2) * 2, math.floor(trainer.fps_max_frames / 2) * 2
    count = math.floor(min(max(wanted, low), high, total) / 2) * 2
    indices = torch.linspace(0, total - 1, count).round().long().tolist()
    clips = decoder.get_clips(video_clip_ranges=[(index, index + 1) for index in indices], video_unit="frames")
    frames = torch.stack([clip[0] for clip in clips.video_clips]).float()
    height, width = smart_resize(frames.shape[2], frames.shape[3], 28, int(trainer.frame_min_pixels * 1.05),
                                 min(trainer.frame_max_pixels, trainer.video_max_pixels / count * 2))
    frames = torch.nn.functional.interpolate(frames, size=(height, width), mode="bicubic", align_corners=False)
    if not rule.consumer_template.qwen3_plugin:
        return len(processor(text=[text], videos=[frames], do_sample_frames=False)["input_ids"][0])
    video_processor = processor.video_processor
    out = video_processor(videos=[frames], video_metadata=[VideoMetadata(total_num_frames=len(frames), fps=24.0)],
                          return_metadata=True)
    grid, kept = out["video_grid_thw"][0], list(out["video_metadata"][0].frames_indices)
    kept += kept[-1:] * (len(kept) % 2)
    patch = "<|vision_start|>" + "<|video_pad|>" * (int(grid[1] * grid[2]) // video_processor.merge_size ** 2) \
        + "<|vision_end|>"
    clip_text = "".join(f"<{(kept[i] / 24 + kept[i + 1] / 24) / 2:.1f} seconds>{patch}" for i in range(0, len(kept), 2))
    return len(processor.tokenizer(text.replace("<|vision_start|><|video_pad|><|vision_end|>", clip_text, 1))["input_ids"])


def measure_consumer(directory: str, template: str, method: str, samples: list[tuple], modalities: dict,
                     repeats: int, results: mp.Queue) -> None:
    """Video children of packed_chat_mix under `template`: ours (LengthCounter.count, clips by their shape
    from the catalogue's views where the probes proved it) or the consumer's loop."""
    from vlm_assets.config import FrameCacheConfig, TrainerConfig
    from vlm_assets.tokens.consumer import CountingRule
    from vlm_assets.tokens.lengths import LengthCounter, Modalities, SampleForLength

    processor = _load(directory)
    # Energon warns, reading an MKV by frame index, that it seeks by time: the consumer reads it so too.
    warnings.filterwarnings("ignore", message="Video container unit is frames", category=RuntimeWarning)
    rule = CountingRule("packed_chat_mix", TrainerConfig(chat_template=template))
    counter = LengthCounter(processor, FrameCacheConfig(), modalities=Modalities(**modalities), rule=rule)
    objects = [SampleForLength(*sample) for sample in samples]
    if method == "ours":
        def one_pass(batch):
            return [(r.sample_id, r.status, r.token_len, r.reason) for r in counter.count(batch)]
    else:
        def one_pass(batch):
            rows = []
            for sample in batch:
                try:
                    rows.append((sample.sample_id, "ok", consumer_loop_length(
                        processor, counter.rule, counter.render(sample.messages), sample.media_refs[0]), ""))
                except Exception as error:
                    rows.append((sample.sample_id, "error", 0, f"{type(error).__name__}: {error}"))
            return rows
    one_pass(objects[:1])  # warm-up, not timed
    results.put(timed_passes(one_pass, objects, repeats))


def consumer_section(root: Path, families: list[str], directories: dict[str, str], count: int, videos: list[str],
                     repeats: int) -> bool:
    """The default consumer path's video children per CPU-second, ours against the consumer's loop, per
    template and family, side by side; and ours' lengths against the catalogue's cost of the same source."""
    records = make_records("video", count, [], videos, seed=7)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    samples, rejected = catalogue(root, "consumer_video", records)
    after = resource.getrusage(resource.RUSAGE_SELF)
    catalogue_cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
    print(f"consumer path (packed_chat_mix video children, the trainer's default media settings): {len(samples)} "
          f"samples of {len(videos)} real clips, catalogued in {catalogue_cpu:.1f} CPU-s (its one decoding pass, "
          f"the mosaic spool rendered; {len(rejected)} rejected)")
    print(f"  {'template':<15}{'family':<12}{'ours/cpu-s':>11}{'loop/cpu-s':>11}{'ours/loop':>10}"
          f"{'lengths/catalogue':>19}{'equal':>9}{'both refuse':>13}")
    all_equal = True
    for template, family in CONSUMER_PAIRS:
        if family not in families:
            continue
        profile = in_process(profile_family, directories[family])
        ours = in_process(measure_consumer, directories[family], template, "ours", samples, profile["modalities"],
                          repeats)
        loop = in_process(measure_consumer, directories[family], template, "loop", samples, profile["modalities"], 1)
        equal, refused, differences = 0, 0, []
        for mine, theirs in zip(ours["lengths"], loop["lengths"], strict=True):
            if mine[1] == theirs[1] == "ok" and mine[2] == theirs[2]:
                equal += 1
            elif mine[1] != "ok" and theirs[1] != "ok":
                refused += 1
            else:
                differences.append(f"{mine[0]}: ours {mine[2] or mine[3]}, loop {theirs[2] or theirs[3]}")
        all_equal &= not differences
        n = len(samples)
        ours_cpu, loop_cpu = statistics.median(ours["cpu"]), statistics.median(loop["cpu"])
        print(f"  {template:<15}{family:<12}{n / ours_cpu:>11.1f}{n / loop_cpu:>11.1f}{loop_cpu / ours_cpu:>9.0f}x"
              f"{ours_cpu / catalogue_cpu:>18.2f}x{f'{equal}/{n - refused}':>9}{refused:>13}")
        for line in differences[:SHOW_DIFFERENCES]:
            print(f"    DIFFERS {line}")
    return all_equal


def peak_rss_kb() -> int:
    """This process's own peak resident memory: VmHWM of its address space. ru_maxrss would not do: Linux
    carries it over exec, so a spawned process starts at its parent's resident size when forked."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def in_process(target, *args) -> dict:
    """Run `target(*args, queue)` in a fresh spawned process and return what it puts."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=target, args=(*args, results))
    process.start()
    while True:
        try:
            result = results.get(timeout=1.0)
            break
        except queue_module.Empty:
            if not process.is_alive():
                raise RuntimeError(f"{target.__name__} process exited with code {process.exitcode} and no result")
    process.join()
    return result


# ---- report -------------------------------------------------------------------------------------
def compare(ours: list[tuple], direct: list[tuple]) -> tuple[int, list[str]]:
    equal, differences = 0, []
    direct_by_id = {row[0]: row for row in direct}
    for sample_id, status, token_len, reason in ours:
        _id, direct_status, direct_len, direct_error = direct_by_id.get(sample_id, (sample_id, "missing", 0, ""))
        if status == "ok" and direct_status == "ok" and token_len == direct_len:
            equal += 1
        else:
            ours_text = f"{token_len}" if status == "ok" else f"{status} ({reason})"
            direct_text = f"{direct_len}" if direct_status == "ok" else f"{direct_status} ({direct_error})"
            differences.append(f"{sample_id}: ours {ours_text}, direct {direct_text}")
    return equal, differences


def rate(n: int, result: dict) -> float:
    return n / statistics.median(result["times"])


def rate_per_core(n: int, result: dict) -> float:
    """Samples per CPU-second of the measuring process (its threads included)."""
    return n / statistics.median(result["cpu"])


def summaries(images_per_core: dict[str, tuple[float, bool]], peak_rss: dict[str, float]) -> None:
    print("images from raw file to length, samples per CPU-second of ours "
          f"(target >= {IMAGES_PER_CORE_TARGET}; header reads included):")
    for family, (per_core, fast) in images_per_core.items():
        verdict = "meets" if per_core >= IMAGES_PER_CORE_TARGET else "BELOW"
        print(f"  {family:<16}{per_core:>8.0f}/s/core  {verdict}" + ("" if fast else "  (exact path)"))
    reference = peak_rss.get(REFERENCE_FAMILY)
    print(f"\npeak RSS of ours' counting process per family, max over its workloads, against {REFERENCE_FAMILY}'s "
          f"(target within {PEAK_RSS_TARGET}x):")
    for family, megabytes in peak_rss.items():
        ratio = f"{megabytes / reference:>6.2f}x  {'meets' if megabytes <= PEAK_RSS_TARGET * reference else 'ABOVE'}" \
            if reference else ""
        print(f"  {family:<16}{megabytes:>8.0f} MB  {ratio}")


def peak(result: dict) -> str:
    """Peak RSS, and how much of it came after the processor was loaded and one sample counted."""
    return f"{result['peak_rss_mb']:.0f} (+{result['peak_rss_mb'] - result['base_rss_mb']:.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="", help="comma-separated subset of the families (default: all nine)")
    parser.add_argument("--images", type=int, default=300, help="single-image samples")
    parser.add_argument("--multi", type=int, default=100, help="multi-image samples (2-4 images each)")
    parser.add_argument("--videos", type=int, default=12, help="video samples (one video each)")
    parser.add_argument("--generated", type=int, default=None,
                        help="generated images (default: images + 3 x multi, at most 300)")
    parser.add_argument("--repeats", type=int, default=3, help="passes of ours where the fast path counts it all")
    parser.add_argument("--direct-repeats", type=int, default=1, help="passes of direct (and of ours' exact path)")
    parser.add_argument("--consumer-videos", type=int, default=48,
                        help="video children for the consumer path's section (Qwen-VL families; 0 skips it)")
    args = parser.parse_args()

    from vlm_assets.tokens.lengths import Modalities
    from vlm_assets_tests.processor_families import FAMILIES, family_processor_dir

    families = [name.strip() for name in args.families.split(",") if name.strip()] or list(FAMILIES)
    unknown = [name for name in families if name not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {', '.join(unknown)}; known: {', '.join(FAMILIES)}")
    sizes = {"image": args.images, "multi_image": args.multi, "video": args.videos}
    generated = args.generated if args.generated is not None else min(300, args.images + 3 * args.multi)

    started = time.perf_counter()
    all_equal = True
    with tempfile.TemporaryDirectory(prefix="bench-lengths-") as tmp:
        root = Path(tmp)
        images = real_images() + generate_images(root / "generated", generated)
        videos = [str(SHARED / video) for video in REAL_VIDEOS if (SHARED / video).is_file()]
        workloads: dict[str, list[tuple]] = {}
        for seed, workload in enumerate(WORKLOADS):
            if sizes[workload] <= 0 or (workload == "video" and not videos) or (workload != "video" and not images):
                continue
            samples, rejected = catalogue(root, workload, make_records(workload, sizes[workload], images, videos, seed))
            workloads[workload] = samples
            by_reason: dict[str, list[str]] = {}
            for sample_id, reason in rejected:
                by_reason.setdefault(reason, []).append(sample_id)
            for reason, ids in by_reason.items():
                print(f"{workload}: the catalogue rejected {len(ids)} sample(s), e.g. {ids[0]}: {reason}; left out")
        print(f"images: {len(images) - generated} real from {SHARED} + {generated} generated; "
              f"videos: {len(videos)} real clips; frame cache: 64 frames at 384²")
        print("samples: " + ", ".join(f"{w} {len(s)}" for w, s in workloads.items())
              + "; ~30% multi-turn, ~10% with a system turn")
        print(f"passes (ours/direct): ours takes the median of {args.repeats} where the fast path counts the "
              f"whole workload, else of {args.direct_repeats} (exact path); direct the median of "
              f"{args.direct_repeats}; each measurement in its own process")
        directories = {family: str(family_processor_dir(family, root / "processors")) for family in families}
        print(f"processor directories built in {time.perf_counter() - started:.0f} s (with the data)\n")

        header = (f"  {'workload':<12}{'samples':>8}{'ours/s':>10}{'direct/s':>10}{'ours/direct':>12}"
                  f"{'ours/cpu-s':>11}{'equal':>12}{'passes':>8}{'ours MB':>14}{'direct MB':>14}{'cpu/wall':>10}")
        images_per_core: dict[str, tuple[float, bool]] = {}
        peak_rss: dict[str, float] = {}
        for family in families:
            profile = in_process(profile_family, directories[family])
            modalities = Modalities(**profile["modalities"])
            print(f"{family}: {profile['describe']}")
            print(f"  (processor loaded in {profile['load_s']:.1f} s, fast path probed in {profile['prove_s']:.1f} s;"
                  " not in the rates below;\n   MB: peak RSS (+ its growth after loading and one warm-up sample);"
                  " cpu/wall: ours/direct)")
            print(header)
            for workload, samples in workloads.items():
                refusal = modalities.refusal(WORKLOAD_KINDS[workload])
                if refusal:
                    print(f"  {workload:<12}{'':>8}  skipped: {refusal}")
                    continue
                fast = modalities.counts_fast(WORKLOAD_KINDS[workload])
                repeats = args.repeats if fast else args.direct_repeats
                spool = str(spool_dir(root))
                ours = in_process(measure, directories[family], "ours", samples, profile["modalities"], spool, repeats)
                direct = in_process(measure, directories[family], "direct", samples, profile["modalities"], spool,
                                    args.direct_repeats)
                n = len(samples)
                equal, differences = compare(ours["lengths"], direct["lengths"])
                all_equal &= equal == n
                ours_rate, direct_rate = rate(n, ours), rate(n, direct)
                usage = "/".join(f"{statistics.median(r['cpu']) / statistics.median(r['times']):.1f}"
                                 for r in (ours, direct))
                path = "fast" if fast else "exact"
                passes = f"{len(ours['times'])}/{len(direct['times'])}"
                per_core = rate_per_core(n, ours)
                if workload == "image":
                    images_per_core[family] = (per_core, fast)
                peak_rss[family] = max(peak_rss.get(family, 0.0), ours["peak_rss_mb"])
                print(f"  {workload:<12}{n:>8}{ours_rate:>10.1f}{direct_rate:>10.1f}{ours_rate / direct_rate:>11.1f}x"
                      f"{per_core:>11.0f}{f'{equal}/{n}':>12}{passes:>8}"
                      f"{peak(ours):>14}{peak(direct):>14}{usage:>10}  ({path} path)")
                for line in differences[:SHOW_DIFFERENCES]:
                    print(f"    DIFFERS {line}")
                if len(differences) > SHOW_DIFFERENCES:
                    print(f"    ... and {len(differences) - SHOW_DIFFERENCES} more")
            print()
        summaries(images_per_core, peak_rss)
        if args.consumer_videos > 0 and videos:
            print()
            all_equal &= consumer_section(root, families, directories, args.consumer_videos, videos, args.repeats)
    print(f"\nall counts equal: {'yes' if all_equal else 'NO'}; wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
