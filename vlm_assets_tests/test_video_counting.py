"""Frame counts, sampled indices and truncation follow what a full front-to-back decode yields.

Every clip is generated here with PyAV: AVI with zero-size ("repeat the previous frame")
packets, variable frame rate, B-frames, a header count that is missing, too high or too low,
a stream whose first frames the decoder drops, and files really cut short. The catalogue
validates each video in one decoding pass that also renders its frame-cache mosaic; the plan
and shards take that pass's results, and give the same cache as decoding afresh.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import av
import numpy as np
import pytest

from vlm_assets.catalog.build import MediaValidator
from vlm_assets_tests.catalog_support import build_catalog
from vlm_assets.config import SourceConfig
from vlm_assets.media.video import FrameResizer, read_sampled_frames
from vlm_assets.frames.index import write_index
from vlm_assets.frames.plan import extend_plan, shard_members, write_plan
from vlm_assets.media.video_probe import VideoError, probe_video, sample_indices
from vlm_assets.frames.reader import FrameCacheReader
from vlm_assets.frames.shard import ensure_shard, tar_path
from vlm_assets.frames.spool import MosaicSpool
from vlm_assets_tests.test_frames import SMALL, frame_image, frame_number, make_video

SIZE = 32
WIDTH, HEIGHT = 96, 64


def encoded_packets(stream: av.video.stream.VideoStream, frames: int) -> list[av.Packet]:
    packets: list[av.Packet] = []
    for index in range(frames):
        packets += stream.encode(av.VideoFrame.from_ndarray(frame_image(index, WIDTH, HEIGHT), format="rgb24"))
    return packets + stream.encode(None)


def avi_with_zero_size_packets(path: Path, frames: int, zero_after: tuple[int, ...], trailing: int = 0) -> Path:
    """MPEG-4 in AVI with a zero-size packet after each packet in `zero_after` and `trailing` at the end."""
    with av.open(str(path), mode="w", format="avi") as container:
        stream = container.add_stream("mpeg4", rate=25)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.gop_size = 10
        packets = encoded_packets(stream, frames)
        slot = 0  # AVI timestamps are positions in the index, zero-size entries included

        def mux(packet: av.Packet) -> None:
            nonlocal slot
            packet.pts = packet.dts = slot
            slot += 1
            container.mux(packet)

        for number, packet in enumerate(packets):
            mux(packet)
            repeats = (number in zero_after) + (trailing if number == len(packets) - 1 else 0)
            for _ in range(repeats):
                empty = av.Packet(0)
                empty.stream, empty.time_base = stream, packet.time_base
                mux(empty)
    return path


def with_b_frames(path: Path, frames: int = 50) -> Path:
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=25, options={"bf": "3", "g": "12"})
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        for packet in encoded_packets(stream, frames):
            container.mux(packet)
    return path


def without_first_packets(source: Path, path: Path, dropped: int) -> Path:
    """`source` remuxed without its first packets: the decoder drops the frames up to the next keyframe."""
    with av.open(str(source)) as original, av.open(str(path), mode="w") as container:
        video = original.streams.video[0]
        stream = container.add_stream_from_template(video)
        for number, packet in enumerate(original.demux(video)):
            if packet.size and number >= dropped:
                packet.stream = stream
                container.mux(packet)
    return path


def with_avi_length(source: Path, path: Path, frames: int) -> Path:
    """A copy of an AVI whose stream header (strh dwLength) lists `frames`."""
    data = bytearray(source.read_bytes())
    struct.pack_into("<I", data, data.index(b"strh") + 40, frames)
    path.write_bytes(bytes(data))
    return path


def cut(source: Path, path: Path, fraction: float = 0.6) -> Path:
    data = source.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    return path


def full_decode(path: Path) -> list[np.ndarray]:
    """Reference: every frame a front-to-back decode yields, resized."""
    resize = FrameResizer(SIZE)
    with av.open(str(path)) as container:
        return [resize(frame) for frame in container.decode(container.streams.video[0])]


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("counting")
    b_frames_mkv = with_b_frames(root / "b_frames.mkv")
    complete_avi = avi_with_zero_size_packets(root / "complete.avi", 40, ())
    return {
        "zero_size.avi": avi_with_zero_size_packets(root / "zero_size.avi", 40, (5, 17, 18)),
        "zero_size_trailing.avi": avi_with_zero_size_packets(root / "zero_size_trailing.avi", 40, (9,), trailing=2),
        "vfr.mp4": make_video(root / "vfr.mp4", frames=40, durations=[20 if i % 3 else 90 for i in range(40)]),
        "b_frames.mp4": with_b_frames(root / "b_frames.mp4"),
        "b_frames.mkv": b_frames_mkv,  # Matroska lists no frame count
        "header_too_high.avi": with_avi_length(complete_avi, root / "header_too_high.avi", 60),
        "header_too_low.avi": with_avi_length(complete_avi, root / "header_too_low.avi", 10),
        "leading_dropped.mkv": without_first_packets(b_frames_mkv, root / "leading_dropped.mkv", 3),
    }


@pytest.fixture(scope="module")
def truncated(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("truncated")
    return {
        "cut.avi": cut(avi_with_zero_size_packets(root / "full.avi", 60, (5,)), root / "cut.avi"),
        "cut_faststart.mp4": cut(make_video(root / "fs.mp4", frames=120, gop=40, options={"movflags": "faststart"}), root / "cut_faststart.mp4"),
        "cut.mkv": cut(make_video(root / "full.mkv", frames=120, gop=40), root / "cut.mkv"),
    }


COUNTED = ["zero_size.avi", "zero_size_trailing.avi", "vfr.mp4", "b_frames.mp4", "b_frames.mkv",
           "header_too_high.avi", "header_too_low.avi", "leading_dropped.mkv"]


def test_the_generated_headers_disagree_with_the_decoded_frames(videos):
    def header(name: str) -> int:
        with av.open(str(videos[name])) as container:
            return container.streams.video[0].frames

    assert (header("zero_size.avi"), len(full_decode(videos["zero_size.avi"]))) == (43, 40)
    assert (header("zero_size_trailing.avi"), len(full_decode(videos["zero_size_trailing.avi"]))) == (43, 40)
    assert header("b_frames.mkv") == 0
    assert (header("header_too_high.avi"), header("header_too_low.avi")) == (60, 10)
    with av.open(str(videos["b_frames.mp4"])) as container:
        assert any(packet.pts != packet.dts for packet in container.demux(container.streams.video[0]) if packet.size)
    assert probe_video(str(videos["leading_dropped.mkv"])).total_frames == 47  # packets the decoder partly drops
    assert len(full_decode(videos["leading_dropped.mkv"])) == 39


@pytest.mark.parametrize("name", COUNTED)
def test_count_indices_and_frames_match_a_full_decode(videos, name):
    path = videos[name]
    reference = full_decode(path)
    resize = FrameResizer(SIZE)
    frames: dict[int, np.ndarray] = {}
    sampled = read_sampled_frames(str(path), 64, lambda index, frame: frames.__setitem__(index, resize(frame)))
    assert sampled.total_frames == len(reference)
    assert sampled.frame_indices == [round(i) for i in np.linspace(0, len(reference) - 1, 64)]
    assert all(np.array_equal(frames[index], reference[index]) for index in sampled.frame_indices)


@pytest.mark.parametrize("name", ["cut.avi", "cut_faststart.mp4", "cut.mkv"])
def test_truncated_video_is_refused_with_the_file_named(truncated, name):
    path = truncated[name]
    with pytest.raises(VideoError, match=str(path)):
        read_sampled_frames(str(path), 8, lambda index, frame: None)


def _jsonl_source(root: Path, paths: list[Path]) -> SourceConfig:
    lines = [json.dumps({"id": path.name, "messages": [{"role": "user", "content": "<video>?"}], "videos": [path.name]})
             for path in paths]
    (root / "s.jsonl").write_text("\n".join(lines) + "\n")
    return SourceConfig("s", "jsonl", root / "s.jsonl", root)


def _cache(cache_dir: Path, videos: list[tuple[str, str]], spool: MosaicSpool | None) -> list[dict]:
    plan, _ = extend_plan([], videos, SMALL, decoded=spool.sampled if spool else None)
    write_plan(cache_dir, plan)
    for shard, members in shard_members(plan).items():
        ensure_shard(cache_dir, shard, members, SMALL, spool=spool)
    write_index(cache_dir, plan, SMALL)
    return [json.loads(line) for line in (cache_dir / "index.jsonl").read_text().splitlines()]


def test_catalogue_pass_feeds_plan_and_shards_like_a_fresh_decode(videos, truncated, tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    for path in [*videos.values(), *truncated.values()]:
        (media / path.name).write_bytes(path.read_bytes())
    source = _jsonl_source(media, sorted(media.iterdir()))
    spool = MosaicSpool(tmp_path / "spool", SMALL)
    catalog = build_catalog(source, validator=MediaValidator(SMALL.num_frames, mosaic_spool=spool))
    rows = dict(zip(catalog.sample_id, catalog.itertuples()))
    for name in truncated:
        assert rows[f"s/{name}"].status == "rejected" and name in rows[f"s/{name}"].reason
    accepted = [(row.media_keys[0], row.media_refs[0]) for row in catalog.itertuples() if row.status == "ok"]
    assert sorted(Path(ref).name for _, ref in accepted) == sorted(COUNTED)

    spooled = _cache(tmp_path / "spooled", accepted, spool)
    assert list((tmp_path / "spool").rglob("*.json")) == []  # taken by the shards
    fresh = _cache(tmp_path / "fresh", accepted, None)
    assert spooled == fresh
    for shard in {row["shard"] for row in fresh}:
        assert tar_path(tmp_path / "spooled", shard).read_bytes() == tar_path(tmp_path / "fresh", shard).read_bytes()
    reader = FrameCacheReader(tmp_path / "fresh")
    for row in fresh:
        numbers = [frame_number(frame) for frame in full_decode(Path(dict(accepted)[row["video"]]))]
        assert row["total_frames"] == len(numbers)
        assert row["frame_indices"] == sample_indices(len(numbers), SMALL.num_frames)
        assert [frame_number(frame) for frame in reader.read(row["video"])] == [numbers[i] for i in row["frame_indices"]]


def test_plan_and_shard_take_the_catalogue_pass_instead_of_decoding(videos, tmp_path, monkeypatch):
    """Proof that nothing decodes after the catalogue: no container is opened (every decode opens
    one with av.open), yet the plan and the shard complete from the spool."""
    video = tmp_path / "clip.avi"
    video.write_bytes(videos["zero_size.avi"].read_bytes())
    spool = MosaicSpool(tmp_path / "spool", SMALL)
    assert MediaValidator(SMALL.num_frames, mosaic_spool=spool).error_for(str(video), "video") == ""
    opened = []
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda *args, **kwargs: opened.append(args) or real_open(*args, **kwargs))
    rows = _cache(tmp_path / "cache", [("s/clip.avi", str(video))], spool)
    assert [(row["total_frames"], row["frame_indices"]) for row in rows] == [(40, sample_indices(40, SMALL.num_frames))]
    assert opened == []


def test_stale_or_damaged_spool_entries_are_decoded_afresh(videos, tmp_path):
    video = tmp_path / "clip.mp4"
    video.write_bytes(videos["vfr.mp4"].read_bytes())
    spool = MosaicSpool(tmp_path / "spool", SMALL)
    spool.render(str(video))
    jpeg = next((tmp_path / "spool").rglob("*.jpg"))
    jpeg.write_bytes(jpeg.read_bytes()[:-10])
    indices = sample_indices(40, SMALL.num_frames)
    assert spool.sampled(str(video)).frame_indices == indices
    assert spool.mosaic(str(video), indices) is None  # damaged JPEG

    spool.render(str(video))
    assert spool.mosaic(str(video), indices) is not None
    video.write_bytes(videos["b_frames.mp4"].read_bytes())  # replaced: other size and mtime
    assert spool.sampled(str(video)) is None and spool.mosaic(str(video), indices) is None
    rows = _cache(tmp_path / "cache", [("s/clip.mp4", str(video))], spool)
    assert [row["total_frames"] for row in rows] == [50]


def test_plan_drops_spooled_mosaics_of_videos_it_does_not_hold(videos, tmp_path):
    spool = MosaicSpool(tmp_path / "spool", SMALL)
    planned, orphan = str(videos["vfr.mp4"]), str(videos["b_frames.mp4"])
    for ref in (planned, orphan):
        spool.render(ref)
    assert spool.keep_only([planned]) == 1
    assert spool.sampled(orphan) is None and spool.sampled(planned) is not None
    assert sorted(path.suffix for path in (tmp_path / "spool").rglob("*.*")) == [".jpg", ".json"]
