"""Shard-writing throughput: our WebDataset writer vs `tar cf` on the same media files.

Generates --files media files (random bytes behind a JPEG / MP4 signature, sizes
drawn 20 KiB – 1 MiB, a few larger "videos"), groups them into packed records of
1–6 media each (a packed_json file and a catalogue naming each medium), then
alternates, --repeat times, (a) `write_shards_from_jsonl` (what packed_wds_shards runs) into
pretrain-*.tar with the configured maxsize and (b) `tar cf` of the same files
into one archive. Both read warm page cache and write to the same disk; our
writer also fsyncs every shard. Reports median MB/s (payload bytes / wall time)
and the ratio (target: ours >= 0.7x tar).

    .venv/bin/python bench/wds_write.py [--files 1500] [--repeat 5] [--workdir bench/out/wds_write]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlm_assets.catalog.lookup import SampleLookup
from vlm_assets.catalog.schema import STATUS_OK
from vlm_assets.packing.wds import write_shards_from_jsonl

TARGET_RATIO = 0.7
JPEG_MAGIC = b"\xff\xd8\xff\xe0" + bytes(60)
MP4_MAGIC = b"\x00\x00\x00\x20ftypisom" + bytes(52)


def make_media(directory: Path, count: int, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        is_video = index % 20 == 0
        size = int(rng.integers(2_000_000, 8_000_000) if is_video else rng.integers(20_000, 1_000_000))
        path = directory / f"m{index:06d}.{'mp4' if is_video else 'jpg'}"
        path.write_bytes((MP4_MAGIC if is_video else JPEG_MAGIC) + rng.bytes(size))
        paths.append(path)
    return paths


def write_inputs(paths: list[Path], jsonl_path: Path, catalog_path: Path, seed: int = 0) -> int:
    """Packed records of 1-6 media each (one sample per medium) and their catalogue; returns the record count."""
    rng = np.random.default_rng(seed)
    lines, start = [], 0
    while start < len(paths):
        group = paths[start : start + int(rng.integers(1, 7))]
        start += len(group)
        members = [f"{'vid' if p.suffix == '.mp4' else 'img'}{k}{p.suffix}" for k, p in enumerate(group)]
        record = {"id": f"bench_ps_{len(lines):08d}", "sample_type": "packed_multi_mix_qa",
                  "sample_ids": [p.stem for p in group], "media_files": [[member] for member in members]}
        lines.append(json.dumps(record) + "\n")
    jsonl_path.write_text("".join(lines))
    pq.write_table(pa.table({"sample_id": [p.stem for p in paths], "status": [STATUS_OK] * len(paths),
                             "media_refs": [[str(p)] for p in paths]}), catalog_path)
    return len(lines)


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1500)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--maxsize", type=int, default=256_000_000)
    parser.add_argument("--workdir", type=Path, default=Path("bench/out/wds_write"))
    args = parser.parse_args()

    shutil.rmtree(args.workdir, ignore_errors=True)
    media_dir = args.workdir / "media"
    paths = make_media(media_dir, args.files)
    payload = sum(path.stat().st_size for path in paths)
    jsonl_path, catalog_path = args.workdir / "packed.jsonl", args.workdir / "catalog.parquet"
    records = write_inputs(paths, jsonl_path, catalog_path)
    print(f"{len(paths)} media files, {payload / 1e6:.0f} MB, in {records} packed records")

    ours_dir, tar_path = args.workdir / "shards", args.workdir / "baseline.tar"
    names = [path.name for path in paths]
    ours, tar = [], []
    with SampleLookup(catalog_path, ["media_refs"], near=jsonl_path) as samples:
        for _ in range(args.repeat):
            ours.append(timed(lambda: write_shards_from_jsonl(jsonl_path, samples, ours_dir, maxcount=10_000,
                                                              maxsize=args.maxsize)))
            tar_path.unlink(missing_ok=True)
            tar.append(timed(lambda: subprocess.run(["tar", "cf", str(tar_path), "-C", str(media_dir), *names],
                                                    check=True)))
    shards = sorted(ours_dir.glob("pretrain-*.tar"))
    ours_mbps = payload / 1e6 / statistics.median(ours)
    tar_mbps = payload / 1e6 / statistics.median(tar)
    print(f"{'writer':<30}{'median s':>10}{'MB/s':>10}   runs")
    print(f"{'write_shards_from_jsonl (fsync)':<30}{statistics.median(ours):>10.2f}{ours_mbps:>10.0f}   "
          f"{', '.join(f'{t:.2f}' for t in ours)}  ({len(shards)} shards)")
    print(f"{'tar cf':<30}{statistics.median(tar):>10.2f}{tar_mbps:>10.0f}   {', '.join(f'{t:.2f}' for t in tar)}")
    ratio = ours_mbps / tar_mbps
    print(f"ours / tar = {ratio:.2f}x (target >= {TARGET_RATIO}x: {'met' if ratio >= TARGET_RATIO else 'MISSED'})")
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
