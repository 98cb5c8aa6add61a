"""Frame-cache throughput: our shard builder vs a seek-per-index baseline vs the decode-only floor.

    .venv/bin/python bench/frame_cache.py [--clips-480p 8] [--clips-720p 8] [--workers 1 2]

Videos: generated 10-s H.264 clips at 480p and 720p (2-s GOP as streaming encoders use,
cached under bench/out/) plus the real videos of ../shared/data, in one fixed shuffled order. Settings are the production ones
(64 frames, 384 px, 4×16 mosaic, JPEG q95). Each method runs over all videos with 1 and 2
worker processes, in one run, and prints videos/s (median of --repeats runs), per-video medians and ratios.

  ours    build_shard (probe, decode with per-video seek/forward strategy, bicubic resize,
          mosaic, JPEG, tar + done record); shards of SHARD_VIDEOS videos, each run by the next free worker
  naive   for every sampled index: seek to it, decode up to it, resize; then mosaic + JPEG
  floor   decode the needed frames only (our decode schedule, no resize, no encode)
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import av
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vlm_assets.config import FrameCacheConfig  # noqa: E402
from vlm_assets.media.video import FrameResizer, iter_sampled_frames, opened_video  # noqa: E402
from vlm_assets.frames.mosaic import encode_jpeg, tile_frames  # noqa: E402
from vlm_assets.frames.plan import PlannedVideo, extend_plan  # noqa: E402
from vlm_assets.media.video_probe import VideoError, VideoProbe, probe_video  # noqa: E402
from vlm_assets.frames.shard import build_shard  # noqa: E402

CONFIG = FrameCacheConfig(num_frames=64, frame_size=384, rows=4, cols=16, jpeg_quality=95, videos_per_shard=10_000)
REAL_DATA = ROOT.parent / "shared" / "data"
SHARD_VIDEOS = 2  # videos per shard here (production: 256 per shard over many more videos, so shards carry similar work)
OUT = ROOT / "bench" / "out" / "frame_cache_clips"
SECONDS, FPS = 10, 30


def generate_clip(path: Path, width: int, height: int) -> Path:
    """A 10-s clip with a moving textured scene (so inter frames carry real motion)."""
    if path.exists():
        return path
    rng = np.random.default_rng(width + height + len(path.name))
    texture = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
    temporary = path.with_suffix(".partial.mp4")
    with av.open(str(temporary), mode="w") as container:
        stream = container.add_stream("libx264", rate=FPS, options={"preset": "veryfast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = 2 * FPS
        for index in range(SECONDS * FPS):
            image = np.roll(texture, (index * 3, index * 5), axis=(0, 1))
            image[:, :, 0] = (image[:, :, 0].astype(np.uint16) + index * 2).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode(None))
    temporary.rename(path)
    return path


def bench_videos(clips_480p: int, clips_720p: int) -> list[str]:
    OUT.mkdir(parents=True, exist_ok=True)
    paths = [generate_clip(OUT / f"clip480_{i}.mp4", 854, 480) for i in range(clips_480p)]
    paths += [generate_clip(OUT / f"clip720_{i}.mp4", 1280, 720) for i in range(clips_720p)]
    real = [p for p in sorted(REAL_DATA.rglob("*")) if p.suffix in {".mp4", ".avi", ".mkv", ".mov"}]
    return [str(path) for path in paths + real]


def naive_mosaic(video: PlannedVideo) -> float:
    """Seek once per sampled index (decoding from the keyframe before it each time)."""
    started = time.perf_counter()
    probe = probe_video(video.ref)
    tiles = []
    resize = FrameResizer(CONFIG.frame_size)
    try:
        with opened_video(video.ref) as (container, stream):
            for index in video.frame_indices:
                target = probe.frame_pts[index]
                container.seek(target, stream=stream, backward=True)
                chosen = None
                for frame in container.decode(stream):
                    chosen = frame
                    if frame.pts is not None and frame.pts >= target:
                        break
                tiles.append(resize(chosen))
        encode_jpeg(tile_frames(tiles, CONFIG.rows, CONFIG.cols, CONFIG.frame_size), CONFIG.jpeg_quality)
    except av.error.FFmpegError:
        pass  # broken video: every method pays for reaching the error, none produces output
    return time.perf_counter() - started


def decode_floor(job: tuple[PlannedVideo, VideoProbe]) -> float:
    video, probe = job
    started = time.perf_counter()
    try:
        with opened_video(video.ref) as (container, stream):
            for _ in iter_sampled_frames(container, stream, probe, video.frame_indices, video.ref):
                pass
    except VideoError:
        pass  # broken video: every method pays for reaching the error, none produces output
    return time.perf_counter() - started


def our_shard(job: tuple[str, str, list[PlannedVideo]]) -> list[float]:
    cache_dir, shard, videos = job
    times: list[float] = []
    last = [time.perf_counter()]

    def lap(_done: int, _video: PlannedVideo, _error: str) -> None:
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    build_shard(Path(cache_dir), shard, videos, CONFIG, on_video=lap)
    return times


def run(method: str, plan: list[PlannedVideo], probes: dict[str, VideoProbe], workers: int, cache_dir: Path) -> tuple[float, list[float]]:
    """(wall seconds for all videos, per-video seconds)."""
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(probe_video, [plan[0].ref] * workers))  # warm the workers (imports)
        started = time.perf_counter()
        if method == "ours":
            # As in production: many small shards, each taken by the next free worker.
            size = SHARD_VIDEOS
            jobs = [(str(cache_dir), f"part-{n:05d}", plan[start:start + size])
                    for n, start in enumerate(range(0, len(plan), size))]
            per_video = [t for times in pool.map(our_shard, jobs) for t in times]
        elif method == "naive":
            per_video = list(pool.map(naive_mosaic, plan))
        else:
            per_video = list(pool.map(decode_floor, [(video, probes[video.ref]) for video in plan]))
        return time.perf_counter() - started, per_video


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips-480p", type=int, default=4)
    parser.add_argument("--clips-720p", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="runs of ours/floor, median reported (naive runs once: it is slow)")
    args = parser.parse_args()

    print("preparing videos …", flush=True)
    paths = bench_videos(args.clips_480p, args.clips_720p)
    plan, _ = extend_plan([], [(f"bench/{i}", path) for i, path in enumerate(paths)], CONFIG)
    plan = [video for video in plan if not video.error]
    # Real datasets interleave long and short videos, so production shards of 256 carry similar
    # work. In generation order the 720p clips would share shards and leave the other worker idle
    # at the end; a fixed shuffle gives every method the same mixed order.
    random.Random(0).shuffle(plan)
    is_generated = [video.ref.startswith(str(OUT)) for video in plan]
    probes = {video.ref: probe_video(video.ref) for video in plan}
    keyframes = statistics.median(len(probe.keyframes) for probe in probes.values())
    print(f"{len(plan)} decodable videos ({args.clips_480p}×480p + {args.clips_720p}×720p generated 10-s clips, "
          f"{len(plan) - args.clips_480p - args.clips_720p} real); median keyframes/video {keyframes:g}; "
          f"{CONFIG.num_frames} frames, {CONFIG.frame_size}px, {CONFIG.rows}×{CONFIG.cols}, q{CONFIG.jpeg_quality}\n")

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for workers in args.workers:
            results: dict[str, tuple[float, list[float]]] = {}
            for method in ("ours", "floor", "naive"):
                repeats = 1 if method == "naive" else args.repeats
                runs = [run(method, plan, probes, workers, Path(scratch)) for _ in range(repeats)]
                results[method] = sorted(runs, key=lambda result: result[0])[len(runs) // 2]  # median run
                print(f"  workers={workers} {method:5s} {results[method][0]:7.2f} s", flush=True)
            ours, floor, naive = (results[name][0] for name in ("ours", "floor", "naive"))
            for method, (wall, per_video) in results.items():
                rows.append((workers, method, len(plan) / wall, statistics.median(per_video) * 1000, wall / ours))
            rows.append((workers, "ratios", naive / ours, floor / ours, ours / floor))
            if workers == 1:
                for group, wanted in (("generated", True), ("real", False)):
                    sums = {name: sum(t for t, generated in zip(results[name][1], is_generated) if generated == wanted)
                            for name in results}
                    print(f"  workers=1 {group:9s} clips: naive/ours {sums['naive'] / sums['ours']:.2f}×, "
                          f"ours/floor {sums['ours'] / sums['floor']:.2f}× (sum of per-video times)")

    print(f"\n{'workers':>7} {'method':>7} {'videos/s':>9} {'median ms/video':>16} {'time vs ours':>13}")
    for workers, method, rate, median_ms, relative in rows:
        if method == "ratios":
            print(f"{workers:>7}  naive/ours time = {rate:.2f}× (target ≥ 5×)   ours/floor time = {relative:.2f}× (target ≤ 1.5×)")
        else:
            print(f"{workers:>7} {method:>7} {rate:9.2f} {median_ms:16.1f} {relative:12.2f}×")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
