"""Which path counts a processor's lengths, proven when the processor loads.

A processor's family decides what it takes (Gemma3 takes no video) and whether the fast path's
arithmetic holds for it (Qwen3-VL prints per-clip timestamps, LLaVA-OneVision switches to a
multi-image mode, InternVL tiles images, Gemma3 pans and scans when told to). Rather than trusting
a list of families, the fast path is put to the test on probe samples, modality by modality,
against the exact path; a modality whose probes differ is counted by the exact path. The outcome
is kept on disk per processor and frame-cache shape, so the chunk processes of later steps know it
without loading the processor.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from vlm_assets.atomic import atomic_write_text
from vlm_assets.config import ConfigError, FrameCacheConfig, ModelConfig
from vlm_assets.media.video_probe import SampledFrames, sample_indices
from vlm_assets.tokens.consumer import (
    CLIP_MARKUP,
    ClipShape,
    CountingRule,
    clip_video_pads,
    qwen3_plugin_clip_text,
    qwen3_plugin_clip_text_for_shape,
)
from vlm_assets.tokens.lengths import (
    LengthCounter,
    LengthResult,
    MeasuredSample,
    Modalities,
    SampleForLength,
    clip_video_tokens,
    completed_length,
    measure_samples,
    modalities_of,
    supports_fast_images,
    supports_fast_videos,
    video_metadata,
)
from vlm_assets.tokens.image_tokens import ImageExpansion, image_expansion
from vlm_assets.tokens.processor import RECENT_WRITE_NS, default_cache_dir, processor_fingerprint, shared_processor
from vlm_assets.tokens.text import store_text_spec, stored_text_spec, text_spec_of
from vlm_assets.tokens.video_tokens import VideoExpansion, video_expansion

PROFILE_VERSION = 6

# Probe conversations in the catalogue's form (<image>/<video> placeholders), chosen to put media
# next to text, newlines and each other, in first and later turns.
TEXT_PROBES = (
    [{"role": "user", "content": "Hello there.\nHow are you?"}, {"role": "assistant", "content": "Fine,  thanks!\n\n"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"},
     {"role": "assistant", "content": "A."}, {"role": "user", "content": "ünïcödé 漢字 🙂\tand\ttabs"},
     {"role": "assistant", "content": ""}],
)
# Each size alone (a family may count a sample's several images apart) and in groups of two and three.
IMAGE_PROBES = (
    ([{"role": "user", "content": "<image>\nDescribe."}, {"role": "assistant", "content": "A shape."}], ("a",)),
    ([{"role": "user", "content": "Look: <image>"}, {"role": "assistant", "content": "Grey."}], ("b",)),
    ([{"role": "user", "content": "What is this?\n\n<image>"}, {"role": "assistant", "content": "Wide."}], ("c",)),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image> tall?"},
      {"role": "assistant", "content": "Yes."}], ("d",)),
    ([{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "Large."}], ("e",)),
    ([{"role": "user", "content": "<image><image>Compare them."}, {"role": "assistant", "content": "Alike."}], ("c", "d")),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
      {"role": "user", "content": "And\n<image>\nthis one, and <image>?"}, {"role": "assistant", "content": "Both."}],
     ("d", "a")),
    ([{"role": "user", "content": "<image>, <image>\n<image>: which?"}, {"role": "assistant", "content": "The first."}],
     ("b", "c", "b")),
)
# (height, width): below the minimum, ordinary, wide and tall, large (more tiles than a family keeps), odd sizes.
PROBE_IMAGE_SIZES = {"a": (37, 53), "b": (480, 640), "c": (333, 1999), "d": (1201, 301), "e": (1501, 1703)}
VIDEO_PROBES = (
    ([{"role": "user", "content": "<video>What happens?"}, {"role": "assistant", "content": "A ball bounces."}],
     ("clip-30fps",)),
    ([{"role": "user", "content": "Then:\n<video>\nand <video>"}, {"role": "assistant", "content": "Two."}],
     ("clip-12fps", "clip-30fps")),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<video><video> and\n<video>"},
      {"role": "assistant", "content": "Three."}], ("clip-2h", "clip-3-frames", "clip-29.97fps")),
)
# Clips of different lengths and frame rates: a family that prints each temporal patch's time counts them
# differently (times of one to four digits before the point, frames fewer than the cache samples, a
# rate that is not whole).
PROBE_CLIPS = {"clip-30fps": (900, 30.0), "clip-12fps": (50, 12.5), "clip-2h": (180_000, 25.0),
               "clip-3-frames": (3, 24.0), "clip-29.97fps": (17_982, 29.97)}  # total frames, fps
# (frames, height, width) of clips as the consumer resizes them: a clip of two frames, the smallest side,
# wide and tall, many frames at a small size, and one past Qwen-VL's default video budget.
PROBE_CLIP_SHAPES = ((2, 28, 28), (4, 336, 336), (12, 364, 644), (20, 252, 420), (30, 644, 364), (64, 140, 196),
                     (16, 868, 1540))
MIXED_PROBE = ([{"role": "user", "content": "<image>\n<video>\nSame scene?"}, {"role": "assistant", "content": "Yes."}],
               ("b", "clip-12fps"))


@dataclass(frozen=True)
class ProcessorProfile:
    modalities: Modalities
    model_types: tuple[str, ...]  # transformers model types whose processor class this is

    def describe(self) -> str:
        """One line for logs and metadata: the family, what it takes, which path counts what."""
        m = self.modalities
        family = f"{m.processor_class} ({_model_types(self.model_types)})"
        takes = ["text"] + [kind for kind, taken in (("images", m.takes_images), ("videos", m.takes_videos)) if taken]
        paths = [f"{kind}: {'fast' if fast else 'exact'}"
                 for kind, fast, taken in (("text", m.fast_text, True), ("images", m.fast_images, m.takes_images),
                                           ("videos", m.fast_videos, m.takes_videos)) if taken]
        return f"{family} takes {', '.join(takes)}; lengths by path: {', '.join(paths)}"


def model_types_of(processor: Any) -> tuple[str, ...]:
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = type(processor).__name__
    return tuple(sorted(model_type for model_type, class_name in PROCESSOR_MAPPING_NAMES.items() if class_name == name))


def check_model_type(model: ModelConfig, profile: ProcessorProfile) -> None:
    """`model.model_type`, when set, must name the loaded processor's family."""
    if model.model_type and model.model_type not in profile.model_types:
        raise ConfigError(
            f"model.model_type is {model.model_type!r} but the processor at {model.processor} is "
            f"{profile.modalities.processor_class} ({_model_types(profile.model_types)}); "
            "fix model.model_type or model.processor"
        )


def length_counter(model: ModelConfig, frame_cache: FrameCacheConfig, reject_control_tokens: bool = True,
                   tokens_per_clip: int | None = None, rule: CountingRule | None = None) -> LengthCounter:
    """This process's counter for `model`: the processor loaded once, its fast path proven (or taken from disk).
    `tokens_per_clip`: a video's tokens as a processor of these files counted them before."""
    processor = shared_processor(model)
    modalities = stored_modalities(model, frame_cache)
    if modalities is None:
        modalities = prove_fast_path(processor, frame_cache)
        _store(_profile_path(model, frame_cache), asdict(modalities))
    if stored_text_spec(model) is None and (spec := text_spec_of(processor)) is not None:
        store_text_spec(model, spec)
    counter = LengthCounter(processor, frame_cache, modalities=modalities, reject_control_tokens=reject_control_tokens,
                            tokens_per_clip=tokens_per_clip, rule=rule)
    if modalities.fast_videos and tokens_per_clip is None:
        counter.video_tokens_per_clip  # computed once, here, off the counting path
    return counter


def processor_profile(counter: LengthCounter) -> ProcessorProfile:
    return ProcessorProfile(counter.modalities, model_types_of(counter.processor))


def stored_modalities(model: ModelConfig, frame_cache: FrameCacheConfig) -> Modalities | None:
    try:
        return Modalities(**json.loads(_profile_path(model, frame_cache).read_text(encoding="utf-8")))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def prove_fast_path(processor: Any, frame_cache: FrameCacheConfig) -> Modalities:
    """The processor's modalities, with the fast path on for each one whose probes equal the exact path."""
    taken = modalities_of(processor)
    everything_fast = Modalities(taken.processor_class, taken.takes_images, taken.takes_videos, True, True, True)
    clips = {name: SampledFrames(total, fps, sample_indices(total, frame_cache.num_frames))
             for name, (total, fps) in PROBE_CLIPS.items()}
    frames = np.zeros((frame_cache.num_frames, frame_cache.frame_size, frame_cache.frame_size, 3), dtype=np.uint8)
    counter = LengthCounter(processor, frame_cache, video_loader=lambda ref, _settings: (clips[ref], frames),
                            modalities=taken, reject_control_tokens=False)

    with tempfile.TemporaryDirectory(prefix="vlm-assets-probe-") as workdir:
        refs = _probe_images(Path(workdir))
        refs.update({name: name for name in clips})

        def equal(probes: tuple[tuple[list[dict[str, str]], tuple[str, ...]], ...]) -> bool:
            samples = [_probe_sample(number, turns, [refs[name] for name in media])
                       for number, (turns, media) in enumerate(probes)]
            fast = [completed_length(measured, counter.image_tokens_for_size,
                                     lambda: clip_video_tokens(processor, frame_cache, everything_fast))
                    for measured in measure_samples(samples, counter.text, everything_fast,
                                                    reject_control_tokens=False, clip_facts=clips.get)]
            exact = [counter.exact(sample) for sample in samples]
            return all(_counts(f) == _counts(e) and e.status == "ok" for f, e in zip(fast, exact, strict=True))

        fast_text = equal(tuple((turns, ()) for turns in TEXT_PROBES))
        expansion = _probe_image_expansion(processor) if fast_text and taken.takes_images else None
        if expansion is not None:
            everything_fast = everything_fast.with_image_expansion(expansion)
        fast_images = expansion is not None and equal(IMAGE_PROBES)
        clip_expansion = (_probe_video_expansion(processor, counter, clips["clip-30fps"], frames)
                          if fast_text and taken.takes_videos else None)
        if clip_expansion is not None:
            everything_fast = everything_fast.with_video_expansion(clip_expansion)
        fast_videos = clip_expansion is not None and equal(VIDEO_PROBES)
        if fast_images and fast_videos and not equal((MIXED_PROBE,)):
            fast_videos = False
    proven = Modalities(taken.processor_class, taken.takes_images, taken.takes_videos, fast_text, fast_images, fast_videos,
                        clip_shape_tokens=_clip_shapes_counted_alike(processor),
                        clip_shape_plugin_text=_clip_shapes_written_alike(processor))
    if fast_videos and clip_expansion is not None:
        proven = proven.with_video_expansion(clip_expansion)
    return proven.with_image_expansion(expansion) if fast_images and expansion is not None else proven


def _clip_shapes_counted_alike(processor: Any) -> bool:
    """Whether a clip's video tokens by its shape (consumer.clip_video_pads) equal the processor's own
    count of such frames, its frames not sampled again (as the consumer hands them over)."""
    import torch

    if not supports_fast_videos(processor):
        return False
    video_id = processor.tokenizer.convert_tokens_to_ids(processor.video_token)
    try:
        for shape in PROBE_CLIP_SHAPES:
            frames = torch.zeros((shape[0], 3, shape[1], shape[2]))
            encoded = processor(text=[CLIP_MARKUP], videos=[frames], do_sample_frames=False, return_tensors="np")
            if int((encoded["input_ids"][0] == video_id).sum()) != clip_video_pads(processor, ClipShape(*shape)):
                return False
    except Exception:  # a processor without this arithmetic, or refusing the markup: its clips are decoded
        return False
    return True


def _clip_shapes_written_alike(processor: Any) -> bool:
    """Whether Qwen3-VL's media plugin writes the same text for a clip from its shape
    (qwen3_plugin_clip_text_for_shape) as from its frames (qwen3_plugin_clip_text)."""
    import torch

    if not supports_fast_videos(processor):
        return False
    try:
        return all(qwen3_plugin_clip_text(processor, torch.zeros((shape[0], 3, shape[1], shape[2])))
                   == qwen3_plugin_clip_text_for_shape(processor, ClipShape(*shape)) for shape in PROBE_CLIP_SHAPES)
    except Exception:  # a processor whose video processor samples otherwise: its clips are decoded
        return False


def _probe_image_expansion(processor: Any) -> ImageExpansion | None:
    """The processor's text for an image, where it has image-token arithmetic and reports that text."""
    from PIL import Image

    if not supports_fast_images(processor):
        return None
    height, width = PROBE_IMAGE_SIZES["b"]
    try:
        return image_expansion(processor, Image.new("RGB", (width, height), (128, 96, 64)))
    except Exception:  # a processor that does not report its replacements: its images are counted exactly
        return None


def _probe_video_expansion(processor: Any, counter: LengthCounter, clip: SampledFrames,
                           frames: np.ndarray) -> VideoExpansion | None:
    """The processor's text for a clip, where it has video-token arithmetic and reports that text."""
    if not supports_fast_videos(processor):
        return None
    turns, _clips = VIDEO_PROBES[0]
    try:
        return video_expansion(processor, counter.render(json.dumps(turns)), frames, clip,
                               video_metadata(clip, counter.frame_cache.frame_size))
    except Exception:  # a processor that does not report its replacements: its videos are counted exactly
        return None


def _model_types(model_types: tuple[str, ...]) -> str:
    if not model_types:
        return "model type unknown"
    return f"model type{'s' if len(model_types) > 1 else ''} {', '.join(model_types)}"


def _probe_images(workdir: Path) -> dict[str, str]:
    from PIL import Image

    refs = {}
    for name, (height, width) in PROBE_IMAGE_SIZES.items():
        path = workdir / f"{name}.png"
        Image.new("RGB", (width, height), (128, 96, 64)).save(path)
        refs[name] = str(path)
    return refs


def _probe_sample(number: int, turns: list[dict[str, str]], refs: list[str]) -> SampleForLength:
    kinds = ["video" if ref.startswith("clip-") else "image" for ref in refs]
    return SampleForLength(f"probe/{number}", json.dumps(turns), kinds, refs)


def _counts(result: LengthResult) -> tuple[str, int, int, int, int]:
    return result.status, result.token_len, result.text_tokens, result.image_tokens, result.video_tokens


# Sizes a media-token table keeps: a source of photos of every size cannot grow it without bound.
MEDIA_TOKEN_SIZES = 200_000


@dataclass(frozen=True)
class MediaTokens:
    """Image tokens per (height, width) and video tokens per clip, as a processor counted them before:
    a chunk whose samples need no other sizes is completed without loading the processor (seconds).
    `by_size`: an image alone in its sample; `grouped_by_size`: one of several images of a sample."""

    by_size: Mapping[tuple[int, int], int]
    per_clip: int | None = None
    grouped_by_size: Mapping[tuple[int, int], int] = field(default_factory=lambda: MappingProxyType({}))

    def covers(self, measured: MeasuredSample) -> bool:
        known = self.grouped_by_size if measured.grouped_images else self.by_size
        return (all(size in known for size in measured.image_sizes)
                and (not measured.videos or self.per_clip is not None))

    def image_tokens(self, height: int, width: int, grouped: bool) -> int:
        return (self.grouped_by_size if grouped else self.by_size)[height, width]

    def tokens_per_clip(self) -> int:
        assert self.per_clip is not None, "covers() says whether the videos' count is known"
        return self.per_clip


def stored_media_tokens(model: ModelConfig, frame_cache: FrameCacheConfig) -> MediaTokens:
    """The stored table, read once per process while its file stays as it is: a worker's chunk runs
    and its `sample_lengths` use it in turn, and a table of many image sizes is a second of JSON."""
    path = _media_tokens_path(model, frame_cache)
    try:
        stat = path.stat()
    except OSError:
        return MediaTokens({})
    # A file written moments ago may be written again within the same timestamp tick: read afresh.
    if time.time_ns() - stat.st_mtime_ns < RECENT_WRITE_NS:
        return _read_media_tokens.__wrapped__(path, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return _read_media_tokens(path, stat.st_ino, stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=4)
def _read_media_tokens(path: Path, _inode: int, _size: int, _mtime_ns: int) -> MediaTokens:
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
        by_size, grouped_by_size = ({(int(height), int(width)): int(tokens) for height, width, tokens in fields[key]}
                                    for key in ("images", "grouped_images"))
        return MediaTokens(MappingProxyType(by_size), fields["per_clip"], MappingProxyType(grouped_by_size))
    except (FileNotFoundError, json.JSONDecodeError, TypeError, KeyError, ValueError):
        return MediaTokens({})


def store_media_tokens(model: ModelConfig, frame_cache: FrameCacheConfig, counter: LengthCounter,
                       known: MediaTokens | None = None) -> None:
    """Add what `counter` counted to the stored table (processes racing may drop each other's
    additions: they are counted again, by a processor, when next needed). `known`: the table as
    read before counting; when it holds all the counter counted, the table is not read again."""
    if known is not None and counter.image_tokens_by_size.keys() <= known.by_size.keys() \
            and counter.grouped_image_tokens_by_size.keys() <= known.grouped_by_size.keys() \
            and (known.per_clip is not None or not counter.modalities.fast_videos):
        return
    stored = stored_media_tokens(model, frame_cache)
    by_size = {**stored.by_size, **counter.image_tokens_by_size}
    grouped_by_size = {**stored.grouped_by_size, **counter.grouped_image_tokens_by_size}
    per_clip = stored.per_clip
    if per_clip is None and counter.modalities.fast_videos:
        per_clip = counter.video_tokens_per_clip
    if (len(by_size), len(grouped_by_size), per_clip) == (len(stored.by_size), len(stored.grouped_by_size),
                                                          stored.per_clip):
        return
    _store(_media_tokens_path(model, frame_cache),
           {"images": _size_rows(by_size), "grouped_images": _size_rows(grouped_by_size), "per_clip": per_clip})


def _size_rows(tokens_by_size: Mapping[tuple[int, int], int]) -> list[list[int]]:
    return [[height, width, tokens] for (height, width), tokens in list(tokens_by_size.items())[:MEDIA_TOKEN_SIZES]]


def _media_tokens_path(model: ModelConfig, frame_cache: FrameCacheConfig) -> Path:
    return _profile_path(model, frame_cache).with_suffix(".media-tokens.json")


def _profile_path(model: ModelConfig, frame_cache: FrameCacheConfig) -> Path:
    shape = f"{frame_cache.num_frames}x{frame_cache.frame_size}"
    return default_cache_dir() / "length-profiles" / f"v{PROFILE_VERSION}-{processor_fingerprint(model)}-{shape}.json"


def _store(path: Path, fields: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(fields))
