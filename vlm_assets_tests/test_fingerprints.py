"""Every setting is part of the fingerprint of exactly the assets docs/formats.md §1.1 says read it.

The keys come from the config loader itself (its unknown-key errors list what each section
accepts), so a key added to the loader without a row in §1.1, or a row whose assets do not match
the fingerprints, fails here.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from vlm_assets.config import ConfigError, load_config
from vlm_assets.fingerprints import Fingerprints
from vlm_assets.frames.plan import FRAMES_SOURCE_FILE
from vlm_assets.tokens.chunk_plan import chunk_partition_key
from vlm_assets.tokens.processor import processor_fingerprint

DOCS = Path(__file__).resolve().parents[1] / "docs" / "formats.md"
SOURCE_ASSETS = ["sample_catalog", "sample_dedup", "sample_lengths", "packing_bins", "packed_json", "packed_wds_shards", "energon_dataset"]
GLOBAL_ASSETS = ["video_frame_plan", "frame_cache_index", "training_mix", "training_package"]
SHARD = "part-00000"

# A changed value for every key (several keys where the loader needs them to change together).
# What a key is changed from, where the base config cannot have it.
BASES: dict[str, dict[str, Any]] = {
    "storage.work_dir": {"storage.root": "s3://vlm-bucket/out", "storage.work_dir": "work"},
}
CHANGES: dict[str, dict[str, Any]] = {
    "storage.root": {"storage.root": "other_root"},
    "storage.work_dir": {"storage.work_dir": "other_work"},
    "inbox": {"inbox": "other_inbox"},
    "inbox_require_ready_marker": {"inbox_require_ready_marker": True},
    "sources[].name": {"sources[].name": "renamed"},
    "sources[].kind": {"sources[].kind": "wds"},
    "sources[].path": {"sources[].path": "copy"},
    "sources[].media_root": {"sources[].media_root": "copy"},
    "sources[].allowed_roots": {"sources[].allowed_roots": ["copy"]},
    "sources[].max_record_bytes": {"sources[].max_record_bytes": 4096},
    "sources[].max_json_depth": {"sources[].max_json_depth": 7},
    "sources[].max_image_pixels": {"sources[].max_image_pixels": 1000},
    "sources[].special_tokens_in_text": {"sources[].special_tokens_in_text": "keep"},
    "sources[].chunk_rows": {"sources[].chunk_rows": 4096},
    "sources[].sample_type": {"sources[].sample_type": "packed_vqa"},
    "sources[].weight": {"sources[].weight": 3},
    "sources[].subflavors": {"sources[].subflavors": {"language": "de"}},
    "model.model_type": {"model.model_type": "qwen2_vl"},
    "model.processor": {"model.processor": "processor"},
    "model.processor_kwargs": {"model.processor_kwargs": {"min_pixels": 3136}},
    "sample.sample_type": {"sample.sample_type": "packed_vqa"},
    "sample.max_token_len": {"sample.max_token_len": 1024},
    "sample.text_key": {"sample.text_key": "conversations"},
    "packing.algorithm": {"packing.algorithm": "best_fit_decreasing"},
    "packing.min_fill_ratio": {"packing.min_fill_ratio": 0.5},
    "packing.mode": {"packing.mode": "append"},
    "wds.maxcount": {"wds.maxcount": 5},
    "wds.maxsize": {"wds.maxsize": 4096},
    "frame_cache.num_frames": {"frame_cache.num_frames": 32, "frame_cache.rows": 2},
    "frame_cache.frame_size": {"frame_cache.frame_size": 224},
    "frame_cache.rows": {"frame_cache.rows": 8, "frame_cache.cols": 8},
    "frame_cache.cols": {"frame_cache.rows": 8, "frame_cache.cols": 8},
    "frame_cache.jpeg_quality": {"frame_cache.jpeg_quality": 80},
    "frame_cache.videos_per_shard": {"frame_cache.videos_per_shard": 8},
    "trainer.chat_template": {"trainer.chat_template": "processor"},
    "trainer.min_pixels": {"trainer.min_pixels": 6272},
    "trainer.max_pixels": {"trainer.max_pixels": 1003520},
    "trainer.image_resolution": {"trainer.image_resolution": 1024},
    "trainer.frame_min_pixels": {"trainer.frame_min_pixels": 50176},
    "trainer.frame_max_pixels": {"trainer.frame_max_pixels": 301056},
    "trainer.video_max_pixels": {"trainer.video_max_pixels": 25690112},
    "trainer.fps": {"trainer.fps": 1.0},
    "trainer.fps_min_frames": {"trainer.fps_min_frames": 8},
    "trainer.fps_max_frames": {"trainer.fps_max_frames": 256},
    "package.name": {"package.name": "other"},
    "package.compress": {"package.compress": "gzip"},
    "package.include": {"package.include": ["packed_wds"]},
    "package.hyperparameters": {"package.hyperparameters": {"lr": 1e-5}},
    "package.train_command": {"package.train_command": "torchrun train.py"},
    "dedup.exact": {"dedup.exact": False},
    "dedup.near_images": {"dedup.near_images": True},
    "dedup.near_videos": {"dedup.near_videos": True},
    "dedup.near_text": {"dedup.near_text": True},
    "dedup.media_only": {"dedup.media_only": True},
    "dedup.image_distance": {"dedup.image_distance": 3},
    "dedup.video_distance": {"dedup.video_distance": 4.5},
    "dedup.video_frames": {"dedup.video_frames": 4},
    "dedup.text_threshold": {"dedup.text_threshold": 0.7},
    "dedup.text_shingle_chars": {"dedup.text_shingle_chars": 3},
    "dedup.text_permutations": {"dedup.text_permutations": 64},
    "dedup.priority": {"dedup.priority": ["b"]},
    "dedup.max_removed_share": {"dedup.max_removed_share": 0.1},
}


def documented_readers() -> dict[str, set[str]]:
    """§1.1's table: key -> the assets whose fingerprint it is part of (asides in parentheses left out)."""
    section = DOCS.read_text(encoding="utf-8").split("### 1.1 ", 1)[1].split("\n## ", 1)[0]
    readers = {}
    for line in section.splitlines():
        match = re.match(r"\| `([^`]+)` \| (.*) \|$", line)
        if match:
            readers[match.group(1)] = set(re.findall(r"`([a-z_]+)`", _without_asides(match.group(2))))
    return readers


def _without_asides(text: str) -> str:
    kept, depth = [], 0
    for char in text:
        depth += char == "("
        if not depth:
            kept.append(char)
        depth -= char == ")" and depth > 0
    return "".join(kept)


def loader_keys(tmp_path: Path) -> set[str]:
    """Every key the loader accepts, read from its unknown-key errors."""

    def allowed(data: dict[str, Any]) -> list[str]:
        path = tmp_path / "probe.yaml"
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(ConfigError) as error:
            load_config(path)
        return re.search(r"unknown key \(allowed: ([^)]*)\)", str(error.value)).group(1).split(", ")

    keys = set()
    sections = {"storage", "model", "sample", "packing", "wds", "frame_cache", "package", "trainer", "dedup"}
    for key in allowed({"bogus": 1}):
        if key in sections:
            keys |= {f"{key}.{name}" for name in allowed({key: {"bogus": 1}})}
        elif key == "sources":
            source = {"name": "a", "kind": "flat_dir", "path": str(tmp_path), "bogus": 1}
            keys |= {f"sources[].{name}" for name in allowed({"sources": [source]})}
        else:
            keys.add(key)
    return keys


@pytest.fixture
def site(tmp_path: Path) -> Path:
    source = tmp_path / "source"
    source.mkdir()
    (source / "s1.json").write_text('{"messages": [{"role": "user", "content": "hi"}]}')
    (source / FRAMES_SOURCE_FILE).write_text("")
    shutil.copytree(source, tmp_path / "copy")
    for name in ("other_root", "other_inbox", "processor"):
        (tmp_path / name).mkdir()
    (tmp_path / "processor" / "preprocessor_config.json").write_text('{"min_pixels": 3136}')
    return tmp_path


def base_config() -> dict[str, Any]:
    return {"storage": {"root": "data"}, "inbox": "inbox",
            "sources": [{"name": "a", "kind": "flat_dir", "path": "source"},
                        {"name": "b", "kind": "flat_dir", "path": "source"}]}


def fingerprints(site: Path, changes: dict[str, Any]) -> dict[str, str]:
    """Each asset's fingerprint under `changes`, its upstreams' recorded fingerprints held fixed."""
    config = base_config()
    for key, value in changes.items():
        section, _, name = key.rpartition(".")
        if section == "sources[]":
            config["sources"][0][name] = value
        elif section:
            config.setdefault(section, {})[name] = value
        else:
            config[name] = value
    app = load_config(_written(site, config))
    current = Fingerprints(app, processor_fingerprint(app.model), list(app.sources),
                           recorded=lambda asset, partition: f"{asset}[{partition}] as recorded")
    first = app.sources[0].name
    return {**{asset: current.of(asset, first) for asset in SOURCE_ASSETS},
            **{asset: current.of(asset) for asset in GLOBAL_ASSETS},
            "frame_cache_shard": current.of("frame_cache_shard", SHARD),
            "sample_length_chunk": current.of("sample_length_chunk", chunk_partition_key(first, 0))}


def test_every_config_key_has_a_row_in_the_docs(tmp_path):
    documented = set(documented_readers())
    accepted = loader_keys(tmp_path)
    assert accepted - documented == set(), "keys the loader accepts without a row in docs/formats.md §1.1"
    assert documented - accepted == set(), "rows in docs/formats.md §1.1 for keys the loader does not accept"
    assert set(CHANGES) == accepted, "a changed value for every key"


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_changing_a_setting_changes_exactly_the_fingerprints_of_its_readers(site, key):
    readers = documented_readers()
    setting = BASES.get(key, {})
    base = fingerprints(site, setting)
    changed = fingerprints(site, {**setting, **CHANGES[key]})
    expected = set().union(*(readers[name] for name in CHANGES[key]))
    assert {asset for asset in base if changed[asset] != base[asset]} == expected


def test_an_upstream_rebuilt_since_changes_the_fingerprint_its_follower_should_have(site):
    """Provenance: a follower's fingerprint is a function of what its upstream recorded, not of the config."""
    app = load_config(_written(site, base_config()))
    records = {("packing_bins", "a"): "bins built under max_token_len 8192"}
    current = Fingerprints(app, "processor", list(app.sources), recorded=lambda asset, partition: records.get((asset, partition), ""))
    built = current.of("packed_json", "a")
    records[("packing_bins", "a")] = "bins rebuilt under max_token_len 1024"
    assert current.of("packed_json", "a") != built


def test_a_rebuilt_length_table_makes_the_frame_plan_stale(site):
    """The plan takes the videos of the samples the length tables accept: a rebuilt one may reject others."""
    app = load_config(_written(site, base_config()))
    records = {("sample_catalog", "a"): "catalogue", ("sample_lengths", "a"): "lengths"}
    current = Fingerprints(app, "processor", list(app.sources), recorded=lambda asset, partition: records.get((asset, partition), ""))
    built = current.of("video_frame_plan")
    records[("sample_lengths", "a")] = "lengths measured again, a one-frame video now rejected"
    assert current.of("video_frame_plan") != built


def _written(site: Path, config: dict[str, Any]) -> Path:
    path = site / "vlm_assets.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_source_walk_digests_every_file_once_by_path_name_size_mtime_and_ctime(tmp_path):
    """The digest is the one of the sorted listing as JSON, spelled out in full (an upgrade must not
    make every source look changed), for names JSON must escape and for a manifest its media root holds."""
    from stat import S_ISREG

    from vlm_assets.config import SourceConfig
    from vlm_assets.catalog.source_walk import walk_source
    from vlm_assets.fingerprints import digest

    media = tmp_path / "media"
    (media / "nested" / "deeper").mkdir(parents=True)
    names = ["a.jpg", 'quote".jpg', "back\\slash.jpg", "é-accent.jpg", "tab\tname.jpg", "nested/b.png",
             "nested/deeper/c.png", ".hidden.jpg", "train.jsonl"]
    for number, name in enumerate(names):
        (media / name).write_bytes(b"x" * number)
    (media / "nested" / "link.png").symlink_to(media / "a.jpg")
    source = SourceConfig("s", "jsonl", media / "train.jsonl", media)  # the manifest is walked from both roots

    listed = sorted((str(path), path.stat().st_size, path.stat().st_mtime_ns, path.stat().st_ctime_ns)
                    for path in media.rglob("*")
                    if S_ISREG(path.stat().st_mode) and not path.name.startswith("."))
    limits = [[], source.max_record_bytes, source.max_json_depth, source.max_image_pixels]
    walked = walk_source(source, [])
    assert walked.digest == digest("jsonl", str(source.path), str(media), limits, listed)
    assert len(listed) == 9  # the link counts, as the file it leads to; the hidden file does not


def test_a_source_snapshot_split_among_processes_counts_every_file_once(tmp_path):
    from vlm_assets.config import SourceConfig
    from vlm_assets.catalog.source_walk import source_snapshot, walk_source

    media = tmp_path / "media"
    (media / "nested").mkdir(parents=True)
    for number in range(40):
        (media / ("nested" if number % 3 else ".") / f"img{number}.jpg").write_bytes(b"x" * number)
    (media / ".hidden.jpg").write_bytes(b"hidden")
    (media / "nested" / "link.jpg").symlink_to(media / "img0.jpg")
    (media / "dangling.jpg").symlink_to(media / "gone.jpg")
    (tmp_path / "train.jsonl").write_text("{}\n")
    source = SourceConfig("s", "jsonl", tmp_path / "train.jsonl", media)  # a media root of its own: walked too

    one = source_snapshot(source, [])
    assert one == walk_source(source, []).snapshot
    assert one[0] == 40 + 1 + 1  # the images, the link (as the file it leads to), the manifest
    assert source_snapshot(source, [], processes=2) == source_snapshot(source, [], processes=3) == one
    (media / "nested" / "img7.jpg").write_bytes(b"y" * 7)  # same size, newer
    assert source_snapshot(source, [], processes=2) != one
