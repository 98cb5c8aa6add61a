"""Memory per sample of the packing_bins step's work, from two source sizes, in both packing modes.

    .venv/bin/python bench/packing_memory.py [--small 100000] [--large 1000000]

For each size, a generated catalogue and length table (ids `bench/<9 digits>`, lengths from
bench/packing.py's VLM mixture, 1 % of rows rejected by the catalogue) are packed in a fresh
process doing what the step does: pack (bins and rejects written), read the bins back for the
metadata, and the accounting check. `full` packs every sample; `append` packs the whole source
over the bins of its first 99 % (packed before, in another process): the kept bins are read,
checked and copied, and the last 1 % packed after them. The child's peak RSS at the two sizes,
differenced over the difference of samples, is the memory per sample with the fixed cost (Python,
pyarrow) cancelled. The target is at most 100 bytes per sample. Inputs are cached under
bench/out/packing_memory/.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing import vlm_lengths  # noqa: E402  (bench/packing.py: the same length mixture)

from vlm_assets.tokens.table import LENGTH_CHUNK_ROWS  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "packing_memory"
MAX_TOKEN_LEN = 8192
TARGET_BYTES_PER_SAMPLE = 100
REJECTED_SHARE = 0.01
APPENDED_SHARE = 0.01
CATALOG_ROW_GROUP = 8192


def write_inputs(samples: int) -> Path:
    folder = OUT / "inputs" / str(samples)
    if (folder / "lengths.parquet").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(samples)
    ids = pa.array([f"bench/{number:09d}" for number in range(samples)])
    rejected = rng.random(samples) < REJECTED_SHARE
    status = pa.array(np.where(rejected, "rejected", "ok"))
    reason = pa.array(np.where(rejected, "unreadable image 'x.jpg'", ""))
    lengths = vlm_lengths(samples, MAX_TOKEN_LEN, seed=samples)
    zeros = pa.array(np.zeros(samples, dtype=np.int64))
    images = pa.array([[f"/data/images/{number:09d}.jpg"] for number in range(samples)])
    catalog = pa.table({"sample_id": ids, "status": status, "reason": reason,
                        "media_type": pa.array(np.full(samples, "image")),
                        # What packing hashes of each sample besides its id (plan.CONTENT_COLUMNS).
                        "messages": pa.array([f'[{{"role":"user","content":"<image>What is in picture {number}?"}}]'
                                              for number in range(samples)]),
                        "media_files": images, "media_kinds": pa.array([["image"]] * samples),
                        "media_refs": images, "media_keys": images})
    lengths = pa.table({"sample_id": ids, "status": status, "reason": reason,
                        "token_len": pa.array(np.where(rejected, 0, lengths)), "text_tokens": pa.array(lengths),
                        "image_tokens": zeros, "video_tokens": zeros})
    first = round(samples * (1 - APPENDED_SHARE))
    (folder / "first").mkdir(exist_ok=True)
    for rows, into in ((first, folder / "first"), (samples, folder)):
        # Row groups as the steps write them: the catalogue's 8,192 rows, the length table's chunks.
        pq.write_table(catalog.slice(0, rows), into / "catalog.parquet", row_group_size=CATALOG_ROW_GROUP)
        pq.write_table(lengths.slice(0, rows), into / "lengths.parquet", row_group_size=LENGTH_CHUNK_ROWS)
    return folder


def step_work(folder: Path, mode: str) -> None:
    """In a child process: the step's work on the tables in `folder`; prints peak RSS (KiB) and seconds."""
    from vlm_assets.packing.plan import BinsOnDisk, pack_source, reject_categories
    from vlm_assets.packing.report import fill_summary_md, reject_counts_md
    from vlm_assets.packing.verify import accounting_problems
    from vlm_assets.tokens.histogram import length_histogram_md

    catalog = folder / "catalog.parquet"
    out = folder / ("full" if mode == "full" else "append")
    bins_path, rejects_path = out / "bins.parquet", out / "rejects.parquet"
    if mode == "first":  # the bins of the first 99 %, written before (not measured: another process does it)
        pack_source(folder / "first" / "catalog.parquet", folder / "first" / "lengths.parquet", bins_path, rejects_path,
                    "packed_vqa", MAX_TOKEN_LEN)
        print(0, 0.0)
        return
    started = time.perf_counter()
    pack_source(catalog, folder / "lengths.parquet", bins_path, rejects_path, "packed_vqa", MAX_TOKEN_LEN,
                keep_written_bins=mode == "append")
    bins = BinsOnDisk.read(bins_path)
    reject_counts_md(bins.packed, reject_categories(rejects_path))
    length_histogram_md(bins.lengths, MAX_TOKEN_LEN)
    fill_summary_md(bins, MAX_TOKEN_LEN)
    problems = accounting_problems(catalog, bins_path, rejects_path) + [str(b) for b in bins.oversized(MAX_TOKEN_LEN)]
    if problems:
        raise SystemExit(f"the packing of {folder} has problems: {problems[:3]}")
    print(peak_rss_kib(), time.perf_counter() - started)


def peak_rss_kib() -> int:
    """This process's peak RSS since its exec (ru_maxrss would keep the forking parent's peak if higher)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def child(folder: Path, mode: str) -> tuple[float, float]:
    output = subprocess.run([sys.executable, __file__, "--step-work", str(folder), "--mode", mode],
                            capture_output=True, text=True, check=True).stdout.split()
    return int(output[0]) / 1024, float(output[1])


def measure(samples: int, mode: str) -> tuple[float, float]:
    folder = write_inputs(samples)
    if mode == "full":
        return child(folder, "full")
    shutil.rmtree(folder / "append", ignore_errors=True)
    child(folder, "first")
    return child(folder, "append")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=100_000)
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--step-work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="full", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step_work:
        step_work(args.step_work, args.mode)
        return 0
    print(f"| mode | peak RSS at {args.small:,} (MiB) | at {args.large:,} (MiB) | seconds at {args.large:,} "
          "| bytes per sample | target |\n|---|---:|---:|---:|---:|---|")
    for mode in ("full", "append"):
        (small_peak, _), (large_peak, large_s) = measure(args.small, mode), measure(args.large, mode)
        per_sample = (large_peak - small_peak) * 2**20 / (args.large - args.small)
        verdict = "met" if per_sample <= TARGET_BYTES_PER_SAMPLE else "MISSED"
        print(f"| {mode} | {small_peak:.0f} | {large_peak:.0f} | {large_s:.1f} | {per_sample:.0f} "
              f"| <= {TARGET_BYTES_PER_SAMPLE}: {verdict} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
