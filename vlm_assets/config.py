"""The one YAML file a user edits, loaded and validated into typed settings.

Every error names the file and the dotted key that is wrong, so a typo never
surfaces later as a confusing failure deep inside a run.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from vlm_assets.object_store import ObjectURL, is_object_url

CONFIG_ENV_VAR = "VLM_ASSETS_CONFIG"
DEFAULT_CONFIG_NAME = "vlm_assets.yaml"
SOURCE_KINDS = ("flat_dir", "jsonl", "wds")
SAMPLE_TYPES = ("packed_captioning", "packed_vqa", "packed_multi_mix_qa", "packed_chat_mix")
# How the packed shards' consumer renders a child's text and resizes its media (vlm_assets.tokens.consumer):
# LoongForge's templates of those names, or the processor's own chat template with Qwen2-VL's media rule.
CHAT_TEMPLATES = ("qwen2-vl", "qwen3-vl", "qwen2.5-vl-hf", "qwen3-vl-hf", "processor")
# `packing.algorithm` may name the packing algorithm; best-fit decreasing is the only one, any other value is refused.
PACKING_ALGORITHMS = ("best_fit_decreasing",)
# full: every build packs every sample afresh (best fill); append: bins and shards once written stay,
# new samples go into new bins and new shards.
PACKING_MODES = ("full", "append")
COMPRESSIONS = ("gzip", "zstd")  # implemented by vlm_assets.package.compression
PACKAGE_PARTS = ("packed_wds", "frame_cache")
SPECIAL_TOKENS_IN_TEXT = ("reject", "keep")
DEFAULT_STORAGE_ROOT = "./vlm_data"
DEFAULT_INBOX = "./vlm_inbox"


class ConfigError(ValueError):
    """A configuration problem, with the file and key it concerns."""


# Per-record limits (docs/formats.md §2.1): far above any real record, low enough that one hostile
# record cannot exhaust memory or the parser's stack. The depth bound keeps Python's JSON parser
# clear of its recursion limit, so a deeper record is refused by our check, never by a crash.
DEFAULT_MAX_RECORD_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_JSON_DEPTH = 100
MAX_JSON_DEPTH_BOUND = 500
# The longest sequence a trainer can take (docs/formats.md §1): a bin capacity above it could only
# come from a typo, and would otherwise pass here and fail the packing step instead.
MAX_TOKEN_LEN_BOUND = 2**20
# Per-image limit (docs/formats.md §2.6), checked on the header before any decode: the exact length
# path holds one image at this limit, with the processor's own working copies, in about 0.5 GB (a
# sample naming it four times: 0.8 GB) besides the processor's fixed 1 GB. A 45-megapixel photo
# needs a source to raise it.
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
# A source's `chunk_rows` is a whole number of the token-length store's entries (vlm_assets.tokens.chunk_plan).
CHUNK_ROWS_MULTIPLE = 2048


@dataclass(frozen=True)
class SourceConfig:
    name: str
    kind: str
    # A local path, or an object on S3-compatible storage (docs/formats.md, "Sources on object storage").
    path: Path | ObjectURL
    media_root: Path | ObjectURL
    # Training mix settings (docs/formats.md); inbox sources get these defaults.
    sample_type: str | None = None  # None: the global `sample.sample_type`
    weight: float = 1.0  # relative share of drawn bins in the metadataset blend; 0 leaves the source out
    subflavors: dict[str, Any] = field(default_factory=dict, hash=False)  # passed through to Energon
    # Input limits (docs/formats.md §2.4): directories besides the source's own and media_root that
    # media may come from, and the largest / most deeply nested record accepted.
    allowed_roots: tuple[Path | ObjectURL, ...] = ()
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width × height of one image; a larger one is refused undecoded
    # A sample whose text holds the processor's control tokens is rejected ("reject"), or counted
    # as the processor counts it ("keep"); see vlm_assets.tokens.text.control_tokens_of.
    special_tokens_in_text: str = "reject"
    chunk_rows: int | None = None  # catalogue rows per length chunk (tokens.chunk_plan); None: from the source's size

    @property
    def rejects_control_tokens(self) -> bool:
        return self.special_tokens_in_text == "reject"

    @property
    def on_object_store(self) -> bool:
        return isinstance(self.path, ObjectURL)


@dataclass(frozen=True)
class ModelConfig:
    processor: str = "embedded"
    processor_kwargs: dict[str, Any] = field(default_factory=dict)
    # When set, the loaded processor must be of this transformers model type (vlm_assets.tokens.profile).
    model_type: str | None = None


@dataclass(frozen=True)
class SampleConfig:
    sample_type: str = "packed_multi_mix_qa"
    max_token_len: int = 8192
    text_key: str = "messages"


@dataclass(frozen=True)
class TrainerConfig:
    """The training arguments with which the packed shards' consumer resizes and samples media
    itself, named after them (LoongForge: `--min-pixels` is `min_pixels`), with its defaults."""

    chat_template: str = CHAT_TEMPLATES[0]
    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 16384 * 28 * 28
    # None: the consumer's media plugin caps an image's longer side at 512 px.
    image_resolution: int | None = None
    frame_min_pixels: int = 128 * 28 * 28
    frame_max_pixels: int = 768 * 28 * 28
    video_max_pixels: int = 65536 * 28 * 28
    fps: float = 2.0
    fps_min_frames: int = 4
    fps_max_frames: int = 768


@dataclass(frozen=True)
class PackingConfig:
    min_fill_ratio: float = 0.9
    mode: str = PACKING_MODES[0]


@dataclass(frozen=True)
class WdsConfig:
    maxcount: int = 10000
    maxsize: int = 1_000_000_000


@dataclass(frozen=True)
class FrameCacheConfig:
    num_frames: int = 64
    frame_size: int = 384
    rows: int = 4
    cols: int = 16
    jpeg_quality: int = 95
    videos_per_shard: int = 256


@dataclass(frozen=True)
class PackageConfig:
    name: str = "run"
    compress: str = "zstd"
    include: tuple[str, ...] = PACKAGE_PARTS
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    train_command: str = ""


@dataclass(frozen=True)
class DedupConfig:
    """Which duplicates `sample_dedup` removes before the token lengths, and how near is near."""

    # Media bytes (sha256) and normalised conversation both equal to a kept sample's.
    exact: bool = True
    # Perceptual hashes (pHash) of images, of frames sampled across each video, and MinHash of the text.
    near_images: bool = False
    near_videos: bool = False
    near_text: bool = False
    # Remove a sample whose media match a kept sample's whatever its text (one caption per image).
    media_only: bool = False
    # Most differing bits of two 64-bit image pHashes: a copy resized or re-encoded differs in 0-2, one
    # cropped by 3 % on two edges in about 8; unrelated pictures in about 30.
    image_distance: int = 10
    video_distance: float = 8.0  # most differing bits, averaged over the sampled frames
    video_frames: int = 8  # frames per video hashed, spread over the frame cache's sampled ones
    text_threshold: float = 0.85  # least estimated Jaccard similarity of two texts' shingles
    text_shingle_chars: int = 5
    text_permutations: int = 128  # MinHash permutations
    # Sources whose kept samples win, first ahead (the others follow in config order).
    priority: tuple[str, ...] = ()
    # The share of a source's catalogued samples its dedup check lets go before failing.
    max_removed_share: float = 0.5

    def decision_settings(self) -> dict[str, Any]:
        """Every setting but the check's share: what the decisions depend on."""
        return {name: value for name, value in asdict(self).items() if name != "max_removed_share"}

    def signature_settings(self) -> dict[str, Any]:
        """What a sample's signatures depend on: a change recomputes them; thresholds only decide."""
        return {"near_images": self.near_images, "near_videos": self.near_videos, "near_text": self.near_text,
                "video_frames": self.video_frames, "text_shingle_chars": self.text_shingle_chars,
                "text_permutations": self.text_permutations}


@dataclass(frozen=True)
class AppConfig:
    path: Path
    storage_root: Path
    inbox: Path
    inbox_require_ready_marker: bool
    sources: tuple[SourceConfig, ...]
    model: ModelConfig
    sample: SampleConfig
    packing: PackingConfig
    wds: WdsConfig
    frame_cache: FrameCacheConfig
    package: PackageConfig
    trainer: TrainerConfig = TrainerConfig()
    dedup: DedupConfig = DedupConfig()
    # `storage.root` on object storage: every output is built in `storage_root` (then a local working
    # copy, `storage.work_dir`) and published there (vlm_assets.publish).
    storage_url: ObjectURL | None = None

    def source(self, name: str) -> SourceConfig:
        for source in self.sources:
            if source.name == name:
                return source
        raise ConfigError(f"{self.path}: no source named {name!r} (known: {[s.name for s in self.sources]})")

    def sample_type_of(self, source: SourceConfig) -> str:
        return source.sample_type or self.sample.sample_type


_SECTION_KEYS = {
    "storage": {"root", "work_dir"},
    "model": {"model_type", "processor", "processor_kwargs"},
    "sample": {"sample_type", "max_token_len", "text_key"},
    "packing": {"algorithm", "min_fill_ratio", "mode"},
    "wds": {"maxcount", "maxsize"},
    "frame_cache": {"num_frames", "frame_size", "rows", "cols", "jpeg_quality", "videos_per_shard"},
    "package": {"name", "compress", "include", "hyperparameters", "train_command"},
    "trainer": {"chat_template", "min_pixels", "max_pixels", "image_resolution", "frame_min_pixels",
                "frame_max_pixels", "video_max_pixels", "fps", "fps_min_frames", "fps_max_frames"},
    "dedup": {"exact", "near_images", "near_videos", "near_text", "media_only", "image_distance", "video_distance",
              "video_frames", "text_threshold", "text_shingle_chars", "text_permutations", "priority",
              "max_removed_share"},
}
_TOP_KEYS = set(_SECTION_KEYS) | {"inbox", "inbox_require_ready_marker", "sources"}
_SOURCE_KEYS = {"name", "kind", "path", "media_root", "sample_type", "weight", "subflavors",
                "allowed_roots", "max_record_bytes", "max_json_depth", "max_image_pixels", "special_tokens_in_text",
                "chunk_rows"}
# Subflavors the training mix sets itself on every source's blend entry.
RESERVED_SUBFLAVORS = ("sample_type", "source")
_ADD_SOURCES = (
    "add a `sources:` list, e.g. `sources: [{name: my_data, kind: jsonl, path: ./train.jsonl}]` "
    f"(kind: one of {', '.join(SOURCE_KINDS)}), or an `inbox:` directory to drop sources into"
)


class _Reader:
    """Pulls typed values out of the parsed YAML, naming file and key on error."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.path}: {key}: {message}")

    def mapping(self, value: Any, key: str) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(key, f"expected a mapping, got {type(value).__name__}")
        return value

    def no_unknown(self, data: dict[str, Any], allowed: set[str], key: str) -> None:
        unknown = sorted(set(data) - allowed)
        if unknown:
            prefix = f"{key}." if key else ""
            raise self.fail(f"{prefix}{unknown[0]}", f"unknown key (allowed: {', '.join(sorted(allowed))})")

    def integer(self, data: dict[str, Any], name: str, key: str, default: int, minimum: int = 1,
                maximum: int | None = None) -> int:
        value = data.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{key}.{name}", f"expected an integer, got {value!r}")
        if value < minimum:
            raise self.fail(f"{key}.{name}", f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.fail(f"{key}.{name}", f"must be <= {maximum}, got {value}")
        return value

    def number(self, data: dict[str, Any], name: str, key: str, default: float) -> float:
        value = data.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(f"{key}.{name}", f"expected a number, got {value!r}")
        return float(value)

    def string(self, data: dict[str, Any], name: str, key: str, default: str | None = None) -> str:
        value = data.get(name, default)
        if value is None:
            raise self.fail(f"{key}.{name}", "is required")
        if not isinstance(value, str) or (not value and default is None):
            raise self.fail(f"{key}.{name}", f"expected a non-empty string, got {value!r}")
        return value

    def choice(self, data: dict[str, Any], name: str, key: str, default: str, choices: tuple[str, ...]) -> str:
        value = self.string(data, name, key, default)
        if value not in choices:
            raise self.fail(f"{key}.{name}", f"must be one of {', '.join(choices)}; got {value!r}")
        return value

    def resolve(self, raw: str) -> Path:
        path = Path(os.path.expanduser(raw))
        return path if path.is_absolute() else (self.path.parent / path).resolve()


def _trainer_config(reader: _Reader, data: dict[str, Any]) -> TrainerConfig:
    defaults = TrainerConfig()
    pixels = {name: reader.integer(data, name, "trainer", getattr(defaults, name))
              for name in ("min_pixels", "max_pixels", "frame_min_pixels", "frame_max_pixels", "video_max_pixels")}
    resolution = data.get("image_resolution")
    if resolution is not None:
        resolution = reader.integer(data, "image_resolution", "trainer", 512, minimum=28)
    trainer = TrainerConfig(
        chat_template=reader.choice(data, "chat_template", "trainer", defaults.chat_template, CHAT_TEMPLATES),
        image_resolution=resolution,
        fps=reader.number(data, "fps", "trainer", defaults.fps),
        fps_min_frames=reader.integer(data, "fps_min_frames", "trainer", defaults.fps_min_frames),
        fps_max_frames=reader.integer(data, "fps_max_frames", "trainer", defaults.fps_max_frames, minimum=2),
        **pixels,
    )
    if trainer.fps <= 0:
        raise reader.fail("trainer.fps", f"must be > 0, got {trainer.fps}")
    for low, high in (("min_pixels", "max_pixels"), ("frame_min_pixels", "frame_max_pixels"),
                      ("fps_min_frames", "fps_max_frames")):
        if getattr(trainer, low) > getattr(trainer, high):
            raise reader.fail(f"trainer.{low}", f"must be <= trainer.{high} ({getattr(trainer, low)} > {getattr(trainer, high)})")
    return trainer


def _dedup_config(reader: _Reader, data: dict[str, Any], source_names: list[str]) -> DedupConfig:
    defaults = DedupConfig()
    switches = {}
    for name in ("exact", "near_images", "near_videos", "near_text", "media_only"):
        value = data.get(name, getattr(defaults, name))
        if not isinstance(value, bool):
            raise reader.fail(f"dedup.{name}", f"expected true or false, got {value!r}")
        switches[name] = value
    shares = {}
    for name in ("video_distance", "text_threshold", "max_removed_share"):
        shares[name] = reader.number(data, name, "dedup", getattr(defaults, name))
    if not 0 < shares["text_threshold"] <= 1:
        raise reader.fail("dedup.text_threshold", f"must be a Jaccard similarity in (0, 1], got {shares['text_threshold']}")
    if not 0 <= shares["max_removed_share"] <= 1:
        raise reader.fail("dedup.max_removed_share", f"must be a share in [0, 1], got {shares['max_removed_share']}")
    if not 0 <= shares["video_distance"] <= 64:
        raise reader.fail("dedup.video_distance", f"must be a number of bits in [0, 64], got {shares['video_distance']}")
    priority = data.get("priority", [])
    if not isinstance(priority, list) or not all(isinstance(name, str) for name in priority):
        raise reader.fail("dedup.priority", f"expected a list of source names, got {priority!r}")
    if len(set(priority)) != len(priority):
        raise reader.fail("dedup.priority", f"names a source twice: {priority!r}")
    # Inbox sources have no name until they arrive, so only configured names are checked.
    unknown = [name for name in priority if name not in source_names]
    if unknown and source_names:
        raise reader.fail("dedup.priority", f"no configured source named {unknown[0]!r} (known: {', '.join(source_names)})")
    return DedupConfig(
        **switches, **shares,
        # Up to 32 bits: two unrelated 64-bit hashes are 32 bits apart on average.
        image_distance=reader.integer(data, "image_distance", "dedup", defaults.image_distance, minimum=0, maximum=32),
        video_frames=reader.integer(data, "video_frames", "dedup", defaults.video_frames, maximum=64),
        text_shingle_chars=reader.integer(data, "text_shingle_chars", "dedup", defaults.text_shingle_chars),
        text_permutations=reader.integer(data, "text_permutations", "dedup", defaults.text_permutations, minimum=16,
                                         maximum=1024),
        priority=tuple(priority),
    )


def package_name_problem(name: Any) -> str | None:
    """Why `name` cannot name a package file (`package.name`, a recipe's `name`); None if it can."""
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        return f"must be a plain file name (no '/', not starting with '.'), got {name!r}"
    return None


def default_config_path() -> str:
    """$VLM_ASSETS_CONFIG, else vlm_assets.yaml in the working directory (no other guess)."""
    return os.environ.get(CONFIG_ENV_VAR) or os.path.abspath(DEFAULT_CONFIG_NAME)


def load_config(path: str | os.PathLike[str] | None = None) -> AppConfig:
    """Load and validate a config file (argument, else $VLM_ASSETS_CONFIG)."""
    if path is None:
        path = os.environ.get(CONFIG_ENV_VAR)
        if not path:
            raise ConfigError(f"no config given: pass --config FILE or set ${CONFIG_ENV_VAR}")
    config_path = Path(path).expanduser().resolve()
    if not config_path.is_file():
        raise ConfigError(f"{config_path}: config file not found (set ${CONFIG_ENV_VAR} or pass --config FILE)")
    try:
        raw = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ConfigError(f"{config_path}: not valid YAML: {error}") from error
    return parse_config(raw, config_path)


def parse_config(raw: Any, config_path: Path) -> AppConfig:
    if raw is None:
        raise ConfigError(f"{config_path}: the config is empty; {_ADD_SOURCES}")
    reader = _Reader(config_path)
    top = reader.mapping(raw, "(top level)")
    reader.no_unknown(top, _TOP_KEYS, "")
    sections = {name: reader.mapping(top.get(name), name) for name in _SECTION_KEYS}
    for name, data in sections.items():
        reader.no_unknown(data, _SECTION_KEYS[name], name)

    storage_raw = reader.string(sections["storage"], "root", "storage", DEFAULT_STORAGE_ROOT)
    storage_url = _object_url(reader, storage_raw, "storage.root") if is_object_url(storage_raw) else None
    if storage_url is not None:
        work_dir = reader.string(sections["storage"], "work_dir", "storage", "")
        storage_root = reader.resolve(work_dir) if work_dir else default_work_dir(storage_url)
    elif "work_dir" in sections["storage"]:
        raise reader.fail("storage.work_dir", "is for a storage.root on object storage (s3://…); a local root is "
                          "its own working copy")
    else:
        storage_root = reader.resolve(storage_raw)
    _check_storage_root(reader, storage_root)
    inbox_raw = top.get("inbox", DEFAULT_INBOX)
    if not isinstance(inbox_raw, str) or not inbox_raw:
        raise reader.fail("inbox", f"expected a path, got {inbox_raw!r}")
    ready_marker = top.get("inbox_require_ready_marker", False)
    if not isinstance(ready_marker, bool):
        raise reader.fail("inbox_require_ready_marker", f"expected true or false, got {ready_marker!r}")

    # Defaults are the dataclasses' own (e.g. SampleConfig.max_token_len), written only there.
    model_data = sections["model"]
    model = ModelConfig(
        processor=reader.string(model_data, "processor", "model", ModelConfig.processor),
        processor_kwargs=dict(reader.mapping(model_data.get("processor_kwargs"), "model.processor_kwargs")),
        model_type=reader.string(model_data, "model_type", "model") if "model_type" in model_data else None,
    )
    if model.processor != "embedded":
        processor_dir = reader.resolve(model.processor)
        if not processor_dir.is_dir():
            raise reader.fail("model.processor", f"'embedded' or a local HF processor directory; {processor_dir} does not exist")
        model = replace(model, processor=str(processor_dir))

    sample_data = sections["sample"]
    sample = SampleConfig(
        sample_type=reader.choice(sample_data, "sample_type", "sample", SampleConfig.sample_type, SAMPLE_TYPES),
        max_token_len=reader.integer(sample_data, "max_token_len", "sample", SampleConfig.max_token_len, minimum=16,
                                     maximum=MAX_TOKEN_LEN_BOUND),
        text_key=reader.string(sample_data, "text_key", "sample", SampleConfig.text_key),
    )
    packing_data = sections["packing"]
    reader.choice(packing_data, "algorithm", "packing", PACKING_ALGORITHMS[0], PACKING_ALGORITHMS)
    packing = PackingConfig(
        min_fill_ratio=reader.number(packing_data, "min_fill_ratio", "packing", PackingConfig.min_fill_ratio),
        mode=reader.choice(packing_data, "mode", "packing", PackingConfig.mode, PACKING_MODES),
    )
    wds_data = sections["wds"]
    wds = WdsConfig(
        maxcount=reader.integer(wds_data, "maxcount", "wds", WdsConfig.maxcount),
        maxsize=reader.integer(wds_data, "maxsize", "wds", WdsConfig.maxsize, minimum=1024),
    )
    frame_data = sections["frame_cache"]
    frame_cache = FrameCacheConfig(
        num_frames=reader.integer(frame_data, "num_frames", "frame_cache", FrameCacheConfig.num_frames),
        frame_size=reader.integer(frame_data, "frame_size", "frame_cache", FrameCacheConfig.frame_size, minimum=28),
        rows=reader.integer(frame_data, "rows", "frame_cache", FrameCacheConfig.rows),
        cols=reader.integer(frame_data, "cols", "frame_cache", FrameCacheConfig.cols),
        jpeg_quality=reader.integer(frame_data, "jpeg_quality", "frame_cache", FrameCacheConfig.jpeg_quality,
                                    maximum=100),
        videos_per_shard=reader.integer(frame_data, "videos_per_shard", "frame_cache", FrameCacheConfig.videos_per_shard),
    )
    if frame_cache.rows * frame_cache.cols != frame_cache.num_frames:
        raise reader.fail(
            "frame_cache.rows",
            f"rows × cols must equal num_frames ({frame_cache.rows} × {frame_cache.cols} != {frame_cache.num_frames})",
        )

    trainer = _trainer_config(reader, sections["trainer"])

    package_data = sections["package"]
    include = package_data.get("include", list(PackageConfig.include))
    if not isinstance(include, list) or any(part not in PACKAGE_PARTS for part in include):
        raise reader.fail("package.include", f"expected a list drawn from {', '.join(PACKAGE_PARTS)}; got {include!r}")
    package = PackageConfig(
        name=reader.string(package_data, "name", "package", PackageConfig.name),
        compress=reader.choice(package_data, "compress", "package", PackageConfig.compress, COMPRESSIONS),
        include=tuple(include),
        hyperparameters=dict(reader.mapping(package_data.get("hyperparameters"), "package.hyperparameters")),
        train_command=reader.string(package_data, "train_command", "package", PackageConfig.train_command),
    )
    problem = package_name_problem(package.name)
    if problem:
        raise reader.fail("package.name", problem)

    sources = _parse_sources(reader, top.get("sources"), inbox_given="inbox" in top)
    dedup = _dedup_config(reader, sections["dedup"], [source.name for source in sources])

    return AppConfig(
        path=config_path,
        storage_root=storage_root,
        storage_url=storage_url,
        inbox=reader.resolve(inbox_raw),
        inbox_require_ready_marker=ready_marker,
        sources=sources,
        model=model,
        sample=sample,
        packing=packing,
        wds=wds,
        frame_cache=frame_cache,
        trainer=trainer,
        package=package,
        dedup=dedup,
    )


def default_work_dir(url: ObjectURL) -> Path:
    """The local working copy of a storage root on object storage, in the user's cache folder."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "vlm-assets" / "s3" / url.bucket / url.key


def _check_storage_root(reader: _Reader, root: Path) -> None:
    """Refuse a root that can be neither used nor created, before any run tries to write under it."""
    if os.path.lexists(root):
        if not root.is_dir():
            raise reader.fail("storage.root", f"storage.root is not a directory: {root}")
        return
    # os.path's checks read an unreadable ancestor as absent, so the error names the one in the way.
    parent = next(ancestor for ancestor in root.parents if os.path.exists(ancestor))
    if not parent.is_dir():
        raise reader.fail("storage.root", f"cannot create {root}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise reader.fail("storage.root", f"cannot create {root}: {parent} is not writable")


def _parse_sources(reader: _Reader, raw: Any, inbox_given: bool) -> tuple[SourceConfig, ...]:
    if raw is None or raw == []:
        # Sources may all come from the inbox; without one either, nothing would ever run.
        if inbox_given:
            return ()
        raise reader.fail("sources", f"no sources configured; {_ADD_SOURCES}")
    if not isinstance(raw, list):
        raise reader.fail("sources", f"expected a list of sources, got {type(raw).__name__}")
    sources: list[SourceConfig] = []
    for index, item in enumerate(raw):
        key = f"sources[{index}]"
        data = reader.mapping(item, key)
        reader.no_unknown(data, _SOURCE_KEYS, key)
        name = reader.string(data, "name", key)
        if not all(ch.isalnum() or ch in "_-" for ch in name):
            raise reader.fail(f"{key}.name", f"use letters, digits, '_' or '-' only; got {name!r}")
        if any(existing.name == name for existing in sources):
            raise reader.fail(f"{key}.name", f"duplicate source name {name!r}")
        kind = reader.choice(data, "kind", key, "", SOURCE_KINDS) if "kind" in data else None
        if kind is None:
            raise reader.fail(f"{key}.kind", f"is required (one of {', '.join(SOURCE_KINDS)})")
        path = _location(reader, data, "path", key)
        if "media_root" in data:
            media_root = _location(reader, data, "media_root", key)
        else:
            media_root = path.parent if kind == "jsonl" else path
        sources.append(SourceConfig(
            name=name, kind=kind, path=path, media_root=media_root,
            sample_type=reader.choice(data, "sample_type", key, "", SAMPLE_TYPES) if "sample_type" in data else None,
            weight=_weight(reader, data, key),
            subflavors=_subflavors(reader, data.get("subflavors"), f"{key}.subflavors"),
            allowed_roots=_allowed_roots(reader, data, key),
            max_record_bytes=reader.integer(data, "max_record_bytes", key, DEFAULT_MAX_RECORD_BYTES),
            max_json_depth=reader.integer(data, "max_json_depth", key, DEFAULT_MAX_JSON_DEPTH,
                                          maximum=MAX_JSON_DEPTH_BOUND),
            max_image_pixels=reader.integer(data, "max_image_pixels", key, DEFAULT_MAX_IMAGE_PIXELS),
            special_tokens_in_text=reader.choice(data, "special_tokens_in_text", key, SourceConfig.special_tokens_in_text,
                                                 SPECIAL_TOKENS_IN_TEXT),
            chunk_rows=_chunk_rows(reader, data, key),
        ))
        _check_object_store_source(reader, sources[-1], key)
    if sources and not any(source.weight for source in sources):
        raise reader.fail("sources[*].weight", "every source has weight 0; at least one needs a positive weight")
    return tuple(sources)


def _weight(reader: _Reader, data: dict[str, Any], key: str) -> float:
    weight = reader.number(data, "weight", key, SourceConfig.weight)
    if not math.isfinite(weight) or weight < 0:
        raise reader.fail(f"{key}.weight", f"must be a finite number >= 0, got {data['weight']!r}")
    return weight


def _subflavors(reader: _Reader, raw: Any, key: str) -> dict[str, Any]:
    subflavors = reader.mapping(raw, key)
    for name, value in subflavors.items():
        if not isinstance(name, str) or name in RESERVED_SUBFLAVORS:
            raise reader.fail(f"{key}.{name}", f"a subflavor name other than {', '.join(RESERVED_SUBFLAVORS)} (set by the training mix)")
        if isinstance(value, (dict, list)) or value is None:
            raise reader.fail(f"{key}.{name}", f"expected a string, number or boolean, got {value!r}")
    return dict(subflavors)


def _allowed_roots(reader: _Reader, data: dict[str, Any], key: str) -> tuple[Path, ...]:
    raw = data.get("allowed_roots", [])
    if not isinstance(raw, list):
        raise reader.fail(f"{key}.allowed_roots", f"expected a list of directories, got {raw!r}")
    roots = []
    for index, item in enumerate(raw):
        item_key = f"{key}.allowed_roots[{index}]"
        if not isinstance(item, str) or not item:
            raise reader.fail(item_key, f"expected a directory path, got {item!r}")
        if is_object_url(item):
            roots.append(_object_url(reader, item, item_key))
            continue
        root = reader.resolve(item)
        if not root.is_dir():
            raise reader.fail(item_key, f"{root} is not an existing directory")
        roots.append(root)
    return tuple(roots)


def _chunk_rows(reader: _Reader, data: dict[str, Any], key: str) -> int | None:
    if "chunk_rows" not in data:
        return None
    rows = reader.integer(data, "chunk_rows", key, 0)
    if rows <= 0 or rows % CHUNK_ROWS_MULTIPLE:
        raise reader.fail(f"{key}.chunk_rows", f"must be a positive multiple of {CHUNK_ROWS_MULTIPLE}, got {data['chunk_rows']!r}")
    return rows


def _location(reader: _Reader, data: dict[str, Any], name: str, key: str) -> Path | ObjectURL:
    """A local path that exists, or an s3:// URL (whose objects are listed when the source is read)."""
    raw = reader.string(data, name, key)
    return _object_url(reader, raw, f"{key}.{name}") if is_object_url(raw) else _existing(reader, data, name, key)


def _object_url(reader: _Reader, raw: str, key: str) -> ObjectURL:
    try:
        url = ObjectURL.parse(raw)
    except ValueError as error:
        raise reader.fail(key, str(error)) from error
    if "@" in url.bucket or ":" in url.bucket:
        raise reader.fail(key, "put no credentials or endpoint in the URL: they come from the environment "
                          "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
    return url


def _check_object_store_source(reader: _Reader, source: SourceConfig, key: str) -> None:
    on_store = source.on_object_store
    for name, location in [("media_root", source.media_root), *(("allowed_roots", root) for root in source.allowed_roots)]:
        if on_store != isinstance(location, ObjectURL):
            raise reader.fail(f"{key}.{name}", "a source's path, media_root and allowed_roots must all be on object "
                              "storage (s3://) or all on a local disk")


def _existing(reader: _Reader, data: dict[str, Any], name: str, key: str) -> Path:
    path = reader.resolve(reader.string(data, name, key))
    if not os.path.exists(path):
        raise reader.fail(f"{key}.{name}", f"{path} does not exist")
    return path
