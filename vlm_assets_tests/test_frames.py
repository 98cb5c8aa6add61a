"""Video frame cache: probing, sampling, decode strategy, shards, index, reader, assets, CLI."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import av
import dagster as dg
import numpy as np
import pandas as pd
import pytest
from PIL import Image

from vlm_assets.catalog.schema import LENGTH_COLUMNS
from vlm_assets.media.refs import tar_member_ref
from vlm_assets.config import FrameCacheConfig
from vlm_assets.defs.frame_cache import assets as frame_cache_assets, checks as frame_cache_checks
from vlm_assets.defs.resources import FRAME_CACHE_SHARD_PARTITIONS, VlmConfig
from vlm_assets.frames import cli as frames_cli
from vlm_assets.media.video import (
    FrameResizer,
    decode_sampled_frames,
    opened_video,
    should_seek,
)
from vlm_assets.frames.index import verify_coverage, verify_shard, write_index
from vlm_assets.frames.mosaic import encode_jpeg, tile_frames
from vlm_assets.frames.plan import (
    extend_plan,
    load_frames_source,
    read_plan,
    shard_members,
    write_plan,
)
from vlm_assets.media.video_probe import (
    SampledFrames,
    VideoError,
    probe_video,
    sample_indices,
)
from vlm_assets.frames.reader import FrameCacheReader
from vlm_assets.frames.render import render_mosaic
from vlm_assets.frames.shard import done_path, ensure_shard, tar_path
from vlm_assets.layout import StorageLayout

SMALL = FrameCacheConfig(num_frames=8, frame_size=64, rows=2, cols=4, jpeg_quality=90, videos_per_shard=3)


def frame_image(index: int, width: int, height: int) -> np.ndarray:
    """Frame `index` of generated videos: top half grey 30+12*(index//16), bottom 30+12*(index%16)."""
    image = np.empty((height, width, 3), dtype=np.uint8)
    image[: height // 2] = 30 + 12 * (index // 16)
    image[height // 2 :] = 30 + 12 * (index % 16)
    return image


def make_video(
    path: Path,
    frames: int = 30,
    codec: str = "libx264",
    container_format: str | None = None,
    size: tuple[int, int] = (96, 64),
    fps: int = 25,
    gop: int = 10,
    durations: list[int] | None = None,
    options: dict[str, str] | None = None,
) -> Path:
    """A clip whose frames show their index (`frame_image`); `durations` (ms per frame) makes it VFR."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w", format=container_format, options=options or {}) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        stream.codec_context.gop_size = gop
        if durations is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
            stream.time_base = Fraction(1, 1000)
        pts = 0
        for index in range(frames):
            image = frame_image(index, *size)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            if durations is not None:
                frame.pts, frame.time_base = pts, Fraction(1, 1000)
                pts += durations[index]
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def frame_number(frame: np.ndarray) -> int:
    height = frame.shape[0]
    high = float(frame[height // 8 : height * 3 // 8].mean())
    low = float(frame[height * 5 // 8 : height * 7 // 8].mean())
    return 16 * round((high - 30) / 12) + round((low - 30) / 12)


def all_frames(path: str, size: int) -> list[np.ndarray]:
    """Reference: every frame decoded front to back, no seeking."""
    resize = FrameResizer(size)
    with opened_video(path) as (container, stream):
        return [resize(frame) for frame in container.decode(stream)]


def write_catalog(root: Path, source: str, refs: list[tuple[str, str]], length_rejects: tuple[str, ...] = ()) -> Path:
    """A minimal catalog/<source>.parquet with one sample per (key, ref) video, and its length table
    (lengths/<source>.parquet) rejecting the samples of the keys in `length_rejects`."""
    rows = [
        {
            "sample_id": f"{source}/{i}", "source": source, "origin": ref, "status": "ok", "reason": "",
            "messages": "[]", "n_turns": 2, "media_files": [Path(key).name], "media_kinds": ["video"],
            "media_refs": [ref], "media_keys": [key], "media_type": "video",
        }
        for i, (key, ref) in enumerate(refs)
    ]
    rows.append({**rows[0], "sample_id": f"{source}/rejected", "status": "rejected", "reason": "test",
                 "media_keys": [f"{source}/rejected.mp4"], "media_refs": ["/nonexistent.mp4"]})
    path = root / "catalog" / f"{source}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    lengths = []
    for row in rows:
        rejected = row["media_keys"][0] in length_rejects
        status = "rejected" if rejected else row["status"]
        reason = "video with 1 frame: too few to sample" if rejected else row["reason"]
        lengths.append({"sample_id": row["sample_id"], "status": status, "reason": reason, "token_len": 0 if status != "ok" else 100,
                        "text_tokens": 10, "image_tokens": 0, "video_tokens": 90})
    (root / "lengths").mkdir(exist_ok=True)
    pd.DataFrame(lengths, columns=list(LENGTH_COLUMNS)).to_parquet(root / "lengths" / f"{source}.parquet", index=False)
    return path


def write_config(path: Path, storage: Path, frame_cache: FrameCacheConfig, sources: list[str]) -> Path:
    lines = [f"storage: {{root: {storage}}}", "sources:"]
    lines += [f"  - {{name: {name}, kind: flat_dir, path: {path.parent / name}}}" for name in sources]
    settings = ", ".join(f"{k}: {getattr(frame_cache, k)}" for k in ("num_frames", "frame_size", "rows", "cols", "jpeg_quality", "videos_per_shard"))
    lines.append(f"frame_cache: {{{settings}}}")
    path.write_text("\n".join(lines) + "\n")
    for name in sources:
        (path.parent / name).mkdir(exist_ok=True)
    return path


def build_cache(cache_dir: Path, videos: list[tuple[str, str]], config: FrameCacheConfig = SMALL):
    plan, _ = extend_plan(read_plan(cache_dir), videos, config)
    write_plan(cache_dir, plan)
    for shard, members in shard_members(plan).items():
        ensure_shard(cache_dir, shard, members, config)
    return plan, write_index(cache_dir, plan, config)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clips")
    clips = {
        "h264.mp4": make_video(root / "h264.mp4"),
        "vp9.webm": make_video(root / "vp9.webm", codec="libvpx-vp9", frames=20),
        "mpeg4.avi": make_video(root / "mpeg4.avi", codec="mpeg4", frames=24),
        "mjpeg.mkv": make_video(root / "mjpeg.mkv", codec="mjpeg", frames=12),
        "hevc.mov": make_video(root / "hevc.mov", codec="libx265", frames=16),
        "long_gop.mp4": make_video(root / "long_gop.mp4", frames=120, gop=40),
        "vfr.mp4": make_video(root / "vfr.mp4", frames=40, durations=[20 if i % 3 else 90 for i in range(40)]),
    }
    extensionless = root / "no_extension"
    shutil.copy(clips["h264.mp4"], extensionless)
    clips["no_extension"] = extensionless
    full_clips = {
        "truncated.mp4": clips["long_gop.mp4"],  # index (moov) at the end: cannot even open
        "truncated_faststart.mp4": make_video(root / "faststart.mp4", frames=120, gop=40, options={"movflags": "faststart"}),
        "truncated.mkv": make_video(root / "full.mkv", frames=120, gop=40),
    }
    for name, full in full_clips.items():
        (root / name).write_bytes(full.read_bytes()[: full.stat().st_size * 6 // 10])
        clips[name] = root / name
    zero = root / "zero.mp4"
    with av.open(str(zero), mode="w") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        container.start_encoding()  # header only, not one frame
    clips["zero.mp4"] = zero
    not_video = root / "notes.mp4"
    not_video.write_text("this is not a video\n")
    clips["notes.mp4"] = not_video
    return clips


GOOD = ["h264.mp4", "vp9.webm", "mpeg4.avi", "mjpeg.mkv", "hevc.mov", "long_gop.mp4", "vfr.mp4", "no_extension"]
BAD = ["truncated.mp4", "truncated_faststart.mp4", "truncated.mkv", "zero.mp4", "notes.mp4"]


def test_sample_indices_spread_over_decodable_frames():
    assert sample_indices(100, 4) == [0, 33, 66, 99]
    assert sample_indices(3, 8) == [0, 0, 1, 1, 1, 1, 2, 2]
    assert sample_indices(1, 2) == [0, 0]
    with pytest.raises(VideoError):
        sample_indices(0, 8)


def test_should_seek_only_past_the_next_keyframe():
    keyframes = (0, 40, 80)
    assert should_seek(keyframes, -1, 50)  # skipping frames 0..39
    assert not should_seek(keyframes, -1, 39)
    assert not should_seek(keyframes, 10, 39)
    assert not should_seek(keyframes, 39, 45)  # next frame to decode is the keyframe itself
    assert should_seek(keyframes, 10, 80)
    assert not should_seek(keyframes, 81, 119)


@pytest.mark.parametrize("name", GOOD)
def test_generated_clips_pick_the_sampled_frames(clips, name):
    path = str(clips[name])
    probe = probe_video(path)
    expected_total = {"vp9.webm": 20, "mpeg4.avi": 24, "mjpeg.mkv": 12, "hevc.mov": 16, "long_gop.mp4": 120, "vfr.mp4": 40}
    assert probe.total_frames == expected_total.get(name, 30)
    sampled, frames = decode_sampled_frames(path, 8, 32)
    indices = sampled.frame_indices
    assert (sampled.total_frames, indices) == (probe.total_frames, sample_indices(probe.total_frames, 8))
    assert [frame_number(frame) for frame in frames] == indices
    reference = all_frames(path, 32)
    assert all(np.array_equal(frame, reference[index]) for frame, index in zip(frames, indices))


def test_variable_frame_rate_indices_follow_frames_not_time(clips):
    probe = probe_video(str(clips["vfr.mp4"]))
    assert probe.timestamps_reliable
    assert 20 < probe.fps < 40  # 40 frames over ~1.7 s
    sampled, frames = decode_sampled_frames(str(clips["vfr.mp4"]), 8, 16)
    assert [frame_number(frame) for frame in frames] == sampled.frame_indices == sample_indices(probe.total_frames, 8)


REAL_VIDEOS = {
    "LLaMA-Factory/data/mllm_demo_data/1.mp4": 243,
    "LLaMA-Factory/data/mllm_demo_data/2.avi": 270,
    "decord/examples/flipping_a_pancake.mkv": 310,  # header says 0 frames
    "decord/tests/test_data/video_90.mov": 3,
    "decord/tests/test_data/unordered.mov": 4,
    "mmaction2/demo/demo.mp4": 280,
    "mmaction2/tests/data/test.avi": 164,  # packed B-frames: counted, not located by timestamp
    "torchcodec/test/resources/av1_video.mkv": 125,
    "torchcodec/test/resources/h264_10bits.mp4": 30,
    "torchcodec/test/resources/h265_video.mp4": 10,
    "torchcodec/test/resources/nasa_13013.mp4": 325,
    "torchcodec/test/resources/var_fps_video.mp4": 300,
}


@pytest.mark.parametrize("name", sorted(REAL_VIDEOS))
def test_real_videos_match_front_to_back_decoding(name, real_file):
    path = str(real_file(name))
    probe = probe_video(path)
    assert probe.total_frames == REAL_VIDEOS[name]
    sampled, frames = decode_sampled_frames(path, 16, 24)
    indices = sampled.frame_indices
    reference = all_frames(path, 24)
    assert len(reference) == probe.total_frames == sampled.total_frames
    assert indices == sample_indices(probe.total_frames, 16)
    assert all(np.array_equal(frame, reference[index]) for frame, index in zip(frames, indices))


def test_resizer_reused_across_frame_sizes_matches_a_fresh_reformat():
    rng = np.random.default_rng(7)
    resize = FrameResizer(48)
    for width, height, pix_fmt in ((320, 240, "yuv420p"), (128, 96, "yuv420p"), (200, 120, "rgb24")):
        image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        frame = av.VideoFrame.from_ndarray(image, format="rgb24").reformat(format=pix_fmt)
        fresh = frame.reformat(width=48, height=48, interpolation="BICUBIC").to_ndarray(format="rgb24")
        assert np.array_equal(resize(frame), fresh)


def test_mosaic_kept_with_a_padding_byte_encodes_to_the_same_jpeg_as_plain_rgb():
    rng = np.random.default_rng(3)
    frames = [av.VideoFrame.from_ndarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8), format="rgb24")
              .reformat(format="yuv420p") for _ in range(5)]
    rgb, rgba = FrameResizer(32), FrameResizer(32, "rgba")
    tiles = [(rgb(frame), rgba(frame)) for frame in frames]
    for plain, padded in tiles:
        assert padded.shape == (32, 32, 4) and np.array_equal(padded[..., :3], plain)
    plain_canvas = np.zeros((2 * 32, 3 * 32, 3), dtype=np.uint8)
    for position, (plain, _) in enumerate(tiles):
        plain_canvas[position // 3 * 32 : (position // 3 + 1) * 32, position % 3 * 32 : (position % 3 + 1) * 32] = plain
    padded_canvas = tile_frames([padded for _, padded in tiles], 2, 3, 32)
    assert padded_canvas.shape[2] == 4
    assert encode_jpeg(padded_canvas, 95) == encode_jpeg(plain_canvas, 95)
    assert encode_jpeg(tile_frames([plain for plain, _ in tiles], 2, 3, 32), 95) == encode_jpeg(plain_canvas, 95)


@pytest.mark.parametrize("num_frames", [SMALL.num_frames, 5])
def test_mosaic_rendered_after_another_shows_nothing_of_it(clips, num_frames):
    """A thread reuses its canvas from video to video, also for a mosaic of fewer frames than cells."""
    config = FrameCacheConfig(num_frames, SMALL.frame_size, SMALL.rows, SMALL.cols, SMALL.jpeg_quality, SMALL.videos_per_shard)

    def render_in_turn(jobs: list[tuple[str, FrameCacheConfig]]) -> list[bytes]:
        return [render_mosaic(str(clips[name]), job_config)[0] for name, job_config in jobs]

    with ThreadPoolExecutor(max_workers=1) as fresh_thread:
        (alone,) = fresh_thread.submit(render_in_turn, [("vp9.webm", config)]).result()
    with ThreadPoolExecutor(max_workers=1) as fresh_thread:
        after_first, after_second = fresh_thread.submit(render_in_turn, [("long_gop.mp4", SMALL), ("vp9.webm", config)]).result()
    assert after_second == alone != after_first
    assert Image.open(io.BytesIO(alone)).size == (SMALL.cols * SMALL.frame_size, SMALL.rows * SMALL.frame_size)


def test_rotated_mov_is_turned_upright(real_file):
    with opened_video(str(real_file("decord/tests/test_data/video_90.mov"))) as (container, stream):
        frame = next(container.decode(stream))
        assert frame.rotation == -90
        raw = frame.reformat(width=32, height=32, interpolation="BICUBIC").to_ndarray(format="rgb24")
        assert np.array_equal(FrameResizer(32)(frame), np.rot90(raw, -1))  # 90° clockwise for display


def test_shard_records_failures_and_completes(clips, tmp_path, real_file):
    videos = [(f"gen/{name}", str(clips[name])) for name in GOOD + BAD]
    videos.append(("real/corrupted.mp4", str(real_file("decord/tests/test_data/corrupted.mp4"))))
    plan, summary = build_cache(tmp_path, videos)
    assert summary.records == len(GOOD)
    assert summary.failed == len(BAD) + 1 and summary.skipped == 0
    failures = {row["video"]: row["error"] for row in map(json.loads, (tmp_path / "failures.jsonl").read_text().splitlines())}
    assert set(failures) == {f"gen/{name}" for name in BAD} | {"real/corrupted.mp4"}
    assert "no video stream" in failures["gen/zero.mp4"]  # FFmpeg drops a track without samples
    assert "truncated" in failures["gen/truncated.mkv"]
    assert "corrupted.mp4" in failures["real/corrupted.mp4"]
    assert all(str(clips[name]) in failures[f"gen/{name}"] for name in BAD)
    assert verify_coverage(tmp_path, plan) == []
    for shard, members in shard_members(plan).items():
        record, reused = ensure_shard(tmp_path, shard, members, SMALL)
        assert reused and verify_shard(tmp_path, record, SMALL) == []


def test_reader_round_trips_frames(clips, tmp_path):
    build_cache(tmp_path, [(f"gen/{name}", str(clips[name])) for name in GOOD])
    reader = FrameCacheReader(tmp_path)
    for name in GOOD:
        record = reader.record(f"gen/{name}")
        frames = reader.read(f"gen/{name}")
        assert frames.shape == (8, 64, 64, 3) and frames.dtype == np.uint8
        assert [frame_number(frame) for frame in frames] == record["frame_indices"]
        with tarfile.open(tar_path(tmp_path, record["shard"])) as tar:
            member = next(m for m in tar.getmembers() if m.offset_data == record["offset"])
            assert tar.extractfile(member).read() == reader.read_jpeg(f"gen/{name}")
    with pytest.raises(KeyError):
        reader.read("gen/unknown.mp4")


def test_full_size_mosaic_64_frames_384px(tmp_path, real_file):
    config = FrameCacheConfig(num_frames=64, frame_size=384, rows=4, cols=16, jpeg_quality=95, videos_per_shard=256)
    path = real_file("mmaction2/demo/demo.mp4")
    build_cache(tmp_path, [("real/demo.mp4", str(path))], config)
    reader = FrameCacheReader(tmp_path)
    record = reader.record("real/demo.mp4")
    assert record["frame_indices"] == sample_indices(280, 64) and record["total_frames"] == 280
    with Image.open(io.BytesIO(reader.read_jpeg("real/demo.mp4"))) as mosaic:
        assert mosaic.size == (6144, 1536)
    frames = reader.read("real/demo.mp4")
    assert frames.shape == (64, 384, 384, 3)
    planned = SampledFrames(record["total_frames"], record["fps"], record["frame_indices"])
    _, decoded = decode_sampled_frames(str(path), 64, 384, planned)
    error = np.abs(frames.astype(int) - np.stack(decoded).astype(int)).mean(axis=(1, 2, 3))
    assert error.max() < 4  # JPEG q95 only; a wrong tile order would be far off
    assert json.loads((tmp_path / "metadata.json").read_text())["order"] == "row-major"


def test_plan_is_append_only_and_shares_decoding(clips, tmp_path):
    first = [(f"gen/{name}", str(clips[name])) for name in GOOD[:4]]
    plan, _ = build_cache(tmp_path, first)
    assert [video.shard for video in plan] == ["part-00000"] * 3 + ["part-00001"]
    done_before = {shard: done_path(tmp_path, shard).read_bytes() for shard in ("part-00000", "part-00001")}
    alias = tmp_path / "alias.mp4"
    alias.symlink_to(clips["h264.mp4"])
    more = first + [("other/alias.mp4", str(alias))] + [(f"gen/{name}", str(clips[name])) for name in GOOD[4:7]]
    plan2, summary = build_cache(tmp_path, more)
    assert [(v.video_id, v.shard) for v in plan2[:4]] == [(v.video_id, v.shard) for v in plan]
    assert [video.shard for video in plan2[4:]] == ["part-00001", "part-00001", "part-00002"]
    assert plan2[0].keys == ["gen/h264.mp4", "other/alias.mp4"] and len(plan2) == 7
    assert done_path(tmp_path, "part-00000").read_bytes() == done_before["part-00000"]  # reused untouched
    assert done_path(tmp_path, "part-00001").read_bytes() != done_before["part-00001"]  # grew, rebuilt
    index = [json.loads(line) for line in (tmp_path / "index.jsonl").read_text().splitlines()]
    shared = [row for row in index if row["video"] in ("gen/h264.mp4", "other/alias.mp4")]
    assert shared[0]["offset"] == shared[1]["offset"] and summary.records == 8


def test_tar_refs_and_seed_frames_source_import(clips, tmp_path):
    archive = tmp_path / "videos.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(clips["h264.mp4"], arcname="clip.mp4")
    with tarfile.open(archive) as tar:
        member = tar.getmember("clip.mp4")
    ref = tar_member_ref(archive, member.offset_data, member.size)
    source_file = tmp_path / "video_frames_source.jsonl"
    source_file.write_text(json.dumps({"video": "clips/a.mp4", "total_frames": 30, "fps": 25.0, "frame_indices": [1, 2, 3, 4, 5, 6, 7, 8]}) + "\n")
    known = load_frames_source(source_file, "seed", tmp_path)
    assert known == {"seed/clips/a.mp4": SampledFrames(30, 25.0, [1, 2, 3, 4, 5, 6, 7, 8])}
    plan, summary = build_cache(tmp_path / "cache", [("wds/clip.mp4", ref)])
    assert summary.records == 1
    assert [frame_number(f) for f in FrameCacheReader(tmp_path / "cache").read("wds/clip.mp4")] == plan[0].frame_indices
    imported, _ = extend_plan([], [("seed/clips/a.mp4", str(clips["h264.mp4"]))], SMALL, known)
    assert imported[0].frame_indices == [1, 2, 3, 4, 5, 6, 7, 8]


INTERRUPT = """
import os, signal, sys
from pathlib import Path
from vlm_assets.config import FrameCacheConfig
from vlm_assets.frames.plan import read_plan, shard_members
from vlm_assets.frames.shard import build_shard
cache = Path(sys.argv[1])
config = FrameCacheConfig(num_frames=8, frame_size=64, rows=2, cols=4, jpeg_quality=90, videos_per_shard=3)
def die(done, video, error):
    if done == 2:
        os.kill(os.getpid(), signal.SIGKILL)
build_shard(cache, "part-00000", shard_members(read_plan(cache))["part-00000"], config, on_video=die)
"""


def test_interrupted_shard_resumes_to_the_same_index(clips, tmp_path):
    videos = [(f"gen/{name}", str(clips[name])) for name in GOOD[:5]]
    reference_dir, resumed_dir = tmp_path / "reference", tmp_path / "resumed"
    build_cache(reference_dir, videos)
    plan, _ = extend_plan([], videos, SMALL)
    write_plan(resumed_dir, plan)
    ensure_shard(resumed_dir, "part-00001", shard_members(plan)["part-00001"], SMALL)
    killed = subprocess.run([sys.executable, "-c", INTERRUPT, str(resumed_dir)], cwd=Path(__file__).parents[1], check=False)
    assert killed.returncode == -9
    assert not tar_path(resumed_dir, "part-00000").exists() and not done_path(resumed_dir, "part-00000").exists()
    assert list(resumed_dir.glob(".part-00000.tar~*.tmp"))  # the half-written tar is left behind
    summary = write_index(resumed_dir, plan, SMALL)
    assert summary.skipped == 3 and summary.records == 2
    tar_path(resumed_dir, "part-00001").unlink()  # tar gone but done kept: must rebuild too
    _, summary = build_cache(resumed_dir, videos)
    assert summary.records == 5 and summary.skipped == 0
    assert not list(resumed_dir.glob(".*.tmp"))
    resumed_index = (resumed_dir / "index.jsonl").read_text()
    assert resumed_index == (reference_dir / "index.jsonl").read_text()
    keys = [json.loads(line)["video"] for line in resumed_index.splitlines()]
    assert len(keys) == len(set(keys)) == 5
    for shard in ("part-00000", "part-00001"):
        assert tar_path(resumed_dir, shard).read_bytes() == tar_path(reference_dir, shard).read_bytes()


def test_assets_checks_and_cli(clips, tmp_path, capsys):
    storage = tmp_path / "data"
    write_catalog(storage, "alpha", [(f"alpha/{name}", str(clips[name])) for name in GOOD[:3] + ["zero.mp4"]])
    # A video whose sample the token lengths reject is never packed: neither planned nor indexed.
    write_catalog(storage, "beta", [("beta/same_as_h264.mp4", str(clips["h264.mp4"])), ("beta/vfr.mp4", str(clips["vfr.mp4"])),
                                    ("beta/one_frame.mov", str(clips["hevc.mov"]))], length_rejects=("beta/one_frame.mov",))
    config = write_config(tmp_path / "vlm.yaml", storage, SMALL, ["alpha", "beta"])
    resources = {"vlm_config": VlmConfig(config_path=str(config))}
    instance = dg.DagsterInstance.ephemeral()
    assets = {asset.key.to_user_string(): asset for asset in dg.load_assets_from_modules([frame_cache_assets])}
    plan_asset, shard_asset, index_asset = (assets[name] for name in ("video_frame_plan", "frame_cache_shard",
                                                                      "frame_cache_index"))
    checks = {next(iter(check.check_keys)).name: check
              for check in dg.load_asset_checks_from_modules([frame_cache_assets, frame_cache_checks])}
    shard_check, coverage_check = checks["frame_cache_shard_matches_record"], checks["frame_cache_covers_plan"]

    result = dg.materialize([plan_asset], resources=resources, instance=instance, selection=[plan_asset])
    assert result.success
    shards = instance.get_dynamic_partitions(FRAME_CACHE_SHARD_PARTITIONS.name)
    assert shards == ["part-00000", "part-00001"]
    planned = {key for video in read_plan(StorageLayout(storage).frame_cache_dir(SMALL)) for key in video.keys}
    assert "beta/vfr.mp4" in planned and "beta/one_frame.mov" not in planned
    for shard in shards:
        result = dg.materialize([shard_asset, shard_check], resources=resources, instance=instance, partition_key=shard)
        assert result.success
        evaluations = result.get_asset_check_evaluations()
        assert [evaluation.passed for evaluation in evaluations] == [True]
    result = dg.materialize([index_asset, coverage_check], resources=resources, instance=instance)
    assert result.success and all(e.passed for e in result.get_asset_check_evaluations())
    metadata = result.asset_materializations_for_node("frame_cache_index")[0].metadata
    assert metadata["summary"].value == "RGB cache: 5 records, 0 skipped, 1 failed"
    indexed = [json.loads(line)["video"] for name in ("index.jsonl", "failures.jsonl")
               for line in (Path(metadata["path"].value) / name).read_text().splitlines()]
    assert "beta/vfr.mp4" in indexed and "beta/one_frame.mov" not in indexed

    out = tmp_path / "frames"
    assert frames_cli.get_frames(_get_args("beta/same_as_h264.mp4", out, config)) == 0
    written = sorted(out.glob("*.png"))
    assert len(written) == 8 and Image.open(written[0]).size == (64, 64)
    assert frames_cli.get_frames(_get_args("beta/missing.mp4", out, config)) == 1
    error = capsys.readouterr().err
    assert "not in the frame cache" in error and "it holds 5 video keys, e.g. beta/" in error  # the most similar first
    assert frames_cli.get_frames(_get_args("alpha/zero.mp4", out, config)) == 1
    assert "alpha/zero.mp4' is not in the frame cache" in (error := capsys.readouterr().err) and "could not be cached" in error


def _get_args(video: str, out: Path, config: Path):
    import argparse

    parser = argparse.ArgumentParser()
    frames_cli.register(parser.add_subparsers())
    return parser.parse_args(["frames", "get", video, "--out", str(out), "--config", str(config)])
