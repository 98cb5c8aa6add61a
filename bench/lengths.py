"""Token-length throughput: fast path vs the exact per-sample processor path (what the seed does).

Builds ≥ 2,000 samples over real images from ../shared/data and generated images of many sizes,
aspect ratios and formats (some multi-image, some multi-turn), then, side by side in one run:
  - fast path: header sizes + batched tokenisation (median of 3 passes),
  - exact path: render + load_image + processor call per sample (one pass),
checks that every count is equal, and reports samples/s, the ratio and each path's peak RSS.

    .venv/bin/python bench/lengths.py [--samples 2000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
FORMATS = ["JPEG", "PNG", "WEBP"]


def make_dataset(root: Path, n_samples: int) -> Path:
    rng = random.Random(0)
    images: list[str] = []
    if SHARED.is_dir():
        images += [str(p) for p in SHARED.rglob("*") if p.suffix.lower() in (".jpg", ".png", ".webp", ".gif")
                   and p.name not in ("truncated_jpeg.jpg", "broken.png")]
    generated = root / "generated"
    generated.mkdir(parents=True)
    for index in range(300):
        width, height = rng.randint(64, 2048), rng.randint(64, 2048)
        if index % 10 == 0:
            width, height = width, max(32, width // rng.randint(3, 8))  # panoramas
        array = np.random.default_rng(index).integers(0, 255, (height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
        image = Image.fromarray(array).resize((width, height))
        fmt = FORMATS[index % 3]
        path = generated / f"g{index:04d}.{fmt.lower().replace('jpeg', 'jpg')}"
        image.save(path, fmt, quality=85) if fmt != "PNG" else image.save(path, fmt)
        images.append(str(path))
    samples = root / "samples"
    samples.mkdir()
    words = "the a cat dog photo shows several objects in bright light near water trees 图片 中 的 狗".split()
    for index in range(n_samples):
        n_images = 1 if rng.random() < 0.8 else rng.randint(2, 4)
        n_turns = 1 if rng.random() < 0.7 else rng.randint(2, 5)
        messages = []
        for turn in range(n_turns):
            question = " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))
            answer = " ".join(rng.choice(words) for _ in range(rng.randint(5, 200)))
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        record = {"messages": messages, "images": [rng.choice(images) for _ in range(n_images)]}
        (samples / f"{index:05d}.json").write_text(json.dumps(record, ensure_ascii=False))
    return samples


def _load(samples_dir: str):
    from vlm_assets.catalog.build import build_catalog
    from vlm_assets.config import FrameCacheConfig, ModelConfig, SourceConfig
    from vlm_assets.tokens.lengths import LengthCounter, SampleForLength
    from vlm_assets.tokens.processor import load_processor

    # The records name images generated beside the samples and real ones under SHARED, by absolute path.
    allowed = (Path(samples_dir).parent, SHARED)
    frame = build_catalog(SourceConfig("bench", "flat_dir", Path(samples_dir), Path(samples_dir), allowed_roots=allowed))
    ok = frame[frame.status == "ok"]
    samples = [SampleForLength(r.sample_id, r.messages, list(r.media_kinds), list(r.media_refs)) for r in ok.itertuples()]
    processor = load_processor(ModelConfig(processor_kwargs={"min_pixels": 3136, "max_pixels": 1003520}))
    return LengthCounter(processor, FrameCacheConfig()), samples


def run_path(samples_dir: str, path: str, repeats: int, queue: mp.Queue) -> None:
    counter, samples = _load(samples_dir)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, results = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        if path == "fast":
            results = counter.fast_many(samples)
        else:
            results = [counter.exact(sample) for sample in samples]
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put({"path": path, "times": times, "n": len(samples), "peak_rss_mb": peak / 1024,
               "rss_growth_mb": (peak - base_rss) / 1024,
               "lengths": [(r.sample_id, r.status, r.token_len) for r in results]})


def measure(samples_dir: Path, path: str, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=run_path, args=(str(samples_dir), path, repeats, queue))
    process.start()
    result = queue.get()
    process.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--fast-repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        samples_dir = make_dataset(Path(tmp), args.samples)
        fast = measure(samples_dir, "fast", args.fast_repeats)
        exact = measure(samples_dir, "exact", 1)
    equal = sum(a == b for a, b in zip(fast["lengths"], exact["lengths"]))
    n = fast["n"]
    fast_rate = n / statistics.median(fast["times"])
    exact_rate = n / statistics.median(exact["times"])
    print(f"samples: {n} (images: real from shared/data + 300 generated; multi-image ~20%, multi-turn ~30%)")
    print(f"{'path':<8}{'median s':>10}{'samples/s':>12}{'peak RSS MB':>14}{'RSS growth MB':>15}")
    for name, result, rate in (("fast", fast, fast_rate), ("exact", exact, exact_rate)):
        print(f"{name:<8}{statistics.median(result['times']):>10.2f}{rate:>12.1f}{result['peak_rss_mb']:>14.0f}{result['rss_growth_mb']:>15.0f}")
    print(f"fast / exact throughput: {fast_rate / exact_rate:.1f}x (target >= 30x)")
    print(f"equal counts: {equal}/{n} ({100 * equal / n:.2f}%)")


if __name__ == "__main__":
    main()
