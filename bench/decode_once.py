"""CPU per video along the graph's video path (validate, plan, shard): each step decoding on its own vs one decode.

    .venv/bin/python bench/decode_once.py [--clips-480p 4] [--clips-720p 4] [--repeats 3]

Videos: the generated 10-s H.264 clips of bench/frame_cache.py (cached under bench/out/) plus the
real videos of ../shared/data; the ones that fail validation are left out (listed). Settings are
the production ones (64 frames, 384 px, 4×16 mosaic, JPEG q95). For every video, in one run and
alternating, --repeats times each:

  separate   what the graph did before: the catalogue validates (MediaValidator without a
             spool: demux, decode the sampled frames), video_frame_plan demuxes again
             (extend_plan probes), the shard demuxes and decodes again (build_shard)
  once       the catalogue's validation renders the mosaic into the spool (MediaValidator with
             a MosaicSpool), the plan reads the count from it, the shard copies its JPEG
  decode     one decode and nothing else: demux plus decoding the sampled frames (the floor)

CPU seconds are process time (all threads: the shard's helper thread resizes beside the decoder).
Prints per-video medians of each step, the graph path's total, and the ratios separate/once and
once/decode.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from frame_cache import CONFIG, bench_videos

from vlm_assets.catalog.build import MediaValidator
from vlm_assets.media.video import read_sampled_frames
from vlm_assets.frames.plan import extend_plan
from vlm_assets.frames.shard import build_shard
from vlm_assets.frames.spool import MosaicSpool

STEPS = ("validate", "plan", "shard")


def cpu_seconds(step: Callable[[], object]) -> tuple[float, object]:
    started = time.process_time()
    result = step()
    return time.process_time() - started, result


def graph_path(ref: str, cache_dir: Path, spool: MosaicSpool | None) -> dict[str, float]:
    """CPU seconds of each step for one video; raises if the video fails anywhere."""
    validator = MediaValidator(CONFIG.num_frames, mosaic_spool=spool)
    seconds: dict[str, float] = {}
    seconds["validate"], error = cpu_seconds(lambda: validator.error_for(ref, "video"))
    if error:
        raise RuntimeError(error)
    decoded = spool.sampled if spool else None
    seconds["plan"], (plan, _) = cpu_seconds(lambda: extend_plan([], [("bench/video", ref)], CONFIG, decoded=decoded))
    seconds["shard"], record = cpu_seconds(lambda: build_shard(cache_dir, "part-00000", plan, CONFIG, spool=spool))
    if record.failures:
        raise RuntimeError(record.failures[0].error)
    if spool is not None and spool.sampled(ref) is not None:
        raise RuntimeError("the shard left its spool entry behind")
    return seconds


def decode_only(ref: str) -> float:
    return cpu_seconds(lambda: read_sampled_frames(ref, CONFIG.num_frames, lambda index, frame: None))[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips-480p", type=int, default=4)
    parser.add_argument("--clips-720p", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    print("preparing videos …", flush=True)
    refs = bench_videos(args.clips_480p, args.clips_720p)
    rows: dict[str, dict[str, list[float]]] = {}
    left_out: list[str] = []
    with tempfile.TemporaryDirectory() as scratch:
        for number, ref in enumerate(refs):
            samples: dict[str, list[float]] = {}
            try:
                for repeat in range(args.repeats):
                    cache_dir = Path(scratch) / f"{number}-{repeat}"
                    for method, spool in (("separate", None), ("once", MosaicSpool(cache_dir / "spool", CONFIG))):
                        for step, seconds in graph_path(ref, cache_dir / method, spool).items():
                            samples.setdefault(f"{method} {step}", []).append(seconds)
                    samples.setdefault("decode", []).append(decode_only(ref))
            except RuntimeError as error:
                left_out.append(f"{Path(ref).name}: {str(error)[:100]}")
                continue
            rows[ref] = samples
            print(f"  {Path(ref).name:32s} separate {sum(statistics.median(samples[f'separate {s}']) for s in STEPS):6.3f} s  "
                  f"once {sum(statistics.median(samples[f'once {s}']) for s in STEPS):6.3f} s  "
                  f"decode {statistics.median(samples['decode']):6.3f} s", flush=True)

    def median_of(name: str) -> float:
        return statistics.median(statistics.median(samples[name]) for samples in rows.values())

    def total_of(method: str) -> list[float]:
        return [sum(statistics.median(samples[f"{method} {step}"]) for step in STEPS) for samples in rows.values()]

    print(f"\n{len(rows)} videos ({len(left_out)} left out: {'; '.join(left_out) or 'none'}), {args.repeats} repeats; "
          f"{CONFIG.num_frames} frames, {CONFIG.frame_size} px, {CONFIG.rows}×{CONFIG.cols}, q{CONFIG.jpeg_quality}")
    print(f"\nmedian CPU ms per video   {'validate':>9} {'plan':>7} {'shard':>7} {'total':>8}")
    for method in ("separate", "once"):
        steps = [median_of(f"{method} {step}") * 1000 for step in STEPS]
        print(f"  {method:22s}  {steps[0]:9.1f} {steps[1]:7.1f} {steps[2]:7.1f} {statistics.median(total_of(method)) * 1000:8.1f}")
    decode = [statistics.median(samples["decode"]) for samples in rows.values()]
    print(f"  {'decode only':22s}  {'':9} {'':7} {'':7} {statistics.median(decode) * 1000:8.1f}")
    separate, once = total_of("separate"), total_of("once")
    per_video = [a / b for a, b in zip(separate, once)]
    print(f"\nseparate/once: median per video {statistics.median(per_video):.2f}×, all videos {sum(separate) / sum(once):.2f}×")
    print(f"once/decode:   median per video {statistics.median(b / d for b, d in zip(once, decode)):.2f}×, "
          f"all videos {sum(once) / sum(decode):.2f}× (target ≤ 1.5×)")
    print(f"separate/decode: all videos {sum(separate) / sum(decode):.2f}× (before)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
