"""A medium replaced, deleted and restored, or restored with its old times after the catalogue was
built is never taken as up to date: each rerun through `vlm-assets run` gives what a clean build of
the media as they are now gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from vlm_assets.catalog.source_walk import walk_source
from vlm_assets.config import load_config
from vlm_assets.layout import StorageLayout
from vlm_assets_tests.run_support import run, snapshot

pytestmark = pytest.mark.processes

WORKERS = ("--workers", "2")
RECORDS = 40


def _site(tmp_path: Path, demo_config_path: Path) -> Path:
    """A flat_dir of small one-image records and the demo's clips as a JSON-lines source."""
    images = tmp_path / "many"
    (images / "photos").mkdir(parents=True)
    for number in range(RECORDS):
        Image.new("RGB", (64, 64), (number * 5, 90, 200)).save(images / "photos" / f"{number:05d}.png")
        record = {"messages": [{"role": "user", "content": f"<image>What is in picture {number}?"},
                               {"role": "assistant", "content": "A coloured square."}],
                  "images": [f"photos/{number:05d}.png"]}
        (images / f"{number:05d}.json").write_text(json.dumps(record))
    videos = tmp_path / "videos"
    shutil.copytree(demo_config_path.parent / "media" / "clips", videos / "clips")
    manifest = [json.loads(line) for line in (demo_config_path.parent / "video_train.jsonl").read_text().splitlines()]
    (videos / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in manifest
                                                if all(path.startswith("clips/") for path in line.get("videos", []))))
    config = {
        "storage": {"root": str(tmp_path / "vlm_data")},
        "inbox": str(tmp_path / "inbox"),
        "sources": [{"name": "many", "kind": "flat_dir", "path": str(images)},
                    {"name": "clips", "kind": "jsonl", "path": str(videos / "train.jsonl"),
                     "media_root": str(videos)}],
        "model": {"processor": "embedded", "processor_kwargs": {"min_pixels": 3136, "max_pixels": 1003520}},
        "sample": {"sample_type": "packed_multi_mix_qa", "max_token_len": 2048, "text_key": "messages"},
        "frame_cache": {"num_frames": 8, "frame_size": 64, "rows": 2, "cols": 4, "videos_per_shard": 1},
    }
    path = tmp_path / "vlm_assets.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _run(config: Path, home: Path, *args: str) -> str:
    result = run(config, home, *WORKERS, *args)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def _lengths(config: Path, source: str) -> dict[str, tuple[str, int]]:
    table = pq.read_table(StorageLayout(load_config(config).storage_root).lengths(source)).to_pylist()
    return {row["sample_id"]: (row["status"], row["token_len"]) for row in table}


def _restore_with_old_times(original: Path, saved: Path) -> None:
    """`cp -p`: the file's bytes, size and modification time as before; only its change time is new."""
    shutil.copy2(saved, original)


@pytest.fixture
def site(tmp_path, demo_config_path):
    return _site(tmp_path, demo_config_path)


def test_a_replaced_image_is_measured_again_and_packed_as_a_clean_build(site, tmp_path):
    home = tmp_path / "home"
    lineage = ("--select", "packed_json[many]")
    _run(site, home, *lineage)
    sample = "many/00023.json"
    before = _lengths(site, "many")[sample]
    Image.new("RGB", (1024, 1024), (10, 20, 30)).save(site.parent / "many" / "photos" / "00023.png")
    _run(site, home, *lineage)
    after = _lengths(site, "many")
    assert after[sample][0] == "ok" and after[sample][1] > before[1] + 300
    built = snapshot(StorageLayout(load_config(site).storage_root).packed_json("many").parent)
    _run(site, home, "--force", *lineage)
    assert _lengths(site, "many") == after
    assert snapshot(StorageLayout(load_config(site).storage_root).packed_json("many").parent) == built


def test_an_image_deleted_then_restored_with_its_old_times_comes_back(site, tmp_path):
    home = tmp_path / "home"
    lineage = ("--select", "packed_json[many]")
    _run(site, home, *lineage)
    first = _lengths(site, "many")
    packed = StorageLayout(load_config(site).storage_root).packed_json("many")
    first_packed = packed.read_bytes()
    image = site.parent / "many" / "photos" / "00007.png"
    saved = tmp_path / "saved.png"
    shutil.copy2(image, saved)

    image.unlink()
    _run(site, home, *lineage)
    assert _lengths(site, "many")["many/00007.json"][0] == "rejected"

    _restore_with_old_times(image, saved)
    assert (image.stat().st_size, image.stat().st_mtime_ns) == (saved.stat().st_size, saved.stat().st_mtime_ns)
    plan = run(site, home, "--plan", *lineage).stdout
    assert "stale" in plan or "missing" in plan, plan
    _run(site, home, *lineage)
    assert _lengths(site, "many") == first
    assert packed.read_bytes() == first_packed


def test_a_video_deleted_then_restored_rebuilds_its_frame_cache_shard(site, tmp_path):
    home = tmp_path / "home"
    lineage = ("--select", "frame_cache_index")
    _run(site, home, *lineage)
    cache_dir = StorageLayout(load_config(site).storage_root).frame_cache_dir(load_config(site).frame_cache)

    def cache() -> dict[str, str]:
        """The cache's files but the shards' done records, which hold their videos' stamps."""
        return {name: digest for name, digest in snapshot(cache_dir).items() if not name.endswith(".done.json")}

    clean = cache()
    video = site.parent / "videos" / "clips" / "bouncing.mp4"
    saved = tmp_path / "saved.mp4"
    shutil.copy2(video, saved)

    video.write_bytes(video.read_bytes()[: video.stat().st_size // 3])  # cut short, as a copy in progress
    _run(site, home, *lineage)
    assert cache() != clean

    _restore_with_old_times(video, saved)
    _run(site, home, *lineage)
    assert cache() == clean


def test_the_walk_of_a_source_changes_with_a_files_change_time_alone(site):
    """What makes the catalogue rebuild when a medium is restored with its old times (`cp -p`) or
    its permissions change (`chmod`): the change time."""
    source = load_config(site).sources[0]
    before = walk_source(source, [])
    image = site.parent / "many" / "photos" / "00003.png"
    image.chmod(0o600)
    assert walk_source(source, []).digest != before.digest
