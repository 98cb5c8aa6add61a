"""Catalogue records per second of one big JSON-lines file: one reader vs every process reading its own
ranges of lines, beside the machine's own 2-process ceiling, measured in the same minutes.

    .venv/bin/python bench/catalog_readers.py [--records 200000] [--repeats 3]

Input, generated once with a fixed seed under bench/out/catalog_readers/: LLaVA-style records
(`conversations` of 1–3 turns, one `image` each, drawn from 200 small JPEGs), the whole file and
its two halves. Each round runs, one after the other:
  1 process          write_catalog(processes=1): read, parse, check, write in this process
  2, one reader      write_catalog(processes=2) with range reading off: this process reads and
                     parses every record, the other process and this one check them (the
                     behaviour before range reading)
  2, ranges          write_catalog(processes=2): each process reads and parses its own ranges
  ceiling            two plain processes side by side, each write_catalog(processes=1) over one
                     half of the file: the most two processes can do on this machine right now
Prints the median records/s of each over --repeats rounds, its speed-up over one process, and its
share of the ceiling's speed-up. No check log: each process decodes each image once.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

import vlm_assets.catalog.build as build
from vlm_assets.catalog.build import MediaValidator
from vlm_assets.catalog.table import write_catalog
from vlm_assets.config import SourceConfig

OUT = Path(__file__).resolve().parent / "out" / "catalog_readers"
WORDS = "what is the color shape size of this object and why does it look so bright in the picture".split()


def generate(records: int) -> Path:
    folder = OUT / str(records)
    whole = folder / "train.jsonl"
    if whole.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(11)
    for number in range(200):
        size = (rng.randint(64, 640), rng.randint(64, 640))
        Image.new("RGB", size, (number, 255 - number, 90)).save(folder / f"img{number}.jpg", quality=80)
    lines = []
    for number in range(records):
        turns = []
        for turn in range(rng.randint(1, 3)):
            question = ("<image>\n" if turn == 0 else "") + " ".join(rng.choices(WORDS, k=rng.randint(5, 30)))
            turns += [{"from": "human", "value": question},
                      {"from": "gpt", "value": " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))}]
        lines.append(json.dumps({"id": f"s{number}", "image": f"img{rng.randrange(200)}.jpg", "conversations": turns}) + "\n")
    half = records // 2
    (folder / "first_half.jsonl").write_text("".join(lines[:half]))
    (folder / "second_half.jsonl").write_text("".join(lines[half:]))
    whole.write_text("".join(lines))
    return folder


def catalogue(path: Path, processes: int, ranges: bool = True) -> float:
    """Seconds to catalogue the jsonl at `path` (its media beside it)."""
    source = SourceConfig(path.stem, "jsonl", path, path.parent)
    build.RANGE_READING_MIN_BYTES = 8 << 20 if ranges else 1 << 62
    with tempfile.TemporaryDirectory() as scratch:
        start = time.perf_counter()
        write_catalog(source, Path(scratch) / "catalog.parquet", "messages", MediaValidator(), processes)
        return time.perf_counter() - start


def ceiling(folder: Path) -> float:
    """Seconds for two plain processes to catalogue one half each, side by side."""
    start = time.perf_counter()
    halves = [subprocess.Popen([sys.executable, __file__, "--one-process", str(folder / name)])
              for name in ("first_half.jsonl", "second_half.jsonl")]
    for half in halves:
        if half.wait() != 0:
            raise SystemExit("a ceiling process failed")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one-process", type=Path, help=argparse.SUPPRESS)  # a ceiling process
    args = parser.parse_args()
    if args.one_process:
        catalogue(args.one_process, 1)
        return
    folder = generate(args.records)
    whole = folder / "train.jsonl"
    print(f"{args.records:,} records, {whole.stat().st_size / 1e6:.0f} MB, {args.repeats} rounds")
    times: dict[str, list[float]] = {"1 process": [], "2, one reader": [], "2, ranges": [], "ceiling": []}
    for round_number in range(args.repeats):
        times["1 process"].append(catalogue(whole, 1))
        times["2, one reader"].append(catalogue(whole, 2, ranges=False))
        times["2, ranges"].append(catalogue(whole, 2))
        times["ceiling"].append(ceiling(folder))
        print(f"round {round_number + 1}: " + ", ".join(f"{name} {values[-1]:.1f} s" for name, values in times.items()),
              flush=True)
    one = statistics.median(times["1 process"])
    top = one / statistics.median(times["ceiling"])
    print(f"\n{'':16} {'records/s':>10} {'speed-up':>9} {'share of ceiling':>17}")
    for name, values in times.items():
        seconds = statistics.median(values)
        speed_up = one / seconds
        share = (speed_up - 1) / (top - 1) if top > 1 else float("nan")
        print(f"{name:16} {args.records / seconds:>10,.0f} {speed_up:>8.2f}× {share:>16.0%}")
    print(f"\nmachine ceiling for 2 processes now: {top:.2f}× (share: the speed-up gained over 1 process, "
          "as a part of what the ceiling gains)")


if __name__ == "__main__":
    main()
