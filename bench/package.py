"""Benchmark: training-package pack and extract+verify vs tar czf / tar --zstd, side by side in one run.

Generates a dataset in a temp dir (default ~520 MB): WebDataset-like shard tars of
(JSON + real Pillow JPEG) samples in two sources, each with an Energon `.nv-meta`, their
metadataset, plus loose JPEGs.
The JPEGs are photo-like (smooth random colour fields + sensor-like noise), so
they are about as incompressible as camera images, not zeros.

Our writer stores files a quick probe finds incompressible in uncompressed
frames; the "nothing stored" row shows the same writer compressing everything.

Each repeat runs every contender once, interleaved, and the table shows medians.
"ratio" is baseline time / our time, so >= 1.0 means we are at least as fast.

    .venv/bin/python bench/package.py [--size-mb 520] [--repeats 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlm_assets.package import (
    PackagePart,
    PackageSpec,
    extract_package,
    verify_package,
    write_package,
)

NOISE_SIDE = 2048
SHARD_BYTES = 32 << 20
JPEG_SHARE = 0.4  # the rest of the bytes are shard tars
ROLES = ("packed_wds", "images")

_noise: np.ndarray | None = None


def _photo_like_jpeg(rng: np.random.Generator) -> bytes:
    """A real JPEG of a smooth random scene plus noise: compresses like a camera image."""
    global _noise
    if _noise is None:
        _noise = np.random.default_rng(1234).normal(0, 12, (NOISE_SIDE, NOISE_SIDE, 3)).astype(np.int16)
    width, height = [(640, 480), (1024, 768), (1280, 960), (768, 1024)][rng.integers(0, 4)]
    cells = int(rng.integers(8, 48))
    scene = rng.integers(0, 256, (height // cells + 2, width // cells + 2, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(scene).resize((width, height), Image.BICUBIC), dtype=np.int16)
    y, x = rng.integers(0, NOISE_SIDE - height), rng.integers(0, NOISE_SIDE - width)
    pixels = np.clip(base + _noise[y : y + height, x : x + width], 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=int(rng.integers(80, 96)))
    return buffer.getvalue()


def _sample_json(key: str, rng: np.random.Generator, images: list[str]) -> bytes:
    words = ["the", "a", "photo", "shows", "red", "car", "person", "table", "what", "is", "in", "image", "describe"]
    text = " ".join(rng.choice(words, size=int(rng.integers(20, 120))))
    record = {
        "id": key,
        "sample_type": "packed_vqa",
        "sample_ids": [f"demo/{key}_{i}.json" for i in range(len(images))],
        "lengths": [int(rng.integers(300, 3000)) for _ in images],
        "messages": [[{"role": "user", "content": f"<image>{text}?"}, {"role": "assistant", "content": text}] for _ in images],
        "texts": {"prompts": [text] * len(images), "captions": [text] * len(images)},
        "media_files": [[name] for name in images],
        "images": images,
        "media_type": "image",
    }
    return json.dumps(record).encode()


def _make_shard(job: tuple[Path, int]) -> int:
    path, seed = job
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        index = 0
        while tar.fileobj.tell() < SHARD_BYTES:
            key = f"demo_ps_{seed:04d}{index:05d}"
            images = [f"{key}.img{k}.jpg" for k in range(int(rng.integers(1, 4)))]
            members = [(f"{key}.json", _sample_json(key, rng, images))] + [(name, _photo_like_jpeg(rng)) for name in images]
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            index += 1
    return path.stat().st_size


def _make_images(job: tuple[Path, int, int]) -> int:
    folder, seed, target = job
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written = index = 0
    while written < target:
        data = _photo_like_jpeg(rng)
        (folder / f"{seed:04d}_{index:05d}.jpg").write_bytes(data)
        written += len(data)
        index += 1
    return written


def generate(root: Path, size_mb: int, workers: int) -> int:
    total = size_mb * 1_000_000
    shard_count = max(1, round(total * (1 - JPEG_SHARE) / SHARD_BYTES))
    image_jobs = 8
    shard_jobs = [(root / "packed_wds" / f"src_{i % 2}" / f"pretrain-{i // 2:06d}.tar", i) for i in range(shard_count)]
    jpeg_target = int(total * JPEG_SHARE) // image_jobs
    jpeg_jobs = [(root / "images" / f"batch_{i}", 1000 + i, jpeg_target) for i in range(image_jobs)]
    with multiprocessing.Pool(workers) as pool:
        written = sum(pool.map(_make_shard, shard_jobs)) + sum(pool.map(_make_images, jpeg_jobs))
    # One Energon dataset per source, as the product lays them out, and the mix over them.
    for source in ("src_0", "src_1"):
        meta = root / "packed_wds" / source / ".nv-meta"
        meta.mkdir(parents=True, exist_ok=True)
        (meta / "dataset.yaml").write_text("__class__: CrudeWebdataset\nsubflavors: {sample_type: packed_vqa}\n")
        (meta / "split.yaml").write_text("split_parts:\n  train: ['pretrain-*.tar']\n")
        shards = {path.name: 1 for path, _ in shard_jobs if path.parent.name == source}
        (meta / ".info.json").write_text(json.dumps({"shard_counts": shards}))
    (root / "packed_wds" / "metadataset.yaml").write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        "      - {path: src_0, weight: 1}\n      - {path: src_1, weight: 1}\n"
    )
    return written


def _source_files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for role in ROLES for path in (root / role).rglob("*") if path.is_file())


def _timed(function, *args, **kwargs) -> tuple[float, object]:
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return time.perf_counter() - started, result


def _run(*argv: str, cwd: Path | None = None) -> None:
    subprocess.run(argv, cwd=cwd, check=True, stdout=subprocess.DEVNULL)


def tar_zstd_available(scratch: Path) -> str | None:
    """None when `tar --zstd` works, else why not (and how to fix it)."""
    if shutil.which("zstd") is None:
        return "the zstd binary is missing: install it (apt-get install zstd) for the tar --zstd baseline"
    probe = scratch / "probe.txt"
    probe.write_text("probe")
    argv = ["tar", "--zstd", "-cf", str(scratch / "probe.tar.zst"), "-C", str(scratch), "probe.txt"]
    result = subprocess.run(argv, capture_output=True, check=False)
    return None if result.returncode == 0 else f"tar --zstd failed: {result.stderr.decode().strip()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=520)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="our zstd/checksum threads (default: all CPUs)")
    parser.add_argument("--keep", type=Path, help="generate into (or reuse) this folder instead of a temp dir")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="vlm_pkg_bench_"))
    try:
        root = args.keep or scratch / "data"
        if not (root / "images").is_dir():
            started = time.perf_counter()
            generate(root, args.size_mb, workers=os.cpu_count() or 1)
            print(f"generated data in {time.perf_counter() - started:.0f} s")
        files = _source_files(root)
        data_bytes = sum((root / name).stat().st_size for name in files)
        jpeg_bytes = sum((root / name).stat().st_size for name in files if name.endswith(".jpg"))
        print(f"data: {len(files)} files, {data_bytes / 1e6:.0f} MB ({jpeg_bytes / 1e6:.0f} MB loose JPEGs, rest shard tars + .nv-meta)")
        print(f"cpus: {os.cpu_count()}, python {sys.version.split()[0]}")
        missing_zstd = tar_zstd_available(scratch)
        if missing_zstd:
            print(f"NOTE: {missing_zstd}")
        checksums = scratch / "SHA256SUMS"
        checksums.write_bytes(subprocess.run(["sha256sum", *files], cwd=root, check=True, capture_output=True).stdout)

        spec = {c: PackageSpec("bench", c, tuple(PackagePart(role, root / role) for role in ROLES)) for c in ("gzip", "zstd")}
        ours_pkg = {"gzip": scratch / "bench.nnpkg", "zstd": scratch / "bench.nnpkg.zst"}
        tar_pkg = {"gzip": scratch / "bench.tar.gz", "zstd": scratch / "bench.tar.zst"}
        tar_flag = {"gzip": "-z", "zstd": "--zstd"}
        compressions = ["zstd", "gzip"] if not missing_zstd else ["gzip"]
        times: dict[str, list[float]] = {}
        hash_times: dict[str, list[float]] = {c: [] for c in compressions}
        sizes: dict[str, int] = {}

        def record(label: str, function, *call_args, **call_kwargs) -> object:
            seconds, result = _timed(function, *call_args, **call_kwargs)
            times.setdefault(label, []).append(seconds)
            return result

        out = scratch / "out"
        everything = scratch / "all_compressed.nnpkg.zst"
        for repeat in range(args.repeats):
            for c in compressions:
                packed = record(f"pack {c}: ours", write_package, spec[c], ours_pkg[c], threads=args.threads)
                hash_times[c].append(packed.hash_seconds)
                record(f"pack {c}: tar", _run, "tar", tar_flag[c], "-cf", str(tar_pkg[c]), *ROLES, cwd=root)
                if c == "zstd":
                    record(f"pack {c}: ours, nothing stored", write_package, spec[c], everything, threads=args.threads,
                           store_incompressible=False)
                    sizes[f"{c}: ours, nothing stored"] = everything.stat().st_size
                    everything.unlink()
                sizes[f"{c}: ours"], sizes[f"{c}: tar"] = ours_pkg[c].stat().st_size, tar_pkg[c].stat().st_size

                record(f"extract+verify {c}: ours", extract_package, ours_pkg[c], out)
                shutil.rmtree(out)
                out.mkdir()
                record(f"extract {c}: tar (no checksums)", _run, "tar", tar_flag[c], "-xf", str(tar_pkg[c]), cwd=out)
                record(f"sha256sum -c {c}", _run, "sha256sum", "--quiet", "-c", str(checksums), cwd=out)
                times.setdefault(f"extract+verify {c}: tar + sha256sum -c", []).append(
                    times[f"extract {c}: tar (no checksums)"][-1] + times[f"sha256sum -c {c}"][-1]
                )
                shutil.rmtree(out)
                record(f"verify only {c}: ours", verify_package, ours_pkg[c])
            print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)

        mb = data_bytes / 1e6
        print(f"\nmedians over {args.repeats} repeats, {mb:.0f} MB of data; ratio = baseline time / ours (>= 1.0: ours as fast or faster)")
        print(f"{'operation':<44}{'median s':>10}{'MB/s':>9}{'ratio':>8}")
        for c in compressions:
            rows = [
                (f"pack {c}: ours", f"pack {c}: tar"),
                *([(f"pack {c}: ours, nothing stored", f"pack {c}: tar")] if c == "zstd" else []),
                (f"pack {c}: tar", None),
                (f"extract+verify {c}: ours", f"extract+verify {c}: tar + sha256sum -c"),
                (f"extract+verify {c}: tar + sha256sum -c", None),
                (f"extract {c}: tar (no checksums)", None),
                (f"verify only {c}: ours", None),
            ]
            for label, baseline in rows:
                median = statistics.median(times[label])
                ratio = f"{statistics.median(times[baseline]) / median:.2f}x" if baseline else ""
                print(f"{label:<44}{median:>10.2f}{mb / median:>9.0f}{ratio:>8}")
            hash_median = statistics.median(hash_times[c])
            pack_median = statistics.median(times[f"pack {c}: ours"])
            extract_ours = statistics.median(times[f"extract+verify {c}: ours"])
            extract_plain = statistics.median(times[f"extract {c}: tar (no checksums)"])
            print(
                f"  checksum overhead ({c}): sha256 inside our pack {hash_median:.2f} s = {hash_median / pack_median:.0%} of its time; "
                f"our verified extract vs plain tar -x: {extract_ours / extract_plain:.2f}x the time"
            )
            print(
                f"  sizes ({c}): ours {sizes[f'{c}: ours'] / 1e6:.1f} MB (ratio {data_bytes / sizes[f'{c}: ours']:.3f}), "
                f"tar {sizes[f'{c}: tar'] / 1e6:.1f} MB (ratio {data_bytes / sizes[f'{c}: tar']:.3f})"
                + (f", ours nothing stored {sizes[f'{c}: ours, nothing stored'] / 1e6:.1f} MB" if c == "zstd" else "")
                + "\n"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
