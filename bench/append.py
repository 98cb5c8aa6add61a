"""What a rebuild costs after records are appended to a source, with what vlm-assets keeps between builds.

    .venv/bin/python bench/append.py [--samples 100000] [--append-share 0.005] [--workers 2] [--kind flat_dir]

One generated image source (bench/scale.py's: small JPEG/PNG images, one- or two-turn
conversations, one image per sample) as a jsonl manifest (`--kind flat_dir`: as a folder of one
JSON file per record, each beside its image; the appended records are new files sorting last),
built to its Energon dataset by
`vlm-assets run --workers N --select energon_dataset` on three sites, then --append-share more
records appended to the manifest and each site built again:

  before   packing.mode full, its catalogue's read mark and measured length chunks deleted before the
           rebuild: what the rebuild cost before appended lines were read alone and length chunks
           kept (every record read and every sample measured again, every shard rewritten)
  full     packing.mode full: only the appended lines are catalogued, only the length chunks that
           changed are measured; every bin packed again, every shard rewritten
  append-reread  packing.mode append, with the records of which shards were checked, indexed by
           Energon and loaded deleted before the rebuild: every shard's members read, every shard
           indexed by Energon's prepare and every sample loaded again (before they were kept)
  append   packing.mode append: also only new bins, their records and new shards; the old shards
           keep their bytes, and only the new shards are checked, indexed and loaded

Prints, per site, the first build's and the rebuild's wall time, the rebuild's seconds inside each
asset's runs (from the instance's run records), and how many of the first build's shards the
rebuild rewrote (a changed modification time). With --repeats N each site is saved after its first
build (its shards as hard links: a build never rewrites a shard in place) and rebuilt N times from
that saved state, sites alternating; the medians are printed, the rebuild's share of the first build
beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from scale import Measured, attribute_time, clean_env, write_source  # noqa: E402

OUT = ROOT / "bench" / "out" / "append"
PYTHON = sys.executable
SITES = ("before", "full", "append-reread", "append")
STEPS = ("sample_catalog", "sample_length_chunk", "sample_lengths", "packing_bins", "packed_json", "packed_wds_shards", "energon_dataset")
CONFIG = """\
storage: {{root: {root}}}
sources:
  - {source}
model: {{processor: embedded, processor_kwargs: {{min_pixels: 3136, max_pixels: 200704}}}}
sample: {{sample_type: packed_multi_mix_qa, max_token_len: 8192}}
packing: {{mode: {mode}, min_fill_ratio: 0.0}}
wds: {{maxcount: 2000}}
"""


def build(site: Path, workers: int) -> Measured:
    started_at = time.time()
    began = time.perf_counter()
    log = site / f"run-{int(started_at)}.log"
    with open(log, "w", encoding="utf-8") as handle:
        result = subprocess.run([PYTHON, "-m", "vlm_assets.cli", "run", "--config", str(site / "vlm_assets.yaml"),
                                 "--workers", str(workers), "--select", "energon_dataset"],
                                cwd=ROOT, env=clean_env(site / "dagster_home"), stdout=handle, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(f"vlm-assets run exited {result.returncode}; log {log}")
    measured = Measured(time.perf_counter() - began, 0.0, 0.0, 0.0)
    attribute_time(site / "dagster_home", measured, started_at)
    return measured


def write_records(site: Path, kind: str, lines: list[str], first: int, media: Path) -> None:
    """Add `lines` (records from number `first` on) to the site's source."""
    if kind == "jsonl":
        with open(site / "images.jsonl", "a", encoding="utf-8") as manifest:
            manifest.write("".join(lines))
        return
    folder = site / "images"
    folder.mkdir(exist_ok=True)
    for number, line in enumerate(lines, start=first):
        (folder / f"{number:07d}.json").write_text(line, encoding="utf-8")
        image = json.loads(line)["images"][0]
        os.link(media / image, folder / image)


def source_entry(site: Path, kind: str, media: Path) -> str:
    if kind == "jsonl":
        return f"{{name: images, kind: jsonl, path: {site / 'images.jsonl'}, media_root: {media}}}"
    return f"{{name: images, kind: flat_dir, path: {site / 'images'}}}"


def shard_times(site: Path) -> dict[str, int]:
    return {path.name: path.stat().st_mtime_ns for path in sorted((site / "vlm_data" / "packed_wds" / "images").glob("*.tar"))}


def _link_shards(source: str, target: str) -> None:
    if source.endswith(".tar"):
        os.link(source, target)
    else:
        shutil.copy2(source, target)


def save_site(source: Path, target: Path) -> None:
    """`target` made a copy of the site folder `source` (times kept), its shards hard-linked."""
    shutil.rmtree(target, ignore_errors=True)
    shards = source / "vlm_data" / "packed_wds"

    def copy(path: str, names: list[str]) -> list[str]:
        return ["packed_wds"] if Path(path) == shards.parent else []

    shutil.copytree(source, target, symlinks=True, ignore=copy)
    if shards.is_dir():
        shutil.copytree(shards, target / "vlm_data" / "packed_wds", symlinks=True, copy_function=_link_shards)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=100_000, help="records in the first manifest")
    parser.add_argument("--append-share", type=float, default=0.005, help="records appended, as a share of --samples")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sites", default=",".join(SITES), help=f"comma-separated, of {', '.join(SITES)}")
    parser.add_argument("--kind", choices=("jsonl", "flat_dir"), default="jsonl", help="the source's kind")
    parser.add_argument("--repeats", type=int, default=1, help="rebuilds of each site from its saved first build")
    args = parser.parse_args()
    sites = [name for name in SITES if name in args.sites.split(",")]
    extra = max(1, int(args.samples * args.append_share))

    inputs = OUT / "inputs"
    grown = write_source(inputs, args.samples + extra, "images")  # its first --samples lines are the small one's
    lines = grown.read_text(encoding="utf-8").splitlines(keepends=True)
    print(f"{args.kind} source: {args.samples} records, then {extra} appended ({args.append_share:.1%}); "
          f"{args.workers} workers")

    first: dict[str, Measured] = {}
    for name in sites:
        site = OUT / "sites" / name
        shutil.rmtree(site, ignore_errors=True)
        site.mkdir(parents=True)
        write_records(site, args.kind, lines[:args.samples], 0, inputs / "media")
        (site / "vlm_assets.yaml").write_text(CONFIG.format(
            root=site / "vlm_data", source=source_entry(site, args.kind, inputs / "media"),
            mode="append" if name.startswith("append") else "full"), encoding="utf-8")
        first[name] = build(site, args.workers)

    # The largest resident set any one process of the runs had (getrusage of waited-for descendants).
    print(f"peak RSS of one process, first builds: {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f} MiB")
    for name in sites:
        save_site(OUT / "sites" / name, OUT / "saved" / name)
    rebuilds: dict[str, list[Measured]] = {name: [] for name in sites}
    rewritten: dict[str, str] = {}
    for _ in range(args.repeats):
        for name in sites:
            site = OUT / "sites" / name
            save_site(OUT / "saved" / name, site)
            if name == "before":
                (site / "vlm_data" / "catalog" / "images.read.json").unlink()
                shutil.rmtree(site / "vlm_data" / "spool" / "lengths")
            if name == "append-reread":
                shutil.rmtree(site / "vlm_data" / "spool" / "shards")
                shutil.rmtree(site / "vlm_data" / "spool" / "energon")
            shards_before = shard_times(site)
            write_records(site, args.kind, lines[args.samples:], args.samples, inputs / "media")
            rebuilds[name].append(build(site, args.workers))
            after = shard_times(site)
            changed = sum(1 for shard, mtime in shards_before.items() if after.get(shard) != mtime)
            rewritten[name] = f"{changed} of {len(shards_before)} (now {len(after)})"
    print(f"\n{'site':<13} {'first build':>12} {'rebuild':>9} {'share':>6}  " + "  ".join(f"{step:>16}" for step in STEPS)
          + f"  {'outside runs':>12}  shards rewritten")
    for name in sites:
        wall = statistics.median(measured.wall for measured in rebuilds[name])
        steps = "  ".join(f"{statistics.median(m.in_runs.get(step, 0.0) for m in rebuilds[name]):>15.1f}s" for step in STEPS)
        outside = statistics.median(measured.outside_runs for measured in rebuilds[name])
        print(f"{name:<13} {first[name].wall:>11.1f}s {wall:>8.1f}s {wall / first[name].wall:>6.1%}  {steps}  "
              f"{outside:>11.1f}s  {rewritten[name]}")
        if args.repeats > 1:
            print(f"{'':<13} rebuilds: {', '.join(f'{measured.wall:.1f}s' for measured in rebuilds[name])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
