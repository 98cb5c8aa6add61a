"""One big source through its token lengths as chunk partitions: 1 vs 2 workers beside the machine's own
2-process ceiling, a run killed at half its chunks then resumed, and 1 % of records appended.

    .venv/bin/python bench/length_chunks.py [--records 200000] [--repeats 2] [--celery] [--append-only]

Input: the LLaVA-style jsonl of bench/catalog_readers.py (one image per record, 1–3 turns), generated
once. Every measured run is the real CLI, `python -m vlm_assets.cli run --select sample_lengths`, on a
fresh DAGSTER_HOME and storage root: the catalogue, its length chunks (16,384 rows each) and the
assembled table. Side by side, alternating, --repeats times:
  workers 1      `--workers 1`
  workers 2      `--workers 2`: two chunk runs at a time
  celery 2       with --celery: `--executor celery --workers 2 --force` against two Celery workers
                 (bench/scale.py's throwaway PostgreSQL, Redis and workers, started once), the
                 site's outputs removed before each run
  ceiling        two plain processes, each cataloguing one half of the records and measuring its
                 lengths (write_catalog, write_length_table; one process each, no Dagster), against
                 one such process over all the records: the most two processes gain on this
                 machine in these minutes
Then, once, on a fresh home with 2 workers: a run killed (kill -9 of its process group) once half of
the chunks are materialised, and the rerun (its time against the full 2-worker run); and on the
fresh site built with 2 workers, 1 % more records appended to the manifest and the rerun (against
that site's first build; --append-only runs just this).
Per run it prints the seconds spent inside each asset's runs (the Dagster run records).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from catalog_readers import generate  # noqa: E402  (a bench script beside this one)
from scale import celery_cluster, celery_unavailable  # noqa: E402

from vlm_assets.catalog.build import MediaValidator  # noqa: E402
from vlm_assets.catalog.table import write_catalog  # noqa: E402
from vlm_assets.config import FrameCacheConfig, ModelConfig, SourceConfig  # noqa: E402
from vlm_assets.tokens.table import write_length_table  # noqa: E402

CHUNK = dg.AssetKey("sample_length_chunk")


def site(scratch: Path, manifest: Path, name: str) -> tuple[Path, Path]:
    folder = scratch / name
    folder.mkdir()
    config = folder / "vlm_assets.yaml"
    config.write_text(yaml.safe_dump({
        "storage": {"root": str(folder / "vlm_data")},
        "sources": [{"name": "big", "kind": "jsonl", "path": str(manifest), "media_root": str(manifest.parent)}],
    }))
    return config, folder / "home"


def start(config: Path, home: Path, workers: int, celery: bool = False) -> subprocess.Popen:
    celery_options = ["--executor", "celery", "--force"] if celery else []
    return subprocess.Popen(
        [sys.executable, "-m", "vlm_assets.cli", "run", "--config", str(config), "--select", "sample_lengths",
         "--workers", str(workers), *celery_options],
        env={**os.environ, "DAGSTER_HOME": str(home)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)


def timed_run(config: Path, home: Path, workers: int, celery: bool = False) -> float:
    began = time.perf_counter()
    process = start(config, home, workers, celery)
    output, _ = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"run failed:\n{output[-3000:]}")
    return time.perf_counter() - began


def seconds_by_asset(home: Path, since: float = 0.0) -> str:
    """Seconds inside each asset's runs that started at `since` or later (summed over runs side by side)."""
    spent: dict[str, float] = {}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        for record in instance.get_run_records():
            asset = record.dagster_run.tags.get("vlm_assets/asset", "?")
            if record.start_time and record.end_time and record.start_time >= since:
                spent[asset] = spent.get(asset, 0.0) + record.end_time - record.start_time
    return ", ".join(f"{asset} {seconds:.0f} s" for asset, seconds in sorted(spent.items()))


def chunks_done(home: Path) -> int:
    if not (home / "dagster.yaml").exists():
        return 0
    with dg.DagsterInstance.from_config(str(home)) as instance:
        return len(instance.fetch_materializations(CHUNK, limit=10_000).records)


def one_process(manifest: Path) -> None:
    """A ceiling process: catalogue and lengths of one jsonl, in this process alone."""
    source = SourceConfig(manifest.stem, "jsonl", manifest, manifest.parent)
    with tempfile.TemporaryDirectory() as scratch:
        catalog = Path(scratch) / "catalog.parquet"
        write_catalog(source, catalog, "messages", MediaValidator(), 1)
        write_length_table(catalog, Path(scratch) / "lengths.parquet", ModelConfig(), FrameCacheConfig())


def plain(*manifests: Path) -> float:
    began = time.perf_counter()
    processes = [subprocess.Popen([sys.executable, __file__, "--one-process", str(path)]) for path in manifests]
    if any(process.wait() != 0 for process in processes):
        raise SystemExit("a ceiling process failed")
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--celery", action="store_true", help="also 2 Celery workers (needs redis-server and PostgreSQL)")
    parser.add_argument("--append-only", action="store_true", help="only the 1 %% append, against its own first build")
    parser.add_argument("--one-process", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_process:
        one_process(args.one_process)
        return
    folder = generate(args.records)
    manifest = folder / "train.jsonl"
    times: dict[str, list[float]] = {"workers 1": [], "workers 2": [], "plain 1": [], "plain 2 (halves)": []}
    with tempfile.TemporaryDirectory() as scratch_name, contextlib.ExitStack() as cluster:
        scratch = Path(scratch_name)
        celery_site, celery_env = None, {}
        if args.celery and not args.append_only:
            if (missing := celery_unavailable()) is not None:
                raise SystemExit(f"--celery: {missing}")
            celery_site = site(scratch, manifest, "celery")
            celery_env = cluster.enter_context(celery_cluster(celery_site[0].parent))
            times["celery 2"] = []
        for round_number in range(0 if args.append_only else args.repeats):
            for workers in (1, 2):
                config, home = site(scratch, manifest, f"round{round_number}-workers{workers}")
                times[f"workers {workers}"].append(timed_run(config, home, workers))
                print(f"round {round_number + 1}, workers {workers}: {times[f'workers {workers}'][-1]:.1f} s "
                      f"({seconds_by_asset(home)})", flush=True)
            if celery_site is not None:
                config, home = celery_site
                shutil.rmtree(config.parent / "vlm_data", ignore_errors=True)
                since = time.time()
                # The cluster's PostgreSQL instance is named by environment variables, for the run and for
                # this process reading its records; only there: the in-process sites keep instances of their own.
                with environment_with(celery_env):
                    times["celery 2"].append(timed_run(config, home, 2, celery=True))
                    print(f"round {round_number + 1}, Celery, 2 workers: {times['celery 2'][-1]:.1f} s "
                          f"({seconds_by_asset(home, since)})", flush=True)
            times["plain 1"].append(plain(manifest))
            times["plain 2 (halves)"].append(plain(folder / "first_half.jsonl", folder / "second_half.jsonl"))
            print(f"round {round_number + 1}, ceiling: one process {times['plain 1'][-1]:.1f} s, "
                  f"two halves side by side {times['plain 2 (halves)'][-1]:.1f} s", flush=True)
        cluster.close()
        if not args.append_only:
            median = workers_and_kill(args, scratch, manifest, times)
        append_phase(args, scratch, folder, manifest, None if args.append_only else median["workers 2"])


@contextlib.contextmanager
def environment_with(variables: dict[str, str]) -> Iterator[None]:
    """`variables` set in this process's environment while inside, the environment as before after."""
    saved = dict(os.environ)
    os.environ.update(variables)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def workers_and_kill(args, scratch: Path, manifest: Path, times: dict[str, list[float]]) -> dict[str, float]:
    """The medians of the rounds, then a run killed at half its chunks and resumed."""
    median = {name: statistics.median(values) for name, values in times.items()}
    ours, ceiling = median["workers 1"] / median["workers 2"], median["plain 1"] / median["plain 2 (halves)"]
    print(f"\n{args.records:,} records, medians of {args.repeats}: workers 1 {median['workers 1']:.1f} s, "
          f"workers 2 {median['workers 2']:.1f} s: {ours:.2f}×; machine ceiling {ceiling:.2f}× "
          f"(plain {median['plain 1']:.1f} s vs {median['plain 2 (halves)']:.1f} s): {ours / ceiling:.0%} of it "
          "(target ≥ 90 %)")
    if "celery 2" in median:
        celery = median["workers 1"] / median["celery 2"]
        print(f"Celery, 2 workers: {median['celery 2']:.1f} s: {celery:.2f}× one in-process worker, "
              f"{celery / ceiling:.0%} of the machine ceiling (target ≥ 80 %)")

    config, home = site(scratch, manifest, "killed")
    process = start(config, home, 2)
    total = None
    while process.poll() is None:
        plan = Path(yaml.safe_load(config.read_text())["storage"]["root"]) / "catalog" / "big.chunks.json"
        if total is None and plan.exists():
            total = len(yaml.safe_load(plan.read_text())["digests"])
        if total and chunks_done(home) >= total // 2:
            os.killpg(process.pid, signal.SIGKILL)
            break
        time.sleep(0.5)
    process.wait()
    done = chunks_done(home)
    since = time.time()
    resumed = timed_run(config, home, 2)
    print(f"killed at {done} of {total} chunks; the rerun took {resumed:.1f} s, "
          f"{resumed / median['workers 2']:.0%} of a full 2-worker run ({seconds_by_asset(home, since)})")
    return median


def append_phase(args, scratch: Path, folder: Path, manifest: Path, full_run: float | None) -> None:
    """A fresh site built with 2 workers, then 1 % more records appended and the rerun."""
    appended = max(1, args.records // 100)
    lines = manifest.read_text().splitlines(keepends=True)[:appended]
    grown = scratch / "grown" / "train.jsonl"
    grown.parent.mkdir()
    for image in folder.glob("*.jpg"):  # copies: a symlink out of the source's folder is refused
        shutil.copyfile(image, grown.parent / image.name)
    grown.write_text(manifest.read_text())
    config, home = site(scratch, grown, "appended")
    first = timed_run(config, home, 2)
    with grown.open("a") as handle:
        handle.writelines(line.replace('"id": "s', '"id": "more') for line in lines)
    since = time.time()
    again = timed_run(config, home, 2)
    against = f", {again / full_run:.0%} of the 2-worker run above" if full_run else ""
    print(f"{appended:,} records appended (1 %): the rerun took {again:.1f} s, {again / first:.0%} of this "
          f"site's first build ({first:.1f} s){against} ({seconds_by_asset(home, since)})")


if __name__ == "__main__":
    main()
